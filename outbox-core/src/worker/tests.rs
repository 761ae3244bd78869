//! Worker behaviour on tokio's paused clock, with the in-memory storage and sink.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::time::{Instant, sleep};

use super::*;
use crate::memory::{MemorySink, MemoryStorage};
use crate::{NewMessage, QueueStats, SinkCapabilities, StorageCapabilities};

fn config() -> WorkerConfig {
    WorkerConfig {
        backoff: Backoff {
            jitter: 0.0,
            ..Backoff::default()
        },
        ..WorkerConfig::new("test-worker")
    }
}

/// A worker running in the background; [`Running::stop`] stops it.
struct Running {
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Asks the worker to shut down and waits until its task has ended.
    async fn stop(self) {
        self.shutdown.cancel();
        self.handle.await.expect("worker task");
    }
}

fn start(config: WorkerConfig, storage: Arc<dyn Storage>, sink: Arc<dyn Sink>) -> Running {
    let worker = Worker::new(config, storage, sink).unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    Running { shutdown, handle }
}

/// Settings under which the worker, within a test, claims only when woken up or after a full
/// batch: its poll interval is an hour.
fn no_polls() -> WorkerConfig {
    WorkerConfig {
        poll_interval: Duration::from_secs(3600),
        ..config()
    }
}

/// [`no_polls`] with batches of `batch_size`.
fn batches_of(batch_size: usize) -> WorkerConfig {
    WorkerConfig {
        batch_size,
        ..no_polls()
    }
}

/// Writes a0, b0, a1, b1, a2, b2 (keys `a` and `b`).
fn enqueue_keys_a_and_b(storage: &MemoryStorage) {
    for i in 0..3 {
        storage.enqueue(NewMessage::new("t", format!("a{i}")).key("a"));
        storage.enqueue(NewMessage::new("t", format!("b{i}")).key("b"));
    }
}

/// How many messages the sink has published once `wait` has passed.
async fn published_after(sink: &MemorySink, wait: Duration) -> usize {
    sleep(wait).await;
    sink.published().len()
}

/// `n` messages without a key, numbered `{prefix}0` to `{prefix}{n - 1}`.
fn numbered(prefix: &str, n: usize) -> impl Iterator<Item = NewMessage> {
    (0..n).map(move |i| NewMessage::new("t", format!("{prefix}{i}")))
}

/// An in-memory storage that keeps per-key order or not, and an in-memory sink.
fn memory(per_key_order: bool) -> (Arc<MemoryStorage>, Arc<MemorySink>) {
    (
        Arc::new(MemoryStorage::new(per_key_order)),
        Arc::new(MemorySink::new()),
    )
}

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

fn payloads(messages: &[Message]) -> Vec<String> {
    messages.iter().map(|m| text(&m.payload)).collect()
}

/// Each message's payload with the attempts charged to it.
fn attempts_of(messages: &[Message]) -> Vec<(String, u32)> {
    messages
        .iter()
        .map(|m| (text(&m.payload), m.attempts))
        .collect()
}

fn times_of_attempts(
    sink: &MemorySink,
    fail: impl Fn(&Message) -> bool + Send + Sync + 'static,
) -> Arc<Mutex<Vec<Duration>>> {
    let start = Instant::now();
    let times = Arc::new(Mutex::new(Vec::new()));
    let seen = times.clone();
    sink.fail_when(move |m| {
        if fail(m) {
            seen.lock().unwrap().push(start.elapsed());
            Some(Error::temporary("broker said no"))
        } else {
            None
        }
    });
    times
}

#[tokio::test(start_paused = true)]
async fn retries_follow_the_backoff_then_dead_letter() {
    let (storage, sink) = memory(true);
    let times = times_of_attempts(&sink, |_| true);
    storage.enqueue(NewMessage::new("t", "x").key("k"));
    let cfg = WorkerConfig {
        max_attempts: 5,
        poll_interval: Duration::from_millis(100),
        ..config()
    };
    let worker = start(cfg, storage.clone(), sink.clone());
    sleep(Duration::from_secs(30)).await;
    worker.stop().await;

    // Attempts at 0, then after waits of 1, 2, 4, 8 s (each seen at the next poll).
    let secs: Vec<u64> = times.lock().unwrap().iter().map(|d| d.as_secs()).collect();
    assert_eq!(secs, [0, 1, 3, 7, 15]);
    let dead = storage.dead_letters();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].1.contains("gave up after 5 attempts"),
        "{}",
        dead[0].1
    );
    assert!(dead[0].1.contains("broker said no"));
    assert_eq!(dead[0].0.attempts, 5);
}

/// A storage that is down: every claim fails, and is recorded with when it was made. The
/// claim numbered `hangs_on` (1 is the first), if any, hangs for 61 s before it fails (a run
/// that lasted over a minute, then lost the database).
struct DownStorage {
    calls: Mutex<Vec<Duration>>,
    start: Instant,
    hangs_on: Option<usize>,
}

impl DownStorage {
    fn new(hangs_on: Option<usize>) -> Self {
        DownStorage {
            calls: Mutex::new(Vec::new()),
            start: Instant::now(),
            hangs_on,
        }
    }
}

#[async_trait]
impl Storage for DownStorage {
    async fn claim(&self, _: &str, _: usize, _: Duration) -> Result<Claim> {
        let n = {
            let mut calls = self.calls.lock().unwrap();
            calls.push(self.start.elapsed());
            calls.len()
        };
        if self.hangs_on == Some(n) {
            sleep(Duration::from_secs(61)).await;
        }
        Err(Error::unavailable("database is down"))
    }
    async fn settle(&self, _: &ClaimToken, _: &Settlement) -> Result<u64> {
        unreachable!("nothing was claimed")
    }
    async fn extend_lease(&self, _: &ClaimToken, _: &[Uuid], _: Duration) -> Result<u64> {
        unreachable!("nothing was claimed")
    }
    async fn health(&self) -> Result<()> {
        Err(Error::unavailable("database is down"))
    }
    async fn stats(&self) -> Result<QueueStats> {
        Err(Error::unavailable("database is down"))
    }
    fn capabilities(&self) -> StorageCapabilities {
        StorageCapabilities::new(true)
    }
}

#[tokio::test(start_paused = true)]
async fn failed_runs_restart_after_doubling_waits() {
    let storage = Arc::new(DownStorage::new(None));
    let worker = start(config(), storage.clone(), Arc::new(MemorySink::new()));
    sleep(Duration::from_millis(7500)).await;
    let calls: Vec<u64> = storage
        .calls
        .lock()
        .unwrap()
        .iter()
        .map(|d| d.as_secs())
        .collect();
    // Waits of 1 + 2 + 4 s between runs.
    assert_eq!(calls, [0, 1, 3, 7]);
    // Shutdown during a restart wait returns at once.
    let asked = Instant::now();
    worker.stop().await;
    assert_eq!(asked.elapsed(), Duration::ZERO);
}

/// docs/ARCHITECTURE.md "Supervision": a failed run is restarted after 1 s, 2 s, 4 s
/// ..., and "the wait resets after a run that lasted 60 s". The test above checks the
/// doubling; this one the reset: runs start at 0 s, 1 s (after 1 s) and 3 s (after 2 s);
/// the third lasts 61 s, so the fourth starts 1 s after it ends (65 s), not 4 s (68 s).
#[tokio::test(start_paused = true)]
async fn the_restart_wait_resets_after_a_run_that_lasted_a_minute() {
    let storage = Arc::new(DownStorage::new(Some(3)));
    let worker = start(config(), storage.clone(), Arc::new(MemorySink::new()));
    sleep(Duration::from_millis(66_500)).await;
    worker.stop().await;
    let starts: Vec<u64> = storage
        .calls
        .lock()
        .unwrap()
        .iter()
        .map(Duration::as_secs)
        .collect();
    assert_eq!(starts, [0, 1, 3, 65], "claims of each run, in seconds");
}

#[tokio::test(start_paused = true)]
async fn shutdown_while_waiting_returns_at_once() {
    let (storage, sink) = memory(true);
    let worker = start(no_polls(), storage, sink.clone());
    sleep(Duration::from_secs(5)).await;
    let asked = Instant::now();
    worker.stop().await;
    assert_eq!(asked.elapsed(), Duration::ZERO);
    assert_eq!(sink.publish_calls(), 0);
}

#[tokio::test(start_paused = true)]
async fn sink_outage_charges_nothing_and_claims_nothing() {
    let (storage, sink) = memory(true);
    sink.set_up(false);
    for i in 0..10 {
        storage.enqueue(NewMessage::new("t", format!("m{i}")).key(format!("k{}", i % 3)));
    }
    let worker = start(config(), storage.clone(), sink.clone());
    sleep(Duration::from_secs(120)).await;
    assert_eq!(sink.publish_calls(), 0, "claimed while the sink was down");
    assert!(
        sink.health_calls() >= 3,
        "health gate did not keep checking"
    );
    assert!(storage.pending().iter().all(|m| m.attempts == 0));

    sink.set_up(true);
    sleep(Duration::from_secs(61)).await;
    worker.stop().await;
    assert_eq!(sink.published().len(), 10);
    assert!(storage.dead_letters().is_empty());
    assert!(storage.delivered().iter().all(|(m, _)| m.attempts == 0));
}

#[tokio::test(start_paused = true)]
async fn outage_in_the_middle_of_a_publish_releases_without_charging() {
    let (storage, sink) = memory(true);
    // The sink answers health checks but every publish hits a dropped connection.
    sink.fail_when(|_| Some(Error::unavailable("connection reset")));
    for i in 0..5 {
        storage.enqueue(NewMessage::new("t", format!("m{i}")).key("k"));
    }
    let worker = start(config(), storage.clone(), sink.clone());
    sleep(Duration::from_secs(20)).await;
    assert!(sink.publish_calls() >= 2);
    assert!(storage.pending().iter().all(|m| m.attempts == 0));
    assert!(storage.dead_letters().is_empty());
    sink.fail_when(|_| None);
    sleep(Duration::from_secs(61)).await;
    worker.stop().await;
    let order: Vec<Vec<u8>> = sink.published().into_iter().map(|m| m.payload).collect();
    let expected: Vec<Vec<u8>> = (0..5).map(|i| format!("m{i}").into_bytes()).collect();
    assert_eq!(order, expected);
}

#[tokio::test(start_paused = true)]
async fn drains_until_idle_without_waiting_between_full_batches() {
    let (storage, sink) = memory(false);
    for i in 0..250 {
        storage.enqueue(NewMessage::new("t", format!("m{i}")));
    }
    let cfg = WorkerConfig {
        poll_interval: Duration::from_secs(10),
        batch_size: 100,
        ..config()
    };
    let worker = start(cfg, storage.clone(), sink.clone());
    // Far less than one poll interval: full batches are followed by an immediate claim.
    assert_eq!(published_after(&sink, Duration::from_millis(1)).await, 250);
    assert_eq!(sink.publish_calls(), 3);
    worker.stop().await;
}

#[tokio::test(start_paused = true)]
async fn wake_up_cuts_the_poll_wait_short() {
    let (storage, sink) = memory(false);
    let worker = start(no_polls(), storage.clone(), sink.clone());
    sleep(Duration::from_secs(5)).await;
    storage.enqueue(NewMessage::new("t", "late"));
    assert_eq!(published_after(&sink, Duration::from_millis(1)).await, 1);
    worker.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failing_head_holds_back_its_key_but_not_others() {
    let (storage, sink) = memory(true);
    sink.fail_when(|m| (m.payload == b"a0").then(|| Error::temporary("nack")));
    enqueue_keys_a_and_b(&storage);
    let worker = start(config(), storage.clone(), sink.clone());
    sleep(Duration::from_millis(500)).await;
    let published = payloads(&sink.published());
    assert_eq!(
        published,
        ["b0", "b1", "b2"],
        "key a must wait for its head"
    );
    // a1 and a2 were released uncharged; a0 was charged.
    let attempts = attempts_of(&storage.pending());
    assert_eq!(
        attempts,
        [("a0".into(), 1), ("a1".into(), 0), ("a2".into(), 0)]
    );

    sink.fail_when(|_| None);
    sleep(Duration::from_secs(3)).await;
    worker.stop().await;
    let published = payloads(&sink.published());
    assert_eq!(published, ["b0", "b1", "b2", "a0", "a1", "a2"]);
}

#[tokio::test(start_paused = true)]
async fn permanent_failure_dead_letters_at_once_and_parks_its_key() {
    let (storage, sink) = memory(true);
    sink.fail_when(|m| (m.payload == b"a0").then(|| Error::permanent("message too large")));
    for i in 0..3 {
        storage.enqueue(NewMessage::new("t", format!("a{i}")).key("a"));
    }
    storage.enqueue(NewMessage::new("t", "free"));
    let worker = start(config(), storage.clone(), sink.clone());
    sleep(Duration::from_secs(10)).await;
    worker.stop().await;
    let dead = storage.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0.payload, b"a0");
    assert!(dead[0].1.contains("message too large"));
    assert_eq!(
        sink.published().len(),
        1,
        "only the keyless message may pass"
    );
    assert_eq!(storage.pending().len(), 2, "a1 and a2 stay parked");
    assert_eq!(storage.stats().await.unwrap().parked_keys, 1);
}

/// docs/ARCHITECTURE.md, the table of error kinds: `Config` means bad configuration, and
/// the worker "refuses to start"; only `Permanent` dead-letters at once. A sink whose
/// publish reports a configuration error must not dead-letter (and park) the messages.
#[tokio::test(start_paused = true)]
async fn a_configuration_error_from_publish_dead_letters_nothing() {
    let (storage, sink) = memory(true);
    sink.fail_when(|_| Some(Error::config("sink.url: bad configuration")));
    storage.enqueue(NewMessage::new("t", "k1").key("k"));
    storage.enqueue(NewMessage::new("t", "k2").key("k"));
    let worker = start(config(), storage.clone(), sink.clone());
    sleep(Duration::from_secs(5)).await;
    worker.stop().await;
    let dead: Vec<(String, String)> = storage
        .dead_letters()
        .iter()
        .map(|(m, e)| (text(&m.payload), e.clone()))
        .collect();
    assert!(
        dead.is_empty(),
        "a Config error from the sink dead-lettered {dead:?} and parked key k"
    );
    assert_eq!(storage.pending().len(), 2, "both messages still waiting");
}

/// A sink whose publish never finishes.
struct StuckSink;

#[async_trait]
impl Sink for StuckSink {
    async fn publish(&self, _: &[Message]) -> Result<Vec<Outcome>> {
        std::future::pending().await
    }
    async fn health(&self) -> Result<()> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_releases_a_batch_that_outlives_the_timeout() {
    let storage = Arc::new(MemoryStorage::new(true));
    for i in 0..3 {
        storage.enqueue(NewMessage::new("t", format!("m{i}")));
    }
    let cfg = WorkerConfig {
        shutdown_timeout: Duration::from_secs(2),
        ..config()
    };
    let worker = start(cfg, storage.clone(), Arc::new(StuckSink));
    sleep(Duration::from_secs(1)).await;
    assert_eq!(storage.stats().await.unwrap().in_flight, 3);
    let asked = Instant::now();
    worker.stop().await;
    assert_eq!(asked.elapsed(), Duration::from_secs(2));
    let stats = storage.stats().await.unwrap();
    assert_eq!((stats.in_flight, stats.pending), (0, 3));
    assert!(storage.pending().iter().all(|m| m.attempts == 0));
}

/// A sink that hangs forever on the message whose payload is `hang_on`, fails the one
/// whose payload is `fail` as `Temporary`, and delivers the rest.
struct HangingSink {
    hang_on: &'static str,
    fail: &'static str,
    calls: Mutex<Vec<Vec<String>>>,
}

#[async_trait]
impl Sink for HangingSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        self.calls.lock().unwrap().push(payloads(batch));
        if batch.iter().any(|m| m.payload == self.hang_on.as_bytes()) {
            std::future::pending::<()>().await;
        }
        Ok(batch
            .iter()
            .map(|m| {
                if m.payload == self.fail.as_bytes() {
                    Outcome::Failed(Error::temporary("nack"))
                } else {
                    Outcome::Delivered(crate::Receipt::new("hanging-sink"))
                }
            })
            .collect())
    }
    async fn health(&self) -> Result<()> {
        Ok(())
    }
}

/// docs/ARCHITECTURE.md "Shutdown": on cancellation the worker "lets the batch in flight
/// finish and records its outcomes"; docs/guarantees.md: "exactly once when nothing
/// crashes"; the `Temporary` row: "charges an attempt". A graceful shutdown whose last
/// round outlives `shutdown_timeout` must still record what the earlier rounds already
/// did: a1 is at the broker (recording it released would publish it twice), b1 was
/// refused (releasing it uncharged loses the attempt).
#[tokio::test(start_paused = true)]
async fn a_shutdown_time_out_keeps_the_outcomes_of_rounds_already_published() {
    let storage = Arc::new(MemoryStorage::new(true));
    storage.enqueue(NewMessage::new("t", "a1").key("a"));
    storage.enqueue(NewMessage::new("t", "b1").key("b"));
    storage.enqueue(NewMessage::new("t", "a2").key("a"));
    let sink = Arc::new(HangingSink {
        hang_on: "a2",
        fail: "b1",
        calls: Mutex::new(Vec::new()),
    });
    let cfg = WorkerConfig {
        shutdown_timeout: Duration::from_secs(2),
        ..config()
    };
    let worker = start(cfg, storage.clone(), sink.clone());
    sleep(Duration::from_secs(1)).await;
    assert_eq!(
        *sink.calls.lock().unwrap(),
        [vec!["a1", "b1"], vec!["a2"]],
        "round 1 published, round 2 hanging"
    );
    worker.stop().await;

    let delivered: Vec<String> = storage
        .delivered()
        .iter()
        .map(|(m, _)| text(&m.payload))
        .collect();
    let pending: Vec<(String, u32)> = storage
        .pending()
        .iter()
        .map(|m| (text(&m.payload), m.attempts))
        .collect();
    assert_eq!(
        (delivered, pending),
        (
            vec!["a1".to_string()],
            vec![("b1".to_string(), 1), ("a2".to_string(), 0)]
        ),
        "after the shutdown time-out: a1 (published in round 1) must be recorded delivered, \
         b1 (refused in round 1) charged one attempt, only a2 (the hung round) released"
    );
}

#[test]
fn rounds_hold_one_message_per_key_in_order() {
    let msgs: Vec<Message> = ["a", "b", "a", "a", "c", "b"]
        .iter()
        .enumerate()
        .map(|(i, k)| NewMessage::new("t", i.to_string()).key(*k).into())
        .chain(std::iter::once(NewMessage::new("t", "free").into()))
        .collect();
    let rounds = split_into_rounds(msgs);
    let payloads: Vec<Vec<String>> = rounds
        .iter()
        .map(|r| {
            r.iter()
                .map(|m| String::from_utf8(m.payload.clone()).unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        payloads,
        [vec!["0", "1", "4", "free"], vec!["2", "5"], vec!["3"]]
    );
}

/// Records the keys of every publish call, then hands the call to a [`MemorySink`].
struct KeysPerCall {
    inner: MemorySink,
    calls: Mutex<Vec<Vec<Option<String>>>>,
}

#[async_trait]
impl Sink for KeysPerCall {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        self.calls
            .lock()
            .unwrap()
            .push(batch.iter().map(|m| m.key.clone()).collect());
        self.inner.publish(batch).await
    }
    async fn health(&self) -> Result<()> {
        self.inner.health().await
    }
    fn capabilities(&self) -> SinkCapabilities {
        self.inner.capabilities()
    }
}

/// docs/ARCHITECTURE.md "The traits": "with per-key order a batch holds at most one
/// message per key" (the sink's contract), and "Rounds": "keyless messages all go in
/// the first". Over a backlog of 7 keys with failures and retries, no call holds two
/// messages of a key, every message is delivered once, each key in enqueue order.
#[tokio::test(start_paused = true)]
async fn no_publish_call_holds_two_messages_of_one_key() {
    use std::collections::BTreeMap;

    let storage = Arc::new(MemoryStorage::new(true));
    let sink = Arc::new(KeysPerCall {
        inner: MemorySink::new(),
        calls: Mutex::new(Vec::new()),
    });
    // Every fifth message fails its first try.
    sink.inner.fail_when(|m| {
        let n: usize = text(&m.payload)
            .rsplit('-')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        (n.is_multiple_of(5) && m.attempts == 0).then(|| Error::temporary("first try fails"))
    });
    let mut sent: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 0..300 {
        let payload = format!("m-{i}");
        if i % 8 == 7 {
            storage.enqueue(NewMessage::new("t", payload.clone()));
            sent.entry(String::new()).or_default().push(payload);
        } else {
            let key = format!("k{}", i % 8);
            storage.enqueue(NewMessage::new("t", payload.clone()).key(key.clone()));
            sent.entry(key).or_default().push(payload);
        }
    }
    let cfg = WorkerConfig {
        batch_size: 50,
        lease: Duration::from_secs(60),
        max_attempts: 100,
        ..config()
    };
    let worker = start(cfg, storage.clone(), sink.clone());
    sleep(Duration::from_secs(300)).await;
    worker.stop().await;

    for (n, call) in sink.calls.lock().unwrap().iter().enumerate() {
        let keys: Vec<&String> = call.iter().flatten().collect();
        let unique: HashSet<&String> = keys.iter().copied().collect();
        assert_eq!(
            unique.len(),
            keys.len(),
            "publish call {n} holds two messages of one key: {call:?}"
        );
    }
    let mut got: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in sink.inner.published() {
        got.entry(m.key.clone().unwrap_or_default())
            .or_default()
            .push(text(&m.payload));
    }
    // Keyless messages need no order: compare them as sets.
    let keyless = |map: &mut BTreeMap<String, Vec<String>>| {
        let mut v = map.remove("").unwrap_or_default();
        v.sort();
        v
    };
    assert_eq!(keyless(&mut got), keyless(&mut sent), "keyless messages");
    assert_eq!(got, sent, "every keyed message once, in its key's order");
    assert!(storage.pending().is_empty() && storage.dead_letters().is_empty());
}

#[test]
fn config_validation_names_the_setting() {
    let bad = WorkerConfig {
        batch_size: 0,
        ..config()
    };
    let err = Worker::new(
        bad,
        Arc::new(MemoryStorage::new(true)),
        Arc::new(MemorySink::new()),
    )
    .err()
    .unwrap();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("batch_size"));
}

/// A sink that takes `delay` per publish, delivers everything, and reports `timeout`.
struct SlowSink {
    delay: Duration,
    timeout: Option<Duration>,
    calls: Mutex<Vec<Vec<String>>>,
}

impl SlowSink {
    fn new(delay: Duration, timeout: Option<Duration>) -> Self {
        SlowSink {
            delay,
            timeout,
            calls: Mutex::new(Vec::new()),
        }
    }

    fn calls(&self) -> Vec<Vec<String>> {
        self.calls.lock().unwrap().clone()
    }
}

#[async_trait]
impl Sink for SlowSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        let payloads = batch
            .iter()
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect();
        self.calls.lock().unwrap().push(payloads);
        sleep(self.delay).await;
        Ok(batch
            .iter()
            .map(|_| Outcome::Delivered(crate::Receipt::new("slow")))
            .collect())
    }
    async fn health(&self) -> Result<()> {
        Ok(())
    }
    fn publish_timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_outlives_its_lease_keeps_it_renewed() {
    let storage = Arc::new(MemoryStorage::new(true));
    storage.enqueue(NewMessage::new("t", "k1").key("k"));
    storage.enqueue(NewMessage::new("t", "k2").key("k"));
    // Each round takes 2.5 leases; the lease must be renewed, or another relay takes over.
    let lease = Duration::from_secs(4);
    let sink = Arc::new(SlowSink::new(Duration::from_secs(10), None));
    let cfg = WorkerConfig { lease, ..config() };
    let worker = start(cfg, storage.clone(), sink.clone());
    for _ in 0..19 {
        sleep(Duration::from_secs(1)).await;
        let other = storage.claim("other", 10, lease).await.unwrap();
        assert!(
            other.messages.is_empty(),
            "another relay claimed {:?} while the batch was still publishing",
            other.messages
        );
    }
    sleep(Duration::from_secs(2)).await;
    worker.stop().await;
    assert_eq!(sink.calls(), [vec!["k1"], vec!["k2"]]);
    let delivered: Vec<Vec<u8>> = storage
        .delivered()
        .into_iter()
        .map(|(m, _)| m.payload)
        .collect();
    assert_eq!(delivered, [b"k1".to_vec(), b"k2".to_vec()]);
}

/// The in-memory storage whose lease renewals fail, in one of two ways.
struct LostLease(MemoryStorage, Lost);

/// How a [`LostLease`] storage refuses a renewal.
enum Lost {
    /// The database went away during the batch: the renewal errs.
    Unreachable,
    /// Another relay claimed the rows after the lease ran out on the database's clock: the
    /// renewal changes no row.
    TakenOver,
}

#[async_trait]
impl Storage for LostLease {
    async fn claim(&self, worker: &str, limit: usize, lease: Duration) -> Result<Claim> {
        self.0.claim(worker, limit, lease).await
    }
    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        self.0.settle(token, settlement).await
    }
    async fn extend_lease(&self, _: &ClaimToken, _: &[Uuid], _: Duration) -> Result<u64> {
        match self.1 {
            Lost::Unreachable => Err(Error::unavailable("database is down")),
            Lost::TakenOver => Ok(0),
        }
    }
    async fn health(&self) -> Result<()> {
        Ok(())
    }
    async fn stats(&self) -> Result<QueueStats> {
        self.0.stats().await
    }
    fn capabilities(&self) -> StorageCapabilities {
        self.0.capabilities()
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_whose_lease_runs_out_publishes_nothing_more() {
    let storage = Arc::new(LostLease(MemoryStorage::new(true), Lost::Unreachable));
    storage.0.enqueue(NewMessage::new("t", "k1").key("k"));
    storage.0.enqueue(NewMessage::new("t", "k2").key("k"));
    let lease = Duration::from_secs(4);
    let sink = Arc::new(SlowSink::new(Duration::from_secs(10), None));
    let cfg = WorkerConfig { lease, ..config() };
    let worker = start(cfg, storage.clone(), sink.clone());
    // The first round outlives the lease, which cannot be renewed: the batch stops at the
    // lease's end and k2 is not published by this batch.
    sleep(Duration::from_millis(4500)).await;
    assert_eq!(sink.calls(), [vec!["k1"]], "k2 went out on a lost lease");
    let stats = storage.stats().await.unwrap();
    assert_eq!(
        (stats.in_flight, stats.pending),
        (0, 2),
        "the lost batch gives its messages back uncharged while they are still its own"
    );
    worker.stop().await;
    assert!(storage.0.pending().iter().all(|m| m.attempts == 0));
}

/// docs/ARCHITECTURE.md "Leases": "When renewal fails (taken over, or the storage
/// cannot be reached ...) it stops the batch: the round in flight is abandoned and
/// nothing more is published". The test above covers the unreachable storage; this one
/// the takeover, seen as a renewal that changes fewer rows than claimed.
#[tokio::test(start_paused = true)]
async fn a_renewal_that_finds_the_claim_taken_over_stops_the_batch_at_once() {
    let storage = Arc::new(LostLease(MemoryStorage::new(true), Lost::TakenOver));
    storage.0.enqueue(NewMessage::new("t", "k1").key("k"));
    storage.0.enqueue(NewMessage::new("t", "k2").key("k"));
    let sink = Arc::new(SlowSink::new(Duration::from_secs(10), None));
    let cfg = WorkerConfig {
        lease: Duration::from_secs(6),
        ..config()
    };
    let worker = start(cfg, storage.clone(), sink.clone());
    // The renewal is due with a third of the 6 s lease left (at 4 s) and is refused.
    sleep(Duration::from_millis(4500)).await;
    assert_eq!(
        sink.calls(),
        [vec!["k1"]],
        "k2 went out after the claim was taken over"
    );
    let stats = storage.stats().await.expect("stats");
    assert_eq!(
        (stats.in_flight, stats.pending),
        (0, 2),
        "the batch stopped when the renewal was refused, before its lease ran out"
    );
    worker.stop().await;
    assert!(storage.0.delivered().is_empty());
    assert!(storage.0.pending().iter().all(|m| m.attempts == 0));
}

/// Found by fuzzing the binary's configuration: a lease of `u64::MAX` seconds was accepted
/// and the first claim panicked adding it to the clock. Library users get the same bound.
#[test]
fn durations_over_a_year_are_refused_naming_the_setting() {
    let huge = Duration::from_secs(u64::MAX);
    for (setting, cfg) in [
        (
            "lease",
            WorkerConfig {
                lease: huge,
                ..config()
            },
        ),
        (
            "poll_interval",
            WorkerConfig {
                poll_interval: huge,
                ..config()
            },
        ),
        (
            "shutdown_timeout",
            WorkerConfig {
                shutdown_timeout: huge,
                ..config()
            },
        ),
    ] {
        let err = cfg.validate().expect_err("longer than a year");
        assert_eq!(err.kind(), ErrorKind::Config);
        let text = err.in_section("relay").to_string();
        assert!(
            text.contains(&format!("relay.{setting} is")) && text.contains("at most 1 year"),
            "{text}"
        );
    }
    let year = WorkerConfig {
        lease: WorkerConfig::MAX_DURATION,
        ..config()
    };
    assert!(year.validate().is_ok());
}

#[test]
fn a_lease_shorter_than_the_worst_batch_is_refused_naming_both_settings() {
    let sink = Arc::new(SlowSink::new(Duration::ZERO, Some(Duration::from_secs(10))));
    let cfg = WorkerConfig {
        lease: Duration::from_secs(60),
        batch_size: 8,
        ..config()
    };
    let err = Worker::new(
        cfg.clone(),
        Arc::new(MemoryStorage::new(true)),
        sink.clone(),
    )
    .err()
    .expect("8 rounds of 10 s do not fit a 60 s lease");
    assert_eq!(err.kind(), ErrorKind::Config);
    let text = err.in_section("relay").to_string();
    for needle in ["relay.lease is 60s", "(batch_size)", "80s"] {
        assert!(text.contains(needle), "{needle} missing from: {text}");
    }
    // Without per-key order a batch is one round.
    assert!(
        Worker::new(
            cfg.clone(),
            Arc::new(MemoryStorage::new(false)),
            sink.clone()
        )
        .is_ok()
    );
    let long = WorkerConfig {
        lease: Duration::from_secs(80),
        ..cfg
    };
    assert!(Worker::new(long, Arc::new(MemoryStorage::new(true)), sink).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_sink_with_ordered_key_runs_takes_a_batch_in_one_call_and_stops_a_key_at_its_failure() {
    let (storage, sink) = memory(true);
    sink.set_ordered_key_runs(true);
    // The middle of key a's run fails: a0 lands, a2 must not.
    sink.fail_when(|m| (m.payload == b"a1").then(|| Error::temporary("nack")));
    enqueue_keys_a_and_b(&storage);
    let worker = start(config(), storage.clone(), sink.clone());
    sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.publish_calls(), 1, "one call for the whole batch");
    assert_eq!(payloads(&sink.published()), ["a0", "b0", "b1", "b2"]);
    // a1 was charged; a2, behind it and never tried, was put back uncharged.
    let attempts = attempts_of(&storage.pending());
    assert_eq!(attempts, [("a1".into(), 1), ("a2".into(), 0)]);

    sink.fail_when(|_| None);
    sleep(Duration::from_secs(3)).await;
    worker.stop().await;
    assert_eq!(
        payloads(&sink.published()),
        ["a0", "b0", "b1", "b2", "a1", "a2"]
    );
}

#[test]
fn a_sink_with_ordered_key_runs_needs_a_lease_for_one_round_only() {
    let storage: Arc<dyn Storage> = Arc::new(MemoryStorage::new(true));
    let timeout = Duration::from_secs(10);
    struct Timed(MemorySink, Duration);
    #[async_trait]
    impl Sink for Timed {
        async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
            self.0.publish(batch).await
        }
        async fn health(&self) -> Result<()> {
            self.0.health().await
        }
        fn capabilities(&self) -> SinkCapabilities {
            self.0.capabilities()
        }
        fn publish_timeout(&self) -> Option<Duration> {
            Some(self.1)
        }
    }
    let config = WorkerConfig {
        lease: Duration::from_secs(15),
        ..config()
    };
    let rounds = Arc::new(Timed(MemorySink::new(), timeout));
    assert!(Worker::new(config.clone(), storage.clone(), rounds).is_err());
    let runs = Timed(MemorySink::new(), timeout);
    runs.0.set_ordered_key_runs(true);
    assert!(Worker::new(config, storage, Arc::new(runs)).is_ok());
}

#[test]
fn the_topic_label_names_the_first_topics_and_counts_the_rest_as_other() {
    let labels = TopicLabels::new(2);
    assert_eq!(labels.label("a"), "a");
    assert_eq!(labels.label("b"), "b");
    assert_eq!(labels.label("c"), "_other");
    assert_eq!(labels.label("a"), "a", "a named topic keeps its label");
    assert_eq!(labels.label("d"), "_other");
    assert_eq!(TopicLabels::new(0).label("a"), "_all");
}

/// The in-memory storage with a settlement that takes `delay`: counts the claims made while
/// a settlement was out.
struct SlowSettle {
    inner: MemoryStorage,
    delay: Duration,
    settling: std::sync::atomic::AtomicUsize,
    overlapped: std::sync::atomic::AtomicUsize,
}

/// A [`SlowSettle`] storage holding `messages`, and an in-memory sink.
fn slow_settle(
    per_key_order: bool,
    delay: Duration,
    messages: impl Iterator<Item = NewMessage>,
) -> (Arc<SlowSettle>, Arc<MemorySink>) {
    let inner = MemoryStorage::new(per_key_order);
    messages.for_each(|m| inner.enqueue(m));
    let storage = SlowSettle {
        inner,
        delay,
        settling: Default::default(),
        overlapped: Default::default(),
    };
    (Arc::new(storage), Arc::new(MemorySink::new()))
}

impl SlowSettle {
    fn overlapped(&self) -> usize {
        self.overlapped.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[async_trait]
impl Storage for SlowSettle {
    async fn claim(&self, worker: &str, limit: usize, lease: Duration) -> Result<Claim> {
        if self.settling.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            self.overlapped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.claim(worker, limit, lease).await
    }
    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        self.settling.fetch_add(1, SeqCst);
        sleep(self.delay).await;
        let settled = self.inner.settle(token, settlement).await;
        self.settling.fetch_sub(1, SeqCst);
        settled
    }
    async fn extend_lease(&self, token: &ClaimToken, ids: &[Uuid], lease: Duration) -> Result<u64> {
        self.inner.extend_lease(token, ids, lease).await
    }
    async fn health(&self) -> Result<()> {
        Ok(())
    }
    async fn stats(&self) -> Result<QueueStats> {
        self.inner.stats().await
    }
    fn capabilities(&self) -> StorageCapabilities {
        self.inner.capabilities()
    }
}

#[tokio::test(start_paused = true)]
async fn the_next_batch_is_claimed_and_published_while_the_last_one_settles() {
    let (storage, sink) = slow_settle(false, Duration::from_millis(100), numbered("m", 1000));
    let worker = start(batches_of(100), storage.clone(), sink.clone());
    // The first batch is published at once; the second while the first settles.
    assert_eq!(
        published_after(&sink, Duration::from_millis(50)).await,
        200,
        "two batches out, one settling"
    );
    assert_eq!(published_after(&sink, Duration::from_secs(2)).await, 1000);
    assert_eq!(storage.inner.delivered().len(), 1000, "every batch settled");
    // Every claim after the first ran while the batch before it settled.
    assert!(
        storage.overlapped() >= 9,
        "claims made while a settlement was out: {}",
        storage.overlapped()
    );
    worker.stop().await;
}

/// One key only: the claim made while the key's batch settles comes back empty (the key is
/// still claimed), and the worker claims again as soon as that settlement is written instead
/// of waiting for work.
#[tokio::test(start_paused = true)]
async fn a_key_held_by_a_settling_batch_is_claimed_right_after_it_without_waiting() {
    let keyed = numbered("k", 30).map(|m| m.key("k"));
    let (storage, sink) = slow_settle(true, Duration::from_millis(100), keyed);
    let worker = start(batches_of(10), storage.clone(), sink.clone());
    // Three batches of the key, 100 ms of settlement each: far less than a poll interval.
    sleep(Duration::from_secs(2)).await;
    let order: Vec<Vec<u8>> = sink.published().into_iter().map(|m| m.payload).collect();
    let expected: Vec<Vec<u8>> = (0..30).map(|i| format!("k{i}").into_bytes()).collect();
    assert_eq!(order, expected, "each once, in key order");
    assert_eq!(storage.inner.delivered().len(), 30);
    assert!(
        storage.overlapped() >= 1,
        "a claim ran while a batch settled"
    );
    worker.stop().await;
}

/// Shutdown comes while the second batch is out and the first is settling: both are
/// written before the worker stops.
#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_the_batch_being_settled() {
    let (storage, sink) = slow_settle(false, Duration::from_secs(1), numbered("m", 20));
    let worker = start(batches_of(10), storage.clone(), sink.clone());
    assert_eq!(
        published_after(&sink, Duration::from_millis(500)).await,
        20,
        "both batches published"
    );
    assert!(
        storage.inner.delivered().is_empty(),
        "the first still settling"
    );
    worker.stop().await;
    assert_eq!(
        storage.inner.delivered().len(),
        20,
        "both settlements were written before the worker stopped"
    );
}
