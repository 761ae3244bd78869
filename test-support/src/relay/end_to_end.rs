//! The end-to-end scripts every broker runs: messages enqueued in PostgreSQL, a relay (or
//! two) publishing them through the broker's sink, and the broker's own consumer reading
//! them back. Each script is a public async function over a [`Fixture`], the small piece a
//! broker's test file writes, as the conformance suite runs over a
//! `outbox_testkit::SinkHarness`.
//!
//! Each script panics with a message saying what broke, and returns what the broker
//! received so that the caller can check what only its broker has (properties, partitions,
//! fields).

use std::any::Any;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Proxy, Service};
use async_trait::async_trait;
use outbox_core::{ErrorKind, NewMessage, Outcome, Sink, Storage, TraceContext};
use uuid::Uuid;

use super::TestOutbox;

/// One message as the broker's consumer read it: what every broker carries, and the
/// broker's own form for checks of its own.
#[derive(Debug, Clone)]
pub struct Arrived<N> {
    pub id: Uuid,
    /// The message's topic (not the stream, topic or subject it went to).
    pub topic: String,
    pub key: Option<String>,
    pub payload: Vec<u8>,
    /// Every header (or property, or field) the broker holds for the message, by name; the
    /// sink may add its own.
    pub headers: BTreeMap<String, String>,
    pub trace_context: Option<TraceContext>,
    /// The receipt the sink must have given for this message (the relay keeps it with the
    /// delivered row), where the broker tells where it put the message.
    pub receipt: Option<String>,
    /// What the broker's client returned.
    pub native: N,
}

/// What a broker's test file gives the scripts. Each method works on the real broker; one
/// that is not running must make the method panic with a message naming it.
#[async_trait]
pub trait Fixture: Send + Sync {
    /// What the broker's client returns for one message.
    type Native: Send + Sync + Debug;
    /// What the fixture needs to know of a destination to publish there, read it back and
    /// clean it up.
    type Destination: Send + Sync;

    /// The broker (its [`Service::id`] names relays and reports, and [`Fixture::proxy`]
    /// goes in front of it).
    const SERVICE: Service;

    /// A fresh destination no other test uses, taking messages of the topics `topics`
    /// (with Kafka, three partitions each). `via` is the proxy the sinks will go through
    /// (the one [`Fixture::proxy`] made), if any: what is behind it is not always the shared
    /// broker.
    async fn destination(&self, topics: &[&str], via: Option<&str>) -> Self::Destination;

    /// A new sink publishing to `destination`: directly, or through the proxy at `via`
    /// with time-outs of a few seconds.
    async fn sink(&self, destination: &Self::Destination, via: Option<&str>) -> Arc<dyn Sink>;

    /// Everything the broker holds for `destination`, in the order its consumer reads it
    /// (per partition), once at least `count` messages are there and, where a consumer may
    /// see them late, half a second more (so that duplicates show); panics when fewer than
    /// `count` came within 60 s.
    async fn read(
        &self,
        destination: &Self::Destination,
        count: usize,
    ) -> Vec<Arrived<Self::Native>>;

    /// Deletes what the destination left on the broker, where it does not go by itself.
    async fn cleanup(&self, _destination: &Self::Destination) {}

    /// A proxy in front of the broker, and whatever must live as long as it (a broker of
    /// the test's own, for Kafka).
    async fn proxy(&self) -> (Proxy, Box<dyn Any + Send>) {
        (Proxy::start(&Self::SERVICE.addr()).await, Box::new(()))
    }
}

/// The messages of [`round_trip`]: the payload bytes of every value (invalid UTF-8 and an
/// empty payload among them), JSON, keyed and unkeyed, headers, trace contexts with and
/// without state, over two topics.
pub fn round_trip_messages() -> Vec<NewMessage> {
    let mut messages = vec![
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
            .expect("JSON")
            .key("order-1"),
        NewMessage::new("users", "no key, other topic"),
    ];
    messages.extend((0..296u32).map(|i| {
        let payload: Vec<u8> = if i == 0 {
            Vec::new()
        } else {
            (0..=255u8).cycle().skip(i as usize).take(64).collect()
        };
        let topic = if i % 2 == 0 { "orders" } else { "users" };
        let mut m = NewMessage::new(topic, payload);
        if i % 3 != 0 {
            m = m.key(format!("k{}", i % 7));
        }
        if i % 5 == 0 {
            m = m
                .header("content-type", "application/x-test")
                .header("tenant", format!("t{i}"));
        }
        if i % 4 == 0 {
            m = m.trace_context(TraceContext {
                traceparent: format!("00-{:032x}-{:016x}-01", i + 1, i + 1),
                tracestate: (i % 8 == 0).then(|| "v=1".to_string()),
            });
        }
        m
    }));
    messages
}

/// [`round_trip_messages`] through PostgreSQL and a relay: each arrives once, with its
/// topic, key, payload bytes, headers and trace context, each key's messages in enqueue
/// order, and the receipt kept with each delivered row is the broker's. Returns each message
/// with what arrived for it.
pub async fn round_trip<F: Fixture>(fixture: &F) -> Vec<(NewMessage, Arrived<F::Native>)> {
    let name = F::SERVICE.id();
    let destination = fixture.destination(&["orders", "users"], None).await;
    let outbox = TestOutbox::with_config(|c| c.retention = Some(Duration::from_secs(3600))).await;
    let messages = round_trip_messages();
    outbox.enqueue(&messages).await;
    let started = Instant::now();
    let relay = outbox.relay(
        &format!("{name}-w1"),
        fixture.sink(&destination, None).await,
    );
    outbox.wait_until_drained(Duration::from_secs(60)).await;
    let elapsed = started.elapsed();
    relay.stop().await;
    assert_eq!(outbox.stats().await.dead_lettered, 0);
    eprintln!(
        "[{name}] the relay delivered {} messages through PostgreSQL in {elapsed:?}",
        messages.len()
    );

    let arrived = fixture.read(&destination, messages.len()).await;
    fixture.cleanup(&destination).await;
    assert_once(&arrived, messages.iter().map(|m| m.id));
    assert_key_order(&arrived, &messages);
    let receipts = outbox.receipts().await;
    let mut by_id: HashMap<Uuid, Arrived<F::Native>> =
        arrived.into_iter().map(|a| (a.id, a)).collect();
    messages
        .into_iter()
        .map(|message| {
            let got = by_id.remove(&message.id).expect("arrived");
            let id = message.id;
            assert_eq!(got.payload, message.payload, "payload bytes of {id}");
            assert_eq!(got.topic, message.topic, "topic of {id}");
            assert_eq!(got.key, message.key, "key of {id}");
            for (name, value) in &message.headers {
                let header = got.headers.get(name);
                assert_eq!(header, Some(value), "header {name} of {id}: {got:?}");
            }
            let trace = &got.trace_context;
            assert_eq!(trace, &message.trace_context, "trace context of {id}");
            if let Some(receipt) = &got.receipt {
                assert_eq!(&receipts[&id], receipt, "the receipt kept for {id}");
            }
            (message, got)
        })
        .collect()
}

/// 5,000 messages of 50 keys, half enqueued before two relays start and half while they
/// run: each arrives once, each key's messages in enqueue order. Returns what arrived.
pub async fn per_key_order_with_two_relays<F: Fixture>(fixture: &F) -> Vec<Arrived<F::Native>> {
    const MESSAGES: usize = 5_000;
    const KEYS: usize = 50;
    let name = F::SERVICE.id();
    let destination = fixture.destination(&["events"], None).await;
    let outbox = TestOutbox::new().await;
    let messages: Vec<NewMessage> = (0..MESSAGES)
        .map(|i| NewMessage::new("events", format!("{i}")).key(format!("k{}", i % KEYS)))
        .collect();
    let (before, during) = messages.split_at(MESSAGES / 2);
    for chunk in before.chunks(500) {
        outbox.enqueue(chunk).await;
    }
    let started = Instant::now();
    let relays = [
        outbox.relay(&format!("{name}-a"), fixture.sink(&destination, None).await),
        outbox.relay(&format!("{name}-b"), fixture.sink(&destination, None).await),
    ];
    // The rest in several transactions while the relays run.
    for chunk in during.chunks(500) {
        outbox.enqueue(chunk).await;
    }
    outbox.wait_until_drained(Duration::from_secs(180)).await;
    let elapsed = started.elapsed();
    for relay in relays {
        relay.stop().await;
    }
    assert_eq!(outbox.stats().await.dead_lettered, 0);

    let arrived = fixture.read(&destination, MESSAGES).await;
    fixture.cleanup(&destination).await;
    assert_eq!(arrived.len(), MESSAGES, "every message once");
    assert_once(&arrived, messages.iter().map(|m| m.id));
    let keys = assert_key_order(&arrived, &messages);
    assert_eq!(keys, KEYS);
    println!(
        "{name}: {MESSAGES} messages, {KEYS} keys, 2 relays: {elapsed:?} ({:.0} messages/s)",
        MESSAGES as f64 / elapsed.as_secs_f64()
    );
    arrived
}

/// The broker's link cut while a relay runs, through a proxy: the sink's health says
/// unavailable, nothing is delivered, no attempt is charged and nothing is dead-lettered;
/// once the link is back everything arrives once, each key's messages in enqueue order.
pub async fn outage<F: Fixture>(fixture: &F) {
    let name = F::SERVICE.id();
    let (proxy, _upstream) = fixture.proxy().await;
    let via = Some(proxy.addr());
    let destination = fixture.destination(&["t"], via.as_deref()).await;
    let outbox = TestOutbox::new().await;
    let sink = fixture.sink(&destination, via.as_deref()).await;
    let relay = outbox.relay(&format!("{name}-outage"), sink.clone());
    let message = |i: usize| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % 5));
    let first: Vec<NewMessage> = (0..50).map(message).collect();
    outbox.enqueue(&first).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;

    proxy.cut();
    let health = sink.health().await.expect_err("health while cut");
    assert_eq!(health.kind(), ErrorKind::Unavailable, "{health}");
    let second: Vec<NewMessage> = (50..250).map(message).collect();
    outbox.enqueue(&second).await;
    // A batch claimed before the relay noticed the cut fails within the sink's time-outs
    // and is released; after that the health gate holds.
    assert_held_by_the_outage(&outbox, second.len(), Duration::from_secs(3)).await;

    proxy.restore();
    outbox
        .drained_with_no_dead_letters(Duration::from_secs(60))
        .await;
    relay.stop().await;
    let sent: Vec<NewMessage> = first.into_iter().chain(second).collect();
    let arrived = fixture.read(&destination, sent.len()).await;
    fixture.cleanup(&destination).await;
    assert_eq!(arrived.len(), sent.len(), "everything delivered once");
    assert_once(&arrived, sent.iter().map(|m| m.id));
    assert_key_order(&arrived, &sent);
}

/// Checks an outage the relay has met: once `settle` has passed (time for a batch claimed
/// before it to fail within the sink's time-outs) and the batch in flight is released, the
/// `held` messages all wait pending, none dead-lettered and none charged an attempt.
pub async fn assert_held_by_the_outage(outbox: &TestOutbox, held: usize, settle: Duration) {
    tokio::time::sleep(settle).await;
    outbox
        .wait_for("the batch in flight released", |s| s.in_flight == 0)
        .await;
    let stats = outbox.stats().await;
    assert_eq!(
        stats.pending, held as u64,
        "nothing delivered during the outage: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    let attempts = outbox.attempts().await;
    assert_eq!(attempts.len(), held);
    assert!(
        attempts.iter().all(|&a| a == 0),
        "an outage charges no attempt: {attempts:?}"
    );
}

/// A relay claims 30 of 50 messages, publishes them and dies before recording the
/// delivery; once its lease runs out another relay publishes them again. A sink that
/// [`deduplicates`](outbox_core::SinkCapabilities::deduplicates) lets each message arrive
/// once, any other lets the redelivered ones arrive twice; each key's messages first arrive
/// in enqueue order either way.
pub async fn redelivery_after_a_crash<F: Fixture>(fixture: &F) {
    let name = F::SERVICE.id();
    let destination = fixture.destination(&["t"], None).await;
    let outbox = TestOutbox::new().await;
    let messages: Vec<NewMessage> = (0..50)
        .map(|i| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % 5)))
        .collect();
    outbox.enqueue(&messages).await;

    let claim = outbox
        .storage
        .claim("crashed", 30, Duration::from_secs(1))
        .await
        .expect("claim");
    let claimed = claim.messages.len();
    assert!(claimed > 0, "nothing claimed");
    let crashed = fixture.sink(&destination, None).await;
    let deduplicates = crashed.capabilities().deduplicates;
    let outcomes = crashed.publish(&claim.messages).await.expect("publish");
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Delivered(_))),
        "{outcomes:?}"
    );
    drop(crashed);

    let relay = outbox.relay(
        &format!("{name}-redelivery"),
        fixture.sink(&destination, None).await,
    );
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;
    let expected = if deduplicates {
        messages.len()
    } else {
        messages.len() + claimed
    };
    let arrived = fixture.read(&destination, expected).await;
    fixture.cleanup(&destination).await;
    let unique: HashSet<Uuid> = arrived.iter().map(|a| a.id).collect();
    assert_eq!(
        unique,
        messages.iter().map(|m| m.id).collect(),
        "every message arrived"
    );
    if deduplicates {
        assert_eq!(arrived.len(), expected, "de-duplicated: each message once");
    } else {
        assert_eq!(
            arrived.len(),
            expected,
            "not de-duplicated: the {claimed} redelivered messages twice"
        );
    }
    let mut first = HashSet::new();
    let firsts: Vec<&Arrived<F::Native>> = arrived.iter().filter(|a| first.insert(a.id)).collect();
    assert_key_order(firsts, &messages);
}

/// The trace context a broker holds as `traceparent` and `tracestate` (headers, fields).
pub fn trace_context(
    traceparent: Option<String>,
    tracestate: Option<String>,
) -> Option<TraceContext> {
    let Some(traceparent) = traceparent else {
        assert_eq!(tracestate, None, "a tracestate without a traceparent");
        return None;
    };
    Some(TraceContext {
        traceparent,
        tracestate,
    })
}

/// Each of `sent` arrived, and none twice.
fn assert_once<N>(arrived: &[Arrived<N>], sent: impl Iterator<Item = Uuid>) {
    let sent: HashSet<Uuid> = sent.collect();
    let mut seen = HashSet::new();
    for a in arrived {
        assert!(seen.insert(a.id), "{} delivered twice", a.id);
        assert!(sent.contains(&a.id), "{} was not sent", a.id);
    }
    assert_eq!(seen.len(), sent.len(), "every message arrived");
}

/// The messages of each topic and key arrived in the order they were enqueued (the order of
/// `sent`); returns the number of keys.
fn assert_key_order<'a, N: 'a>(
    arrived: impl IntoIterator<Item = &'a Arrived<N>>,
    sent: &[NewMessage],
) -> usize {
    let position: HashMap<Uuid, usize> = sent.iter().enumerate().map(|(i, m)| (m.id, i)).collect();
    let mut by_key: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
    for a in arrived {
        if let Some(key) = &a.key {
            by_key
                .entry((a.topic.as_str(), key.as_str()))
                .or_default()
                .push(position[&a.id]);
        }
    }
    for ((topic, key), positions) in &by_key {
        assert!(
            positions.is_sorted(),
            "key {key} of {topic} out of enqueue order: {positions:?}"
        );
    }
    by_key.len()
}
