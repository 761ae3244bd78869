//! The operator's side ([`StorageAdmin`]), used by the CLI: migrations, enqueue, dead letters
//! (list, show, replay, purge), parked keys (list, release) and queue figures per topic. The
//! relay never calls these.

use async_trait::async_trait;
use outbox_core::{
    DeadLetterFilter, DeadLetterRow, NewMessage, ParkedKey, Result, StorageAdmin, TopicStats,
};
use uuid::Uuid;

use crate::storage::json_ids;
use crate::{SqliteStorage, rows, sql};

#[async_trait]
impl StorageAdmin for SqliteStorage {
    fn describe(&self) -> String {
        format!(
            "sqlite {}, table {}",
            self.config().path.display(),
            self.table().table()
        )
    }

    async fn migrate(&self) -> Result<()> {
        SqliteStorage::migrate(self).await
    }

    async fn migration_sql(&self) -> Result<String> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(|e| self.error("cannot open the database", e))?;
        self.table().migration_sql(&mut conn).await
    }

    async fn enqueue(&self, messages: &[NewMessage]) -> Result<()> {
        let what = "enqueue failed";
        let _writer = self.writer_turn().await;
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(|e| self.error(what, e))?;
        // The relay's connections commit without waiting for the disk; an enqueue must not.
        sqlx::query(sql::DURABLE_COMMITS)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.error(what, e))?;
        let result = async {
            let mut tx = sqlx::Connection::begin_with(&mut *conn, sql::BEGIN_WRITE)
                .await
                .map_err(|e| self.error(what, e))?;
            match self.table().enqueue_many(&mut tx, messages).await {
                Ok(()) => tx.commit().await.map_err(|e| self.error(what, e)),
                Err(error) => {
                    let _ = tx.rollback().await;
                    Err(error)
                }
            }
        }
        .await;
        let _ = sqlx::query(sql::FAST_COMMITS).execute(&mut *conn).await;
        result
    }

    async fn topic_stats(&self) -> Result<Vec<TopicStats>> {
        let what = "cannot read topic figures";
        let now = self.now(what).await?;
        let rows = sqlx::query(&self.sql.topic_stats)
            .bind(now)
            .fetch_all(self.pool())
            .await
            .map_err(|e| self.error(what, e))?;
        rows.iter().map(rows::topic_stats).collect()
    }

    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: usize,
    ) -> Result<Vec<DeadLetterRow>> {
        let search = sqlx::query(&self.sql.find_dead_letters);
        let ids = filter.ids.as_deref().map(|ids| json_ids(ids.iter()));
        let rows = outbox_sql::bind_dead_letter_filter!(search, filter, limit, ids)
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
        let ids = json_ids(ids.iter());
        let mut write = self.write(what).await?;
        let now = write.now;
        let tx = &mut write.tx;
        let replayed = async {
            sqlx::query(&self.sql.replay_restore)
                .bind(ids.as_str())
                .bind(now)
                .execute(&mut **tx)
                .await?;
            sqlx::query(&self.sql.replay_unpark)
                .bind(ids.as_str())
                .execute(&mut **tx)
                .await?;
            let done = sqlx::query(&self.sql.replay_delete)
                .bind(ids.as_str())
                .execute(&mut **tx)
                .await?;
            Ok(done.rows_affected())
        }
        .await
        .map_err(|e| self.error(what, e));
        self.finish(what, write, replayed).await
    }

    async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let what = "cannot purge dead letters";
        let write = self.write(what).await?;
        let query = sqlx::query(&self.sql.purge_dead_letters).bind(json_ids(ids.iter()));
        self.execute_in(what, write, query).await
    }

    async fn parked_keys(&self) -> Result<Vec<ParkedKey>> {
        let what = "cannot list parked keys";
        // Read as bytes: a key that is not valid UTF-8 (see rows.rs) is listed, lossily.
        let rows: Vec<(Vec<u8>, String)> = sqlx::query_as(&self.sql.parked_keys)
            .fetch_all(self.pool())
            .await
            .map_err(|e| self.error(what, e))?;
        rows.into_iter()
            .map(|(key, id)| outbox_sql::rows::parked_key("sqlite", &key, &id))
            .collect()
    }

    async fn release_parked_key(&self, key: &str) -> Result<bool> {
        let what = "cannot release parked key";
        let write = self.write(what).await?;
        let query = sqlx::query(&self.sql.release_parked_key).bind(key);
        Ok(self.execute_in(what, write, query).await? > 0)
    }

    async fn waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE partition_key = ?1",
            self.table().quoted("")
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(key)
            .fetch_one(self.pool())
            .await
            .map_err(|e| self.error("cannot count the messages behind a parked key", e))?;
        Ok(Some(n.max(0) as u64))
    }
}
