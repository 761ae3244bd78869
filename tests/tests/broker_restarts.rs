//! Brokers that go away or refuse writes while a relay runs, on servers of the test's own
//! (`outbox_test_support::servers`: a port and data directory of their own, so the shared
//! services that other tests use are never disturbed): a Redis server killed and then
//! restarted in the middle of pipelined batches, a Redis server that turns read-only
//! (`REPLICAOF` a port nothing listens on) and then runs out of memory (`maxmemory`, policy
//! `noeviction`), a RabbitMQ node restarted and a NATS server (JetStream, file storage)
//! killed and restarted.
//!
//! In each, the real worker relays from PostgreSQL (a schema of the test's own, delivered rows
//! kept) through the real sink while a writer keeps enqueueing on several keys; the server
//! goes away or refuses while a publish is on the wire, and comes back. Then every message is
//! at the broker, each key's first arrivals in enqueue order; nothing was delivered, charged
//! an attempt or dead-lettered while the server was away; the same relay and sink delivered
//! again once it was back, without a restart; and every delivered row records 0 attempts
//! (docs/guarantees.md: a sink outage charges no attempt and dead-letters nothing). The
//! duplicates at-least-once allows are counted and printed, with the time each recovery took.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::StreamExt;
use outbox_core::{Message, NewMessage, Outcome, Result, Sink, SinkCapabilities, Template};
use outbox_test_support::servers::{self, free_port};
use outbox_test_support::unique_name;
use outbox_tests::{Relay, TestOutbox};
use uuid::Uuid;

/// The real sink, watched: every call goes to it unchanged, and the test learns whether a
/// publish is on the wire (to cut the server in the middle of one) and what the calls gave.
struct Watched {
    sink: Arc<dyn Sink>,
    publishing: AtomicUsize,
    calls: AtomicU64,
    delivered: AtomicU64,
    /// Messages that failed, by the kind of their error.
    failed: Mutex<BTreeMap<String, u64>>,
    /// The first errors other than `Unavailable`, for the failure message.
    charged: Mutex<Vec<String>>,
    /// Failed health checks, and the first few distinct reasons.
    unhealthy: AtomicU64,
    reasons: Mutex<Vec<String>>,
}

/// Counts a publish as on the wire while it lives (the worker may drop a publish future).
struct OnTheWire<'a>(&'a AtomicUsize);

impl Drop for OnTheWire<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Watched {
    fn new(sink: Arc<dyn Sink>) -> Arc<Watched> {
        Arc::new(Watched {
            sink,
            publishing: AtomicUsize::new(0),
            calls: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            failed: Mutex::new(BTreeMap::new()),
            charged: Mutex::new(Vec::new()),
            unhealthy: AtomicU64::new(0),
            reasons: Mutex::new(Vec::new()),
        })
    }

    fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::SeqCst)
    }

    fn publishing(&self) -> bool {
        self.publishing.load(Ordering::SeqCst) > 0
    }

    /// The failures so far, by kind, and the health checks' reasons, for a failure message.
    fn failures(&self) -> String {
        format!(
            "{:?} (first charged: {:?}); failed health checks: {:?}",
            self.failed.lock().unwrap(),
            self.charged.lock().unwrap(),
            self.reasons.lock().unwrap()
        )
    }

    fn failure(&self, error: &outbox_core::Error, messages: u64) {
        let kind = error.kind();
        *self
            .failed
            .lock()
            .unwrap()
            .entry(kind.to_string())
            .or_default() += messages;
        if kind != outbox_core::ErrorKind::Unavailable {
            let mut charged = self.charged.lock().unwrap();
            if charged.len() < 5 {
                charged.push(error.to_string());
            }
        }
    }
}

#[async_trait]
impl Sink for Watched {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        self.publishing.fetch_add(1, Ordering::SeqCst);
        let _wire = OnTheWire(&self.publishing);
        self.calls.fetch_add(1, Ordering::SeqCst);
        let result = self.sink.publish(batch).await;
        match &result {
            Ok(outcomes) => {
                for outcome in outcomes {
                    match outcome {
                        Outcome::Delivered(_) => {
                            self.delivered.fetch_add(1, Ordering::SeqCst);
                        }
                        Outcome::Failed(error) => self.failure(error, 1),
                    }
                }
            }
            Err(error) => self.failure(error, batch.len() as u64),
        }
        result
    }

    async fn health(&self) -> Result<()> {
        let health = self.sink.health().await;
        if let Err(error) = &health {
            self.unhealthy.fetch_add(1, Ordering::SeqCst);
            let reason: String = error.to_string().chars().take(200).collect();
            let mut reasons = self.reasons.lock().unwrap();
            if reasons.len() < 4 && !reasons.contains(&reason) {
                reasons.push(reason);
            }
        }
        health
    }

    fn capabilities(&self) -> SinkCapabilities {
        self.sink.capabilities()
    }

    fn publish_timeout(&self) -> Option<Duration> {
        self.sink.publish_timeout()
    }
}

/// How the writer enqueues: `rounds_before` rounds at once (a backlog, so batches are full
/// and publishes long), then a round every `pause`; a round is `per_key` messages of each of
/// `keys` keys and `unkeyed` messages without a key, in one transaction, with payloads of
/// `payload` bytes.
#[derive(Clone, Copy)]
struct Load {
    keys: usize,
    per_key: usize,
    unkeyed: usize,
    rounds_before: usize,
    pause: Duration,
    payload: usize,
}

/// A writer enqueueing in the background, as an application does.
struct Writer {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<Vec<NewMessage>>,
}

impl Writer {
    fn start(outbox: Arc<TestOutbox>, topic: String, load: Load) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let handle = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut sent = Vec::new();
                let mut round = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let keyed = load.keys * load.per_key;
                    let messages: Vec<NewMessage> = (0..keyed + load.unkeyed)
                        .map(|i| {
                            let key = (i < keyed).then(|| format!("k{}", i % load.keys));
                            let mut payload = format!("{key:?} {round} {i} ").into_bytes();
                            payload.resize(load.payload.max(payload.len()), b'.');
                            let message = NewMessage::new(topic.as_str(), payload);
                            match key {
                                Some(key) => message.key(key),
                                None => message,
                            }
                        })
                        .collect();
                    outbox.enqueue(&messages).await;
                    sent.extend(messages);
                    round += 1;
                    if round > load.rounds_before {
                        tokio::time::sleep(load.pause).await;
                    }
                }
                sent
            }
        });
        Writer { stop, handle }
    }

    /// Stops it; returns what it enqueued, in enqueue order.
    async fn stop(self) -> Vec<NewMessage> {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.await.expect("the writer")
    }
}

/// A relay running through a watched sink while a writer enqueues, and what the test saw.
struct Run {
    name: &'static str,
    outbox: Arc<TestOutbox>,
    sink: Arc<Watched>,
    relay: Option<Relay>,
    writer: Option<Writer>,
    started: Instant,
    report: Vec<String>,
    /// Messages delivered when the last outage began.
    before_outage: u64,
}

impl Run {
    /// Starts the writer and a relay (the real worker, test settings) through `sink`.
    async fn start(name: &'static str, sink: Arc<dyn Sink>, topic: &str, load: Load) -> Run {
        let outbox = Arc::new(
            TestOutbox::with_config(|c| c.retention = Some(Duration::from_secs(3600))).await,
        );
        let writer = Writer::start(outbox.clone(), topic.to_string(), load);
        let sink = Watched::new(sink);
        let relay = outbox.relay(name, sink.clone());
        Run {
            name,
            outbox,
            sink,
            relay: Some(relay),
            writer: Some(writer),
            started: Instant::now(),
            report: Vec::new(),
            before_outage: 0,
        }
    }

    fn note(&mut self, line: String) {
        eprintln!("[{} {:>5.1?}] {line}", self.name, self.started.elapsed());
        self.report.push(line);
    }

    /// Waits until at least `delivered` messages went out and a publish is on the wire
    /// (within 30 s): the moment to cut the server.
    async fn publishing_after(&mut self, delivered: u64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.sink.delivered() < delivered || !self.sink.publishing() {
            if Instant::now() >= deadline {
                let stats = self.outbox.stats().await;
                panic!(
                    "[{}] no publish under way with {delivered} delivered within 30 s: {} \
                     delivered, failures {}, queue {stats:?}",
                    self.name,
                    self.sink.delivered(),
                    self.sink.failures()
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.before_outage = self.sink.delivered();
    }

    /// While the server is away (for `hold` after the publish that was on the wire when it
    /// went has returned): nothing is delivered, nothing charged, nothing dead-lettered, and
    /// the writer's messages wait.
    async fn held_back(&mut self, what: &str, hold: Duration) {
        self.held_back_counting(what, hold, || async { None }).await;
    }

    /// [`held_back`](Self::held_back), where the broker can still be asked how many
    /// messages it holds (`broker_count`): that must not change either.
    async fn held_back_counting<F, Fut>(&mut self, what: &str, hold: Duration, broker_count: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Option<usize>>,
    {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.sink.publishing() {
            assert!(
                Instant::now() < deadline,
                "[{}] the publish under way when {what} did not return within 30 s",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let delivered = self.sink.delivered();
        let in_the_call = delivered - self.before_outage;
        let at_broker = broker_count().await;
        let pending_before = self.outbox.stats().await.pending;
        let calls = self.sink.calls.load(Ordering::SeqCst);
        tokio::time::sleep(hold).await;
        let stats = self.outbox.stats().await;
        let calls = self.sink.calls.load(Ordering::SeqCst) - calls;
        assert_eq!(
            self.sink.delivered(),
            delivered,
            "[{}] delivered while {what}",
            self.name
        );
        assert_eq!(
            broker_count().await,
            at_broker,
            "[{}] the broker took messages while {what}",
            self.name
        );
        assert_eq!(stats.dead_lettered, 0, "[{}] {what}: {stats:?}", self.name);
        assert_eq!(stats.retrying, 0, "[{}] {what}: {stats:?}", self.name);
        assert!(
            stats.pending > pending_before,
            "[{}] the writer's messages wait while {what}: {stats:?}",
            self.name
        );
        let attempts = self.outbox.attempts().await;
        assert!(
            attempts.iter().all(|&a| a == 0),
            "[{}] attempts charged while {what}: {:?}; errors: {:?}",
            self.name,
            attempts.iter().filter(|&&a| a > 0).count(),
            self.sink.charged.lock().unwrap()
        );
        self.note(format!(
            "{what}: {in_the_call} delivered in the call on the wire; then for {hold:?} \
             nothing delivered, {calls} publish calls made, {} messages waiting, 0 attempts \
             charged, 0 dead letters",
            stats.pending
        ));
    }

    /// Kills `server` (SIGKILL, `who` names it) while a publish is on the wire, checks that
    /// nothing goes out for `hold` ([`held_back`](Self::held_back)), and starts it again:
    /// how long the start took.
    async fn killed_and_started(
        &mut self,
        server: &mut servers::Server,
        who: &str,
        hold: Duration,
    ) -> Duration {
        server.kill().await;
        self.held_back(&format!("{who} killed"), hold).await;
        server.start().await
    }

    /// Stops `server` cleanly (SIGTERM, `who` names it), checks that nothing goes out for
    /// `hold` ([`held_back`](Self::held_back)), and starts it again: how long the start
    /// took.
    async fn stopped_and_started(
        &mut self,
        server: &mut servers::Server,
        who: &str,
        hold: Duration,
    ) -> Duration {
        let took = server.stop().await;
        self.note(format!("{who} stopped (SIGTERM) in {took:?}"));
        self.held_back(&format!("{who} stopped"), hold).await;
        server.start().await
    }

    /// Waits until the relay delivers again (within 60 s): the same worker and sink, not
    /// restarted. Returns how long it took.
    async fn recovered(&mut self, what: &str) -> Duration {
        let since = Instant::now();
        let delivered = self.sink.delivered();
        while self.sink.delivered() <= delivered {
            if since.elapsed() >= Duration::from_secs(60) {
                let stats = self.outbox.stats().await;
                panic!(
                    "[{}] the relay did not deliver within 60 s after {what}: failures {}, \
                     queue {stats:?}",
                    self.name,
                    self.sink.failures()
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let took = since.elapsed();
        self.note(format!(
            "{what}: delivering again after {took:?} (same relay, same sink)"
        ));
        took
    }

    /// Lets the writer go on for `more`, stops it, waits until everything is delivered with
    /// no dead letter, and checks the delivered rows: every message once, none charged an
    /// attempt. Returns what was enqueued, in order.
    async fn finish(mut self, more: Duration) -> (Vec<NewMessage>, Vec<String>) {
        tokio::time::sleep(more).await;
        let sent = self.writer.take().expect("the writer").stop().await;
        self.outbox
            .drained_with_no_dead_letters(Duration::from_secs(60))
            .await;
        self.relay.take().expect("the relay").stop().await;
        let (rows, charged, max): (i64, i64, i32) = sqlx::query_as(&format!(
            "SELECT count(*), count(*) FILTER (WHERE attempts > 0), coalesce(max(attempts), 0) \
             FROM {}",
            self.outbox.table.qualified("_delivered")
        ))
        .fetch_one(&self.outbox.pool)
        .await
        .expect("the delivered rows");
        assert_eq!(rows as usize, sent.len(), "[{}] delivered rows", self.name);
        assert_eq!(
            (charged, max),
            (0, 0),
            "[{}] delivered rows that were charged attempts (the most: {max}); errors: {:?}",
            self.name,
            self.sink.charged.lock().unwrap()
        );
        let failed = self.sink.failed.lock().unwrap().clone();
        assert!(
            failed.keys().all(|kind| kind == "unavailable"),
            "[{}] the sink failed messages other than as unavailable: {failed:?}: {:?}",
            self.name,
            self.sink.charged.lock().unwrap()
        );
        let line = format!(
            "{} messages enqueued and delivered in {:?}, {} publish calls, failures by kind \
             {failed:?}, every delivered row with 0 attempts; {} failed health checks: {:?}",
            sent.len(),
            self.started.elapsed(),
            self.sink.calls.load(Ordering::SeqCst),
            self.sink.unhealthy.load(Ordering::SeqCst),
            self.sink.reasons.lock().unwrap()
        );
        self.note(line);
        (sent, self.report)
    }
}

/// Checks what the broker holds (message ids in the order its consumer reads them) against
/// what was enqueued: every message is there, nothing else is, and each key's first
/// arrivals are in enqueue order (messages without a key have no order to keep). Returns
/// the number of duplicates, which it prints with the run's `report` (`held_in`: where the
/// broker holds them, for the line).
fn check_arrivals(
    name: &str,
    sent: &[NewMessage],
    arrived: &[Uuid],
    report: &[String],
    held_in: &str,
) -> usize {
    let position: HashMap<Uuid, (usize, Option<&str>)> = sent
        .iter()
        .enumerate()
        .map(|(i, m)| (m.id, (i, m.key.as_deref())))
        .collect();
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut duplicates = 0;
    for id in arrived {
        let Some(&(at, key)) = position.get(id) else {
            panic!("[{name}] {id} arrived but was never enqueued");
        };
        if !seen.insert(*id) {
            duplicates += 1;
            continue;
        }
        if let Some(key) = key
            && let Some(before) = last.insert(key, at)
        {
            assert!(
                before < at,
                "[{name}] key {key}: message {at} (in enqueue order) first arrived after {before}"
            );
        }
    }
    let lost: Vec<&Uuid> = sent
        .iter()
        .map(|m| &m.id)
        .filter(|id| !seen.contains(id))
        .collect();
    assert!(
        lost.is_empty(),
        "[{name}] {} of {} messages never reached the broker: {:?}",
        lost.len(),
        sent.len(),
        &lost[..lost.len().min(5)]
    );
    assert_eq!(arrived.len(), sent.len() + duplicates);
    eprintln!(
        "[{name}] {} messages, {duplicates} duplicates in the {held_in}\n  {}",
        sent.len(),
        report.join("\n  ")
    );
    duplicates
}

/// A directory of the test's own for a server's data; removed by [`Scratch::drop`].
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(prefix: &str) -> Scratch {
        Scratch(std::env::temp_dir().join(unique_name(prefix)))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------
// Redis

mod redis_server {
    use std::time::Duration;

    use outbox_redis::redis::{self, AsyncCommands, aio::MultiplexedConnection};

    /// A connection of the test's own (replies within 30 s: a whole stream is megabytes).
    pub async fn connect(url: &str) -> MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(30)));
        redis::Client::open(url)
            .expect("a Redis URL")
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap_or_else(|e| panic!("the test's own redis-server at {url}: {e}"))
    }

    /// `XLEN`, once a server that was just started has loaded its AOF (it answers `LOADING`
    /// until then, to the relay as well).
    pub async fn xlen(url: &str, stream: &str) -> usize {
        let mut connection = connect(url).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match connection.xlen(stream).await {
                Ok(n) => return n,
                Err(e) if e.code() == Some("LOADING") && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("XLEN {stream}: {e}"),
            }
        }
    }

    /// The message ids of `stream`, in stream order.
    pub async fn ids(url: &str, stream: &str) -> Vec<uuid::Uuid> {
        let reply: redis::streams::StreamRangeReply =
            connect(url).await.xrange_all(stream).await.expect("XRANGE");
        reply
            .ids
            .iter()
            .map(|entry| {
                let id: String = entry.get(outbox_redis::wire::ID).expect("outbox-id");
                id.parse().expect("a UUID")
            })
            .collect()
    }

    /// The entries appended by calls an outage cut off (synced to the AOF before replies that
    /// never came), for the report: read as soon as the server is back, before the relay's
    /// next health check as a rule (it waits up to its backoff, 500 ms). That is what the
    /// server holds beyond the deliveries the relay was told of, less the second copies of
    /// those `earlier` restarts counted (with de-duplication: plus, as their second publishes
    /// added no entry).
    pub async fn unacknowledged(
        url: &str,
        stream: &str,
        run: &super::Run,
        dedup: bool,
        earlier: u64,
    ) -> u64 {
        let held = xlen(url, stream).await as i64;
        let extra = held - run.sink.delivered() as i64;
        let earlier = earlier as i64;
        let found = if dedup {
            extra + earlier
        } else {
            extra - earlier
        };
        found.max(0) as u64
    }

    pub async fn command(url: &str, args: &[&str]) {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        let _: () = cmd
            .query_async(&mut connect(url).await)
            .await
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    }
}

/// The Redis sink on the test's own server, with 1 s time-outs, de-duplicating by message id
/// (records kept 10 minutes) when `dedup`.
fn redis_sink(url: &str, prefix: &str, dedup: bool) -> Arc<dyn Sink> {
    let mut config = outbox_redis::RedisConfig::new(url)
        .stream_prefix(prefix)
        .publish_timeout(Duration::from_secs(1));
    config.dedup_key_prefix = format!("{prefix}dedup:");
    if dedup {
        config = config.dedup(Duration::from_secs(600));
    }
    Arc::new(outbox_redis::RedisSink::new(config).expect("valid sink configuration"))
}

/// The test's own redis-server (started, its data in a directory of its own) and a run of
/// the relay into a stream of its own on it, through the Redis sink ([`redis_sink`]).
struct OwnRedis {
    server: servers::Server,
    url: String,
    stream: String,
    /// Last, so the server goes before its directory.
    _dir: Scratch,
}

impl OwnRedis {
    /// The server (data in a directory `scratch_<random>`) and the run `name` of
    /// [`REDIS_LOAD`] into the stream `<names>_<random>:events`.
    async fn start(name: &'static str, scratch: &str, names: &str, dedup: bool) -> (OwnRedis, Run) {
        let dir = Scratch::new(scratch);
        let mut server = servers::redis(&dir.0);
        server.start().await;
        let url = format!("redis://{}", server.addr());
        let prefix = format!("{}:", unique_name(names));
        let sink = redis_sink(&url, &prefix, dedup);
        assert!(sink.capabilities().ordered_key_runs, "batches go whole");
        let run = Run::start(name, sink, "events", REDIS_LOAD).await;
        let redis = OwnRedis {
            server,
            url,
            stream: format!("{prefix}events"),
            _dir: dir,
        };
        (redis, run)
    }

    /// Ends `run` ([`Run::finish`]) and checks what the stream holds ([`check_arrivals`]):
    /// the duplicates in it.
    async fn duplicates(&self, run: Run) -> usize {
        let name = run.name;
        let (sent, report) = run.finish(Duration::from_secs(1)).await;
        let arrived = redis_server::ids(&self.url, &self.stream).await;
        check_arrivals(name, &sent, &arrived, &report, "stream")
    }
}

/// Two tests of the Redis scenario `$scenario(name, dedup)`: `$plain` without
/// de-duplication, `$dedup` with it, each a run of its own name.
macro_rules! redis_tests {
    ($scenario:ident: $plain:ident = $plain_name:literal, $dedup:ident = $dedup_name:literal) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $plain() {
            $scenario($plain_name, false).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $dedup() {
            $scenario($dedup_name, true).await;
        }
    };
}

/// One-kilobyte messages over 20 keys and a few without a key, a backlog first: each claim
/// takes 8 of each key (the storage's `max_per_key`) and unkeyed ones, which go in one call
/// and one pipeline of 20 key-run scripts and single appends (about 170 KB) that Redis,
/// syncing its AOF before it replies, takes some milliseconds to work through.
const REDIS_LOAD: Load = Load {
    keys: 20,
    per_key: 2,
    unkeyed: 4,
    rounds_before: 50,
    pause: Duration::from_millis(40),
    payload: 1024,
};

/// Redis killed (SIGKILL) while a pipelined batch is on the wire, started again on the same
/// port and AOF; then stopped cleanly (SIGTERM) while another is, and started again. Without
/// de-duplication, the entries of a batch whose replies the kill cut off are appended again
/// (counted); with it, each message is in the stream once.
async fn redis_restart(name: &'static str, dedup: bool) {
    let (mut redis, mut run) =
        OwnRedis::start(name, "outbox_redis_restart", "restart", dedup).await;
    let (url, stream) = (redis.url.clone(), redis.stream.clone());
    let hold = Duration::from_secs(2);

    run.publishing_after(500).await;
    let up = run
        .killed_and_started(&mut redis.server, "redis-server", hold)
        .await;
    let mut unacknowledged = redis_server::unacknowledged(&url, &stream, &run, dedup, 0).await;
    run.note(format!(
        "redis-server started again in {up:?}; {unacknowledged} entries were appended by the \
         call the kill cut off, without a reply"
    ));
    run.recovered("restart after the kill").await;

    run.publishing_after(run.sink.delivered() + 500).await;
    run.stopped_and_started(&mut redis.server, "redis-server", hold)
        .await;
    let earlier = unacknowledged;
    unacknowledged = redis_server::unacknowledged(&url, &stream, &run, dedup, earlier).await;
    run.note(format!(
        "redis-server started again; {unacknowledged} entries were appended by the call the \
         stop cut off, without a reply"
    ));
    run.recovered("restart after the stop").await;

    let duplicates = redis.duplicates(run).await;
    if dedup {
        assert_eq!(duplicates, 0, "[{name}] de-duplicated: each message once");
    }
}

redis_tests!(redis_restart:
    a_redis_restart_in_the_middle_of_a_pipelined_run_loses_nothing = "redis-restart",
    a_redis_restart_with_dedup_appends_each_message_once = "redis-restart-dedup");

/// Redis refusing writes while a pipelined batch is on the wire: first `READONLY` (made a
/// replica of a port nothing listens on; its data stay), back to a primary; then `OOM`
/// (`maxmemory` 1 byte, `noeviction`), back to no limit. Without de-duplication a refusal
/// is the reply of an `XADD` or of an append inside a key-run script; with it, also the
/// error of the whole de-duplication script.
async fn redis_refusals(name: &'static str, dedup: bool) {
    let (redis, mut run) = OwnRedis::start(name, "outbox_redis_refusals", "refusals", dedup).await;
    let (url, stream) = (redis.url.clone(), redis.stream.clone());
    let count = || async { Some(redis_server::xlen(&url, &stream).await) };

    run.publishing_after(500).await;
    let nowhere = free_port().to_string();
    redis_server::command(&url, &["REPLICAOF", "127.0.0.1", &nowhere]).await;
    let what = "Redis read-only (REPLICAOF a closed port)";
    run.held_back_counting(what, Duration::from_secs(3), count)
        .await;
    redis_server::command(&url, &["REPLICAOF", "NO", "ONE"]).await;
    run.recovered("REPLICAOF NO ONE").await;

    run.publishing_after(run.sink.delivered() + 500).await;
    redis_server::command(&url, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).await;
    redis_server::command(&url, &["CONFIG", "SET", "maxmemory", "1"]).await;
    let what = "Redis out of memory (maxmemory 1, noeviction)";
    run.held_back_counting(what, Duration::from_secs(3), count)
        .await;
    redis_server::command(&url, &["CONFIG", "SET", "maxmemory", "0"]).await;
    run.recovered("maxmemory 0").await;

    let duplicates = redis.duplicates(run).await;
    // A refused command appends nothing, and a script is refused before its first append or
    // not at all: nothing reported failed is in the stream.
    assert_eq!(duplicates, 0, "[{name}] a refusal appends nothing");
}

redis_tests!(redis_refusals:
    redis_refusing_writes_readonly_then_oom_loses_nothing_and_charges_nothing = "redis-refusals",
    redis_refusing_writes_with_dedup_loses_nothing_and_charges_nothing = "redis-refusals-dedup");

// ---------------------------------------------------------------------------------------
// NATS JetStream

/// NATS: one message per key per round (the sink keeps no key runs), so smaller batches.
const NATS_LOAD: Load = Load {
    keys: 20,
    per_key: 1,
    unkeyed: 2,
    rounds_before: 40,
    pause: Duration::from_millis(40),
    payload: 256,
};

/// nats-server (JetStream, a file stream) killed (SIGKILL) while a window of publishes waits
/// for its acknowledgements, started again on the same port and store; then stopped cleanly
/// (SIGTERM) and started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_in_the_middle_of_a_run_loses_nothing() {
    use outbox_nats::async_nats::{self, jetstream};

    let dir = Scratch::new("outbox_nats_restart");
    let mut server = servers::nats(&dir.0);
    server.start().await;
    let url = format!("nats://{}", server.addr());
    let name = unique_name("restart");
    let prefix = format!("{name}.");
    let js = jetstream::new(
        async_nats::connect(url.as_str())
            .await
            .expect("the test's own nats-server"),
    );
    js.create_stream(jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}>")],
        storage: jetstream::stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .expect("a file stream");
    drop(js);
    let config = outbox_nats::NatsConfig {
        subject_prefix: prefix.clone(),
        ..outbox_nats::NatsConfig::new(&url).publish_timeout(Duration::from_secs(2))
    };
    let sink: Arc<dyn Sink> =
        Arc::new(outbox_nats::NatsSink::new(config).expect("valid sink configuration"));
    let mut run = Run::start("nats-restart", sink, "events", NATS_LOAD).await;

    let hold = Duration::from_secs(2);
    run.publishing_after(300).await;
    let up = run
        .killed_and_started(&mut server, "nats-server", hold)
        .await;
    run.note(format!("nats-server started again in {up:?}"));
    run.recovered("restart after the kill").await;

    run.publishing_after(run.sink.delivered() + 300).await;
    run.stopped_and_started(&mut server, "nats-server", hold)
        .await;
    run.recovered("restart after the stop").await;

    let (sent, report) = run.finish(Duration::from_secs(1)).await;
    let js = jetstream::new(
        async_nats::connect(url.as_str())
            .await
            .expect("the test's own nats-server"),
    );
    let messages =
        outbox_test_support::nats::read(&js, &name, sent.len(), Duration::from_secs(30)).await;
    let arrived: Vec<Uuid> = messages
        .iter()
        .map(|m| {
            let headers = outbox_test_support::nats::headers(&m.message);
            headers[outbox_nats::wire::ID].parse().expect("a UUID")
        })
        .collect();
    let duplicates = check_arrivals("nats-restart", &sent, &arrived, &report, "stream");
    // A message published again within the stream's duplicate window (after a lost
    // acknowledgement, or from the client's buffer once it reconnected) is stored once, also
    // across the server's restarts: JetStream rebuilds its window from the stored messages.
    assert_eq!(
        duplicates, 0,
        "[nats-restart] Nats-Msg-Id: each message once"
    );
}

// ---------------------------------------------------------------------------------------
// RabbitMQ

/// AMQP: one message per key per round, a confirm round trip each, so a lighter load.
const AMQP_LOAD: Load = Load {
    keys: 10,
    per_key: 1,
    unkeyed: 2,
    rounds_before: 30,
    pause: Duration::from_millis(50),
    payload: 256,
};

/// Every message of `queue` on the node at `url`, in queue order, once it held at least
/// `count` (then half a second more, for duplicates); panics when fewer came within 30 s.
async fn amqp_read(url: &str, queue: &str, count: usize) -> Vec<Uuid> {
    use outbox_amqp::lapin::options::{BasicConsumeOptions, BasicQosOptions};
    use outbox_amqp::lapin::types::FieldTable;
    use outbox_amqp::lapin::{Connection, ConnectionProperties};

    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("the test's own RabbitMQ node");
    let channel = connection.create_channel().await.expect("a channel");
    channel
        .basic_qos(1000, BasicQosOptions::default())
        .await
        .expect("qos");
    let options = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut consumer = channel
        .basic_consume(queue.into(), "read".into(), options, FieldTable::default())
        .await
        .expect("consume");
    let mut ids = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let wait = if ids.len() >= count {
            tokio::time::Instant::now() + Duration::from_millis(500)
        } else {
            deadline
        };
        match tokio::time::timeout_at(wait, consumer.next()).await {
            Ok(Some(delivery)) => {
                let delivery = delivery.expect("a delivery");
                ids.push(
                    outbox_test_support::amqp::message_id(&delivery)
                        .parse()
                        .expect("a UUID"),
                );
            }
            Ok(None) => panic!("the consumer of {queue} ended after {} messages", ids.len()),
            Err(_) if ids.len() >= count => return ids,
            Err(_) => panic!(
                "only {} of {count} messages in {queue} within 30 s",
                ids.len()
            ),
        }
    }
}

/// A RabbitMQ node restarted (SIGTERM: the clean shutdown of an operator's restart) while
/// publishes wait for their confirms, and started again on the same port and data; the
/// durable queue keeps the persistent messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_restart_in_the_middle_of_a_run_loses_nothing() {
    use outbox_amqp::lapin::options::QueueDeclareOptions;
    use outbox_amqp::lapin::types::FieldTable;
    use outbox_amqp::lapin::{Connection, ConnectionProperties};

    let dir = Scratch::new("outbox_amqp_restart");
    let mut server = servers::rabbitmq(&dir.0, |port| {
        format!("listeners.tcp.default = 127.0.0.1:{port}\n")
    });
    let up = server.start().await;
    let url = format!("amqp://guest:guest@{}/%2f", server.addr());
    let queue = unique_name("restart");
    {
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .expect("the test's own RabbitMQ node");
        let channel = connection.create_channel().await.expect("a channel");
        let options = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(queue.as_str().into(), options, FieldTable::default())
            .await
            .expect("a durable queue");
        let _ = connection.close(200, "declared".into()).await;
    }
    // The default exchange: the topic, the routing key, names the queue.
    let mut config = outbox_amqp::AmqpConfig::new(&url, Template::new("").expect("a template"));
    config.connect_timeout = Duration::from_secs(2);
    config.publish_timeout = Duration::from_secs(5);
    let sink: Arc<dyn Sink> = Arc::new(
        outbox_amqp::AmqpSink::connect(config)
            .await
            .expect("the sink connects"),
    );
    let mut run = Run::start("amqp-restart", sink, &queue, AMQP_LOAD).await;
    run.note(format!("RabbitMQ node took {up:?} to start"));

    run.publishing_after(200).await;
    let up = run
        .stopped_and_started(&mut server, "RabbitMQ node", Duration::from_secs(1))
        .await;
    run.note(format!("RabbitMQ node started again in {up:?}"));
    run.recovered("restart").await;

    let (sent, report) = run.finish(Duration::from_secs(1)).await;
    let arrived = amqp_read(&url, &queue, sent.len()).await;
    check_arrivals("amqp-restart", &sent, &arrived, &report, "queue");
}
