//! The Redis Streams sink against the real Redis (`$OUTBOX_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`): the conformance suite, with and without de-duplication, and the
//! relay end to end through the real PostgreSQL. Each test writes under a stream prefix of
//! its own. Tests of the sink alone are in outbox-redis/tests/broker.rs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::{Message, NewMessage, Outcome, Sink, Storage, TraceContext};
use outbox_redis::redis::{self, AsyncCommands, Value};
use outbox_redis::{RedisConfig, RedisSink, fields};
use outbox_tests::conformance::{Destination, Received, SinkHarness};
use outbox_tests::{Proxy, TestOutbox, unique_name};
use uuid::Uuid;

fn redis_url() -> String {
    std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A plain connection for the test's checks; panics loudly when Redis is not there.
async fn client() -> redis::aio::MultiplexedConnection {
    let url = redis_url();
    let connect = async {
        redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection_with_config(
                &redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(Duration::from_secs(30))),
            )
            .await
    };
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(e)) => {
            panic!("Redis must be running at {url} (start it with `cargo xtask services`): {e}")
        }
        Err(_) => panic!(
            "Redis at {url} did not answer within 5 s (start it with `cargo xtask services`)"
        ),
    }
}

/// A stream prefix no other test uses.
fn prefix() -> String {
    format!("{}:", unique_name("outbox_test"))
}

fn sink(config: RedisConfig) -> Arc<RedisSink> {
    Arc::new(RedisSink::new(config).expect("valid sink configuration"))
}

/// Entries of `stream`, oldest first: (entry id, fields).
async fn xrange(stream: &str) -> Vec<(String, BTreeMap<String, Vec<u8>>)> {
    let reply: Value = client().await.xrange_all(stream).await.expect("XRANGE");
    let Value::Array(entries) = reply else {
        panic!("XRANGE reply {reply:?}")
    };
    entries
        .into_iter()
        .map(|entry| {
            let Value::Array(mut parts) = entry else {
                panic!("entry {entry:?}")
            };
            let (Some(Value::Array(flat)), Some(id)) = (parts.pop(), parts.pop()) else {
                panic!("entry parts")
            };
            let id: String = redis::from_redis_value(id).expect("entry id");
            let fields = flat
                .chunks(2)
                .map(|pair| {
                    let name: String =
                        redis::from_redis_value(pair[0].clone()).expect("field name");
                    let value: Vec<u8> =
                        redis::from_redis_value(pair[1].clone()).expect("field value");
                    (name, value)
                })
                .collect();
            (id, fields)
        })
        .collect()
}

fn field(fields: &BTreeMap<String, Vec<u8>>, name: &str) -> String {
    let value = fields
        .get(name)
        .unwrap_or_else(|| panic!("entry has no field `{name}`: {fields:?}"));
    String::from_utf8(value.clone()).expect("text field")
}

fn entry_ids(entries: &[(String, BTreeMap<String, Vec<u8>>)]) -> Vec<Uuid> {
    entries
        .iter()
        .map(|(_, f)| field(f, fields::ID).parse().expect("uuid"))
        .collect()
}

async fn cleanup(prefix: &str) {
    let mut con = client().await;
    let keys: Vec<String> = con.keys(format!("{prefix}*")).await.expect("KEYS");
    if !keys.is_empty() {
        let _: () = con.del(keys).await.expect("DEL");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_through_postgres_and_the_relay() {
    let prefix = prefix();
    let _ = client().await;
    let outbox = TestOutbox::with_config(|c| c.retention = Some(Duration::from_secs(3600))).await;
    let binary: Vec<u8> = (0..=255u8).rev().collect();
    let messages = vec![
        NewMessage::new("orders", binary.clone())
            .key("order-1")
            .header("content-type", "application/octet-stream")
            .header("x-tenant", "acme")
            .trace_context(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: Some("rojo=00f067aa0ba902b7".into()),
            }),
        NewMessage::new("orders", vec![0xc3, 0x28, 0x00, 0xff]).key("order-2"),
        NewMessage::json("orders", &serde_like_json())
            .unwrap()
            .key("order-1"),
        NewMessage::new("users", "no key, other topic"),
    ];
    outbox.enqueue(&messages).await;
    let relay = outbox.relay(
        "redis-w1",
        sink(RedisConfig::new(redis_url()).stream_prefix(&prefix)),
    );
    outbox.wait_until_drained(Duration::from_secs(20)).await;
    relay.stop().await;

    let orders = xrange(&format!("{prefix}orders")).await;
    let users = xrange(&format!("{prefix}users")).await;
    assert_eq!(
        entry_ids(&orders),
        [messages[0].id, messages[1].id, messages[2].id],
        "each once, in order"
    );
    assert_eq!(entry_ids(&users), [messages[3].id]);

    let all: HashMap<Uuid, &BTreeMap<String, Vec<u8>>> = orders
        .iter()
        .chain(&users)
        .map(|(_, f)| (field(f, fields::ID).parse().unwrap(), f))
        .collect();
    for message in &messages {
        let f = all[&message.id];
        assert_eq!(
            f[fields::PAYLOAD],
            message.payload,
            "payload bytes of {}",
            message.id
        );
        assert_eq!(field(f, fields::TOPIC), message.topic);
        assert_eq!(
            f.get(fields::KEY)
                .map(|k| String::from_utf8(k.clone()).unwrap()),
            message.key
        );
        let headers: BTreeMap<String, String> = f
            .iter()
            .filter_map(|(name, value)| {
                let name = name.strip_prefix(fields::HEADER_PREFIX)?;
                Some((name.to_string(), String::from_utf8(value.clone()).unwrap()))
            })
            .collect();
        assert_eq!(headers, message.headers, "headers of {}", message.id);
        assert_eq!(
            f.get(fields::CONTENT_TYPE)
                .map(|v| String::from_utf8(v.clone()).unwrap()),
            message.headers.get("content-type").cloned()
        );
        let created = chrono::DateTime::parse_from_rfc3339(&field(f, fields::CREATED_AT)).unwrap();
        assert_eq!(
            created.timestamp_micros(),
            message.created_at.timestamp_micros()
        );
    }
    let first = all[&messages[0].id];
    assert_eq!(
        field(first, fields::TRACEPARENT),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert_eq!(field(first, fields::TRACESTATE), "rojo=00f067aa0ba902b7");

    // The receipt kept with each delivered row is its stream entry id.
    let receipts: HashMap<Uuid, String> = sqlx::query_as::<_, (Uuid, String)>(&format!(
        "SELECT id, receipt FROM {}",
        outbox.table.qualified("_delivered")
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let entry_of: HashMap<Uuid, String> = orders
        .iter()
        .chain(&users)
        .map(|(entry, f)| (field(f, fields::ID).parse().unwrap(), entry.clone()))
        .collect();
    assert_eq!(receipts, entry_of);
    cleanup(&prefix).await;
}

/// The sink under the shared conformance suite.
struct Harness {
    dedup: bool,
}

impl Harness {
    const TIMEOUT: Duration = Duration::from_secs(2);
    const PREFIX: &str = "outbox_conformance:";

    async fn new(dedup: bool) -> Harness {
        let _ = client().await; // fails loudly when Redis is not there
        Harness { dedup }
    }

    fn config(&self, url: String) -> RedisConfig {
        let mut config = RedisConfig::new(url)
            .stream_prefix(Self::PREFIX)
            .command_timeout(Self::TIMEOUT);
        // Low enough for the suite's size check to run.
        config.max_payload = 1024 * 1024;
        if self.dedup {
            config = config.dedup(Duration::from_secs(3600));
        }
        config
    }
}

#[async_trait]
impl SinkHarness for Harness {
    fn timeout(&self) -> Duration {
        Self::TIMEOUT
    }

    async fn destination(&self) -> Destination {
        Destination {
            sink: sink(self.config(redis_url())),
            topic: unique_name("conformance"),
        }
    }

    async fn read(&self, destination: &Destination, at_least: usize) -> Vec<Received> {
        let stream = format!("{}{}", Self::PREFIX, destination.topic);
        let mut con = client().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while con.xlen::<_, usize>(&stream).await.expect("XLEN") < at_least
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let entries = xrange(&stream).await;
        // Read once per destination: let it go in an hour.
        let _: bool = con.expire(&stream, 3600).await.expect("EXPIRE");
        entries
            .into_iter()
            .map(|(_, f)| Received {
                payload: f.get(fields::PAYLOAD).cloned().unwrap_or_default(),
                key: f
                    .get(fields::KEY)
                    .map(|k| String::from_utf8(k.clone()).expect("key")),
                headers: f
                    .iter()
                    .filter_map(|(name, value)| {
                        let name = name.strip_prefix(fields::HEADER_PREFIX)?;
                        Some((name.to_string(), String::from_utf8(value.clone()).ok()?))
                    })
                    .collect(),
            })
            .collect()
    }

    async fn sink_at(&self, addr: &str) -> Arc<dyn Sink> {
        sink(self.config(format!("redis://{addr}")))
    }

    /// A message for a stream key that holds a string: WRONGTYPE.
    async fn refused(&self, _destination: &Destination) -> Option<Message> {
        let topic = unique_name("wrongtype");
        let key = format!("{}{topic}", Self::PREFIX);
        let _: () = client()
            .await
            .set_ex(&key, "not a stream", 3600)
            .await
            .expect("SET");
        Some(Message::from(NewMessage::new(topic, "refused")))
    }
}

mod conformance {
    outbox_tests::sink_conformance_tests!(super::Harness::new(false).await);
}

mod conformance_with_dedup {
    outbox_tests::sink_conformance_tests!(super::Harness::new(true).await);
}

fn serde_like_json() -> BTreeMap<&'static str, u32> {
    BTreeMap::from([("order", 3)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_over_5000_messages_and_50_keys_with_two_relays() {
    const MESSAGES: usize = 5000;
    const KEYS: usize = 50;
    let prefix = prefix();
    let _ = client().await;
    let outbox = TestOutbox::new().await;
    let config = RedisConfig::new(redis_url())
        .stream_prefix(&prefix)
        .stream_template("events");
    let relays = [
        outbox.relay("redis-a", sink(config.clone())),
        outbox.relay("redis-b", sink(config)),
    ];
    let started = Instant::now();
    // Enqueued while the relays run, in several transactions.
    let messages: Vec<NewMessage> = (0..MESSAGES)
        .map(|i| {
            NewMessage::new(format!("t{}", i % 3), format!("{i}")).key(format!("k{}", i % KEYS))
        })
        .collect();
    for chunk in messages.chunks(500) {
        outbox.enqueue(chunk).await;
    }
    outbox.wait_until_drained(Duration::from_secs(120)).await;
    let elapsed = started.elapsed();
    for relay in relays {
        relay.stop().await;
    }

    let entries = xrange(&format!("{prefix}events")).await;
    let ids = entry_ids(&entries);
    assert_eq!(ids.len(), MESSAGES, "every message once");
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        MESSAGES,
        "no duplicates"
    );
    let mut by_key: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (_, f) in &entries {
        by_key
            .entry(field(f, fields::KEY))
            .or_default()
            .push(field(f, fields::PAYLOAD).parse().unwrap());
    }
    assert_eq!(by_key.len(), KEYS);
    for (key, seqs) in &by_key {
        let expected: Vec<usize> = (0..MESSAGES)
            .filter(|i| format!("k{}", i % KEYS) == *key)
            .collect();
        assert_eq!(seqs, &expected, "key {key} in enqueue order");
    }
    assert_eq!(outbox.stats().await.dead_lettered, 0);
    println!(
        "redis: {MESSAGES} messages, {KEYS} keys, 2 relays: {elapsed:?} ({:.0} messages/s)",
        MESSAGES as f64 / elapsed.as_secs_f64()
    );
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_charges_no_attempt_and_everything_arrives_once_back() {
    let prefix = prefix();
    let _ = client().await;
    let outbox = TestOutbox::new().await;
    let proxy = Proxy::start(&outbox_tests::host_port(&redis_url())).await;
    let config = RedisConfig::new(format!("redis://{}", proxy.addr()))
        .stream_prefix(&prefix)
        .command_timeout(Duration::from_secs(1));
    let relay = outbox.relay("redis-outage", sink(config));
    let first: Vec<NewMessage> = (0..50)
        .map(|i| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % 5)))
        .collect();
    outbox.enqueue(&first).await;
    outbox.wait_until_drained(Duration::from_secs(20)).await;

    proxy.cut();
    let second: Vec<NewMessage> = (50..250)
        .map(|i| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % 5)))
        .collect();
    outbox.enqueue(&second).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stats = outbox.stats().await;
    assert_eq!(stats.pending, 200, "nothing delivered while cut: {stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    let attempts: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT attempts FROM {}",
        outbox.table.qualified("")
    ))
    .fetch_all(&outbox.pool)
    .await
    .unwrap();
    assert_eq!(attempts.len(), 200);
    assert!(
        attempts.iter().all(|&a| a == 0),
        "an outage charges no attempt: {attempts:?}"
    );

    proxy.restore();
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;
    assert_eq!(outbox.stats().await.dead_lettered, 0);
    let ids = entry_ids(&xrange(&format!("{prefix}t")).await);
    let expected: Vec<Uuid> = first.iter().chain(&second).map(|m| m.id).collect();
    assert_eq!(ids.len(), 250, "everything delivered once");
    assert_eq!(
        ids.iter().collect::<HashSet<_>>(),
        expected.iter().collect::<HashSet<_>>()
    );
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrongtype_is_dead_lettered_and_the_rest_flow() {
    let prefix = prefix();
    let mut con = client().await;
    let _: () = con
        .set(format!("{prefix}broken"), "a string, not a stream")
        .await
        .unwrap();
    let outbox = TestOutbox::new().await;
    let mut messages: Vec<NewMessage> = (0..20)
        .map(|i| NewMessage::new("good", format!("{i}")).key(format!("k{i}")))
        .collect();
    let bad = NewMessage::new("broken", "never fits").key("bad-key");
    messages.insert(7, bad.clone());
    outbox.enqueue(&messages).await;
    let relay = outbox.relay(
        "redis-wrongtype",
        sink(RedisConfig::new(redis_url()).stream_prefix(&prefix)),
    );
    outbox.wait_until_drained(Duration::from_secs(20)).await;
    relay.stop().await;

    let dead = outbox.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, bad.id);
    assert!(
        dead[0].1.contains("WRONGTYPE"),
        "the error is kept: {}",
        dead[0].1
    );
    let good: Vec<Uuid> = messages
        .iter()
        .filter(|m| m.topic == "good")
        .map(|m| m.id)
        .collect();
    assert_eq!(entry_ids(&xrange(&format!("{prefix}good")).await), good);
    let kind: String = redis::cmd("TYPE")
        .arg(format!("{prefix}broken"))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(kind, "string", "the key was left alone");
    cleanup(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_keeps_a_batch_redelivered_after_a_crash_once() {
    for dedup in [true, false] {
        let prefix = prefix();
        let _ = client().await;
        let outbox = TestOutbox::new().await;
        let mut config = RedisConfig::new(redis_url()).stream_prefix(&prefix);
        if dedup {
            config = config.dedup(Duration::from_secs(600));
        }
        let messages: Vec<NewMessage> = (0..30)
            .map(|i| NewMessage::new("t", format!("{i}")).key(format!("k{i}")))
            .collect();
        outbox.enqueue(&messages).await;

        // A relay claims the batch, publishes it and dies before recording the delivery.
        let claim = outbox
            .storage
            .claim("crashed", 100, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(claim.messages.len(), 30);
        let crashed = RedisSink::new(config.clone()).unwrap();
        let outcomes = crashed.publish(&claim.messages).await.unwrap();
        assert!(outcomes.iter().all(|o| matches!(o, Outcome::Delivered(_))));
        drop(crashed);

        // Once its lease runs out, another relay publishes the same batch again.
        let relay = outbox.relay("redis-dedup", sink(config));
        outbox.wait_until_drained(Duration::from_secs(20)).await;
        relay.stop().await;

        let ids = entry_ids(&xrange(&format!("{prefix}t")).await);
        let unique: HashSet<&Uuid> = ids.iter().collect();
        assert_eq!(unique.len(), 30, "every message arrived");
        if dedup {
            assert_eq!(ids.len(), 30, "de-duplication on: each message once");
        } else {
            assert_eq!(
                ids.len(),
                60,
                "de-duplication off: the redelivery shows up twice"
            );
        }
        let mut con = client().await;
        let keys: Vec<String> = messages
            .iter()
            .map(|m| format!("outbox:dedup:{}", m.id))
            .collect();
        let _: () = con.del(keys).await.unwrap();
        cleanup(&prefix).await;
    }
}
