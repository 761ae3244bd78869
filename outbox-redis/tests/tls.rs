//! TLS end to end: a Redis server of the test's own (`redis-server` with a TLS port only),
//! certificates made at test time, a sink that trusts the test's CA through `tls_ca_file`
//! and presents a client certificate. A sink that trusts another CA is refused.

use std::path::Path;
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Message, NewMessage};
use outbox_redis::{RedisConfig, RedisSink};
use outbox_test_support::servers::Server;
use outbox_test_support::tls::{
    Pki, assert_delivers_over_tls, assert_wrong_ca_refused, two_authorities,
};

/// `redis-server` of the test's own, listening with TLS only, client certificates required;
/// not started yet.
fn tls_redis(pki: &Pki, dir: &Path) -> Server {
    let server = Server::new("redis-server", dir);
    let port = server.port().to_string();
    server
        .args([
            "--port",
            "0",
            "--tls-port",
            port.as_str(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--tls-auth-clients",
            "yes",
        ])
        .arg("--dir")
        .arg(dir)
        .arg("--tls-cert-file")
        .arg(&pki.server_cert)
        .arg("--tls-key-file")
        .arg(&pki.server_key)
        .arg("--tls-ca-cert-file")
        .arg(&pki.ca)
}

fn config(port: u16, trust: &Pki, client: &Pki) -> RedisConfig {
    RedisConfig {
        url: format!("rediss://127.0.0.1:{port}"),
        tls_ca_file: Some(trust.ca.clone()),
        tls_cert_file: Some(client.client_cert.clone()),
        tls_key_file: Some(client.client_key.clone()),
        publish_timeout: Duration::from_secs(3),
        ..RedisConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_go_over_verified_tls_and_a_wrong_ca_is_refused() {
    let (dir, ours, theirs) = two_authorities("outbox_redis_tls");
    let mut server = tls_redis(&ours, &dir);
    server.start().await;

    let sink = RedisSink::new(config(server.port(), &ours, &ours)).expect("sink");
    let batch = [Message::from(
        NewMessage::new("tls-orders", "paid").key("k"),
    )];
    assert_delivers_over_tls(&sink, &batch).await;

    // A sink that trusts another CA does not accept the server's certificate.
    let wrong = RedisSink::new(config(server.port(), &theirs, &ours)).expect("sink");
    assert_wrong_ca_refused(&wrong).await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tls_files_need_a_tls_url_and_go_in_pairs() {
    let config = |url: &str, ca: Option<&str>, cert: Option<&str>| RedisConfig {
        url: url.into(),
        tls_ca_file: ca.map(Into::into),
        tls_cert_file: cert.map(Into::into),
        ..RedisConfig::default()
    };
    for (config, what, needles) in [
        (
            config("redis://127.0.0.1:6379", Some("/etc/hostname"), None),
            "a CA file on a plain URL",
            &["tls_ca_file", "rediss://"][..],
        ),
        (
            config("rediss://127.0.0.1:6379", None, Some("/etc/hostname")),
            "a certificate without its key",
            &["tls_key_file"],
        ),
        (
            config("rediss://127.0.0.1:6379", Some("/nowhere/ca.pem"), None),
            "a missing CA file",
            &["/nowhere/ca.pem"],
        ),
    ] {
        let error = config.validate().expect_err(what);
        let text = error.to_string();
        assert!(needles.iter().all(|n| text.contains(n)), "{what}: {error}");
    }
}
