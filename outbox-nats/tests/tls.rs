//! TLS end to end: a NATS server of the test's own (`nats-server` with JetStream, TLS and
//! client verification), certificates made at test time, a sink that trusts the test's CA
//! through `tls_ca_file` and presents a client certificate. A sink that trusts another CA is
//! refused.

use std::path::Path;
use std::time::Duration;

use async_nats::jetstream;
use outbox_core::config::Settings;
use outbox_core::{Message, NewMessage};
use outbox_nats::{NatsConfig, NatsSink};
use outbox_test_support::servers::{self, Server};
use outbox_test_support::tls::{
    Pki, assert_delivers_over_tls, assert_wrong_ca_refused, two_authorities,
};

/// `nats-server` of the test's own with JetStream (its store in `dir`), TLS and client
/// certificates required; not started yet.
fn tls_nats(pki: &Pki, dir: &Path) -> Server {
    servers::nats(dir)
        .args(["--tls", "--tlsverify", "--tlscert"])
        .arg(&pki.server_cert)
        .arg("--tlskey")
        .arg(&pki.server_key)
        .arg("--tlscacert")
        .arg(&pki.ca)
}

fn config(port: u16, trust: &Pki, client: &Pki) -> NatsConfig {
    NatsConfig {
        url: format!("nats://127.0.0.1:{port}"),
        tls_ca_file: Some(trust.ca.clone()),
        tls_cert_file: Some(client.client_cert.clone()),
        tls_key_file: Some(client.client_key.clone()),
        publish_timeout: Duration::from_secs(3),
        ..NatsConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_go_over_verified_tls_and_a_wrong_ca_is_refused() {
    let (dir, ours, theirs) = two_authorities("outbox_nats_tls");
    let mut server = tls_nats(&ours, &dir.join("server"));
    server.start().await;

    // The test's own client, over the same verified TLS, makes the stream.
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(ours.ca.clone())
        .add_client_certificate(ours.client_cert.clone(), ours.client_key.clone())
        .require_tls(true)
        .connect(format!("nats://{}", server.addr()))
        .await
        .expect("the test's client connects over TLS");
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "TLS".into(),
        subjects: vec!["tls.>".into()],
        storage: jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("stream");

    let sink = NatsSink::new(config(server.port(), &ours, &ours)).expect("sink");
    let batch = [Message::from(
        NewMessage::new("tls.orders", "paid").key("k"),
    )];
    assert_delivers_over_tls(&sink, &batch).await;
    let stream = js.get_stream("TLS").await.expect("the stream");
    assert_eq!(stream.cached_info().state.messages, 1);

    // A sink that trusts another CA does not accept the server's certificate.
    let wrong = NatsSink::new(config(server.port(), &theirs, &ours)).expect("sink");
    assert_wrong_ca_refused(&wrong).await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_client_certificate_needs_its_key_and_files_must_be_readable() {
    let half = NatsConfig {
        tls_cert_file: Some("/etc/hostname".into()),
        ..NatsConfig::default()
    };
    let error = half.validate().expect_err("a certificate without its key");
    assert!(error.to_string().contains("tls_key_file"), "{error}");
    let missing = NatsConfig {
        tls_ca_file: Some("/nowhere/ca.pem".into()),
        ..NatsConfig::default()
    };
    let error = missing.validate().expect_err("a missing CA file");
    assert!(
        error.to_string().contains("tls_ca_file") && error.to_string().contains("/nowhere"),
        "{error}"
    );
}
