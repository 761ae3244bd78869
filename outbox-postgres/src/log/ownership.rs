//! Shard ownership: the rounds that renew this relay's shards, take free ones up to a fair
//! share and hand those above it over; the epoch fence every write of a shard's cursor
//! passes; giving shards up.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use outbox_core::{Error, Result};
use outbox_sql::saturating_millis;
use sqlx::postgres::PgPool;

use super::memory::{Inner, Pos, Shard, cursor_positions};
use super::{LogEngine, parse_xid, split};
use crate::error::db_error;

impl LogEngine {
    /// Renews owned shards (dropping those another relay took), records this relay as
    /// alive, and takes free or expired shards up to a fair share (shards ÷ live relays,
    /// rounded up), giving up idle ones above it.
    pub(super) async fn round(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        lease: Duration,
    ) -> Result<()> {
        let fail = |e| db_error("cannot renew or take shards", e);
        if inner.last_round.is_none() {
            self.refuse_a_moved_log(pool).await?;
        }
        let _writing = self.writes.lock().await;
        let ms = saturating_millis(lease);
        let asked_at = self.now();
        let mut tx = pool.begin().await.map_err(fail)?;
        sqlx::query(&self.sql.heartbeat)
            .bind(&self.owner)
            .bind(ms)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        let (owned, epochs): (Vec<i32>, Vec<i64>) =
            inner.shards.iter().map(|(s, sh)| (*s, sh.epoch)).unzip();
        let kept: Vec<i32> = sqlx::query_scalar(&self.sql.renew)
            .bind(&owned)
            .bind(&epochs)
            .bind(ms)
            .bind(&self.owner)
            .fetch_all(&mut *tx)
            .await
            .map_err(fail)?;
        let (total, live): (i64, i64) = sqlx::query_as(&self.sql.counts)
            .fetch_one(&mut *tx)
            .await
            .map_err(fail)?;
        let live = live.max(1);
        let fair = usize::try_from((total + live - 1) / live).unwrap_or(0);
        let mut acquired: Vec<(i32, i64, String, i64, String)> = Vec::new();
        let mut given_up: Vec<i32> = Vec::new();
        let mut leaving: HashSet<i32> = HashSet::new();
        if kept.len() < fair {
            acquired = sqlx::query_as(&self.sql.acquire)
                .bind(&self.owner)
                .bind(ms)
                .bind(i64::try_from(fair - kept.len()).unwrap_or(0))
                .bind(&kept)
                .bind(self.start_now)
                .fetch_all(&mut *tx)
                .await
                .map_err(fail)?;
        } else if kept.len() > fair {
            // Hand over the shards already leaving, then those with the least read: they
            // stop reading and handing out now, and are given up once no live claim holds
            // a row of theirs (a row waiting to retry does not keep them: it is read again
            // from the stored cursor).
            let mut by_load: Vec<(bool, usize, i32)> = kept
                .iter()
                .filter_map(|s| {
                    let sh = inner.shards.get(s)?;
                    Some((!sh.leaving, sh.entries.len(), *s))
                })
                .collect();
            by_load.sort_unstable();
            leaving = by_load
                .iter()
                .take(kept.len() - fair)
                .map(|(_, _, s)| *s)
                .collect();
            given_up = leaving
                .iter()
                .copied()
                .filter(|s| !inner.has_live_claims(*s, asked_at))
                .collect();
            self.give_up_in(&mut tx, inner, &given_up).await?;
        }
        tx.commit().await.map_err(fail)?;
        let kept: HashSet<i32> = kept.into_iter().collect();
        for shard in owned {
            if !kept.contains(&shard) {
                tracing::warn!(relay = %self.owner, shard, "another relay took this shard over; dropping what was read of it");
                inner.drop_shard(shard);
            }
        }
        for shard in given_up {
            tracing::debug!(relay = %self.owner, shard, "gave a shard up (more relays are alive)");
            inner.drop_shard(shard);
        }
        for (shard, s) in inner.shards.iter_mut() {
            s.leaving = leaving.contains(shard);
        }
        for (shard, epoch, xid, seq, lsn) in acquired {
            let cursor = (parse_xid(&xid)?, seq);
            inner.replica_from = Some(lsn);
            tracing::debug!(relay = %self.owner, shard, epoch, "took a shard");
            inner.shards.insert(
                shard,
                Shard {
                    epoch,
                    cursor,
                    read: cursor,
                    entries: BTreeMap::new(),
                    delivered: BTreeSet::new(),
                    evicted: HashMap::new(),
                    leaving: false,
                },
            );
        }
        inner.last_round = Some(asked_at);
        inner.held_until = Some(asked_at + lease);
        Ok(())
    }

    /// Refuses to read a log whose transaction ids are ahead of this cluster's (moved from
    /// another cluster): the cursors would pass every new row (see
    /// [`OutboxTable::moved_log_sql`](crate::OutboxTable::moved_log_sql)). A schema error,
    /// so the relay waits, retrying, until `outbox migrate` rebases it.
    pub(super) async fn refuse_a_moved_log(&self, pool: &PgPool) -> Result<()> {
        let moved: Option<(i32, String, String)> = sqlx::query_as(&self.sql.moved)
            .fetch_optional(pool)
            .await
            .map_err(|e| db_error("cannot check the log's transaction ids", e))?;
        match moved {
            None => Ok(()),
            Some((shard, ahead, next)) => Err(Error::schema(format!(
                "postgres: the log table's shard {shard} is at transaction id {ahead}, ahead of \
                 this cluster's next id {next}: the table was moved from another cluster \
                 (pg_dump and restore, logical replication). Reading it would pass every new \
                 message. Stop the relays and run `outbox migrate`, which rebases the log onto \
                 this cluster's ids (docs/storage/postgres.md, moving a log table)"
            ))),
        }
    }

    /// Gives `shards` up (those still this relay's, by their epoch), with the rows
    /// delivered past their cursors, in `conn`.
    pub(super) async fn give_up_in(
        &self,
        conn: &mut sqlx::PgConnection,
        inner: &Inner,
        shards: &[i32],
    ) -> Result<()> {
        let mut epochs = Vec::new();
        let mut delivered: Vec<(i32, Pos)> = Vec::new();
        for shard in shards {
            if let Some(s) = inner.shards.get(shard) {
                epochs.push(s.epoch);
                delivered.extend(s.delivered.iter().map(|p| (*shard, *p)));
            }
        }
        let (d_shards, d_xids, d_seqs) = split(&delivered);
        sqlx::query(&self.sql.give_up)
            .bind(shards)
            .bind(&epochs)
            .bind(&self.owner)
            .bind(&d_shards)
            .bind(&d_xids)
            .bind(&d_seqs)
            .execute(conn)
            .await
            .map_err(|e| db_error("cannot give shards up", e))?;
        Ok(())
    }

    /// Moves the cursors of `touched` shards (to where they stand once `removed` are gone)
    /// under the epoch fence, in `tx`; returns the shards still owned.
    pub(super) async fn fence(
        &self,
        tx: &mut sqlx::PgConnection,
        inner: &Inner,
        touched: &HashSet<i32>,
        removed: &HashSet<Pos>,
    ) -> Result<HashSet<i32>> {
        let (positions, epochs) = cursor_positions(inner, touched, removed);
        move_cursors(tx, &self.sql.move_cursors, &self.owner, &positions, &epochs).await
    }

    /// Renews the lease of `shards` (those still this relay's, by their epoch) for `lease`
    /// from now on the database clock; drops the others. Returns the shards renewed.
    pub(super) async fn renew(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        shards: &HashSet<i32>,
        lease: Duration,
    ) -> Result<HashSet<i32>> {
        let (list, epochs): (Vec<i32>, Vec<i64>) = shards
            .iter()
            .filter_map(|s| inner.shards.get(s).map(|sh| (*s, sh.epoch)))
            .unzip();
        let kept: Vec<i32> = sqlx::query_scalar(&self.sql.renew)
            .bind(&list)
            .bind(&epochs)
            .bind(saturating_millis(lease))
            .bind(&self.owner)
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot renew shards", e))?;
        let kept: HashSet<i32> = kept.into_iter().collect();
        self.forget_lost(inner, shards, &kept);
        Ok(kept)
    }

    /// Drops the shards of `touched` that the fence found taken over.
    pub(super) fn forget_lost(
        &self,
        inner: &mut Inner,
        touched: &HashSet<i32>,
        kept: &HashSet<i32>,
    ) {
        for shard in touched {
            if !kept.contains(shard) && inner.shards.contains_key(shard) {
                tracing::warn!(relay = %self.owner, shard, "shard taken over by another relay: its writes were refused");
                inner.drop_shard(*shard);
            }
        }
    }

    /// Gives every owned shard up at once (their cursors are stored), so other relays take
    /// them without waiting for the lease; what was read and not settled is read again by
    /// the next owner.
    pub(super) async fn give_up(&self, pool: &PgPool) -> Result<()> {
        let mut inner = self.inner.lock().await;
        // After the last cursor write, or the next owner delivers its batch again.
        let _writing = self.writes.lock().await;
        let shards: Vec<i32> = inner.shards.keys().copied().collect();
        let fail = |e| db_error("cannot give shards up", e);
        let mut conn = pool.acquire().await.map_err(fail)?;
        self.give_up_in(&mut conn, &inner, &shards).await?;
        sqlx::query(&self.sql.forget_relay)
            .bind(&self.owner)
            .execute(pool)
            .await
            .map_err(fail)?;
        *inner = Inner::default();
        Ok(())
    }
}

/// Moves the cursors of shards to `positions` under the epoch fence (`epochs`, `owner`);
/// returns the shards still owned.
pub(super) async fn move_cursors(
    conn: &mut sqlx::PgConnection,
    sql: &str,
    owner: &str,
    positions: &[(i32, Pos)],
    epochs: &[i64],
) -> Result<HashSet<i32>> {
    let (shards, xids, seqs) = split(positions);
    let kept: Vec<i32> = sqlx::query_scalar(sql)
        .bind(&shards)
        .bind(&xids)
        .bind(&seqs)
        .bind(epochs)
        .bind(owner)
        .fetch_all(conn)
        .await
        .map_err(|e| db_error("cannot move the cursor", e))?;
    Ok(kept.into_iter().collect())
}
