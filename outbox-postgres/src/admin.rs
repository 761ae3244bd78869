//! The operator's repairs, used by the CLI: dead letters (list, show, replay, purge), parked
//! keys (list, release) and queue figures per topic. The relay never calls these.

use chrono::{DateTime, Utc};
use outbox_core::{Message, Result};
use uuid::Uuid;

use crate::PgStorage;
use crate::error::db_error;
use crate::rows;

impl PgStorage {
    /// Dead-lettered messages, oldest first, at most `limit`.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetterRow>> {
        self.find_dead_letters(&DeadLetterFilter::default(), limit)
            .await
    }

    /// Dead-lettered messages that match `filter`, oldest first, at most `limit`.
    pub async fn find_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: i64,
    ) -> Result<Vec<DeadLetterRow>> {
        let rows = sqlx::query(&self.sql.find_dead_letters)
            .bind(limit)
            .bind(filter.ids.as_deref())
            .bind(filter.topic.as_deref())
            .bind(filter.key.as_deref())
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot list dead letters", e))?;
        rows.iter().map(rows::dead_letter).collect()
    }

    /// Puts dead-lettered messages back into the outbox at their original position (first in
    /// their key's order), with their attempts reset, and releases their keys' parked
    /// messages once no dead letter of the key remains. Returns how many were replayed.
    pub async fn replay_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        let n: i64 = sqlx::query_scalar(&self.sql.replay_dead_letters)
            .bind(ids)
            .bind(self.table().lock_key())
            .fetch_one(self.pool())
            .await
            .map_err(|e| db_error("cannot replay dead letters", e))?;
        Ok(n as u64)
    }

    /// Queue figures per topic, sorted by topic.
    pub async fn topic_stats(&self) -> Result<Vec<TopicStats>> {
        let rows = sqlx::query(&self.sql.topic_stats)
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot read topic figures", e))?;
        rows.iter().map(rows::topic_stats).collect()
    }

    /// Partition keys that are parked, with the dead letter that parked each.
    pub async fn parked_keys(&self) -> Result<Vec<(String, Uuid)>> {
        sqlx::query_as(&self.sql.parked_keys)
            .fetch_all(self.pool())
            .await
            .map_err(|e| db_error("cannot list parked keys", e))
    }

    /// Lets a parked key's messages flow again without replaying its dead letter (which stays
    /// in the dead letters). Returns whether the key was parked.
    pub async fn release_parked_key(&self, key: &str) -> Result<bool> {
        let done = sqlx::query(&self.sql.release_parked_key)
            .bind(key)
            .execute(self.pool())
            .await
            .map_err(|e| db_error("cannot release parked key", e))?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes dead letters for good. Their keys stay parked until released.
    pub async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        let done = sqlx::query(&self.sql.purge_dead_letters)
            .bind(ids)
            .execute(self.pool())
            .await
            .map_err(|e| db_error("cannot purge dead letters", e))?;
        Ok(done.rows_affected())
    }
}

/// Which dead letters an operator command applies to; unset fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only these ids.
    pub ids: Option<Vec<Uuid>>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this partition key.
    pub key: Option<String>,
}

/// Queue figures of one topic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopicStats {
    /// The topic.
    pub topic: String,
    /// Messages waiting (including retries and parked ones).
    pub pending: u64,
    /// Creation time of the oldest pending message.
    pub oldest_pending: Option<DateTime<Utc>>,
    /// Messages claimed under a live lease.
    pub in_flight: u64,
    /// Messages in the dead letters.
    pub dead_lettered: u64,
}

/// A dead-lettered message with why and when it was dead-lettered.
#[derive(Debug, Clone)]
pub struct DeadLetterRow {
    /// The message, with the attempts it used.
    pub message: Message,
    /// The last error.
    pub last_error: String,
    /// When it was dead-lettered.
    pub dead_lettered_at: DateTime<Utc>,
}
