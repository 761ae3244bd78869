//! The operator's side ([`StorageAdmin`]), used by the CLI: migrations, enqueue, dead letters
//! (list, show, replay, purge), parked keys (list, release) and queue figures per topic. The
//! relay never calls these.

use async_trait::async_trait;
use outbox_core::{
    DeadLetterFilter, DeadLetterRow, NewMessage, ParkedKey, Result, StorageAdmin, TopicStats,
    redact_url,
};
use sqlx::Row;
use uuid::Uuid;

use crate::MySqlStorage;
use crate::rows;

#[async_trait]
impl StorageAdmin for MySqlStorage {
    fn describe(&self) -> String {
        format!(
            "mysql {}, table {}.{}",
            redact_url(&self.config().url),
            self.table().database(),
            self.table().table()
        )
    }

    async fn migrate(&self) -> Result<()> {
        MySqlStorage::migrate(self).await
    }

    async fn migration_sql(&self) -> Result<String> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(|e| self.error("cannot connect", e))?;
        self.table().migration_sql(&mut conn).await
    }

    async fn enqueue(&self, messages: &[NewMessage]) -> Result<()> {
        let what = "enqueue failed";
        let mut tx = self.pool().begin().await.map_err(|e| self.error(what, e))?;
        match self.table().enqueue_many(&mut tx, messages).await {
            Ok(()) => tx.commit().await.map_err(|e| self.error(what, e)),
            Err(error) => {
                let _ = tx.rollback().await;
                Err(error)
            }
        }
    }

    async fn topic_stats(&self) -> Result<Vec<TopicStats>> {
        let rows = sqlx::query(&self.sql.topic_stats)
            .fetch_all(self.pool())
            .await
            .map_err(|e| self.error("cannot read topic figures", e))?;
        rows.iter().map(rows::topic_stats).collect()
    }

    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: usize,
    ) -> Result<Vec<DeadLetterRow>> {
        let sql = self.sql.find_dead_letters(filter);
        let mut query = sqlx::query(&sql).bind(filter.without_payloads);
        if let Some(ids) = &filter.ids {
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            for id in ids {
                query = query.bind(id.hyphenated().to_string());
            }
        }
        if let Some(topic) = &filter.topic {
            query = query.bind(topic.as_str());
        }
        if let Some(key) = &filter.key {
            query = query.bind(key.as_bytes());
        }
        if let Some(text) = &filter.last_error {
            query = query.bind(text.as_str());
        }
        let rows = query
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(|e| self.error("cannot list dead letters", e))?;
        rows.iter().map(rows::dead_letter).collect()
    }

    async fn replay_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let what = "cannot replay dead letters";
        let ids: Vec<String> = ids.iter().map(|id| id.hyphenated().to_string()).collect();
        // Shared claim lock: a claim never sees a replayed row half restored.
        let mut write = self.write(what, Some(&self.sql.lock_shared)).await?;
        let tx = &mut write.tx;
        let n = ids.len();
        let replayed = async {
            let restore = self.sql.replay_restore(n);
            let mut query = sqlx::query(&restore);
            for id in &ids {
                query = query.bind(id.as_str());
            }
            query.execute(&mut **tx).await?;
            let unpark = self.sql.replay_unpark(n);
            let mut query = sqlx::query(&unpark);
            for id in ids.iter().chain(&ids) {
                query = query.bind(id.as_str());
            }
            query.execute(&mut **tx).await?;
            let delete = self.sql.delete_dead(n);
            let mut query = sqlx::query(&delete);
            for id in &ids {
                query = query.bind(id.as_str());
            }
            Ok(query.execute(&mut **tx).await?.rows_affected())
        }
        .await
        .map_err(|e| self.error(what, e));
        self.finish(what, write, replayed).await
    }

    async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let delete = self.sql.delete_dead(ids.len());
        let mut query = sqlx::query(&delete);
        for id in ids {
            query = query.bind(id.hyphenated().to_string());
        }
        let done = query
            .execute(self.pool())
            .await
            .map_err(|e| self.error("cannot purge dead letters", e))?;
        Ok(done.rows_affected())
    }

    async fn parked_keys(&self) -> Result<Vec<ParkedKey>> {
        let what = "cannot list parked keys";
        let rows = sqlx::query(&self.sql.parked_keys)
            .fetch_all(self.pool())
            .await
            .map_err(|e| self.error(what, e))?;
        rows.iter()
            .map(|row| {
                let key: Vec<u8> = row.try_get(0).map_err(|e| self.error(what, e))?;
                let id = rows::text(row, "dead_letter_id").map_err(|e| self.error(what, e))?;
                outbox_sql::rows::parked_key("mysql", &key, &id)
            })
            .collect()
    }

    async fn release_parked_key(&self, key: &str) -> Result<bool> {
        let done = sqlx::query(&self.sql.release_parked_key)
            .bind(key.as_bytes())
            .execute(self.pool())
            .await
            .map_err(|e| self.error("cannot release parked key", e))?;
        Ok(done.rows_affected() > 0)
    }

    async fn waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE partition_key = ?",
            self.table().qualified("")
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(key.as_bytes())
            .fetch_one(self.pool())
            .await
            .map_err(|e| self.error("cannot count the messages behind a parked key", e))?;
        Ok(Some(n.max(0) as u64))
    }
}
