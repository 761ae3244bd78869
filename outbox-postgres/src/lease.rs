//! Lease mode (`[storage] mode = "lease"`, the default): a claim takes rows `FOR UPDATE`
//! under a lease on the database clock and stamps them with its token, which fences every
//! later write; with per-key order, claims are serialised by the table's advisory lock and
//! sweep the keys from a cursor. See docs/ARCHITECTURE.md (the claim protocol).

use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{Claim, ClaimToken, QueueStats, Result, Settlement, TopicStats};
use outbox_sql::saturating_millis;
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use crate::error::db_error;
use crate::rows;
use crate::sql;
use crate::storage::{Mode, Shared};

/// Lease mode's engine: what one relay keeps between claims.
pub(crate) struct LeaseEngine {
    /// The partition key after which the next ordered claim starts its sweep.
    cursor: std::sync::Mutex<String>,
}

impl LeaseEngine {
    pub(crate) fn new() -> Self {
        LeaseEngine {
            cursor: std::sync::Mutex::new(String::new()),
        }
    }
}

#[async_trait]
impl Mode for LeaseEngine {
    async fn migrate(&self, s: &Shared, conn: &mut PgConnection) -> Result<()> {
        s.table.migrate(conn).await
    }

    async fn claim(
        &self,
        s: &Shared,
        worker_id: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Claim> {
        let fail = |e| db_error("claim failed", e);
        let token = ClaimToken(Uuid::now_v7());
        let query = sqlx::query(&s.sql.claim)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(token.0)
            .bind(worker_id)
            .bind(saturating_millis(lease));
        let query = if s.config.per_key_order {
            let cursor = self
                .cursor
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            query.bind(cursor)
        } else {
            query
        };
        let rows = if s.config.per_key_order {
            let mut tx = s.pool.begin().await.map_err(fail)?;
            sqlx::query(sql::CLAIM_LOCK)
                .bind(s.table.lock_key())
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            let rows = query.fetch_all(&mut *tx).await.map_err(fail)?;
            tx.commit().await.map_err(fail)?;
            rows
        } else {
            query.fetch_all(&s.pool).await.map_err(fail)?
        };
        let (messages, cursor) = rows::claimed(&rows)?;
        if let Some(cursor) = cursor {
            *self.cursor.lock().unwrap_or_else(|e| e.into_inner()) = cursor;
        }
        Ok(Claim { token, messages })
    }

    async fn settle(&self, s: &Shared, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        let sql = if settlement.holds_back() {
            &s.sql.settle_holding_back
        } else {
            &s.sql.settle
        };
        let st = settlement;
        let query = sqlx::query(sql)
            .bind(token.0)
            .bind(st.dead.iter().map(|d| d.id).collect::<Vec<Uuid>>())
            .bind(st.dead.iter().map(|d| d.error.as_str()).collect::<Vec<_>>())
            .bind(st.retries.iter().map(|r| r.id).collect::<Vec<Uuid>>())
            .bind(
                st.retries
                    .iter()
                    .map(|r| saturating_millis(r.delay))
                    .collect::<Vec<i64>>(),
            )
            .bind(
                st.retries
                    .iter()
                    .map(|r| r.error.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(st.delivered.iter().map(|d| d.id).collect::<Vec<Uuid>>())
            .bind(
                st.delivered
                    .iter()
                    .map(|d| d.receipt.0.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(st.released.clone());
        s.count("settling a batch failed", query).await
    }

    async fn extend_lease(
        &self,
        s: &Shared,
        token: &ClaimToken,
        ids: &[Uuid],
        lease: Duration,
    ) -> Result<u64> {
        let query = sqlx::query(&s.sql.extend_lease)
            .bind(ids.to_vec())
            .bind(token.0)
            .bind(saturating_millis(lease));
        s.count("renewing a lease failed", query).await
    }

    async fn stats(&self, s: &Shared) -> Result<QueueStats> {
        let row = sqlx::query(&s.sql.stats)
            .fetch_one(&s.pool)
            .await
            .map_err(|e| db_error("cannot read queue figures", e))?;
        rows::queue_stats(&row)
    }

    async fn topic_stats(&self, s: &Shared) -> Result<Vec<TopicStats>> {
        let rows = sqlx::query(&s.sql.topic_stats)
            .fetch_all(&s.pool)
            .await
            .map_err(|e| db_error("cannot read topic figures", e))?;
        rows.iter().map(rows::topic_stats).collect()
    }

    async fn maintain(&self, s: &Shared) -> Result<()> {
        if let Some(retention) = s.config.retention {
            let done = sqlx::query(&s.sql.purge_delivered)
                .bind(saturating_millis(retention))
                .execute(&s.pool)
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

    async fn replay(&self, s: &Shared, ids: &[Uuid]) -> Result<u64> {
        let query = sqlx::query(&s.sql.replay_dead_letters)
            .bind(ids)
            .bind(s.table.lock_key());
        s.count("cannot replay dead letters", query).await
    }

    async fn release(&self, s: &Shared, key: &str) -> Result<bool> {
        let query = sqlx::query(&s.sql.release_parked_key).bind(key);
        Ok(s.execute("cannot release parked key", query).await? > 0)
    }

    async fn waiting_behind(&self, s: &Shared, key: &str) -> Result<u64> {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE partition_key = $1",
            s.table.qualified("")
        );
        let query = sqlx::query(&sql).bind(key);
        s.count("cannot count the messages behind a parked key", query)
            .await
    }
}
