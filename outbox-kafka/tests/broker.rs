//! The sink against the real Kafka-protocol broker (tansu on 127.0.0.1:9092, or
//! $OUTBOX_TEST_KAFKA_BROKERS).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, TraceContext};
use outbox_kafka::{KafkaConfig, KafkaSink};
use outbox_test_support::kafka::{Record, consume, create_topic, require_broker, try_create_topic};
use outbox_test_support::{free_addr, unique_name};
use outbox_testkit::{assert_unavailable_within, receipts};

fn sink(brokers: &str) -> KafkaSink {
    KafkaSink::new(KafkaConfig::new(brokers)).expect("sink")
}

/// The brokers, with a topic of the test's own (named after `name`) made there with
/// `partitions` partitions: the brokers and the topic.
async fn new_topic(name: &str, partitions: i32) -> (String, String) {
    let brokers = require_broker();
    let topic = unique_name(name);
    create_topic(&brokers, &topic, partitions).await;
    (brokers, topic)
}

/// Checks the outcomes of three messages: the first and the last delivered, the middle one
/// failed for good with an error that contains `needle` (which `why` explains).
fn assert_only_the_middle_fails(outcomes: &[Outcome], needle: &str, why: &str) {
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    for delivered in [&outcomes[0], &outcomes[2]] {
        assert!(matches!(delivered, Outcome::Delivered(_)), "{delivered:?}");
    }
    match &outcomes[1] {
        Outcome::Failed(e) => {
            assert_eq!(e.kind(), ErrorKind::Permanent, "{e}");
            assert!(e.to_string().contains(needle), "{why}: {e}");
        }
        other => panic!("the middle message must fail: {other:?}"),
    }
}

/// Messages of `topic` for `keys` keys, `per_key` each, interleaved in enqueue order.
fn keyed_messages(topic: &str, keys: usize, per_key: usize) -> Vec<Message> {
    let mut messages = Vec::new();
    for seq in 0..per_key {
        for k in 0..keys {
            messages.push(Message::from(
                NewMessage::new(topic, format!("k{k}:{seq}")).key(format!("k{k}")),
            ));
        }
    }
    messages
}

/// Groups records by key, in consumed order (which is offset order per partition).
fn by_key(records: &[Record]) -> HashMap<String, Vec<&Record>> {
    let mut map: HashMap<String, Vec<&Record>> = HashMap::new();
    for r in records {
        let key = r.key.clone().expect("keyed record");
        map.entry(key).or_default().push(r);
    }
    map
}

#[tokio::test(flavor = "multi_thread")]
async fn round_trip_keeps_key_headers_and_payload_bytes() {
    let (brokers, topic) = new_topic("rt", 3).await;
    let sink = sink(&brokers);
    sink.health().await.expect("healthy");

    let binary: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    let batch: Vec<Message> = vec![
        NewMessage::new(&topic, binary.clone())
            .key("order-1")
            .header("content-type", "application/octet-stream")
            .header("tenant", "acme")
            .trace_context(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: Some("vendor=1".into()),
            })
            .into(),
        NewMessage::new(&topic, b"no key".to_vec()).into(),
        NewMessage::new(&topic, Vec::new()).key("order-2").into(),
    ];
    let outcomes = sink.publish(&batch).await.expect("publish");
    assert_eq!(outcomes.len(), batch.len());
    let receipts = receipts(&outcomes);

    let records = consume(&brokers, &topic, 3, batch.len(), Duration::from_secs(20)).await;
    assert_eq!(
        records.len(),
        batch.len(),
        "each message exactly once: {records:?}"
    );
    for (message, receipt) in batch.iter().zip(&receipts) {
        let id = message.id.to_string();
        let record = records
            .iter()
            .find(|r| r.header("outbox-id") == Some(id.as_str()))
            .unwrap_or_else(|| panic!("message {id} not consumed"));
        assert_eq!(receipt, &format!("{}:{}", record.partition, record.offset));
        assert_eq!(record.payload, message.payload, "payload bytes exact");
        assert_eq!(record.key, message.key);
        assert_eq!(record.header("outbox-topic"), Some(topic.as_str()));
        let created = chrono::DateTime::parse_from_rfc3339(
            record.header("outbox-created-at").expect("created"),
        )
        .expect("RFC 3339");
        assert_eq!(
            created.timestamp_micros(),
            message.created_at.timestamp_micros()
        );
        for (name, value) in &message.headers {
            assert_eq!(record.header(name), Some(value.as_str()), "header {name}");
        }
    }
    let first = records
        .iter()
        .find(|r| r.key.as_deref() == Some("order-1"))
        .unwrap();
    assert_eq!(first.header("tenant"), Some("acme"));
    assert_eq!(
        first.header("traceparent"),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert_eq!(first.header("tracestate"), Some("vendor=1"));
    let keyless = records.iter().find(|r| r.payload == b"no key").unwrap();
    assert_eq!(keyless.key, None, "no key when the message has none");
    assert_eq!(keyless.header("traceparent"), None);
}

#[tokio::test(flavor = "multi_thread")]
async fn same_key_same_partition_in_order_across_calls() {
    let (brokers, topic) = new_topic("order", 3).await;
    let sink = sink(&brokers);
    let (keys, per_key) = (20, 10);
    let messages = keyed_messages(&topic, keys, per_key);
    // One message per key per call, as the worker hands them over when the storage keeps
    // per-key order.
    for call in messages.chunks(keys) {
        let outcomes = sink.publish(call).await.expect("publish");
        receipts(&outcomes);
    }
    let records = consume(&brokers, &topic, 3, keys * per_key, Duration::from_secs(30)).await;
    assert_eq!(records.len(), keys * per_key, "each message exactly once");
    let grouped = by_key(&records);
    assert_eq!(grouped.len(), keys);
    let partitions: std::collections::HashSet<i32> = records.iter().map(|r| r.partition).collect();
    assert!(
        partitions.len() > 1,
        "20 keys should spread over the 3 partitions: {partitions:?}"
    );
    for (key, records) in grouped {
        assert!(
            records.iter().all(|r| r.partition == records[0].partition),
            "{key} in one partition"
        );
        let seqs: Vec<String> = records
            .iter()
            .map(|r| String::from_utf8(r.payload.clone()).unwrap())
            .collect();
        let expected: Vec<String> = (0..per_key).map(|s| format!("{key}:{s}")).collect();
        assert_eq!(seqs, expected, "{key} in enqueue order");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_topic_is_permanent_and_does_not_stop_the_others() {
    let (brokers, topic) = new_topic("known", 1).await;
    let missing = unique_name("missing");
    let sink = sink(&brokers);
    let batch: Vec<Message> = vec![
        NewMessage::new(&topic, b"a".to_vec()).key("a").into(),
        NewMessage::new(&missing, b"b".to_vec()).key("b").into(),
        NewMessage::new(&topic, b"c".to_vec()).key("c").into(),
    ];
    let started = Instant::now();
    let outcomes = sink.publish(&batch).await.expect("publish");
    println!("unknown topic reported after {:?}", started.elapsed());
    assert_only_the_middle_fails(&outcomes, &missing, "names the topic");
}

/// tansu 0.6 does not enforce a topic's `max.message.bytes`, so this checks the producer's
/// own limit (`message.max.bytes`, set to match the topic); the broker's refusal of a too
/// large message is checked against the mock cluster.
#[tokio::test(flavor = "multi_thread")]
async fn too_large_for_the_producer_is_permanent() {
    let brokers = require_broker();
    let topic = unique_name("small");
    try_create_topic(&brokers, &topic, 1, &[("max.message.bytes", "8192")])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sink = KafkaSink::new(KafkaConfig::new(&brokers).property("message.max.bytes", "8192"))
        .expect("sink");
    let batch: Vec<Message> = vec![
        NewMessage::new(&topic, b"fits".to_vec()).key("a").into(),
        NewMessage::new(&topic, vec![7u8; 64 * 1024])
            .key("b")
            .into(),
        NewMessage::new(&topic, b"fits too".to_vec())
            .key("c")
            .into(),
    ];
    let outcomes = sink.publish(&batch).await.expect("publish");
    assert_only_the_middle_fails(&outcomes, "MessageSizeTooLarge", "says why");
}

#[tokio::test(flavor = "multi_thread")]
async fn closed_port_is_unavailable_within_the_time_outs() {
    // A port that was free a moment ago: nothing listens there.
    let addr = free_addr();
    let mut config = KafkaConfig::new(&addr);
    config.publish_timeout = Duration::from_secs(2);
    config.health_timeout = Duration::from_secs(1);
    let sink = KafkaSink::new(config).expect("made without connecting");

    let started = Instant::now();
    let err = sink.health().await.expect_err("nothing listens");
    assert_unavailable_within(&err, started.elapsed(), Duration::from_secs(3));
    assert!(err.to_string().contains(&addr), "names the brokers: {err}");

    let batch: Vec<Message> = (0..3)
        .map(|i| {
            NewMessage::new("orders", format!("m{i}"))
                .key(format!("k{i}"))
                .into()
        })
        .collect();
    let started = Instant::now();
    let outcomes = sink.publish(&batch).await.expect("per-message outcomes");
    let took = started.elapsed();
    assert_eq!(outcomes.len(), 3);
    for outcome in &outcomes {
        match outcome {
            Outcome::Failed(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}"),
            other => panic!("nothing listens, yet {other:?}"),
        }
    }
    assert!(
        took < Duration::from_secs(6),
        "publish must end near the delivery time-out, took {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn librdkafka_refuses_bad_properties_as_config_errors() {
    let err =
        KafkaSink::new(KafkaConfig::new("127.0.0.1:9092").property("linger.mss", "5")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    // Keyed relative to the sink's section, which the relay puts in front.
    let message = err.in_section("sink").message().to_string();
    assert!(
        message.starts_with("sink.properties.linger.mss is refused by librdkafka"),
        "{message}"
    );

    let err =
        KafkaSink::new(KafkaConfig::new("127.0.0.1:9092").property("compression.type", "brotli"))
            .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("compression.type"), "{err}");

    // With idempotence librdkafka allows at most 5 requests in flight.
    let err = KafkaSink::new(
        KafkaConfig::new("127.0.0.1:9092").property("max.in.flight.requests.per.connection", "10"),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    println!("{err}");

    // A secret's value never shows in the error.
    let err =
        KafkaSink::new(KafkaConfig::new("127.0.0.1:9092").property("sasl.passwordd", "hunter2"))
            .unwrap_err();
    assert!(!err.to_string().contains("hunter2"), "{err}");
}
