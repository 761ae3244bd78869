//! Log mode (`[storage] mode = "log"`): the outbox is an append-only log that relays only
//! read. Each row belongs to one of S shards; a relay owns some shards (a lease on the
//! database clock, fenced by an epoch bumped at every change of owner) and reads each past
//! its cursor `(xid, seq)`, only rows whose transaction id is below the oldest transaction
//! of the database still running ([`HORIZON`](sql::HORIZON)), in `(xid, seq)` order. What
//! it has read but not settled is kept here, in memory: in flight under a claim token,
//! waiting to retry, or ready. The stored cursor moves to just before the oldest row not
//! settled. A parked key's rows move to `<table>_held`, and dead letters to
//! `<table>_dead_letters`: both leave the log, so the cursor can pass them and no later
//! reader of the shard (after a restart or a hand-over) sees them again as new. See
//! docs/ARCHITECTURE.md (log mode) for why the horizon rule loses nothing.
//!
//! The engine is split by what it does: `memory.rs` holds what this relay has read (the
//! pure rules: which rows a claim hands out, where cursors stand), `sql.rs` the
//! statements, `ownership.rs` the shards' leases and fencing, `parking.rs` parked keys and
//! held rows, `read.rs` reading the log, `settle.rs` settlements, `stats.rs` queue figures
//! and the horizon.

mod memory;
mod ownership;
mod parking;
mod read;
mod settle;
mod sql;
mod stats;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Claim, ClaimToken, Error, HorizonLag, QueueStats, Result, Settlement, TopicStats,
};
use outbox_sql::saturating_millis;
use sqlx::postgres::{PgConnection, PgPool};
use tokio::time::Instant;
use uuid::Uuid;

use self::memory::{Inner, Pos, State, pick};
use self::read::read_rows;
use self::sql::LogSql;
use crate::error::db_error;
use crate::storage::{Mode, Shared};
use crate::{OutboxTable, PostgresConfig};

/// How often a claiming relay renews its shards, counts the relays and rebalances (more
/// often with a lease under 3 s: three times per lease). A round holds the shards for the
/// lease plus this interval, so every claim made before the next round ends (its lease
/// counted from the claim) before its shards' lease does; renewing a claim (`extend_lease`)
/// renews its shards. Four times a second, so that relays joining or leaving see their
/// shares within a quarter of a second (a round is one short transaction).
const ROUND_EVERY: Duration = Duration::from_millis(250);

/// A relay handing a shard over gives it up at its first claim after the shard has nothing
/// out, at most this often, rather than at its next round.
const HAND_OVER_EVERY: Duration = Duration::from_millis(20);

/// The most rows a relay keeps read but unsettled per shard: this many claims' limits, and
/// at least [`BUFFER_MIN`]. Rows behind a shard's full buffer wait unread.
const BUFFER_CLAIMS: usize = 4;

const BUFFER_MIN: usize = 256;

/// The most delivered rows one cleanup statement deletes (split over the owned shards), so
/// that each is a short transaction.
const CLEANUP_CHUNK: usize = 2_000;

/// The log-mode engine of one [`crate::PgStorage`]: one relay's shards and what it has read.
pub(crate) struct LogEngine {
    /// This relay's name in the shards table: unique per storage instance.
    owner: String,
    sql: LogSql,
    /// The pool of `replica_url`, which the rows and the horizon are read from.
    replica: Option<PgPool>,
    /// `start = "now"`: a shard never owned before starts at the horizon.
    start_now: bool,
    inner: tokio::sync::Mutex<Inner>,
    /// Held by every write to the shards table, taken after `inner` when both are: a
    /// settlement of deliveries moves its cursors without holding `inner` (so the worker's
    /// next claim goes on meanwhile), and this relay's writes still never overlap: no
    /// lock-order deadlock between its own statements, and no give-up passes a cursor write.
    writes: tokio::sync::Mutex<()>,
    /// Added to the clock of in-memory times (leases, retry delays): for tests only.
    offset: std::sync::Mutex<Duration>,
    /// [`BUFFER_MIN`], lowered by tests so that small queues fill a buffer.
    buffer_min: std::sync::atomic::AtomicUsize,
}

impl LogEngine {
    /// The engine of `table`; `replica`: the pool of `replica_url`.
    pub(crate) fn new(table: &OutboxTable, start_now: bool, replica: Option<PgPool>) -> Self {
        LogEngine {
            owner: format!("relay-{}", Uuid::now_v7()),
            sql: LogSql::new(table),
            replica,
            start_now,
            inner: tokio::sync::Mutex::new(Inner::default()),
            writes: tokio::sync::Mutex::new(()),
            offset: std::sync::Mutex::new(Duration::ZERO),
            buffer_min: std::sync::atomic::AtomicUsize::new(BUFFER_MIN),
        }
    }

    /// This relay's name in the shards table.
    pub(crate) fn owner(&self) -> &str {
        &self.owner
    }

    /// The pool of `replica_url`, if one is set.
    pub(crate) fn replica(&self) -> Option<&PgPool> {
        self.replica.as_ref()
    }

    fn now(&self) -> Instant {
        Instant::now() + *self.offset.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most rows a shard keeps read but unsettled, for claims of `limit`.
    fn buffer_cap(&self, limit: usize) -> usize {
        let min = self.buffer_min.load(std::sync::atomic::Ordering::Relaxed);
        limit.saturating_mul(BUFFER_CLAIMS).max(min)
    }

    /// Tests only: a smaller [`BUFFER_MIN`].
    pub(crate) fn set_buffer_min(&self, rows: usize) {
        self.buffer_min
            .store(rows.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Moves the in-memory clock ahead (tests: the conformance suite's `advance`).
    pub(crate) fn advance(&self, by: Duration) {
        *self.offset.lock().unwrap_or_else(|e| e.into_inner()) += by;
    }

    /// The shards this relay owns, with their epochs.
    pub(crate) async fn owned(&self) -> Vec<(i32, i64)> {
        let inner = self.inner.lock().await;
        inner.shards.iter().map(|(s, sh)| (*s, sh.epoch)).collect()
    }

    /// A claim: shards renewed and taken on the primary `pool`, rows read from the replica
    /// when there is one.
    async fn claim(
        &self,
        pool: &PgPool,
        config: &PostgresConfig,
        limit: usize,
        lease: Duration,
    ) -> Result<Claim> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        let now = self.now();
        let every = ROUND_EVERY.min(lease / 3);
        let handing_over = inner
            .shards
            .iter()
            .any(|(shard, s)| s.leaving && !inner.has_live_claims(*shard, now));
        let round_due = inner.last_round.is_none_or(|at| {
            let since = now.saturating_duration_since(at);
            since >= every || (handing_over && since >= HAND_OVER_EVERY)
        }) || inner.held_until.is_none_or(|until| now + lease > until);
        if round_due {
            // Shards are held for a round interval beyond the lease: every claim until the
            // next round then ends, lease and all, before its shards' lease does, so a claim
            // needs no renewal of its own (the worker renews at two thirds of its lease,
            // which renews the shards too, see `extend_lease`).
            self.round(pool, inner, lease + every).await?;
        }
        let token = ClaimToken(Uuid::now_v7());
        if inner.shards.is_empty() {
            return Ok(Claim {
                token,
                messages: Vec::new(),
            });
        }
        // Which keys are parked (from the primary) and the new rows are read at once, on
        // two connections; the parked keys are applied first, so the rows of a parked key
        // go to the held rows. The parked keys are read by every claim: an operator's
        // replay can park a key this relay does not hold parked (its key was released and
        // drained since), and the next claim must put the replayed row ahead of the key's
        // later rows. The rows come from the read started by the last claim when there is
        // one (it ran while that claim's batch went out), else from a read now.
        // A replica is read only once it has replayed what the shards' previous owners
        // wrote (rows they moved out of the log): until then the claim reads nothing, as
        // when the replica lags.
        let source = match self.replica.as_ref() {
            Some(replica) if !self.replica_caught_up(replica, inner).await? => {
                return Ok(Claim {
                    token,
                    messages: Vec::new(),
                });
            }
            Some(replica) => replica,
            None => pool,
        };
        let read_parked = config.per_key_order;
        let mut ahead = inner.ahead.take();
        let (parked, (rows, from)) = {
            let shared: &Inner = inner;
            tokio::try_join!(
                async {
                    match read_parked {
                        true => self.parked_rows(pool, shared).await.map(Some),
                        false => Ok(None),
                    }
                },
                async {
                    if let Some(ahead) = ahead.as_mut() {
                        let rows = (&mut ahead.task).await.map_err(|e| {
                            Error::temporary(format!("postgres: reading the log stopped: {e}"))
                        })??;
                        return Ok((rows, std::mem::take(&mut ahead.from)));
                    }
                    match self.plan_read(shared, limit, &HashMap::new()) {
                        Some(plan) => {
                            Ok((read_rows(source, &self.sql.read, &plan).await?, plan.from))
                        }
                        None => Ok((Vec::new(), HashMap::new())),
                    }
                },
            )?
        };
        if let Some(parked) = parked {
            self.refresh_parked(pool, inner, parked).await?;
        }
        self.take(pool, inner, rows, &from).await?;
        let max_per_key = if config.per_key_order {
            config.max_per_key
        } else {
            usize::MAX
        };
        if config.per_key_order {
            self.reload_evicted(pool, inner, max_per_key).await?;
            self.hold_parked(pool, inner).await?;
            self.evict(inner, limit, max_per_key);
        }

        let mut picked = pick(inner, limit, max_per_key, config.per_key_order, self.now());
        // The read ahead began before this claim: a claim it does not fill reads again, so
        // that it hands out every row committed before it.
        if ahead.is_some()
            && picked.len() < limit
            && let Some(plan) = self.plan_read(inner, limit, &HashMap::new())
        {
            let rows = read_rows(source, &self.sql.read, &plan).await?;
            self.take(pool, inner, rows, &plan.from).await?;
            if config.per_key_order {
                self.hold_parked(pool, inner).await?;
            }
            picked = pick(inner, limit, max_per_key, config.per_key_order, self.now());
        }
        let now = self.now();
        let until = now + lease;
        let mut messages = Vec::with_capacity(picked.len());
        let mut leaving: HashMap<i32, usize> = HashMap::new();
        for (pos, shard) in picked {
            *leaving.entry(shard).or_default() += 1;
            if let Some(e) = inner.lease_entry(shard, pos, &token, until) {
                messages.push(e.message.clone());
            }
        }
        // A full batch: more is likely waiting, so read it while this batch goes out.
        if messages.len() == limit {
            self.start_read(source, inner, limit, &leaving);
        }
        Ok(Claim { token, messages })
    }

    async fn extend_lease(
        &self,
        pool: &PgPool,
        token: &ClaimToken,
        ids: &[Uuid],
        lease: Duration,
    ) -> Result<u64> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        let asked_at = self.now();
        // Rows set aside under this claim: the lease of a parked key's row is only memory.
        let mut aside = 0;
        for id in ids {
            if inner.aside_held_by(id, token)
                && let Some(a) = inner.aside.get_mut(id)
            {
                a.state = State::InFlight {
                    token: token.0,
                    until: asked_at + lease,
                };
                aside += 1;
            }
        }
        let found: Vec<(i32, Pos)> = ids
            .iter()
            .filter_map(|id| inner.held_by(id, token))
            .collect();
        if found.is_empty() {
            return Ok(aside);
        }
        let touched: HashSet<i32> = found.iter().map(|(s, _)| *s).collect();
        let _writing = self.writes.lock().await;
        let kept = self.renew(pool, inner, &touched, lease).await?;
        let mut n = 0;
        for (shard, pos) in found {
            if !kept.contains(&shard) {
                continue;
            }
            if inner
                .lease_entry(shard, pos, token, asked_at + lease)
                .is_some()
            {
                n += 1;
            }
        }
        Ok(n + aside)
    }

    /// Removes delivered rows behind the cursors of the owned shards (or only those older
    /// than `retention`), along the primary key, in deletes of at most [`CLEANUP_CHUNK`]
    /// rows. Each is a transaction of its own and a short one: a transaction that runs
    /// holds the readable horizon of every relay on the database, its own too.
    async fn maintain(&self, pool: &PgPool, retention: Option<Duration>) -> Result<()> {
        let owned: Vec<i32> = self.owned().await.into_iter().map(|(s, _)| s).collect();
        if owned.is_empty() {
            return Ok(());
        }
        let per_shard = CLEANUP_CHUNK.div_ceil(owned.len()) as i64;
        let mut removed = 0;
        loop {
            let done = sqlx::query(&self.sql.cleanup)
                .bind(&owned)
                .bind(retention.map(saturating_millis))
                .bind(per_shard)
                .execute(pool)
                .await
                .map_err(|e| db_error("cannot remove delivered rows", e))?;
            removed += done.rows_affected();
            // Below one shard's share: no shard had a full chunk, so nothing is left.
            if done.rows_affected() < per_shard as u64 {
                break;
            }
        }
        if removed > 0 {
            tracing::debug!(rows = removed, "removed delivered rows behind the cursors");
        }
        sqlx::query(&self.sql.forget_old_relays)
            .execute(pool)
            .await
            .map_err(|e| db_error("cannot remove old relays", e))?;
        Ok(())
    }
}

/// Binds of a set of positions: shards, transaction ids (as text: sqlx has no `xid8`), seqs.
pub(super) fn split(positions: &[(i32, Pos)]) -> (Vec<i32>, Vec<String>, Vec<i64>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for &(shard, (xid, seq)) in positions {
        out.0.push(shard);
        out.1.push(xid.to_string());
        out.2.push(seq);
    }
    out
}

/// A transaction id that the statements return as text.
pub(super) fn parse_xid(text: &str) -> Result<u64> {
    text.parse()
        .map_err(|_| Error::temporary(format!("postgres: `{text}` is not a transaction id")))
}

#[async_trait]
impl Mode for LogEngine {
    async fn migrate(&self, s: &Shared, conn: &mut PgConnection) -> Result<()> {
        s.table.migrate_log(conn, s.config.shards).await
    }

    async fn claim(
        &self,
        s: &Shared,
        _worker_id: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Claim> {
        LogEngine::claim(self, &s.pool, &s.config, limit, lease).await
    }

    async fn settle(&self, s: &Shared, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        LogEngine::settle(self, &s.pool, &s.config, token, settlement).await
    }

    async fn extend_lease(
        &self,
        s: &Shared,
        token: &ClaimToken,
        ids: &[Uuid],
        lease: Duration,
    ) -> Result<u64> {
        LogEngine::extend_lease(self, &s.pool, token, ids, lease).await
    }

    async fn stats(&self, s: &Shared) -> Result<QueueStats> {
        LogEngine::stats(self, &s.pool).await
    }

    async fn topic_stats(&self, s: &Shared) -> Result<Vec<TopicStats>> {
        LogEngine::topic_stats(self, &s.pool).await
    }

    async fn maintain(&self, s: &Shared) -> Result<()> {
        LogEngine::maintain(self, &s.pool, s.config.retention).await
    }

    async fn replay(&self, s: &Shared, ids: &[Uuid]) -> Result<u64> {
        let query = sqlx::query(&self.sql.replay)
            .bind(ids)
            .bind(s.config.per_key_order);
        s.count("cannot replay dead letters", query).await
    }

    async fn release(&self, s: &Shared, key: &str) -> Result<bool> {
        // The owner delivers the key's held rows, then unparks it.
        let query = sqlx::query(&self.sql.release).bind(key);
        Ok(s.execute("cannot release parked key", query).await? > 0)
    }

    async fn waiting_behind(&self, s: &Shared, key: &str) -> Result<u64> {
        // Log mode keeps a key's held messages elsewhere (see `stats.rs`).
        LogEngine::waiting_behind(self, &s.pool, key).await
    }

    async fn horizon(&self, s: &Shared) -> Result<Option<HorizonLag>> {
        self.horizon_lag(&s.pool).await.map(Some)
    }

    /// Gives every shard this relay owns up at once, so other relays take them without
    /// waiting for the lease to run out.
    async fn stop(&self, s: &Shared) -> Result<()> {
        self.give_up(&s.pool).await
    }
}
