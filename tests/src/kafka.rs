//! Kafka helpers shared by the Kafka suites and the binary's tests: the broker address,
//! topic creation with the admin client, and a consumer that reads with `assign()`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_kafka::HEADER_ID;
use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::message::{Headers, Message as _};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use uuid::Uuid;

/// The broker under test: `$OUTBOX_TEST_KAFKA_BROKERS` or the local tansu.
pub fn brokers() -> String {
    std::env::var("OUTBOX_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// Panics, naming the address, when no broker listens there.
pub fn require_broker() -> String {
    let brokers = brokers();
    let first = brokers
        .split(',')
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    let addr = first
        .parse()
        .unwrap_or_else(|e| panic!("OUTBOX_TEST_KAFKA_BROKERS `{first}` is not ip:port: {e}"));
    if let Err(e) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3)) {
        panic!(
            "Kafka (tansu) must be running at {first} (start it with `cargo xtask services`): {e}"
        );
    }
    brokers
}

pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = tokio::time::timeout(
        Duration::from_secs(20),
        admin.create_topics([&new], &options),
    )
    .await
    .unwrap_or_else(|_| panic!("creating topic {topic} on {brokers} timed out"))
    .unwrap_or_else(|e| panic!("creating topic {topic} on {brokers}: {e}"));
    for result in results {
        result.unwrap_or_else(|(t, code)| panic!("creating topic {t} on {brokers}: {code:?}"));
    }
}

/// One consumed record.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

impl Record {
    pub fn id(&self) -> Uuid {
        self.headers[HEADER_ID].parse().expect("outbox-id header")
    }
}

/// Reads every partition of `topic` from the start with `assign()` until `count` records
/// came (then half a second more, to catch duplicates); panics with the count on time-out.
pub async fn consume(
    brokers: &str,
    topic: &str,
    partitions: i32,
    count: usize,
    timeout: Duration,
) -> Vec<Record> {
    let records = consume_until(brokers, topic, partitions, count, timeout).await;
    assert!(
        records.len() >= count,
        "consumed {} of {count} records of {topic} on {brokers} within {timeout:?}",
        records.len()
    );
    records
}

/// Like [`consume`], but returns what came by the deadline instead of panicking.
pub async fn consume_until(
    brokers: &str,
    topic: &str,
    partitions: i32,
    count: usize,
    timeout: Duration,
) -> Vec<Record> {
    let (brokers, topic) = (brokers.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("outbox-test-{topic}"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let mut assignment = TopicPartitionList::new();
        for partition in 0..partitions {
            assignment
                .add_partition_offset(&topic, partition, Offset::Beginning)
                .expect("assignment");
        }
        consumer.assign(&assignment).expect("assign");
        let deadline = Instant::now() + timeout;
        let mut settle: Option<Instant> = None;
        let mut records = Vec::new();
        while settle.is_none_or(|t| Instant::now() < t) {
            if Instant::now() >= deadline {
                break;
            }
            if let Some(message) = consumer.poll(Duration::from_millis(100)) {
                let m = message.unwrap_or_else(|e| panic!("consuming {topic}: {e}"));
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                let value = String::from_utf8(h.value.unwrap_or_default().to_vec());
                                (h.key.to_string(), value.expect("UTF-8 header"))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                records.push(Record {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m
                        .key()
                        .map(|k| String::from_utf8(k.to_vec()).expect("UTF-8 key")),
                    payload: m.payload().unwrap_or_default().to_vec(),
                    headers,
                });
            }
            if records.len() >= count && settle.is_none() {
                settle = Some(Instant::now() + Duration::from_millis(500));
            }
        }
        records
    })
    .await
    .expect("consumer task")
}
