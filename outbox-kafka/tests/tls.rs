//! TLS and SASL_SSL end to end, with certificates made at test time.
//!
//! tansu 0.6 has no TLS listener (its `--cert` and `--key` options are read but never
//! applied), so each test runs a tansu of its own that advertises a TLS-terminating proxy in
//! front of it: every connection a Kafka client makes (bootstrap, then the advertised
//! broker) goes through the proxy, which requires and verifies a client certificate. The
//! test's own admin client and consumer use the same verified TLS.
//!
//! Compiled with the `ssl` feature only (`cargo xtask test` builds the workspace with
//! `--all-features`).
#![cfg(feature = "ssl")]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink};
use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::message::{Headers, Message as _};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_kafka::{KafkaConfig, KafkaSink};
use outbox_test_support::kafka::tansu_binary;
use outbox_test_support::tls::{Pki, assert_delivers_over_tls, pki, two_authorities};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig, crypto};

/// SASL credentials, which tansu 0.6 refuses (see the SASL_SSL test).
const USER: &str = "relay";
const PASSWORD: &str = "relay-secret";

/// A tansu of the test's own behind a TLS proxy that requires client certificates; both
/// stop on drop.
struct TlsKafka {
    /// `127.0.0.1:<proxy port>`: the only address clients are given or told.
    brokers: String,
    /// TLS handshakes the proxy completed, and those that failed.
    verified: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
    proxy: tokio::task::JoinHandle<()>,
    _tansu: tokio::process::Child,
}

impl Drop for TlsKafka {
    fn drop(&mut self) {
        self.proxy.abort();
        // `_tansu` is killed on drop (kill_on_drop).
    }
}

impl TlsKafka {
    /// Starts tansu (with SASL required when `sasl`) on a free port, advertising the
    /// proxy's port, and the proxy, which presents `pki`'s server certificate and accepts
    /// clients whose certificate `pki`'s CA signed.
    async fn start(pki: &Pki, dir: &Path, sasl: bool) -> TlsKafka {
        let proxy_listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy port");
        let proxy_addr = proxy_listener.local_addr().expect("proxy address");
        let tansu_addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port for tansu");

        let binary = tansu_binary();
        let log = dir.join("tansu.log");
        let out = std::fs::File::create(&log).expect("tansu log");
        let err = out.try_clone().expect("tansu log");
        let mut command = tokio::process::Command::new(&binary);
        command
            .args(["broker", "--listener-url", &format!("tcp://{tansu_addr}")])
            .args(["--advertised-listener-url", &format!("tcp://{proxy_addr}")])
            .args(["--storage-engine", "memory://tansu/"]);
        if sasl {
            command.arg("--authentication");
        }
        let tansu = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "tansu must be installed (`cargo xtask services` installs it): {}: {e}",
                    binary.display()
                )
            });
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(tansu_addr).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "tansu did not listen on {tansu_addr} within 20 s; see {}",
                log.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        let acceptor = TlsAcceptor::from(Arc::new(server_config(pki)));
        let verified = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let proxy = tokio::spawn(proxy(
            proxy_listener,
            acceptor,
            tansu_addr,
            verified.clone(),
            refused.clone(),
        ));
        TlsKafka {
            brokers: proxy_addr.to_string(),
            verified,
            refused,
            proxy,
            _tansu: tansu,
        }
    }
}

/// The proxy's TLS: `pki`'s server certificate; a client certificate signed by its CA is
/// required.
fn server_config(pki: &Pki) -> ServerConfig {
    let provider = Arc::new(crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&pki.ca).expect("CA file") {
        roots.add(cert.expect("CA certificate")).expect("a CA");
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .expect("client verifier");
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&pki.server_cert)
        .expect("server certificate file")
        .collect::<Result<_, _>>()
        .expect("server certificate");
    let key = PrivateKeyDer::from_pem_file(&pki.server_key).expect("server key");
    ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .expect("server TLS config")
}

/// Accepts TLS connections and pipes each, decrypted, to tansu at `upstream`.
async fn proxy(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    upstream: SocketAddr,
    verified: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
) {
    while let Ok((client, _)) = listener.accept().await {
        let acceptor = acceptor.clone();
        let (verified, refused) = (verified.clone(), refused.clone());
        tokio::spawn(async move {
            // A failed handshake (the client refused our certificate, or brought none the
            // CA signed) closes the connection: nothing reaches tansu.
            let Ok(mut tls) = acceptor.accept(client).await else {
                refused.fetch_add(1, Ordering::SeqCst);
                return;
            };
            verified.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut server) = TcpStream::connect(upstream).await {
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
            }
        });
    }
}

/// librdkafka settings for the test's own clients: TLS trusting `pki`'s CA, with its client
/// certificate.
fn client(brokers: &str, pki: &Pki) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("security.protocol", "ssl")
        .set("ssl.ca.location", pki.ca.display().to_string())
        .set(
            "ssl.certificate.location",
            pki.client_cert.display().to_string(),
        )
        .set("ssl.key.location", pki.client_key.display().to_string());
    config
}

/// Creates `topic` (one partition) through the TLS proxy.
async fn create_topic(config: &ClientConfig, topic: &str) {
    let admin: AdminClient<DefaultClientContext> = config.create().expect("admin client");
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = tokio::time::timeout(
        Duration::from_secs(20),
        admin.create_topics([&new], &options),
    )
    .await
    .unwrap_or_else(|_| panic!("creating {topic} over TLS timed out"))
    .unwrap_or_else(|e| panic!("creating {topic} over TLS: {e}"));
    for result in results {
        result.unwrap_or_else(|(_, code)| panic!("creating {topic} over TLS: {code:?}"));
    }
}

/// Reads partition 0 of `topic` through the TLS proxy until `count` records came (and half a
/// second more), as (key, payload, `outbox-id` header); panics when fewer came within 20 s.
async fn consume(
    config: &ClientConfig,
    topic: &str,
    count: usize,
) -> Vec<(String, String, String)> {
    let mut config = config.clone();
    config
        .set("group.id", format!("outbox-test-{topic}"))
        .set("enable.auto.commit", "false");
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = config.create().expect("consumer");
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(&topic, 0, Offset::Beginning)
            .expect("assignment");
        consumer.assign(&assignment).expect("assign");
        let deadline = Instant::now() + Duration::from_secs(20);
        // Once `count` came, half a second more, to catch any record too many.
        let mut settle: Option<Instant> = None;
        let mut records = Vec::new();
        while settle.is_none_or(|t| Instant::now() < t) && Instant::now() < deadline {
            if records.len() >= count && settle.is_none() {
                settle = Some(Instant::now() + Duration::from_millis(500));
            }
            let Some(message) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = message.unwrap_or_else(|e| panic!("consuming {topic} over TLS: {e}"));
            let text = |bytes: Option<&[u8]>| {
                String::from_utf8_lossy(bytes.unwrap_or_default()).into_owned()
            };
            let id = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == outbox_kafka::wire::ID))
                .map(|h| text(h.value))
                .unwrap_or_default();
            records.push((text(m.key()), text(m.payload()), id));
        }
        assert!(
            records.len() >= count,
            "{} of {count} records of {topic} read back over TLS within 20 s",
            records.len()
        );
        records
    })
    .await
    .expect("consumer task")
}

/// The sink's settings: brokers through the proxy, trusting `trust`'s CA, presenting
/// `client`'s certificate when given.
fn sink_config(brokers: &str, trust: &Pki, client: Option<&Pki>) -> KafkaConfig {
    KafkaConfig {
        tls_ca_file: Some(trust.ca.clone()),
        tls_cert_file: client.map(|p| p.client_cert.clone()),
        tls_key_file: client.map(|p| p.client_key.clone()),
        publish_timeout: Duration::from_secs(5),
        health_timeout: Duration::from_secs(5),
        ..KafkaConfig::new(brokers)
    }
}

/// Three keyed messages for `topic`.
fn batch(topic: &str) -> Vec<Message> {
    (0..3)
        .map(|i| Message::from(NewMessage::new(topic, format!("paid-{i}")).key(format!("k{i}"))))
        .collect()
}

/// A sink with `config` (and short time-outs) cannot reach the brokers: a publish fails
/// `Unavailable` within its time-out, not a hang, and the error says why in librdkafka's
/// words (`why`); so does the health check. Returns the publish error's text.
async fn assert_refused(config: KafkaConfig, topic: &str, why: &str) -> String {
    let sink = KafkaSink::new(KafkaConfig {
        publish_timeout: Duration::from_secs(2),
        health_timeout: Duration::from_secs(2),
        ..config
    })
    .expect("sink");
    let started = Instant::now();
    let outcomes = sink
        .publish(&batch(topic)[..1])
        .await
        .expect("publish returns outcomes");
    let [Outcome::Failed(error)] = outcomes.as_slice() else {
        panic!("the message must not be delivered: {outcomes:?}");
    };
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let text = error.to_string();
    assert!(
        text.contains("last broker error") && text.contains(why),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused within publish_timeout, not a hang: {:?}",
        started.elapsed()
    );
    let error = sink.health().await.expect_err("health must fail");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.to_string().contains(why), "{error}");
    text
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(outbox_test_support::unique_name(name));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_go_over_verified_tls_and_a_wrong_ca_or_no_client_certificate_is_refused() {
    let (dir, ours, theirs) = two_authorities("outbox_kafka_tls");
    let kafka = TlsKafka::start(&ours, &dir, false).await;
    let clients = client(&kafka.brokers, &ours);
    let topic = "tls-orders";
    create_topic(&clients, topic).await;

    // Only the proxy's TLS address is given; the keys alone turn TLS on.
    let sink = KafkaSink::new(sink_config(&kafka.brokers, &ours, Some(&ours))).expect("sink");
    let messages = batch(topic);
    assert_delivers_over_tls(&sink, &messages).await;
    let records = consume(&clients, topic, 3).await;
    let expected: Vec<(String, String, String)> = messages
        .iter()
        .map(|m| {
            let payload = String::from_utf8(m.payload.clone()).expect("UTF-8 payload");
            (m.key.clone().unwrap_or_default(), payload, m.id.to_string())
        })
        .collect();
    assert_eq!(records, expected);
    assert!(
        kafka.verified.load(Ordering::SeqCst) >= 2,
        "bootstrap and broker over TLS"
    );
    assert_eq!(
        kafka.refused.load(Ordering::SeqCst),
        0,
        "no handshake failed so far"
    );
    drop(sink);

    // A sink that trusts another CA refuses the brokers' certificate.
    let wrong_ca = sink_config(&kafka.brokers, &theirs, Some(&ours));
    assert_refused(wrong_ca, topic, "certificate verify failed").await;
    let refused = kafka.refused.load(Ordering::SeqCst);
    assert!(refused > 0, "the proxy saw the failed handshakes");

    // Without a client certificate the proxy refuses the sink.
    let anonymous = sink_config(&kafka.brokers, &ours, None);
    assert_refused(anonymous, topic, "certificate required").await;
    assert!(
        kafka.refused.load(Ordering::SeqCst) > refused,
        "refused by the proxy"
    );

    // Nothing more than the three messages arrived.
    assert_eq!(consume(&clients, topic, 3).await, expected);
    drop(kafka);
    let _ = std::fs::remove_dir_all(&dir);
}

/// tansu 0.6 cannot accept any SASL login: its SASL library is built without PLAIN, it
/// keeps no SCRAM credentials with in-memory storage, and it refuses OAUTHBEARER. So this
/// shows that SASL_SSL is wired up (the SCRAM exchange runs inside the verified TLS
/// connection and reaches the broker's authenticator) and that the broker's refusal is
/// reported clearly, without the password; a successful SASL login is not verified here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_ssl_runs_scram_inside_verified_tls_and_a_refused_login_is_reported() {
    let dir = temp_dir("outbox_kafka_sasl_ssl");
    let ours = pki(&dir, "ours");
    let kafka = TlsKafka::start(&ours, &dir, true).await;

    let config = sink_config(&kafka.brokers, &ours, Some(&ours))
        .property("security.protocol", "SASL_SSL")
        .property("sasl.mechanism", "SCRAM-SHA-512")
        .property("sasl.username", USER)
        .property("sasl.password", PASSWORD);
    assert!(
        !format!("{config:?}").contains(PASSWORD),
        "the password is never shown"
    );
    let error = assert_refused(config, "sasl-orders", "SASL SCRAM authentication failed").await;
    assert!(
        !error.contains(PASSWORD),
        "the password is never shown: {error}"
    );
    assert!(
        kafka.verified.load(Ordering::SeqCst) > 0,
        "SASL ran inside verified TLS"
    );
    assert_eq!(
        kafka.refused.load(Ordering::SeqCst),
        0,
        "TLS itself was accepted"
    );
    drop(kafka);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tls_files_librdkafka_cannot_load_are_refused_at_start_up_naming_the_key() {
    let (dir, ours, theirs) = two_authorities("outbox_kafka_tls_files");
    let not_pem = dir.join("not.pem");
    std::fs::write(&not_pem, "not a certificate\n").expect("write");

    let local = || KafkaConfig::new("127.0.0.1:9093");
    for (config, expected) in [
        (
            KafkaConfig {
                tls_ca_file: Some(not_pem.clone()),
                ..local()
            },
            "sink.tls_ca_file is refused by librdkafka",
        ),
        (
            KafkaConfig {
                tls_cert_file: Some(not_pem.clone()),
                tls_key_file: Some(ours.client_key.clone()),
                ..local()
            },
            "sink.tls_cert_file is refused by librdkafka",
        ),
        // A key that does not belong to the certificate.
        (
            KafkaConfig {
                tls_cert_file: Some(ours.client_cert.clone()),
                tls_key_file: Some(theirs.client_key.clone()),
                ..local()
            },
            "sink.tls_key_file",
        ),
    ] {
        let error = KafkaSink::new(config).expect_err(expected);
        assert_eq!(error.kind(), ErrorKind::Config, "{error}");
        let text = error.in_section("sink").to_string();
        assert!(text.contains(expected), "{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
