//! Relays draining a SQLite file that the application writes to at the same time: the
//! worker of outbox-core with the in-memory sink, on a real database file.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TempDir, app_pool, storage};
use outbox_core::memory::MemorySink;
use outbox_core::{CancellationToken, NewMessage, Storage, Worker, WorkerConfig};
use outbox_sqlite::OutboxTable;
use outbox_sqlite::sqlx::SqlitePool;

/// Writes `total` messages over `keys` keys in transactions of 1 to 40 messages, as an
/// application does (`BEGIN IMMEDIATE`, enqueue, commit), pausing now and then so relays
/// claim between commits. Payloads are `key:n`, `n` counting up per key.
async fn write(pool: SqlitePool, table: OutboxTable, total: usize, keys: usize) -> Vec<NewMessage> {
    let mut sent = Vec::with_capacity(total);
    let mut counters = vec![0usize; keys];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    while sent.len() < total {
        let size = (1 + next(40)).min(total - sent.len());
        let batch: Vec<NewMessage> = (0..size)
            .map(|_| {
                let key = next(keys);
                let n = counters[key];
                counters[key] += 1;
                NewMessage::new("relay-test", format!("k{key}:{n}")).key(format!("k{key}"))
            })
            .collect();
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.expect("begin");
        table.enqueue_many(&mut tx, &batch).await.expect("enqueue");
        tx.commit().await.expect("commit");
        sent.extend(batch);
        if next(4) == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    sent
}

fn worker_config(id: &str) -> WorkerConfig {
    WorkerConfig {
        batch_size: 100,
        poll_interval: Duration::from_millis(20),
        lease: Duration::from_secs(30),
        ..WorkerConfig::new(id)
    }
}

/// Every message published exactly once, and each key's messages in enqueue order.
fn check_once_in_key_order(sink: &MemorySink, sent: &[NewMessage]) {
    let published = sink.published();
    let mut seen = HashSet::new();
    for m in &published {
        assert!(seen.insert(m.id), "{} published twice", m.id);
    }
    let expected: HashSet<_> = sent.iter().map(|m| m.id).collect();
    assert_eq!(
        seen, expected,
        "published set differs from the enqueued one"
    );
    let mut next_of_key: HashMap<String, usize> = HashMap::new();
    for m in &published {
        let text = String::from_utf8(m.payload.clone()).expect("utf-8 payload");
        let (key, n) = text.split_once(':').expect("key:n");
        let n: usize = n.parse().expect("a number");
        let expected = next_of_key.entry(key.to_string()).or_default();
        assert_eq!(
            n, *expected,
            "key {key}: got message {n}, expected {expected}"
        );
        *expected += 1;
    }
}

async fn wait_for(sink: &MemorySink, storage: &dyn Storage, total: usize, within: Duration) {
    let started = Instant::now();
    loop {
        let stats = storage.stats().await.expect("stats");
        if sink.published().len() >= total && stats.pending == 0 && stats.in_flight == 0 {
            return;
        }
        assert!(
            started.elapsed() < within,
            "not drained after {within:?}: {} of {total} published, {stats:?}",
            sink.published().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_drains_10000_messages_over_100_keys_written_meanwhile() {
    let dir = TempDir::new("outbox-sqlite");
    let path = dir.file("app.db");
    let storage = Arc::new(storage(&path, |_| {}).await);
    let sink = Arc::new(MemorySink::new());
    let worker = Worker::new(worker_config("relay-1"), storage.clone(), sink.clone())
        .expect("worker settings");
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    let writer = tokio::spawn(write(
        app_pool(&path).await,
        storage.table().clone(),
        10_000,
        100,
    ));
    let sent = writer.await.expect("the writer");
    wait_for(&sink, &*storage, sent.len(), Duration::from_secs(120)).await;
    shutdown.cancel();
    relay.await.expect("the relay");
    check_once_in_key_order(&sink, &sent);
    assert_eq!(storage.stats().await.expect("stats").dead_lettered, 0);
}

/// Two relays on one file, each with its own connections as two processes would have: they
/// take turns on the write lock, fence each other through their claims, and between them
/// deliver everything once, in key order at the (shared) sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_one_file_deliver_everything_once_in_key_order() {
    let dir = TempDir::new("outbox-sqlite");
    let path = dir.file("app.db");
    let first = Arc::new(storage(&path, |_| {}).await);
    let second = Arc::new(storage(&path, |_| {}).await);
    let sink = Arc::new(MemorySink::new());
    let shutdown = CancellationToken::new();
    let mut relays = Vec::new();
    for (id, storage) in [("relay-a", first.clone()), ("relay-b", second.clone())] {
        let worker = Worker::new(worker_config(id), storage as Arc<dyn Storage>, sink.clone())
            .expect("worker settings");
        let shutdown = shutdown.clone();
        relays.push(tokio::spawn(async move { worker.run(shutdown).await }));
    }
    let sent = write(app_pool(&path).await, first.table().clone(), 5_000, 50).await;
    wait_for(&sink, &*first, sent.len(), Duration::from_secs(120)).await;
    shutdown.cancel();
    for relay in relays {
        relay.await.expect("a relay");
    }
    check_once_in_key_order(&sink, &sent);
}
