//! The storage trait: where messages wait, and how a relay claims and settles them.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{Message, Receipt, Result};

/// Fences every write made under one claim: a write whose token no longer matches the stored
/// one (the lease expired and another relay claimed the row) changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimToken(pub Uuid);

/// A batch of messages claimed by one worker under a lease.
#[derive(Debug, Clone)]
pub struct Claim {
    /// Token that fences every later write about these messages.
    pub token: ClaimToken,
    /// The claimed messages, in enqueue order.
    pub messages: Vec<Message>,
}

/// A message the sink accepted, with the sink's receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The message id.
    pub id: Uuid,
    /// What the broker returned (stream entry id, partition and offset, ...).
    pub receipt: Receipt,
}

/// A failed message to try again after `delay` (counted on the storage's clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retry {
    /// The message id.
    pub id: Uuid,
    /// How long to wait before the next attempt.
    pub delay: Duration,
    /// The error of this attempt.
    pub error: String,
}

/// A message to move to the dead letters, with the error that put it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The message id.
    pub id: Uuid,
    /// The last error.
    pub error: String,
}

/// Queue figures, for status commands, metrics and health.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Messages waiting to be claimed (including those waiting for a retry and parked ones).
    pub pending: u64,
    /// Creation time of the oldest pending message.
    pub oldest_pending: Option<DateTime<Utc>>,
    /// Messages claimed under a lease that has not expired.
    pub in_flight: u64,
    /// Messages in the dead letters.
    pub dead_lettered: u64,
    /// Partition keys held back because their head message was dead-lettered.
    pub parked_keys: u64,
}

/// What a storage guarantees, declared as data so the worker and the conformance suite can
/// act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StorageCapabilities {
    /// A claim returns a later message of a key only while no earlier one of that key is
    /// pending, in flight or waiting to retry, and claims return one key's messages in order.
    /// The worker then publishes them in order and stops a key at its first failure.
    pub per_key_order: bool,
}

impl StorageCapabilities {
    /// Capabilities with per-key order set as given.
    pub fn new(per_key_order: bool) -> Self {
        StorageCapabilities { per_key_order }
    }
}

/// Where outbox messages wait until a relay delivers them.
///
/// Every write after [`claim`](Storage::claim) takes the claim's token and returns how many
/// messages it changed: a message whose claim was taken over by another worker (its lease
/// expired) is left alone, so a stalled relay can never complete another relay's work.
/// Writes are atomic per call.
#[async_trait]
pub trait Storage: Send + Sync {
    /// Claims up to `limit` messages that are due, for `worker_id`, under a lease of `lease`
    /// counted on the storage's clock. Returns an empty claim when nothing is due.
    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> Result<Claim>;

    /// Records that these messages were delivered (deleting them, or keeping them with
    /// their receipt).
    async fn ack(&self, token: &ClaimToken, delivered: &[Delivery]) -> Result<u64>;

    /// Charges an attempt and makes each message due again after its delay.
    async fn retry(&self, token: &ClaimToken, failed: &[Retry]) -> Result<u64>;

    /// Moves messages to the dead letters. With per-key order, the rest of each message's
    /// key is parked until an operator replays or releases it.
    async fn dead_letter(&self, token: &ClaimToken, dead: &[DeadLetter]) -> Result<u64>;

    /// Gives messages back without charging an attempt (transport failure, shutdown).
    async fn release(&self, token: &ClaimToken, ids: &[Uuid]) -> Result<u64>;

    /// Checks that the storage answers.
    async fn health(&self) -> Result<()>;

    /// Queue figures.
    async fn stats(&self) -> Result<QueueStats>;

    /// What this storage guarantees.
    fn capabilities(&self) -> StorageCapabilities;

    /// Resolves when new messages may be due, for example on a database notification. The
    /// worker races it against its poll interval, so a storage without notifications keeps
    /// this default, which never resolves.
    async fn wait_for_work(&self) -> Result<()> {
        std::future::pending().await
    }

    /// Housekeeping (such as removing kept delivered rows past their retention), called by
    /// the worker now and then. Must do a bounded amount of work per call.
    async fn maintain(&self) -> Result<()> {
        Ok(())
    }
}
