//! Reading the log: what to read per shard ([`LogEngine::plan_read`]), the read started in
//! the background while a batch goes out, putting rows read into memory
//! ([`LogEngine::take`]), letting a stopped key's rows go when a buffer is full and reading
//! them again.

use std::collections::{HashMap, HashSet, btree_map};

use outbox_core::{Message, Result};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgRow};

use super::memory::{Entry, Inner, Pos, State};
use super::{LogEngine, parse_xid, split};
use crate::error::db_error;
use crate::rows;

/// A read of the log for the next claim, running in the background (see
/// [`LogEngine::start_read`]).
pub(super) struct ReadAhead {
    /// Each shard's epoch and read position when the read started.
    pub(super) from: HashMap<i32, (i64, Pos)>,
    pub(super) task: tokio::task::JoinHandle<Result<Vec<ReadRow>>>,
}

/// A row read from the log: its shard, its place, the message.
pub(super) type ReadRow = (i32, Pos, Message);

/// What [`read_rows`] reads: per shard, after which place and how many rows.
pub(super) struct ReadPlan {
    pub(super) shards: Vec<i32>,
    pub(super) xids: Vec<String>,
    pub(super) seqs: Vec<i64>,
    pub(super) room: Vec<i64>,
    pub(super) from: HashMap<i32, (i64, Pos)>,
}

impl LogEngine {
    /// Whether `replica` has replayed the primary's WAL up to where this relay last took
    /// shards (see `Inner::replica_from`); forgets that position once it has.
    pub(super) async fn replica_caught_up(
        &self,
        replica: &PgPool,
        inner: &mut Inner,
    ) -> Result<bool> {
        let Some(lsn) = &inner.replica_from else {
            return Ok(true);
        };
        // NULL on a server that is not a standby: it has everything.
        let caught_up: bool = sqlx::query_scalar(
            "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, true)",
        )
        .bind(lsn)
        .fetch_one(replica)
        .await
        .map_err(|e| db_error("cannot read the replica's replay position", e))?;
        if caught_up {
            inner.replica_from = None;
        }
        Ok(caught_up)
    }

    /// What to read next: each shard's read position, as many rows as fill its buffer once
    /// `leaving` of its rows (per shard: the batch going out) are gone. `None` when every
    /// buffer is full.
    pub(super) fn plan_read(
        &self,
        inner: &Inner,
        limit: usize,
        leaving: &HashMap<i32, usize>,
    ) -> Option<ReadPlan> {
        let cap = self.buffer_cap(limit);
        let mut want: Vec<(i32, Pos)> = Vec::new();
        let mut room: Vec<i64> = Vec::new();
        let mut from = HashMap::new();
        for (&shard, s) in &inner.shards {
            let staying = s
                .entries
                .len()
                .saturating_sub(leaving.get(&shard).copied().unwrap_or(0));
            if staying < cap && !s.leaving {
                want.push((shard, s.read));
                room.push(i64::try_from(cap - staying).unwrap_or(i64::MAX));
                from.insert(shard, (s.epoch, s.read));
            }
        }
        if want.is_empty() {
            return None;
        }
        let (shards, xids, seqs) = split(&want);
        Some(ReadPlan {
            shards,
            xids,
            seqs,
            room,
            from,
        })
    }

    /// Starts reading the rows for the next claim in the background, while this claim's
    /// batch goes out: the next claim only puts them in memory.
    pub(super) fn start_read(
        &self,
        source: &PgPool,
        inner: &mut Inner,
        limit: usize,
        leaving: &HashMap<i32, usize>,
    ) {
        let Some(plan) = self.plan_read(inner, limit, leaving) else {
            return;
        };
        let (source, sql) = (source.clone(), self.sql.read.clone());
        let from = plan.from.clone();
        let task = tokio::spawn(async move { read_rows(&source, &sql, &plan).await });
        inner.ahead = Some(ReadAhead { from, task });
    }

    /// Puts rows read (see [`plan_read`](Self::plan_read)) into memory; rows of parked keys
    /// are kept aside in the held rows at once (fenced, on the primary `pool`), before the
    /// cursor can move past them. Which keys are parked comes from memory, refreshed from
    /// the primary. Only the rows of shards still at the epoch and read position they were
    /// read from (`from`) are taken: a shard taken over, or handed over and read back from
    /// an earlier position, since, is read again.
    pub(super) async fn take(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        rows: Vec<ReadRow>,
        from: &HashMap<i32, (i64, Pos)>,
    ) -> Result<()> {
        let fail = |e| db_error("cannot read the outbox log", e);
        let current: HashSet<i32> = from
            .iter()
            .filter(|(shard, at)| {
                inner
                    .shards
                    .get(shard)
                    .is_some_and(|s| (s.epoch, s.read) == **at)
            })
            .map(|(shard, _)| *shard)
            .collect();
        // Write the held rows first, then change memory: a failure on the way must leave
        // no row behind the read position that is neither in memory nor kept aside.
        let read: Vec<(i32, Pos, Message, bool)> = rows
            .into_iter()
            .filter(|r| current.contains(&r.0))
            .map(|(shard, pos, message)| {
                let parked = message
                    .key
                    .as_ref()
                    .and_then(|k| inner.parked.get(k))
                    .is_some_and(|p| !p.draining);
                (shard, pos, message, parked)
            })
            .collect();
        let hold: Vec<(i32, Pos)> = read.iter().filter(|r| r.3).map(|r| (r.0, r.1)).collect();
        let touched: HashSet<i32> = hold.iter().map(|(s, _)| *s).collect();
        let mut kept = HashSet::new();
        if !hold.is_empty() {
            let _writing = self.writes.lock().await;
            let mut tx = pool.begin().await.map_err(fail)?;
            kept = self
                .fence(&mut tx, inner, &touched, &HashSet::new())
                .await?;
            // Never tried: read just now.
            let hold: Vec<(i32, Pos, i32)> = (hold.into_iter())
                .filter(|(s, _)| kept.contains(s))
                .map(|(s, pos)| (s, pos, 0))
                .collect();
            let hold: Vec<&(i32, Pos, i32)> = hold.iter().collect();
            self.hold_in(&mut tx, &hold).await.map_err(fail)?;
            tx.commit().await.map_err(fail)?;
        }
        for (shard, pos, message, parked) in read {
            if touched.contains(&shard) && !kept.contains(&shard) {
                continue;
            }
            let Some(s) = inner.shards.get_mut(&shard) else {
                continue;
            };
            s.read = s.read.max(pos);
            if parked
                || message
                    .key
                    .as_ref()
                    .is_some_and(|k| s.evicted.contains_key(k))
            {
                continue;
            }
            inner.ids.insert(message.id, (shard, pos));
            s.entries.insert(
                pos,
                Entry {
                    message,
                    held: false,
                    state: State::Ready,
                },
            );
        }
        self.forget_lost(inner, &touched, &kept);
        Ok(())
    }

    /// Makes room in full buffers: in a shard holding as many rows as it may
    /// ([`BUFFER_CLAIMS`](super::BUFFER_CLAIMS) claims' limits), a key stopped behind a row
    /// that is not due (waiting to retry, or out under a live claim) keeps its first
    /// `max_per_key` rows in memory and lets the rest go (rows read and never handed out,
    /// ready, without attempts): the shard reads on, so the other keys go on whatever one
    /// key's backlog. The cursor stays before the rows let go;
    /// [`reload_evicted`](Self::reload_evicted) reads them again.
    pub(super) fn evict(&self, inner: &mut Inner, limit: usize, max_per_key: usize) {
        let cap = self.buffer_cap(limit);
        let now = self.now();
        let keep = max_per_key.max(1);
        for s in inner.shards.values_mut() {
            if s.entries.len() < cap {
                continue;
            }
            // Per key: whether it is stopped (its first row here is not due), its rows.
            let mut keys: HashMap<&str, (bool, Vec<Pos>)> = HashMap::new();
            for (&pos, e) in &s.entries {
                let Some(key) = e.message.key.as_deref() else {
                    continue;
                };
                let due = match e.state {
                    State::Ready => true,
                    State::InFlight { until, .. } => until <= now,
                    State::Waiting { at } => at <= now,
                };
                let k = keys.entry(key).or_insert((!due, Vec::new()));
                k.1.push(pos);
            }
            let mut gone: Vec<(String, Pos, Vec<Pos>)> = Vec::new();
            for (key, (stopped, positions)) in keys {
                if !stopped || positions.len() <= keep {
                    continue;
                }
                // The tail after the first `keep`, from its first row that may go: only
                // rows read from the log, ready and never tried, are let go.
                let tail: Vec<Pos> = positions[keep..]
                    .iter()
                    .copied()
                    .skip_while(|p| {
                        s.entries.get(p).is_some_and(|e| {
                            e.held || !matches!(e.state, State::Ready) || e.message.attempts > 0
                        })
                    })
                    .collect();
                let Some(&first) = tail.first() else { continue };
                let free = tail.iter().all(|p| {
                    s.entries.get(p).is_some_and(|e| {
                        !e.held && matches!(e.state, State::Ready) && e.message.attempts == 0
                    })
                });
                if free {
                    gone.push((key.to_string(), (first.0, first.1 - 1), tail));
                }
            }
            for (key, from, tail) in gone {
                for pos in tail {
                    if let Some(e) = s.entries.remove(&pos) {
                        inner.ids.remove(&e.message.id);
                    }
                }
                tracing::debug!(relay = %self.owner, key, "buffer full: let a stopped key's later rows go, to read them again");
                let at = s.evicted.entry(key).or_insert(from);
                *at = (*at).min(from);
            }
        }
    }

    /// Reads again the rows let go of evicted keys that have fewer than `max_per_key` rows
    /// left in memory, up to `max_per_key` each and at most up to the shard's read
    /// position; a key whose rows are all back is no longer evicted. On the primary: a
    /// replica may not have replayed yet every row this relay read there.
    pub(super) async fn reload_evicted(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        max_per_key: usize,
    ) -> Result<()> {
        let want = max_per_key.max(1);
        let mut plan: Vec<(i32, String, Pos, Pos)> = Vec::new();
        for (&shard, s) in &inner.shards {
            for (key, &from) in &s.evicted {
                let left = s
                    .entries
                    .values()
                    .filter(|e| e.message.key.as_deref() == Some(key.as_str()))
                    .count();
                if left < want {
                    plan.push((shard, key.clone(), from, s.read));
                }
            }
        }
        if plan.is_empty() {
            return Ok(());
        }
        // One more than wanted: fewer back means the key has no rows left out.
        let n = i64::try_from(want + 1).unwrap_or(i64::MAX);
        let rows = sqlx::query(&self.sql.reload)
            .bind(plan.iter().map(|p| p.0).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.1.as_str()).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.2.0.to_string()).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.2.1).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.3.0.to_string()).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.3.1).collect::<Vec<_>>())
            .bind(vec![n; plan.len()])
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot read the outbox log", e))?;
        let mut loaded: HashMap<(i32, String), (usize, Pos)> = HashMap::new();
        for row in &rows {
            let (shard, pos) = position(row)?;
            let message = rows::message(row)?;
            let Some(key) = message.key.clone() else {
                continue;
            };
            let Some(s) = inner.shards.get_mut(&shard) else {
                continue;
            };
            let l = loaded.entry((shard, key)).or_insert((0, pos));
            l.0 += 1;
            l.1 = l.1.max(pos);
            if let btree_map::Entry::Vacant(slot) = s.entries.entry(pos) {
                inner.ids.insert(message.id, (shard, pos));
                slot.insert(Entry {
                    message,
                    held: false,
                    state: State::Ready,
                });
            }
        }
        for (shard, key, _, _) in plan {
            let Some(s) = inner.shards.get_mut(&shard) else {
                continue;
            };
            match loaded.get(&(shard, key.clone())) {
                Some(&(count, last)) if count > want => {
                    s.evicted.insert(key, last);
                }
                _ => {
                    s.evicted.remove(&key);
                }
            }
        }
        Ok(())
    }
}

/// Reads new rows below the horizon from `source` (the primary or a replica: either way
/// every row below its horizon is there, see `HORIZON`) as `plan` says, and decodes them.
/// Changes nothing: [`LogEngine::take`] puts the rows in memory.
///
/// The read runs in a transaction whose first statement takes this session's picture of
/// `pg_stat_activity`, before the read's snapshot: the horizon rule leaves out a running
/// transaction of another database only when that picture shows it, and one that ended
/// between a snapshot and a later picture would count as running, holding the horizon
/// below rows committed before the claim (a claim would hand out nothing it could). With
/// the picture first, a transaction it does not show is either over before the snapshot
/// or newer than everything committed before the read began.
pub(super) async fn read_rows(source: &PgPool, sql: &str, plan: &ReadPlan) -> Result<Vec<ReadRow>> {
    let fail = |e| db_error("cannot read the outbox log", e);
    // Read committed whatever the database's default: each statement its own snapshot.
    let mut tx = source
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .map_err(fail)?;
    sqlx::query("SELECT count(*) FROM pg_stat_activity")
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let rows = sqlx::query(sql)
        .bind(&plan.shards)
        .bind(&plan.xids)
        .bind(&plan.seqs)
        .bind(&plan.room)
        .fetch_all(&mut *tx)
        .await
        .map_err(fail)?;
    tx.commit().await.map_err(fail)?;
    rows.iter()
        .map(|row| {
            let (shard, pos) = position(row)?;
            Ok((shard, pos, rows::message(row)?))
        })
        .collect()
}

/// The shard and place of a row that has `shard`, `xid_text` and `seq`.
pub(super) fn position(row: &PgRow) -> Result<(i32, Pos)> {
    let fail = |e| db_error("cannot read the outbox log", e);
    let shard: i32 = row.try_get("shard").map_err(fail)?;
    let xid: String = row.try_get("xid_text").map_err(fail)?;
    let seq: i64 = row.try_get("seq").map_err(fail)?;
    Ok((shard, (parse_xid(&xid)?, seq)))
}
