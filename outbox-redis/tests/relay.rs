//! The Redis Streams sink against the real Redis (`$OUTBOX_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`): the conformance suite, with and without de-duplication, and the
//! end-to-end scripts through the real PostgreSQL. Each test writes under a stream prefix of
//! its own. Tests of the sink alone are in outbox-redis/tests/broker.rs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::{Message, NewMessage, Sink};
use outbox_redis::redis::{self, AsyncCommands};
use outbox_redis::{RedisConfig, RedisSink, wire};
use outbox_test_support::envelope::{assert_envelope, publish_full_and_bare};
use outbox_test_support::redis::{Entry, client, delete_prefixed, text, xlen, xrange};
use outbox_test_support::relay::TestOutbox;
use outbox_test_support::relay::end_to_end::{self, Arrived, Fixture, trace_context};
use outbox_test_support::{Service, through, unique_name};
use outbox_testkit::{Destination, Received, SinkHarness};
use uuid::Uuid;

fn sink(config: RedisConfig) -> Arc<RedisSink> {
    Arc::new(RedisSink::new(config).expect("valid sink configuration"))
}

/// The headers of an entry: its fields named `header:<name>`.
fn headers(fields: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, String> {
    fields
        .iter()
        .filter_map(|(name, value)| {
            let name = name.strip_prefix(wire::HEADER_PREFIX)?;
            let value = String::from_utf8(value.clone()).expect("text header");
            Some((name.to_string(), value))
        })
        .collect()
}

/// A field that not every entry has, as text.
fn optional(fields: &BTreeMap<String, Vec<u8>>, name: &str) -> Option<String> {
    fields
        .get(name)
        .map(|v| String::from_utf8(v.clone()).expect("text field"))
}

/// The message ids of `entries`, in stream order.
fn entry_ids(entries: &[Entry]) -> Vec<Uuid> {
    entries
        .iter()
        .map(|(_, f)| text(f, wire::ID).parse().expect("uuid"))
        .collect()
}

/// The sink under the end-to-end scripts: each destination is a stream prefix of its own,
/// one stream per topic.
struct Redis {
    dedup: bool,
}

struct Streams {
    prefix: String,
    topics: Vec<String>,
}

#[async_trait]
impl Fixture for Redis {
    type Native = Entry;
    type Destination = Streams;

    const SERVICE: Service = Service::Redis;

    async fn destination(&self, topics: &[&str], _via: Option<&str>) -> Streams {
        let _ = client().await; // fails loudly when Redis is not there
        Streams {
            prefix: format!("{}:", unique_name("outbox_test")),
            topics: topics.iter().map(|t| t.to_string()).collect(),
        }
    }

    async fn sink(&self, streams: &Streams, via: Option<&str>) -> Arc<dyn Sink> {
        let url = outbox_test_support::redis::url();
        let mut config = RedisConfig::new(via.map_or(url.clone(), |addr| through(&url, addr)))
            .stream_prefix(&streams.prefix);
        config.dedup_key_prefix = format!("{}dedup:", streams.prefix);
        if via.is_some() {
            config = config.publish_timeout(Duration::from_secs(1));
        }
        if self.dedup {
            config = config.dedup(Duration::from_secs(600));
        }
        sink(config)
    }

    async fn read(&self, streams: &Streams, count: usize) -> Vec<Arrived<Entry>> {
        let names: Vec<String> = streams
            .topics
            .iter()
            .map(|t| format!("{}{t}", streams.prefix))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut held = 0;
            for name in &names {
                held += xlen(name).await;
            }
            if held >= count {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{held} of {count} entries in {names:?} within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut arrived = Vec::new();
        for name in &names {
            for entry in xrange(name).await {
                let fields = &entry.1;
                arrived.push(Arrived {
                    id: text(fields, wire::ID).parse().expect("uuid"),
                    topic: text(fields, wire::TOPIC),
                    key: optional(fields, wire::KEY),
                    payload: fields[wire::PAYLOAD].clone(),
                    headers: headers(fields),
                    trace_context: trace_context(
                        optional(fields, wire::TRACEPARENT),
                        optional(fields, wire::TRACESTATE),
                    ),
                    // The receipt is the entry id.
                    receipt: Some(entry.0.clone()),
                    native: entry,
                });
            }
        }
        arrived
    }

    async fn cleanup(&self, streams: &Streams) {
        delete_prefixed(&streams.prefix).await;
    }
}

/// Through PostgreSQL and the relay, each entry holds the envelope under its documented
/// field names (read with the plain redis client), the payload, and every header as
/// `header:<name>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_through_postgres_and_the_relay() {
    for (message, got) in end_to_end::round_trip(&Redis { dedup: false }).await {
        let fields = &got.native.1;
        assert_eq!(got.headers, message.headers, "headers of {}", message.id);
        assert_envelope(&Message::from(message.clone()), "entry", |name| {
            optional(fields, name)
        });
        let names: Vec<&str> = fields.keys().map(String::as_str).collect();
        for name in names {
            assert!(
                name == "payload"
                    || name.starts_with("header:")
                    || outbox_test_support::envelope::NAMES.contains(&name),
                "unexpected field {name} in {}",
                message.id
            );
        }
    }
}

/// The sink alone: the entry's envelope read by its documented names with the plain redis
/// client, for a message with every field and one with none of the optional ones; an
/// application header named like an envelope field stays a `header:` field and does not
/// change the envelope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelope_fields_are_read_by_their_documented_names() {
    let prefix = format!("{}:", unique_name("outbox_test"));
    let _ = client().await;
    let sink = sink(RedisConfig::new(outbox_test_support::redis::url()).stream_prefix(&prefix));
    let [full, bare] = publish_full_and_bare(&*sink, "orders").await;
    let entries = xrange(&format!("{prefix}orders")).await;
    assert_eq!(entries.len(), 2);
    for (sent, (_, fields)) in [&full, &bare].into_iter().zip(&entries) {
        let raw: Vec<&str> = fields.keys().map(String::as_str).collect();
        assert_envelope(sent, "entry", |name| optional(fields, name));
        assert_eq!(fields["payload"], sent.payload, "{raw:?}");
    }
    assert_eq!(text(&entries[0].1, "header:outbox-id"), "forged");
    delete_prefixed(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_over_5000_messages_and_50_keys_with_two_relays() {
    end_to_end::per_key_order_with_two_relays(&Redis { dedup: false }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_charges_no_attempt_and_everything_arrives_once_back() {
    end_to_end::outage(&Redis { dedup: false }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_keeps_a_batch_redelivered_after_a_crash_once() {
    for dedup in [true, false] {
        end_to_end::redelivery_after_a_crash(&Redis { dedup }).await;
    }
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
            .publish_timeout(Self::TIMEOUT);
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
            sink: sink(self.config(outbox_test_support::redis::url())),
            topic: unique_name("conformance"),
        }
    }

    async fn read(&self, destination: &Destination, at_least: usize) -> Vec<Received> {
        let stream = format!("{}{}", Self::PREFIX, destination.topic);
        let deadline = Instant::now() + Duration::from_secs(10);
        while xlen(&stream).await < at_least && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let entries = xrange(&stream).await;
        // Read once per destination: let it go in an hour.
        let _: bool = client().await.expire(&stream, 3600).await.expect("EXPIRE");
        entries
            .into_iter()
            .map(|(_, f)| Received {
                payload: f.get(wire::PAYLOAD).cloned().unwrap_or_default(),
                key: optional(&f, wire::KEY),
                headers: headers(&f),
            })
            .collect()
    }

    async fn sink_at(&self, addr: &str) -> Option<Arc<dyn Sink>> {
        Some(sink(self.config(format!("redis://{addr}"))))
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
    outbox_testkit::sink_conformance_tests!(super::Harness::new(false).await);
}

mod conformance_with_dedup {
    outbox_testkit::sink_conformance_tests!(super::Harness::new(true).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrongtype_is_dead_lettered_and_the_rest_flow() {
    let prefix = format!("{}:", unique_name("outbox_test"));
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
        sink(RedisConfig::new(outbox_test_support::redis::url()).stream_prefix(&prefix)),
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
    delete_prefixed(&prefix).await;
}
