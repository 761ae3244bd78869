//! SQLite: one relay draining a preloaded outbox file to no sink and to the file sink, against
//! a bare-delete loop on the same kind of file measured in the same run; and writers'
//! enqueue rate through `OutboxTable::enqueue` against plain INSERTs of the same rows.
//!
//! Every file lives in a temporary directory of its own (removed afterwards), migrated by the
//! storage, so it is in WAL mode as the relay leaves it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::{
    Claim, ClaimToken, NewMessage, QueueStats, Result as OutboxResult, Settlement, Sink, Storage,
    StorageCapabilities, Worker, WorkerConfig,
};
use outbox_file::{FileConfig, FileSink};
use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteSynchronous};
use outbox_sqlite::sqlx::{self, Row};
use outbox_sqlite::{OutboxTable, SqliteConfig, SqliteStorage};
use outbox_test_support::TempDir;
use uuid::Uuid;

use crate::baselines;
use crate::drain::{self, BATCH};
use crate::report::Report;
use crate::setup::{CountingSink, NullSink, text};
use crate::{Scale, median};

/// The outbox table of every file.
const TABLE: &str = "outbox";

/// Concurrent writers of the enqueue figures. SQLite takes one write at a time; more writers
/// only queue for the lock (its busy handler sleeps), so a few show the contention without
/// measuring mostly sleep.
const WRITERS: usize = 4;

/// A directory of its own under the system's temporary directory, removed when dropped.
fn temp_dir() -> Result<TempDir, String> {
    TempDir::try_new("outbox-bench").map_err(|e| e.to_string())
}

/// A fresh outbox file in a directory of its own, migrated by the storage.
struct SqliteFile {
    /// Opened with the relay's settings (WAL, `synchronous = NORMAL`): the preload, the
    /// ceiling and the checks go through its pool.
    storage: SqliteStorage,
    path: PathBuf,
    dir: TempDir,
}

impl SqliteFile {
    async fn new() -> Result<Self, String> {
        let dir = temp_dir()?;
        let path = dir.path().join("outbox.db");
        let storage = SqliteStorage::open(SqliteConfig::new(&path).table(TABLE))
            .await
            .map_err(text)?;
        storage.migrate().await.map_err(text)?;
        Ok(SqliteFile { storage, path, dir })
    }

    /// The relay's settings for this file.
    fn config(&self, per_key_order: bool) -> SqliteConfig {
        let mut config = SqliteConfig::new(&self.path).table(TABLE);
        config.per_key_order = per_key_order;
        config
    }

    fn quoted(&self) -> String {
        self.storage.table().quoted("")
    }

    /// Inserts `n` messages with 200-byte payloads over `keys` keys in one statement (ids,
    /// headers and times from the table's defaults), then checkpoints the WAL so every run
    /// starts from the same state.
    async fn preload(&self, n: u64, keys: u64) -> Result<(), String> {
        let sql = format!(
            "WITH RECURSIVE i(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM i WHERE x < ?1)
             INSERT INTO {} (topic, partition_key, payload)
             SELECT 'bench', 'k' || (x % ?2), CAST(replace(hex(zeroblob(200)), '00', 'x') AS BLOB)
             FROM i",
            self.quoted()
        );
        sqlx::query(&sql)
            .bind(n as i64)
            .bind(keys as i64)
            .execute(self.storage.pool())
            .await
            .map_err(text)?;
        self.checkpoint().await
    }

    async fn checkpoint(&self) -> Result<(), String> {
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(self.storage.pool())
            .await
            .map_err(text)?;
        Ok(())
    }

    async fn count(&self) -> Result<i64, String> {
        sqlx::query(&format!("SELECT count(*) FROM {}", self.quoted()))
            .fetch_one(self.storage.pool())
            .await
            .and_then(|row| row.try_get(0))
            .map_err(text)
    }
}

/// Where the SQLite drains deliver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SinkKind {
    /// Delivers instantly: the relay's own cost on the database.
    Null,
    /// The file sink, syncing each batch (its default).
    File,
}

impl SinkKind {
    fn name(self) -> &'static str {
        match self {
            SinkKind::Null => "none",
            SinkKind::File => "file",
        }
    }

    fn build(self, dir: &Path) -> Result<Arc<dyn Sink>, String> {
        Ok(match self {
            SinkKind::Null => Arc::new(NullSink),
            SinkKind::File => {
                Arc::new(FileSink::new(FileConfig::new(dir.join("delivered.jsonl"))).map_err(text)?)
            }
        })
    }
}

/// Time the relay spent in the storage's claims and settlements.
#[derive(Default)]
struct Timings {
    /// Claims that returned messages, their messages and their time.
    claims: AtomicU64,
    claimed: AtomicU64,
    claim_ns: AtomicU64,
    settles: AtomicU64,
    settle_ns: AtomicU64,
}

fn nanos(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The relay's storage, timing its claims and settlements.
struct Timed {
    inner: SqliteStorage,
    timings: Arc<Timings>,
}

#[async_trait]
impl Storage for Timed {
    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> OutboxResult<Claim> {
        let started = Instant::now();
        let claim = self.inner.claim(worker_id, limit, lease).await?;
        if !claim.messages.is_empty() {
            let t = &self.timings;
            t.claim_ns.fetch_add(nanos(started), Ordering::Relaxed);
            t.claims.fetch_add(1, Ordering::Relaxed);
            t.claimed
                .fetch_add(claim.messages.len() as u64, Ordering::Relaxed);
        }
        Ok(claim)
    }

    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> OutboxResult<u64> {
        let started = Instant::now();
        let settled = self.inner.settle(token, settlement).await;
        let t = &self.timings;
        t.settle_ns.fetch_add(nanos(started), Ordering::Relaxed);
        t.settles.fetch_add(1, Ordering::Relaxed);
        settled
    }

    async fn extend_lease(
        &self,
        token: &ClaimToken,
        ids: &[Uuid],
        lease: Duration,
    ) -> OutboxResult<u64> {
        self.inner.extend_lease(token, ids, lease).await
    }

    async fn health(&self) -> OutboxResult<()> {
        self.inner.health().await
    }

    async fn stats(&self) -> OutboxResult<QueueStats> {
        self.inner.stats().await
    }

    fn capabilities(&self) -> StorageCapabilities {
        self.inner.capabilities()
    }

    async fn wait_for_work(&self) -> OutboxResult<()> {
        self.inner.wait_for_work().await
    }

    async fn maintain(&self) -> OutboxResult<()> {
        self.inner.maintain().await
    }
}

/// Where one drain's time went, per batch.
struct Profile {
    batch_ms: f64,
    claim_ms: f64,
    settle_ms: f64,
    per_claim: f64,
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let share = |ms: f64| 100.0 * ms / self.batch_ms;
        let rest = self.batch_ms - self.claim_ms - self.settle_ms;
        write!(
            f,
            "{:.1} messages/claim, {:.2} ms/batch: claim {:.2} ms ({:.0}%), settle {:.2} ms ({:.0}%), publish and worker {:.2} ms ({:.0}%)",
            self.per_claim,
            self.batch_ms,
            self.claim_ms,
            share(self.claim_ms),
            self.settle_ms,
            share(self.settle_ms),
            rest,
            share(rest),
        )
    }
}

/// A fresh preloaded file, one relay draining it into `kind`, cleaned up. Returns events per
/// second and where the time went.
async fn one_drain(
    scale: Scale,
    kind: SinkKind,
    per_key_order: bool,
) -> Result<(f64, Profile), String> {
    let file = SqliteFile::new().await?;
    file.preload(scale.drain_messages, scale.keys).await?;
    let timings = Arc::new(Timings::default());
    let storage = Arc::new(Timed {
        inner: SqliteStorage::new(file.config(per_key_order)).map_err(text)?,
        timings: timings.clone(),
    });
    let delivered = Arc::new(AtomicU64::new(0));
    let sink = Arc::new(CountingSink {
        inner: kind.build(file.dir.path())?,
        delivered: delivered.clone(),
    });
    let config = WorkerConfig {
        batch_size: BATCH,
        poll_interval: Duration::from_millis(50),
        ..WorkerConfig::new("bench-0")
    };
    let worker = Worker::new(config, storage, sink).map_err(text)?;
    let what = format!("sqlite drain to {}", kind.name());
    let drained = drain::run_workers(vec![worker], &delivered, scale.drain_messages, &what).await?;
    let left = file.count().await?;
    if left != 0 {
        eprintln!("warning: {what}: {left} messages still in the outbox after the drain");
    }
    let t = &timings;
    let batches = t.claims.load(Ordering::Relaxed).max(1) as f64;
    let ms = |ns: &AtomicU64, n: f64| ns.load(Ordering::Relaxed) as f64 / 1e6 / n.max(1.0);
    let elapsed_ms = scale.drain_messages as f64 / drained.rate * 1000.0;
    let profile = Profile {
        batch_ms: elapsed_ms / batches,
        claim_ms: ms(&t.claim_ns, batches),
        settle_ms: ms(&t.settle_ns, t.settles.load(Ordering::Relaxed) as f64),
        per_claim: t.claimed.load(Ordering::Relaxed) as f64 / batches,
    };
    Ok((drained.rate, profile))
}

/// The SQLite ceiling: `DELETE … WHERE seq IN (SELECT seq … ORDER BY seq LIMIT 500)
/// RETURNING *` in a loop on one connection with the relay's settings, no sink. SQLite has
/// one writer, so there is nothing to skip.
async fn bare_delete(scale: Scale) -> Result<f64, String> {
    let file = SqliteFile::new().await?;
    file.preload(scale.drain_messages, scale.keys).await?;
    let t = file.quoted();
    let sql = format!(
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} ORDER BY seq LIMIT ?1) RETURNING *"
    );
    let mut conn = file.storage.pool().acquire().await.map_err(text)?;
    baselines::deleted_per_second::<sqlx::Sqlite>(&mut conn, &sql).await
}

/// The file sink's ceiling: the drain's messages written straight to it in batches of
/// [`BATCH`], each synced, no database.
async fn file_ceiling(scale: Scale) -> Result<f64, String> {
    let dir = temp_dir()?;
    let sink = SinkKind::File.build(dir.path())?;
    baselines::publish_all(scale, sink.as_ref()).await
}

/// How the enqueue figures write their single-message transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Insert {
    /// A plain INSERT of the same columns into a table with only a primary key: the
    /// baseline.
    PlainTable,
    /// A plain INSERT of the same row into the outbox table (its indexes and checks).
    PlainOutbox,
    /// `OutboxTable::enqueue`.
    Enqueue,
}

impl Insert {
    fn name(self) -> &'static str {
        match self {
            Insert::PlainTable => "enqueue baseline: plain INSERT, table without indexes",
            Insert::PlainOutbox => "plain INSERT into the outbox table",
            Insert::Enqueue => "OutboxTable::enqueue",
        }
    }
}

/// [`WRITERS`] writers committing single-message transactions for `duration` into a fresh
/// file, each `BEGIN IMMEDIATE` as the crate advises, with durable commits
/// (`synchronous = FULL`, sqlx's default). Returns messages per second.
async fn enqueue_run(mode: Insert, duration: Duration) -> Result<f64, String> {
    let file = SqliteFile::new().await?;
    let outbox = OutboxTable::new(TABLE).map_err(text)?;
    let target = if mode == Insert::PlainTable {
        sqlx::query(
            r#"CREATE TABLE "plain" (
                seq INTEGER PRIMARY KEY, id TEXT NOT NULL, topic TEXT NOT NULL,
                partition_key TEXT, payload BLOB NOT NULL, headers TEXT NOT NULL,
                traceparent TEXT, tracestate TEXT, created_at INTEGER NOT NULL)"#,
        )
        .execute(file.storage.pool())
        .await
        .map_err(text)?;
        r#""plain""#.to_string()
    } else {
        outbox.quoted("")
    };
    let insert = Arc::new(format!(
        "INSERT INTO {target} (id, topic, partition_key, payload, headers, traceparent, \
         tracestate, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    ));
    let options = SqliteConnectOptions::new()
        .filename(&file.path)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(WRITERS as u32)
        .min_connections(WRITERS as u32)
        .connect_with(options)
        .await
        .map_err(text)?;
    let commits = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (pool, outbox, insert, commits) = (
            pool.clone(),
            outbox.clone(),
            insert.clone(),
            commits.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let payload = vec![b'x'; 200];
            let mut i = 0u64;
            while Instant::now() < deadline {
                let message = NewMessage::new("bench", payload.clone())
                    .key(format!("k{}", (w as u64 * 7919 + i) % 1000));
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.map_err(text)?;
                if mode == Insert::Enqueue {
                    outbox.enqueue(&mut tx, &message).await.map_err(text)?;
                } else {
                    sqlx::query(insert.as_str())
                        .bind(message.id.hyphenated().to_string())
                        .bind(message.topic.as_str())
                        .bind(message.key.as_deref())
                        .bind(message.payload.as_slice())
                        .bind(serde_json::to_string(&message.headers).map_err(text)?)
                        .bind(None::<&str>)
                        .bind(None::<&str>)
                        .bind(message.created_at.timestamp_micros())
                        .execute(&mut *tx)
                        .await
                        .map_err(text)?;
                }
                tx.commit().await.map_err(text)?;
                commits.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<(), String>(())
        }));
    }
    for task in tasks {
        task.await.map_err(text)??;
    }
    let rate = commits.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    pool.close().await;
    Ok(rate)
}

pub async fn run(scale: Scale, report: &mut Report) -> Result<(), String> {
    let n = scale.drain_messages;
    let version: String = {
        let file = SqliteFile::new().await?;
        sqlx::query_scalar("SELECT sqlite_version()")
            .fetch_one(file.storage.pool())
            .await
            .map_err(text)?
    };
    let tmp = std::env::temp_dir();
    report.machine.push_str(&format!(
        "; SQLite {version} (bundled), files in {}",
        tmp.display()
    ));
    println!(
        "\n== sqlite {version}: {n} messages of 200 bytes over {} keys in a file in {}, batches of {BATCH}; {WRITERS} writers ==",
        scale.keys,
        tmp.display()
    );
    let bare = median(drain::repeat(scale.runs, || bare_delete(scale)).await?);
    report.add_bare_ceiling("sqlite", "DELETE … ORDER BY seq LIMIT 500", bare);
    let files = drain::repeat(scale.runs, || file_ceiling(scale)).await?;
    let file_ceiling = median(files);
    report.add(
        "sqlite",
        "ceiling: file publish (synced), no database",
        file_ceiling,
        "events/s",
        Some(("bare delete", bare)),
    );
    for kind in [SinkKind::Null, SinkKind::File] {
        for per_key_order in [true, false] {
            let name = format!(
                "1 relay → {}, key order {}",
                kind.name(),
                if per_key_order { "on" } else { "off" }
            );
            let mut rates = Vec::new();
            for _ in 0..scale.runs {
                let (rate, profile) = one_drain(scale, kind, per_key_order).await?;
                println!("         {name}: {profile}");
                rates.push(rate);
            }
            let rate = median(rates);
            report.add(
                "sqlite",
                &name,
                rate,
                "events/s",
                Some(("bare delete", bare)),
            );
        }
    }
    let mut baseline = None;
    for mode in [Insert::PlainTable, Insert::PlainOutbox, Insert::Enqueue] {
        let rates = drain::repeat(scale.runs, || enqueue_run(mode, scale.enqueue_duration)).await?;
        let rate = median(rates);
        let plain = *baseline.get_or_insert(rate);
        report.add(
            "sqlite",
            mode.name(),
            rate,
            "messages/s",
            (mode != Insert::PlainTable).then_some(("plain INSERT", plain)),
        );
    }
    Ok(())
}
