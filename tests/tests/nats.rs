//! The NATS JetStream sink against the real NATS server (with JetStream) at 127.0.0.1:4222,
//! or `$OUTBOX_TEST_NATS_URL`: the conformance suite, and the relay end to end through
//! PostgreSQL.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, SinkRegistry, WorkerConfig};
use outbox_nats::async_nats::jetstream::{self, consumer, stream};
use outbox_nats::{NatsConfig, NatsSink, async_nats};
use outbox_tests::conformance::{Destination, Received, SinkHarness};
use outbox_tests::{Proxy, TestOutbox, test_worker_config, unique_name};

/// Every test subject starts with this; each destination's stream captures one subject.
const PREFIX: &str = "conformance.";
/// The sinks' time-out in these tests.
const TIMEOUT: Duration = Duration::from_secs(2);

fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_string())
}

fn config(url: &str) -> NatsConfig {
    NatsConfig {
        timeout: TIMEOUT,
        subject_prefix: PREFIX.into(),
        ..NatsConfig::new(url)
    }
}

/// A JetStream client of the tests' own, to make streams and read them back.
struct Nats {
    js: jetstream::Context,
}

impl Nats {
    async fn new() -> Nats {
        let url = nats_url();
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(url.as_str())
            .await
            .unwrap_or_else(|e| {
                panic!("NATS with JetStream must be running at {url} (start it with `cargo xtask services`): {e}")
            });
        Nats {
            js: jetstream::new(client),
        }
    }

    /// A stream named `topic` capturing the subject of `topic`, in memory, emptied after an
    /// hour so repeated runs leave little behind.
    async fn stream_for(&self, topic: &str) {
        self.js
            .create_stream(stream::Config {
                name: topic.to_string(),
                subjects: vec![format!("{PREFIX}{topic}")],
                storage: stream::StorageType::Memory,
                max_age: Duration::from_secs(3600),
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("creating JetStream stream {topic} at {}: {e}", nats_url()));
    }

    /// Every message of stream `topic`, in stream order, once it holds at least `at_least`
    /// (or after 10 s).
    async fn messages(&self, topic: &str, at_least: usize) -> Vec<Received> {
        let mut stream = self.js.get_stream(topic).await.expect("the test's stream");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let count = loop {
            let held = stream.info().await.expect("stream info").state.messages as usize;
            if held >= at_least || tokio::time::Instant::now() >= deadline {
                break held;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if count == 0 {
            return Vec::new();
        }
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig::default())
            .await
            .expect("ordered consumer");
        let mut messages = consumer.messages().await.expect("consume").take(count);
        let mut received = Vec::with_capacity(count);
        while let Some(next) = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("stream message within 10 s")
        {
            let message = next.expect("stream message");
            let headers: BTreeMap<String, String> = message
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .filter_map(|(name, values)| Some((name.to_string(), values.last()?.to_string())))
                .collect();
            received.push(Received {
                payload: message.payload.to_vec(),
                key: headers.get("Outbox-Key").cloned(),
                headers,
            });
        }
        received
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
        let sink = NatsSink::new(config(&nats_url())).expect("valid configuration");
        Destination {
            sink: Arc::new(sink),
            topic,
        }
    }

    async fn read(&self, destination: &Destination, at_least: usize) -> Vec<Received> {
        self.messages(&destination.topic, at_least).await
    }

    async fn sink_at(&self, addr: &str) -> Arc<dyn Sink> {
        Arc::new(NatsSink::new(config(&format!("nats://{addr}"))).expect("valid configuration"))
    }

    /// A topic no stream captures: JetStream has no responder for its subject.
    async fn refused(&self, _destination: &Destination) -> Option<Message> {
        Some(Message::from(NewMessage::new(
            unique_name("nostream"),
            "refused",
        )))
    }
}

outbox_tests::sink_conformance_tests!(Nats::new().await);

/// The suite in one call, as the lead wires it into the other sinks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_sink_suite_runs_in_one_call() {
    outbox_tests::conformance::run_sink_suite(&Nats::new().await).await;
}

/// Per key, the payloads as text, in the order held.
fn by_key(received: &[Received]) -> BTreeMap<String, Vec<String>> {
    let mut keys: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in received {
        keys.entry(r.key.clone().unwrap_or_default())
            .or_default()
            .push(String::from_utf8(r.payload.clone()).expect("text payload"));
    }
    keys
}

fn orders(topic: &str, keys: usize, per_key: usize, tag: &str) -> Vec<NewMessage> {
    (0..per_key)
        .flat_map(|i| {
            (0..keys).map(move |k| {
                NewMessage::new(topic, format!("{tag}{i:04}"))
                    .key(format!("order-{k}"))
                    .header("x-tag", tag)
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_delivers_from_postgres_to_jetstream_in_key_order() {
    let nats = Nats::new().await;
    let topic = unique_name("relay");
    nats.stream_for(&topic).await;
    let outbox = TestOutbox::new().await;
    let sent = orders(&topic, 10, 30, "m");
    outbox.enqueue(&sent).await;

    let sink = Arc::new(NatsSink::new(config(&nats_url())).unwrap());
    let started = std::time::Instant::now();
    let relay = outbox.relay("nats-1", sink);
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    let elapsed = started.elapsed();
    relay.stop().await;
    eprintln!(
        "[nats] relay delivered {} messages through PostgreSQL in {elapsed:?}",
        sent.len()
    );

    let got = nats.messages(&topic, sent.len()).await;
    assert_eq!(got.len(), sent.len(), "every message once");
    let expected: Vec<String> = (0..30).map(|i| format!("m{i:04}")).collect();
    for (key, payloads) in by_key(&got) {
        assert_eq!(payloads, expected, "key {key} out of order");
    }
    // The id travels as Nats-Msg-Id, the header as it was.
    let ids: Vec<String> = sent.iter().map(|m| m.id.to_string()).collect();
    for r in &got {
        assert!(
            ids.contains(&r.headers["Nats-Msg-Id"]),
            "unknown Nats-Msg-Id {:?}",
            r.headers
        );
        assert_eq!(r.headers["x-tag"], "m");
    }
    assert!(outbox.dead_letters().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_published_before_a_crash_are_not_stored_twice() {
    let nats = Nats::new().await;
    let topic = unique_name("dedup");
    nats.stream_for(&topic).await;
    let outbox = TestOutbox::new().await;
    let sent = orders(&topic, 5, 10, "d");
    outbox.enqueue(&sent).await;

    // A relay claimed and published these, then died before recording it.
    let sink = Arc::new(NatsSink::new(config(&nats_url())).unwrap());
    let earlier: Vec<Message> = sent.iter().take(30).cloned().map(Message::from).collect();
    let outcomes = sink.publish(&earlier).await.unwrap();
    assert!(outcomes.iter().all(|o| matches!(o, Outcome::Delivered(_))));

    // The next relay publishes all 50 again; JetStream drops the 30 it has.
    let relay = outbox.relay("nats-2", sink);
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;
    let got = nats.messages(&topic, sent.len()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut stream = nats.js.get_stream(&topic).await.unwrap();
    let held = stream.info().await.unwrap().state.messages;
    assert_eq!(
        held,
        sent.len() as u64,
        "the stream holds each message once"
    );
    assert_eq!(got.len(), sent.len());
    let expected: Vec<String> = (0..10).map(|i| format!("d{i:04}")).collect();
    for (key, payloads) in by_key(&got) {
        assert_eq!(payloads, expected, "key {key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_charges_no_attempts_and_everything_arrives_after_it() {
    let nats = Nats::new().await;
    let topic = unique_name("outage");
    nats.stream_for(&topic).await;
    let proxy = Proxy::start("127.0.0.1:4222").await;
    let outbox = TestOutbox::new().await;
    let sink = Arc::new(NatsSink::new(config(&format!("nats://{}", proxy.addr()))).unwrap());
    let relay = outbox.relay("nats-3", sink.clone());

    let before = orders(&topic, 4, 5, "a");
    outbox.enqueue(&before).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;

    proxy.cut();
    let health = sink.health().await.expect_err("health while cut");
    assert_eq!(health.kind(), ErrorKind::Unavailable, "{health}");
    let during = orders(&topic, 4, 5, "b");
    outbox.enqueue(&during).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = outbox.stats().await;
    assert_eq!(
        stats.pending + stats.in_flight,
        during.len() as u64,
        "held while NATS is cut: {stats:?}"
    );
    let attempts: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT attempts FROM {}",
        outbox.table.qualified("")
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap();
    assert!(
        attempts.iter().all(|&a| a == 0),
        "an outage charges no attempts: {attempts:?}"
    );

    proxy.restore();
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;
    assert!(outbox.dead_letters().await.is_empty());
    let got = nats.messages(&topic, before.len() + during.len()).await;
    assert_eq!(got.len(), before.len() + during.len(), "each message once");
    for (key, payloads) in by_key(&got) {
        let expected: Vec<String> = ["a", "b"]
            .iter()
            .flat_map(|tag| (0..5).map(move |i| format!("{tag}{i:04}")))
            .collect();
        assert_eq!(payloads, expected, "key {key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_without_a_stream_is_retried_then_dead_lettered_with_the_subject_named() {
    let outbox = TestOutbox::new().await;
    let topic = unique_name("nostream");
    outbox
        .enqueue(&[NewMessage::new(topic.as_str(), "lost").key("k")])
        .await;
    let sink = Arc::new(NatsSink::new(config(&nats_url())).unwrap());
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
    let d = nats.destination().await;
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
    let d = nats.destination().await;
    let strict = NatsSink::new(NatsConfig {
        stream: Some("some_other_stream".into()),
        ..config(&nats_url())
    })
    .unwrap();
    let exact = NatsSink::new(NatsConfig {
        stream: Some(d.topic.clone()),
        ..config(&nats_url())
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
            serde_json::json!({ "url": nats_url(), "subject_prefix": PREFIX, "timeout": "2s" }),
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

    let error = registry
        .build(
            outbox_nats::TYPE,
            serde_json::json!({ "url": nats_url(), "subjct": "x" }),
        )
        .await
        .err()
        .expect("unknown key refused");
    assert_eq!(error.kind(), ErrorKind::Config);
    assert!(
        error.to_string().contains("unknown field `subjct`"),
        "{error}"
    );
    let secret = registry
        .build(
            outbox_nats::TYPE,
            serde_json::json!({ "url": "nats://u:hunter2@127.0.0.1:4222", "timeout": "0s" }),
        )
        .await
        .err()
        .expect("zero time-out refused");
    assert!(
        secret.to_string().contains("sink.timeout") && !secret.to_string().contains("hunter2"),
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
    let sink = NatsSink::new(config(&nats_url())).unwrap();
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
