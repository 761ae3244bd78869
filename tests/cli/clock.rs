//! Leases run on the database's clock, whatever the relay's: relay processes of the binary
//! run under libfaketime (Debian's `faketime`: `LD_PRELOAD` makes `clock_gettime` and the
//! other wall-clock calls answer hours off; the monotonic clock is left alone), one three
//! hours ahead and one three hours behind, on one outbox of the shared PostgreSQL while the
//! test writes messages on 20 keys, to a Redis stream of their own. That the offset reaches
//! the binary is checked first: `outbox enqueue` under each offset stamps `created_at` hours
//! off the database's `now()`.
//!
//! While both relays live, neither takes the other's leases: no message is delivered twice,
//! and each key's messages arrive in order. Then each in turn dies holding a live lease (its
//! link to Redis holds every reply back, so its batch is stuck publishing, and it is killed
//! with SIGKILL): the relay ahead, with the one behind left (which would keep a dead lease
//! for hours if it read its own clock), then, after a relay ahead is started again, the one
//! behind, with the one ahead left (which would take a live lease at once). Each time the
//! survivor takes the dead relay's rows (lease mode) or shards (log mode) no earlier than the
//! lease the database holds for them, and within a few seconds after (the lease is 6 s); at
//! the broker no message of the dead relay's keys goes out between the kill and that lease's
//! end, and the only duplicates are of what the dead relay held. No relay logs that a claim
//! or a shard was taken over from it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox::redis::redis;
use outbox_tests::{Proxy, Service, postgres_url, unique_name};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::{ConfigFile, outbox as run, sigterm, text, until};

const LEASE: Duration = Duration::from_secs(6);
const KEYS: usize = 20;
const AHEAD: &str = "+3h";
const BEHIND: &str = "-3h";
/// The broker's entry ids count whole milliseconds; the database's clock reads microseconds.
const CLOCK_SLACK: f64 = 0.005;

/// libfaketime's library (the thread-safe build when there is one); panics, saying what to
/// install, when it is missing.
fn libfaketime() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("faketime"))
        .collect();
    dirs.extend(["/usr/lib/faketime", "/usr/local/lib/faketime"].map(PathBuf::from));
    for dir in &dirs {
        for name in ["libfaketimeMT.so.1", "libfaketime.so.1"] {
            if dir.join(name).is_file() {
                return dir.join(name);
            }
        }
    }
    panic!(
        "libfaketime is not installed (Debian package `faketime`; cargo xtask services \
         installs it): this test runs relays whose clocks are hours off"
    )
}

/// The binary with its wall clock `offset` off (`+3h`, `-3h`), claims naming `host`.
fn skewed(offset: &str, host: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox"));
    command
        .env("LD_PRELOAD", libfaketime())
        .env("FAKETIME", offset)
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .env("HOSTNAME", host)
        .env_remove("RUST_LOG");
    command
}

/// A relay process with a skewed clock, its log in a file; killed on drop.
struct Relay {
    child: Child,
    log: PathBuf,
    name: String,
}

impl Relay {
    fn start(config: &Path, offset: &str, name: &str, dir: &Path) -> Relay {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("the relay's log file");
        let child = skewed(offset, name)
            .arg("--config")
            .arg(config)
            .arg("relay")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start the relay");
        Relay {
            child,
            log,
            name: name.to_string(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the relay logged.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL: no shutdown, its leases left to run out.
    fn kill(&mut self) {
        self.child.kill().expect("SIGKILL the relay");
        self.child.wait().expect("wait for the relay");
    }

    /// SIGTERM; the exit code.
    fn terminate(&mut self) -> Option<i32> {
        sigterm(&self.child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within 30 s of SIGTERM",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics if the relay logged that another relay took a claim or a shard from it.
    fn assert_nothing_taken_over(&self) {
        let log = self.log();
        let taken: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("taken over") || l.contains("took this shard over"))
            .collect();
        assert!(
            taken.is_empty(),
            "{} lost leases while alive: {taken:?}",
            self.name
        );
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The test's messages: every 20 ms one per key, in one transaction, payload the round.
struct Writer {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<usize>,
}

impl Writer {
    fn start(pool: PgPool, schema: &str) -> Writer {
        let sql = format!(
            r#"INSERT INTO "{schema}".outbox (topic, partition_key, payload)
               SELECT 't', 'k' || lpad(k::text, 2, '0'), convert_to(lpad($1::text, 6, '0'), 'UTF8')
               FROM generate_series(0, {}) AS k"#,
            KEYS - 1
        );
        let stop = Arc::new(AtomicBool::new(false));
        let handle = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut rounds = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    sqlx::query(&sql)
                        .bind(i64::try_from(rounds).expect("rounds"))
                        .execute(&pool)
                        .await
                        .expect("write a round of messages");
                    rounds += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                rounds
            }
        });
        Writer { stop, handle }
    }

    /// Stops writing; how many rounds were written.
    async fn stop(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.await.expect("the writer")
    }
}

/// One entry of the stream: the broker's time (s), message id, key, payload.
struct Entry {
    at: f64,
    id: String,
    key: String,
    payload: String,
}

/// Every entry of stream `name`, read a page at a time.
async fn stream(name: &str) -> Vec<Entry> {
    use outbox::redis::wire;
    let client = redis::Client::open(Service::Redis.url()).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis must be running at 127.0.0.1:6379");
    // Pages of a long stream on a busy machine take longer than the default 0.5 s.
    conn.set_response_timeout(Duration::from_secs(30));
    let mut entries = Vec::new();
    let mut from = "-".to_string();
    loop {
        let page: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(name)
            .arg(&from)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .expect("XRANGE");
        let Some(last) = page.ids.last() else {
            break;
        };
        from = format!("({}", last.id);
        entries.extend(page.ids.iter().map(|e| {
            Entry {
                at: e
                    .id
                    .split('-')
                    .next()
                    .and_then(|ms| ms.parse::<f64>().ok())
                    .expect("a stream entry id")
                    / 1000.0,
                id: e.get::<String>(wire::ID).expect("the message id"),
                key: e.get::<String>(wire::KEY).unwrap_or_default(),
                payload: e
                    .get::<Vec<u8>>(wire::PAYLOAD)
                    .map(|p| text(&p))
                    .unwrap_or_default(),
            }
        }));
    }
    entries
}

/// The test's streams (`<prefix>t`, and `<prefix>probe` for the clock probes), deleted on
/// drop, also when the test fails.
struct Streams(String);

impl Drop for Streams {
    fn drop(&mut self) {
        let names = [format!("{}t", self.0), format!("{}probe", self.0)];
        outbox_tests::clean_up(async move {
            let client = redis::Client::open(Service::Redis.url()).ok()?;
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("DEL")
                .arg(&names)
                .query_async::<i64>(&mut conn)
                .await
                .ok()
        });
    }
}

/// The database's clock, in seconds since the epoch.
async fn db_now(pool: &PgPool) -> f64 {
    sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(pool)
        .await
        .expect("the database's clock")
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// What a dead relay held, as the database records it: per key, when the lease on it ends
/// (database clock).
type Held = HashMap<String, f64>;

/// The outbox under test, in either mode.
struct Outbox {
    log_mode: bool,
    schema: String,
    url: String,
    pool: PgPool,
    /// Log mode: the database of the test's own (the readable horizon is per database).
    database: Option<String>,
}

impl Outbox {
    async fn new(log_mode: bool) -> Outbox {
        let schema = unique_name("cli_clock");
        let shared = postgres_url();
        let (url, database) = if log_mode {
            let database = unique_name("outbox_clock");
            let admin = PgPool::connect(&shared)
                .await
                .expect("PostgreSQL must be running");
            sqlx::query(&format!(r#"CREATE DATABASE "{database}""#))
                .execute(&admin)
                .await
                .expect("create the test's database");
            admin.close().await;
            let (base, _) = shared.rsplit_once('/').expect("a database in the URL");
            (format!("{base}/{database}"), Some(database))
        } else {
            (shared, None)
        };
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .expect("PostgreSQL must be running");
        Outbox {
            log_mode,
            schema,
            url,
            pool,
            database,
        }
    }

    fn storage_section(&self) -> String {
        let mode = if self.log_mode {
            "mode = \"log\"\nshards = 8\n"
        } else {
            ""
        };
        format!(
            "[storage]\nurl = \"{}\"\nschema = \"{}\"\n{mode}",
            self.url, self.schema
        )
    }

    fn table(&self, suffix: &str) -> String {
        format!(r#""{}".outbox{suffix}"#, self.schema)
    }

    /// The rows of `sql`, its `$1` bound to `bind` when there is one; `what` they are
    /// names a failure.
    async fn rows<T>(&self, sql: &str, bind: Option<String>, what: &str) -> Vec<T>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        let query = sqlx::query_as(sql);
        let query = match bind {
            Some(value) => query.bind(value),
            None => query,
        };
        query.fetch_all(&self.pool).await.expect(what)
    }

    /// Log mode: the owners of shards now, with how many each owns.
    async fn owners(&self) -> HashMap<String, i64> {
        let sql = format!(
            "SELECT owner, count(*) FROM {} WHERE owner IS NOT NULL AND expires_at > now() GROUP BY owner",
            self.table("_shards")
        );
        let owners: Vec<(String, i64)> = self.rows(&sql, None, "the shards' owners").await;
        owners.into_iter().collect()
    }

    /// Lease mode: the relays (by their process ids) holding live claims now.
    async fn claimers(&self) -> HashSet<String> {
        let sql = format!(
            "SELECT DISTINCT claimed_by FROM {} WHERE claim_token IS NOT NULL AND available_at > now()",
            self.table("")
        );
        let claimers: Vec<(String,)> = self.rows(&sql, None, "the claimers").await;
        claimers.into_iter().map(|(claimer,)| claimer).collect()
    }

    /// What `victim` (its claims name `:pid`; log mode: its owner name) holds with a live
    /// lease: per key, when the lease ends.
    async fn held_by(&self, victim: &str) -> Held {
        let rows: Vec<(String, f64)> = if self.log_mode {
            let sql = format!(
                "SELECT DISTINCT o.partition_key, extract(epoch FROM s.expires_at)::float8
                 FROM {s} s JOIN {o} o ON o.shard = s.shard
                 WHERE s.owner = $1 AND s.expires_at > clock_timestamp()",
                s = self.table("_shards"),
                o = self.table(""),
            );
            let owner = Some(victim.to_string());
            self.rows(&sql, owner, "the dead relay's shards").await
        } else {
            let sql = format!(
                "SELECT partition_key, min(extract(epoch FROM available_at))::float8 FROM {}
                 WHERE claim_token IS NOT NULL AND claimed_by LIKE $1
                   AND available_at > clock_timestamp()
                 GROUP BY partition_key",
                self.table("")
            );
            let claimed_by = Some(format!("%:{victim}"));
            self.rows(&sql, claimed_by, "the dead relay's claims").await
        };
        rows.into_iter().collect()
    }

    /// Waits until nothing `victim` held is still its own; returns when (database clock).
    /// Panics if anything of it changes hands before its lease ends, or if it stays the dead
    /// relay's for more than 5 s after the lease.
    async fn wait_for_takeover(&self, victim: &str, held: &Held) -> f64 {
        let last = held.values().copied().fold(f64::MIN, f64::max);
        loop {
            let now = db_now(&self.pool).await;
            let still = self.held_by_dead(victim).await;
            for (key, until) in held {
                if !still.contains(key) {
                    assert!(
                        *until <= now + CLOCK_SLACK,
                        "{key} changed hands {:.3} s before the dead relay's lease ended",
                        until - now
                    );
                }
            }
            if still.is_empty() {
                return now;
            }
            assert!(
                now < last + 5.0,
                "the dead relay still holds {still:?} 5 s after its lease ended"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The keys still held in the name of a dead relay, lease run out or not.
    async fn held_by_dead(&self, victim: &str) -> HashSet<String> {
        let keys: Vec<String> = if self.log_mode {
            sqlx::query_scalar(&format!(
                "SELECT DISTINCT o.partition_key FROM {s} s JOIN {o} o ON o.shard = s.shard
                 WHERE s.owner = $1",
                s = self.table("_shards"),
                o = self.table(""),
            ))
            .bind(victim)
            .fetch_all(&self.pool)
            .await
            .expect("the dead relay's shards")
        } else {
            sqlx::query_scalar(&format!(
                "SELECT DISTINCT partition_key FROM {} WHERE claimed_by LIKE $1",
                self.table("")
            ))
            .bind(format!("%:{victim}"))
            .fetch_all(&self.pool)
            .await
            .expect("the dead relay's claims")
        };
        keys.into_iter().collect()
    }

    /// Rows not yet delivered.
    async fn undelivered(&self) -> i64 {
        let sql = if self.log_mode {
            format!(
                "SELECT (SELECT count(*) FROM {o} o JOIN {s} s ON s.shard = o.shard
                         WHERE (o.xid, o.seq) > (s.cursor_xid, s.cursor_seq))
                      + (SELECT count(*) FROM {h})",
                o = self.table(""),
                s = self.table("_shards"),
                h = self.table("_held"),
            )
        } else {
            format!("SELECT count(*) FROM {}", self.table(""))
        };
        scalar(&self.pool, &sql).await
    }
}

/// Drops the test's database (log mode) or schema, also when the test fails: from a thread
/// with a runtime of its own (a runtime cannot block inside another), errors ignored.
impl Drop for Outbox {
    fn drop(&mut self) {
        match &self.database {
            Some(database) => outbox_tests::drop_database(database),
            None => outbox_tests::drop_schemas(std::slice::from_ref(&self.schema)),
        }
    }
}

/// A relay's link to Redis, its configuration file and its log directory.
struct Link {
    proxy: Proxy,
    config: ConfigFile,
}

async fn link(outbox: &Outbox, stream_prefix: &str) -> Link {
    let proxy = Proxy::start("127.0.0.1:6379").await;
    let config = ConfigFile::new(&format!(
        "{}[relay]\npoll_interval = \"100ms\"\nlease = \"{}s\"\nshutdown_timeout = \"5s\"\n\
         backoff = {{ initial = \"100ms\", max = \"1s\" }}\n\
         [sink]\ntype = \"redis\"\nurl = \"redis://{}\"\nstream_prefix = \"{stream_prefix}\"\n",
        outbox.storage_section(),
        LEASE.as_secs(),
        proxy.addr()
    ));
    Link { proxy, config }
}

/// Kills `relay` holding a live lease: its replies from Redis are held back until its batch
/// is stuck publishing, then SIGKILL. (When what the hold caught was an idle relay's health
/// check, the replies are let through and it is tried again.) Returns what it held and when
/// it died (database clock).
async fn kill_holding_a_lease(
    outbox: &Outbox,
    relay: &mut Relay,
    link: &Link,
    victim: &str,
) -> (Held, f64) {
    let mut attempts = 0;
    loop {
        attempts += 1;
        // With per-key order and 20 keys, the other relay often has every key in flight, so
        // the victim gets a batch only now and then: on a loaded machine 40 tries (20 s) were
        // not always enough (CI, 2026-12-04). The pause between tries varies so that the
        // tries do not keep the same phase as the relays' polls.
        assert!(
            attempts <= 120,
            "{} was never caught publishing a batch; its log:\n{}",
            relay.name,
            relay.log()
        );
        let sent = link.proxy.traffic().to_server;
        link.proxy.hold();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // More than a health check's PING went out: a batch, stuck until the replies come.
        let publishing = link.proxy.traffic().to_server > sent + 200;
        if publishing && (outbox.log_mode || !outbox.held_by(victim).await.is_empty()) {
            break;
        }
        link.proxy.restore();
        tokio::time::sleep(Duration::from_millis(100 + (attempts * 73) % 300)).await;
    }
    relay.kill();
    let died = db_now(&outbox.pool).await;
    let held = outbox.held_by(victim).await;
    link.proxy.restore();
    assert!(
        !held.is_empty(),
        "{} held no live lease when it was killed",
        relay.name
    );
    (held, died)
}

async fn leases_follow_the_database_clock(log_mode: bool) {
    let started = Instant::now();
    let outbox = Outbox::new(log_mode).await;
    let db = &outbox;
    let prefix = format!("{}:", unique_name("clock"));
    let _streams = Streams(prefix.clone());
    let (ahead_link, behind_link) = (link(&outbox, &prefix).await, link(&outbox, &prefix).await);
    let migrate = run(&ahead_link.config.path, &["migrate"]);
    assert!(
        migrate.status.success(),
        "migrate: {}",
        text(&migrate.stderr)
    );

    // libfaketime reaches the binary: what it stamps is hours off the database's clock.
    for (offset, key, hours) in [(AHEAD, "ahead", 3.0), (BEHIND, "behind", -3.0)] {
        let out = skewed(offset, key)
            .arg("--config")
            .arg(&ahead_link.config.path)
            .args(["enqueue", "--topic", "probe", "--key", key, "probe"])
            .output()
            .expect("run the binary under libfaketime");
        assert!(
            out.status.success(),
            "enqueue under libfaketime: {}",
            text(&out.stderr)
        );
        let off: f64 = sqlx::query_scalar(&format!(
            "SELECT extract(epoch FROM created_at - now())::float8 / 3600 FROM {}
             WHERE partition_key = $1",
            outbox.table("")
        ))
        .bind(key)
        .fetch_one(&outbox.pool)
        .await
        .expect("the probe");
        assert!(
            (off - hours).abs() < 0.1,
            "the binary under FAKETIME={offset} stamped a message {off:.3} h off the database's clock"
        );
    }

    let dir = ahead_link.config.dir.clone();
    let writer = Writer::start(outbox.pool.clone(), &outbox.schema);
    let mut ahead = Relay::start(&ahead_link.config.path, AHEAD, "ahead", &dir);
    // Log mode: the relay ahead takes every shard, then hands the one behind its share.
    let mut ahead_owner = String::new();
    if log_mode {
        until(
            "the relay ahead owns every shard",
            Duration::from_secs(20),
            || async move { db.owners().await.values().sum::<i64>() == 8 },
        )
        .await;
        ahead_owner = outbox.owners().await.into_keys().next().expect("an owner");
    }
    let mut behind = Relay::start(&behind_link.config.path, BEHIND, "behind", &dir);
    let behind_owner = if log_mode {
        until(
            "the relay behind takes its share of the shards",
            Duration::from_secs(20),
            || async move { db.owners().await.len() == 2 },
        )
        .await;
        let owners = outbox.owners().await;
        owners
            .into_keys()
            .find(|o| *o != ahead_owner)
            .expect("the other owner")
    } else {
        let pids = &[format!(":{}", ahead.pid()), format!(":{}", behind.pid())];
        until(
            "both relays hold claims",
            Duration::from_secs(20),
            || async move {
                let mut seen = HashSet::new();
                for _ in 0..50 {
                    for c in db.claimers().await {
                        seen.extend(pids.iter().filter(|p| c.ends_with(*p)).cloned());
                    }
                    if seen.len() == 2 {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                false
            },
        )
        .await;
        String::new()
    };
    // Both alive, under load: neither may take the other's leases.
    tokio::time::sleep(Duration::from_secs(5)).await;
    ahead.assert_nothing_taken_over();
    behind.assert_nothing_taken_over();

    // The relay ahead dies holding a lease; the one behind takes it once it has run out.
    let victim = if log_mode {
        ahead_owner.clone()
    } else {
        ahead.pid().to_string()
    };
    let (held_ahead, died_ahead) =
        kill_holding_a_lease(&outbox, &mut ahead, &ahead_link, &victim).await;
    let first_kill = died_ahead;
    let taken_ahead = outbox.wait_for_takeover(&victim, &held_ahead).await;
    let lease_left_ahead = held_ahead.values().copied().fold(f64::MIN, f64::max) - died_ahead;

    // A relay ahead again; both alive a while; then the one behind dies holding a lease and
    // the one ahead takes it once it has run out.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ahead_again = Relay::start(&ahead_link.config.path, AHEAD, "ahead-again", &dir);
    if log_mode {
        until(
            "the relay ahead, started again, takes its share of the shards",
            Duration::from_secs(20),
            || async move { db.owners().await.len() == 2 },
        )
        .await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    behind.assert_nothing_taken_over();
    ahead_again.assert_nothing_taken_over();
    let victim_behind = if log_mode {
        behind_owner
    } else {
        behind.pid().to_string()
    };
    let (held_behind, died_behind) =
        kill_holding_a_lease(&outbox, &mut behind, &behind_link, &victim_behind).await;
    let taken_behind = outbox.wait_for_takeover(&victim_behind, &held_behind).await;
    let lease_left_behind = held_behind.values().copied().fold(f64::MIN, f64::max) - died_behind;

    tokio::time::sleep(Duration::from_secs(1)).await;
    let rounds = writer.stop().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while outbox.undelivered().await > 0 {
        assert!(
            Instant::now() < deadline,
            "{} messages undelivered 30 s after the writer stopped",
            outbox.undelivered().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        ahead_again.terminate(),
        Some(0),
        "the last relay stops cleanly"
    );
    ahead.assert_nothing_taken_over();
    behind.assert_nothing_taken_over();
    ahead_again.assert_nothing_taken_over();

    let entries = stream(&format!("{prefix}t")).await;
    // Everything delivered; each key's first deliveries in order.
    let mut first: HashMap<&str, f64> = HashMap::new();
    let mut by_key: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for e in &entries {
        if !first.contains_key(e.id.as_str()) {
            first.insert(e.id.as_str(), e.at);
            by_key
                .entry(e.key.as_str())
                .or_default()
                .push(e.payload.as_str());
        }
    }
    assert_eq!(first.len(), rounds * KEYS, "every message delivered");
    let expected: Vec<String> = (0..rounds).map(|r| format!("{r:06}")).collect();
    for (key, payloads) in &by_key {
        assert!(
            payloads.len() == rounds && payloads.iter().zip(&expected).all(|(a, b)| *a == b),
            "{key}: first deliveries out of order or missing"
        );
    }
    // While both relays lived, nothing twice; after each kill, nothing of the dead relay's
    // keys before its lease ran out, and duplicates only of what went out before it died,
    // again after its lease.
    let kills = [(&held_ahead, died_ahead), (&held_behind, died_behind)];
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    for e in &entries {
        for (held, died) in kills {
            if let Some(until) = held.get(e.key.as_str()) {
                assert!(
                    e.at <= died + CLOCK_SLACK || e.at + CLOCK_SLACK >= *until,
                    "{} of {} went out {:.3} s before the dead relay's lease on it ran out",
                    e.payload,
                    e.key,
                    until - e.at
                );
            }
        }
        if seen.insert(e.id.as_str()) {
            continue;
        }
        duplicates += 1;
        assert!(
            e.at > first_kill,
            "{} of {} delivered twice while both relays were alive",
            e.payload,
            e.key
        );
        let first_at = first[e.id.as_str()];
        assert!(
            kills.iter().any(|(held, died)| {
                held.get(e.key.as_str()).is_some_and(|until| {
                    first_at <= died + CLOCK_SLACK && e.at + CLOCK_SLACK >= *until
                })
            }),
            "{} of {} delivered twice, though no relay died holding it",
            e.payload,
            e.key
        );
    }
    let mode = if log_mode { "log" } else { "lease" };
    eprintln!(
        "{mode} mode, clocks {AHEAD} and {BEHIND}: {} messages, {} entries, {duplicates} duplicates; \
         the relay ahead died holding {} keys with {lease_left_ahead:.2} s of lease left, taken over \
         {:.2} s after its death; the relay behind died holding {} keys with {lease_left_behind:.2} s \
         left, taken over after {:.2} s; {:?} in all",
        rounds * KEYS,
        entries.len(),
        held_ahead.len(),
        taken_ahead - died_ahead,
        held_behind.len(),
        taken_behind - died_behind,
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_leases_follow_the_database_clock_not_the_relays() {
    leases_follow_the_database_clock(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_mode_shard_leases_follow_the_database_clock_not_the_relays() {
    leases_follow_the_database_clock(true).await;
}
