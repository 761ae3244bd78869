//! In-memory storage and sink (cargo feature `memory`), for tests of the worker and of code
//! built on the traits. They follow the same contracts as the real backends, on tokio's
//! clock, so tests can run them with a paused clock.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    Claim, ClaimToken, DeadLetter, Delivery, Error, Message, NewMessage, Outcome, QueueStats,
    Receipt, Result, Retry, Sink, Storage, StorageCapabilities,
};

struct Row {
    message: Message,
    due: Instant,
    token: Option<ClaimToken>,
    last_error: Option<String>,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    rows: BTreeMap<u64, Row>,
    delivered: Vec<(Message, Receipt)>,
    dead: Vec<(Message, String)>,
    parked: HashSet<String>,
}

impl State {
    fn seq_of(&self, id: Uuid, token: &ClaimToken) -> Option<u64> {
        self.rows
            .iter()
            .find(|(_, r)| r.message.id == id && r.token.as_ref() == Some(token))
            .map(|(seq, _)| *seq)
    }
}

/// A [`Storage`] in memory with the same claim rules as the PostgreSQL one.
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

    /// Enqueues a message and wakes a waiting worker.
    pub fn enqueue(&self, message: NewMessage) {
        let mut state = self.lock();
        state.next_seq += 1;
        let seq = state.next_seq;
        state.rows.insert(
            seq,
            Row {
                message: message.into(),
                due: Instant::now(),
                token: None,
                last_error: None,
            },
        );
        drop(state);
        self.notify.notify_one();
    }

    /// Delivered messages with their receipts, in acknowledgement order.
    pub fn delivered(&self) -> Vec<(Message, Receipt)> {
        self.lock().delivered.clone()
    }

    /// Dead-lettered messages with their last error.
    pub fn dead_letters(&self) -> Vec<(Message, String)> {
        self.lock().dead.clone()
    }

    /// Messages still in the queue (pending, in flight or waiting to retry), in order.
    pub fn pending(&self) -> Vec<Message> {
        self.lock()
            .rows
            .values()
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
        let now = Instant::now();
        let token = ClaimToken(Uuid::now_v7());
        let mut state = self.lock();
        let parked = state.parked.clone();
        let mut blocked: HashSet<String> = HashSet::new();
        let mut messages = Vec::new();
        for row in state.rows.values_mut() {
            if messages.len() == limit {
                break;
            }
            let key = row.message.key.clone();
            if self.per_key_order
                && let Some(k) = &key
                && (parked.contains(k) || blocked.contains(k))
            {
                continue;
            }
            if row.due > now {
                if let Some(k) = key {
                    blocked.insert(k);
                }
                continue;
            }
            row.due = now + lease;
            row.token = Some(token);
            messages.push(row.message.clone());
        }
        Ok(Claim { token, messages })
    }

    async fn ack(&self, token: &ClaimToken, delivered: &[Delivery]) -> Result<u64> {
        let mut state = self.lock();
        let mut n = 0;
        for d in delivered {
            if let Some(seq) = state.seq_of(d.id, token) {
                let row = state.rows.remove(&seq).expect("row found above");
                state.delivered.push((row.message, d.receipt.clone()));
                n += 1;
            }
        }
        Ok(n)
    }

    async fn retry(&self, token: &ClaimToken, failed: &[Retry]) -> Result<u64> {
        let mut state = self.lock();
        let mut n = 0;
        for f in failed {
            if let Some(seq) = state.seq_of(f.id, token) {
                let row = state.rows.get_mut(&seq).expect("row found above");
                row.message.attempts += 1;
                row.due = Instant::now() + f.delay;
                row.token = None;
                row.last_error = Some(f.error.clone());
                n += 1;
            }
        }
        Ok(n)
    }

    async fn dead_letter(&self, token: &ClaimToken, dead: &[DeadLetter]) -> Result<u64> {
        let mut state = self.lock();
        let mut n = 0;
        for d in dead {
            if let Some(seq) = state.seq_of(d.id, token) {
                let mut row = state.rows.remove(&seq).expect("row found above");
                row.message.attempts += 1;
                if let (true, Some(key)) = (self.per_key_order, &row.message.key) {
                    state.parked.insert(key.clone());
                }
                state.dead.push((row.message, d.error.clone()));
                n += 1;
            }
        }
        Ok(n)
    }

    async fn release(&self, token: &ClaimToken, ids: &[Uuid]) -> Result<u64> {
        let mut state = self.lock();
        let mut n = 0;
        for id in ids {
            if let Some(seq) = state.seq_of(*id, token) {
                let row = state.rows.get_mut(&seq).expect("row found above");
                row.due = Instant::now();
                row.token = None;
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
        let now = Instant::now();
        Ok(QueueStats {
            pending: state
                .rows
                .values()
                .filter(|r| r.token.is_none() || r.due <= now)
                .count() as u64,
            oldest_pending: state
                .rows
                .values()
                .filter(|r| r.token.is_none() || r.due <= now)
                .map(|r| r.message.created_at)
                .min(),
            in_flight: state
                .rows
                .values()
                .filter(|r| r.token.is_some() && r.due > now)
                .count() as u64,
            dead_lettered: state.dead.len() as u64,
            parked_keys: state.parked.len() as u64,
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

/// Decides the outcome of one message in a [`MemorySink`]: `None` delivers it.
pub type FailureRule = Box<dyn Fn(&Message) -> Option<Error> + Send + Sync>;

/// A [`Sink`] that keeps what it is given, can be switched down, and fails messages by rule.
pub struct MemorySink {
    published: Mutex<Vec<Message>>,
    up: AtomicBool,
    publish_calls: AtomicUsize,
    health_calls: AtomicUsize,
    rule: Mutex<Option<FailureRule>>,
}

impl Default for MemorySink {
    fn default() -> Self {
        MemorySink {
            published: Mutex::new(Vec::new()),
            up: AtomicBool::new(true),
            publish_calls: AtomicUsize::new(0),
            health_calls: AtomicUsize::new(0),
            rule: Mutex::new(None),
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
        Ok(batch
            .iter()
            .map(|m| match rule.as_ref().and_then(|r| r(m)) {
                Some(error) => Outcome::Failed(error),
                None => {
                    published.push(m.clone());
                    Outcome::Delivered(Receipt::new(format!("mem-{}", published.len())))
                }
            })
            .collect())
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
