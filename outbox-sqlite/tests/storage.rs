//! What the SQLite storage promises beyond the conformance suite (which runs in
//! tests/tests/sqlite.rs), on real database files: the application's transaction, the write
//! lock, leases, migrations from two processes, the plain-INSERT contract, retention and the
//! registry.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{TempDir, app_db, app_pool, count, now_ms, storage};
use outbox_core::{
    Claim, DeadLetter, Delivery, ErrorKind, NewMessage, Receipt, Settlement, Storage, StorageAdmin,
    StorageRegistry,
};
use outbox_sqlite::sqlx;
use outbox_sqlite::sqlx::SqliteConnection;
use outbox_sqlite::{OutboxTable, SqliteConfig, SqliteStorage};
use outbox_test_support::text;

const LEASE: Duration = Duration::from_secs(30);

fn payloads(claim: &Claim) -> Vec<String> {
    outbox_test_support::payloads(&claim.messages)
}

/// Deliveries of `claim`'s messages with the receipt `receipt-<payload>`.
fn deliveries(claim: &Claim) -> Vec<Delivery> {
    outbox_test_support::deliveries(&claim.messages, |m| format!("receipt-{}", text(&m.payload)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_transaction_is_invisible_until_it_commits_and_claims_wait_for_it() {
    let (_dir, path) = app_db();
    let storage = Arc::new(storage(&path, |_| {}).await);
    let app = app_pool(&path).await;
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT NOT NULL)")
        .execute(&app)
        .await
        .unwrap();
    let table = storage.table().clone();

    // The domain write and the message in one transaction, which holds the write lock.
    let mut tx = app.begin_with("BEGIN IMMEDIATE").await.unwrap();
    pay_order(&mut tx, &table, 1, "paid").await;
    // Readers go on meanwhile (WAL), and see nothing of it.
    let stats = storage.stats().await.expect("stats while a writer is open");
    assert_eq!(
        stats.pending, 0,
        "uncommitted messages are invisible: {stats:?}"
    );
    // A claim is a write: it waits for the transaction.
    let claim = tokio::spawn({
        let storage = storage.clone();
        async move { storage.claim("w1", 10, LEASE).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !claim.is_finished(),
        "a claim must wait for the open transaction"
    );
    tx.commit().await.unwrap();
    let claimed = tokio::time::timeout(Duration::from_secs(5), claim)
        .await
        .expect("the claim goes on once the transaction commits")
        .unwrap()
        .expect("claim");
    assert_eq!(payloads(&claimed), ["paid"]);

    // A rolled-back transaction leaves neither its domain write nor its message.
    let mut tx = app.begin_with("BEGIN IMMEDIATE").await.unwrap();
    pay_order(&mut tx, &table, 2, "rolled back").await;
    tx.rollback().await.unwrap();
    assert!(
        storage
            .claim("w1", 10, LEASE)
            .await
            .unwrap()
            .messages
            .is_empty()
    );
    assert_eq!(count(&app, "orders").await, 1);
}

/// In the application's transaction `tx`: order `id` is paid (the domain write), and its
/// message (key `order-<id>`, payload `payload`) is enqueued.
async fn pay_order(tx: &mut SqliteConnection, table: &OutboxTable, id: i64, payload: &str) {
    sqlx::query("INSERT INTO orders (id, state) VALUES (?1, 'paid')")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let message = NewMessage::new("orders", payload).key(format!("order-{id}"));
    table.enqueue(tx, &message).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_runs_from_the_claim_not_from_the_wait_for_the_write_lock() {
    let (_dir, path) = app_db();
    let storage = Arc::new(storage(&path, |_| {}).await);
    storage.enqueue(&[NewMessage::new("t", "m")]).await.unwrap();
    let app = app_pool(&path).await;
    let tx = app.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let lease = Duration::from_secs(2);
    let claim = tokio::spawn({
        let storage = storage.clone();
        async move { storage.claim("w1", 10, lease).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    tx.rollback().await.unwrap();
    let claimed = claim.await.unwrap().expect("claim");
    assert_eq!(claimed.messages.len(), 1);
    let until: i64 = sqlx::query_scalar("SELECT available_at FROM outbox")
        .fetch_one(&app)
        .await
        .unwrap();
    let left = until - now_ms(&app).await;
    assert!(
        left > 1_700,
        "the lease has {left} ms left right after the claim; it lost the wait for the lock"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lock_held_past_busy_timeout_is_unavailable_not_a_crash() {
    let (_dir, path) = app_db();
    let storage = storage(&path, |c| c.busy_timeout = Duration::from_millis(200)).await;
    storage.enqueue(&[NewMessage::new("t", "m")]).await.unwrap();
    let app = app_pool(&path).await;
    let tx = app.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let error = storage.claim("w1", 10, LEASE).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.message().contains("locked"), "{error}");
    // Readers are not held up.
    assert_eq!(storage.stats().await.unwrap().pending, 1);
    tx.rollback().await.unwrap();
    assert_eq!(
        storage.claim("w1", 10, LEASE).await.unwrap().messages.len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_from_two_processes_at_once_run_once() {
    for _ in 0..5 {
        let (_dir, path) = app_db();
        // Two storages with their own connections, as two relay processes have.
        let a = SqliteStorage::new(SqliteConfig::new(&path)).unwrap();
        let b = SqliteStorage::new(SqliteConfig::new(&path)).unwrap();
        let (ra, rb) = tokio::join!(a.migrate(), b.migrate());
        ra.expect("first migrator");
        rb.expect("second migrator");
        a.migrate().await.expect("migrating again changes nothing");
        let app = app_pool(&path).await;
        let versions: Vec<i64> = sqlx::query_scalar("SELECT version FROM outbox_migrations")
            .fetch_all(&app)
            .await
            .unwrap();
        assert_eq!(versions, [1], "each version recorded once");
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&app)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_language_enqueues_with_a_plain_insert() {
    let (_dir, path) = app_db();
    let storage = storage(&path, |_| {}).await;
    let app = app_pool(&path).await;
    // The least a writer gives: topic and payload.
    sqlx::query("INSERT INTO outbox (topic, payload) VALUES ('orders.paid', X'7b7d')")
        .execute(&app)
        .await
        .unwrap();
    // Everything, with a text payload and a hand-written id and time.
    let id = "0192f0c4-5b2e-7cc1-8a3e-3f1b2c4d5e6f";
    sqlx::query(
        "INSERT INTO outbox (id, topic, partition_key, payload, headers, traceparent, tracestate, created_at)
         VALUES (?, 'orders.paid', 'order-42', 'text payload', '{\"content-type\": \"application/json\"}',
                 '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', NULL, 1700000000123456)",
    )
    .bind(id)
    .execute(&app)
    .await
    .unwrap();
    let claimed = storage.claim("w1", 10, LEASE).await.unwrap();
    assert_eq!(claimed.messages.len(), 2);
    let (bare, full) = (&claimed.messages[0], &claimed.messages[1]);
    assert_eq!(bare.payload, b"{}");
    assert_eq!(
        bare.id.get_version_num(),
        4,
        "a default id is a random UUID"
    );
    assert!(bare.headers.is_empty() && bare.key.is_none() && bare.trace_context.is_none());
    let age = chrono::Utc::now() - bare.created_at;
    assert!(
        age.num_seconds().abs() < 60,
        "default created_at is now: {age}"
    );
    assert_eq!(full.id.to_string(), id);
    assert_eq!(full.payload, b"text payload");
    assert_eq!(full.key.as_deref(), Some("order-42"));
    assert_eq!(full.headers["content-type"], "application/json");
    assert_eq!(full.created_at.timestamp_micros(), 1_700_000_000_123_456);
    assert!(full.trace_context.is_some());

    // Rows the relay could not read are refused at INSERT, in the writer's transaction.
    for bad in [
        "INSERT INTO outbox (topic, payload) VALUES ('', X'00')",
        "INSERT INTO outbox (topic, payload) VALUES (NULL, X'00')",
        "INSERT INTO outbox (topic, payload) VALUES ('t', NULL)",
        "INSERT INTO outbox (id, topic, payload) VALUES ('0192F0C4-5B2E-7CC1-8A3E-3F1B2C4D5E6F', 't', X'00')",
        "INSERT INTO outbox (id, topic, payload) VALUES ('not-a-uuid', 't', X'00')",
        "INSERT INTO outbox (topic, payload, created_at) VALUES ('t', X'00', '2024-05-01 10:00:00')",
        "INSERT INTO outbox (topic, payload, headers) VALUES ('t', X'00', X'7b7d')",
    ] {
        let error = sqlx::query(bad).execute(&app).await.unwrap_err();
        let db = error.as_database_error().expect("a database error");
        assert!(db.message().contains("constraint failed"), "{bad}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_delivered_rows_with_their_receipt_until_housekeeping() {
    let (dir, path) = app_db();
    let storage = storage(&path, |c| c.retention = Some(Duration::from_secs(3600))).await;
    storage
        .enqueue(&[NewMessage::new("t", "a"), NewMessage::new("t", "b")])
        .await
        .unwrap();
    let c = storage.claim("w1", 10, LEASE).await.unwrap();
    assert_eq!(storage.ack(&c.token, &deliveries(&c)).await.unwrap(), 2);
    let app = app_pool(&path).await;
    let kept = || async {
        sqlx::query_as::<_, (String, String)>(
            "SELECT CAST(payload AS TEXT), receipt FROM outbox_delivered ORDER BY seq",
        )
        .fetch_all(&app)
        .await
        .unwrap()
    };
    let expected = vec![
        ("a".to_string(), "receipt-a".to_string()),
        ("b".to_string(), "receipt-b".to_string()),
    ];
    assert_eq!(kept().await, expected);
    storage.maintain().await.unwrap();
    assert_eq!(kept().await, expected, "rows within the retention stay");
    sqlx::query("UPDATE outbox_delivered SET delivered_at = delivered_at - 7200000")
        .execute(&app)
        .await
        .unwrap();
    storage.maintain().await.unwrap();
    assert!(kept().await.is_empty(), "rows past the retention go");

    // Without retention, delivered rows are deleted at once.
    let plain = self::storage(&dir.file("plain.db"), |_| {}).await;
    plain.enqueue(&[NewMessage::new("t", "x")]).await.unwrap();
    let c = plain.claim("w1", 10, LEASE).await.unwrap();
    plain.ack(&c.token, &deliveries(&c)).await.unwrap();
    let plain_app = app_pool(&dir.file("plain.db")).await;
    assert_eq!(count(&plain_app, "outbox_delivered").await, 0);
}

/// `describe` names the file and the table. The operator's repairs are the testkit's
/// `admin_the_operators_repairs`, which tests/tests/sqlite.rs runs on this storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_names_the_file_and_table() {
    let dir = TempDir::new("outbox-sqlite");
    let storage = storage(&dir.file("app.db"), |_| {}).await;
    let described = storage.describe();
    assert!(
        described.contains("app.db") && described.ends_with("table outbox"),
        "{described}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_take_turns_and_a_claim_takes_at_most_max_per_key_of_one() {
    let dir = TempDir::new("outbox-sqlite");
    let storage = storage(&dir.file("app.db"), |c| c.max_per_key = 2).await;
    let messages: Vec<NewMessage> = (0..5)
        .flat_map(|k| {
            (0..4).map(move |n| NewMessage::new("t", format!("k{k}:{n}")).key(format!("k{k}")))
        })
        .collect();
    storage.enqueue(&messages).await.unwrap();
    let first = storage.claim("w1", 4, LEASE).await.unwrap();
    assert_eq!(payloads(&first), ["k0:0", "k0:1", "k1:0", "k1:1"]);
    let second = storage.claim("w1", 4, LEASE).await.unwrap();
    assert_eq!(payloads(&second), ["k2:0", "k2:1", "k3:0", "k3:1"]);
    let third = storage.claim("w1", 4, LEASE).await.unwrap();
    assert_eq!(
        payloads(&third),
        ["k4:0", "k4:1"],
        "the other keys are in flight"
    );
    storage
        .ack(&first.token, &deliveries(&first))
        .await
        .unwrap();
    let fourth = storage.claim("w1", 4, LEASE).await.unwrap();
    assert_eq!(
        payloads(&fourth),
        ["k0:2", "k0:3", "k1:2", "k1:3"],
        "the sweep wraps around to the keys before the last one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_id_is_a_permanent_error_of_the_enqueue() {
    let (_dir, path) = app_db();
    let storage = storage(&path, |_| {}).await;
    let message = NewMessage::new("t", "once");
    storage
        .enqueue(std::slice::from_ref(&message))
        .await
        .unwrap();
    let error = storage.enqueue(&[message]).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Permanent, "{error}");
    let error = storage
        .enqueue(&[NewMessage::new("", "no topic")])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Permanent, "{error}");
    assert_eq!(storage.stats().await.unwrap().pending, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_builds_a_working_storage() {
    let dir = TempDir::new("outbox-sqlite");
    let mut registry = StorageRegistry::new();
    outbox_sqlite::register(&mut registry);
    let storage = registry
        .build(
            "sqlite",
            serde_json::json!({ "path": dir.file("app.db"), "table": "events", "max_per_key": 4 }),
        )
        .await
        .expect("built");
    storage.migrate().await.unwrap();
    assert_eq!(storage.capabilities().max_per_key, Some(4));
    assert!(storage.capabilities().per_key_order);
    storage.enqueue(&[NewMessage::new("t", "m")]).await.unwrap();
    let c = storage.claim("w1", 10, LEASE).await.unwrap();
    assert_eq!(storage.ack(&c.token, &deliveries(&c)).await.unwrap(), 1);
    assert_eq!(storage.stats().await.unwrap().pending, 0);
    let app = app_pool(&dir.file("app.db")).await;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name LIKE 'events%' ORDER BY name",
    )
    .fetch_all(&app)
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "events",
            "events_dead_letters",
            "events_delivered",
            "events_migrations",
            "events_parked_keys"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_is_written_whole_or_not_at_all() {
    let (_dir, path) = app_db();
    let storage = storage(&path, |c| c.retention = Some(Duration::from_secs(3600))).await;
    storage
        .enqueue(&[
            NewMessage::new("t", "dead").key("a"),
            NewMessage::new("t", "retried").key("b"),
            NewMessage::new("t", "delivered").key("c"),
        ])
        .await
        .unwrap();
    let c = storage.claim("w1", 10, LEASE).await.unwrap();
    let (dead, retried, delivered) = (&c.messages[0], &c.messages[1], &c.messages[2]);
    // Make the last write of the settlement fail: a kept delivery whose seq is taken.
    let app = app_pool(&path).await;
    sqlx::query(
        "INSERT INTO outbox_delivered (seq, id, topic, payload, headers, created_at, attempts, receipt, delivered_at)
         SELECT seq, 'x', 'x', X'', '{}', 0, 0, 'x', 0 FROM outbox WHERE id = ?",
    )
    .bind(delivered.id.to_string())
    .execute(&app)
    .await
    .unwrap();
    let settlement = Settlement {
        dead: vec![DeadLetter {
            id: dead.id,
            error: "poison".into(),
        }],
        retries: vec![outbox_core::Retry {
            id: retried.id,
            delay: Duration::from_secs(3600),
            error: "refused".into(),
        }],
        delivered: vec![Delivery {
            id: delivered.id,
            receipt: Receipt::new("r"),
        }],
        released: vec![],
    };
    let error = storage.settle(&c.token, &settlement).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Permanent, "{error}");
    let stats = storage.stats().await.unwrap();
    assert_eq!(
        (stats.in_flight, stats.dead_lettered, stats.parked_keys),
        (3, 0, 0),
        "nothing of the failed settlement was written: {stats:?}"
    );
    let attempts: i64 = sqlx::query_scalar("SELECT sum(attempts) FROM outbox")
        .fetch_one(&app)
        .await
        .unwrap();
    assert_eq!(attempts, 0);
    // Once the obstacle is gone, the same settlement goes through whole.
    sqlx::query("DELETE FROM outbox_delivered")
        .execute(&app)
        .await
        .unwrap();
    assert_eq!(storage.settle(&c.token, &settlement).await.unwrap(), 3);
    let stats = storage.stats().await.unwrap();
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.dead_lettered,
            stats.parked_keys
        ),
        (1, 0, 1, 1)
    );
}
