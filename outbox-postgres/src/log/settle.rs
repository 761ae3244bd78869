//! Settling a claim in log mode: deliveries move the cursors, dead letters and the rows of
//! their keys leave the log for the dead letters and the held rows, retries wait in memory.
//! [`LogEngine::settle`] goes in steps: resolve the settlement's ids to the rows this claim
//! holds ([`Resolved`]), plan what leaves memory and what is written ([`Plan`]), write it
//! under the epoch fence, then change memory to match.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_core::{ClaimToken, Result, Settlement};
use sqlx::postgres::{PgConnection, PgPool};
use tokio::sync::MutexGuard;
use tokio::time::Instant;
use uuid::Uuid;

use super::memory::{Aside, Entry, Inner, Parked, Pos, State, cursor_positions, entry};
use super::ownership::move_cursors;
use super::{LogEngine, split};
use crate::PostgresConfig;
use crate::error::db_error;

fn fail(e: sqlx::Error) -> outbox_core::Error {
    db_error("settling a batch failed", e)
}

/// The rows of a settlement that this relay holds under the claim's token, by place.
struct Resolved<'s> {
    delivered: Vec<(i32, Pos)>,
    dead: Vec<(i32, Pos, &'s str)>,
    retries: Vec<(i32, Pos, Duration, &'s str)>,
    released: Vec<(i32, Pos)>,
    // Late settlements of rows set aside while this claim held them.
    aside_delivered: Vec<Uuid>,
    aside_dead: Vec<(Uuid, &'s str)>,
    aside_retries: Vec<(Uuid, Duration)>,
    aside_released: Vec<Uuid>,
}

impl<'s> Resolved<'s> {
    fn new(inner: &Inner, token: &ClaimToken, s: &'s Settlement) -> Self {
        let find = |inner: &Inner, id: &Uuid| inner.held_by(id, token);
        let delivered: Vec<(i32, Pos)> = s
            .delivered
            .iter()
            .filter_map(|d| find(inner, &d.id))
            .collect();
        let dead: Vec<(i32, Pos, &str)> = s
            .dead
            .iter()
            .filter_map(|d| find(inner, &d.id).map(|(sh, p)| (sh, p, d.error.as_str())))
            .collect();
        let retries: Vec<(i32, Pos, Duration, &str)> = s
            .retries
            .iter()
            .filter_map(|r| find(inner, &r.id).map(|(sh, p)| (sh, p, r.delay, r.error.as_str())))
            .collect();
        let released: Vec<(i32, Pos)> =
            s.released.iter().filter_map(|id| find(inner, id)).collect();
        let aside_delivered: Vec<Uuid> = s
            .delivered
            .iter()
            .map(|d| d.id)
            .filter(|id| inner.aside_held_by(id, token))
            .collect();
        let aside_dead: Vec<(Uuid, &str)> = s
            .dead
            .iter()
            .filter(|d| inner.aside_held_by(&d.id, token))
            .map(|d| (d.id, d.error.as_str()))
            .collect();
        let aside_retries: Vec<(Uuid, Duration)> = s
            .retries
            .iter()
            .filter(|r| inner.aside_held_by(&r.id, token))
            .map(|r| (r.id, r.delay))
            .collect();
        let aside_released: Vec<Uuid> = s
            .released
            .iter()
            .copied()
            .filter(|id| inner.aside_held_by(id, token))
            .collect();
        Resolved {
            delivered,
            dead,
            retries,
            released,
            aside_delivered,
            aside_dead,
            aside_retries,
            aside_released,
        }
    }

    /// How many rows the settlement settles.
    fn count(&self) -> u64 {
        (self.delivered.len()
            + self.dead.len()
            + self.retries.len()
            + self.released.len()
            + self.aside_delivered.len()
            + self.aside_dead.len()
            + self.aside_retries.len()
            + self.aside_released.len()) as u64
    }
}

/// What a settlement writes, and what leaves memory.
struct Plan {
    /// What leaves memory: deliveries, dead letters, and (with per-key order) every other
    /// row of a dead letter's key, which is kept aside in the held rows.
    removed: HashSet<Pos>,
    /// The same, with each row's shard.
    removed_at: Vec<(i32, Pos)>,
    /// Keys to park: (key, dead letter, shard).
    parks: Vec<(String, Uuid, i32)>,
    /// Rows of the log to keep aside in the held rows, with their attempts.
    hold: Vec<(i32, Pos, i32)>,
    /// The shards whose cursors the settlement writes.
    touched: HashSet<i32>,
    /// Held rows delivered, by seq: they leave the held rows.
    held_delivered: Vec<i64>,
}

impl Plan {
    fn new(
        inner: &Inner,
        r: &Resolved<'_>,
        per_key_order: bool,
        token: &ClaimToken,
        now: Instant,
    ) -> Self {
        let mut removed: HashSet<Pos> = HashSet::new();
        let mut removed_at: Vec<(i32, Pos)> = Vec::new();
        for (shard, pos) in r
            .delivered
            .iter()
            .copied()
            .chain(r.dead.iter().map(|(s, p, _)| (*s, *p)))
        {
            if removed.insert(pos) {
                removed_at.push((shard, pos));
            }
        }
        let mut parks: Vec<(String, Uuid, i32)> = Vec::new();
        let mut hold: Vec<(i32, Pos, i32)> = Vec::new();
        if per_key_order {
            let mut keys = HashSet::new();
            for &(shard, pos, _) in &r.dead {
                let Some(e) = inner.shards.get(&shard).and_then(|s| s.entries.get(&pos)) else {
                    continue;
                };
                if let Some(key) = &e.message.key
                    && keys.insert(key.clone())
                {
                    parks.push((key.clone(), e.message.id, shard));
                }
            }
            // Rows of this settlement given back (retried, released) whose key is parked.
            for (shard, pos) in r
                .retries
                .iter()
                .map(|(s, p, _, _)| (*s, *p))
                .chain(r.released.iter().copied())
            {
                if let Some(key) = entry(inner, shard, pos).and_then(|e| e.message.key.as_ref())
                    && inner.parked.get(key).is_some_and(|p| !p.draining)
                {
                    keys.insert(key.clone());
                }
            }
            if !keys.is_empty() {
                for (&shard, sh) in &inner.shards {
                    for (&pos, e) in &sh.entries {
                        let Some(key) = &e.message.key else { continue };
                        if !keys.contains(key) || removed.contains(&pos) {
                            continue;
                        }
                        // Another claim's live row of the key stays until it is settled.
                        let other = matches!(e.state,
                            State::InFlight { token: t, until } if t != token.0 && until > now);
                        if other {
                            continue;
                        }
                        removed.insert(pos);
                        removed_at.push((shard, pos));
                        if !e.held {
                            hold.push((shard, pos, e.message.attempts as i32));
                        }
                    }
                }
            }
        }
        let mut touched: HashSet<i32> = r.delivered.iter().map(|(s, _)| *s).collect();
        touched.extend(r.dead.iter().map(|(s, _, _)| *s));
        touched.extend(hold.iter().map(|(s, _, _)| *s));
        let aside_shard = |id: &Uuid| inner.aside.get(id).map(|a| a.shard);
        touched.extend(r.aside_delivered.iter().filter_map(aside_shard));
        touched.extend(r.aside_dead.iter().filter_map(|(id, _)| aside_shard(id)));

        let mut held_delivered: Vec<i64> = r
            .delivered
            .iter()
            .filter(|(sh, p)| entry(inner, *sh, *p).is_some_and(|e| e.held))
            .map(|(_, p)| p.1)
            .collect();
        held_delivered.extend(
            r.aside_delivered
                .iter()
                .filter_map(|id| inner.aside.get(id).map(|a| a.seq)),
        );
        for (id, _) in &r.aside_dead {
            if let Some(a) = inner.aside.get(id) {
                parks.push((a.key.clone(), *id, a.shard));
            }
        }
        Plan {
            removed,
            removed_at,
            parks,
            hold,
            touched,
            held_delivered,
        }
    }

    /// Whether more than cursors are written (dead letters, held rows): one transaction.
    fn needs_tx(&self, r: &Resolved<'_>) -> bool {
        !r.dead.is_empty()
            || !self.hold.is_empty()
            || !self.held_delivered.is_empty()
            || !r.aside_dead.is_empty()
    }
}

impl LogEngine {
    /// Settles what `s` names of the rows this relay holds under `token` (in memory or set
    /// aside); returns how many it settled.
    pub(super) async fn settle(
        &self,
        pool: &PgPool,
        config: &PostgresConfig,
        token: &ClaimToken,
        s: &Settlement,
    ) -> Result<u64> {
        let mut guard = self.inner.lock().await;
        let mut inner: &mut Inner = &mut guard;
        let now = self.now();
        let r = Resolved::new(inner, token, s);
        let count = r.count();
        let plan = Plan::new(inner, &r, config.per_key_order, token, now);
        if !plan.touched.is_empty() {
            let needs_tx = plan.needs_tx(&r);
            let deliveries_only = !needs_tx
                && r.retries.is_empty()
                && r.released.is_empty()
                && r.aside_retries.is_empty()
                && r.aside_released.is_empty();
            let writing = self.writes.lock().await;
            let mut tx = if needs_tx {
                Some(pool.begin().await.map_err(fail)?)
            } else {
                None
            };
            let kept = match tx.as_mut() {
                Some(tx) => self.fence(tx, inner, &plan.touched, &plan.removed).await?,
                None if deliveries_only => {
                    let (relocked, kept) =
                        self.deliver_unlocked(pool, guard, writing, &plan).await?;
                    guard = relocked;
                    inner = &mut guard;
                    kept
                }
                None => {
                    let mut conn = pool.acquire().await.map_err(fail)?;
                    self.fence(&mut conn, inner, &plan.touched, &plan.removed)
                        .await?
                }
            };
            if let Some(tx) = tx.as_mut() {
                self.write_settled(tx, inner, &r, &plan, &kept).await?;
            }
            if let Some(tx) = tx {
                tx.commit().await.map_err(fail)?;
            }
            if let Some(n) = self.apply_settled(inner, &r, &plan, &kept, token, now) {
                return Ok(n);
            }
        }
        self.apply_waits(inner, &r.retries, &r.released, now);
        for id in r
            .aside_delivered
            .iter()
            .chain(r.aside_dead.iter().map(|(id, _)| id))
        {
            inner.aside.remove(id);
        }
        for id in &r.aside_released {
            inner.aside.remove(id);
        }
        for (id, delay) in &r.aside_retries {
            if let Some(a) = inner.aside.get_mut(id) {
                a.state = State::Waiting { at: now + *delay };
                a.attempts = a.attempts.saturating_add(1);
            }
        }
        Ok(count)
    }

    /// The common case, a settlement of deliveries only: the cursors move without the lock
    /// on memory, so the worker's next claim goes on while they commit (about one WAL
    /// flush). The rows are delivered, so they leave memory first: that claim may take the
    /// next rows of their keys, published after these were acknowledged. A write that fails
    /// or is refused leaves the stored cursor behind them: the shard's next cursor write
    /// passes them, or its next owner (or this relay after a restart) delivers them again,
    /// in order. Returns memory locked again, and the shards still owned.
    async fn deliver_unlocked<'a>(
        &'a self,
        pool: &PgPool,
        mut guard: MutexGuard<'a, Inner>,
        writing: MutexGuard<'a, ()>,
        plan: &Plan,
    ) -> Result<(MutexGuard<'a, Inner>, HashSet<i32>)> {
        let inner: &mut Inner = &mut guard;
        let (positions, epochs) = cursor_positions(inner, &plan.touched, &plan.removed);
        for &(shard, pos) in &plan.removed_at {
            if let Some(s) = inner.shards.get_mut(&shard)
                && let Some(e) = s.entries.remove(&pos)
            {
                s.delivered.insert(pos);
                inner.ids.remove(&e.message.id);
            }
        }
        drop(guard);
        let moved = async {
            let mut conn = pool.acquire().await.map_err(fail)?;
            let sql = &self.sql.move_cursors;
            move_cursors(&mut conn, sql, &self.owner, &positions, &epochs).await
        }
        .await;
        drop(writing);
        let guard = self.inner.lock().await;
        // A shard taken over and back meanwhile is not the one written.
        let written: HashMap<i32, i64> = positions.iter().map(|(s, _)| *s).zip(epochs).collect();
        let mut kept = moved?;
        kept.retain(|shard| {
            guard.shards.get(shard).map(|s| s.epoch) == written.get(shard).copied()
        });
        Ok((guard, kept))
    }

    /// Writes, in `tx`, what the settlement moves out of the log or the held rows for the
    /// shards still owned (`kept`): dead letters, parked keys, rows kept aside, held rows
    /// delivered.
    async fn write_settled(
        &self,
        tx: &mut PgConnection,
        inner: &Inner,
        r: &Resolved<'_>,
        plan: &Plan,
        kept: &HashSet<i32>,
    ) -> Result<()> {
        let live = |sh: &i32| kept.contains(sh);
        // Dead letters first: a held row of the key must not be in the held rows and
        // the dead letters at once.
        let (log_dead, held_dead): (Vec<_>, Vec<_>) = r
            .dead
            .iter()
            .filter(|(sh, _, _)| live(sh))
            .partition(|(sh, p, _)| entry(inner, *sh, *p).is_some_and(|e| !e.held));
        if !log_dead.is_empty() {
            let positions: Vec<(i32, Pos)> = log_dead.iter().map(|(s, p, _)| (*s, *p)).collect();
            let (shards, xids, seqs) = split(&positions);
            let attempts: Vec<i32> = log_dead
                .iter()
                .map(|(s, p, _)| attempts_after_failure(entry(inner, *s, *p)))
                .collect();
            let errors: Vec<&str> = log_dead.iter().map(|(_, _, e)| *e).collect();
            sqlx::query(&self.sql.dead_from_log)
                .bind(&shards)
                .bind(&xids)
                .bind(&seqs)
                .bind(&attempts)
                .bind(&errors)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        let aside_dead: Vec<(&Aside, &str)> = r
            .aside_dead
            .iter()
            .filter_map(|(id, e)| inner.aside.get(id).map(|a| (a, *e)))
            .filter(|(a, _)| live(&a.shard))
            .collect();
        if !held_dead.is_empty() || !aside_dead.is_empty() {
            let mut seqs: Vec<i64> = held_dead.iter().map(|(_, p, _)| p.1).collect();
            let mut attempts: Vec<i32> = held_dead
                .iter()
                .map(|(s, p, _)| attempts_after_failure(entry(inner, *s, *p)))
                .collect();
            let mut errors: Vec<&str> = held_dead.iter().map(|(_, _, e)| *e).collect();
            for (a, error) in &aside_dead {
                seqs.push(a.seq);
                attempts.push(a.attempts.saturating_add(1) as i32);
                errors.push(error);
            }
            sqlx::query(&self.sql.dead_from_held)
                .bind(&seqs)
                .bind(&attempts)
                .bind(&errors)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        let mut parks: Vec<&(String, Uuid, i32)> =
            plan.parks.iter().filter(|(_, _, sh)| live(sh)).collect();
        // One order for the key locks of every writer of parked keys.
        parks.sort();
        if !parks.is_empty() {
            sqlx::query(&self.sql.park)
                .bind(parks.iter().map(|p| p.0.as_str()).collect::<Vec<_>>())
                .bind(parks.iter().map(|p| p.1).collect::<Vec<_>>())
                .bind(parks.iter().map(|p| p.2).collect::<Vec<_>>())
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        let hold: Vec<&(i32, Pos, i32)> = plan.hold.iter().filter(|(sh, _, _)| live(sh)).collect();
        if !hold.is_empty() {
            self.hold_in(&mut *tx, &hold).await.map_err(fail)?;
        }
        if !plan.held_delivered.is_empty() {
            sqlx::query(&self.sql.delete_held)
                .bind(&plan.held_delivered)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        Ok(())
    }

    /// Written: changes memory to match, for the shards still owned (`kept`), and drops
    /// those lost. With a shard lost, returns how many rows were settled (only what was
    /// written for shards still owned), retries and releases already applied.
    fn apply_settled(
        &self,
        inner: &mut Inner,
        r: &Resolved<'_>,
        plan: &Plan,
        kept: &HashSet<i32>,
        token: &ClaimToken,
        now: Instant,
    ) -> Option<u64> {
        for (key, _, shard) in &plan.parks {
            if kept.contains(shard) {
                inner.parked.insert(
                    key.clone(),
                    Parked {
                        draining: false,
                        generation: -1,
                        shard: *shard,
                    },
                );
            }
        }
        let delivered_at: HashSet<Pos> = r.delivered.iter().map(|(_, p)| *p).collect();
        let settled: HashSet<Pos> = delivered_at
            .iter()
            .copied()
            .chain(r.dead.iter().map(|(_, p, _)| *p))
            .collect();
        let retried: HashMap<Pos, Duration> =
            r.retries.iter().map(|(_, p, d, _)| (*p, *d)).collect();
        let given_back: HashSet<Pos> = r.released.iter().map(|(_, p)| *p).collect();
        for &(shard, pos) in &plan.removed_at {
            if !kept.contains(&shard) {
                continue;
            }
            // A row moved aside keeps its state (after this settlement) for later.
            if !settled.contains(&pos)
                && let Some(e) = entry(inner, shard, pos)
            {
                let (state, attempts) = if let Some(delay) = retried.get(&pos) {
                    (State::Waiting { at: now + *delay }, e.message.attempts + 1)
                } else if given_back.contains(&pos) {
                    (State::Ready, e.message.attempts)
                } else {
                    (e.state, e.message.attempts)
                };
                inner.set_aside(shard, pos, state, attempts, token);
            }
            if let Some(s) = inner.shards.get_mut(&shard)
                && let Some(e) = s.entries.remove(&pos)
            {
                if !e.held && delivered_at.contains(&pos) {
                    s.delivered.insert(pos);
                }
                inner.ids.remove(&e.message.id);
            }
        }
        for &shard in &plan.touched {
            if let Some(s) = inner.shards.get_mut(&shard)
                && kept.contains(&shard)
            {
                let to = s.cursor_after(&plan.removed);
                s.move_cursor(to);
            }
        }
        let touched = &plan.touched;
        let lost = touched.iter().any(|s| !kept.contains(s));
        self.forget_lost(inner, touched, kept);
        if !lost {
            return None;
        }
        // Count only what was written for shards still owned.
        let written = |sh: &i32| kept.contains(sh);
        let n = r.delivered.iter().filter(|(s, _)| written(s)).count()
            + r.dead.iter().filter(|(s, _, _)| written(s)).count()
            + r.retries
                .iter()
                .filter(|(s, _, _, _)| written(s) || !touched.contains(s))
                .count()
            + r.released
                .iter()
                .filter(|(s, _)| written(s) || !touched.contains(s))
                .count();
        self.apply_waits(inner, &r.retries, &r.released, now);
        Some(n as u64)
    }

    /// Retries wait out their delay with one more attempt; releases are ready at once.
    fn apply_waits(
        &self,
        inner: &mut Inner,
        retries: &[(i32, Pos, Duration, &str)],
        released: &[(i32, Pos)],
        now: Instant,
    ) {
        for &(shard, pos, delay, _) in retries {
            if let Some(e) = inner
                .shards
                .get_mut(&shard)
                .and_then(|s| s.entries.get_mut(&pos))
            {
                e.message.attempts = e.message.attempts.saturating_add(1);
                e.state = State::Waiting { at: now + delay };
            }
        }
        for &(shard, pos) in released {
            if let Some(e) = inner
                .shards
                .get_mut(&shard)
                .and_then(|s| s.entries.get_mut(&pos))
            {
                e.state = State::Ready;
            }
        }
    }
}

fn attempts_after_failure(entry: Option<&Entry>) -> i32 {
    entry.map_or(1, |e| e.message.attempts.saturating_add(1) as i32)
}
