//! In-memory storage and sink (cargo feature `memory`), for tests of the worker and of code
//! built on the traits. They follow the same contracts as the real backends, on tokio's
//! clock, so tests can run them with a paused clock.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    Claim, ClaimToken, DeadLetterFilter, DeadLetterRow, Error, Message, NewMessage, Outcome,
    ParkedKey, QueueStats, Receipt, Result, Settlement, Sink, Storage, StorageAdmin,
    StorageCapabilities, TopicStats,
};

#[cfg(test)]
mod tests;

struct Row {
    message: Message,
    /// False while the transaction that wrote it is open.
    visible: bool,
    due: Instant,
    token: Option<ClaimToken>,
    last_error: Option<String>,
}

impl Row {
    /// Claimed under a lease that has not run out at `now`: in flight, not pending.
    fn leased(&self, now: Instant) -> bool {
        self.token.is_some() && self.due > now
    }
}

/// Whether `dead` matches every field of `filter` that is set; `error` is the filter's
/// [`last_error`](DeadLetterFilter::last_error) in ASCII lower case.
fn matches(filter: &DeadLetterFilter, dead: &Dead, error: Option<&str>) -> bool {
    let m = &dead.message;
    filter.ids.as_ref().is_none_or(|ids| ids.contains(&m.id))
        && filter.topic.as_ref().is_none_or(|t| *t == m.topic)
        && filter
            .key
            .as_ref()
            .is_none_or(|k| m.key.as_ref() == Some(k))
        && error.is_none_or(|e| dead.error.to_ascii_lowercase().contains(e))
}

/// A dead-lettered message, with the sequence number it keeps for a replay.
struct Dead {
    seq: u64,
    message: Message,
    error: String,
    /// When it was dead-lettered, on the wall clock.
    at: DateTime<Utc>,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    rows: BTreeMap<u64, Row>,
    delivered: Vec<(Message, Receipt)>,
    /// Dead letters, in the order they were dead-lettered.
    dead: Vec<Dead>,
    /// Parked keys, each with the dead letter that parked it.
    parked: BTreeMap<String, Uuid>,
    /// How far [`MemoryStorage::advance`] moved this storage's clock ahead of tokio's.
    offset: Duration,
}

impl State {
    fn now(&self) -> Instant {
        Instant::now() + self.offset
    }

    fn held(&mut self, id: Uuid, token: &ClaimToken) -> Option<u64> {
        self.rows
            .iter()
            .find(|(_, r)| r.message.id == id && r.token.as_ref() == Some(token))
            .map(|(seq, _)| *seq)
    }
}

/// Messages written by [`MemoryStorage::begin`] and not yet committed or rolled back.
#[derive(Debug)]
#[must_use = "commit or roll back the transaction"]
pub struct MemoryTransaction {
    seqs: Vec<u64>,
}

/// A [`Storage`] in memory with the same claim rules as the PostgreSQL one; the reference
/// that the conformance suite and the randomised tests hold real storages to.
pub struct MemoryStorage {
    state: Mutex<State>,
    per_key_order: bool,
    notify: Notify,
}

impl MemoryStorage {
    /// An empty storage, keeping per-key order or not.
    pub fn new(per_key_order: bool) -> Self {
        MemoryStorage {
            state: Mutex::new(State::default()),
            per_key_order,
            notify: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Enqueues a message (a committed transaction of one) and wakes a waiting worker.
    pub fn enqueue(&self, message: NewMessage) {
        let tx = self.begin(vec![message]);
        self.commit(tx);
    }

    /// Writes `messages` as an application transaction would: they take their sequence
    /// numbers now, in order, but stay invisible to claims until [`commit`](Self::commit).
    pub fn begin(&self, messages: Vec<NewMessage>) -> MemoryTransaction {
        let mut state = self.lock();
        let now = state.now();
        let mut seqs = Vec::with_capacity(messages.len());
        for message in messages {
            state.next_seq += 1;
            let seq = state.next_seq;
            state.rows.insert(
                seq,
                Row {
                    message: message.into(),
                    visible: false,
                    due: now,
                    token: None,
                    last_error: None,
                },
            );
            seqs.push(seq);
        }
        MemoryTransaction { seqs }
    }

    /// Commits a transaction: its messages become claimable.
    pub fn commit(&self, tx: MemoryTransaction) {
        let mut state = self.lock();
        let now = state.now();
        for seq in tx.seqs {
            if let Some(row) = state.rows.get_mut(&seq) {
                row.visible = true;
                row.due = now;
            }
        }
        drop(state);
        self.notify.notify_one();
    }

    /// Rolls a transaction back: its messages are gone.
    pub fn rollback(&self, tx: MemoryTransaction) {
        let mut state = self.lock();
        for seq in tx.seqs {
            state.rows.remove(&seq);
        }
    }

    /// Moves this storage's clock ahead by `by` (leases and retry delays run out sooner),
    /// for tests that cannot pause tokio's clock.
    pub fn advance(&self, by: Duration) {
        self.lock().offset += by;
    }

    /// Delivered messages with their receipts, in acknowledgement order.
    pub fn delivered(&self) -> Vec<(Message, Receipt)> {
        self.lock().delivered.clone()
    }

    /// Dead-lettered messages with their last error.
    pub fn dead_letters(&self) -> Vec<(Message, String)> {
        self.lock()
            .dead
            .iter()
            .map(|d| (d.message.clone(), d.error.clone()))
            .collect()
    }

    /// Puts dead letters back at their original place in their key's order, with their
    /// attempts reset, and unparks each key once none of its dead letters remain. Returns
    /// how many were replayed.
    pub fn replay_dead_letters(&self, ids: &[Uuid]) -> u64 {
        let mut state = self.lock();
        let now = state.now();
        let (back, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut state.dead)
            .into_iter()
            .partition(|d| ids.contains(&d.message.id));
        state.dead = kept;
        let n = back.len() as u64;
        for Dead {
            seq,
            mut message,
            error,
            ..
        } in back
        {
            message.attempts = 0;
            if let Some(key) = &message.key
                && !state
                    .dead
                    .iter()
                    .any(|d| d.message.key.as_ref() == Some(key))
            {
                state.parked.remove(key);
            }
            state.rows.insert(
                seq,
                Row {
                    message,
                    visible: true,
                    due: now,
                    token: None,
                    last_error: Some(error),
                },
            );
        }
        drop(state);
        self.notify.notify_one();
        n
    }

    /// Deletes dead letters for good; their keys stay parked. Returns how many were deleted.
    pub fn purge_dead_letters(&self, ids: &[Uuid]) -> u64 {
        let mut state = self.lock();
        let before = state.dead.len();
        state.dead.retain(|d| !ids.contains(&d.message.id));
        (before - state.dead.len()) as u64
    }

    /// Lets a parked key's messages flow again without replaying its dead letter. Returns
    /// whether the key was parked.
    pub fn release_parked_key(&self, key: &str) -> bool {
        let released = self.lock().parked.remove(key).is_some();
        self.notify.notify_one();
        released
    }

    /// Messages still in the queue (pending, in flight or waiting to retry), in order;
    /// uncommitted ones are not counted.
    pub fn pending(&self) -> Vec<Message> {
        self.lock()
            .rows
            .values()
            .filter(|r| r.visible)
            .map(|r| r.message.clone())
            .collect()
    }

    /// The last error recorded for a message still in the queue.
    pub fn last_error(&self, id: Uuid) -> Option<String> {
        self.lock()
            .rows
            .values()
            .find(|r| r.message.id == id)
            .and_then(|r| r.last_error.clone())
    }
}

#[async_trait]
impl Storage for MemoryStorage {
    async fn claim(&self, _worker_id: &str, limit: usize, lease: Duration) -> Result<Claim> {
        let token = ClaimToken(Uuid::now_v7());
        let mut state = self.lock();
        let now = state.now();
        let State { rows, parked, .. } = &mut *state;
        // Keys stopped at a message that is not due: nothing after it may go.
        let mut stopped: HashSet<String> = HashSet::new();
        let mut messages = Vec::new();
        for row in rows.values_mut().filter(|r| r.visible) {
            if messages.len() == limit {
                break;
            }
            let key = row.message.key.clone().filter(|_| self.per_key_order);
            if let Some(k) = &key
                && (parked.contains_key(k) || stopped.contains(k))
            {
                continue;
            }
            if row.due > now {
                if let Some(k) = key {
                    stopped.insert(k);
                }
                continue;
            }
            row.due = now + lease;
            row.token = Some(token);
            messages.push(row.message.clone());
        }
        Ok(Claim { token, messages })
    }

    async fn settle(&self, token: &ClaimToken, settlement: &Settlement) -> Result<u64> {
        let mut state = self.lock();
        let now = state.now();
        let mut n = 0;
        for d in &settlement.dead {
            if let Some(seq) = state.held(d.id, token) {
                let Some(mut row) = state.rows.remove(&seq) else {
                    continue;
                };
                row.message.attempts += 1;
                if let (true, Some(key)) = (self.per_key_order, &row.message.key) {
                    // A key already parked stays parked behind its first dead letter.
                    state.parked.entry(key.clone()).or_insert(row.message.id);
                }
                state.dead.push(Dead {
                    seq,
                    message: row.message,
                    error: d.error.clone(),
                    at: Utc::now(),
                });
                n += 1;
            }
        }
        for f in &settlement.retries {
            if let Some(seq) = state.held(f.id, token)
                && let Some(row) = state.rows.get_mut(&seq)
            {
                row.message.attempts += 1;
                row.due = now + f.delay;
                row.token = None;
                row.last_error = Some(f.error.clone());
                n += 1;
            }
        }
        for d in &settlement.delivered {
            if let Some(seq) = state.held(d.id, token)
                && let Some(row) = state.rows.remove(&seq)
            {
                state.delivered.push((row.message, d.receipt.clone()));
                n += 1;
            }
        }
        for id in &settlement.released {
            if let Some(seq) = state.held(*id, token)
                && let Some(row) = state.rows.get_mut(&seq)
            {
                row.due = now;
                row.token = None;
                n += 1;
            }
        }
        Ok(n)
    }

    async fn extend_lease(&self, token: &ClaimToken, ids: &[Uuid], lease: Duration) -> Result<u64> {
        let mut state = self.lock();
        let until = state.now() + lease;
        let mut n = 0;
        for id in ids {
            if let Some(seq) = state.held(*id, token)
                && let Some(row) = state.rows.get_mut(&seq)
            {
                row.due = until;
                n += 1;
            }
        }
        Ok(n)
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    async fn stats(&self) -> Result<QueueStats> {
        let state = self.lock();
        let now = state.now();
        let rows = || state.rows.values().filter(|r| r.visible);
        let waiting = |r: &&Row| !r.leased(now);
        Ok(QueueStats {
            pending: rows().filter(waiting).count() as u64,
            oldest_pending: rows().filter(waiting).map(|r| r.message.created_at).min(),
            in_flight: rows().filter(|r| !waiting(r)).count() as u64,
            retrying: rows()
                .filter(|r| waiting(r) && r.message.attempts > 0)
                .count() as u64,
            dead_lettered: state.dead.len() as u64,
            parked_keys: state.parked.len() as u64,
            measured_at: None,
        })
    }

    fn capabilities(&self) -> StorageCapabilities {
        StorageCapabilities::new(self.per_key_order)
    }

    async fn wait_for_work(&self) -> Result<()> {
        self.notify.notified().await;
        Ok(())
    }
}

/// The operator's side, as the SQL storages do it: what `outbox status` and the dead-letter
/// commands see. The repairs are the inherent methods of the same names.
#[async_trait]
impl StorageAdmin for MemoryStorage {
    fn describe(&self) -> String {
        "memory".to_string()
    }

    /// Nothing to create: an in-memory storage is always up to date.
    async fn migrate(&self) -> Result<()> {
        Ok(())
    }

    /// Empty: [`migrate`](StorageAdmin::migrate) has nothing to run.
    async fn migration_sql(&self) -> Result<String> {
        Ok(String::new())
    }

    /// Enqueues `messages` as one committed transaction and wakes a waiting worker. Like a
    /// table's unique index on the id, a message whose id is already in the queue (or twice
    /// in `messages`) fails the whole call, and none is enqueued.
    async fn enqueue(&self, messages: &[NewMessage]) -> Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        {
            let state = self.lock();
            let mut ids: HashSet<Uuid> = state.rows.values().map(|r| r.message.id).collect();
            if let Some(m) = messages.iter().find(|m| !ids.insert(m.id)) {
                return Err(Error::permanent(format!(
                    "memory: enqueue failed: message {} is already in the outbox",
                    m.id
                )));
            }
        }
        let tx = self.begin(messages.to_vec());
        self.commit(tx);
        Ok(())
    }

    /// Figures per topic of the committed messages and the dead letters, on this storage's
    /// clock: a message claimed under a lease that ran out counts as pending again.
    async fn topic_stats(&self) -> Result<Vec<TopicStats>> {
        let state = self.lock();
        let now = state.now();
        let mut topics: BTreeMap<&str, TopicStats> = BTreeMap::new();
        fn of<'a, 'k>(
            topics: &'a mut BTreeMap<&'k str, TopicStats>,
            topic: &'k str,
        ) -> &'a mut TopicStats {
            topics.entry(topic).or_insert_with(|| TopicStats {
                topic: topic.to_string(),
                ..TopicStats::default()
            })
        }
        for row in state.rows.values().filter(|r| r.visible) {
            let figures = of(&mut topics, &row.message.topic);
            if row.leased(now) {
                figures.in_flight += 1;
                continue;
            }
            figures.pending += 1;
            if row.message.attempts > 0 {
                figures.retrying += 1;
            }
            let created = row.message.created_at;
            figures.oldest_pending =
                Some(figures.oldest_pending.map_or(created, |o| o.min(created)));
        }
        for dead in &state.dead {
            of(&mut topics, &dead.message.topic).dead_lettered += 1;
        }
        Ok(topics.into_values().collect())
    }

    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: usize,
    ) -> Result<Vec<DeadLetterRow>> {
        let state = self.lock();
        let error = filter.last_error.as_deref().map(str::to_ascii_lowercase);
        let mut found: Vec<&Dead> = state
            .dead
            .iter()
            .filter(|d| matches(filter, d, error.as_deref()))
            .collect();
        // Oldest first: in enqueue order, as the SQL storages sort by sequence number.
        found.sort_by_key(|d| d.seq);
        Ok(found
            .into_iter()
            .take(limit)
            .map(|d| {
                let m = &d.message;
                DeadLetterRow {
                    message: Message {
                        id: m.id,
                        topic: m.topic.clone(),
                        key: m.key.clone(),
                        payload: if filter.without_payloads {
                            Vec::new()
                        } else {
                            m.payload.clone()
                        },
                        headers: m.headers.clone(),
                        created_at: m.created_at,
                        attempts: m.attempts,
                        trace_context: m.trace_context.clone(),
                    },
                    last_error: d.error.clone(),
                    dead_lettered_at: d.at,
                }
            })
            .collect())
    }

    async fn replay_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        Ok(MemoryStorage::replay_dead_letters(self, ids))
    }

    async fn purge_dead_letters(&self, ids: &[Uuid]) -> Result<u64> {
        Ok(MemoryStorage::purge_dead_letters(self, ids))
    }

    /// Parked keys in key order, each with its oldest dead letter still there, or the one
    /// that parked it once every dead letter of the key has been purged.
    async fn parked_keys(&self) -> Result<Vec<ParkedKey>> {
        let state = self.lock();
        Ok(state
            .parked
            .iter()
            .map(|(key, parked_by)| ParkedKey {
                key: key.clone(),
                dead_letter: state
                    .dead
                    .iter()
                    .filter(|d| d.message.key.as_ref() == Some(key))
                    .min_by_key(|d| d.seq)
                    .map_or(*parked_by, |d| d.message.id),
            })
            .collect())
    }

    async fn release_parked_key(&self, key: &str) -> Result<bool> {
        Ok(MemoryStorage::release_parked_key(self, key))
    }

    /// The committed messages of `key` still in the queue (pending, in flight or waiting to
    /// retry), as the SQL storages count the key's rows in the outbox table.
    async fn waiting_behind(&self, key: &str) -> Result<Option<u64>> {
        let state = self.lock();
        let n = state
            .rows
            .values()
            .filter(|r| r.visible && r.message.key.as_deref() == Some(key))
            .count();
        Ok(Some(n as u64))
    }
}

/// Decides the outcome of one message in a [`MemorySink`]: `None` delivers it.
pub type FailureRule = Box<dyn Fn(&Message) -> Option<Error> + Send + Sync>;

/// A [`Sink`] that keeps what it is given, can be switched down, and fails messages by rule.
pub struct MemorySink {
    published: Mutex<Vec<Message>>,
    up: AtomicBool,
    publish_calls: AtomicUsize,
    health_calls: AtomicUsize,
    rule: Mutex<Option<FailureRule>>,
    ordered_key_runs: AtomicBool,
}

impl Default for MemorySink {
    fn default() -> Self {
        MemorySink {
            published: Mutex::new(Vec::new()),
            up: AtomicBool::new(true),
            publish_calls: AtomicUsize::new(0),
            health_calls: AtomicUsize::new(0),
            rule: Mutex::new(None),
            ordered_key_runs: AtomicBool::new(false),
        }
    }
}

impl MemorySink {
    /// A healthy sink that delivers everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// Switches the sink up or down. While down, health checks and publishes fail as
    /// [`Unavailable`](crate::ErrorKind::Unavailable).
    pub fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::SeqCst);
    }

    /// Fails each message for which `rule` returns an error.
    pub fn fail_when(&self, rule: impl Fn(&Message) -> Option<Error> + Send + Sync + 'static) {
        *self.rule.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(rule));
    }

    /// Declares (or not) [`ordered_key_runs`](crate::SinkCapabilities::ordered_key_runs)
    /// and keeps it: once a message of a key fails, the key's later messages in the call
    /// fail untried.
    pub fn set_ordered_key_runs(&self, on: bool) {
        self.ordered_key_runs.store(on, Ordering::SeqCst);
    }

    /// Every delivered message, in publish order.
    pub fn published(&self) -> Vec<Message> {
        self.published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many times `publish` was called.
    pub fn publish_calls(&self) -> usize {
        self.publish_calls.load(Ordering::SeqCst)
    }

    /// How many times `health` was called.
    pub fn health_calls(&self) -> usize {
        self.health_calls.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Sink for MemorySink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        self.publish_calls.fetch_add(1, Ordering::SeqCst);
        if !self.up.load(Ordering::SeqCst) {
            return Err(Error::unavailable("memory sink is down"));
        }
        let rule = self.rule.lock().unwrap_or_else(|p| p.into_inner());
        let mut published = self.published.lock().unwrap_or_else(|p| p.into_inner());
        let key_runs = self.ordered_key_runs.load(Ordering::SeqCst);
        let mut failed_keys = std::collections::HashSet::new();
        Ok(batch
            .iter()
            .map(|m| {
                if key_runs && m.key.as_ref().is_some_and(|k| failed_keys.contains(k)) {
                    return Err(Error::unavailable(
                        "not tried: an earlier message of its key failed",
                    ));
                }
                match rule.as_ref().and_then(|r| r(m)) {
                    Some(error) => {
                        failed_keys.extend(m.key.clone());
                        Err(error)
                    }
                    None => Ok(m),
                }
            })
            .map(|tried| match tried {
                Err(error) => Outcome::Failed(error),
                Ok(m) => {
                    published.push(m.clone());
                    Outcome::Delivered(Receipt::new(format!("mem-{}", published.len())))
                }
            })
            .collect())
    }

    fn capabilities(&self) -> crate::SinkCapabilities {
        crate::SinkCapabilities::default()
            .with_ordered_key_runs(self.ordered_key_runs.load(Ordering::SeqCst))
    }

    async fn health(&self) -> Result<()> {
        self.health_calls.fetch_add(1, Ordering::SeqCst);
        if self.up.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Error::unavailable("memory sink is down"))
        }
    }
}
