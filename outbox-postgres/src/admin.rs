//! The operator's side ([`StorageAdmin`]), used by the CLI: migrations, enqueue, dead letters
//! (list, show, replay, purge), parked keys (list, release) and queue figures per topic. The
//! relay never calls these.

use async_trait::async_trait;
use outbox_core::{
    DeadLetterFilter, DeadLetterRow, NewMessage, ParkedKey, Result, StorageAdmin, TopicStats,
    redact_url,
};
use uuid::Uuid;

use crate::PgStorage;
use crate::error::db_error;
use crate::{rows, sql};

#[async_trait]
impl StorageAdmin for PgStorage {
    fn describe(&self) -> String {
        let mode = match self.config().mode {
            crate::StorageMode::Lease => "",
            crate::StorageMode::Log => " (log mode)",
        };
        format!(
            "{}, table {}.{}{mode}",
            redact_url(&self.config().url),
            self.table().schema(),
            self.table().table()
        )
    }

    async fn migrate(&self) -> Result<()> {
        PgStorage::migrate(self).await
    }

    async fn migration_sql(&self) -> Result<String> {
        PgStorage::migration_sql(self).await
    }

    async fn enqueue(&self, messages: &[NewMessage]) -> Result<()> {
        let fail = |e| db_error("enqueue failed", e);
        let mut tx = self.pool().begin().await.map_err(fail)?;
        // The relay's sessions commit without waiting for the disk; an enqueue must not.
        sqlx::query(sql::DURABLE_COMMITS_IN_TRANSACTION)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        self.table().enqueue_many(&mut tx, messages).await?;
        tx.commit().await.map_err(fail)
    }

    async fn topic_stats(&self) -> Result<Vec<TopicStats>> {
        if let Some(log) = &self.log {
            return log.topic_stats(self.pool()).await;
        }
        let rows = sqlx::query(&self.sql.topic_stats)
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot read topic figures", e))?;
        rows.iter().map(rows::topic_stats).collect()
    }

    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: usize,
    ) -> Result<Vec<DeadLetterRow>> {
        let rows = sqlx::query(&self.sql.find_dead_letters)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(filter.ids.as_deref())
            .bind(filter.topic.as_deref())
            .bind(filter.key.as_deref())
            .bind(filter.last_error.as_deref())
            .bind(filter.without_payloads)
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot list dead letters", e))?;
        rows.iter().map(rows::dead_letter).collect()
    }

    async fn replay_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        if let Some(log) = &self.log {
            let n: i64 = sqlx::query_scalar(&log.sql.replay)
                .bind(ids)
                .bind(self.config().per_key_order)
                .fetch_one(self.pool())
                .await
                .map_err(|e| db_error("cannot replay dead letters", e))?;
            return Ok(n.max(0) as u64);
        }
        let n: i64 = sqlx::query_scalar(&self.sql.replay_dead_letters)
            .bind(ids)
            .bind(self.table().lock_key())
            .fetch_one(self.pool())
            .await
            .map_err(|e| db_error("cannot replay dead letters", e))?;
        Ok(n.max(0) as u64)
    }

    async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        let done = sqlx::query(&self.sql.purge_dead_letters)
            .bind(ids)
            .execute(self.pool())
            .await
            .map_err(|e| db_error("cannot purge dead letters", e))?;
        Ok(done.rows_affected())
    }

    async fn parked_keys(&self) -> Result<Vec<ParkedKey>> {
        let rows: Vec<(String, Uuid)> = sqlx::query_as(&self.sql.parked_keys)
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot list parked keys", e))?;
        Ok(rows
            .into_iter()
            .map(|(key, dead_letter)| ParkedKey { key, dead_letter })
            .collect())
    }

    async fn release_parked_key(&self, key: &str) -> Result<bool> {
        let sql = match &self.log {
            // The owner delivers the key's held rows, then unparks it.
            Some(log) => &log.sql.release,
            None => &self.sql.release_parked_key,
        };
        let done = sqlx::query(sql)
            .bind(key)
            .execute(self.pool())
            .await
            .map_err(|e| db_error("cannot release parked key", e))?;
        Ok(done.rows_affected() > 0)
    }

    async fn waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        // Log mode keeps a key's held messages elsewhere (its own count lives in log.rs).
        if self.log.is_some() {
            return self.log_waiting_behind(key).await;
        }
        let sql = format!(
            "SELECT count(*) FROM {} WHERE partition_key = $1",
            self.table().qualified("")
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(key)
            .fetch_one(self.pool())
            .await
            .map_err(|e| db_error("cannot count the messages behind a parked key", e))?;
        Ok(Some(n.max(0) as u64))
    }
}
