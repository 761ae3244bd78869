//! The sink checks.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::config::Settings;
use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, SinkRegistry};
use tokio::net::TcpListener;

use crate::note;

/// One message as the broker holds it, as a consumer would read it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Received {
    /// The body, as exact bytes.
    pub payload: Vec<u8>,
    /// Every header (or property, or field) the broker holds for the message, by name. The
    /// sink may add its own; the suite checks that each header of the message is there with
    /// its exact value.
    pub headers: BTreeMap<String, String>,
    /// The partition key as the broker holds it (a Kafka key, a header, a field), if any.
    pub key: Option<String>,
}

/// A destination made for one check: a sink that publishes there, and the topic the suite
/// puts on its messages.
pub struct Destination {
    /// The sink under test, publishing to this destination.
    pub sink: Arc<dyn Sink>,
    /// The topic of every message the suite publishes to this destination.
    pub topic: String,
}

/// What a sink backend gives the suite. Each method works on the real broker; a broker that
/// is not running must make the method panic with a message naming it and its address.
///
/// ```text
/// use outbox_testkit::{Destination, Received, SinkHarness};
///
/// struct RedisHarness { url: String }
///
/// #[async_trait::async_trait]
/// impl SinkHarness for RedisHarness {
///     fn timeout(&self) -> Duration { Duration::from_secs(2) }
///
///     async fn destination(&self) -> Destination {
///         let topic = outbox_tests::unique_name("conformance");   // the stream is named after it
///         let config = RedisConfig { publish_timeout: self.timeout(), ..RedisConfig::new(&self.url) };
///         Destination { sink: Arc::new(RedisSink::new(config).unwrap()), topic }
///     }
///
///     async fn read(&self, destination: &Destination, at_least: usize) -> Vec<Received> {
///         // poll XLEN until it is at least `at_least` (give up after ~10 s), then XRANGE - +
///         // and turn each entry into a Received { payload, headers, key }
///     }
///
///     async fn sink_at(&self, addr: &str) -> Option<Arc<dyn Sink>> {
///         let config = RedisConfig { publish_timeout: self.timeout(), ..RedisConfig::new(format!("redis://{addr}")) };
///         Some(Arc::new(RedisSink::new(config).unwrap()))
///     }
/// }
/// ```
#[async_trait]
pub trait SinkHarness: Send + Sync {
    /// The time-out the harness's sinks are configured with (connect, command, ack). The
    /// suite expects a health check or publish against a server that never answers to fail
    /// within about twice this. Keep it short (1–2 s) so the suite runs fast.
    fn timeout(&self) -> Duration;

    /// A fresh destination no other check uses (its own stream, queue or topic, made on the
    /// broker if the sink needs it made), with a sink that publishes messages of
    /// `Destination::topic` there.
    async fn destination(&self) -> Destination;

    /// What the broker holds for `destination`, in the order a consumer reads it (for a
    /// partitioned broker: partition after partition, so each key's messages are in their
    /// partition's order). Waits until at least `at_least` messages are there, giving up
    /// after about 10 s, then returns all there are. The suite calls it once per
    /// destination, after the last publish, so it may read destructively (AMQP `basic.get`).
    async fn read(&self, destination: &Destination, at_least: usize) -> Vec<Received>;

    /// A sink configured like those of [`destination`](SinkHarness::destination), with the
    /// same time-out, but pointed at `addr` (`127.0.0.1:port`). The suite points it at a
    /// closed port and at a server that accepts connections and never answers. Building it
    /// must not fail or block: connect lazily, or within the time-out. `None` for a sink
    /// that has no network address (a file, standard output): the two checks skip, saying
    /// so.
    async fn sink_at(&self, addr: &str) -> Option<Arc<dyn Sink>>;

    /// A message the broker refuses at `destination` for reasons of its own (for example a
    /// topic no stream captures, or a payload over a per-destination limit), or `None` when
    /// the broker cannot be made to refuse one; the suite checks that it fails alone, as a
    /// message failure (`Temporary` or `Permanent`), while the rest of its batch is
    /// delivered.
    async fn refused(&self, destination: &Destination) -> Option<Message> {
        let _ = destination;
        None
    }
}

fn message(topic: &str, payload: impl Into<Vec<u8>>) -> Message {
    Message::from(NewMessage::new(topic, payload))
}

fn keyed(topic: &str, key: &str, payload: impl Into<Vec<u8>>) -> Message {
    Message::from(NewMessage::new(topic, payload).key(key))
}

/// Publishes and checks that every message was delivered, one outcome each, in order.
async fn publish_all(check: &str, sink: &dyn Sink, batch: &[Message]) {
    let outcomes = sink
        .publish(batch)
        .await
        .unwrap_or_else(|e| panic!("{check}: publishing {} messages failed: {e}", batch.len()));
    assert_eq!(
        outcomes.len(),
        batch.len(),
        "{check}: a sink must return one outcome per message"
    );
    for (i, outcome) in outcomes.iter().enumerate() {
        if let Outcome::Failed(error) = outcome {
            panic!(
                "{check}: message {i} of {} was not delivered: {error}",
                batch.len()
            );
        }
    }
}

/// The receipts of `outcomes`, in order; panics naming the first message that was not
/// delivered. For a backend's own tests of a batch that must be delivered whole.
pub fn receipts(outcomes: &[Outcome]) -> Vec<String> {
    (outcomes.iter().enumerate())
        .map(|(i, outcome)| match outcome {
            Outcome::Delivered(receipt) => receipt.0.clone(),
            Outcome::Failed(error) => panic!("message {i} was not delivered: {error}"),
        })
        .collect()
}

/// Asserts that `error` is of `kind` and that its message says `says`, showing the error
/// otherwise. For a backend's own tests of the errors it reports.
pub fn assert_error_says(error: &outbox_core::Error, kind: ErrorKind, says: &str) {
    assert_eq!(error.kind(), kind, "{error}");
    assert!(error.message().contains(says), "{error}");
}

/// Asserts that `error` is `Unavailable` and that it `took` less than `within`: a failure
/// the sink reports promptly, not after a hang.
pub fn assert_unavailable_within(error: &outbox_core::Error, took: Duration, within: Duration) {
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(took < within, "took {took:?}: {error}");
}

/// Checks a sink crate's `register` without a broker: it registers `type_name` alone, its
/// factory builds a sink from `good` (a table that does not connect), and refuses `bad`
/// with a configuration error keyed by `bad_key` (relative to the `[sink]` section, so the
/// relay shows `sink.<bad_key>: …`).
pub async fn check_sink_register(
    register: fn(&mut SinkRegistry),
    type_name: &str,
    good: serde_json::Value,
    bad: serde_json::Value,
    bad_key: &str,
) {
    let mut registry = SinkRegistry::new();
    register(&mut registry);
    assert_eq!(registry.names(), [type_name]);
    if let Err(error) = registry.build(type_name, good).await {
        panic!("{type_name}: the good table was refused: {error}");
    }
    let error = refused_sink_build(&registry, type_name, bad).await;
    let expected = format!("sink.{bad_key}: ");
    assert!(error.message().starts_with(&expected), "{error}");
}

/// The configuration error `registry` refuses to build a `type_name` sink from `table`
/// with, placed in the `[sink]` section (`sink.<key> …`); panics when the sink is built or
/// fails with another kind of error.
pub async fn refused_sink_build(
    registry: &SinkRegistry,
    type_name: &str,
    table: serde_json::Value,
) -> outbox_core::Error {
    let shown = table.to_string();
    let Err(error) = registry.build(type_name, table).await else {
        panic!("{type_name}: {shown} was accepted");
    };
    assert_eq!(error.kind(), ErrorKind::Config, "{shown}: {error}");
    error.in_section("sink")
}

/// Checks that `T::from_value` refuses each table of `cases` with a configuration error
/// whose message, placed in the `[sink]` section, starts with the text beside it (`sink.<key>
/// …`). For a sink crate's tests of its settings.
pub fn check_sink_settings_refused<T: Settings + std::fmt::Debug>(
    cases: impl IntoIterator<Item = (serde_json::Value, &'static str)>,
) {
    for (table, expected) in cases {
        let error = match T::from_value(table.clone()) {
            Ok(settings) => panic!("{table} was accepted: {settings:?}"),
            Err(error) => error,
        };
        assert_eq!(error.kind(), ErrorKind::Config, "{table}: {error}");
        let message = error.in_section("sink").message().to_string();
        assert!(message.starts_with(expected), "{table}: {message}");
    }
}

/// Publishes a batch in which some messages may fail, and returns the outcomes, checking
/// that the call itself succeeded with one outcome per message.
async fn publish_some(check: &str, sink: &dyn Sink, batch: &[Message]) -> Vec<Outcome> {
    let outcomes = sink.publish(batch).await.unwrap_or_else(|e| {
        panic!("{check}: one refused message failed the whole batch ({e}); it must fail alone")
    });
    assert_eq!(
        outcomes.len(),
        batch.len(),
        "{check}: one outcome per message"
    );
    outcomes
}

/// Checks that `outcome`, of the message `what`, is a delivery.
fn assert_delivered(check: &str, what: &str, outcome: &Outcome) {
    assert!(
        matches!(outcome, Outcome::Delivered(_)),
        "{check}: {what}: {outcome:?}"
    );
}

/// What the broker holds for `d`, checked to be `count` messages: `what` says which.
async fn read_exactly(
    check: &str,
    h: &dyn SinkHarness,
    d: &Destination,
    count: usize,
    what: &str,
) -> Vec<Received> {
    let got = h.read(d, count).await;
    assert_eq!(got.len(), count, "{check}: the broker must hold {what}");
    got
}

/// Checks that the broker holds exactly the messages of `sent` (no more), with their
/// payload, headers and key.
fn assert_same(check: &str, sent: &[Message], got: &[Received]) {
    let name = |i: usize, _: &Message| format!("message {i}");
    assert_pairs(check, sent.iter().collect(), got.iter().collect(), name);
}

/// Like [`assert_same`], for messages of several keys, whose relative order a partitioned
/// broker does not keep: matches them by payload (unique in each check).
fn assert_same_any_order(check: &str, sent: &[Message], got: &[Received]) {
    let mut sent: Vec<&Message> = sent.iter().collect();
    let mut got: Vec<&Received> = got.iter().collect();
    sent.sort_by(|a, b| a.payload.cmp(&b.payload));
    got.sort_by(|a, b| a.payload.cmp(&b.payload));
    let name = |_: usize, m: &Message| format!("message {:?}", String::from_utf8_lossy(&m.payload));
    assert_pairs(check, sent, got, name);
}

/// Checks that `got` holds as many messages as `sent`, each with the fields of the one
/// sent at its place; `name` names a message in a failure.
fn assert_pairs(
    check: &str,
    sent: Vec<&Message>,
    got: Vec<&Received>,
    name: impl Fn(usize, &Message) -> String,
) {
    assert_eq!(
        got.len(),
        sent.len(),
        "{check}: the broker holds {} messages, {} were published",
        got.len(),
        sent.len()
    );
    for (i, (sent, got)) in sent.into_iter().zip(got).enumerate() {
        assert_fields(&format!("{check}, {}", name(i, sent)), sent, got);
    }
}

fn assert_fields(check: &str, sent: &Message, got: &Received) {
    assert!(
        got.payload == sent.payload,
        "{check}: payload changed: sent {} bytes {:?}…, broker holds {} bytes {:?}…",
        sent.payload.len(),
        &sent.payload[..sent.payload.len().min(16)],
        got.payload.len(),
        &got.payload[..got.payload.len().min(16)]
    );
    assert_eq!(got.key, sent.key, "{check}: key changed");
    for (name, value) in &sent.headers {
        assert_eq!(
            got.headers.get(name),
            Some(value),
            "{check}: header `{name}` changed or missing; the broker holds {:?}",
            got.headers
        );
    }
}

/// Checks that, for each key, the broker holds its messages in the order they were sent
/// (messages without a key only as a set: a partitioned broker spreads them).
fn assert_key_order(check: &str, sent: &[Message], got: &[Received]) {
    let mut sent_by_key = by_key(sent.iter().map(|m| (&m.key, &m.payload[..])));
    let got_by_key = by_key(got.iter().map(|r| (&r.key, &r.payload[..])));
    for (key, sent) in &mut sent_by_key {
        let mut got = got_by_key.get(key).cloned().unwrap_or_default();
        if key.is_none() {
            sent.sort();
            got.sort();
        }
        let sent = &*sent;
        assert!(
            *sent == got,
            "{check}: key {key:?}: {} messages sent, {} held, or out of order (first difference at {})",
            sent.len(),
            got.len(),
            sent.iter()
                .zip(&got)
                .position(|(a, b)| a != b)
                .unwrap_or(sent.len().min(got.len()))
        );
    }
}

/// Payloads grouped by key, in the order given.
fn by_key<'a>(
    messages: impl Iterator<Item = (&'a Option<String>, &'a [u8])>,
) -> BTreeMap<Option<String>, Vec<&'a [u8]>> {
    let mut by_key: BTreeMap<Option<String>, Vec<&[u8]>> = BTreeMap::new();
    for (key, payload) in messages {
        by_key.entry(key.clone()).or_default().push(payload);
    }
    by_key
}

/// A free port with nothing listening on it.
async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a local port");
    listener.local_addr().expect("local address")
}

/// A server that accepts connections and never sends a byte; stops when dropped.
struct SilentServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl SilentServer {
    async fn start() -> SilentServer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a local port");
        let addr = listener.local_addr().expect("local address");
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket); // keep it open, never answer
            }
        });
        SilentServer { addr, task }
    }
}

impl Drop for SilentServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Checks that `error` is a transport failure.
fn assert_unavailable(check: &str, what: &str, error: &outbox_core::Error) {
    assert_eq!(
        error.kind(),
        ErrorKind::Unavailable,
        "{check}: {what} must fail as Unavailable (a transport failure), got: {error}"
    );
}

/// Publishing to an unreachable broker must fail as a transport failure: either the whole
/// call fails, or every message fails, as `Unavailable`.
async fn assert_publish_unavailable(check: &str, sink: &dyn Sink, topic: &str, limit: Duration) {
    let batch = vec![message(topic, "a"), message(topic, "b")];
    let started = Instant::now();
    let result = sink.publish(&batch).await;
    let elapsed = started.elapsed();
    match result {
        Err(error) => assert_unavailable(check, "publish", &error),
        Ok(outcomes) => {
            assert_eq!(
                outcomes.len(),
                batch.len(),
                "{check}: one outcome per message"
            );
            for outcome in &outcomes {
                match outcome {
                    Outcome::Failed(error) => assert_unavailable(check, "each message", error),
                    Outcome::Delivered(r) => {
                        panic!("{check}: delivered to an unreachable broker: {r}")
                    }
                }
            }
        }
    }
    assert!(
        elapsed <= limit,
        "{check}: publish took {elapsed:?}, more than {limit:?}"
    );
}

/// The longest a call against an unreachable broker may take.
fn limit(h: &dyn SinkHarness) -> Duration {
    h.timeout() * 2 + Duration::from_secs(2)
}

/// `health` passes on a fresh sink while the broker is up.
pub async fn sink_health_is_ok_when_the_broker_is_up(h: &dyn SinkHarness) {
    let d = h.destination().await;
    if let Err(error) = d.sink.health().await {
        panic!("health: the broker is up but health failed: {error}");
    }
}

/// Payload bytes, headers and key survive exactly, for messages with and without a key.
pub async fn sink_fields_survive_exactly(h: &dyn SinkHarness) {
    let check = "fields survive";
    let d = h.destination().await;
    let t = &d.topic;
    let mut json = NewMessage::json(
        t.as_str(),
        &serde_json::json!({"order": 7, "total": "12.50"}),
    )
    .expect("json")
    .key("order-7")
    .header("x-tenant", "acme");
    json.headers.insert("x-request-id".into(), "b7c1-44".into());
    let batch = vec![
        Message::from(json),
        Message::from(
            NewMessage::new(t.as_str(), "plain text")
                .key("customer:42/eu")
                .header("x-empty", "")
                .header("x-symbols", "a=b; c,d \"q\" [x] {y} <z> 100%"),
        ),
        Message::from(NewMessage::new(t.as_str(), "no key, no headers")),
    ];
    publish_all(check, &*d.sink, &batch).await;
    assert_same_any_order(check, &batch, &h.read(&d, batch.len()).await);
}

/// Binary payloads survive byte for byte: every byte value, invalid UTF-8, NUL bytes, an
/// empty payload and 64 KiB of random bytes.
pub async fn sink_binary_and_non_utf8_payloads_survive(h: &dyn SinkHarness) {
    let check = "binary payloads";
    let d = h.destination().await;
    let random: Vec<u8> = (0..64 * 1024).map(|_| fastrand::u8(..)).collect();
    let payloads: Vec<Vec<u8>> = vec![
        (0..=255u8).collect(),
        (0..=255u8).rev().collect(),
        vec![0xff, 0xfe, 0xfd, 0xc3, 0x28, 0xa0, 0xa1, 0xe2, 0x28, 0xa1],
        vec![0, 0, 0, b'\r', b'\n', 0],
        Vec::new(),
        random,
    ];
    // One key, so the broker's order is the order sent.
    let batch: Vec<Message> = payloads
        .into_iter()
        .map(|p| keyed(&d.topic, "binary", p))
        .collect();
    publish_all(check, &*d.sink, &batch).await;
    assert_same(check, &batch, &h.read(&d, batch.len()).await);
}

/// Header values and keys outside ASCII survive exactly.
pub async fn sink_unicode_header_values_survive(h: &dyn SinkHarness) {
    let check = "unicode headers";
    let d = h.destination().await;
    let batch = vec![
        Message::from(
            NewMessage::new(d.topic.as_str(), "1")
                .key("ключ-✓")
                .header("x-name", "Zoë Ñúñez")
                .header("x-city", "東京")
                .header("x-emoji", "🚀 launch ✅"),
        ),
        Message::from(
            NewMessage::new(d.topic.as_str(), "2")
                .key("ключ-✓")
                .header("x-rtl", "مرحبا")
                .header("x-combining", "e\u{301}"),
        ),
    ];
    publish_all(check, &*d.sink, &batch).await;
    assert_same(check, &batch, &h.read(&d, batch.len()).await);
}

/// A batch gets exactly one outcome per message, and every message arrives.
pub async fn sink_one_outcome_per_message(h: &dyn SinkHarness) {
    let check = "one outcome per message";
    let d = h.destination().await;
    let batch: Vec<Message> = (0..25)
        .map(|i| match i % 3 {
            0 => message(&d.topic, format!("m{i}")),
            _ => keyed(&d.topic, &format!("k{i}"), format!("m{i}")),
        })
        .collect();
    publish_all(check, &*d.sink, &batch).await;
    let got = read_exactly(check, h, &d, batch.len(), "every message once").await;
    assert_key_order(check, &batch, &got);
}

/// An empty batch returns no outcomes and publishes nothing.
pub async fn sink_empty_batch_publishes_nothing(h: &dyn SinkHarness) {
    let check = "empty batch";
    let d = h.destination().await;
    let outcomes = d
        .sink
        .publish(&[])
        .await
        .unwrap_or_else(|e| panic!("{check}: {e}"));
    assert!(
        outcomes.is_empty(),
        "{check}: {} outcomes for no messages",
        outcomes.len()
    );
    // A marker after it: the broker must hold the marker alone.
    let marker = vec![message(&d.topic, "marker")];
    publish_all(check, &*d.sink, &marker).await;
    assert_same(check, &marker, &h.read(&d, 1).await);
}

/// Each key's messages land in the order given, within one call and across calls.
pub async fn sink_keeps_key_order_within_and_across_batches(h: &dyn SinkHarness) {
    let check = "key order";
    let d = h.destination().await;
    if !declares(check, d.sink.capabilities().keeps_order, "keeps_order") {
        return;
    }
    let sent: Vec<Message> = (0..200)
        .map(|i| keyed(&d.topic, &format!("key-{}", i % 5), format!("{i}")))
        .collect();
    for batch in sent.chunks(50) {
        publish_all(check, &*d.sink, batch).await;
    }
    let got = read_exactly(check, h, &d, sent.len(), "every message once").await;
    assert_key_order(check, &sent, &got);
}

/// A batch of 10,000 messages: one outcome each, all delivered, key order kept.
pub async fn sink_large_batch(h: &dyn SinkHarness) {
    let check = "large batch";
    let d = h.destination().await;
    let sent: Vec<Message> = (0..10_000)
        .map(|i| {
            keyed(
                &d.topic,
                &format!("key-{}", i % 100),
                format!("message {i:05}"),
            )
        })
        .collect();
    let started = Instant::now();
    publish_all(check, &*d.sink, &sent).await;
    let elapsed = started.elapsed();
    note(
        check,
        format!(
            "10000 messages published in {elapsed:?} ({:.0} messages/s)",
            sent.len() as f64 / elapsed.as_secs_f64()
        ),
    );
    let got = read_exactly(check, h, &d, sent.len(), "every message once").await;
    if d.sink.capabilities().keeps_order {
        assert_key_order(check, &sent, &got);
    }
}

/// Against a closed port, `health` and `publish` fail as `Unavailable`, quickly.
pub async fn sink_health_is_down_on_a_closed_port(h: &dyn SinkHarness) {
    let check = "closed port";
    let addr = closed_port().await.to_string();
    let Some(sink) = h.sink_at(&addr).await else {
        note(check, "skipped: the sink has no network address");
        return;
    };
    let started = Instant::now();
    let health = sink.health().await;
    let elapsed = started.elapsed();
    match health {
        Ok(()) => panic!("{check}: health passed with nothing listening at {addr}"),
        Err(error) => assert_unavailable(check, "health", &error),
    }
    assert!(elapsed <= limit(h), "{check}: health took {elapsed:?}");
    assert_publish_unavailable(check, &*sink, "conformance", limit(h)).await;
}

/// Against a server that accepts connections and never answers, `health` and `publish`
/// fail as `Unavailable` within the sink's time-out.
pub async fn sink_health_times_out_on_a_silent_server(h: &dyn SinkHarness) {
    let check = "silent server";
    let server = SilentServer::start().await;
    let Some(sink) = h.sink_at(&server.addr.to_string()).await else {
        note(check, "skipped: the sink has no network address");
        return;
    };
    let started = Instant::now();
    let health = tokio::time::timeout(limit(h) * 3, sink.health()).await;
    let elapsed = started.elapsed();
    match health {
        Err(_) => panic!("{check}: health was still waiting after {elapsed:?}: it has no time-out"),
        Ok(Ok(())) => panic!("{check}: health passed against a server that never answers"),
        Ok(Err(error)) => assert_unavailable(check, "health", &error),
    }
    assert!(
        elapsed <= limit(h),
        "{check}: health took {elapsed:?}, the harness's time-out is {:?}",
        h.timeout()
    );
    note(
        check,
        format!(
            "health failed after {elapsed:?} (time-out {:?})",
            h.timeout()
        ),
    );
    assert_publish_unavailable(check, &*sink, "conformance", limit(h)).await;
}

/// A message the broker refuses fails alone, as a message failure; the rest of its batch
/// is delivered.
pub async fn sink_refused_message_is_a_message_failure(h: &dyn SinkHarness) {
    let check = "refused message";
    let d = h.destination().await;
    let Some(refused) = refused(check, h, &d).await else {
        return;
    };
    let batch = vec![
        keyed(&d.topic, "k", "before"),
        refused,
        keyed(&d.topic, "k", "after"),
    ];
    let outcomes = publish_some(check, &*d.sink, &batch).await;
    assert_delivered(check, "first message", &outcomes[0]);
    assert_delivered(check, "last message", &outcomes[2]);
    match &outcomes[1] {
        Outcome::Delivered(r) => panic!("{check}: the refused message was delivered: {r}"),
        Outcome::Failed(error) => assert!(
            matches!(error.kind(), ErrorKind::Temporary | ErrorKind::Permanent),
            "{check}: a refused message is a message failure (Temporary or Permanent), not {:?}: {error}",
            error.kind()
        ),
    }
    let delivered = [batch[0].clone(), batch[2].clone()];
    let got = read_exactly(check, h, &d, 2, "the two good messages only").await;
    assert_key_order(check, &delivered, &got);
}

/// Whether the sink declares the capability `name`; when it does not, notes that `check`
/// is skipped.
fn declares(check: &str, declared: bool, name: &str) -> bool {
    if !declared {
        note(check, format!("skipped: the sink does not declare {name}"));
    }
    declared
}

/// The harness's message the broker refuses at `d`; `None` (and a note that `check` is
/// skipped) when it has none.
async fn refused(check: &str, h: &dyn SinkHarness, d: &Destination) -> Option<Message> {
    let refused = h.refused(d).await;
    if refused.is_none() {
        note(
            check,
            "skipped: the harness has no message the broker refuses",
        );
    }
    refused
}

/// A sink that declares `ordered_key_runs` stops a key at its first failure within a call:
/// the key's later messages do not land, and other keys are not held back.
pub async fn sink_ordered_key_runs_stop_a_key_at_its_failure(h: &dyn SinkHarness) {
    let check = "ordered key runs";
    let d = h.destination().await;
    if !declares(
        check,
        d.sink.capabilities().ordered_key_runs,
        "ordered_key_runs",
    ) {
        return;
    }
    let Some(refused) = refused(check, h, &d).await else {
        return;
    };
    let refused = Message {
        key: Some("k".into()),
        ..refused
    };
    let batch = vec![
        keyed(&d.topic, "k", "before"),
        keyed(&d.topic, "other", "other"),
        refused,
        keyed(&d.topic, "k", "after"),
    ];
    let outcomes = publish_some(check, &*d.sink, &batch).await;
    for (i, delivered) in [(0, true), (1, true), (2, false), (3, false)] {
        assert_eq!(
            matches!(outcomes[i], Outcome::Delivered(_)),
            delivered,
            "{check}: message {i}: {:?}",
            outcomes[i]
        );
    }
    let got = read_exactly(check, h, &d, 2, "`before` and `other` only").await;
    assert_key_order(check, &batch[..2], &got);
}

/// Largest payloads the size check sends; a sink with a larger limit is checked with the
/// limit lowered in its configuration, if the harness does so.
const MAX_SIZE_CHECKED: usize = 16 * 1024 * 1024;

/// A payload over the sink's declared `max_payload` fails alone as `Permanent`; one of half
/// that size is delivered.
pub async fn sink_too_large_payload_is_permanent(h: &dyn SinkHarness) {
    let check = "too large";
    let d = h.destination().await;
    // Some sinks learn the limit from the broker when they connect.
    d.sink
        .health()
        .await
        .unwrap_or_else(|e| panic!("{check}: health: {e}"));
    let Some(max) = d.sink.capabilities().max_payload else {
        note(check, "skipped: the sink declares no max_payload");
        return;
    };
    if max > MAX_SIZE_CHECKED {
        note(
            check,
            format!(
                "skipped: max_payload {max} is over {MAX_SIZE_CHECKED} bytes; lower it in the harness's configuration to check it"
            ),
        );
        return;
    }
    let batch = vec![
        keyed(&d.topic, "k", vec![b'h'; max / 2]),
        keyed(&d.topic, "k", vec![b'x'; max + 1]),
        // Another key: a sink with `ordered_key_runs` rightly holds back k's later messages.
        keyed(&d.topic, "k2", "after"),
    ];
    let outcomes = publish_some(check, &*d.sink, &batch).await;
    let half = format!("{} bytes (half of max_payload)", max / 2);
    assert_delivered(check, &half, &outcomes[0]);
    assert_delivered(check, "the message after", &outcomes[2]);
    match &outcomes[1] {
        Outcome::Failed(error) => assert_eq!(
            error.kind(),
            ErrorKind::Permanent,
            "{check}: a payload over max_payload ({max}) can never be delivered: {error}"
        ),
        Outcome::Delivered(r) => panic!(
            "{check}: {} bytes delivered over max_payload {max}: {r}",
            max + 1
        ),
    }
    let got = read_exactly(check, h, &d, 2, "the two good messages only").await;
    assert_eq!(
        got[0].payload.len(),
        max / 2,
        "{check}: the half-size payload"
    );
}

/// A sink that declares `deduplicates` stores a message published twice (same id) once,
/// and reports both publishes as delivered.
pub async fn sink_deduplicates_a_redelivered_message(h: &dyn SinkHarness) {
    let check = "de-duplication";
    let d = h.destination().await;
    if !declares(check, d.sink.capabilities().deduplicates, "deduplicates") {
        return;
    }
    let first = vec![keyed(&d.topic, "k", "1"), keyed(&d.topic, "k", "2")];
    publish_all(check, &*d.sink, &first).await;
    // The relay lost the acks and publishes the first message again, then a new one.
    let mut redelivered = first[0].clone();
    redelivered.attempts = 1;
    publish_all(check, &*d.sink, &[redelivered]).await;
    let last = keyed(&d.topic, "k", "3");
    publish_all(check, &*d.sink, std::slice::from_ref(&last)).await;
    let expected = [first[0].clone(), first[1].clone(), last];
    // A stored duplicate would come before "3": reading three would show it.
    assert_same(check, &expected, &h.read(&d, expected.len()).await);
}
