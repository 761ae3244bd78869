//! The HTTP listener: `/metrics` (Prometheus text format), `/health/live`, `/health/ready`,
//! and the operator console at `/` (see `console`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox::CancellationToken;

mod listener;

use listener::Limits;

use crate::Failure;
use crate::config::Observability;
use crate::relay::Relay;

/// How long a health check waits for each storage and sink.
const READY_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the health checks behind `/health/ready` run: a probe reads their last result,
/// so probes cost no I/O however often they come.
const READY_INTERVAL: Duration = Duration::from_secs(5);
/// Runs of a relay's worker that may fail in a row (each restarted after 1 s, 2 s, …) before
/// `/health/ready` says so: a database that answers its health check but refuses every
/// claim (a grant taken away, a row it cannot read) is not ready.
const RUN_FAILURES_NOT_READY: u32 = 3;

/// Installs the Prometheus recorder that the worker's metrics go to.
pub fn install_metrics() -> Result<PrometheusHandle, Failure> {
    const LATENCY_BUCKETS: [f64; 12] = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
    ];
    PrometheusBuilder::new()
        .set_buckets(&LATENCY_BUCKETS)
        .map_err(|e| Failure::Runtime(format!("metrics: {e}")))?
        .install_recorder()
        .map_err(|e| Failure::Runtime(format!("cannot install the metrics recorder: {e}")))
}

/// What `/health/ready` answers: the last health checks of each relay, or that the relays
/// are still being built. The console reads the relays and their checks from here too.
#[derive(Clone)]
pub struct Readiness {
    checks: Arc<std::sync::RwLock<Option<Vec<RelayHealth>>>>,
    relays: Arc<std::sync::OnceLock<Arc<Vec<Relay>>>>,
}

/// The last health check of one relay: what is wrong with its storage and its sink, if any.
#[derive(Clone, Debug)]
pub struct RelayHealth {
    /// The relay's name.
    pub relay: String,
    /// What is wrong with its storage; none when it answered.
    pub storage: Option<String>,
    /// What is wrong with its sink; none when it answered.
    pub sink: Option<String>,
    /// When the check ended.
    pub checked_at: chrono::DateTime<chrono::Utc>,
}

impl Readiness {
    /// Not ready: the relays are being built.
    pub fn starting() -> Self {
        Readiness {
            checks: Arc::new(std::sync::RwLock::new(None)),
            relays: Arc::new(std::sync::OnceLock::new()),
        }
    }

    /// Checks every relay's storage and sink now and every [`READY_INTERVAL`] until
    /// shutdown, keeping the last result for the probes.
    pub async fn watch(self, relays: Arc<Vec<Relay>>, shutdown: CancellationToken) {
        let _ = self.relays.set(relays.clone());
        loop {
            let checks = check(&relays).await;
            *self.checks.write().unwrap_or_else(|e| e.into_inner()) = Some(checks);
            tokio::select! {
                () = tokio::time::sleep(READY_INTERVAL) => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// The relays of this process, once built.
    pub fn relays(&self) -> Option<Arc<Vec<Relay>>> {
        self.relays.get().cloned()
    }

    /// The last health checks, once the relays are built.
    pub fn checks(&self) -> Option<Vec<RelayHealth>> {
        self.checks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn answer(&self) -> (StatusCode, String) {
        let Some(checks) = self.checks() else {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "starting: building the storages and sinks\n".into(),
            );
        };
        let problems: Vec<String> = checks
            .iter()
            .flat_map(|c| {
                let storage = c
                    .storage
                    .as_ref()
                    .map(|e| format!("relay {}: storage: {e}", c.relay));
                let sink = c
                    .sink
                    .as_ref()
                    .map(|e| format!("relay {}: sink: {e}", c.relay));
                storage.into_iter().chain(sink)
            })
            .chain(self.relays().iter().flat_map(|relays| {
                relays.iter().filter_map(|relay| {
                    let failed = relay.runs.failures_in_a_row();
                    (failed >= RUN_FAILURES_NOT_READY).then(|| {
                        let last = relay
                            .runs
                            .last_failure()
                            .map_or(String::new(), |(_, error)| format!(": {error}"));
                        format!(
                            "relay {}: its last {failed} runs failed{last}",
                            relay.def.name
                        )
                    })
                })
            }))
            .collect();
        if problems.is_empty() {
            (StatusCode::OK, "ready\n".into())
        } else {
            (StatusCode::SERVICE_UNAVAILABLE, problems.join("\n") + "\n")
        }
    }
}

#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    readiness: Readiness,
}

/// Binds `addr` now (so a taken port is an error at start-up) and serves until shutdown:
/// `/health/live` answers from here on, before any storage or sink is built.
/// The console, when `observability` turns it on, is served too.
pub async fn serve(
    addr: SocketAddr,
    observability: &Observability,
    metrics: PrometheusHandle,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<(), Failure> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Failure::Config(format!(
            "observability.listen: cannot listen on {addr}: {e}"
        ))
    })?;
    let console = crate::console::router(readiness.clone(), observability);
    let mut app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/health/live", get(|| async { "live\n" }))
        .route("/health/ready", get(ready))
        .with_state(AppState { metrics, readiness });
    match console {
        Some(console) => {
            app = app.merge(console);
            tracing::info!(%addr, "serving /metrics, /health and the console at /");
        }
        None => tracing::info!(%addr, "serving /metrics and /health"),
    }
    if addr.ip().is_loopback() {
        app = app.layer(axum::middleware::from_fn(loopback_host_only));
    }
    // Each request carries the client's address: the console logs who acted.
    tokio::spawn(listener::serve(listener, app, Limits::DEFAULT, shutdown));
    Ok(())
}

/// Whether the `Host` header names this machine's loopback (`localhost`, `127.0.0.1`,
/// `[::1]`, with or without a numeric port): a page served without a token is only for local
/// clients, and a foreign name there is a DNS-rebinding attempt. Anything else is refused:
/// two `Host` headers, a port that is not a number, text after a bracketed address.
pub fn loopback_host(headers: &axum::http::HeaderMap) -> bool {
    let mut hosts = headers.get_all(axum::http::header::HOST).iter();
    let (Some(host), None) = (hosts.next(), hosts.next()) else {
        return false;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((name, after)) => match after {
                "" => (name, None),
                _ => match after.strip_prefix(':') {
                    Some(port) => (name, Some(port)),
                    None => return false,
                },
            },
            None => return false,
        },
        None => match host.split_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        },
    };
    let port_ok =
        port.is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    port_ok
        && (name.eq_ignore_ascii_case("localhost")
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback()))
}

/// On a loopback listener every route, the probes and `/metrics` too, answers only a `Host`
/// that names loopback (or none, as plain HTTP/1.0 tools send): a page of another site that
/// rebinds its name to 127.0.0.1 must not read topic names, volumes or error texts.
async fn loopback_host_only(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let headers = request.headers();
    if headers.contains_key(axum::http::header::HOST) && !loopback_host(headers) {
        return (
            StatusCode::FORBIDDEN,
            "this listener is on loopback: the Host header must name loopback \
             (localhost, 127.0.0.1, [::1])\n",
        )
            .into_response();
    }
    next.run(request).await
}

async fn render_metrics(State(state): State<AppState>) -> String {
    state.metrics.render()
}

/// Ready once the relays are built, the last health checks found every storage and sink
/// answering, and no relay's runs have failed [`RUN_FAILURES_NOT_READY`] times in a row.
async fn ready(State(state): State<AppState>) -> (StatusCode, String) {
    state.readiness.answer()
}

/// The health checks of every relay's storage and sink: what is wrong with each, if any.
async fn check(relays: &[Relay]) -> Vec<RelayHealth> {
    let mut checks = Vec::new();
    for relay in relays {
        let storage = match tokio::time::timeout(READY_TIMEOUT, relay.storage.health()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {READY_TIMEOUT:?}")),
        };
        let sink = match tokio::time::timeout(READY_TIMEOUT, relay.sink.health()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {READY_TIMEOUT:?}")),
        };
        checks.push(RelayHealth {
            relay: relay.def.name.clone(),
            storage,
            sink,
            checked_at: chrono::Utc::now(),
        });
    }
    checks
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue, header::HOST};

    fn hosts(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(HOST, HeaderValue::from_str(value).expect("a header value"));
        }
        headers
    }

    #[test]
    fn only_a_single_loopback_host_with_a_numeric_port_passes() {
        for good in [
            "localhost",
            "LocalHost:9187",
            "127.0.0.1",
            "127.0.0.1:9187",
            "127.1.2.3:1",
            "[::1]",
            "[::1]:9187",
        ] {
            assert!(loopback_host(&hosts(&[good])), "{good}");
        }
        for bad in [
            "localhost:evil.example",
            "[::1]evil.example",
            "[::1",
            "localhost:",
            "localhost:123456",
            "127.0.0.1:80:80",
            "evil.example",
            "localhost.evil.example",
            "10.0.0.1:9187",
            "::1",
        ] {
            assert!(!loopback_host(&hosts(&[bad])), "{bad}");
        }
        assert!(!loopback_host(&hosts(&[])), "no Host");
        assert!(
            !loopback_host(&hosts(&["localhost", "evil.example"])),
            "two Host headers"
        );
    }
}
