//! Parked keys: which keys of the owned shards are parked or draining (refreshed from the
//! primary), loading a draining key's held rows, and keeping a parked key's rows aside in
//! the held rows so that the cursor moves on.

use std::collections::HashSet;

use outbox_core::Result;
use sqlx::postgres::{PgConnection, PgPool};

use super::LogEngine;
use super::memory::{Aside, Entry, Inner, Parked, Pos, State};
use super::read::position;
use super::split;
use crate::error::db_error;
use crate::rows;

impl LogEngine {
    /// Reads which keys of the owned shards are parked; loads the held rows of keys that
    /// became draining (released or replayed) or were replayed again; unparks draining keys
    /// whose held rows are all settled.
    pub(super) async fn refresh_parked(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        rows: Vec<(String, bool, i64, i32)>,
    ) -> Result<()> {
        let fail = |e| db_error("cannot read parked keys", e);
        let mut seen = HashSet::new();
        for (key, draining, generation, shard) in rows {
            let before = inner.parked.get(&key).copied();
            let load = draining && before.is_none_or(|p| !p.draining || p.generation != generation);
            if load {
                let held = sqlx::query(&self.sql.held_of_key)
                    .bind(&key)
                    .fetch_all(pool)
                    .await
                    .map_err(fail)?;
                for row in &held {
                    let (shard, pos) = position(row)?;
                    let mut message = rows::message(row)?;
                    if let Some(s) = inner.shards.get_mut(&shard)
                        && let std::collections::btree_map::Entry::Vacant(slot) =
                            s.entries.entry(pos)
                    {
                        let mut state = State::Ready;
                        if let Some(a) = inner.aside.remove(&message.id) {
                            state = a.state;
                            message.attempts = a.attempts;
                        }
                        inner.ids.insert(message.id, (shard, pos));
                        slot.insert(Entry {
                            message,
                            held: true,
                            state,
                        });
                    }
                }
            }
            seen.insert(key.clone());
            inner.parked.insert(
                key,
                Parked {
                    draining,
                    generation,
                    shard,
                },
            );
        }
        inner.parked.retain(|k, _| seen.contains(k));
        // A draining key with nothing held left in memory is unparked (the statement checks
        // the table too, and that no replay came meanwhile).
        let done: Vec<(String, i64)> = inner
            .parked
            .iter()
            .filter(|(key, p)| {
                p.draining
                    && !inner.shards.values().any(|s| {
                        s.entries
                            .values()
                            .any(|e| e.held && e.message.key.as_deref() == Some(key.as_str()))
                    })
            })
            .map(|(k, p)| (k.clone(), p.generation))
            .collect();
        for (key, generation) in done {
            let gone = sqlx::query(&self.sql.unpark)
                .bind(&key)
                .bind(generation)
                .execute(pool)
                .await
                .map_err(fail)?;
            if gone.rows_affected() > 0 {
                inner.parked.remove(&key);
            }
        }
        Ok(())
    }

    /// The parked keys of the owned shards, as stored on the primary.
    pub(super) async fn parked_rows(
        &self,
        pool: &PgPool,
        inner: &Inner,
    ) -> Result<Vec<(String, bool, i64, i32)>> {
        let owned: Vec<i32> = inner.shards.keys().copied().collect();
        sqlx::query_as(&self.sql.parked_in)
            .bind(&owned)
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot read parked keys", e))
    }

    /// Keeps aside the rows in memory of parked keys that no live claim holds (a claim whose
    /// lease ran out, rows read just before the key was parked), so that the cursor can move.
    pub(super) async fn hold_parked(&self, pool: &PgPool, inner: &mut Inner) -> Result<()> {
        // Without a parked key in memory there is nothing to keep aside: skip the walk over
        // every entry read.
        if !inner.parked.values().any(|p| !p.draining) {
            return Ok(());
        }
        let now = self.now();
        let mut hold: Vec<(i32, Pos, i32)> = Vec::new();
        let mut drop: HashSet<Pos> = HashSet::new();
        for (&shard, s) in &inner.shards {
            for (&pos, e) in &s.entries {
                let parked = e
                    .message
                    .key
                    .as_ref()
                    .and_then(|k| inner.parked.get(k))
                    .is_some_and(|p| !p.draining);
                let live = matches!(e.state, State::InFlight { until, .. } if until > now);
                if parked && !live {
                    drop.insert(pos);
                    if !e.held {
                        hold.push((shard, pos, e.message.attempts as i32));
                    }
                }
            }
        }
        if drop.is_empty() {
            return Ok(());
        }
        let fail = |e| db_error("cannot keep a parked key's rows aside", e);
        let touched: HashSet<i32> = hold.iter().map(|(s, _, _)| *s).collect();
        let mut kept = HashSet::new();
        if !hold.is_empty() {
            let _writing = self.writes.lock().await;
            let mut tx = pool.begin().await.map_err(fail)?;
            kept = self.fence(&mut tx, inner, &touched, &drop).await?;
            let hold: Vec<&(i32, Pos, i32)> =
                hold.iter().filter(|(s, _, _)| kept.contains(s)).collect();
            self.hold_in(&mut tx, &hold).await.map_err(fail)?;
            tx.commit().await.map_err(fail)?;
        }
        for (&shard, s) in inner.shards.iter_mut() {
            if touched.contains(&shard) && !kept.contains(&shard) {
                continue;
            }
            if kept.contains(&shard) {
                let to = s.cursor_after(&drop);
                s.move_cursor(to);
            }
            let gone: Vec<Pos> = s
                .entries
                .keys()
                .filter(|p| drop.contains(p))
                .copied()
                .collect();
            for pos in gone {
                if let Some(e) = s.entries.remove(&pos) {
                    inner.ids.remove(&e.message.id);
                    if let (Some(key), State::InFlight { .. } | State::Waiting { .. }) =
                        (e.message.key.clone(), e.state)
                    {
                        inner.aside.insert(
                            e.message.id,
                            Aside {
                                shard,
                                seq: pos.1,
                                key,
                                state: e.state,
                                attempts: e.message.attempts,
                            },
                        );
                    }
                }
            }
        }
        self.forget_lost(inner, &touched, &kept);
        Ok(())
    }

    /// Moves `rows` of the log (shard, place, attempts so far) to the held rows, in `tx`.
    pub(super) async fn hold_in(
        &self,
        tx: &mut PgConnection,
        rows: &[&(i32, Pos, i32)],
    ) -> sqlx::Result<()> {
        let positions: Vec<(i32, Pos)> = rows.iter().map(|h| (h.0, h.1)).collect();
        let (shards, xids, seqs) = split(&positions);
        sqlx::query(&self.sql.hold)
            .bind(&shards)
            .bind(&xids)
            .bind(&seqs)
            .bind(rows.iter().map(|h| h.2).collect::<Vec<_>>())
            .execute(tx)
            .await?;
        Ok(())
    }
}
