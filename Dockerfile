# The relay as a container: the `outbox` binary only, run as a non-root user.
#   docker build -t outbox .
#   docker run --rm -v "$PWD/outbox.toml:/etc/outbox/outbox.toml:ro" -p 9187:9187 outbox
# Every storage and sink is compiled in; the configuration picks one (docs/deployment.md).
# There is no container engine on the project's machines: tests/cli/deployment.rs checks the
# build line below against the workspace, and `cargo xtask container-build` runs it as is.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --all-features --bin outbox
# The release profile keeps debug info for profiling; the image does not need it.
RUN strip --strip-debug target/release/outbox

FROM debian:bookworm-slim
# CA roots for TLS to databases and brokers, and OpenSSL for Kafka's TLS (`kafka-ssl`, part
# of --all-features); nothing else is needed at run time.
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin outbox
COPY --from=build /src/target/release/outbox /usr/local/bin/outbox
USER 10001
# The metrics and health listener (set observability.listen = "0.0.0.0:9187").
EXPOSE 9187
ENV OUTBOX_CONFIG=/etc/outbox/outbox.toml
ENTRYPOINT ["/usr/local/bin/outbox"]
CMD ["relay"]
