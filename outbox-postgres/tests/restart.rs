//! The PostgreSQL server restarted under a draining relay, in both modes: a server of the
//! test's own (the shared one on 5432 is never restarted: other suites run against it), a
//! backlog of thousands of messages on several keys, two relays (the worker of
//! `outbox-core` on `PgStorage`, each its own storage as separate processes would be), and
//! mid-drain first `pg_ctl restart -m fast` (sessions terminated, a clean shutdown), then
//! `pg_ctl stop -m immediate` (every server process killed, as a crash: WAL not yet written
//! is lost, the relays' `synchronous_commit = off` claims and acknowledgements among it) and
//! a start after 4 s down, longer than the relays' 3 s lease (every claim and shard lease runs
//! out meanwhile). The relays are never touched: they must recover by themselves.
//!
//! Checked: nothing lost, each key's first deliveries in order, no publication charged an
//! attempt, no dead letter, no parked key, nothing left in the table; every duplicate is a
//! message first delivered around an outage (in flight, or acknowledged in WAL the crash
//! lost: the redelivery docs/ARCHITECTURE.md allows), and the relays deliver again within
//! seconds of each start. In log mode the second relay joins just before the restart, so
//! shards are being handed over while the server goes down; both end up owning shards, and
//! every shard is given up when they stop.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::{
    CancellationToken, Message, NewMessage, Outcome, Receipt, Result, Sink, Worker, WorkerConfig,
};
use outbox_postgres::{PgStorage, PostgresConfig, StorageMode};
use outbox_test_support::postgres_server::{PostgresServer, Stop};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

/// Keys of the backlog, and messages per key.
const KEYS: usize = 16;
const PER_KEY: usize = 750;
const TOTAL: usize = KEYS * PER_KEY;
const LEASE: Duration = Duration::from_secs(3);
const BATCH: usize = 500;
const MAX_PER_KEY: usize = 8;
/// What a sink call takes, so that the drain lasts long enough for two outages.
const PACE: Duration = Duration::from_millis(20);
/// Messages that may be claimed before an outage and still go out after it: two relays,
/// two batches deep, each batch at most `max_per_key` messages of each key.
const IN_FLIGHT: usize = 2 * 2 * KEYS * MAX_PER_KEY;
/// Before an outage, how far back a first delivery may be and still be delivered again: an
/// acknowledgement the crash lost (async commit: WAL written within 3 × `wal_writer_delay`)
/// or a cursor write that failed.
const GRACE: Duration = Duration::from_secs(2);

/// One publication the sink took.
#[derive(Clone)]
struct Published {
    id: Uuid,
    key: String,
    payload: String,
    attempts: u32,
    at: Instant,
}

/// A sink that keeps every message it is given, with when, taking [`PACE`] per call.
#[derive(Default)]
struct Recorder {
    published: Mutex<Vec<Published>>,
}

impl Recorder {
    fn published(&self) -> Vec<Published> {
        self.published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Messages delivered at least once.
    fn distinct(&self) -> usize {
        let published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        published.iter().map(|p| p.id).collect::<HashSet<_>>().len()
    }

    /// When a message was first delivered after `since`, if one was.
    fn first_after(&self, since: Instant) -> Option<Instant> {
        let published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        published.iter().map(|p| p.at).find(|at| *at >= since)
    }
}

#[async_trait]
impl Sink for Recorder {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        tokio::time::sleep(PACE).await;
        let at = Instant::now();
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        Ok(batch
            .iter()
            .map(|m| {
                published.push(Published {
                    id: m.id,
                    key: m.key.clone().unwrap_or_default(),
                    payload: String::from_utf8_lossy(&m.payload).into_owned(),
                    attempts: m.attempts,
                    at,
                });
                Outcome::Delivered(Receipt::new(format!("r{}", published.len())))
            })
            .collect())
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }
}

/// A relay running in the background.
struct Relay {
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Relay {
    fn start(name: &str, storage: Arc<PgStorage>, sink: Arc<Recorder>) -> Relay {
        let config = WorkerConfig {
            batch_size: BATCH,
            lease: LEASE,
            poll_interval: Duration::from_millis(50),
            shutdown_timeout: Duration::from_secs(5),
            ..WorkerConfig::new(name)
        };
        let worker = Worker::new(config, storage, sink).expect("a worker");
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { worker.run(shutdown).await }
        });
        Relay { shutdown, handle }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.handle.await.expect("the relay task");
    }
}

/// A server of the test's own, started.
fn server(name: &str) -> PostgresServer {
    let dir: PathBuf = std::env::temp_dir().join(outbox_test_support::unique_name(name));
    let server = PostgresServer::init(&dir);
    // Room for two relays' pools, their listeners and the test's pool.
    server.configure("max_connections = 50\n");
    server.start();
    server
}

/// Runs `sql` (a count) until the server answers it.
async fn count(pool: &PgPool, sql: &str) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await {
            Ok(n) => return n,
            Err(e) => {
                assert!(Instant::now() < deadline, "{sql}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Waits until `sink` has `n` messages delivered at least once; panics after `timeout`
/// with what it has, and the server's log.
async fn wait_for_distinct(sink: &Recorder, n: usize, timeout: Duration, server: &PostgresServer) {
    let deadline = Instant::now() + timeout;
    while sink.distinct() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} messages delivered after {timeout:?}; server log:\n{}",
            sink.distinct(),
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One outage: when the server went down and when it accepted connections again.
struct Outage {
    what: &'static str,
    down: Instant,
    up: Instant,
    /// From `up` to the first delivery after it, and to delivering past what was in flight.
    first: Duration,
    recovered: Duration,
}

/// Takes the server down with `take_down` (a fast restart, or an immediate stop and a start
/// after a while), then measures how soon the relays deliver again: first at all, then more
/// than what they had claimed before (so they claimed again).
async fn outage(
    what: &'static str,
    server: &PostgresServer,
    sink: &Recorder,
    take_down: impl FnOnce(&PostgresServer),
) -> Outage {
    let down = Instant::now();
    let before = sink.distinct();
    tokio::task::block_in_place(|| take_down(server));
    let up = Instant::now();
    let deadline = up + Duration::from_secs(30);
    let first = loop {
        if let Some(at) = sink.first_after(up) {
            break at;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: nothing delivered within 30 s of the server's start"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let past = (before + IN_FLIGHT + 1).min(TOTAL);
    wait_for_distinct(sink, past, Duration::from_secs(30), server).await;
    Outage {
        what,
        down,
        up,
        first: first - up,
        recovered: up.elapsed(),
    }
}

/// The scenario, in `mode`: the backlog, relay `a` alone, relay `b` joining just before a
/// fast restart, more drain, a crash, the rest of the drain, then the checks.
async fn restart_mid_drain(mode: StorageMode) {
    let started = Instant::now();
    let server = server(match mode {
        StorageMode::Lease => "outbox_restart_lease",
        StorageMode::Log => "outbox_restart_log",
    });
    let url = server.url("127.0.0.1", "postgres", "");
    let config = PostgresConfig {
        mode,
        shards: 8,
        max_per_key: MAX_PER_KEY,
        ..PostgresConfig::new(&url)
    };
    let storage = |config: &PostgresConfig| {
        Arc::new(PgStorage::new(config.clone()).expect("a valid configuration"))
    };
    let a = storage(&config);
    a.migrate().await.expect("migrate");
    let table = a.table().clone();
    // The application's side: durable commits, its own pool.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("connect to the test's server");
    let messages: Vec<NewMessage> = (0..PER_KEY)
        .flat_map(|i| {
            (0..KEYS).map(move |k| NewMessage::new("t", format!("{i:04}")).key(format!("k{k:02}")))
        })
        .collect();
    for chunk in messages.chunks(2_000) {
        let mut tx = pool.begin().await.expect("begin");
        table.enqueue_many(&mut tx, chunk).await.expect("enqueue");
        tx.commit().await.expect("commit");
    }

    let sink = Arc::new(Recorder::default());
    let relay_a = Relay::start("relay-a", a.clone(), sink.clone());
    wait_for_distinct(&sink, TOTAL / 5, Duration::from_secs(30), &server).await;
    // The second relay joins: in log mode the first starts handing shards over.
    let b = storage(&config);
    let relay_b = Relay::start("relay-b", b.clone(), sink.clone());
    match mode {
        // The restart comes as soon as the second relay is alive in the table: the first
        // is about to hand it half the shards, or has begun (a round every 250 ms).
        StorageMode::Log => {
            let live = format!(
                "SELECT count(*) FROM {} WHERE expires_at > now()",
                table.qualified("_relays")
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            while count(&pool, &live).await < 2 {
                assert!(Instant::now() < deadline, "the second relay never joined");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        StorageMode::Lease => tokio::time::sleep(Duration::from_millis(300)).await,
    }
    let b_before = b.owned_shards().await.len();
    let fast = outage("pg_ctl restart -m fast", &server, &sink, |s| {
        s.restart(Stop::Fast)
    })
    .await;
    wait_for_distinct(&sink, TOTAL * 11 / 20, Duration::from_secs(40), &server).await;
    if mode == StorageMode::Log {
        assert!(
            !b.owned_shards().await.is_empty(),
            "the relay that joined got no shard after the restart"
        );
    }
    let crash = outage("pg_ctl stop -m immediate", &server, &sink, |s| {
        s.stop(Stop::Immediate);
        // Down longer than a lease: every claim and every shard's lease runs out meanwhile,
        // so the relays take their work again, or each other's, when the server is back.
        std::thread::sleep(LEASE + Duration::from_secs(1));
        s.start();
    })
    .await;
    wait_for_distinct(&sink, TOTAL, Duration::from_secs(40), &server).await;

    // Settled, as the database sees it: nothing left to deliver, nothing set aside.
    let remaining = match mode {
        StorageMode::Lease => format!("SELECT count(*) FROM {}", table.qualified("")),
        StorageMode::Log => format!(
            "SELECT (SELECT count(*) FROM {o} o JOIN {s} s ON s.shard = o.shard
                     WHERE (o.xid, o.seq) > (s.cursor_xid, s.cursor_seq))
                  + (SELECT count(*) FROM {h})",
            o = table.qualified(""),
            s = table.qualified("_shards"),
            h = table.qualified("_held"),
        ),
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while count(&pool, &remaining).await > 0 {
        assert!(
            Instant::now() < deadline,
            "everything was delivered but {} rows are not settled",
            count(&pool, &remaining).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Log mode: how the shards are shared once the relays have settled down again.
    let shares: Vec<i64> = match mode {
        StorageMode::Log => sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE owner IS NOT NULL GROUP BY owner ORDER BY 1",
            table.qualified("_shards")
        ))
        .fetch_all(&pool)
        .await
        .expect("the shards' owners"),
        StorageMode::Lease => Vec::new(),
    };
    relay_a.stop().await;
    relay_b.stop().await;

    let dead = count(
        &pool,
        &format!("SELECT count(*) FROM {}", table.qualified("_dead_letters")),
    )
    .await;
    assert_eq!(dead, 0, "no message is dead-lettered because of an outage");
    let parked = count(
        &pool,
        &format!("SELECT count(*) FROM {}", table.qualified("_parked_keys")),
    )
    .await;
    assert_eq!(parked, 0, "no key is parked because of an outage");
    if mode == StorageMode::Log {
        let owned = count(
            &pool,
            &format!(
                "SELECT count(*) FROM {} WHERE owner IS NOT NULL",
                table.qualified("_shards")
            ),
        )
        .await;
        assert_eq!(owned, 0, "relays that stop give their shards up");
    }

    let published = sink.published();
    let charged: Vec<&Published> = published.iter().filter(|p| p.attempts > 0).collect();
    assert!(
        charged.is_empty(),
        "{} publications carried a charged attempt (the first: {} of {}, attempt {})",
        charged.len(),
        charged[0].payload,
        charged[0].key,
        charged[0].attempts
    );
    // Each key's first deliveries, in order; every message once at least.
    let mut first: HashMap<Uuid, Instant> = HashMap::new();
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in &published {
        if let std::collections::hash_map::Entry::Vacant(slot) = first.entry(p.id) {
            slot.insert(p.at);
            by_key
                .entry(p.key.clone())
                .or_default()
                .push(p.payload.clone());
        }
    }
    assert_eq!(first.len(), TOTAL, "every message delivered");
    let expected: Vec<String> = (0..PER_KEY).map(|i| format!("{i:04}")).collect();
    assert_eq!(by_key.len(), KEYS);
    for (key, payloads) in &by_key {
        assert!(
            payloads == &expected,
            "key {key}: first deliveries out of order"
        );
    }
    // Duplicates only of messages first delivered around an outage: from GRACE before the
    // server went down until two leases after it was back (a batch claimed before the
    // outage may still be going out then; its lease runs out and it goes again).
    let outages = [&fast, &crash];
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut per_outage = [0; 2];
    for p in &published {
        if seen.insert(p.id) {
            continue;
        }
        duplicates += 1;
        let at = first[&p.id];
        let around = |o: &Outage| at + GRACE >= o.down && at <= o.up + 2 * LEASE;
        if let Some(i) = outages.iter().position(|o| around(o)) {
            per_outage[i] += 1;
        }
        assert!(
            outages.iter().any(|o| around(o)),
            "{} of {} was delivered again, though first delivered {:?} after the start, \
             away from both outages",
            p.payload,
            p.key,
            at.duration_since(started)
        );
    }
    for o in outages {
        assert!(
            o.recovered < Duration::from_secs(20),
            "{}: the relays took {:?} to deliver again",
            o.what,
            o.recovered
        );
        eprintln!(
            "{mode:?} mode, {}: server down {:?}; first delivery {:?} after its start, \
             delivering past what was in flight after {:?}",
            o.what,
            o.up - o.down,
            o.first,
            o.recovered
        );
    }
    let shares = match mode {
        StorageMode::Log => format!(
            "; the second relay owned {b_before} shards when the restart came; once drained \
             the owners held {shares:?} shards"
        ),
        StorageMode::Lease => String::new(),
    };
    eprintln!(
        "{mode:?} mode: {TOTAL} messages over {KEYS} keys, {} publications, {duplicates} \
         duplicates ({} around the restart, {} around the crash), none charged or \
         dead-lettered{shares}; {:?} in all",
        published.len(),
        per_outage[0],
        per_outage[1],
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_relays_ride_out_a_server_restart_and_a_crash_mid_drain() {
    restart_mid_drain(StorageMode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_mode_relays_ride_out_a_server_restart_and_a_crash_with_a_hand_over_mid_drain() {
    restart_mid_drain(StorageMode::Log).await;
}
