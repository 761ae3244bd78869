//! [`MySqlStorage`]: its lifecycle (connection pool, migrations) and the relay side, the
//! [`Storage`] implementation: claims under fenced leases, settlements, queue figures and
//! housekeeping. The operator's repairs are in `admin.rs`.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::NaiveDateTime;
use outbox_core::{
    Claim, ClaimToken, Error, ErrorKind, QueueStats, Result, Settlement, Storage,
    StorageCapabilities, redact_url,
};
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlRow};
use sqlx::{MySql, Row, Transaction};
use uuid::Uuid;

use outbox_sql::first_of_each;

use crate::error::{Origin, db_error};
use crate::sql::{self, Statements};
use crate::{MySqlConfig, OutboxTable, connection, rows};
use outbox_core::config::Settings;

/// The longest delay or lease written (about 100 years): a `DATETIME` ends at year 9999.
const MAX_DELAY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Keys the sweep reads per statement, at most.
const SWEEP_CHUNK: usize = 500;

/// Messages whose seq a storage remembers at most (see `MySqlStorage::seqs`); past it the
/// memory is cleared (claims abandoned without a settlement leave entries behind).
const MAX_REMEMBERED: usize = 100_000;

/// The MySQL / MariaDB [`Storage`]: claims under leases on the database's clock, fences
/// every later write with the claim's token, keeps per-key order (ordered claims take a
/// lock row of the table, so two relays never both see a key as free), and takes rows with
/// `FOR UPDATE SKIP LOCKED` when per-key order is off. No wake-up: the relay polls.
pub struct MySqlStorage {
    config: MySqlConfig,
    table: OutboxTable,
    pool: MySqlPool,
    origin: Origin,
    /// Also used by the operator's repairs (`admin.rs`).
    pub(crate) sql: Statements,
    /// The partition key after which the next ordered claim starts its sweep, when the
    /// shared one (`<table>_claim_cursor`) is missing (tables of migration 2).
    cursor: std::sync::Mutex<Vec<u8>>,
    /// Whether `<table>_claim_cursor` was found missing: the private cursor is used.
    no_shared_cursor: std::sync::atomic::AtomicBool,
    /// The seq of each message this storage claimed and has not settled yet, so that an
    /// acknowledgement deletes by primary key. A message keeps its seq for life (a replay
    /// restores it), and every claim records it again, so an entry is never wrong; one
    /// missing sends the settlement through the `id` index.
    seqs: std::sync::Mutex<HashMap<Uuid, i64>>,
}

outbox_core::debug_shows_config!(MySqlStorage);

/// A delay or lease as the microseconds the statements add to the database's clock,
/// saturating at [`MAX_DELAY`].
pub(crate) fn micros(d: Duration) -> i64 {
    outbox_sql::saturating_micros(d.min(MAX_DELAY))
}

/// Ids as the text the `id` columns hold.
fn id_text(id: &Uuid) -> String {
    id.hyphenated().to_string()
}

/// A write in progress: the transaction and, when it took the claim lock, the database's
/// clock once the lock was held.
pub(crate) struct Write {
    pub(crate) tx: Transaction<'static, MySql>,
    pub(crate) now: Option<NaiveDateTime>,
}

impl MySqlStorage {
    /// A storage for `config`. Validates the configuration; connects lazily, so a database
    /// that is down shows up as an `Unavailable` error from the first call, not here (use
    /// [`connect`](MySqlStorage::connect) to check credentials and database at once).
    pub fn new(config: MySqlConfig) -> Result<Self> {
        config.validate()?;
        let (database, database_key) = config.database_name()?;
        let table = OutboxTable::new(&database, &config.table)?;
        let sql = Statements::new(&table, &config);
        let pool = connection::pool(&config)?;
        let origin = Origin {
            url: redact_url(&config.url),
            database,
            database_key,
        };
        Ok(MySqlStorage {
            config,
            table,
            pool,
            origin,
            sql,
            cursor: std::sync::Mutex::new(Vec::new()),
            no_shared_cursor: std::sync::atomic::AtomicBool::new(false),
            seqs: std::sync::Mutex::new(HashMap::new()),
        })
    }

    /// A storage for `config` that connects once at once: wrong credentials or a database
    /// that does not exist are a `Config` error naming the setting here. A server that is
    /// down is not (the relay starts and retries): that is logged.
    pub async fn connect(config: MySqlConfig) -> Result<Self> {
        let storage = Self::new(config)?;
        match storage.check().await {
            Ok(()) => Ok(storage),
            Err(e) if e.kind() == ErrorKind::Config => Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "mysql: the database is not reachable yet; the relay will retry");
                Ok(storage)
            }
        }
    }

    /// Connects and checks that the database of the outbox tables exists (it may differ
    /// from the URL's).
    async fn check(&self) -> Result<()> {
        let what = "cannot connect";
        let found: Option<Vec<u8>> = sqlx::query_scalar(sql::SCHEMA_EXISTS)
            .bind(self.table.database())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.error(what, e))?;
        if found.is_none() {
            return Err(Error::setting(
                self.origin.database_key,
                format!(
                    "names database `{}`, which does not exist on the server; create it \
                     (CREATE DATABASE {}) or fix the setting",
                    self.origin.database, self.origin.database
                ),
            ));
        }
        Ok(())
    }

    /// The outbox table this storage relays from.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// The relay's connection pool (READ COMMITTED sessions).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &MySqlConfig {
        &self.config
    }

    /// Creates or upgrades the outbox tables (see [`OutboxTable::migrate`]).
    pub async fn migrate(&self) -> Result<()> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| self.error("cannot connect", e))?;
        self.table.migrate(&mut conn).await
    }

    /// Classifies an error; credentials and a missing database name their setting.
    pub(crate) fn error(&self, context: &str, error: sqlx::Error) -> Error {
        db_error(Some(&self.origin), context, error)
    }

    /// Begins a transaction; with `lock`, takes the claim lock first (a statement that
    /// returns the database's clock once the lock is held).
    pub(crate) async fn write(&self, what: &str, lock: Option<&str>) -> Result<Write> {
        let mut tx = self.pool.begin().await.map_err(|e| self.error(what, e))?;
        let Some(lock) = lock else {
            return Ok(Write { tx, now: None });
        };
        match sqlx::query_scalar::<_, NaiveDateTime>(lock)
            .fetch_optional(&mut *tx)
            .await
        {
            Ok(Some(now)) => Ok(Write { tx, now: Some(now) }),
            Ok(None) => {
                let _ = tx.rollback().await;
                Err(Error::config(format!(
                    "mysql: {what}: {} has no row (run `outbox migrate`)",
                    self.table.qualified("_claim_lock")
                )))
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(self.error(what, e))
            }
        }
    }

    /// The lock of a write that holds keys back: the shared claim lock with per-key order,
    /// none without.
    pub(crate) fn holding_back(&self) -> Option<&str> {
        self.config
            .per_key_order
            .then_some(self.sql.lock_shared.as_str())
    }

    /// Remembers the seqs of claimed rows (read from `MESSAGE_COLUMNS`).
    fn remember(&self, rows: &[MySqlRow], messages: &[outbox_core::Message]) -> Result<()> {
        let mut seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        if seqs.len() + rows.len() > MAX_REMEMBERED {
            seqs.clear();
        }
        for (row, message) in rows.iter().zip(messages) {
            let seq: i64 = row
                .try_get("seq")
                .map_err(|e| self.error("cannot read a message row", e))?;
            seqs.insert(message.id, seq);
        }
        Ok(())
    }

    /// Forgets the messages of a settlement; returns the seqs of `delivered`, when it
    /// remembered all of them.
    fn forget(&self, s: &Settlement) -> Option<Vec<i64>> {
        let mut seqs = self.seqs.lock().unwrap_or_else(|e| e.into_inner());
        let delivered: Option<Vec<i64>> = s.delivered.iter().map(|d| seqs.remove(&d.id)).collect();
        for id in s.retries.iter().map(|r| r.id) {
            seqs.remove(&id);
        }
        for id in s
            .dead
            .iter()
            .map(|d| d.id)
            .chain(s.released.iter().copied())
        {
            seqs.remove(&id);
        }
        delivered
    }

    /// Ends a write: commits it when `result` is `Ok`, rolls it back when it is an error.
    pub(crate) async fn finish<T>(&self, what: &str, write: Write, result: Result<T>) -> Result<T> {
        match result {
            Ok(value) => {
                write.tx.commit().await.map_err(|e| self.error(what, e))?;
                Ok(value)
            }
            Err(error) => {
                if let Err(e) = write.tx.rollback().await {
                    tracing::warn!(error = %e, "mysql: rolling back a failed write failed");
                }
                Err(error)
            }
        }
    }

    /// The rows an ordered claim may take, in sweep order (each key's in seq order). See docs/storage/mysql.md: the sweep visits the
    /// keys after the cursor, then those up to it; a key is free when its first row is due
    /// and it is not parked; of a free key it takes its first rows, at most `max_per_key`,
    /// up to the first that is not due.
    async fn sweep(
        &self,
        tx: &mut Transaction<'static, MySql>,
        now: NaiveDateTime,
        limit: usize,
        cursor: &[u8],
        read: &mut HashMap<i64, MySqlRow>,
    ) -> std::result::Result<Vec<(i64, Vec<u8>)>, sqlx::Error> {
        let max_per_key = self.config.max_per_key;
        // Enough keys for a batch if each gives `max_per_key`, twice over (some are held).
        let chunk = (limit.div_ceil(max_per_key) * 2).clamp(32, SWEEP_CHUNK);
        let mut taken: Vec<(i64, Vec<u8>)> = Vec::new();
        let mut keys_taken = 0usize;
        for wrapped in [false, true] {
            let mut after: Option<Vec<u8>> = (!wrapped).then(|| cursor.to_vec());
            loop {
                if taken.len() >= limit {
                    break;
                }
                let sweep = self.sql.sweep_keys(after.is_some(), wrapped);
                let mut query = sqlx::query(&sweep).bind(now);
                if let Some(after) = &after {
                    query = query.bind(after.as_slice());
                }
                if wrapped {
                    query = query.bind(cursor);
                }
                let keys = query.bind(chunk as i64).fetch_all(&mut **tx).await?;
                let mut free = Vec::new();
                for row in &keys {
                    let key: Vec<u8> = row.try_get(0)?;
                    let head_due: i64 = row.try_get(1)?;
                    let parked: i64 = row.try_get(2)?;
                    if head_due != 0 && parked == 0 {
                        free.push(key.clone());
                    }
                    after = Some(key);
                }
                let mut free = free.as_slice();
                while !free.is_empty() && taken.len() < limit {
                    // Ask for the keys the rows still wanted need at the rows per key seen
                    // so far (`max_per_key` at first): reading 8 rows of 500 keys for a
                    // batch of 500 cost more than the rest of the claim.
                    let per_key = taken
                        .len()
                        .checked_div(keys_taken)
                        .map_or(max_per_key, |n| n.max(1));
                    let n = free.len().min((limit - taken.len()).div_ceil(per_key) + 1);
                    let (group, rest) = free.split_at(n);
                    free = rest;
                    let first_rows = self.sql.first_rows(group.len(), max_per_key);
                    let mut query = sqlx::query(&first_rows);
                    for key in group {
                        query = query.bind(now).bind(key.as_slice());
                    }
                    let mut by_key: HashMap<Vec<u8>, Vec<(i64, bool)>> = HashMap::new();
                    for row in query.fetch_all(&mut **tx).await? {
                        let due: Option<i64> = row.try_get("due")?;
                        let seq: i64 = row.try_get("seq")?;
                        by_key
                            .entry(row.try_get("partition_key")?)
                            .or_default()
                            .push((seq, due.unwrap_or(0) != 0));
                        read.insert(seq, row);
                    }
                    for key in group {
                        let Some(mut rows) = by_key.remove(key) else {
                            continue;
                        };
                        rows.sort_unstable_by_key(|(seq, _)| *seq);
                        keys_taken += 1;
                        for (seq, due) in rows.into_iter().take(max_per_key) {
                            if !due {
                                break;
                            }
                            taken.push((seq, key.clone()));
                        }
                    }
                }
                if keys.len() < chunk {
                    break;
                }
            }
        }
        Ok(taken)
    }

    /// Claims with per-key order: under the claim lock, the sweep, the rows without a key
    /// taking turns with the keyed ones, then the UPDATE that takes them all. The rows the
    /// sweep read (every column) go into `read`.
    async fn claim_ordered(
        &self,
        write: &mut Write,
        limit: usize,
        read: &mut HashMap<i64, MySqlRow>,
    ) -> std::result::Result<(Vec<i64>, Option<Vec<u8>>), sqlx::Error> {
        // Always set: the claim lock returns the clock (the epoch would claim nothing).
        let now = write.now.unwrap_or_default();
        let cursor = self.cursor_of(write).await?;
        let keyed = self.sweep(&mut write.tx, now, limit, &cursor, read).await?;
        let mut unkeyed = Vec::new();
        for row in sqlx::query(&self.sql.unkeyed)
            .bind(now)
            .bind(limit as i64)
            .fetch_all(&mut *write.tx)
            .await?
        {
            let seq: i64 = row.try_get("seq")?;
            unkeyed.push(seq);
            read.insert(seq, row);
        }
        // Turns: the i-th row without a key, then the i-th keyed row. A cut at the limit
        // drops only the last rows of the sweep, never a row ahead of one it keeps.
        let mut picked = Vec::with_capacity(limit);
        let mut last_key = None;
        let mut keyed = keyed.into_iter();
        let mut unkeyed = unkeyed.into_iter();
        while picked.len() < limit {
            let mut any = false;
            if let Some(seq) = unkeyed.next() {
                picked.push(seq);
                any = true;
            }
            if picked.len() < limit
                && let Some((seq, key)) = keyed.next()
            {
                picked.push(seq);
                last_key = Some(key);
                any = true;
            }
            if !any {
                break;
            }
        }
        Ok((picked, last_key))
    }

    /// Where the sweep starts: the key the last ordered claim of any relay ended on, read
    /// under the claim lock (so relays do not sweep over the keys the others just took), or
    /// this storage's own when the table of it is missing.
    async fn cursor_of(&self, write: &mut Write) -> std::result::Result<Vec<u8>, sqlx::Error> {
        use std::sync::atomic::Ordering;
        if !self.no_shared_cursor.load(Ordering::Relaxed) {
            match sqlx::query_scalar::<_, Vec<u8>>(&self.sql.shared_cursor)
                .fetch_optional(&mut *write.tx)
                .await
            {
                Ok(Some(key)) => return Ok(key),
                // MySQL keeps the transaction (and the lock) after a failed statement.
                Ok(None) => {}
                Err(e) if no_such_table(&e) => {
                    tracing::warn!(
                        "mysql: {} is missing (run `outbox migrate`); each relay sweeps keys \
                         from its own cursor",
                        self.table.qualified("_claim_cursor")
                    );
                    self.no_shared_cursor.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(self
            .cursor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone())
    }

    /// Records where the next ordered claim starts, in the claim's transaction.
    async fn move_cursor(
        &self,
        write: &mut Write,
        key: &[u8],
    ) -> std::result::Result<(), sqlx::Error> {
        if !self
            .no_shared_cursor
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            sqlx::query(&self.sql.move_cursor)
                .bind(key)
                .execute(&mut *write.tx)
                .await?;
        }
        Ok(())
    }

    /// Sets the claim's token and lease on the picked rows. `claimed_by` is not written: it
    /// would grow the rows (see `Statements::take`).
    async fn mark(
        &self,
        write: &mut Write,
        picked: &[i64],
        token: &str,
        lease: Duration,
    ) -> std::result::Result<u64, sqlx::Error> {
        if picked.is_empty() {
            return Ok(0);
        }
        let take = self.sql.take(picked.len());
        let mut query = sqlx::query(&take).bind(token).bind(micros(lease));
        for seq in picked {
            query = query.bind(seq);
        }
        Ok(query.execute(&mut *write.tx).await?.rows_affected())
    }

    /// Takes the picked rows under the claim's token; returns them in seq order, as `read`
    /// holds them when the UPDATE took every one (nothing it returns changed since: writes
    /// that change a row's columns take the claim lock, and the claim changes only the
    /// token and the lease), else as read back under the token (a relay whose lease had
    /// run out deleted one meanwhile).
    async fn take(
        &self,
        write: &mut Write,
        picked: &[i64],
        token: &str,
        lease: Duration,
        mut read: HashMap<i64, MySqlRow>,
    ) -> std::result::Result<Vec<MySqlRow>, sqlx::Error> {
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        let took = self.mark(write, picked, token, lease).await?;
        if took == picked.len() as u64 {
            let mut seqs = picked.to_vec();
            seqs.sort_unstable();
            let rows: Option<Vec<MySqlRow>> = seqs.iter().map(|seq| read.remove(seq)).collect();
            if let Some(rows) = rows {
                return Ok(rows);
            }
        }
        let claimed = self.sql.claimed(picked.len());
        let mut query = sqlx::query(&claimed).bind(token);
        for seq in picked {
            query = query.bind(seq);
        }
        query.fetch_all(&mut *write.tx).await
    }
}

#[async_trait]
impl Storage for MySqlStorage {
    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> Result<Claim> {
        let what = "claim failed";
        let token = ClaimToken(Uuid::now_v7());
        let token_text = id_text(&token.0);
        let limit = limit.max(1);
        if self.config.per_key_order {
            let mut write = self.write(what, Some(&self.sql.lock_for_claim)).await?;
            let result = async {
                let mut read = HashMap::new();
                let (picked, last_key) = self.claim_ordered(&mut write, limit, &mut read).await?;
                let rows = self
                    .take(&mut write, &picked, &token_text, lease, read)
                    .await?;
                if let Some(key) = &last_key {
                    self.move_cursor(&mut write, key).await?;
                }
                Ok((rows, last_key))
            }
            .await
            .map_err(|e| self.error(what, e));
            let (rows, last_key) = self.finish(what, write, result).await?;
            if let Some(key) = last_key {
                *self.cursor.lock().unwrap_or_else(|e| e.into_inner()) = key;
            }
            let messages: Vec<_> = rows.iter().map(rows::message).collect::<Result<_>>()?;
            self.remember(&rows, &messages)?;
            claimed(worker_id, &token, &messages);
            Ok(Claim { token, messages })
        } else {
            let mut write = self.write(what, None).await?;
            let result = async {
                let rows = sqlx::query(&self.sql.unordered)
                    .bind(limit as i64)
                    .fetch_all(&mut *write.tx)
                    .await?;
                let picked = rows
                    .iter()
                    .map(|row| row.try_get::<i64, _>("seq"))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                self.mark(&mut write, &picked, &token_text, lease).await?;
                Ok(rows)
            }
            .await
            .map_err(|e| self.error(what, e));
            let rows = self.finish(what, write, result).await?;
            let messages: Vec<_> = rows.iter().map(rows::message).collect::<Result<_>>()?;
            self.remember(&rows, &messages)?;
            claimed(worker_id, &token, &messages);
            Ok(Claim { token, messages })
        }
    }

    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        if settlement.is_empty() {
            return Ok(0);
        }
        let what = "settling a batch failed";
        let seqs = self.forget(settlement);
        let seqs = seqs.as_deref();
        if self.one_statement(settlement) {
            // Nothing to make atomic: the statement commits on its own, which saves the
            // BEGIN and COMMIT round trips of most batches.
            let mut conn = self.pool.acquire().await.map_err(|e| self.error(what, e))?;
            return self
                .settle_in(&mut conn, token, settlement, seqs)
                .await
                .map_err(|e| self.error(what, e));
        }
        let lock = if settlement.holds_back() {
            self.holding_back()
        } else {
            None
        };
        let mut write = self.write(what, lock).await?;
        let result = self
            .settle_in(&mut write.tx, token, settlement, seqs)
            .await
            .map_err(|e| self.error(what, e));
        self.finish(what, write, result).await
    }

    async fn extend_lease(&self, token: &ClaimToken, ids: &[Uuid], lease: Duration) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let what = "renewing a lease failed";
        let mut write = self.write(what, self.holding_back()).await?;
        let sql = self.sql.extend_lease(ids.len());
        let mut query = sqlx::query(&sql)
            .bind(micros(lease))
            .bind(id_text(&token.0));
        for id in ids {
            query = query.bind(id_text(id));
        }
        let done = query
            .execute(&mut *write.tx)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| self.error(what, e));
        self.finish(what, write, done).await
    }

    async fn health(&self) -> Result<()> {
        sqlx::query(sql::PING)
            .execute(&self.pool)
            .await
            .map_err(|e| self.error("health check failed", e))?;
        Ok(())
    }

    async fn stats(&self) -> Result<QueueStats> {
        let row = sqlx::query(&self.sql.stats)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.error("cannot read queue figures", e))?;
        rows::queue_stats(&row)
    }

    async fn shared_stats(&self, max_age: Duration) -> Result<QueueStats> {
        let fail = |e| self.error("cannot read queue figures", e);
        let turn = sqlx::query(&self.sql.stats_turn)
            .bind(micros(max_age))
            .execute(&self.pool)
            .await;
        let ours = match turn {
            Ok(done) => done.rows_affected() > 0,
            // Migrated by an older release (a DBA applies the new step later): count here.
            Err(e) if older_schema(&e) => return self.stats().await,
            Err(e) => return Err(fail(e)),
        };
        if !ours {
            let row = match sqlx::query(&self.sql.stats_read)
                .fetch_one(&self.pool)
                .await
            {
                Ok(row) => row,
                Err(e) if older_schema(&e) => return self.stats().await,
                Err(e) => return Err(fail(e)),
            };
            let measured_at: Option<NaiveDateTime> = row.try_get(5).map_err(fail)?;
            if let Some(at) = measured_at {
                return Ok(QueueStats {
                    measured_at: Some(rows::utc(at)),
                    ..rows::queue_stats(&row)?
                });
            }
            // The first count has not finished yet.
            return self.stats().await;
        }
        let row = sqlx::query(&self.sql.stats)
            .fetch_one(&self.pool)
            .await
            .map_err(fail)?;
        let stats = rows::queue_stats(&row)?;
        let measured_at: NaiveDateTime = row.try_get(5).map_err(fail)?;
        let stored = sqlx::query(&self.sql.stats_store)
            .bind(measured_at)
            .bind(stats.pending as i64)
            .bind(stats.oldest_pending.map(|t| t.naive_utc()))
            .bind(stats.in_flight as i64)
            .bind(stats.dead_lettered as i64)
            .bind(stats.parked_keys as i64)
            .bind(stats.retrying as i64)
            .execute(&self.pool)
            .await;
        match stored {
            Ok(_) => {}
            // Without the `retrying` column (an older release's schema): figures just counted.
            Err(e) if older_schema(&e) => return Ok(stats),
            Err(e) => return Err(self.error("cannot store queue figures", e)),
        }
        Ok(QueueStats {
            measured_at: Some(rows::utc(measured_at)),
            ..stats
        })
    }

    fn capabilities(&self) -> StorageCapabilities {
        StorageCapabilities::keyed(self.config.per_key_order, self.config.max_per_key)
    }

    // `wait_for_work` keeps the default: MySQL has no LISTEN/NOTIFY, so the worker polls
    // every `poll_interval`.

    async fn maintain(&self) -> Result<()> {
        let Some(retention) = self.config.retention else {
            return Ok(());
        };
        let what = "cannot purge delivered rows";
        let now: NaiveDateTime = sqlx::query_scalar(sql::NOW)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.error(what, e))?;
        let cutoff = now
            .checked_sub_signed(
                chrono::Duration::from_std(retention.min(MAX_DELAY))
                    .unwrap_or(chrono::Duration::zero()),
            )
            .unwrap_or(NaiveDateTime::MIN);
        let done = sqlx::query(&self.sql.purge_delivered)
            .bind(cutoff)
            .execute(&self.pool)
            .await
            .map_err(|e| self.error(what, e))?;
        if done.rows_affected() > 0 {
            tracing::debug!(
                rows = done.rows_affected(),
                "purged delivered rows past retention"
            );
        }
        Ok(())
    }
}

impl MySqlStorage {
    /// Whether `settlement` is one statement: only deliveries (deleted, no retention) or
    /// only releases.
    fn one_statement(&self, s: &Settlement) -> bool {
        s.retries.is_empty()
            && s.dead.is_empty()
            && (s.delivered.is_empty()
                || (s.released.is_empty() && self.sql.delivered_keep.is_none()))
    }

    /// The statements of a settlement, on `tx` (its transaction, or a plain connection when
    /// it is [one statement](Self::one_statement)): dead letters (keys parked, copied,
    /// deleted), retries, deliveries (kept with retention, deleted) and releases, each only
    /// for rows still held under the token. `delivered_seqs`, when known, are the seqs of
    /// `s.delivered`, which are then deleted by primary key.
    async fn settle_in(
        &self,
        tx: &mut MySqlConnection,
        token: &ClaimToken,
        s: &Settlement,
        delivered_seqs: Option<&[i64]>,
    ) -> std::result::Result<u64, sqlx::Error> {
        let token = id_text(&token.0);
        let mut changed = 0;
        let dead = first_of_each(&s.dead, |d| d.id);
        if !dead.is_empty() {
            if self.config.per_key_order {
                let park = self.sql.dead_park(dead.len());
                let mut query = sqlx::query(&park).bind(token.as_str());
                for d in &dead {
                    query = query.bind(id_text(&d.id));
                }
                query.execute(&mut *tx).await?;
            }
            for d in &dead {
                sqlx::query(&self.sql.dead_copy)
                    .bind(d.error.as_str())
                    .bind(id_text(&d.id))
                    .bind(token.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
            let delete = self.sql.delete_held(dead.len());
            let mut query = sqlx::query(&delete).bind(token.as_str());
            for d in &dead {
                query = query.bind(id_text(&d.id));
            }
            changed += query.execute(&mut *tx).await?.rows_affected();
        }
        for retry in first_of_each(&s.retries, |r| r.id) {
            changed += sqlx::query(&self.sql.retry)
                .bind(retry.error.as_str())
                .bind(micros(retry.delay))
                .bind(id_text(&retry.id))
                .bind(token.as_str())
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        let delivered = first_of_each(&s.delivered, |d| d.id);
        if !delivered.is_empty() {
            if let Some(keep) = &self.sql.delivered_keep {
                for d in &delivered {
                    sqlx::query(keep)
                        .bind(d.receipt.0.as_str())
                        .bind(id_text(&d.id))
                        .bind(token.as_str())
                        .execute(&mut *tx)
                        .await?;
                }
            }
            changed += match delivered_seqs {
                Some(seqs) if seqs.len() == delivered.len() => {
                    let delete = self.sql.delete_held_seqs(seqs.len());
                    let mut query = sqlx::query(&delete).bind(token.as_str());
                    for seq in seqs {
                        query = query.bind(seq);
                    }
                    query.execute(&mut *tx).await?.rows_affected()
                }
                _ => {
                    let delete = self.sql.delete_held(delivered.len());
                    let mut query = sqlx::query(&delete).bind(token.as_str());
                    for d in &delivered {
                        query = query.bind(id_text(&d.id));
                    }
                    query.execute(&mut *tx).await?.rows_affected()
                }
            };
        }
        let released = first_of_each(&s.released, |id| *id);
        if !released.is_empty() {
            let release = self.sql.release(released.len());
            let mut query = sqlx::query(&release).bind(token.as_str());
            for id in &released {
                query = query.bind(id_text(id));
            }
            changed += query.execute(&mut *tx).await?.rows_affected();
        }
        Ok(changed)
    }
}

/// Logs which worker holds a claim: `claimed_by` is not written (see `Statements::take`).
fn claimed(worker_id: &str, token: &ClaimToken, messages: &[outbox_core::Message]) {
    if !messages.is_empty() {
        tracing::debug!(worker = worker_id, token = %token.0, messages = messages.len(), "mysql: claimed");
    }
}

/// Whether `error` says a table does not exist (ER_NO_SUCH_TABLE).
fn no_such_table(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("42S02"))
}

/// The shared figures' table is missing, or lacks a column a later migration adds (SQLSTATE
/// 42S02, no such table; 42S22, unknown column): the schema is an older release's, which
/// relays accept until a DBA applies the new steps.
fn older_schema(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if outbox_sql::missing_table_or_column(db.code().as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_saturate() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::MAX), MAX_DELAY.as_micros() as i64);
    }
}
