//! A disk that fills up for real: a tmpfs of the test's own (`mounts::Mount`, unmounted when
//! the test ends, a failed one included) that a filler file takes to its last byte while
//! messages are enqueued and relayed.
//!
//! - The SQLite storage with its database on that disk: an enqueue fails with an error that
//!   says the disk is full and what to do, and leaves nothing of its transaction; the relay's
//!   claims and settlements fail as `Unavailable` (its runs restart) and lose, charge and
//!   dead-letter nothing; once the filler is removed everything flows, every committed
//!   message is delivered (again only where a settlement was refused), each key in order.
//! - The file sink writing onto that disk: a batch that cannot be written is acknowledged
//!   for none of its messages, which stay in the outbox uncharged (docs/sinks/file.md: "disk
//!   full … `Unavailable` … releases the batch uncharged and backs off"); the part of a batch
//!   that landed before `ENOSPC` is cut off again, so the file holds whole lines only; once
//!   there is room every message is in the file once, in each key's order.

mod mounts;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use mounts::{Filler, Mount};
use outbox_core::{
    CancellationToken, ErrorKind, Message, NewMessage, Outcome, Result, Settlement, Sink,
    SinkCapabilities, Storage, Worker, WorkerConfig,
};
use outbox_file::{FileConfig, FileSink, wire};
use outbox_sqlite::sqlx::TransactionManager;
use outbox_sqlite::sqlx::sqlite::{
    SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteTransactionManager,
};
use outbox_sqlite::{OutboxTable, SqliteConfig};
use outbox_tests::{TestOutbox, open_sqlite, test_worker_config};
use uuid::Uuid;

/// The file sink's time-out in these tests.
const SINK_TIMEOUT: Duration = Duration::from_secs(1);

/// A line of the file sink's output as a consumer reads it: id, key, payload text.
#[derive(Debug, Clone)]
struct Line {
    id: Uuid,
    key: String,
    payload: String,
}

/// Every line of `bytes`, which must hold whole lines only, each a JSON object.
fn parse(bytes: &[u8]) -> Vec<Line> {
    assert!(
        bytes.is_empty() || bytes.ends_with(b"\n"),
        "the file ends in a cut-off line: {:?}",
        String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(200)..])
    );
    bytes
        .split(|b| *b == b'\n')
        .filter(|line| !line.is_empty())
        .map(|raw| {
            let value: serde_json::Value = serde_json::from_slice(raw).unwrap_or_else(|e| {
                panic!(
                    "a line that is not JSON ({e}): {:?}",
                    String::from_utf8_lossy(raw)
                )
            });
            let text = |name: &str| value[name].as_str().unwrap_or_default().to_string();
            Line {
                id: text(wire::ID).parse().expect("outbox-id is a UUID"),
                key: text(wire::KEY),
                payload: text(wire::PAYLOAD),
            }
        })
        .collect()
}

fn read_lines(path: &Path) -> Vec<Line> {
    match std::fs::read(path) {
        Ok(bytes) => parse(&bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("read {}: {e}", path.display()),
    }
}

/// The number a payload `n:padding` starts with.
fn number(payload: &str) -> usize {
    payload
        .split(':')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("payload without its number: {payload:.40}"))
}

/// Per key: the first delivery of each message comes in enqueue order (0, 1, 2, …), and
/// every delivery of a message, a redelivery included, comes after a delivery of the one
/// before it. Returns how many lines were redeliveries.
fn check_key_order(lines: &[Line]) -> usize {
    let mut seen = HashSet::new();
    let mut next: HashMap<&str, usize> = HashMap::new();
    let mut redelivered = 0;
    for line in lines {
        let n = number(&line.payload);
        let expected = next.entry(line.key.as_str()).or_default();
        if seen.insert(line.id) {
            assert_eq!(
                n, *expected,
                "key {}: first delivery of message {n} where {expected} was next",
                line.key
            );
            *expected += 1;
        } else {
            assert!(
                n < *expected,
                "key {}: message {n} delivered again before {expected}",
                line.key
            );
            redelivered += 1;
        }
    }
    redelivered
}

// --- (a) The SQLite database on a disk that fills up. ---

/// An application writing numbered messages (`n:padding`, `n` counting up per key) over
/// keys of its own, one transaction at a time, and what became of each: the ids of the
/// transactions that committed and of those that failed (rolled back; their numbers are
/// used again by the next transaction, as an application retrying its change would).
struct Ledger {
    prefix: &'static str,
    keys: usize,
    next_key: usize,
    counters: Vec<usize>,
    committed: Vec<Uuid>,
    refused: Vec<Uuid>,
    /// The errors of the transactions that failed, as the application saw them.
    failures: Vec<String>,
}

/// Bytes of padding in each payload, so the disk fills in a few thousand messages.
const PADDING: usize = 700;

impl Ledger {
    fn new(prefix: &'static str, keys: usize) -> Ledger {
        Ledger {
            prefix,
            keys,
            next_key: 0,
            counters: vec![0; keys],
            committed: Vec::new(),
            refused: Vec::new(),
            failures: Vec::new(),
        }
    }

    /// Writes `count` messages in one `BEGIN IMMEDIATE` transaction; on failure rolls back
    /// and records the error.
    async fn transaction(
        &mut self,
        app: &SqlitePool,
        table: &OutboxTable,
        count: usize,
    ) -> std::result::Result<(), String> {
        let before = (self.next_key, self.counters.clone());
        let messages: Vec<NewMessage> = (0..count)
            .map(|_| {
                let key = self.next_key;
                self.next_key = (self.next_key + 1) % self.keys;
                let n = self.counters[key];
                self.counters[key] += 1;
                NewMessage::new(
                    "full-disk",
                    format!("{n}:{}", "x".repeat(PADDING)).into_bytes(),
                )
                .key(format!("{}{key}", self.prefix))
            })
            .collect();
        let ids = messages.iter().map(|m| m.id);
        let outcome = async {
            let mut tx = app
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(|e| format!("begin: {e}"))?;
            if let Err(error) = table.enqueue_many(&mut tx, &messages).await {
                let _ = tx.rollback().await;
                return Err(format!("enqueue: {error}"));
            }
            tx.commit().await.map_err(|e| format!("commit: {e}"))
        }
        .await;
        match &outcome {
            Ok(()) => self.committed.extend(ids),
            Err(error) => {
                (self.next_key, self.counters) = before;
                self.refused.extend(ids);
                self.failures.push(error.clone());
            }
        }
        outcome
    }
}

/// The application's pool, as an application opens the file (default settings, durable
/// commits), with the one precaution a full disk calls for: a connection whose transaction
/// could not be ended is closed rather than reused. When a statement or COMMIT fails with
/// SQLITE_FULL, SQLite rolls the transaction back itself; the ROLLBACK that follows fails,
/// and sqlx 0.8 then counts the connection as inside a transaction for good (every later
/// BEGIN on it fails with "attempted to call begin_with at non-zero transaction depth").
/// The relay's own pool does the same (outbox-sqlite's `connection.rs`).
async fn app_pool(path: &Path) -> SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(2)
        .after_release(|conn, _| {
            Box::pin(async move { Ok(SqliteTransactionManager::get_transaction_depth(conn) == 0) })
        })
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .busy_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("the application's pool")
}

/// How many of `ids` are rows of the outbox table.
async fn stored(app: &SqlitePool, table: &OutboxTable, ids: &[Uuid]) -> i64 {
    let list = serde_json::to_string(&ids.iter().map(|id| id.to_string()).collect::<Vec<_>>())
        .expect("ids as JSON");
    outbox_sqlite::sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE id IN (SELECT value FROM json_each(?))",
        table.quoted("")
    ))
    .bind(list)
    .fetch_one(app)
    .await
    .expect("count rows")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_on_a_full_disk_refuses_enqueues_clearly_and_the_relay_loses_nothing() {
    let disk = Mount::tmpfs(8 << 20);
    let elsewhere = Mount::tmpfs(128 << 20);
    let db = disk.file("app.db");
    let storage = open_sqlite(SqliteConfig::new(&db)).await;
    let storage = Arc::new(storage);
    let table = storage.table().clone();
    let app = app_pool(&db).await;
    let out = elsewhere.file("delivered.jsonl");
    let sink = Arc::new(
        FileSink::new(FileConfig::new(&out).publish_timeout(SINK_TIMEOUT)).expect("file sink"),
    );
    let batch_size = 50;
    let config = WorkerConfig {
        batch_size,
        lease: Duration::from_secs(3),
        ..test_worker_config("full-disk")
    };
    let worker = Worker::new(config, storage.clone(), sink).expect("worker");
    let stop_relay = CancellationToken::new();
    let relay = tokio::spawn({
        let stop = stop_relay.clone();
        async move { worker.run(stop).await }
    });

    // An application writing all along, ten messages per transaction.
    let writer = Arc::new(tokio::sync::Mutex::new(Ledger::new("w", 10)));
    let stop_writer = CancellationToken::new();
    let writing = tokio::spawn({
        let (app, table, writer, stop) = (
            app.clone(),
            table.clone(),
            writer.clone(),
            stop_writer.clone(),
        );
        async move {
            while !stop.is_cancelled() {
                let failed = writer.lock().await.transaction(&app, &table, 10).await;
                let pause = if failed.is_ok() { 5 } else { 50 };
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
        }
    });
    let committed_by_writer = || async { writer.lock().await.committed.len() };
    let deadline = Instant::now() + Duration::from_secs(20);
    while committed_by_writer().await < 300 {
        assert!(Instant::now() < deadline, "the writer committed too little");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A backlog, so the relay has rows to claim and settle when the disk fills.
    let mut main = Ledger::new("m", 10);
    main.transaction(&app, &table, 1500)
        .await
        .expect("a backlog while there is room");
    // The WAL emptied to 0 bytes, then every free byte taken: any write now needs room.
    for attempt in 0.. {
        let (busy, _, _): (i64, i64, i64) =
            outbox_sqlite::sqlx::query_as("PRAGMA wal_checkpoint(TRUNCATE)")
                .fetch_one(&app)
                .await
                .expect("checkpoint");
        if busy == 0 {
            break;
        }
        assert!(attempt < 100, "the WAL could not be checkpointed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let filler = Filler::fill(&disk.file("filler"));
    let full_at = Instant::now();
    let failures_before = writer.lock().await.failures.len();

    // The relay's side: a claim on the full disk is `Unavailable`, names the file and says
    // what to do.
    let mut claim_error = None;
    for _ in 0..20 {
        match storage.claim("probe", 1, Duration::from_secs(1)).await {
            Err(error) => {
                claim_error = Some(error);
                break;
            }
            Ok(claim) => {
                let released = Settlement {
                    released: claim.messages.iter().map(|m| m.id).collect(),
                    ..Settlement::default()
                };
                let _ = storage.settle(&claim.token, &released).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let claim_error = claim_error.expect("a claim on a full disk failed");
    assert_eq!(claim_error.kind(), ErrorKind::Unavailable, "{claim_error}");
    let text = claim_error.to_string();
    assert!(
        text.contains(&db.display().to_string()) && text.contains("is full; free space"),
        "the claim's error names the file and says what to do: {text}"
    );

    // The application's side: a transaction larger than SQLite's page cache writes to the
    // disk before its commit, so the enqueue itself fails, and says why.
    let big: Vec<NewMessage> = (0..250)
        .map(|i| NewMessage::new("full-disk", vec![b'b'; 16 << 10]).key(format!("big{i}")))
        .collect();
    let big_ids: Vec<Uuid> = big.iter().map(|m| m.id).collect();
    let mut tx = app
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("begin on a full disk");
    let error = table
        .enqueue_many(&mut tx, &big)
        .await
        .expect_err("an enqueue of 4 MiB on a full disk");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.is_retryable(), "{error}");
    let enqueue_error = error.to_string();
    assert!(
        enqueue_error.contains("enqueue failed") && enqueue_error.contains("is full; free space"),
        "the enqueue's error says the disk is full and what to do: {enqueue_error}"
    );
    // An application that commits anyway commits none of it: no message half-written.
    let committed_anyway = tx.commit().await;
    assert_eq!(
        stored(&app, &table, &big_ids).await,
        0,
        "a failed enqueue left messages in the outbox (commit after it: {committed_anyway:?})"
    );

    // The writer's transactions fail meanwhile (at the commit, with SQLite's own words).
    let deadline = Instant::now() + Duration::from_secs(10);
    while writer.lock().await.failures.len() < failures_before + 3 {
        assert!(
            Instant::now() < deadline,
            "the writer's transactions kept committing on a full disk"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for failure in &writer.lock().await.failures {
        assert!(
            failure.contains("is full; free space") || failure.contains("disk is full"),
            "the application's error says the disk is full: {failure}"
        );
    }
    // Let the relay run into the full disk a few times.
    tokio::time::sleep(Duration::from_millis(2500).saturating_sub(full_at.elapsed())).await;
    let filler_bytes = filler.bytes;
    filler.free();

    // Once there is room, everything flows again: the writer commits, and everything
    // committed is delivered.
    let after_free = committed_by_writer().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while committed_by_writer().await < after_free + 200 {
        assert!(
            Instant::now() < deadline,
            "the writer could not commit after the space was freed: {:?}",
            writer.lock().await.failures.last()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_writer.cancel();
    writing.await.expect("the writer");
    main.transaction(&app, &table, 100)
        .await
        .expect("an enqueue after the space was freed");
    let writer = std::mem::replace(&mut *writer.lock().await, Ledger::new("w", 10));
    let committed: HashSet<Uuid> = writer
        .committed
        .iter()
        .chain(&main.committed)
        .copied()
        .collect();
    let deadline = Instant::now() + Duration::from_secs(40);
    let lines = loop {
        let lines = read_lines(&out);
        let delivered: HashSet<Uuid> = lines.iter().map(|l| l.id).collect();
        if committed.is_subset(&delivered) {
            break lines;
        }
        let stats = storage.stats().await;
        assert!(
            Instant::now() < deadline,
            "{} of {} committed messages delivered within 40 s after the space was freed: {stats:?}",
            committed.intersection(&delivered).count(),
            committed.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let stats = storage.stats().await.expect("queue figures");
        if (stats.pending, stats.in_flight) == (0, 0) || Instant::now() >= deadline {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop_relay.cancel();
    relay.await.expect("the relay");

    assert_eq!(
        (stats.pending, stats.in_flight, stats.dead_lettered),
        (0, 0, 0),
        "nothing left, nothing dead-lettered: {stats:?}"
    );
    let delivered: HashSet<Uuid> = lines.iter().map(|l| l.id).collect();
    assert_eq!(delivered, committed, "exactly the committed messages");
    for id in writer.refused.iter().chain(&main.refused).chain(&big_ids) {
        assert!(
            !delivered.contains(id),
            "message {id} of a failed transaction was delivered"
        );
    }
    let redelivered = check_key_order(&lines);
    assert!(
        redelivered <= 4 * batch_size,
        "{redelivered} redeliveries: more than the batches whose settlement the full disk refused"
    );
    println!(
        "full disk ({filler_bytes} bytes of filler): {} messages committed, {} refused in {} \
         failed transactions, {} lines delivered ({redelivered} redeliveries)\n  the claim \
         said: {claim_error}\n  the big enqueue said: {enqueue_error}\n  a commit after it: \
         {committed_anyway:?}\n  the writer's first failure: {:?}",
        committed.len(),
        writer.refused.len() + main.refused.len(),
        writer.failures.len() + main.failures.len(),
        lines.len(),
        writer.failures.first()
    );
}

// --- (b) The file sink writing onto a disk that fills up. ---

/// The file sink as the relay uses it, with its calls counted: what it answers is the real
/// sink's, unchanged.
struct Counted {
    sink: FileSink,
    publishes: AtomicUsize,
    failed: AtomicUsize,
    errors: Mutex<Vec<String>>,
}

#[async_trait]
impl Sink for Counted {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        self.publishes.fetch_add(1, Ordering::Relaxed);
        let outcomes = self.sink.publish(batch).await?;
        for outcome in &outcomes {
            if let Outcome::Failed(error) = outcome {
                self.failed.fetch_add(1, Ordering::Relaxed);
                let mut errors = self.errors.lock().expect("errors");
                if errors.len() < 10 {
                    errors.push(format!("{:?}: {error}", error.kind()));
                }
            }
        }
        Ok(outcomes)
    }

    async fn health(&self) -> Result<()> {
        self.sink.health().await
    }

    fn capabilities(&self) -> SinkCapabilities {
        self.sink.capabilities()
    }

    fn publish_timeout(&self) -> Option<Duration> {
        self.sink.publish_timeout()
    }
}

/// The file at `path` holds exactly `before`: `what` left nothing behind.
#[track_caller]
fn assert_unchanged(path: &Path, before: &[u8], what: &str) {
    let now = std::fs::read(path).expect("the file");
    if now != before {
        let common = now.iter().zip(before).take_while(|(a, b)| a == b).count();
        panic!(
            "{what} left bytes behind: {} bytes before, {} now, the same up to byte {common}; \
             from there: {:?}",
            before.len(),
            now.len(),
            String::from_utf8_lossy(&now[common..now.len().min(common + 300)])
        );
    }
}

/// The size of a page of tmpfs: a write that ends in a page already allocated lands there
/// even when the file system is full.
const PAGE: u64 = 4096;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_file_sink_on_a_full_disk_acknowledges_nothing_and_leaves_whole_lines() {
    let disk = Mount::tmpfs(1 << 20);
    let path = disk.file("messages.jsonl");
    let sink = Arc::new(Counted {
        sink: FileSink::new(FileConfig::new(&path).publish_timeout(SINK_TIMEOUT))
            .expect("file sink"),
        publishes: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
        errors: Mutex::new(Vec::new()),
    });
    let outbox = TestOutbox::new().await;
    let relay = outbox.relay("file-full-disk", sink.clone());
    let keys = 5;
    let message = |i: usize| {
        NewMessage::new("full-disk", format!("{i}:{}", "y".repeat(200)))
            .key(format!("k{}", i % keys))
    };
    let mut sent: Vec<NewMessage> = (0..100).map(message).collect();
    outbox.enqueue(&sent).await;
    outbox
        .drained_with_no_dead_letters(Duration::from_secs(30))
        .await;
    // The file's last page must have room, so that the next batch lands in part before the
    // disk is found full (and must be cut off again).
    while std::fs::metadata(&path)
        .expect("the file")
        .len()
        .is_multiple_of(PAGE)
    {
        let more = message(sent.len());
        outbox.enqueue(std::slice::from_ref(&more)).await;
        sent.push(more);
        outbox
            .drained_with_no_dead_letters(Duration::from_secs(30))
            .await;
    }

    let filler = Filler::fill(&disk.file("filler"));
    let before = std::fs::read(&path).expect("the file");
    // A batch through the sink itself: every message fails as `Unavailable`, saying what to
    // do, and the file is as it was.
    let batch: Vec<Message> = (0..20)
        .map(|i| Message::from(NewMessage::new("probe", vec![b'p'; 1000]).key(format!("p{i}"))))
        .collect();
    let outcomes = sink.sink.publish(&batch).await.expect("one outcome each");
    assert_eq!(outcomes.len(), batch.len());
    for outcome in &outcomes {
        match outcome {
            Outcome::Failed(error) => {
                assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
                let text = error.to_string();
                assert!(
                    text.contains(&format!(
                        "the disk holding `{}` is full; free space on it",
                        path.display()
                    )),
                    "{text}"
                );
            }
            Outcome::Delivered(receipt) => panic!("acknowledged on a full disk: {receipt}"),
        }
    }
    assert_unchanged(&path, &before, "a failed batch");

    // Through the relay: new messages are tried again and again, acknowledged never,
    // charged nothing; a reader of the file finds whole lines up to its last line break.
    let failed_before = sink.failed.load(Ordering::Relaxed);
    let publishes_before = sink.publishes.load(Ordering::Relaxed);
    let second: Vec<NewMessage> = (sent.len()..sent.len() + 200).map(message).collect();
    outbox.enqueue(&second).await;
    let watching = Instant::now();
    let mut longest = before.len();
    while watching.elapsed() < Duration::from_secs(3) {
        let now = std::fs::read(&path).expect("the file");
        longest = longest.max(now.len());
        let whole = now
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(&now[..0], |end| &now[..=end]);
        let lines = parse(whole);
        assert!(
            lines.len() >= sent.len(),
            "lines went missing: {}",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    outbox
        .wait_for("the batch in flight released", |s| s.in_flight == 0)
        .await;
    let stats = outbox.stats().await;
    assert_eq!(
        (stats.pending, stats.dead_lettered),
        (second.len() as u64, 0),
        "nothing acknowledged, nothing dead-lettered: {stats:?}"
    );
    let attempts = outbox.attempts().await;
    assert!(
        attempts.iter().all(|&a| a == 0),
        "a full disk charges no attempt: {attempts:?}"
    );
    assert_unchanged(&path, &before, "the relay's failed batches");
    let publishes = sink.publishes.load(Ordering::Relaxed) - publishes_before;
    let failed = sink.failed.load(Ordering::Relaxed) - failed_before;
    assert!(
        publishes >= 2 && failed >= 2,
        "the relay tried again: {publishes} publishes, {failed} failed messages"
    );
    assert!(
        publishes <= 30,
        "the relay backs off between attempts: {publishes} publishes in 3 s"
    );
    let errors = sink.errors.lock().expect("errors").clone();
    assert!(
        errors
            .iter()
            .all(|e| e.starts_with("Unavailable: ") && e.contains("is full; free space")),
        "{errors:?}"
    );

    filler.free();
    outbox
        .drained_with_no_dead_letters(Duration::from_secs(30))
        .await;
    relay.stop().await;
    sent.extend(second);
    let lines = read_lines(&path);
    let ids: Vec<Uuid> = lines.iter().map(|l| l.id).collect();
    let unique: HashSet<Uuid> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "each message once");
    assert_eq!(
        unique,
        sent.iter().map(|m| m.id).collect::<HashSet<_>>(),
        "every message, none else"
    );
    for key in 0..keys {
        let key = format!("k{key}");
        let expected: Vec<String> = sent
            .iter()
            .filter(|m| m.key.as_deref() == Some(key.as_str()))
            .map(|m| String::from_utf8(m.payload.clone()).expect("text"))
            .collect();
        let got: Vec<String> = lines
            .iter()
            .filter(|l| l.key == key)
            .map(|l| l.payload.clone())
            .collect();
        assert_eq!(got, expected, "key {key} in enqueue order");
    }
    println!(
        "file sink on a full disk: {publishes} publishes failed over 3 s; the file grew to \
         {longest} bytes at most while {} were whole (a part of a batch that landed is cut off \
         again)",
        before.len()
    );
}
