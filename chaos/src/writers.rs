//! Writers: enqueue with plain SQL INSERTs (the table contract of docs/storage/postgres.md
//! and docs/storage/mysql.md), as an application in any language would, and record what they
//! did and when.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::AnyPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Every message goes to this topic: one stream, queue or subject, so the broker's order of
/// arrival is one sequence.
pub const TOPIC: &str = "chaos";
/// The poison topic (AMQP runs): the broker routes it nowhere while the faults go on, so
/// its messages are returned and dead-lettered; at the end it is routed to the run's queue
/// and the dead letters left are replayed.
pub const POISON_TOPIC: &str = "chaos-poison";

/// A message whose transaction committed.
#[derive(Clone, Debug)]
pub struct Written {
    pub id: Uuid,
    pub key: String,
    /// When its INSERT was issued.
    pub began: Instant,
    /// When the COMMIT of its transaction returned.
    pub committed: Instant,
    /// Sent to [`POISON_TOPIC`].
    pub poison: bool,
}

#[derive(Default)]
pub struct Ledger {
    pub committed: Vec<Written>,
    /// Rolled back on purpose, or aborted by a failed INSERT: never committed.
    pub rolled_back: Vec<Uuid>,
    /// The COMMIT failed: the outcome is unknown, so these are left out of every check.
    pub uncertain: Vec<Uuid>,
}

impl Ledger {
    pub fn merge(&mut self, other: Ledger) {
        self.committed.extend(other.committed);
        self.rolled_back.extend(other.rolled_back);
        self.uncertain.extend(other.uncertain);
    }
}

#[derive(Default)]
pub struct Counters {
    pub committed: AtomicU64,
    pub rolled_back: AtomicU64,
}

pub struct Writer {
    pub name: String,
    pub keys: Vec<String>,
    /// Shares its keys with another writer: holds its transactions open a little, so the
    /// two overlap on the same keys.
    pub shared: bool,
    pub seed: u64,
    /// The share of messages sent to [`POISON_TOPIC`] (0 where the sink has no poison).
    pub poison: f64,
}

/// What one transaction does.
struct Plan {
    /// Each message's key, and whether it goes to the poison topic.
    messages: Vec<(String, bool)>,
    rollback: bool,
    /// Time between the last INSERT and the COMMIT (or ROLLBACK).
    hold: Duration,
}

impl Plan {
    fn draw(rng: &mut fastrand::Rng, writer: &Writer) -> Plan {
        let count = rng.usize(1..=3);
        let messages = (0..count)
            .map(|_| {
                let key = writer.keys[rng.usize(..writer.keys.len())].clone();
                (key, rng.f64() < writer.poison)
            })
            .collect();
        // Late commits matter most on shared keys: the other writer's messages of the key
        // commit meanwhile, so the late one lands in the middle of the key's queue.
        let late = rng.f64() < if writer.shared { 0.2 } else { 0.05 };
        let hold = if late {
            Duration::from_millis(rng.u64(1000..2500))
        } else if writer.shared {
            Duration::from_millis(rng.u64(0..300))
        } else {
            Duration::ZERO
        };
        Plan {
            messages,
            rollback: rng.f64() < 0.08,
            hold,
        }
    }
}

/// Runs transactions until `stop`, then returns what it wrote.
pub async fn run(
    pool: AnyPool,
    insert: Arc<str>,
    writer: Writer,
    counters: Arc<Counters>,
    stop: CancellationToken,
) -> Ledger {
    let mut rng = fastrand::Rng::with_seed(writer.seed);
    let mut ledger = Ledger::default();
    let mut sequence = 0u64;
    while !stop.is_cancelled() {
        let plan = Plan::draw(&mut rng, &writer);
        let outcome = transaction(&pool, &insert, &writer.name, &mut sequence, plan).await;
        match outcome {
            Outcome::Committed(written) => {
                counters
                    .committed
                    .fetch_add(written.len() as u64, Ordering::Relaxed);
                ledger.committed.extend(written);
            }
            Outcome::RolledBack(ids) => {
                counters
                    .rolled_back
                    .fetch_add(ids.len() as u64, Ordering::Relaxed);
                ledger.rolled_back.extend(ids);
            }
            Outcome::Uncertain(ids) => ledger.uncertain.extend(ids),
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(10..60))).await;
    }
    ledger
}

enum Outcome {
    Committed(Vec<Written>),
    RolledBack(Vec<Uuid>),
    Uncertain(Vec<Uuid>),
}

async fn transaction(
    pool: &AnyPool,
    insert: &str,
    writer: &str,
    sequence: &mut u64,
    plan: Plan,
) -> Outcome {
    let mut tx = match pool.begin().await {
        Ok(tx) => tx,
        Err(error) => {
            eprintln!("chaos: writer {writer}: cannot begin: {error}");
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Outcome::RolledBack(Vec::new());
        }
    };
    let mut inserted: Vec<(Uuid, String, Instant, bool)> = Vec::new();
    for (key, poison) in plan.messages {
        let id = Uuid::now_v7();
        *sequence += 1;
        // The id leads the payload, so whatever the broker hands back maps to this row.
        let payload = format!("{id} {key} {writer}#{sequence}");
        let began = Instant::now();
        let result = sqlx::query(insert)
            .bind(id.to_string())
            .bind(if poison { POISON_TOPIC } else { TOPIC })
            .bind(key.clone())
            .bind(payload.into_bytes())
            .execute(&mut *tx)
            .await;
        if let Err(error) = result {
            // The transaction is aborted; dropping it rolls back: nothing of it commits.
            eprintln!("chaos: writer {writer}: INSERT failed, rolling back: {error}");
            let mut ids: Vec<Uuid> = inserted.into_iter().map(|(id, ..)| id).collect();
            ids.push(id);
            return Outcome::RolledBack(ids);
        }
        inserted.push((id, key, began, poison));
    }
    tokio::time::sleep(plan.hold).await;
    let ids = || inserted.iter().map(|(id, ..)| *id).collect::<Vec<_>>();
    if plan.rollback {
        // Even if the ROLLBACK itself fails, nothing was committed.
        let _ = tx.rollback().await;
        return Outcome::RolledBack(ids());
    }
    match tx.commit().await {
        Ok(()) => {
            let committed = Instant::now();
            let written = inserted
                .into_iter()
                .map(|(id, key, began, poison)| Written {
                    id,
                    key,
                    began,
                    committed,
                    poison,
                })
                .collect();
            Outcome::Committed(written)
        }
        Err(error) => {
            eprintln!("chaos: writer {writer}: COMMIT failed, outcome unknown: {error}");
            Outcome::Uncertain(ids())
        }
    }
}
