//! Log mode's queue figures (from the tables and this relay's memory), per-topic figures,
//! the horizon's lag and the rows waiting behind a key.

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::{HorizonLag, QueueStats, Result, TopicStats};
use sqlx::Row;
use sqlx::postgres::PgPool;

use super::memory::{Pos, State};
use super::{LogEngine, split};
use crate::error::db_error;
use crate::rows;

impl LogEngine {
    pub(super) async fn stats(&self, pool: &PgPool) -> Result<QueueStats> {
        let fail = |e| db_error("cannot read queue figures", e);
        let inner = self.inner.lock().await;
        let now = self.now();
        let positions: Vec<(i32, Pos)> = inner.shards.iter().map(|(s, sh)| (*s, sh.read)).collect();
        let (shards, xids, seqs) = split(&positions);
        let mut in_flight = 0_u64;
        // Held entries in flight are left out of the held rows' count by their seq.
        let mut held_in_flight: Vec<i64> = Vec::new();
        // Held rows read into memory: their attempts are counted here, not from the table.
        let mut held_read: Vec<i64> = Vec::new();
        let mut pending = 0_u64;
        let mut retrying = 0_u64;
        let mut oldest = None;
        for s in inner.shards.values() {
            for (pos, e) in &s.entries {
                let flying = matches!(e.state, State::InFlight { until, .. } if until > now);
                if e.held {
                    held_read.push(pos.1);
                }
                if flying {
                    in_flight += 1;
                    if e.held {
                        held_in_flight.push(pos.1);
                    }
                    continue;
                }
                if e.message.attempts > 0 {
                    retrying += 1;
                }
                if !e.held {
                    pending += 1;
                    oldest = min_time(oldest, Some(e.message.created_at));
                }
            }
        }
        // Counting the backlog can take seconds: claims, settlements and renewals must not
        // wait for it.
        drop(inner);
        let row = sqlx::query(&self.sql.stats)
            .bind(&shards)
            .bind(&xids)
            .bind(&seqs)
            .bind(&held_in_flight)
            .bind(&held_read)
            .fetch_one(pool)
            .await
            .map_err(fail)?;
        let count =
            |i: usize| -> Result<u64> { Ok(row.try_get::<i64, _>(i).map_err(fail)?.max(0) as u64) };
        Ok(QueueStats {
            pending: pending + count(0)? + count(2)?,
            oldest_pending: min_time(
                oldest,
                min_time(row.try_get(1).map_err(fail)?, row.try_get(3).map_err(fail)?),
            ),
            in_flight,
            retrying: retrying + count(6)?,
            dead_lettered: count(4)?,
            parked_keys: count(5)?,
            measured_at: None,
        })
    }

    /// The figures per topic: rows past the stored cursors and held rows from the table,
    /// what this relay has in flight or waiting to retry from its memory (`$1`: the held
    /// rows read into memory, whose attempts are counted there).
    pub(super) async fn topic_stats(&self, pool: &PgPool) -> Result<Vec<TopicStats>> {
        let inner = self.inner.lock().await;
        let now = self.now();
        let mut held_read: Vec<i64> = Vec::new();
        // By topic: (in flight, retrying).
        let mut mine: HashMap<String, (u64, u64)> = HashMap::new();
        for s in inner.shards.values() {
            for (pos, e) in &s.entries {
                if e.held {
                    held_read.push(pos.1);
                }
                let counts = mine.entry(e.message.topic.clone()).or_default();
                if matches!(e.state, State::InFlight { until, .. } if until > now) {
                    counts.0 += 1;
                } else if e.message.attempts > 0 {
                    counts.1 += 1;
                }
            }
        }
        // Not while holding memory: see `stats`.
        drop(inner);
        let rows = sqlx::query(&self.sql.topic_stats)
            .bind(&held_read)
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot read topic figures", e))?;
        rows.iter()
            .map(|row| {
                let mut t = rows::topic_stats(row)?;
                if let Some(&(in_flight, retrying)) = mine.get(t.topic.as_str()) {
                    // The rows past the cursors include those in flight: pending is the rest.
                    t.pending = t.pending.saturating_sub(in_flight);
                    t.in_flight = in_flight;
                    t.retrying += retrying;
                }
                Ok(t)
            })
            .collect()
    }

    /// How far the readable horizon trails the log, and why: committed rows waiting for an
    /// older transaction of the database to end, and which transaction that is (its backend
    /// and age, or a prepared transaction). With a replica, its horizon (what the relay
    /// reads below), against the primary's rows: rows the replica has not replayed yet
    /// count as waiting.
    pub(super) async fn horizon_lag(&self, pool: &PgPool) -> Result<HorizonLag> {
        let fail = |e| db_error("cannot read the horizon", e);
        let horizon: Option<String> = match &self.replica {
            Some(replica) => Some(
                sqlx::query_scalar(&self.sql.horizon)
                    .fetch_one(replica)
                    .await
                    .map_err(|e| db_error("cannot read the horizon from the replica", e))?,
            ),
            None => None,
        };
        let row = sqlx::query(&self.sql.lag)
            .bind(horizon)
            .fetch_one(pool)
            .await
            .map_err(fail)?;
        let waiting: i64 = row.try_get(0).map_err(fail)?;
        let pid: Option<i32> = row.try_get(1).map_err(fail)?;
        let age: Option<f64> = row.try_get(2).map_err(fail)?;
        let prepared: Option<String> = row.try_get(3).map_err(fail)?;
        Ok(HorizonLag {
            waiting: waiting.max(0) as u64,
            held_by: held_by(pid, prepared),
            held_for: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
        })
    }

    /// The rows of `key` waiting behind it: held aside (a parked or draining key), and past
    /// the stored cursor of its shard.
    pub(crate) async fn waiting_behind(&self, pool: &PgPool, key: &str) -> Result<u64> {
        let n: i64 = sqlx::query_scalar(&self.sql.waiting_behind)
            .bind(key)
            .fetch_one(pool)
            .await
            .map_err(|e| db_error("cannot count the messages behind a parked key", e))?;
        Ok(n.max(0) as u64)
    }
}

pub(super) fn min_time<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What holds the horizon, for people: `backend pid 4242` (the backend whose open
/// transaction holds it) or `prepared transaction 'gid'` (a two-phase commit's);
/// `None` when nothing identifiable does (or a replica has not replayed yet).
fn held_by(pid: Option<i32>, prepared: Option<String>) -> Option<String> {
    match (pid, prepared) {
        (Some(pid), _) => Some(format!("backend pid {pid}")),
        (None, Some(gid)) => Some(format!("prepared transaction '{gid}'")),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::held_by;

    #[test]
    fn the_horizon_is_held_by_a_backend_before_a_prepared_transaction() {
        assert_eq!(
            held_by(Some(4242), None).as_deref(),
            Some("backend pid 4242")
        );
        assert_eq!(
            held_by(Some(7), Some("g".into())).as_deref(),
            Some("backend pid 7")
        );
        assert_eq!(
            held_by(None, Some("order-17".into())).as_deref(),
            Some("prepared transaction 'order-17'")
        );
        assert_eq!(held_by(None, None), None);
    }
}
