//! Helpers for the sink's tests: the broker address, topics, and a consumer that reads
//! partitions with `assign()` (no group join, which is slow on tansu).

#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::{Message, NewMessage};
use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::message::{Headers, Message as _};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// The Kafka-protocol broker under test: $OUTBOX_TEST_KAFKA_BROKERS or tansu's default.
pub fn brokers() -> String {
    std::env::var("OUTBOX_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// Panics, naming the address, when the broker's port is closed: a missing broker must
/// fail the suite, never skip it.
pub fn require_broker() -> String {
    let brokers = brokers();
    let first = brokers
        .split(',')
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    if let Err(e) = std::net::TcpStream::connect_timeout(
        &first
            .parse()
            .unwrap_or_else(|e| panic!("OUTBOX_TEST_KAFKA_BROKERS `{first}`: {e}")),
        Duration::from_secs(3),
    ) {
        panic!(
            "no Kafka-protocol broker at {first} ({e}); start tansu: tansu broker --listener-url tcp://{first} --advertised-listener-url tcp://{first} --storage-engine memory://tansu/ (or set OUTBOX_TEST_KAFKA_BROKERS)"
        );
    }
    brokers
}

/// A topic name of its own for one test.
pub fn unique_topic(prefix: &str) -> String {
    format!("{prefix}_{:016x}", fastrand::u64(..))
}

/// Creates `topic` with `partitions` partitions and the given topic configs.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32, configs: &[(&str, &str)]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for (k, v) in configs {
        new = new.set(k, v);
    }
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = tokio::time::timeout(
        Duration::from_secs(20),
        admin.create_topics([&new], &options),
    )
    .await
    .unwrap_or_else(|_| panic!("creating topic {topic} on {brokers} timed out"))
    .unwrap_or_else(|e| panic!("creating topic {topic} on {brokers}: {e}"));
    for result in results {
        result.unwrap_or_else(|(t, code)| panic!("creating topic {t}: {code:?}"));
    }
}

/// One consumed record, owned.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads partitions `0..partitions` of `topic` from the beginning until `count` records
/// arrived; panics with what it got after `timeout`. Waits a little longer to catch
/// records beyond `count` (duplicates).
pub async fn consume(
    brokers: &str,
    topic: &str,
    partitions: i32,
    count: usize,
    timeout: Duration,
) -> Vec<Record> {
    let brokers = brokers.to_string();
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("outbox-test-{topic}"))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .create()
            .expect("consumer");
        let mut assignment = TopicPartitionList::new();
        for p in 0..partitions {
            assignment
                .add_partition_offset(&topic, p, Offset::Beginning)
                .expect("partition offset");
        }
        consumer.assign(&assignment).expect("assign");
        let mut records = Vec::new();
        let deadline = std::time::Instant::now() + timeout;
        let mut extra_until: Option<std::time::Instant> = None;
        loop {
            let now = std::time::Instant::now();
            if extra_until.is_some_and(|t| now >= t) {
                break;
            }
            if now >= deadline {
                panic!(
                    "consumed {} of {count} records from {topic} on {brokers} within {timeout:?}",
                    records.len()
                );
            }
            match consumer.poll(Duration::from_millis(200)) {
                None => {}
                Some(Err(e)) => panic!("consuming {topic}: {e}"),
                Some(Ok(m)) => {
                    let headers = m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| {
                                    (
                                        h.key.to_string(),
                                        String::from_utf8_lossy(h.value.unwrap_or_default())
                                            .into_owned(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    records.push(Record {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        payload: m.payload().unwrap_or_default().to_vec(),
                        headers,
                    });
                }
            }
            if records.len() >= count && extra_until.is_none() {
                extra_until = Some(std::time::Instant::now() + Duration::from_millis(500));
            }
        }
        records
    })
    .await
    .expect("consumer task")
}

/// Messages of `topic` for `keys` keys, `per_key` each, interleaved in enqueue order.
pub fn keyed_messages(topic: &str, keys: usize, per_key: usize) -> Vec<Message> {
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
pub fn by_key(records: &[Record]) -> HashMap<String, Vec<&Record>> {
    let mut map: HashMap<String, Vec<&Record>> = HashMap::new();
    for r in records {
        let key = String::from_utf8(r.key.clone().expect("keyed record")).expect("utf-8 key");
        map.entry(key).or_default().push(r);
    }
    map
}
