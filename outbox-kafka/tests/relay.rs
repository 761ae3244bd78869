//! The Kafka sink behind the relay, against the real PostgreSQL and a real Kafka-protocol
//! broker: tansu at `$OUTBOX_TEST_KAFKA_BROKERS` (default `127.0.0.1:9092`), a tansu of the
//! test's own behind a proxy for the outage, and librdkafka's mock cluster for injected
//! broker errors. Each test uses topics of its own. Tests of the sink alone are in
//! outbox-kafka/tests/broker.rs (tansu) and outbox-kafka/tests/mock.rs (mock cluster).

use std::any::Any;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{Message, NewMessage, Sink, Template};
use outbox_kafka::rdkafka::mocking::MockCluster;
use outbox_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use outbox_kafka::{KafkaConfig, KafkaSink, wire};
use outbox_test_support::envelope::{assert_envelope, publish_full_and_bare};
use outbox_test_support::kafka::{
    Record, Tansu, consume, consume_until, create_topic, require_broker,
};
use outbox_test_support::relay::TestOutbox;
use outbox_test_support::relay::end_to_end::{self, Arrived, Fixture, trace_context};
use outbox_test_support::{Proxy, Service, free_addr, unique_name};
use uuid::Uuid;

fn sink(config: KafkaConfig) -> Arc<KafkaSink> {
    Arc::new(KafkaSink::new(config).expect("valid sink configuration"))
}

fn template(text: &str) -> Template {
    Template::new(text).expect("a valid template")
}

/// The outbox id of a record.
fn id(record: &Record) -> Uuid {
    let id = record.header(wire::ID).expect("outbox-id header");
    id.parse().expect("a UUID")
}

/// The sink under the end-to-end scripts: each destination is a topic of its own, of three
/// partitions, per outbox topic.
struct Kafka {
    brokers: String,
}

impl Kafka {
    fn new() -> Kafka {
        Kafka {
            brokers: require_broker(),
        }
    }
}

struct Topics {
    brokers: String,
    /// Outbox topic → Kafka topic.
    topics: BTreeMap<String, String>,
}

#[async_trait]
impl Fixture for Kafka {
    type Native = Record;
    type Destination = Topics;

    const SERVICE: Service = Service::Kafka;

    async fn destination(&self, topics: &[&str], via: Option<&str>) -> Topics {
        let brokers = via.map_or_else(|| self.brokers.clone(), str::to_string);
        let mut map = BTreeMap::new();
        for topic in topics {
            let kafka_topic = unique_name(topic);
            create_topic(&brokers, &kafka_topic, 3).await;
            map.insert(topic.to_string(), kafka_topic);
        }
        Topics {
            brokers,
            topics: map,
        }
    }

    /// `via` is where the destination is: the proxy in front of a tansu of the test's own.
    async fn sink(&self, topics: &Topics, via: Option<&str>) -> Arc<dyn Sink> {
        let mut config = KafkaConfig::new(&topics.brokers);
        for (outbox_topic, kafka_topic) in &topics.topics {
            config = config.topic(outbox_topic, kafka_topic);
        }
        if via.is_some() {
            config.publish_timeout = Duration::from_secs(3);
            config.health_timeout = Duration::from_secs(1);
        }
        sink(config)
    }

    async fn read(&self, topics: &Topics, count: usize) -> Vec<Arrived<Record>> {
        let names: Vec<&str> = topics.topics.values().map(String::as_str).collect();
        let timeout = Duration::from_secs(60);
        let records = consume_until(&topics.brokers, &names, 3, count, timeout).await;
        assert!(
            records.len() >= count,
            "consumed {} of {count} records of {names:?} within {timeout:?}",
            records.len()
        );
        records
            .into_iter()
            .map(|r| Arrived {
                id: id(&r),
                topic: r.header(wire::TOPIC).expect("outbox-topic header").into(),
                key: r.key.clone(),
                payload: r.payload.clone(),
                headers: r.headers.clone(),
                trace_context: trace_context(
                    r.headers.get(wire::TRACEPARENT).cloned(),
                    r.headers.get(wire::TRACESTATE).cloned(),
                ),
                // The receipt is where the record went.
                receipt: Some(format!("{}:{}", r.partition, r.offset)),
                native: r,
            })
            .collect()
    }

    /// Kafka clients connect to the address the broker advertises, not the one they were
    /// given, so a proxy in front of the shared broker would be bypassed: behind this one is
    /// a tansu of the test's own that advertises the proxy.
    async fn proxy(&self) -> (Proxy, Box<dyn Any + Send>) {
        let listen = free_addr();
        let proxy = Proxy::start(&listen).await;
        let log = std::env::temp_dir().join(format!("{}.log", unique_name("outbox-test-tansu")));
        let tansu = Tansu::start(&listen, &proxy.addr(), log)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        (proxy, Box::new(tansu))
    }
}

/// Through PostgreSQL and the relay: the envelope read back from the record's headers by
/// its documented names with a plain rdkafka consumer, and the native fields filled as
/// well: the record key is the partition key, the timestamp (`CreateTime`) the created time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_through_postgres_and_the_relay() {
    for (message, got) in end_to_end::round_trip(&Kafka::new()).await {
        let message = Message::from(message);
        let record = &got.native;
        assert_envelope(&message, "record", |name| {
            record.header(name).map(str::to_string)
        });
        assert_eq!(record.key, message.key, "record key of {}", message.id);
        assert!(record.create_time, "CreateTime: {record:?}");
        assert_eq!(
            record.timestamp,
            Some(message.created_at.timestamp_millis()),
            "record timestamp of {}",
            message.id
        );
    }
}

/// The sink alone, read with a plain rdkafka consumer: every envelope field of a full
/// message and of a bare one by its documented name, with the native key and timestamp; an
/// application header named like an envelope field is not sent, the envelope's value is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelope_fields_are_read_by_their_documented_names() {
    let brokers = require_broker();
    let topic = unique_name("envelope");
    create_topic(&brokers, &topic, 1).await;
    let sink = sink(KafkaConfig::new(&brokers));
    let [full, bare] = publish_full_and_bare(&*sink, &topic).await;
    let records = consume(&brokers, &topic, 1, 2, Duration::from_secs(20)).await;
    assert_eq!(records.len(), 2, "{records:?}");
    for (sent, record) in [&full, &bare].into_iter().zip(&records) {
        assert_envelope(sent, "record", |name| {
            record.header(name).map(str::to_string)
        });
        assert_eq!(record.key, sent.key);
        // `bare` was made an hour ago: the timestamp is the created time, not the send time.
        assert_eq!(record.timestamp, Some(sent.created_at.timestamp_millis()));
    }
    assert_eq!(records[0].header("x-tenant"), Some("acme"));
    assert_eq!(records[1].headers.len(), 5, "{:?}", records[1].headers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_over_5000_messages_and_50_keys_with_two_relays() {
    let arrived = end_to_end::per_key_order_with_two_relays(&Kafka::new()).await;
    let mut partitions: BTreeMap<&str, HashSet<i32>> = BTreeMap::new();
    for a in &arrived {
        let key = a.key.as_deref().expect("keyed");
        partitions
            .entry(key)
            .or_default()
            .insert(a.native.partition);
    }
    for (key, of_key) in &partitions {
        assert_eq!(of_key.len(), 1, "key {key} in one partition");
    }
    let used: HashSet<i32> = arrived.iter().map(|a| a.native.partition).collect();
    assert_eq!(used.len(), 3, "50 keys spread over the 3 partitions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_charges_no_attempt_and_everything_arrives_once_back() {
    end_to_end::outage(&Kafka::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_and_unknown_topic_are_dead_lettered_and_the_rest_flow() {
    let brokers = require_broker();
    let topic = unique_name("small");
    create_topic(&brokers, &topic, 1).await;
    let missing = unique_name("missing");
    let outbox = TestOutbox::new().await;
    let big = NewMessage::new("small", vec![b'x'; 64 * 1024]).key("big");
    let lost = NewMessage::new("missing", "no such topic").key("lost");
    let fine: Vec<NewMessage> = (0..10)
        .map(|i| NewMessage::new("small", format!("{i}")).key(format!("k{i}")))
        .collect();
    outbox.enqueue(&[big.clone(), lost.clone()]).await;
    outbox.enqueue(&fine).await;
    // tansu 0.6 does not enforce a topic's max.message.bytes, so the producer's own limit
    // stands in for it here; the broker's refusal is covered with the mock cluster.
    let config = KafkaConfig::new(&brokers)
        .topic("small", &topic)
        .topic("missing", &missing)
        .property("message.max.bytes", "8192");
    let relay = outbox.relay("kafka-dl", sink(config));
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;

    let dead: HashMap<Uuid, String> = outbox.dead_letters().await.into_iter().collect();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(
        dead[&big.id].contains("MessageSizeTooLarge"),
        "{}",
        dead[&big.id]
    );
    assert!(
        dead[&lost.id].contains(&missing) && dead[&lost.id].contains("UnknownTopic"),
        "{}",
        dead[&lost.id]
    );
    let records = consume(&brokers, &topic, 1, fine.len(), Duration::from_secs(20)).await;
    let ids: HashSet<Uuid> = records.iter().map(id).collect();
    assert_eq!(records.len(), fine.len());
    assert_eq!(ids, fine.iter().map(|m| m.id).collect());
}

/// librdkafka's mock cluster injects what tansu cannot: broker errors on produce requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_broker_errors_retryable_retried_fatal_dead_lettered() {
    use RDKafkaRespErr as E;
    let mock = MockCluster::new(1).expect("mock cluster");
    let servers = mock.bootstrap_servers();
    let topic = unique_name("mock");
    mock.create_topic(&topic, 1, 1).expect("mock topic");
    let outbox = TestOutbox::with_config(|c| c.retention = Some(Duration::from_secs(3600))).await;
    let mut config = KafkaConfig::new(&servers)
        .topic_template(template(&topic))
        .property("retry.backoff.ms", "10");
    config.publish_timeout = Duration::from_secs(5);
    let relay = outbox.relay("kafka-mock", sink(config));

    // Retryable broker errors (and a dropped connection): librdkafka retries them within
    // the delivery time-out, so the worker sees deliveries and charges nothing.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[
            E::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            E::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            E::RD_KAFKA_RESP_ERR__TRANSPORT,
            E::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        ],
    );
    let retried: Vec<NewMessage> = (0..10)
        .map(|i| NewMessage::new("t", format!("retried {i}")).key(format!("k{i}")))
        .collect();
    outbox.enqueue(&retried).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;

    // A sequence gap at the head of the partition is fatal to an idempotent producer: the
    // sink reports the message as temporary, the worker charges an attempt and retries it
    // on a new producer.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[E::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
    );
    let desync = NewMessage::new("t", "after a sequence gap").key("desync");
    outbox.enqueue(std::slice::from_ref(&desync)).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;

    // Errors that no retry can fix: each message is dead-lettered with the broker's reason.
    let mut doomed = Vec::new();
    for (injected, reason) in [
        (
            E::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE,
            "MessageSizeTooLarge",
        ),
        (E::RD_KAFKA_RESP_ERR_INVALID_RECORD, "InvalidRecord"),
        (E::RD_KAFKA_RESP_ERR_POLICY_VIOLATION, "PolicyViolation"),
    ] {
        mock.request_errors(RDKafkaApiKey::Produce, &[injected]);
        let message = NewMessage::new("t", reason).key(reason);
        let dead_before = outbox.stats().await.dead_lettered;
        outbox.enqueue(std::slice::from_ref(&message)).await;
        outbox
            .wait_for(&format!("{reason} dead-lettered"), |s| {
                s.dead_lettered == dead_before + 1 && s.pending == 0 && s.in_flight == 0
            })
            .await;
        doomed.push((message.id, reason));
    }
    let after = NewMessage::new("t", "after the refusals").key("after");
    outbox.enqueue(std::slice::from_ref(&after)).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;

    let dead: HashMap<Uuid, String> = outbox.dead_letters().await.into_iter().collect();
    assert_eq!(dead.len(), doomed.len(), "{dead:?}");
    for (id, reason) in &doomed {
        assert!(dead[id].contains(reason), "{reason}: {}", dead[id]);
    }
    let attempts: HashMap<Uuid, i32> = outbox_postgres::sqlx::query_as::<_, (Uuid, i32)>(&format!(
        "SELECT id, attempts FROM {}",
        outbox.table.qualified("_delivered")
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert!(
        retried.iter().all(|m| attempts[&m.id] == 0),
        "librdkafka's retries charge nothing: {attempts:?}"
    );
    assert_eq!(
        attempts[&desync.id], 1,
        "the fatal producer error cost one attempt"
    );
    assert_eq!(attempts[&after.id], 0);

    let records = consume(&servers, &topic, 1, 12, Duration::from_secs(20)).await;
    let ids: Vec<Uuid> = records.iter().map(id).collect();
    let expected: HashSet<Uuid> = retried
        .iter()
        .chain([&desync, &after])
        .map(|m| m.id)
        .collect();
    assert_eq!(ids.len(), expected.len(), "once each: {records:?}");
    assert_eq!(ids.into_iter().collect::<HashSet<_>>(), expected);
    let receipts = outbox.receipts().await;
    for record in &records {
        assert_eq!(
            receipts[&id(record)],
            format!("{}:{}", record.partition, record.offset)
        );
    }
}

/// The Kafka sink under the shared conformance suite: each destination is a topic of its own
/// with three partitions, read back partition after partition.
struct Harness {
    brokers: String,
}

impl Harness {
    /// librdkafka's delivery time-out; a publish gives up at most a few seconds after it.
    const DELIVERY: Duration = Duration::from_secs(2);

    fn new() -> Harness {
        Harness {
            brokers: require_broker(),
        }
    }

    fn config(brokers: &str) -> KafkaConfig {
        let mut config = KafkaConfig::new(brokers);
        config.publish_timeout = Self::DELIVERY;
        config.health_timeout = Self::DELIVERY;
        config
    }
}

#[async_trait::async_trait]
impl outbox_testkit::SinkHarness for Harness {
    fn timeout(&self) -> Duration {
        // A publish waits up to the delivery time-out plus the sink's 5 s grace.
        Self::DELIVERY * 2
    }

    async fn destination(&self) -> outbox_testkit::Destination {
        let topic = unique_name("conformance");
        create_topic(&self.brokers, &topic, 3).await;
        outbox_testkit::Destination {
            sink: sink(Self::config(&self.brokers)),
            topic,
        }
    }

    async fn read(
        &self,
        destination: &outbox_testkit::Destination,
        at_least: usize,
    ) -> Vec<outbox_testkit::Received> {
        let mut records = consume_until(
            &self.brokers,
            &[&destination.topic],
            3,
            at_least,
            Duration::from_secs(10),
        )
        .await;
        records.sort_by_key(|r| (r.partition, r.offset));
        records
            .into_iter()
            .map(|r| outbox_testkit::Received {
                payload: r.payload,
                headers: r.headers,
                key: r.key,
            })
            .collect()
    }

    async fn sink_at(&self, addr: &str) -> Option<Arc<dyn outbox_core::Sink>> {
        Some(sink(Self::config(addr)))
    }

    /// A message for a topic that does not exist (tansu does not create topics).
    async fn refused(
        &self,
        _destination: &outbox_testkit::Destination,
    ) -> Option<outbox_core::Message> {
        Some(outbox_core::Message::from(NewMessage::new(
            unique_name("missing"),
            "refused",
        )))
    }
}

mod conformance {
    outbox_testkit::sink_conformance_tests!(super::Harness::new());
}
