//! Kafka: the broker's address, topics made with the admin client, a consumer that reads
//! partitions with `assign()` (no group join, which is slow on tansu), and a tansu of a
//! test's own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication, TopicResult};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Headers, Message as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::Service;

/// The broker under test: `$OUTBOX_TEST_KAFKA_BROKERS` or the local tansu.
pub fn brokers() -> String {
    Service::Kafka.url()
}

/// [`brokers`], once the first of them accepts connections; panics naming it otherwise.
pub fn require_broker() -> String {
    Service::Kafka.require()
}

/// Creates `topic` with `partitions` partitions; panics when it cannot.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    if let Err(error) = try_create_topic(brokers, topic, partitions, &[]).await {
        panic!("{error}");
    }
}

/// Creates `topic` with `partitions` partitions and the topic settings `configs`.
pub async fn try_create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
    configs: &[(&str, &str)],
) -> Result<(), String> {
    let what = format!("creating topic {topic}");
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for (name, value) in configs {
        new = new.set(name, value);
    }
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    admin_call(brokers, &what, |admin| async move {
        admin.create_topics([&new], &options).await
    })
    .await
}

/// Deletes `topics`, saying what failed.
pub async fn delete_topics(brokers: &str, topics: &[&str]) -> Result<(), String> {
    let what = format!("deleting topics {topics:?}");
    admin_call(brokers, &what, |admin| async move {
        admin.delete_topics(topics, &AdminOptions::new()).await
    })
    .await
}

/// Runs one call of an admin client on `brokers` within 20 s, and fails naming `what` when
/// the call or one of its topics failed.
async fn admin_call<F, Fut>(brokers: &str, what: &str, call: F) -> Result<(), String>
where
    F: FnOnce(AdminClient<DefaultClientContext>) -> Fut,
    Fut: std::future::Future<Output = KafkaResult<Vec<TopicResult>>>,
{
    let failed = |e: &dyn std::fmt::Display| format!("{what} on {brokers}: {e}");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| failed(&e))?;
    let results = tokio::time::timeout(Duration::from_secs(20), call(admin))
        .await
        .map_err(|_| failed(&"timed out"))?
        .map_err(|e| failed(&e))?;
    for result in results {
        result.map_err(|(_, code)| failed(&format_args!("{code:?}")))?;
    }
    Ok(())
}

/// One consumed record, owned.
#[derive(Debug, Clone)]
pub struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
    /// The record's timestamp in milliseconds since the epoch, when it has one.
    pub timestamp: Option<i64>,
    /// Whether [`Record::timestamp`] is the producer's (`CreateTime`) rather than the
    /// broker's (`LogAppendTime`).
    pub create_time: bool,
}

impl Record {
    /// The value of header `name`, if the record has it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// Reads partitions `0..partitions` of `topic` from the start until `count` records came
/// (then half a second more, to catch duplicates); panics with the count on time-out.
pub async fn consume(
    brokers: &str,
    topic: &str,
    partitions: i32,
    count: usize,
    timeout: Duration,
) -> Vec<Record> {
    let records = consume_until(brokers, &[topic], partitions, count, timeout).await;
    assert!(
        records.len() >= count,
        "consumed {} of {count} records of {topic} on {brokers} within {timeout:?}",
        records.len()
    );
    records
}

/// Like [`consume`], reading partitions `0..partitions` of each of `topics`, and returning
/// what came by the deadline instead of panicking.
pub async fn consume_until(
    brokers: &str,
    topics: &[&str],
    partitions: i32,
    count: usize,
    timeout: Duration,
) -> Vec<Record> {
    let brokers = brokers.to_string();
    let topics: Vec<String> = topics.iter().map(|t| t.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("outbox-test-{}", topics.join("-")))
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let mut assignment = TopicPartitionList::new();
        for topic in &topics {
            for partition in 0..partitions {
                assignment
                    .add_partition_offset(topic, partition, Offset::Beginning)
                    .expect("assignment");
            }
        }
        consumer.assign(&assignment).expect("assign");
        let deadline = Instant::now() + timeout;
        let mut settle: Option<Instant> = None;
        let mut records = Vec::new();
        while settle.is_none_or(|t| Instant::now() < t) && Instant::now() < deadline {
            if let Some(message) = consumer.poll(Duration::from_millis(100)) {
                let m = message.unwrap_or_else(|e| panic!("consuming {topics:?}: {e}"));
                records.push(record(&m));
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

fn record(m: &rdkafka::message::BorrowedMessage<'_>) -> Record {
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
    Record {
        topic: m.topic().to_string(),
        partition: m.partition(),
        offset: m.offset(),
        key: m
            .key()
            .map(|k| String::from_utf8(k.to_vec()).expect("UTF-8 key")),
        payload: m.payload().unwrap_or_default().to_vec(),
        headers,
        timestamp: m.timestamp().to_millis(),
        create_time: matches!(m.timestamp(), rdkafka::Timestamp::CreateTime(_)),
    }
}

/// tansu: `$OUTBOX_TEST_TANSU`, else `$CARGO_HOME/bin/tansu` (where `cargo xtask services`
/// installs it), else `tansu` on the PATH.
pub fn tansu_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("OUTBOX_TEST_TANSU") {
        return path.into();
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    match home.map(|h| h.join("bin").join("tansu")) {
        Some(path) if path.is_file() => path,
        _ => PathBuf::from("tansu"),
    }
}

/// A tansu of a test's own, in memory, killed when dropped. Kafka clients connect to the
/// address a broker advertises, not the one they were given, so a proxy in front of the
/// shared broker would be bypassed: a test that breaks the link runs a tansu that
/// advertises the proxy.
pub struct Tansu {
    child: tokio::process::Child,
    log: PathBuf,
}

impl Tansu {
    /// Starts [`tansu_binary`] listening on `listen` and telling clients to connect to
    /// `advertised`, its output in `log`; returns once it listens (at most 20 s).
    pub async fn start(listen: &str, advertised: &str, log: PathBuf) -> Result<Tansu, String> {
        let binary = tansu_binary();
        let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let stdout = file
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let child = tokio::process::Command::new(&binary)
            .args(["broker", "--listener-url", &format!("tcp://{listen}")])
            .args(["--advertised-listener-url", &format!("tcp://{advertised}")])
            .args(["--storage-engine", "memory://tansu/"])
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                format!(
                    "starting tansu ({}; `cargo xtask services` installs it): {e}",
                    binary.display()
                )
            })?;
        let tansu = Tansu { child, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(listen).await.is_err() {
            if Instant::now() >= deadline {
                return Err(format!(
                    "tansu did not listen on {listen} within 20 s; see {}",
                    tansu.log.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(tansu)
    }

    /// Where its output goes.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Kills it and waits for it to exit.
    pub async fn stop(&mut self) -> std::io::Result<()> {
        self.child.kill().await
    }
}
