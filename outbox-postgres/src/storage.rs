//! The relay side of the PostgreSQL outbox: claims under fenced leases, settlements, the
//! wake-up, queue figures and the operator's repairs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::{
    Claim, ClaimToken, Error, Message, QueueStats, Result, Settlement, Storage,
    StorageCapabilities, TraceContext,
};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Executor, Row};
use tokio::sync::{Notify, OnceCell};
use uuid::Uuid;

use crate::error::db_error;
use crate::{OutboxTable, PostgresConfig};

/// How soon a relay whose last claim found messages claims again.
const BUSY_POLL: Duration = Duration::from_millis(2);

/// Columns of a message, in the order `message_from_row` reads them.
const MESSAGE_COLUMNS: &str =
    "id, topic, partition_key, payload, headers, traceparent, tracestate, created_at, attempts";

/// The SQL of one outbox table, built once from validated names.
///
/// Times come from `statement_timestamp()`, never `now()`: `now()` is when the transaction
/// began, and a claim waits for the claim lock inside its transaction, so a lease counted
/// from `now()` would already be partly spent when the claim is made.
struct Statements {
    claim: String,
    /// The outcome of a batch that holds no key back (deliveries and releases only).
    settle: String,
    /// The outcome of a batch with retries or dead letters: under the shared claim lock.
    settle_holding_back: String,
    extend_lease: String,
    stats: String,
    arm_wakeup: String,
    disarm_wakeup: String,
    purge_delivered: String,
}

impl Statements {
    fn new(t: &OutboxTable, config: &PostgresConfig) -> Self {
        let per_key_order = config.per_key_order;
        let outbox = t.qualified("");
        let wakeup = t.qualified("_wakeup");
        let delivered = t.qualified("_delivered");
        let cols = MESSAGE_COLUMNS
            .split(", ")
            .map(|c| format!("o.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let claim = if per_key_order {
            Self::ordered_claim(
                &outbox,
                &t.qualified("_parked_keys"),
                &cols,
                config.max_per_key,
            )
        } else {
            // Without per-key order claims run concurrently and skip each other's rows.
            format!(
                "WITH due AS (
                    SELECT o.seq FROM {outbox} o
                    WHERE o.available_at <= statement_timestamp()
                    ORDER BY o.seq LIMIT $1 FOR UPDATE SKIP LOCKED)
                 UPDATE {outbox} o SET claim_token = $2, claimed_by = $3,
                        available_at = statement_timestamp() + $4 * interval '1 millisecond'
                 FROM due WHERE o.seq = due.seq
                 RETURNING o.seq, {cols}, NULL::text AS cursor"
            )
        };
        // With per-key order, claims hold the table's advisory lock exclusively, and the
        // writes that hold a key's first row back (retries, dead letters) or lengthen a
        // lease hold it shared: a claim then never reads the old version of a row such a
        // write is changing (its lease run out, so seemingly due) and lets the rows behind
        // it through. Deliveries and releases need no lock: a claim that misses one only
        // sees a key as busier than it is (see ARCHITECTURE.md). The key is a number we
        // computed from the validated names, so it is written inline.
        let lock = |locked: bool| {
            if per_key_order && locked {
                (
                    format!(
                        "lock AS (SELECT pg_advisory_xact_lock_shared({})),",
                        t.lock_key()
                    ),
                    "AND EXISTS (SELECT 1 FROM lock)",
                )
            } else {
                (String::new(), "")
            }
        };
        let (lock_cte, locked) = lock(true);
        let extend_lease = format!(
            "WITH {lock_cte} done AS (
                UPDATE {outbox} o
                SET available_at = statement_timestamp() + $3 * interval '1 millisecond'
                WHERE o.id = ANY($1) AND o.claim_token = $2 {locked}
                RETURNING 1)
             SELECT count(*) FROM done"
        );
        let stats = format!(
            "SELECT count(*) FILTER (WHERE claim_token IS NULL OR available_at <= now()),
                    min(created_at) FILTER (WHERE claim_token IS NULL OR available_at <= now()),
                    count(*) FILTER (WHERE claim_token IS NOT NULL AND available_at > now()),
                    (SELECT count(*) FROM {}),
                    (SELECT count(*) FROM {})
             FROM {outbox}",
            t.qualified("_dead_letters"),
            t.qualified("_parked_keys"),
        );
        Statements {
            claim,
            settle: Self::settle(t, config, lock(false)),
            settle_holding_back: Self::settle(t, config, lock(true)),
            extend_lease,
            stats,
            arm_wakeup: format!("UPDATE {wakeup} SET relay_idle = true WHERE NOT relay_idle"),
            disarm_wakeup: format!("UPDATE {wakeup} SET relay_idle = false WHERE relay_idle"),
            purge_delivered: format!(
                "DELETE FROM {delivered} WHERE seq IN (
                    SELECT seq FROM {delivered} WHERE delivered_at < now() - $1 * interval '1 millisecond'
                    ORDER BY delivered_at LIMIT 1000)"
            ),
        }
    }

    /// The outcome of a batch in one statement, so it is written whole or not at all:
    /// dead letters (moved, their keys parked), retries, deliveries (deleted, or kept with
    /// their receipt) and releases. Each row changes only while it is still held under the
    /// claim's token (`$1`). Returns how many rows changed.
    fn settle(
        t: &OutboxTable,
        config: &PostgresConfig,
        (lock_cte, locked): (String, &str),
    ) -> String {
        let outbox = t.qualified("");
        let dead = t.qualified("_dead_letters");
        let parked = t.qualified("_parked_keys");
        let delivered = t.qualified("_delivered");
        let park = if config.per_key_order {
            format!(
                "parked AS (
                    INSERT INTO {parked} (partition_key, dead_letter_id)
                    SELECT DISTINCT ON (partition_key) partition_key, id FROM moved
                    WHERE partition_key IS NOT NULL ORDER BY partition_key, seq
                    ON CONFLICT (partition_key) DO NOTHING),"
            )
        } else {
            String::new()
        };
        let (kept, acked_count) = if config.retention.is_some() {
            (
                format!(
                    "kept AS (
                        INSERT INTO {delivered} (seq, id, topic, partition_key, payload, headers,
                               traceparent, tracestate, created_at, attempts, receipt)
                        SELECT seq, id, topic, partition_key, payload, headers, traceparent,
                               tracestate, created_at, attempts, receipt FROM acked
                        RETURNING 1),"
                ),
                "kept",
            )
        } else {
            (String::new(), "acked")
        };
        format!(
            "WITH {lock_cte}
             gone AS (
                DELETE FROM {outbox} o USING unnest($2::uuid[], $3::text[]) AS r(id, error)
                WHERE o.id = r.id AND o.claim_token = $1 {locked}
                RETURNING o.*, r.error),
             moved AS (
                INSERT INTO {dead} (seq, id, topic, partition_key, payload, headers, traceparent,
                       tracestate, created_at, attempts, last_error)
                SELECT seq, id, topic, partition_key, payload, headers, traceparent, tracestate,
                       created_at, attempts + 1, error FROM gone
                RETURNING seq, id, partition_key),
             {park}
             retried AS (
                UPDATE {outbox} o SET attempts = o.attempts + 1, claim_token = NULL,
                       claimed_by = NULL, last_error = r.error,
                       available_at = statement_timestamp() + r.delay_ms * interval '1 millisecond'
                FROM unnest($4::uuid[], $5::bigint[], $6::text[]) AS r(id, delay_ms, error)
                WHERE o.id = r.id AND o.claim_token = $1 {locked}
                RETURNING 1),
             acked AS (
                DELETE FROM {outbox} o USING unnest($7::uuid[], $8::text[]) AS r(id, receipt)
                WHERE o.id = r.id AND o.claim_token = $1
                RETURNING o.*, r.receipt),
             {kept}
             released AS (
                UPDATE {outbox} o SET claim_token = NULL, claimed_by = NULL,
                       available_at = statement_timestamp()
                WHERE o.id = ANY($9) AND o.claim_token = $1
                RETURNING 1)
             SELECT (SELECT count(*) FROM moved) + (SELECT count(*) FROM retried)
                  + (SELECT count(*) FROM {acked_count}) + (SELECT count(*) FROM released)"
        )
    }

    /// The claim with per-key order: a sweep over the partition keys rather than the rows.
    ///
    /// A key is free when its first row is due and it is not parked. The sweep visits each
    /// key once, in key order, starting after the key where this relay's last claim stopped
    /// (`$5`) and wrapping around: a key another relay holds costs one index descent,
    /// however many rows it has waiting, and keys take turns. Of a free key it takes its
    /// first rows, at most `max_per_key` (the worker publishes a key's rows one round after
    /// another), and stops at the first row that is not due: rows behind one that is in
    /// flight or waiting to retry never go ahead of it, whatever their own state (a row of
    /// a late commit, a released or replayed row can be due behind one that is not). It
    /// stops once it has the batch.
    ///
    /// Rows without a key need no order: the oldest due ones take turns with the keyed rows,
    /// so neither kind starves the other. Claims are serialised by the advisory lock, so the
    /// candidates need no row locks, and the UPDATE takes every picked row without checking
    /// it again: the only writes that can change a picked row meanwhile are deliveries
    /// (the row is gone, and skipped) and releases (the row is due anyway); re-checking
    /// would drop a released row and keep the rows behind it. Every returned row carries
    /// the key the next sweep starts after, the last one taken in sweep order.
    fn ordered_claim(outbox: &str, parked: &str, cols: &str, max_per_key: usize) -> String {
        let head = format!("SELECT o.partition_key, o.seq, o.available_at FROM {outbox} o");
        format!(
            "WITH RECURSIVE
             after_cursor AS (
                ({head} WHERE o.partition_key > $5 ORDER BY o.partition_key, o.seq LIMIT 1)
                UNION ALL
                SELECT n.* FROM after_cursor a CROSS JOIN LATERAL (
                    {head} WHERE o.partition_key > a.partition_key
                    ORDER BY o.partition_key, o.seq LIMIT 1) n),
             up_to_cursor AS (
                ({head} WHERE o.partition_key <= $5 ORDER BY o.partition_key, o.seq LIMIT 1)
                UNION ALL
                SELECT n.* FROM up_to_cursor a CROSS JOIN LATERAL (
                    {head} WHERE o.partition_key > a.partition_key AND o.partition_key <= $5
                    ORDER BY o.partition_key, o.seq LIMIT 1) n),
             heads AS (
                SELECT * FROM after_cursor UNION ALL SELECT * FROM up_to_cursor),
             free_keys AS (
                SELECT h.partition_key FROM heads h
                WHERE h.available_at <= statement_timestamp()
                  AND NOT EXISTS (SELECT 1 FROM {parked} p WHERE p.partition_key = h.partition_key)),
             keyed AS (
                SELECT r.seq, r.partition_key FROM free_keys f CROSS JOIN LATERAL (
                    SELECT w.seq, w.partition_key FROM (
                        SELECT k.seq, k.partition_key,
                               bool_and(k.available_at <= statement_timestamp())
                                   OVER (ORDER BY k.seq) AS all_due_so_far
                        FROM (SELECT o.seq, o.partition_key, o.available_at FROM {outbox} o
                              WHERE o.partition_key = f.partition_key
                              ORDER BY o.seq LIMIT {max_per_key}) k) w
                    WHERE w.all_due_so_far) r
                -- Stops the sweep once it has a batch: rows come key after key in sweep
                -- order, each key's in seq order, so the cut drops only a key's last rows.
                LIMIT $1),
             unkeyed AS (
                SELECT o.seq, o.partition_key FROM {outbox} o
                WHERE o.partition_key IS NULL AND o.available_at <= statement_timestamp()
                ORDER BY o.seq LIMIT $1),
             picked AS MATERIALIZED (
                SELECT seq, partition_key FROM (
                    SELECT seq, partition_key, row_number() OVER (ORDER BY seq) AS turn FROM unkeyed
                    UNION ALL
                    -- Sweep order, each key's rows in order: a cut at the limit drops only
                    -- the last rows of a key, never a row ahead of one it keeps.
                    SELECT seq, partition_key, row_number() OVER (
                        ORDER BY partition_key <= $5, partition_key, seq) AS turn FROM keyed) t
                ORDER BY turn LIMIT $1)
             UPDATE {outbox} o SET claim_token = $2, claimed_by = $3,
                    available_at = statement_timestamp() + $4 * interval '1 millisecond'
             FROM picked WHERE o.seq = picked.seq
             RETURNING o.seq, {cols},
                (SELECT p.partition_key FROM picked p WHERE p.partition_key IS NOT NULL
                 ORDER BY p.partition_key <= $5 DESC, p.partition_key DESC LIMIT 1) AS cursor"
        )
    }
}

/// The PostgreSQL [`Storage`]: claims with `FOR UPDATE` under leases on the database clock,
/// fences every later write with the claim's token, keeps per-key order, and wakes the
/// relay with LISTEN/NOTIFY.
pub struct PgStorage {
    config: PostgresConfig,
    table: OutboxTable,
    pool: PgPool,
    sql: Statements,
    wakeup: Arc<Notify>,
    listener: OnceCell<tokio::task::JoinHandle<()>>,
    /// Whether this storage told writers to notify (its last claim found nothing).
    armed: AtomicBool,
    /// Whether the last claim found messages: then more are likely on their way, and the
    /// relay polls again shortly instead of asking writers to notify.
    busy: AtomicBool,
    /// The partition key after which the next ordered claim starts its sweep.
    cursor: std::sync::Mutex<String>,
}

impl std::fmt::Debug for PgStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStorage")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Drop for PgStorage {
    fn drop(&mut self) {
        if let Some(listener) = self.listener.get() {
            listener.abort();
        }
    }
}

impl PgStorage {
    /// A storage for `config`. Validates the configuration; connects lazily, so a database
    /// that is down shows up as an `Unavailable` error from the first call, not here.
    pub fn new(config: PostgresConfig) -> Result<Self> {
        config.validate()?;
        let options: PgConnectOptions = config.url.parse().map_err(|e: sqlx::Error| {
            Error::config(format!(
                "storage.url `{}` cannot be parsed: {e}",
                outbox_core::redact_url(&config.url)
            ))
        })?;
        let options = options.application_name("outbox-relay");
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.connect_timeout)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // The relay's own writes may be lost in a crash without harm (a lost
                    // acknowledgement means one redelivery), so they need not wait for the WAL
                    // flush. Custom plans keep the claim index-driven however small the table
                    // was when the statement was first prepared. JIT compiling the claim (its
                    // estimated cost is high) took 200 ms per call; the claim runs in 1-5 ms.
                    conn.execute(
                        "SET synchronous_commit = off; SET plan_cache_mode = force_custom_plan; SET jit = off",
                    )
                    .await?;
                    Ok(())
                })
            })
            .connect_lazy_with(options);
        let table = OutboxTable::new(&config.schema, &config.table)?;
        let sql = Statements::new(&table, &config);
        Ok(PgStorage {
            config,
            table,
            pool,
            sql,
            wakeup: Arc::new(Notify::new()),
            listener: OnceCell::new(),
            armed: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            cursor: std::sync::Mutex::new(String::new()),
        })
    }

    /// The outbox table this storage relays from.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// The relay's connection pool (its sessions run with `synchronous_commit = off`: do not
    /// enqueue through it).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &PostgresConfig {
        &self.config
    }

    /// Creates or upgrades the outbox tables.
    pub async fn migrate(&self) -> Result<()> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| db_error("cannot connect", e))?;
        // Migrations must be durable whatever the relay's session settings say.
        sqlx::query("SET synchronous_commit = on")
            .execute(&mut *conn)
            .await
            .map_err(|e| db_error("migration failed", e))?;
        let result = self.table.migrate(&mut conn).await;
        let _ = sqlx::query("SET synchronous_commit = off")
            .execute(&mut *conn)
            .await;
        result
    }

    fn lock_key(&self) -> i64 {
        self.table.lock_key()
    }

    /// Runs a statement that returns a count.
    async fn count(
        &self,
        what: &str,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<u64> {
        let row = query
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_error(what, e))?;
        let n: i64 = row.try_get(0).map_err(|e| db_error(what, e))?;
        Ok(n as u64)
    }

    /// Starts the LISTEN connection once; returns false if it could not be started.
    async fn ensure_listener(&self) -> bool {
        let started = self
            .listener
            .get_or_try_init(|| async {
                let mut listener = PgListener::connect_with(&self.pool)
                    .await
                    .map_err(|e| db_error("wake-up listener cannot connect", e))?;
                listener
                    .listen(&self.table.channel())
                    .await
                    .map_err(|e| db_error("LISTEN failed", e))?;
                let wakeup = self.wakeup.clone();
                Ok::<_, Error>(tokio::spawn(async move {
                    loop {
                        match listener.recv().await {
                            Ok(_) => wakeup.notify_one(),
                            Err(error) => {
                                // PgListener reconnects on the next recv; polling covers the gap.
                                tracing::warn!(%error, "wake-up listener lost its connection");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                            }
                        }
                    }
                }))
            })
            .await;
        match started {
            Ok(_) => true,
            Err(error) => {
                tracing::warn!(%error, "wake-up unavailable; polling only");
                false
            }
        }
    }

    /// Dead-lettered messages, oldest first, at most `limit`.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetterRow>> {
        self.find_dead_letters(&DeadLetterFilter::default(), limit)
            .await
    }

    /// Dead-lettered messages that match `filter`, oldest first, at most `limit`.
    pub async fn find_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: i64,
    ) -> Result<Vec<DeadLetterRow>> {
        let sql = format!(
            "SELECT seq, {MESSAGE_COLUMNS}, last_error, dead_lettered_at FROM {}
             WHERE ($2::uuid[] IS NULL OR id = ANY($2)) AND ($3::text IS NULL OR topic = $3)
               AND ($4::text IS NULL OR partition_key = $4)
             ORDER BY seq LIMIT $1",
            self.table.qualified("_dead_letters")
        );
        let rows = sqlx::query(&sql)
            .bind(limit)
            .bind(filter.ids.as_deref())
            .bind(filter.topic.as_deref())
            .bind(filter.key.as_deref())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("cannot list dead letters", e))?;
        rows.iter()
            .map(|row| {
                let message = message_from_row(row)?;
                let get = |e| db_error("cannot read dead letter", e);
                Ok(DeadLetterRow {
                    message,
                    last_error: row.try_get("last_error").map_err(get)?,
                    dead_lettered_at: row.try_get("dead_lettered_at").map_err(get)?,
                })
            })
            .collect()
    }

    /// Puts dead-lettered messages back into the outbox at their original position (first in
    /// their key's order), with their attempts reset, and releases their keys' parked
    /// messages once no dead letter of the key remains. Returns how many were replayed.
    pub async fn replay_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        let (outbox, dead, parked) = (
            self.table.qualified(""),
            self.table.qualified("_dead_letters"),
            self.table.qualified("_parked_keys"),
        );
        let sql = format!(
            "WITH lock AS (SELECT pg_advisory_xact_lock_shared($2)),
             back AS (
                DELETE FROM {dead} d WHERE d.id = ANY($1) AND EXISTS (SELECT 1 FROM lock)
                RETURNING d.*),
             restored AS (
                INSERT INTO {outbox} (seq, id, topic, partition_key, payload, headers, traceparent,
                       tracestate, created_at, attempts, available_at)
                OVERRIDING SYSTEM VALUE
                SELECT seq, id, topic, partition_key, payload, headers, traceparent, tracestate,
                       created_at, 0, now() FROM back
                RETURNING partition_key),
             unparked AS (
                DELETE FROM {parked} p WHERE p.partition_key IN (SELECT partition_key FROM restored)
                  AND NOT EXISTS (SELECT 1 FROM {dead} d WHERE d.partition_key = p.partition_key
                                  AND d.id <> ALL($1)))
             SELECT count(*) FROM restored"
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(ids)
            .bind(self.lock_key())
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_error("cannot replay dead letters", e))?;
        Ok(n as u64)
    }

    /// Queue figures per topic, sorted by topic.
    pub async fn topic_stats(&self) -> Result<Vec<TopicStats>> {
        let sql = format!(
            "WITH live AS (
                SELECT topic,
                       count(*) FILTER (WHERE claim_token IS NULL OR available_at <= now()) AS pending,
                       min(created_at) FILTER (WHERE claim_token IS NULL OR available_at <= now()) AS oldest,
                       count(*) FILTER (WHERE claim_token IS NOT NULL AND available_at > now()) AS in_flight
                FROM {outbox} GROUP BY topic),
             dead AS (SELECT topic, count(*) AS dead FROM {dead} GROUP BY topic)
             SELECT coalesce(live.topic, dead.topic) AS topic, coalesce(pending, 0) AS pending, oldest,
                    coalesce(in_flight, 0) AS in_flight, coalesce(dead.dead, 0) AS dead
             FROM live FULL JOIN dead ON live.topic = dead.topic ORDER BY 1",
            outbox = self.table.qualified(""),
            dead = self.table.qualified("_dead_letters"),
        );
        let fail = |e| db_error("cannot read topic figures", e);
        let rows = sqlx::query(&sql)
            .fetch_all(&self.pool)
            .await
            .map_err(fail)?;
        rows.iter()
            .map(|row| {
                let count = |name: &str| -> Result<u64> {
                    Ok(row.try_get::<i64, _>(name).map_err(fail)?.max(0) as u64)
                };
                Ok(TopicStats {
                    topic: row.try_get("topic").map_err(fail)?,
                    pending: count("pending")?,
                    oldest_pending: row.try_get("oldest").map_err(fail)?,
                    in_flight: count("in_flight")?,
                    dead_lettered: count("dead")?,
                })
            })
            .collect()
    }

    /// Partition keys that are parked, with the dead letter that parked each.
    pub async fn parked_keys(&self) -> Result<Vec<(String, Uuid)>> {
        let sql = format!(
            "SELECT partition_key, dead_letter_id FROM {} ORDER BY parked_at",
            self.table.qualified("_parked_keys")
        );
        sqlx::query_as(&sql)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error("cannot list parked keys", e))
    }

    /// Lets a parked key's messages flow again without replaying its dead letter (which stays
    /// in the dead letters). Returns whether the key was parked.
    pub async fn release_parked_key(&self, key: &str) -> Result<bool> {
        let sql = format!(
            "DELETE FROM {} WHERE partition_key = $1",
            self.table.qualified("_parked_keys")
        );
        let done = sqlx::query(&sql)
            .bind(key)
            .execute(&self.pool)
            .await
            .map_err(|e| db_error("cannot release parked key", e))?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes dead letters for good. Their keys stay parked until released.
    pub async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        let sql = format!(
            "DELETE FROM {} WHERE id = ANY($1)",
            self.table.qualified("_dead_letters")
        );
        let done = sqlx::query(&sql)
            .bind(ids)
            .execute(&self.pool)
            .await
            .map_err(|e| db_error("cannot purge dead letters", e))?;
        Ok(done.rows_affected())
    }
}

/// Which dead letters an operator command applies to; unset fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only these ids.
    pub ids: Option<Vec<Uuid>>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this partition key.
    pub key: Option<String>,
}

/// Queue figures of one topic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopicStats {
    /// The topic.
    pub topic: String,
    /// Messages waiting (including retries and parked ones).
    pub pending: u64,
    /// Creation time of the oldest pending message.
    pub oldest_pending: Option<DateTime<Utc>>,
    /// Messages claimed under a live lease.
    pub in_flight: u64,
    /// Messages in the dead letters.
    pub dead_lettered: u64,
}

/// A dead-lettered message with why and when it was dead-lettered.
#[derive(Debug, Clone)]
pub struct DeadLetterRow {
    /// The message, with the attempts it used.
    pub message: Message,
    /// The last error.
    pub last_error: String,
    /// When it was dead-lettered.
    pub dead_lettered_at: DateTime<Utc>,
}

/// Reads a message from a row holding [`MESSAGE_COLUMNS`].
fn message_from_row(row: &PgRow) -> Result<Message> {
    let get = |e| db_error("cannot read message row", e);
    let id: Uuid = row.try_get("id").map_err(get)?;
    let headers: serde_json::Value = row.try_get("headers").map_err(get)?;
    let traceparent: Option<String> = row.try_get("traceparent").map_err(get)?;
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    Ok(Message {
        id,
        topic: row.try_get("topic").map_err(get)?,
        key: row.try_get("partition_key").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        headers: headers_from_json(id, headers),
        created_at: row.try_get("created_at").map_err(get)?,
        attempts: attempts.max(0) as u32,
        trace_context: match traceparent {
            Some(traceparent) => Some(TraceContext {
                traceparent,
                tracestate: row.try_get("tracestate").map_err(get)?,
            }),
            None => None,
        },
    })
}

/// Headers are a JSON object of strings. Rows written by hand in SQL may hold other JSON
/// values: those are passed on as their JSON text rather than dropped.
fn headers_from_json(id: Uuid, value: serde_json::Value) -> BTreeMap<String, String> {
    match value {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        serde_json::Value::Null => BTreeMap::new(),
        other => {
            tracing::warn!(%id, "headers column is not a JSON object; passing it on as `headers`");
            BTreeMap::from([("headers".to_string(), other.to_string())])
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[async_trait]
impl Storage for PgStorage {
    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> Result<Claim> {
        let fail = |e| db_error("claim failed", e);
        let token = ClaimToken(Uuid::now_v7());
        let query = sqlx::query(&self.sql.claim)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(token.0)
            .bind(worker_id)
            .bind(millis(lease));
        let query = if self.config.per_key_order {
            let cursor = self
                .cursor
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            query.bind(cursor)
        } else {
            query
        };
        let rows = if self.config.per_key_order {
            let mut tx = self.pool.begin().await.map_err(fail)?;
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(self.lock_key())
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            let rows = query.fetch_all(&mut *tx).await.map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            rows
        } else {
            query.fetch_all(&self.pool).await.map_err(fail)?
        };
        let mut numbered = rows
            .iter()
            .map(|row| {
                Ok((
                    row.try_get::<i64, _>("seq").map_err(fail)?,
                    message_from_row(row)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        numbered.sort_unstable_by_key(|(seq, _)| *seq);
        if let Some(row) = rows.first()
            && let Some(cursor) = row.try_get::<Option<String>, _>("cursor").map_err(fail)?
        {
            *self.cursor.lock().unwrap_or_else(|e| e.into_inner()) = cursor;
        }
        let messages: Vec<Message> = numbered.into_iter().map(|(_, m)| m).collect();
        // Idle to busy: writers need not notify until a claim comes back empty again. Any
        // relay clears the flag (another relay may have set it); a no-op when already clear.
        let was_busy = self.busy.swap(!messages.is_empty(), Ordering::SeqCst);
        if !messages.is_empty() && !was_busy && self.config.wakeup {
            self.armed.store(false, Ordering::SeqCst);
            sqlx::query(&self.sql.disarm_wakeup)
                .execute(&self.pool)
                .await
                .map_err(|e| db_error("cannot disarm the wake-up", e))?;
        }
        Ok(Claim { token, messages })
    }

    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        if settlement.is_empty() {
            return Ok(0);
        }
        let sql = if settlement.holds_back() {
            &self.sql.settle_holding_back
        } else {
            &self.sql.settle
        };
        let s = settlement;
        let query = sqlx::query(sql)
            .bind(token.0)
            .bind(s.dead.iter().map(|d| d.id).collect::<Vec<Uuid>>())
            .bind(s.dead.iter().map(|d| d.error.as_str()).collect::<Vec<_>>())
            .bind(s.retries.iter().map(|r| r.id).collect::<Vec<Uuid>>())
            .bind(
                s.retries
                    .iter()
                    .map(|r| millis(r.delay))
                    .collect::<Vec<i64>>(),
            )
            .bind(
                s.retries
                    .iter()
                    .map(|r| r.error.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(s.delivered.iter().map(|d| d.id).collect::<Vec<Uuid>>())
            .bind(
                s.delivered
                    .iter()
                    .map(|d| d.receipt.0.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(s.released.clone());
        self.count("settling a batch failed", query).await
    }

    async fn extend_lease(&self, token: &ClaimToken, ids: &[Uuid], lease: Duration) -> Result<u64> {
        let query = sqlx::query(&self.sql.extend_lease)
            .bind(ids.to_vec())
            .bind(token.0)
            .bind(millis(lease));
        self.count("renewing a lease failed", query).await
    }

    async fn health(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(|e| db_error("health check failed", e))?;
        Ok(())
    }

    async fn stats(&self) -> Result<QueueStats> {
        let fail = |e| db_error("cannot read queue figures", e);
        let row = sqlx::query(&self.sql.stats)
            .fetch_one(&self.pool)
            .await
            .map_err(fail)?;
        let count =
            |i: usize| -> Result<u64> { Ok(row.try_get::<i64, _>(i).map_err(fail)?.max(0) as u64) };
        Ok(QueueStats {
            pending: count(0)?,
            oldest_pending: row.try_get(1).map_err(fail)?,
            in_flight: count(2)?,
            dead_lettered: count(3)?,
            parked_keys: count(4)?,
        })
    }

    fn capabilities(&self) -> StorageCapabilities {
        let per_key_order = self.config.per_key_order;
        StorageCapabilities::new(per_key_order)
            .with_max_per_key(per_key_order.then_some(self.config.max_per_key))
    }

    async fn wait_for_work(&self) -> Result<()> {
        if self.busy.load(Ordering::SeqCst) {
            // The last claim found messages: under a steady load, look again soon rather
            // than make every writer's commit notify.
            tokio::time::sleep(BUSY_POLL).await;
            return Ok(());
        }
        if !self.config.wakeup || !self.ensure_listener().await {
            return std::future::pending().await;
        }
        if !self.armed.swap(true, Ordering::SeqCst) {
            sqlx::query(&self.sql.arm_wakeup)
                .execute(&self.pool)
                .await
                .map_err(|e| db_error("cannot arm the wake-up", e))?;
            // Rows committed before writers knew to notify: look once more before sleeping.
            return Ok(());
        }
        self.wakeup.notified().await;
        Ok(())
    }

    async fn maintain(&self) -> Result<()> {
        if let Some(retention) = self.config.retention {
            let done = sqlx::query(&self.sql.purge_delivered)
                .bind(millis(retention))
                .execute(&self.pool)
                .await
                .map_err(|e| db_error("cannot purge delivered rows", e))?;
            if done.rows_affected() > 0 {
                tracing::debug!(
                    rows = done.rows_affected(),
                    "purged delivered rows past retention"
                );
            }
        }
        Ok(())
    }
}
