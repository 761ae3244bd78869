//! The Kafka sink behind the relay, against the real PostgreSQL and a real Kafka-protocol
//! broker: tansu at `$OUTBOX_TEST_KAFKA_BROKERS` (default `127.0.0.1:9092`), a tansu of the
//! test's own behind a proxy for the outage, and librdkafka's mock cluster for injected
//! broker errors. Each test uses topics of its own. Tests of the sink alone are in
//! outbox-kafka/tests/broker.rs (tansu) and outbox-kafka/tests/mock.rs (mock cluster).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::{NewMessage, TraceContext};
use outbox_kafka::rdkafka::mocking::MockCluster;
use outbox_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use outbox_kafka::{HEADER_CREATED_AT, HEADER_TOPIC, KafkaConfig, KafkaSink};
use outbox_tests::kafka::{Record, consume, create_topic, require_broker};
use outbox_tests::{Proxy, TestOutbox, unique_name};
use uuid::Uuid;

fn sink(config: KafkaConfig) -> Arc<KafkaSink> {
    Arc::new(KafkaSink::new(config).expect("valid sink configuration"))
}

/// Receipts kept with the delivered rows (retention on): id → `partition:offset`.
async fn receipts(outbox: &TestOutbox) -> HashMap<Uuid, String> {
    sqlx::query_as::<_, (Uuid, String)>(&format!(
        "SELECT id, receipt FROM {}",
        outbox.table.qualified("_delivered")
    ))
    .fetch_all(&outbox.pool)
    .await
    .expect("delivered rows")
    .into_iter()
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_through_postgres_and_the_relay() {
    let brokers = require_broker();
    let topic = unique_name("orders");
    let other = unique_name("users");
    create_topic(&brokers, &topic, 3).await;
    create_topic(&brokers, &other, 1).await;
    let outbox = TestOutbox::with_config(|c| c.retention = Some(Duration::from_secs(3600))).await;
    let messages = vec![
        NewMessage::new("orders", (0..=255u8).rev().collect::<Vec<u8>>())
            .key("order-1")
            .header("content-type", "application/octet-stream")
            .header("x-tenant", "acme")
            .trace_context(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: Some("rojo=00f067aa0ba902b7".into()),
            }),
        NewMessage::new("orders", vec![0xc3, 0x28, 0x00, 0xff]).key("order-2"),
        NewMessage::json("orders", &BTreeMap::from([("order", 3)]))
            .unwrap()
            .key("order-1"),
        NewMessage::new("users", "no key, other topic"),
    ];
    outbox.enqueue(&messages).await;
    let config = KafkaConfig::new(&brokers)
        .topic("orders", &topic)
        .topic("users", &other);
    let relay = outbox.relay("kafka-w1", sink(config));
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;
    assert_eq!(outbox.stats().await.dead_lettered, 0);

    let orders = consume(&brokers, &topic, 3, 3, Duration::from_secs(20)).await;
    let users = consume(&brokers, &other, 1, 1, Duration::from_secs(20)).await;
    assert_eq!(orders.len(), 3, "each once: {orders:?}");
    assert_eq!(users.len(), 1, "each once: {users:?}");
    let order_1: Vec<Uuid> = orders
        .iter()
        .filter(|r| r.key.as_deref() == Some("order-1"))
        .map(Record::id)
        .collect();
    assert_eq!(
        order_1,
        [messages[0].id, messages[2].id],
        "one key in enqueue order"
    );

    let kept = receipts(&outbox).await;
    let by_id: HashMap<Uuid, &Record> = orders.iter().chain(&users).map(|r| (r.id(), r)).collect();
    for message in &messages {
        let record = by_id[&message.id];
        assert_eq!(
            record.payload, message.payload,
            "payload bytes of {}",
            message.id
        );
        assert_eq!(record.key, message.key, "key of {}", message.id);
        assert_eq!(record.headers[HEADER_TOPIC], message.topic);
        let created =
            chrono::DateTime::parse_from_rfc3339(&record.headers[HEADER_CREATED_AT]).unwrap();
        assert_eq!(
            created.timestamp_micros(),
            message.created_at.timestamp_micros()
        );
        for (name, value) in &message.headers {
            assert_eq!(
                record.headers.get(name),
                Some(value),
                "header {name} of {}",
                message.id
            );
        }
        assert_eq!(
            kept[&message.id],
            format!("{}:{}", record.partition, record.offset),
            "the receipt is partition:offset"
        );
    }
    let first = by_id[&messages[0].id];
    assert_eq!(
        first.headers["traceparent"],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert_eq!(first.headers["tracestate"], "rojo=00f067aa0ba902b7");
    assert!(!by_id[&messages[3].id].headers.contains_key("traceparent"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_over_5000_messages_and_50_keys_with_two_relays() {
    const MESSAGES: usize = 5_000;
    const KEYS: usize = 50;
    let brokers = require_broker();
    let topic = unique_name("order");
    create_topic(&brokers, &topic, 3).await;
    let outbox = TestOutbox::new().await;
    let messages: Vec<NewMessage> = (0..MESSAGES)
        .map(|i| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % KEYS)))
        .collect();
    for chunk in messages.chunks(500) {
        outbox.enqueue(chunk).await;
    }
    let config = KafkaConfig::new(&brokers).topic_template(&topic);
    let started = Instant::now();
    let relays = [
        outbox.relay("kafka-a", sink(config.clone())),
        outbox.relay("kafka-b", sink(config)),
    ];
    outbox.wait_until_drained(Duration::from_secs(180)).await;
    let elapsed = started.elapsed();
    for relay in relays {
        relay.stop().await;
    }
    assert_eq!(outbox.stats().await.dead_lettered, 0);

    let records = consume(&brokers, &topic, 3, MESSAGES, Duration::from_secs(60)).await;
    assert_eq!(records.len(), MESSAGES, "every message once");
    let ids: HashSet<Uuid> = records.iter().map(Record::id).collect();
    assert_eq!(
        ids,
        messages.iter().map(|m| m.id).collect(),
        "no duplicates, none missing"
    );
    let mut by_key: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for record in &records {
        by_key
            .entry(record.key.clone().expect("keyed"))
            .or_default()
            .push(record);
    }
    assert_eq!(by_key.len(), KEYS);
    let partitions: HashSet<i32> = records.iter().map(|r| r.partition).collect();
    assert_eq!(partitions.len(), 3, "50 keys spread over the 3 partitions");
    for (key, records) in &by_key {
        assert!(
            records.iter().all(|r| r.partition == records[0].partition),
            "key {key} in one partition"
        );
        let seqs: Vec<usize> = records
            .iter()
            .map(|r| {
                String::from_utf8(r.payload.clone())
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        let expected: Vec<usize> = (0..MESSAGES)
            .filter(|i| format!("k{}", i % KEYS) == *key)
            .collect();
        assert_eq!(seqs, expected, "key {key} in enqueue order");
    }
    println!(
        "kafka (tansu): {MESSAGES} messages, {KEYS} keys, 3 partitions, 2 relays: {elapsed:?} ({:.0} messages/s)",
        MESSAGES as f64 / elapsed.as_secs_f64()
    );
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
    let ids: HashSet<Uuid> = records.iter().map(Record::id).collect();
    assert_eq!(records.len(), fine.len());
    assert_eq!(ids, fine.iter().map(|m| m.id).collect());
}

/// A tansu of this test's own, killed on drop.
struct OwnTansu {
    child: std::process::Child,
    log: PathBuf,
}

impl Drop for OwnTansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// tansu: `$OUTBOX_TEST_TANSU`, else ~/.cargo/bin/tansu (where `cargo xtask services`
/// installs it), else `tansu` on the PATH.
fn tansu_binary() -> PathBuf {
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

/// `127.0.0.1:port` with a port that was free a moment ago.
fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").to_string()
}

/// Starts tansu listening on `listen` and telling clients to connect to `advertised`.
async fn start_own_tansu(listen: &str, advertised: &str) -> OwnTansu {
    let log = std::env::temp_dir().join(format!("{}.log", unique_name("outbox-test-tansu")));
    let binary = tansu_binary();
    let child = std::process::Command::new(&binary)
        .args(["broker", "--listener-url", &format!("tcp://{listen}")])
        .args(["--advertised-listener-url", &format!("tcp://{advertised}")])
        .args(["--storage-engine", "memory://tansu/"])
        .stdout(std::fs::File::create(&log).expect("tansu log"))
        .stderr(std::fs::File::create(&log).expect("tansu log"))
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "tansu must be installed ({}; `cargo xtask services` installs it): {e}",
                binary.display()
            )
        });
    let tansu = OwnTansu { child, log };
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(listen).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "tansu did not listen on {listen} within 20 s; see {}",
            tansu.log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tansu
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_charges_no_attempt_and_everything_arrives_once_back() {
    // Kafka clients connect to the address the broker advertises, not the one they were
    // given, so a proxy in front of the shared broker would be bypassed: this test runs a
    // tansu of its own that advertises the proxy.
    let outbox = TestOutbox::new().await;
    let listen = free_addr();
    let proxy = Proxy::start(&listen).await;
    let _tansu = start_own_tansu(&listen, &proxy.addr()).await;
    let brokers = proxy.addr();
    let topic = unique_name("outage");
    create_topic(&brokers, &topic, 3).await;

    let mut config = KafkaConfig::new(&brokers).topic_template(&topic);
    config.delivery_timeout = Duration::from_secs(3);
    config.health_timeout = Duration::from_secs(1);
    let relay = outbox.relay("kafka-outage", sink(config));
    let first: Vec<NewMessage> = (0..50)
        .map(|i| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % 5)))
        .collect();
    outbox.enqueue(&first).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;

    proxy.cut();
    let second: Vec<NewMessage> = (50..250)
        .map(|i| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % 5)))
        .collect();
    outbox.enqueue(&second).await;
    // A batch claimed before the relay noticed the cut fails within the delivery time-out
    // (plus the sink's 5 s grace) and is released; after that the health gate holds.
    tokio::time::sleep(Duration::from_secs(2)).await;
    wait_for(&outbox, "the batch in flight released", |s| {
        s.in_flight == 0
    })
    .await;
    let stats = outbox.stats().await;
    assert_eq!(stats.pending, 200, "nothing delivered while cut: {stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    let attempts = outbox.attempts().await;
    assert_eq!(attempts.len(), 200);
    assert!(
        attempts.iter().all(|&a| a == 0),
        "an outage charges no attempt: {attempts:?}"
    );

    proxy.restore();
    drained_with_no_dead_letters(&outbox, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_eq!(outbox.stats().await.dead_lettered, 0);
    let records = consume(&brokers, &topic, 3, 250, Duration::from_secs(30)).await;
    assert_eq!(records.len(), 250, "everything delivered once");
    let ids: HashSet<Uuid> = records.iter().map(Record::id).collect();
    assert_eq!(ids, first.iter().chain(&second).map(|m| m.id).collect());
    let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for r in &records {
        let seq = String::from_utf8(r.payload.clone())
            .unwrap()
            .parse()
            .unwrap();
        by_key
            .entry(r.key.as_deref().unwrap())
            .or_default()
            .push(seq);
    }
    for (key, seqs) in by_key {
        assert!(
            seqs.is_sorted(),
            "key {key} in enqueue order across the outage: {seqs:?}"
        );
    }
}

/// Waits until nothing is pending or in flight; panics at once, with the reasons, if
/// anything is dead-lettered meanwhile.
async fn drained_with_no_dead_letters(outbox: &TestOutbox, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let stats = outbox.stats().await;
        if stats.dead_lettered > 0 {
            panic!("dead-lettered: {:?}", outbox.dead_letters().await);
        }
        if stats.pending == 0 && stats.in_flight == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not drained within {timeout:?}: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `check` holds for the outbox, polling; panics with `what` on time-out.
async fn wait_for(
    outbox: &TestOutbox,
    what: &str,
    check: impl Fn(&outbox_core::QueueStats) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = outbox.stats().await;
        if check(&stats) {
            return;
        }
        assert!(Instant::now() < deadline, "{what} within 30 s: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
        .topic_template(&topic)
        .property("retry.backoff.ms", "10");
    config.delivery_timeout = Duration::from_secs(5);
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
        wait_for(&outbox, &format!("{reason} dead-lettered"), |s| {
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
    let attempts: HashMap<Uuid, i32> = sqlx::query_as::<_, (Uuid, i32)>(&format!(
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
    let ids: Vec<Uuid> = records.iter().map(Record::id).collect();
    let expected: HashSet<Uuid> = retried
        .iter()
        .chain([&desync, &after])
        .map(|m| m.id)
        .collect();
    assert_eq!(ids.len(), expected.len(), "once each: {records:?}");
    assert_eq!(ids.into_iter().collect::<HashSet<_>>(), expected);
    let receipts = receipts(&outbox).await;
    for record in &records {
        assert_eq!(
            receipts[&record.id()],
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
        config.delivery_timeout = Self::DELIVERY;
        config.health_timeout = Self::DELIVERY;
        config
    }
}

#[async_trait::async_trait]
impl outbox_tests::conformance::SinkHarness for Harness {
    fn timeout(&self) -> Duration {
        // A publish waits up to the delivery time-out plus the sink's 5 s grace.
        Self::DELIVERY * 2
    }

    async fn destination(&self) -> outbox_tests::conformance::Destination {
        let topic = unique_name("conformance");
        create_topic(&self.brokers, &topic, 3).await;
        outbox_tests::conformance::Destination {
            sink: sink(Self::config(&self.brokers)),
            topic,
        }
    }

    async fn read(
        &self,
        destination: &outbox_tests::conformance::Destination,
        at_least: usize,
    ) -> Vec<outbox_tests::conformance::Received> {
        let mut records = outbox_tests::kafka::consume_until(
            &self.brokers,
            &destination.topic,
            3,
            at_least,
            Duration::from_secs(10),
        )
        .await;
        records.sort_by_key(|r| (r.partition, r.offset));
        records
            .into_iter()
            .map(|r| outbox_tests::conformance::Received {
                payload: r.payload,
                headers: r.headers,
                key: r.key,
            })
            .collect()
    }

    async fn sink_at(&self, addr: &str) -> Arc<dyn outbox_core::Sink> {
        sink(Self::config(addr))
    }

    /// A message for a topic that does not exist (tansu does not create topics).
    async fn refused(
        &self,
        _destination: &outbox_tests::conformance::Destination,
    ) -> Option<outbox_core::Message> {
        Some(outbox_core::Message::from(NewMessage::new(
            unique_name("missing"),
            "refused",
        )))
    }
}

mod conformance {
    outbox_tests::sink_conformance_tests!(super::Harness::new());
}
