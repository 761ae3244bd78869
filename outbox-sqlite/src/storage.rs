//! [`SqliteStorage`]: its lifecycle (file, connection pool, migrations) and the relay side,
//! the [`Storage`] implementation: claims under fenced leases, settlements, queue figures
//! and housekeeping. The operator's repairs are in `admin.rs`.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Claim, ClaimToken, Error, QueueStats, Result, Settlement, Storage, StorageCapabilities,
};
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Row, Sqlite, Transaction};
use uuid::Uuid;

use outbox_sql::first_of_each;

use crate::error::db_error;
use crate::sql::{self, Statements};
use crate::{OutboxTable, SqliteConfig, connection, rows};
use outbox_core::config::Settings;

/// The longest delay or lease written, in milliseconds (about 31,000 years): times stay
/// integers however long a `Duration` is.
const MAX_MILLIS: i64 = 1_000_000_000_000_000;

/// The SQLite [`Storage`]: claims in `BEGIN IMMEDIATE` transactions under leases on the
/// database's clock (the host's), fences every later write with the claim's token, and keeps
/// per-key order. SQLite has one writer at a time, so claims and settlements take turns on
/// the database's write lock, with each other and with the application's transactions. No
/// wake-up: the relay polls.
pub struct SqliteStorage {
    config: SqliteConfig,
    table: OutboxTable,
    pool: SqlitePool,
    /// Why the pool's last new connection could not be set up, if it could not.
    setup: connection::SetupError,
    /// Also used by the operator's repairs (`admin.rs`).
    pub(crate) sql: Statements,
    /// Serialises this process's writes before they queue for the file's write lock:
    /// SQLite's busy handler waits by sleeping, so two of our own connections competing for
    /// the lock would lose milliseconds to each other; a queue hands it over at once.
    writer: tokio::sync::Mutex<()>,
    /// The partition key after which the next ordered claim starts its sweep.
    cursor: std::sync::Mutex<String>,
    /// The seq of each message this storage claimed and has not settled yet: the relay's
    /// writes find rows by seq, the rowid, with no index to search. A message keeps its seq
    /// for life (a replay restores it), so this only caches; a seq it lacks is read back.
    seqs: std::sync::Mutex<HashMap<Uuid, i64>>,
}

outbox_core::debug_shows_config!(SqliteStorage);

/// A write in progress: this process's turn, the write transaction and the database's
/// clock when it began. End it with [`SqliteStorage::finish`].
pub(crate) struct Write<'a> {
    _turn: tokio::sync::MutexGuard<'a, ()>,
    pub(crate) tx: Transaction<'static, Sqlite>,
    /// Milliseconds since the Unix epoch, on the database's clock.
    pub(crate) now: i64,
}

/// A duration as the milliseconds the statements take, saturating at [`MAX_MILLIS`].
fn millis(d: Duration) -> i64 {
    outbox_sql::saturating_millis(d).min(MAX_MILLIS)
}

/// How many message seqs [`SqliteStorage`] remembers before it starts over: the seqs of
/// claims that are never settled here (their lease ran out) would otherwise pile up.
const SEQS_REMEMBERED: usize = 100_000;

/// Ids as the JSON array the statements read with `json_each`.
pub(crate) fn json_ids<'a>(ids: impl IntoIterator<Item = &'a Uuid>) -> String {
    serde_json::Value::Array(
        ids.into_iter()
            .map(|id| serde_json::Value::String(id.hyphenated().to_string()))
            .collect(),
    )
    .to_string()
}

/// Seqs as the JSON array the statements read with `json_each`.
fn json_seqs<'a>(seqs: impl IntoIterator<Item = &'a i64>) -> String {
    serde_json::Value::Array(seqs.into_iter().map(|&seq| seq.into()).collect()).to_string()
}

/// A statement over a JSON list of messages (`?1`) held under a token (`?2`) at `now` (`?3`).
fn listed<'q>(
    sql: &'q str,
    list: &str,
    token: &str,
    now: i64,
) -> sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments<'q>> {
    sqlx::query(sql)
        .bind(list.to_string())
        .bind(token.to_string())
        .bind(now)
}

/// Runs the [`listed`] statements `steps` (a `None` is a step this configuration skips), in
/// order, over the JSON list of `items`; returns the rows the last one changed. A list with
/// no items runs nothing.
async fn run_listed(
    tx: &mut Transaction<'static, Sqlite>,
    steps: &[Option<&String>],
    items: impl Iterator<Item = serde_json::Value>,
    token: &str,
    now: i64,
) -> std::result::Result<u64, sqlx::Error> {
    let items: Vec<_> = items.collect();
    if items.is_empty() {
        return Ok(0);
    }
    let list = serde_json::Value::Array(items).to_string();
    let mut changed = 0;
    for sql in steps.iter().flatten() {
        changed = listed(sql, &list, token, now)
            .execute(&mut **tx)
            .await?
            .rows_affected();
    }
    Ok(changed)
}

impl SqliteStorage {
    /// A storage for `config`. Validates the configuration and checks that the file's
    /// directory exists; opens the file lazily, so a file that is not a database shows up
    /// at the first call (use [`open`](SqliteStorage::open) to check it at once).
    pub fn new(config: SqliteConfig) -> Result<Self> {
        config.validate()?;
        config.check_path()?;
        let table = OutboxTable::new(&config.table)?;
        let sql = Statements::new(&table, &config);
        let setup = connection::SetupError::default();
        let pool = connection::pool(&config, &setup);
        Ok(SqliteStorage {
            config,
            table,
            pool,
            setup,
            sql,
            writer: tokio::sync::Mutex::new(()),
            cursor: std::sync::Mutex::new(String::new()),
            seqs: std::sync::Mutex::new(HashMap::new()),
        })
    }

    /// A storage for `config` whose file is opened at once (and created if missing, as an
    /// empty database in WAL mode): a file that cannot be opened or is not a SQLite
    /// database is a `Config` error keyed `path` here, as is one that cannot be switched to
    /// WAL mode (on a read-only file system, say).
    pub async fn open(config: SqliteConfig) -> Result<Self> {
        let storage = Self::new(config)?;
        connection::check(&storage.config)
            .await
            .map_err(|e| storage.error("cannot open the database", e))?;
        sqlx::query(sql::PING)
            .execute(&storage.pool)
            .await
            .map_err(|e| storage.error("cannot open the database", e))?;
        Ok(storage)
    }

    /// The outbox table this storage relays from.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// The relay's connection pool (its connections commit with `synchronous = NORMAL`: do
    /// not enqueue through it).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &SqliteConfig {
        &self.config
    }

    /// Creates or upgrades the outbox tables, durably (`synchronous = FULL`).
    pub async fn migrate(&self) -> Result<()> {
        let _writer = self.writer_turn().await;
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| self.error("cannot open the database", e))?;
        sqlx::query(sql::DURABLE_COMMITS)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.error("migration failed", e))?;
        let result = self.table.migrate(&mut conn).await;
        let _ = sqlx::query(sql::FAST_COMMITS).execute(&mut *conn).await;
        result
    }

    /// Classifies an error; a problem with the file names `path`. A pool time-out while
    /// every new connection failed its set-up is reported as that failure.
    pub(crate) fn error(&self, context: &str, error: sqlx::Error) -> Error {
        let error = match error {
            sqlx::Error::PoolTimedOut => {
                let wait = self.config.busy_timeout + Duration::from_secs(2);
                self.setup.take(wait).unwrap_or(sqlx::Error::PoolTimedOut)
            }
            error => error,
        };
        db_error(Some(&self.config.path), context, error)
    }

    /// Takes this process's turn to write, then the database's write lock, and reads the
    /// database's clock: one instant for the whole call, taken once the lock is held, so a
    /// lease counts from when the claim is made, not from a wait for the lock.
    pub(crate) async fn write(&self, what: &str) -> Result<Write<'_>> {
        let turn = self.writer_turn().await;
        let mut tx = self
            .pool
            .begin_with(sql::BEGIN_WRITE)
            .await
            .map_err(|e| self.error(what, e))?;
        match sqlx::query_scalar(&sql::now()).fetch_one(&mut *tx).await {
            Ok(now) => Ok(Write {
                _turn: turn,
                tx,
                now,
            }),
            Err(e) => {
                let _ = tx.rollback().await;
                Err(self.error(what, e))
            }
        }
    }

    /// Runs `query` in `write`, then ends the write ([`finish`](Self::finish)); returns how
    /// many rows the statement changed.
    pub(crate) async fn execute_in<'q>(
        &self,
        what: &str,
        mut write: Write<'_>,
        query: sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
    ) -> Result<u64> {
        let done = query
            .execute(&mut *write.tx)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| self.error(what, e));
        self.finish(what, write, done).await
    }

    /// Ends a write: commits it when `result` is `Ok`, rolls it back (and waits for that, so
    /// the next writer finds the lock free) when it is an error.
    pub(crate) async fn finish<T>(
        &self,
        what: &str,
        write: Write<'_>,
        result: Result<T>,
    ) -> Result<T> {
        match result {
            Ok(value) => {
                write.tx.commit().await.map_err(|e| self.error(what, e))?;
                Ok(value)
            }
            Err(error) => {
                if let Err(e) = write.tx.rollback().await {
                    tracing::warn!(error = %e, "sqlite: rolling back a failed write failed");
                }
                Err(error)
            }
        }
    }

    /// This process's turn to write (see `writer`), for writes that open their own
    /// transaction.
    pub(crate) async fn writer_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.writer.lock().await
    }

    /// Reads the database's clock outside a transaction.
    pub(crate) async fn now(&self, what: &str) -> Result<i64> {
        sqlx::query_scalar(&sql::now())
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.error(what, e))
    }

    /// Remembers the seqs of claimed messages, starting over when the cache is full.
    fn remember_seqs(&self, claimed: &[(i64, outbox_core::Message)]) {
        let mut seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        if seqs.len() + claimed.len() > SEQS_REMEMBERED {
            seqs.clear();
        }
        seqs.extend(claimed.iter().map(|(seq, message)| (message.id, *seq)));
    }

    /// The seqs of messages `ids`, from the cache (forgetting them when `settled`) or else
    /// read in the write's transaction. An id with no row has no seq.
    async fn seqs_of<'a>(
        &self,
        write: &mut Write<'_>,
        ids: impl Iterator<Item = &'a Uuid>,
        settled: bool,
    ) -> Result<HashMap<Uuid, i64>> {
        let mut found = HashMap::new();
        let mut missing = Vec::new();
        {
            let mut cache = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
            for id in ids {
                if found.contains_key(id) {
                    continue;
                }
                let seq = if settled {
                    cache.remove(id)
                } else {
                    cache.get(id).copied()
                };
                match seq {
                    Some(seq) => {
                        found.insert(*id, seq);
                    }
                    None => missing.push(*id),
                }
            }
        }
        if !missing.is_empty() {
            let rows = sqlx::query(&self.sql.seqs_of)
                .bind(json_ids(&missing))
                .fetch_all(&mut *write.tx)
                .await
                .map_err(|e| self.error("cannot find claimed rows", e))?;
            for row in &rows {
                let (id, seq) = rows::id_and_seq(row)?;
                found.insert(id, seq);
            }
        }
        Ok(found)
    }

    /// The messages of a claim's rows, and the key the next ordered claim starts after. A row
    /// that cannot be read as a message (text that is not UTF-8, an id that is not a UUID)
    /// is dead-lettered in the claim's own transaction with why, its key parked, so it
    /// neither stalls the messages claimed with it nor comes back.
    async fn read_claimed(
        &self,
        write: &mut Write<'_>,
        token: &ClaimToken,
        cursor: &str,
        rows: &[SqliteRow],
    ) -> Result<(rows::Numbered, Option<String>)> {
        let (good, bad) = rows::claimed(rows)?;
        if !bad.is_empty() {
            let fail = |e| self.error("dead-lettering a row that cannot be read", e);
            for (seq, error) in &bad {
                tracing::warn!(seq, %error, "sqlite: a claimed row cannot be read as a message; dead-lettering it");
            }
            let list = bad
                .iter()
                .map(|(seq, error)| serde_json::json!({ "seq": seq, "error": error.to_string() }))
                .collect::<Vec<_>>();
            let list = serde_json::Value::Array(list).to_string();
            let token = token.0.hyphenated().to_string();
            let run = |sql| listed(sql, &list, &token, write.now);
            run(&self.sql.dead_copy)
                .execute(&mut *write.tx)
                .await
                .map_err(fail)?;
            if let Some(park) = &self.sql.dead_park {
                run(park).execute(&mut *write.tx).await.map_err(fail)?;
            }
            run(&self.sql.dead_delete)
                .execute(&mut *write.tx)
                .await
                .map_err(fail)?;
        }
        Ok((good, Self::next_cursor(cursor, rows)))
    }

    /// The partition key the next ordered claim starts after: the last key this claim took
    /// in sweep order (keys after the cursor, then those up to it), if it took one. A key
    /// that is not text is left out: the cursor only spreads claims over the keys.
    fn next_cursor(cursor: &str, rows: &[SqliteRow]) -> Option<String> {
        let mut after: Option<String> = None;
        let mut wrapped: Option<String> = None;
        for row in rows {
            let key: Option<String> = row.try_get("partition_key").ok().flatten();
            let Some(key) = key else { continue };
            let slot = if key.as_str() > cursor {
                &mut after
            } else {
                &mut wrapped
            };
            if slot.as_ref().is_none_or(|k| key > *k) {
                *slot = Some(key);
            }
        }
        wrapped.or(after)
    }
}

#[async_trait]
impl Storage for SqliteStorage {
    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> Result<Claim> {
        let what = "claim failed";
        let token = ClaimToken(Uuid::now_v7());
        let cursor = self
            .cursor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut write = self.write(what).await?;
        let query = sqlx::query(&self.sql.claim)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(write.now)
            .bind(token.0.hyphenated().to_string())
            .bind(worker_id)
            .bind(millis(lease));
        let query = if self.config.per_key_order {
            query.bind(cursor.as_str())
        } else {
            query
        };
        let rows = query
            .fetch_all(&mut *write.tx)
            .await
            .map_err(|e| self.error(what, e));
        let claimed = match rows {
            Ok(rows) => self.read_claimed(&mut write, &token, &cursor, &rows).await,
            Err(error) => Err(error),
        };
        let (claimed, next) = self.finish(what, write, claimed).await?;
        if let Some(next) = next.filter(|_| self.config.per_key_order) {
            *self.cursor.lock().unwrap_or_else(|e| e.into_inner()) = next;
        }
        self.remember_seqs(&claimed);
        Ok(Claim {
            token,
            messages: claimed.into_iter().map(|(_, message)| message).collect(),
        })
    }

    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        if settlement.is_empty() {
            return Ok(0);
        }
        let what = "settling a batch failed";
        let mut write = self.write(what).await?;
        let result = self.settle_in(&mut write, token, settlement).await;
        self.finish(what, write, result).await
    }

    async fn extend_lease(&self, token: &ClaimToken, ids: &[Uuid], lease: Duration) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let what = "renewing a lease failed";
        let mut write = self.write(what).await?;
        let seqs = match self.seqs_of(&mut write, ids.iter(), false).await {
            Ok(seqs) => seqs,
            Err(e) => return self.finish(what, write, Err(e)).await,
        };
        let query = sqlx::query(&self.sql.extend_lease)
            .bind(json_seqs(ids.iter().filter_map(|id| seqs.get(id))))
            .bind(token.0.hyphenated().to_string())
            .bind(write.now)
            .bind(millis(lease));
        self.execute_in(what, write, query).await
    }

    async fn health(&self) -> Result<()> {
        sqlx::query(sql::PING)
            .execute(&self.pool)
            .await
            .map_err(|e| self.error("health check failed", e))?;
        Ok(())
    }

    async fn stats(&self) -> Result<QueueStats> {
        let what = "cannot read queue figures";
        let now = self.now(what).await?;
        let row = sqlx::query(&self.sql.stats)
            .bind(now)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.error(what, e))?;
        rows::queue_stats(&row)
    }

    fn capabilities(&self) -> StorageCapabilities {
        StorageCapabilities::keyed(self.config.per_key_order, self.config.max_per_key)
    }

    // `wait_for_work` keeps the default: SQLite has no notifications across processes, so
    // the worker polls every `poll_interval`.

    async fn maintain(&self) -> Result<()> {
        let Some(retention) = self.config.retention else {
            return Ok(());
        };
        let what = "cannot purge delivered rows";
        let write = self.write(what).await?;
        let query = sqlx::query(&self.sql.purge_delivered)
            .bind(write.now)
            .bind(millis(retention));
        let purged = self.execute_in(what, write, query).await?;
        if purged > 0 {
            tracing::debug!(rows = purged, "purged delivered rows past retention");
        }
        Ok(())
    }
}

impl SqliteStorage {
    /// The statements of a settlement, in its write transaction: dead letters (copied,
    /// their keys parked, deleted), retries, deliveries (kept with retention, deleted) and
    /// releases, each only for rows still held under the token.
    async fn settle_in(
        &self,
        write: &mut Write<'_>,
        token: &ClaimToken,
        s: &Settlement,
    ) -> Result<u64> {
        let fail = |e| self.error("settling a batch failed", e);
        let settled = (s.dead.iter().map(|d| &d.id))
            .chain(s.retries.iter().map(|r| &r.id))
            .chain(s.delivered.iter().map(|d| &d.id))
            .chain(&s.released);
        let seqs = self.seqs_of(write, settled, true).await?;
        let token = token.0.hyphenated().to_string();
        let (tx, now) = (&mut write.tx, write.now);
        let mut changed = 0;
        // A message with no seq has no row: nothing to change.
        let dead = first_of_each(&s.dead, |d| d.id);
        let dead = dead
            .iter()
            .filter_map(|d| Some(serde_json::json!({ "seq": seqs.get(&d.id)?, "error": d.error })));
        let dead_steps = [
            Some(&self.sql.dead_copy),
            self.sql.dead_park.as_ref(),
            Some(&self.sql.dead_delete),
        ];
        changed += run_listed(tx, &dead_steps, dead, &token, now)
            .await
            .map_err(fail)?;
        for retry in first_of_each(&s.retries, |r| r.id) {
            let Some(seq) = seqs.get(&retry.id) else {
                continue;
            };
            changed += sqlx::query(&self.sql.retry)
                .bind(seq)
                .bind(token.as_str())
                .bind(now)
                .bind(millis(retry.delay))
                .bind(retry.error.as_str())
                .execute(&mut **tx)
                .await
                .map_err(fail)?
                .rows_affected();
        }
        let delivered = first_of_each(&s.delivered, |d| d.id);
        let delivered = delivered.iter().filter_map(|d| {
            Some(serde_json::json!({ "seq": seqs.get(&d.id)?, "receipt": d.receipt.0 }))
        });
        let delivered_steps = [
            self.sql.delivered_keep.as_ref(),
            Some(&self.sql.delivered_delete),
        ];
        changed += run_listed(tx, &delivered_steps, delivered, &token, now)
            .await
            .map_err(fail)?;
        let released = s.released.iter().filter_map(|id| seqs.get(id));
        let released = json_seqs(released);
        if released != "[]" {
            changed += sqlx::query(&self.sql.release)
                .bind(released)
                .bind(token.as_str())
                .bind(now)
                .execute(&mut **tx)
                .await
                .map_err(fail)?
                .rows_affected();
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_saturate() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_MILLIS);
    }

    #[test]
    fn ids_are_a_json_list() {
        let a = Uuid::now_v7();
        assert_eq!(json_ids(&[a]), format!("[\"{a}\"]"));
    }
}
