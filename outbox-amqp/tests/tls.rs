//! TLS end to end: a RabbitMQ node of the test's own (`rabbitmq-server` with a TLS listener
//! only, client certificates required), certificates made at test time, a sink that trusts
//! the test's CA through `tls_ca_file` and presents a client certificate. A sink that trusts
//! another CA, or presents no certificate, is refused.
//!
//! The node has its own name, ports, data, logs, configuration and Erlang cookie, all in a
//! temporary directory: the shared RabbitMQ on 5672 is not touched (the two only share the
//! machine's epmd, where each registers under its own name).

use std::path::Path;
use std::time::{Duration, Instant};

use outbox_amqp::lapin::options::{BasicGetOptions, QueueDeclareOptions};
use outbox_amqp::lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use outbox_amqp::lapin::types::FieldTable;
use outbox_amqp::lapin::{Connect, ConnectionProperties, runtime};
use outbox_amqp::{AmqpConfig, AmqpSink};
use outbox_core::{ErrorKind, Message, NewMessage, Template};
use outbox_test_support::servers::{self, Server};
use outbox_test_support::tls::{Pki, assert_delivers_over_tls, pki, two_authorities};
use outbox_test_support::unique_name;

/// A RabbitMQ node of the test's own (`servers::rabbitmq`: its own name, ports, data, logs,
/// configuration and cookie in `dir`) with a TLS listener only, client certificates
/// required; not started yet. It stops cleanly when dropped.
fn tls_rabbit(pki: &Pki, dir: &Path) -> Server {
    servers::rabbitmq(dir, |port| {
        format!(
            "listeners.tcp = none\n\
             listeners.ssl.default = 127.0.0.1:{port}\n\
             ssl_options.cacertfile = {}\n\
             ssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = true\n",
            pki.ca.display(),
            pki.server_cert.display(),
            pki.server_key.display(),
        )
    })
}

/// TLS settings trusting `trust`'s CA, presenting `client`'s certificate if given.
fn tls_config(trust: &Pki, client: Option<&Pki>) -> OwnedTLSConfig {
    let read = |path: &Path| std::fs::read(path).expect("read a PEM file");
    OwnedTLSConfig {
        identity: client.map(|client| OwnedIdentity::PKCS8 {
            pem: read(&client.client_cert),
            key: read(&client.client_key),
        }),
        cert_chain: Some(String::from_utf8(read(&trust.ca)).expect("PEM text")),
    }
}

/// The sink's settings: the node's TLS port, trusting `trust`'s CA, with `client`'s
/// certificate if given; messages go to the queue named by their topic.
fn config(port: u16, trust: &Pki, client: Option<&Pki>) -> AmqpConfig {
    AmqpConfig {
        url: format!("amqps://guest:guest@127.0.0.1:{port}/%2f"),
        tls_ca_file: Some(trust.ca.clone()),
        tls_cert_file: client.map(|c| c.client_cert.clone()),
        tls_key_file: client.map(|c| c.client_key.clone()),
        // The broker's default exchange: the routing key (the topic) names the queue.
        exchange: Some(Template::new("").expect("a template")),
        connect_timeout: Duration::from_secs(10),
        ..AmqpConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_go_over_verified_tls_and_a_wrong_ca_is_refused() {
    let started = Instant::now();
    let (dir, ours, theirs) = two_authorities("outbox_amqp_tls");
    let mut node = tls_rabbit(&ours, &dir.join("node"));
    let took = node.start().await;
    eprintln!(
        "RabbitMQ node took {took:.1?} to open TLS port {}",
        node.port()
    );
    let url = format!("amqps://guest:guest@{}/%2f", node.addr());

    // The test's own client, over the same verified TLS, makes the queue and reads it.
    let connection = url
        .as_str()
        .connect_with_config(
            ConnectionProperties::default(),
            tls_config(&ours, Some(&ours)),
            runtime::default_runtime().expect("tokio"),
        )
        .await
        .expect("the test's client connects over TLS");
    let channel = connection.create_channel().await.expect("channel");
    let queue = "tls-orders";
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare the queue");

    let sink = AmqpSink::connect(config(node.port(), &ours, Some(&ours)))
        .await
        .expect("the sink connects over verified TLS");
    let batch: Vec<Message> = (0..3)
        .map(|i| Message::from(NewMessage::new(queue, format!("paid {i}")).key("k")))
        .collect();
    assert_delivers_over_tls(&sink, &batch).await;
    sink.close().await;

    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < batch.len() && Instant::now() < deadline {
        match channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get")
        {
            Some(message) => got.push(message.delivery),
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(got.len(), batch.len(), "every message arrives");
    for (delivery, sent) in got.iter().zip(&batch) {
        assert_eq!(delivery.data, sent.payload);
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str());
        assert_eq!(id, Some(sent.id.to_string().as_str()));
    }

    // A sink that trusts another CA does not accept the broker's certificate.
    let error = AmqpSink::connect(config(node.port(), &theirs, Some(&ours)))
        .await
        .expect_err("the broker's certificate must be refused");
    eprintln!("a sink trusting another CA: {error}");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let message = error.to_string();
    assert!(
        message.contains("cannot connect to the AMQP broker") && message.contains("certificate"),
        "{message}"
    );
    // The broker refuses a sink that presents no client certificate.
    let error = AmqpSink::connect(config(node.port(), &ours, None))
        .await
        .expect_err("a client without a certificate must be refused");
    eprintln!("a sink without a client certificate: {error}");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");

    drop(connection);
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("TLS test took {:.1?}", started.elapsed());
}

#[test]
fn tls_files_are_read_and_checked_when_the_sink_is_made() {
    let dir = std::env::temp_dir().join(unique_name("outbox_amqp_tls_files"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ours = pki(&dir, "ours");
    let sink = |ca: &Path, cert: &Path, key: &Path| {
        AmqpSink::lazy(AmqpConfig {
            tls_ca_file: Some(ca.into()),
            tls_cert_file: Some(cert.into()),
            tls_key_file: Some(key.into()),
            ..config(5671, &ours, None)
        })
    };
    sink(&ours.ca, &ours.client_cert, &ours.client_key).expect("good PEM files");

    // The message of the configuration error the files make.
    let refused = |ca: &Path, cert: &Path, key: &Path| {
        let error = sink(ca, cert, key).expect_err("bad PEM files");
        assert_eq!(error.kind(), ErrorKind::Config, "{error}");
        error.in_section("sink").to_string()
    };
    // A key is not a CA certificate.
    let message = refused(&ours.client_key, &ours.client_cert, &ours.client_key);
    let expected = format!(
        "sink.tls_ca_file `{}` holds no certificate",
        ours.client_key.display()
    );
    assert!(message.contains(&expected), "{message}");
    // A certificate is not a key.
    let message = refused(&ours.ca, &ours.client_cert, &ours.client_cert);
    let expected = format!(
        "sink.tls_key_file `{}` holds no usable private key",
        ours.client_cert.display()
    );
    assert!(message.contains(&expected), "{message}");
    let binary = dir.join("binary.der");
    std::fs::write(&binary, [0xff, 0xfe, 0x00]).expect("write");
    let message = refused(&ours.ca, &binary, &ours.client_key);
    assert!(
        message.contains("sink.tls_cert_file") && message.contains("binary.der"),
        "not PEM: {message}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
