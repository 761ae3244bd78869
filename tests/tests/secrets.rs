//! "Passwords in URLs never appear in errors or `Debug` output" (docs/configuration.md), for
//! every backend that takes a URL, with passwords as people write them (raw `#`, `/`, `?`,
//! `@`) and as query parameters; no server is needed (closed ports). The binary's side (its
//! logs, its configuration errors) is tests/cli/secrets.rs.

use std::time::Duration;

use outbox_core::{Message, NewMessage, Storage};
use outbox_tests::unique_name;

use outbox_core::{Sink, Template};

/// The secret every URL below carries; it must never be printed.
const SECRET: &str = "Zq8uSecretPw";

/// Passwords as they end up in URLs: plain, and raw with a character that ends a URL's
/// authority (`#`, `/`, `?`) or is its own delimiter (`@`), as people paste them.
fn passwords() -> Vec<String> {
    ["", "x#", "x/", "x?", "x@"]
        .iter()
        .map(|prefix| format!("{prefix}{SECRET}"))
        .collect()
}

/// Notes where the secret showed, if it did.
fn assert_hidden(leaks: &mut Vec<String>, url: &str, what: &str, printed: &str) {
    if printed.contains(SECRET) {
        leaks.push(format!("{url}\n    {what}: {printed}"));
    }
}

/// Fails listing every leak found.
fn report(leaks: Vec<String>, backend: &str) {
    assert!(
        leaks.is_empty(),
        "{backend}: the password showed in {} place(s):\n{}",
        leaks.len(),
        leaks.join("\n")
    );
}

/// At most this long for a call against a closed port ("never blocks forever").
const CALL: Duration = Duration::from_secs(30);

/// For each of `urls`, notes where a `backend` that connects lazily shows its secret: in the
/// `Debug` of the config `config_of` makes of it, or in the error of `build` or, built, of
/// its `health` against the closed port (which must fail, and within [`CALL`]); then fails
/// listing every leak ([`report`]).
async fn check_lazy<C: std::fmt::Debug, B, F>(
    backend: &str,
    urls: &[String],
    config_of: impl Fn(&str) -> C,
    build: impl Fn(C) -> outbox_core::Result<B>,
    health: impl Fn(B) -> F,
) where
    F: std::future::Future<Output = outbox_core::Result<()>>,
{
    let mut leaks = Vec::new();
    for url in urls {
        let config = config_of(url);
        assert_hidden(
            &mut leaks,
            url,
            "Debug of the config",
            &format!("{config:?}"),
        );
        let error = match build(config) {
            Err(e) => e,
            Ok(built) => match tokio::time::timeout(CALL, health(built)).await {
                Err(_) => panic!("{url}: health did not return within {CALL:?}"),
                Ok(Ok(())) => panic!("{url}: a closed port answered"),
                Ok(Err(e)) => e,
            },
        };
        assert_hidden(&mut leaks, url, "the error", &error.to_string());
        assert_hidden(&mut leaks, url, "Debug of the error", &format!("{error:?}"));
    }
    report(leaks, backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_passwords_never_appear_in_errors_or_debug() {
    use outbox_postgres::{PgStorage, PostgresConfig};
    let mut urls: Vec<String> = passwords()
        .iter()
        .map(|p| format!("postgres://app:{p}@127.0.0.1:1/test"))
        .collect();
    urls.push(format!("postgres://app@127.0.0.1:1/test?password={SECRET}"));
    urls.push(format!(
        "postgres://app@127.0.0.1:1/test?sslmode=disable&password={SECRET}"
    ));
    let config = |url: &str| PostgresConfig::new(url).table(unique_name("t"), "outbox");
    let health = |s: PgStorage| async move { s.health().await };
    check_lazy("PostgreSQL", &urls, config, PgStorage::new, health).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_passwords_never_appear_in_errors_or_debug() {
    use outbox_mysql::{MySqlConfig, MySqlStorage};
    let urls: Vec<String> = passwords()
        .iter()
        .map(|p| format!("mysql://root:{p}@127.0.0.1:1/test"))
        .collect();
    // docs/storage/mysql.md: "`MySqlStorage::new` only validates and connects lazily".
    MySqlStorage::new(MySqlConfig::new(&urls[0]))
        .expect("a valid URL of a closed port is accepted: connecting is lazy");
    let config = |url: &str| MySqlConfig::new(url).table(unique_name("t"));
    let health = |s: MySqlStorage| async move { s.health().await };
    check_lazy("MySQL", &urls, config, MySqlStorage::new, health).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_passwords_never_appear_in_errors_or_debug() {
    use outbox_redis::{RedisConfig, RedisSink};
    let urls: Vec<String> = passwords()
        .iter()
        .flat_map(|p| {
            [
                format!("redis://:{p}@127.0.0.1:1"),
                format!("redis://user:{p}@127.0.0.1:1/0"),
            ]
        })
        .collect();
    let mut leaks = Vec::new();
    let batch: Vec<Message> = vec![NewMessage::new("t", "m").key("k").into()];
    for url in &urls {
        let config = RedisConfig::new(url).publish_timeout(Duration::from_secs(2));
        assert_hidden(
            &mut leaks,
            url,
            "Debug of the config",
            &format!("{config:?}"),
        );
        match RedisSink::new(config) {
            Err(e) => {
                assert_hidden(&mut leaks, url, "the error", &e.to_string());
                assert_hidden(&mut leaks, url, "Debug of the error", &format!("{e:?}"));
            }
            Ok(sink) => {
                let health = tokio::time::timeout(CALL, sink.health())
                    .await
                    .unwrap_or_else(|_| panic!("{url}: health did not return"));
                let e = health.expect_err("a closed port answered");
                assert_hidden(&mut leaks, url, "the health error", &e.to_string());
                let published = tokio::time::timeout(CALL, sink.publish(&batch))
                    .await
                    .unwrap_or_else(|_| panic!("{url}: publish did not return"));
                assert_hidden(
                    &mut leaks,
                    url,
                    "the publish result",
                    &format!("{published:?}"),
                );
            }
        }
    }
    report(leaks, "Redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_passwords_never_appear_in_errors_or_debug() {
    use outbox_amqp::{AmqpConfig, AmqpSink};
    let urls: Vec<String> = passwords()
        .iter()
        .map(|p| format!("amqp://guest:{p}@127.0.0.1:1/%2f"))
        .collect();
    let config = |url: &str| {
        let exchange = Template::new("events").expect("a template");
        AmqpConfig::new(url, exchange).publish_timeout(Duration::from_secs(2))
    };
    let health = |s: AmqpSink| async move { s.health().await };
    check_lazy("AMQP", &urls, config, AmqpSink::lazy, health).await;
}
