//! The NATS JetStream sink against the real NATS server (with JetStream) at 127.0.0.1:4222,
//! or `$OUTBOX_TEST_NATS_URL`: the conformance suite, the end-to-end scripts through
//! PostgreSQL, and what only NATS has.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, SinkRegistry, WorkerConfig};
use outbox_nats::async_nats::jetstream::{self, stream};
use outbox_nats::{NatsConfig, NatsSink, wire};
use outbox_test_support::envelope::{assert_envelope, publish_full_and_bare};
use outbox_test_support::nats::{connect, create_stream, headers, read, url};
use outbox_test_support::relay::end_to_end::{self, Arrived, Fixture, trace_context};
use outbox_test_support::relay::{TestOutbox, test_worker_config};
use outbox_test_support::{Service, through, unique_name};
use outbox_testkit::{Destination, Received, SinkHarness, refused_sink_build};

/// Every conformance subject starts with this; each destination's stream captures one
/// subject.
const PREFIX: &str = "conformance.";
/// The sinks' time-out in these tests.
const TIMEOUT: Duration = Duration::from_secs(2);

fn config(url: &str, prefix: &str) -> NatsConfig {
    NatsConfig {
        subject_prefix: prefix.into(),
        ..NatsConfig::new(url).publish_timeout(TIMEOUT)
    }
}

/// A JetStream client of the tests' own, to make streams and read them back.
struct Nats {
    js: jetstream::Context,
}

impl Nats {
    async fn new() -> Nats {
        Nats {
            js: connect().await,
        }
    }

    /// A stream named `topic` capturing the conformance subject of `topic`.
    async fn stream_for(&self, topic: &str) {
        create_stream(&self.js, topic, vec![format!("{PREFIX}{topic}")]).await;
    }

    /// Every message of stream `topic`, in stream order, once it holds at least `at_least`
    /// (or after 10 s).
    async fn messages(&self, topic: &str, at_least: usize) -> Vec<Received> {
        let messages = read(&self.js, topic, at_least, Duration::from_secs(10)).await;
        messages
            .iter()
            .map(|m| {
                let headers = headers(&m.message);
                Received {
                    payload: m.message.payload.to_vec(),
                    key: headers.get(wire::KEY).cloned(),
                    headers,
                }
            })
            .collect()
    }
}

#[async_trait]
impl SinkHarness for Nats {
    fn timeout(&self) -> Duration {
        TIMEOUT
    }

    async fn destination(&self) -> Destination {
        let topic = unique_name("conformance");
        self.stream_for(&topic).await;
        let sink = NatsSink::new(config(&url(), PREFIX)).expect("valid configuration");
        Destination {
            sink: Arc::new(sink),
            topic,
        }
    }

    async fn read(&self, destination: &Destination, at_least: usize) -> Vec<Received> {
        self.messages(&destination.topic, at_least).await
    }

    async fn sink_at(&self, addr: &str) -> Option<Arc<dyn Sink>> {
        let config = config(&format!("nats://{addr}"), PREFIX);
        Some(Arc::new(
            NatsSink::new(config).expect("valid configuration"),
        ))
    }

    /// A topic no stream captures: JetStream has no responder for its subject.
    async fn refused(&self, _destination: &Destination) -> Option<Message> {
        Some(Message::from(NewMessage::new(
            unique_name("nostream"),
            "refused",
        )))
    }
}

outbox_testkit::sink_conformance_tests!(Nats::new().await);

/// The suite in one call, as the lead wires it into the other sinks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_sink_suite_runs_in_one_call() {
    outbox_testkit::run_sink_suite(&Nats::new().await).await;
}

/// Under the end-to-end scripts, each destination is a stream of its own capturing every
/// subject under a prefix of its own.
struct Stream {
    name: String,
    prefix: String,
}

#[async_trait]
impl Fixture for Nats {
    type Native = outbox_nats::async_nats::Message;
    type Destination = Stream;

    const SERVICE: Service = Service::Nats;

    async fn destination(&self, _topics: &[&str], _via: Option<&str>) -> Stream {
        let name = unique_name("relay");
        let prefix = format!("{name}.");
        create_stream(&self.js, &name, vec![format!("{prefix}>")]).await;
        Stream { name, prefix }
    }

    async fn sink(&self, stream: &Stream, via: Option<&str>) -> Arc<dyn Sink> {
        let url = via.map_or_else(url, |addr| through(&url(), addr));
        Arc::new(NatsSink::new(config(&url, &stream.prefix)).expect("valid configuration"))
    }

    /// The stream's count is exact once the relay is done (JetStream acknowledges stored
    /// messages): no need to wait for more.
    async fn read(&self, stream: &Stream, count: usize) -> Vec<Arrived<Self::Native>> {
        let messages = read(&self.js, &stream.name, count, Duration::from_secs(60)).await;
        assert!(
            messages.len() >= count,
            "{} of {count} messages in stream {} within 60 s",
            messages.len(),
            stream.name
        );
        messages
            .into_iter()
            .map(|m| {
                let info = m.info().expect("JetStream message info");
                let receipt = format!("{}:{}", info.stream, info.stream_sequence);
                let headers = headers(&m.message);
                let subject = m.message.subject.as_str();
                let topic = subject.strip_prefix(&stream.prefix).expect("prefixed");
                Arrived {
                    id: headers[wire::ID].parse().expect("a UUID"),
                    topic: topic.to_string(),
                    key: headers.get(wire::KEY).cloned(),
                    payload: m.message.payload.to_vec(),
                    trace_context: trace_context(
                        headers.get(wire::TRACEPARENT).cloned(),
                        headers.get(wire::TRACESTATE).cloned(),
                    ),
                    headers,
                    receipt: Some(receipt),
                    native: m.message,
                }
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_delivers_from_postgres_to_jetstream_in_key_order() {
    for (message, got) in end_to_end::round_trip(&Nats::new().await).await {
        // The envelope by its documented names, as a plain async-nats consumer reads it, and
        // JetStream's own id header filled as well.
        assert_envelope(&Message::from(message.clone()), "message", |name| {
            got.headers.get(name).cloned()
        });
        assert_eq!(
            got.headers.get("Nats-Msg-Id"),
            Some(&message.id.to_string())
        );
    }
}

/// The sink alone, read with a plain async-nats consumer: every envelope field of a full
/// message and of a bare one by its documented name, `Nats-Msg-Id` filled as well; an
/// application header named like an envelope field is not sent, the envelope's value is;
/// `key_header` repeats the key under an older name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelope_fields_are_read_by_their_documented_names() {
    let nats = Nats::new().await;
    let topic = unique_name("envelope");
    nats.stream_for(&topic).await;
    let sink = NatsSink::new(NatsConfig {
        key_header: Some("Outbox-Key".into()),
        ..config(&url(), PREFIX)
    })
    .expect("valid configuration");
    let [full, bare] = publish_full_and_bare(&sink, &topic).await;
    let got = read(&nats.js, &topic, 2, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 2);
    for (sent, m) in [&full, &bare].into_iter().zip(&got) {
        let headers = headers(&m.message);
        assert_envelope(sent, "message", |name| headers.get(name).cloned());
        assert_eq!(headers.get("Nats-Msg-Id"), Some(&sent.id.to_string()));
        assert_eq!(headers.get("Outbox-Key"), sent.key.as_ref());
    }
    let first = headers(&got[0].message);
    assert_eq!(first["x-tenant"], "acme");
    assert_eq!(first["outbox-id"], full.id.to_string(), "the envelope wins");
    // The five that are always there, and Nats-Msg-Id.
    assert_eq!(
        headers(&got[1].message).len(),
        6,
        "{:?}",
        headers(&got[1].message)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_published_before_a_crash_are_not_stored_twice() {
    end_to_end::redelivery_after_a_crash(&Nats::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_charges_no_attempts_and_everything_arrives_after_it() {
    end_to_end::outage(&Nats::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_without_a_stream_is_retried_then_dead_lettered_with_the_subject_named() {
    let outbox = TestOutbox::new().await;
    let topic = unique_name("nostream");
    outbox
        .enqueue(&[NewMessage::new(topic.as_str(), "lost").key("k")])
        .await;
    let sink = Arc::new(NatsSink::new(config(&url(), PREFIX)).unwrap());
    let relay = outbox.relay_with(
        WorkerConfig {
            max_attempts: 2,
            ..test_worker_config("nats-4")
        },
        sink,
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let dead = loop {
        let dead = outbox.dead_letters().await;
        if !dead.is_empty() || tokio::time::Instant::now() >= deadline {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    relay.stop().await;
    assert_eq!(dead.len(), 1, "dead-lettered after its attempts");
    assert!(
        dead[0].1.contains("gave up after 2 attempts"),
        "{}",
        dead[0].1
    );
    assert!(
        dead[0].1.contains(&format!(
            "no JetStream stream captures subject `{PREFIX}{topic}`"
        )),
        "{}",
        dead[0].1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_nats_cannot_carry_fail_alone_as_permanent() {
    let nats = Nats::new().await;
    let d = SinkHarness::destination(&nats).await;
    let t = d.topic.as_str();
    let batch: Vec<Message> = vec![
        NewMessage::new(t, "ok 1").key("k"),
        NewMessage::new(t, "line break").header("x-bad", "a\r\nInjected: yes"),
        NewMessage::new(t, "reserved").header("Nats-Expected-Stream", "other"),
        NewMessage::new(t, "bad name").header("x bad", "v"),
        NewMessage::new(t, "newline key").key("k\n2"),
        NewMessage::new("has space", "bad topic"),
        NewMessage::new(t, "ok 2").key("k"),
    ]
    .into_iter()
    .map(Message::from)
    .collect();
    let outcomes = d.sink.publish(&batch).await.unwrap();
    assert_eq!(outcomes.len(), batch.len());
    for (i, outcome) in outcomes.iter().enumerate() {
        match (i, outcome) {
            (0 | 6, Outcome::Delivered(receipt)) => {
                assert!(receipt.0.starts_with(&format!("{t}:")), "{receipt}")
            }
            (1..=5, Outcome::Failed(e)) => {
                assert_eq!(e.kind(), ErrorKind::Permanent, "message {i}: {e}")
            }
            (i, o) => panic!("message {i}: {o:?}"),
        }
    }
    let got = nats.messages(t, 2).await;
    let payloads: Vec<&[u8]> = got.iter().map(|r| r.payload.as_slice()).collect();
    assert_eq!(payloads, [b"ok 1".as_slice(), b"ok 2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expected_stream_refuses_a_subject_captured_elsewhere() {
    let nats = Nats::new().await;
    let d = SinkHarness::destination(&nats).await;
    let strict = NatsSink::new(NatsConfig {
        stream: Some("some_other_stream".into()),
        ..config(&url(), PREFIX)
    })
    .unwrap();
    let exact = NatsSink::new(NatsConfig {
        stream: Some(d.topic.clone()),
        ..config(&url(), PREFIX)
    })
    .unwrap();
    let m = |p: &str| Message::from(NewMessage::new(d.topic.as_str(), p));
    match &strict.publish(&[m("wrong stream")]).await.unwrap()[0] {
        Outcome::Failed(e) => assert_eq!(e.kind(), ErrorKind::Permanent, "{e}"),
        o => panic!("delivered to a stream other than the expected one: {o:?}"),
    }
    assert!(matches!(
        exact.publish(&[m("right stream")]).await.unwrap()[0],
        Outcome::Delivered(_)
    ));
    let got = nats.messages(&d.topic, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].payload, b"right stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_builds_the_sink_from_configuration() {
    let nats = Nats::new().await;
    let topic = unique_name("registry");
    nats.stream_for(&topic).await;
    let mut registry = SinkRegistry::new();
    outbox_nats::register(&mut registry);
    let sink = registry
        .build(
            outbox_nats::TYPE,
            serde_json::json!({ "url": url(), "subject_prefix": PREFIX, "publish_timeout": "2s" }),
        )
        .await
        .unwrap();
    sink.health().await.unwrap();
    assert!(sink.capabilities().deduplicates);
    let outcomes = sink
        .publish(&[Message::from(NewMessage::new(topic.as_str(), "built"))])
        .await
        .unwrap();
    assert!(matches!(outcomes[0], Outcome::Delivered(_)), "{outcomes:?}");
    assert_eq!(nats.messages(&topic, 1).await[0].payload, b"built");

    let unknown = serde_json::json!({ "url": url(), "subjct": "x" });
    let error = refused_sink_build(&registry, outbox_nats::TYPE, unknown).await;
    assert!(
        error.to_string().contains("unknown field `subjct`"),
        "{error}"
    );
    let zero =
        serde_json::json!({ "url": "nats://u:hunter2@127.0.0.1:4222", "publish_timeout": "0s" });
    let secret = refused_sink_build(&registry, outbox_nats::TYPE, zero).await;
    assert!(
        secret.to_string().contains("publish_timeout") && !secret.to_string().contains("hunter2"),
        "{secret}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_stream_is_back_pressure_not_a_message_failure() {
    let nats = Nats::new().await;
    let topic = unique_name("full");
    nats.js
        .create_stream(stream::Config {
            name: topic.clone(),
            subjects: vec![format!("{PREFIX}{topic}")],
            storage: stream::StorageType::Memory,
            max_messages: 2,
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    let sink = NatsSink::new(config(&url(), PREFIX)).unwrap();
    let batch: Vec<Message> = (0..3)
        .map(|i| Message::from(NewMessage::new(topic.as_str(), format!("{i}"))))
        .collect();
    let outcomes = sink.publish(&batch).await.unwrap();
    assert!(matches!(outcomes[0], Outcome::Delivered(_)), "{outcomes:?}");
    assert!(matches!(outcomes[1], Outcome::Delivered(_)), "{outcomes:?}");
    match &outcomes[2] {
        // Released uncharged: it goes out once consumers make room.
        Outcome::Failed(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}"),
        o => panic!("a full stream took a third message: {o:?}"),
    }
}
