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
        self.mode().topic_stats(&self.shared).await
    }

    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: usize,
    ) -> Result<Vec<DeadLetterRow>> {
        let search = sqlx::query(&self.shared.sql.find_dead_letters);
        let ids = filter.ids.as_deref();
        let rows = outbox_sql::bind_dead_letter_filter!(search, filter, limit, ids)
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot list dead letters", e))?;
        rows.iter().map(rows::dead_letter).collect()
    }

    async fn replay_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        self.mode().replay(&self.shared, ids).await
    }

    async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        let query = sqlx::query(&self.shared.sql.purge_dead_letters).bind(ids);
        self.shared
            .execute("cannot purge dead letters", query)
            .await
    }

    async fn parked_keys(&self) -> Result<Vec<ParkedKey>> {
        let rows: Vec<(String, Uuid)> = sqlx::query_as(&self.shared.sql.parked_keys)
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot list parked keys", e))?;
        Ok(rows
            .into_iter()
            .map(|(key, dead_letter)| ParkedKey { key, dead_letter })
            .collect())
    }

    async fn release_parked_key(&self, key: &str) -> Result<bool> {
        self.mode().release(&self.shared, key).await
    }

    async fn waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        self.mode()
            .waiting_behind(&self.shared, key)
            .await
            .map(Some)
    }
}
