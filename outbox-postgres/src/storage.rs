//! [`PgStorage`]: its lifecycle (connection pool, migrations) and the relay side, the
//! [`Storage`] implementation. What the two modes share (pool, table, configuration, the
//! shared queue figures, the wake-up) is here; what each does its own way is a [`Mode`]:
//! lease mode in `lease.rs`, log mode in `log/`. The operator's repairs are in `admin.rs`,
//! the wake-up in `wakeup.rs`.

use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Claim, ClaimToken, HorizonLag, QueueStats, Result, Settlement, Storage, StorageCapabilities,
    TopicStats,
};
use outbox_sql::saturating_millis;
use sqlx::Row;
use sqlx::postgres::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::db_error;
use crate::lease::LeaseEngine;
use crate::log::LogEngine;
use crate::sql::{self, Statements};
use crate::wakeup::Wakeup;
use crate::{LogStart, OutboxTable, PostgresConfig, StorageMode, connection, rows};
use outbox_core::config::Settings;

/// The PostgreSQL [`Storage`], in one of two modes ([`StorageMode`]): lease mode claims with
/// `FOR UPDATE` under leases on the database clock, fences every later write with the
/// claim's token and keeps per-key order; log mode reads an append-only log past per-shard
/// cursors (docs/storage/postgres.md). Both wake the relay with LISTEN/NOTIFY.
pub struct PgStorage {
    /// What both modes use.
    pub(crate) shared: Shared,
    wakeup: Wakeup,
    engine: Engine,
    /// Whether the table was found migrated for the configured mode.
    mode_checked: std::sync::atomic::AtomicBool,
}

/// What both modes use: the configuration, the table, the relay's pool and the statements
/// the two share (dead letters, parked keys, the shared queue figures).
pub(crate) struct Shared {
    pub(crate) config: PostgresConfig,
    pub(crate) table: OutboxTable,
    pub(crate) pool: PgPool,
    /// Built for both modes; lease mode's own statements among them are used by `lease.rs`
    /// only.
    pub(crate) sql: Statements,
}

/// A statement with its parameters bound.
pub(crate) type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

impl Shared {
    /// Runs `query` on the pool, a statement whose one row is a count (of rows settled,
    /// replayed, waiting, ...); `what` failed if it fails.
    pub(crate) async fn count(&self, what: &str, query: PgQuery<'_>) -> Result<u64> {
        let row = query
            .fetch_one(&self.pool)
            .await
            .map_err(|e| db_error(what, e))?;
        let n: i64 = row.try_get(0).map_err(|e| db_error(what, e))?;
        Ok(n.max(0) as u64)
    }

    /// Runs `query` on the pool and returns how many rows it changed; `what` failed if it
    /// fails.
    pub(crate) async fn execute(&self, what: &str, query: PgQuery<'_>) -> Result<u64> {
        let done = query
            .execute(&self.pool)
            .await
            .map_err(|e| db_error(what, e))?;
        Ok(done.rows_affected())
    }
}

/// The mode's engine.
enum Engine {
    Lease(LeaseEngine),
    /// Log mode's shards and what this relay has read of them (boxed: it is large).
    Log(Box<LogEngine>),
}

/// What each mode does its own way. Every method gets what both share.
#[async_trait]
pub(crate) trait Mode: Send + Sync {
    /// Creates or upgrades the mode's tables in `conn`.
    async fn migrate(&self, s: &Shared, conn: &mut PgConnection) -> Result<()>;
    /// [`Storage::claim`].
    async fn claim(
        &self,
        s: &Shared,
        worker_id: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Claim>;
    /// [`Storage::settle`] of a settlement that is not empty.
    async fn settle(&self, s: &Shared, token: &ClaimToken, settlement: &Settlement) -> Result<u64>;
    /// [`Storage::extend_lease`].
    async fn extend_lease(
        &self,
        s: &Shared,
        token: &ClaimToken,
        ids: &[Uuid],
        lease: Duration,
    ) -> Result<u64>;
    /// [`Storage::stats`], counted now.
    async fn stats(&self, s: &Shared) -> Result<QueueStats>;
    /// [`outbox_core::StorageAdmin::topic_stats`].
    async fn topic_stats(&self, s: &Shared) -> Result<Vec<TopicStats>>;
    /// [`Storage::maintain`].
    async fn maintain(&self, s: &Shared) -> Result<()>;
    /// [`outbox_core::StorageAdmin::replay_dead_letters`].
    async fn replay(&self, s: &Shared, ids: &[Uuid]) -> Result<u64>;
    /// [`outbox_core::StorageAdmin::release_parked_key`].
    async fn release(&self, s: &Shared, key: &str) -> Result<bool>;
    /// [`outbox_core::StorageAdmin::waiting_behind`].
    async fn waiting_behind(&self, s: &Shared, key: &str) -> Result<u64>;
    /// [`Storage::horizon`]: `None` for a mode that does not wait for older transactions.
    async fn horizon(&self, _s: &Shared) -> Result<Option<HorizonLag>> {
        Ok(None)
    }
    /// [`Storage::stop`].
    async fn stop(&self, _s: &Shared) -> Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for PgStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStorage")
            .field("config", &self.shared.config)
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
        let engine = match config.mode {
            StorageMode::Lease => Engine::Lease(LeaseEngine::new()),
            StorageMode::Log => Engine::Log(Box::new(LogEngine::new(
                &table,
                config.start == LogStart::Now,
                replica,
            ))),
        };
        Ok(PgStorage {
            shared: Shared {
                config,
                table,
                pool,
                sql,
            },
            wakeup,
            engine,
            mode_checked: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The engine of the configured mode.
    pub(crate) fn mode(&self) -> &dyn Mode {
        match &self.engine {
            Engine::Lease(lease) => lease,
            Engine::Log(log) => &**log,
        }
    }

    /// Log mode's engine (`None` in lease mode), for what only log mode has.
    fn log(&self) -> Option<&LogEngine> {
        match &self.engine {
            Engine::Log(log) => Some(&**log),
            Engine::Lease(_) => None,
        }
    }

    /// The outbox table this storage relays from.
    pub fn table(&self) -> &OutboxTable {
        &self.shared.table
    }

    /// The relay's connection pool (its sessions run with `synchronous_commit = off`: do not
    /// enqueue through it).
    pub fn pool(&self) -> &PgPool {
        &self.shared.pool
    }

    /// The configuration.
    pub fn config(&self) -> &PostgresConfig {
        &self.shared.config
    }

    /// Creates or upgrades the outbox tables.
    pub async fn migrate(&self) -> Result<()> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(|e| db_error("cannot connect", e))?;
        sqlx::query(sql::DURABLE_COMMITS)
            .execute(&mut *conn)
            .await
            .map_err(|e| db_error("migration failed", e))?;
        let result = self.mode().migrate(&self.shared, &mut conn).await;
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
            .pool()
            .acquire()
            .await
            .map_err(|e| db_error("cannot connect", e))?;
        let config = self.config();
        self.table()
            .migration_sql(&mut conn, config.mode, config.shards)
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
            .pool()
            .acquire()
            .await
            .map_err(|e| db_error("cannot connect", e))?;
        self.table()
            .refuse_other_mode(&mut conn, self.config().mode)
            .await?;
        if self.table().mode(&mut conn).await?.is_some() {
            self.mode_checked.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Log mode: the pool of `replica_url`, if one is set (its sessions read only).
    pub fn replica_pool(&self) -> Option<&PgPool> {
        self.log().and_then(|log| log.replica())
    }

    /// Log mode: how many of `key`'s messages wait behind it: held aside (a parked or
    /// draining key) and past the stored cursor of its shard. `None` in lease mode.
    pub async fn log_waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        match self.log() {
            Some(log) => log.waiting_behind(self.pool(), key).await.map(Some),
            None => Ok(None),
        }
    }

    /// Log mode: the shards this relay owns, with their fencing epochs (empty in lease mode).
    pub async fn owned_shards(&self) -> Vec<(i32, i64)> {
        match self.log() {
            Some(log) => log.owned().await,
            None => Vec::new(),
        }
    }

    /// Log mode: this relay's name in the shards table (`None` in lease mode).
    pub fn relay_name(&self) -> Option<&str> {
        self.log().map(|l| l.owner())
    }

    /// Tests only: log mode's read buffer per shard holds at least `rows` (default 256),
    /// so that small queues fill it.
    #[doc(hidden)]
    pub fn set_log_buffer_min(&self, rows: usize) {
        if let Some(log) = self.log() {
            log.set_buffer_min(rows);
        }
    }

    /// Tests only: moves log mode's in-memory clock (leases, retry delays) ahead.
    #[doc(hidden)]
    pub fn advance_clock(&self, by: Duration) {
        if let Some(log) = self.log() {
            log.advance(by);
        }
    }
}

#[async_trait]
impl Storage for PgStorage {
    async fn horizon(&self) -> Result<Option<HorizonLag>> {
        self.mode().horizon(&self.shared).await
    }

    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> Result<Claim> {
        self.check_mode().await?;
        let claim = self
            .mode()
            .claim(&self.shared, worker_id, limit, lease)
            .await?;
        self.wakeup
            .claimed(self.pool(), !claim.messages.is_empty())
            .await?;
        Ok(claim)
    }

    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        if settlement.is_empty() {
            return Ok(0);
        }
        self.mode().settle(&self.shared, token, settlement).await
    }

    async fn extend_lease(&self, token: &ClaimToken, ids: &[Uuid], lease: Duration) -> Result<u64> {
        self.mode()
            .extend_lease(&self.shared, token, ids, lease)
            .await
    }

    async fn health(&self) -> Result<()> {
        sqlx::query(sql::PING)
            .execute(self.pool())
            .await
            .map_err(|e| db_error("health check failed", e))?;
        Ok(())
    }

    async fn stats(&self) -> Result<QueueStats> {
        self.mode().stats(&self.shared).await
    }

    async fn shared_stats(&self, max_age: Duration) -> Result<QueueStats> {
        let sql = &self.shared.sql;
        let pool = self.pool();
        let turn = sqlx::query(&sql.stats_turn)
            .bind(saturating_millis(max_age))
            .execute(pool)
            .await;
        let ours = match turn {
            Ok(done) => done.rows_affected() > 0,
            // Migrated by an older release (a DBA applies the new step later): count here.
            Err(e) if older_schema(&e) => return self.stats().await,
            Err(e) => return Err(db_error("cannot read queue figures", e)),
        };
        if !ours {
            let row = match sqlx::query(&sql.stats_read).fetch_one(pool).await {
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
        let stored = sqlx::query(&sql.stats_store)
            .bind(stats.pending as i64)
            .bind(stats.oldest_pending)
            .bind(stats.in_flight as i64)
            .bind(stats.dead_lettered as i64)
            .bind(stats.parked_keys as i64)
            .bind(stats.retrying as i64)
            .fetch_one(pool)
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
        let config = self.config();
        StorageCapabilities::keyed(config.per_key_order, config.max_per_key)
            .with_waits_for_older_transactions(config.mode == StorageMode::Log)
    }

    /// Log mode gives every shard this relay owns up at once, so other relays take them
    /// without waiting for the lease to run out; a no-op in lease mode.
    async fn stop(&self) -> Result<()> {
        self.mode().stop(&self.shared).await
    }

    async fn wait_for_work(&self) -> Result<()> {
        self.wakeup.wait(self.pool()).await
    }

    async fn maintain(&self) -> Result<()> {
        self.mode().maintain(&self.shared).await
    }
}

/// The shared figures' table is missing, or lacks a column a later migration adds (SQLSTATE
/// 42P01, undefined table; 42703, undefined column): the schema is an older release's,
/// which relays accept until a DBA applies the new steps.
fn older_schema(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if outbox_sql::missing_table_or_column(db.code().as_deref()))
}
