//! The operator's side of a storage: what `outbox status`, `outbox dead-letters …` and
//! `outbox enqueue` do. The relay itself never calls it; every storage the binary runs
//! implements it, so every command works on every storage.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{Message, NewMessage, Result, Storage};

/// Which dead letters an operator command applies to; unset fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only these ids.
    pub ids: Option<Vec<Uuid>>,
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this partition key.
    pub key: Option<String>,
    /// Only dead letters whose last error contains this text, ignoring the case of ASCII
    /// letters. The storage matches it, so a search reads no more rows than it returns.
    pub last_error: Option<String>,
    /// Leave the payloads out: every row's payload is empty. For listings and for picking
    /// ids, which show no payload and should not load megabytes to print a line.
    pub without_payloads: bool,
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
    /// Of the pending messages, those that failed at least one attempt and wait to be tried
    /// again.
    pub retrying: u64,
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

/// A partition key held back behind a dead letter (with per-key order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedKey {
    /// The key.
    pub key: String,
    /// The dead letter that holds it back (the oldest, when there are several).
    pub dead_letter: Uuid,
}

/// The operator's side of a [`Storage`]: creating its tables, enqueueing from outside an
/// application, queue figures per topic, and the dead-letter repairs.
#[async_trait]
pub trait StorageAdmin: Storage {
    /// Where the messages are kept, for logs and `outbox status`, with any password hidden
    /// (for example `postgres://app:***@db/app, table outbox.outbox`).
    fn describe(&self) -> String;

    /// Creates or upgrades the storage's tables. Safe to run again and from several
    /// processes at once.
    async fn migrate(&self) -> Result<()>;

    /// The SQL that [`migrate`](StorageAdmin::migrate) would run now, as one script, for a
    /// database administrator to review and apply: only the steps the database lacks (it is
    /// read, not changed), each with the record of its version. Empty when up to date. The
    /// default says the storage cannot print its migrations.
    async fn migration_sql(&self) -> Result<String> {
        Err(crate::Error::permanent(format!(
            "{} cannot print its migrations; run `outbox migrate` with an account that may \
             change the schema",
            self.describe()
        )))
    }

    /// Enqueues `messages` durably in one transaction of the storage's own (all or none), as
    /// an application's transaction would.
    async fn enqueue(&self, messages: &[NewMessage]) -> Result<()>;

    /// Queue figures per topic, sorted by topic.
    async fn topic_stats(&self) -> Result<Vec<TopicStats>>;

    /// Dead letters that match `filter`, oldest first, at most `limit`.
    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: usize,
    ) -> Result<Vec<DeadLetterRow>>;

    /// Puts dead letters back into the outbox at their original position (first in their
    /// key's order) with their attempts reset, and releases their keys once no dead letter
    /// of the key remains. Returns how many were replayed.
    async fn replay_dead_letters(&self, ids: &[Uuid]) -> Result<u64>;

    /// Deletes dead letters for good. A key parked behind one stays parked until it is
    /// released. Returns how many were deleted.
    async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64>;

    /// The keys held back behind a dead letter.
    async fn parked_keys(&self) -> Result<Vec<ParkedKey>>;

    /// Lets a parked key's messages flow again without replaying its dead letters. Returns
    /// whether the key was parked.
    async fn release_parked_key(&self, key: &str) -> Result<bool>;

    /// How many of the key's messages wait behind its parking: the messages of `key` still
    /// in the outbox, which a parked key holds back until it is replayed or released. `None`
    /// when the storage cannot tell (the default).
    async fn waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        let _ = key;
        Ok(None)
    }
}
