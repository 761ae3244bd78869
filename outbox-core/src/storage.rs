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

/// The outcome of one claimed batch, written by [`Storage::settle`] in one atomic step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settlement {
    /// Messages the sink accepted: deleted, or kept with their receipt.
    pub delivered: Vec<Delivery>,
    /// Messages that failed and are tried again after a delay (an attempt is charged).
    pub retries: Vec<Retry>,
    /// Messages moved to the dead letters (with per-key order, their keys are parked).
    pub dead: Vec<DeadLetter>,
    /// Messages given back unpublished, without charging an attempt.
    pub released: Vec<Uuid>,
}

impl Settlement {
    /// How many messages this settlement is about.
    pub fn len(&self) -> usize {
        self.delivered.len() + self.retries.len() + self.dead.len() + self.released.len()
    }

    /// Whether it is about no message at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it holds back a key's first message (a retry or a dead letter): the writes a
    /// claim must never see half done.
    pub fn holds_back(&self) -> bool {
        !self.retries.is_empty() || !self.dead.is_empty()
    }
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
    /// Of the pending messages, those that failed at least one attempt and wait to be tried
    /// again (the sink refused them; they are dead-lettered after `max_attempts`).
    pub retrying: u64,
    /// Messages in the dead letters.
    pub dead_lettered: u64,
    /// Partition keys held back because their head message was dead-lettered.
    pub parked_keys: u64,
    /// When these figures were counted, on the storage's clock, if they may be older than
    /// the call that returned them ([`Storage::shared_stats`]); `None` means just now.
    pub measured_at: Option<DateTime<Utc>>,
}

/// How far the readable horizon of a storage whose messages wait for older transactions
/// ([`StorageCapabilities::waits_for_older_transactions`], such as PostgreSQL's log mode)
/// trails what is committed: [`Storage::horizon`]. For a metric and `outbox status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HorizonLag {
    /// Committed messages not claimable yet because an older transaction is still open
    /// (or, reading from a replica, not replayed there yet).
    pub waiting: u64,
    /// What holds the horizon, for people, e.g. `backend pid 4242` or `prepared
    /// transaction 'order-17'`; `None` when nothing identifiable does.
    pub held_by: Option<String>,
    /// How long that transaction has been open, when known.
    pub held_for: Option<Duration>,
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
    /// With per-key order, the most messages of one key a claim returns (`None`: up to the
    /// claim's limit). The worker publishes a key's messages one round after another, so this
    /// bounds the rounds of a batch, which the worker checks against the lease at start-up.
    pub max_per_key: Option<usize>,
    /// A committed message becomes claimable only once every transaction that began
    /// writing before it has ended (a storage that reads below the oldest running
    /// transaction, such as PostgreSQL's log mode): a long-open transaction delays later
    /// messages, and no message can commit behind one already claimed.
    pub waits_for_older_transactions: bool,
}

impl StorageCapabilities {
    /// Capabilities with per-key order set as given.
    pub fn new(per_key_order: bool) -> Self {
        StorageCapabilities {
            per_key_order,
            max_per_key: None,
            waits_for_older_transactions: false,
        }
    }

    /// Capabilities of a storage configured with `per_key_order` and `max_per_key` (the SQL
    /// storages' settings of those names): the limit applies only with per-key order.
    pub fn keyed(per_key_order: bool, max_per_key: usize) -> Self {
        Self::new(per_key_order).with_max_per_key(per_key_order.then_some(max_per_key))
    }
}

crate::setters!(StorageCapabilities {
    /// Sets whether committed messages wait for older transactions to end.
    with_waits_for_older_transactions(waits: bool) => waits_for_older_transactions = waits;
    /// Sets the most messages of one key a claim returns.
    with_max_per_key(max_per_key: Option<usize>) => max_per_key = max_per_key;
});

/// Where outbox messages wait until a relay delivers them.
///
/// Every write after [`claim`](Storage::claim) takes the claim's token and returns how many
/// messages it changed: a message whose claim was taken over by another worker (its lease
/// expired) is left alone, so a stalled relay can never complete another relay's work.
///
/// **The claim rule with per-key order.** A claim takes a key's messages from its first one
/// that is still in the storage, in order, and stops the key at its first message that is
/// not due (in flight under another claim, or waiting to retry), whatever state the later
/// ones are in; it takes nothing of a parked key. Messages of uncommitted transactions are
/// invisible and hold nothing back.
#[async_trait]
pub trait Storage: Send + Sync {
    /// Claims up to `limit` messages that are due, for `worker_id`, under a lease of `lease`
    /// counted on the storage's clock from the moment the claim is made (not from when its
    /// call or transaction began). Returns an empty claim when nothing is due.
    async fn claim(&self, worker_id: &str, limit: usize, lease: Duration) -> Result<Claim>;

    /// Writes the outcome of a claimed batch atomically: every delivery, retry, dead letter
    /// and release in it, or (on error) none of them. Each message is changed only if it is
    /// still held under `token`. Returns how many messages were changed.
    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64>;

    /// Renews the lease of messages still held under `token` for another `lease` from now,
    /// on the storage's clock. Returns how many were renewed: fewer than `ids` means some
    /// were taken over (the lease had run out), and the batch must stop publishing.
    async fn extend_lease(&self, token: &ClaimToken, ids: &[Uuid], lease: Duration) -> Result<u64>;

    /// Checks that the storage answers.
    async fn health(&self) -> Result<()>;

    /// Queue figures, counted now.
    async fn stats(&self) -> Result<QueueStats>;

    /// Queue figures that every relay on this storage shares: the first caller after
    /// `max_age` has passed counts them ([`stats`](Storage::stats)) and stores them; the
    /// others read what it stored, so many replicas cost one count per `max_age`, not one
    /// each. A count that never finishes (its relay died) is taken over after `max_age`.
    /// The default counts on every call, for storages that one process owns.
    async fn shared_stats(&self, max_age: Duration) -> Result<QueueStats> {
        let _ = max_age;
        self.stats().await
    }

    /// What this storage guarantees.
    fn capabilities(&self) -> StorageCapabilities;

    /// Resolves when new messages may be due, for example on a database notification. The
    /// worker races it against its poll interval, so a storage without notifications keeps
    /// this default, which never resolves.
    async fn wait_for_work(&self) -> Result<()> {
        std::future::pending().await
    }

    /// How far the readable horizon trails the committed messages, and what holds it, for a
    /// storage that [waits for older transactions](StorageCapabilities::waits_for_older_transactions);
    /// `None` for the others (the default).
    async fn horizon(&self) -> Result<Option<HorizonLag>> {
        Ok(None)
    }

    /// Housekeeping (such as removing kept delivered rows past their retention), called by
    /// the worker now and then. Must do a bounded amount of work per call.
    async fn maintain(&self) -> Result<()> {
        Ok(())
    }

    /// Called once when a worker stops (shutdown): gives up what this relay holds that other
    /// relays could take at once (a log-mode storage's shards). The default does nothing.
    async fn stop(&self) -> Result<()> {
        Ok(())
    }

    /// Records that these messages were delivered: [`settle`](Storage::settle) with
    /// deliveries only.
    async fn ack(&self, token: &ClaimToken, delivered: &[Delivery]) -> Result<u64> {
        let settlement = Settlement {
            delivered: delivered.to_vec(),
            ..Settlement::default()
        };
        self.settle(token, &settlement).await
    }

    /// Charges an attempt and makes each message due again after its delay:
    /// [`settle`](Storage::settle) with retries only.
    async fn retry(&self, token: &ClaimToken, failed: &[Retry]) -> Result<u64> {
        let settlement = Settlement {
            retries: failed.to_vec(),
            ..Settlement::default()
        };
        self.settle(token, &settlement).await
    }

    /// Moves messages to the dead letters (with per-key order, parking their keys):
    /// [`settle`](Storage::settle) with dead letters only.
    async fn dead_letter(&self, token: &ClaimToken, dead: &[DeadLetter]) -> Result<u64> {
        let settlement = Settlement {
            dead: dead.to_vec(),
            ..Settlement::default()
        };
        self.settle(token, &settlement).await
    }

    /// Gives messages back without charging an attempt: [`settle`](Storage::settle) with
    /// releases only.
    async fn release(&self, token: &ClaimToken, ids: &[Uuid]) -> Result<u64> {
        let settlement = Settlement {
            released: ids.to_vec(),
            ..Settlement::default()
        };
        self.settle(token, &settlement).await
    }
}
