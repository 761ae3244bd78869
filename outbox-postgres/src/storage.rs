//! [`PgStorage`]: its lifecycle (connection pool, migrations) and the relay side, the
//! [`Storage`] implementation: claims under fenced leases, settlements, queue figures and
//! housekeeping. The operator's repairs are in `admin.rs`, the wake-up in `wakeup.rs`.

use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Claim, ClaimToken, QueueStats, Result, Settlement, Storage, StorageCapabilities,
};
use sqlx::Row;
use sqlx::postgres::PgPool;
use uuid::Uuid;

use crate::error::db_error;
use crate::log::LogEngine;
use crate::sql::{self, Statements};
use crate::wakeup::Wakeup;
use crate::{LogStart, OutboxTable, PostgresConfig, StorageMode, connection, rows};

/// The PostgreSQL [`Storage`]: claims with `FOR UPDATE` under leases on the database clock,
/// fences every later write with the claim's token, keeps per-key order, and wakes the
/// relay with LISTEN/NOTIFY.
pub struct PgStorage {
    config: PostgresConfig,
    table: OutboxTable,
    pool: PgPool,
    /// Log mode: the pool of `replica_url`, which the rows and the horizon are read from.
    replica: Option<PgPool>,
    /// Also used by the operator's repairs (`admin.rs`).
    pub(crate) sql: Statements,
    wakeup: Wakeup,
    /// The partition key after which the next ordered claim starts its sweep.
    cursor: std::sync::Mutex<String>,
    /// Log mode's shards and what this relay has read of them (`None` in lease mode).
    pub(crate) log: Option<LogEngine>,
    /// Whether the table was found migrated for the configured mode.
    mode_checked: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for PgStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStorage")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PgStorage {
    /// A storage for `config`. Validates the configuration; connects lazily, so a database
    /// that is down shows up as an `Unavailable` error from the first call, not here.
    pub fn new(config: PostgresConfig) -> Result<Self> {
        config.validate()?;
        let pool = connection::pool(&config)?;
        let replica = connection::replica_pool(&config)?;
        let table = OutboxTable::new(&config.schema, &config.table)?;
        let sql = Statements::new(&table, &config);
        let wakeup = Wakeup::new(
            config.wakeup,
            config.wakeup_with_prepared_transactions,
            &table,
        );
        let log = (config.mode == StorageMode::Log)
            .then(|| LogEngine::new(&table, config.start == LogStart::Now));
        Ok(PgStorage {
            config,
            table,
            pool,
            replica,
            sql,
            wakeup,
            cursor: std::sync::Mutex::new(String::new()),
            log,
            mode_checked: std::sync::atomic::AtomicBool::new(false),
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
        sqlx::query(sql::DURABLE_COMMITS)
            .execute(&mut *conn)
            .await
            .map_err(|e| db_error("migration failed", e))?;
        let result = match self.config.mode {
            StorageMode::Lease => self.table.migrate(&mut conn).await,
            StorageMode::Log => self.table.migrate_log(&mut conn, self.config.shards).await,
        };
        if result.is_ok() {
            self.mode_checked
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let _ = sqlx::query(sql::FAST_COMMITS).execute(&mut *conn).await;
        result
    }

    /// The SQL [`migrate`](Self::migrate) would run now, without running it (see
    /// [`OutboxTable::migration_sql`]).
    pub async fn migration_sql(&self) -> Result<String> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| db_error("cannot connect", e))?;
        self.table
            .migration_sql(&mut conn, self.config.mode, self.config.shards)
            .await
    }

    /// Refuses, once, a table migrated for the other mode (a `Config` error naming
    /// `mode`). A table that does not exist yet is left to the statements' own errors.
    async fn check_mode(&self) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.mode_checked.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| db_error("cannot connect", e))?;
        self.table
            .refuse_other_mode(&mut conn, self.config.mode)
            .await?;
        if self.table.mode(&mut conn).await?.is_some() {
            self.mode_checked.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Log mode: gives every shard this relay owns up at once, so other relays take them
    /// without waiting for the lease to run out (call it when a relay stops; the worker
    /// does through [`Storage::stop`]). A no-op in lease mode.
    pub async fn give_up_shards(&self) -> Result<()> {
        match &self.log {
            Some(log) => log.give_up(&self.pool).await,
            None => Ok(()),
        }
    }

    /// Log mode: how far the readable horizon trails the log: committed rows waiting for an
    /// older transaction of the database to end, and which transaction that is (its backend
    /// and age, or a prepared transaction). `None` in lease mode.
    pub async fn horizon_lag(&self) -> Result<Option<crate::HorizonLag>> {
        match &self.log {
            Some(log) => log
                .horizon_lag(&self.pool, self.replica.as_ref())
                .await
                .map(Some),
            None => Ok(None),
        }
    }

    /// Log mode: the pool of `replica_url`, if one is set (its sessions read only).
    pub fn replica_pool(&self) -> Option<&PgPool> {
        self.replica.as_ref()
    }

    /// Log mode: how many of `key`'s messages wait behind it: held aside (a parked or
    /// draining key) and past the stored cursor of its shard. `None` in lease mode.
    pub async fn log_waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        match &self.log {
            Some(log) => log.waiting_behind(&self.pool, key).await.map(Some),
            None => Ok(None),
        }
    }

    /// Log mode: the shards this relay owns, with their fencing epochs (empty in lease mode).
    pub async fn owned_shards(&self) -> Vec<(i32, i64)> {
        match &self.log {
            Some(log) => log.owned().await,
            None => Vec::new(),
        }
    }

    /// Log mode: this relay's name in the shards table (`None` in lease mode).
    pub fn relay_name(&self) -> Option<&str> {
        self.log.as_ref().map(|l| l.owner())
    }

    /// Tests only: log mode's read buffer per shard holds at least `rows` (default 256),
    /// so that small queues fill it.
    #[doc(hidden)]
    pub fn set_log_buffer_min(&self, rows: usize) {
        if let Some(log) = &self.log {
            log.set_buffer_min(rows);
        }
    }

    /// Tests only: moves log mode's in-memory clock (leases, retry delays) ahead.
    #[doc(hidden)]
    pub fn advance_clock(&self, by: Duration) {
        if let Some(log) = &self.log {
            log.advance(by);
        }
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
}

/// A duration as the milliseconds the statements take, saturating.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[async_trait]
impl Storage for PgStorage {
    async fn horizon(&self) -> Result<Option<outbox_core::HorizonLag>> {
        Ok(self
            .horizon_lag()
            .await?
            .map(|lag| outbox_core::HorizonLag {
                waiting: lag.waiting_rows,
                held_by: lag.held_by(),
                held_for: lag.blocker_age,
            }))
    }

    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> Result<Claim> {
        self.check_mode().await?;
        if let Some(log) = &self.log {
            let claim = log
                .claim(
                    &self.pool,
                    self.replica.as_ref(),
                    &self.config,
                    limit,
                    lease,
                )
                .await?;
            self.wakeup
                .claimed(&self.pool, !claim.messages.is_empty())
                .await?;
            return Ok(claim);
        }
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
            sqlx::query(sql::CLAIM_LOCK)
                .bind(self.table.lock_key())
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            let rows = query.fetch_all(&mut *tx).await.map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            rows
        } else {
            query.fetch_all(&self.pool).await.map_err(fail)?
        };
        let (messages, cursor) = rows::claimed(&rows)?;
        if let Some(cursor) = cursor {
            *self.cursor.lock().unwrap_or_else(|e| e.into_inner()) = cursor;
        }
        self.wakeup
            .claimed(&self.pool, !messages.is_empty())
            .await?;
        Ok(Claim { token, messages })
    }

    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        if settlement.is_empty() {
            return Ok(0);
        }
        if let Some(log) = &self.log {
            return log
                .settle(&self.pool, &self.config, token, settlement)
                .await;
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
        if let Some(log) = &self.log {
            return log.extend_lease(&self.pool, token, ids, lease).await;
        }
        let query = sqlx::query(&self.sql.extend_lease)
            .bind(ids.to_vec())
            .bind(token.0)
            .bind(millis(lease));
        self.count("renewing a lease failed", query).await
    }

    async fn health(&self) -> Result<()> {
        sqlx::query(sql::PING)
            .execute(&self.pool)
            .await
            .map_err(|e| db_error("health check failed", e))?;
        Ok(())
    }

    async fn stats(&self) -> Result<QueueStats> {
        if let Some(log) = &self.log {
            return log.stats(&self.pool).await;
        }
        let row = sqlx::query(&self.sql.stats)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_error("cannot read queue figures", e))?;
        rows::queue_stats(&row)
    }

    async fn shared_stats(&self, max_age: Duration) -> Result<QueueStats> {
        let turn = sqlx::query(&self.sql.stats_turn)
            .bind(millis(max_age))
            .execute(&self.pool)
            .await;
        let ours = match turn {
            Ok(done) => done.rows_affected() > 0,
            // Migrated by an older release (a DBA applies the new step later): count here.
            Err(e) if older_schema(&e) => return self.stats().await,
            Err(e) => return Err(db_error("cannot read queue figures", e)),
        };
        if !ours {
            let row = match sqlx::query(&self.sql.stats_read)
                .fetch_one(&self.pool)
                .await
            {
                Ok(row) => row,
                Err(e) if older_schema(&e) => return self.stats().await,
                Err(e) => return Err(db_error("cannot read queue figures", e)),
            };
            let measured_at: Option<chrono::DateTime<chrono::Utc>> = row
                .try_get(6)
                .map_err(|e| db_error("cannot read queue figures", e))?;
            if measured_at.is_some() {
                return Ok(QueueStats {
                    measured_at,
                    ..rows::queue_stats(&row)?
                });
            }
            // The first count has not finished yet.
            return self.stats().await;
        }
        let stats = self.stats().await?;
        let stored = sqlx::query(&self.sql.stats_store)
            .bind(stats.pending as i64)
            .bind(stats.oldest_pending)
            .bind(stats.in_flight as i64)
            .bind(stats.dead_lettered as i64)
            .bind(stats.parked_keys as i64)
            .bind(stats.retrying as i64)
            .fetch_one(&self.pool)
            .await
            .and_then(|row| row.try_get(0));
        let measured_at: chrono::DateTime<chrono::Utc> = match stored {
            Ok(at) => at,
            // Without the `retrying` column (an older release's schema): figures just counted.
            Err(e) if older_schema(&e) => return Ok(stats),
            Err(e) => return Err(db_error("cannot store queue figures", e)),
        };
        Ok(QueueStats {
            measured_at: Some(measured_at),
            ..stats
        })
    }

    fn capabilities(&self) -> StorageCapabilities {
        let per_key_order = self.config.per_key_order;
        StorageCapabilities::new(per_key_order)
            .with_max_per_key(per_key_order.then_some(self.config.max_per_key))
            .with_waits_for_older_transactions(self.log.is_some())
    }

    async fn stop(&self) -> Result<()> {
        self.give_up_shards().await
    }

    async fn wait_for_work(&self) -> Result<()> {
        self.wakeup.wait(&self.pool).await
    }

    async fn maintain(&self) -> Result<()> {
        if let Some(log) = &self.log {
            return log.maintain(&self.pool, self.config.retention).await;
        }
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

/// The shared figures' table is missing, or lacks a column a later migration adds (SQLSTATE
/// 42P01, undefined table; 42703, undefined column): the schema is an older release's,
/// which relays accept until a DBA applies the new steps.
fn older_schema(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if matches!(db.code().as_deref(), Some("42P01" | "42703")))
}
