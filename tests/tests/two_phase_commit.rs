//! Writers that use two-phase commit (`PREPARE TRANSACTION`), in both PostgreSQL modes.
//!
//! A test binary of their own: a prepared transaction holds the readable horizon of every
//! log-mode table of the cluster, in every database, so these must not run beside the
//! log-mode tests (cargo runs one test binary at a time).

use std::sync::Arc;
use std::time::Duration;

use outbox_core::memory::MemorySink;
use outbox_core::{CancellationToken, NewMessage, Worker};
use outbox_postgres::{OutboxTable, PgStorage, StorageMode};
use outbox_tests::{TestOutbox, test_worker_config};
use sqlx::PgPool;

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

/// Two-phase commit: a writer's `PREPARE TRANSACTION` succeeds while a relay is idle (a
/// transaction that ran NOTIFY cannot be prepared, so where the server allows prepared
/// transactions a relay never asks writers to notify, and clears the flag an earlier one
/// left), and the relay delivers the message once it is committed, polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_phase_commit_writer_prepares_while_the_relay_is_idle() {
    let outbox = TestOutbox::with_config(|c| {
        c.mode = StorageMode::Log;
        c.shards = 2;
    })
    .await;
    two_phase_commit_while_idle(&outbox.table, &outbox.pool, &outbox.storage).await;
}

/// The same in lease mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_phase_commit_writer_prepares_while_a_lease_mode_relay_is_idle() {
    let outbox = TestOutbox::new().await;
    two_phase_commit_while_idle(&outbox.table, &outbox.pool, &outbox.storage).await;
}

async fn two_phase_commit_while_idle(table: &OutboxTable, pool: &PgPool, storage: &Arc<PgStorage>) {
    let allowed: String = sqlx::query_scalar("SHOW max_prepared_transactions")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_ne!(
        allowed, "0",
        "the test server has max_prepared_transactions = 0: `cargo xtask services` sets it to 16"
    );
    // The flag as a relay of an earlier release, or one started before the server allowed
    // prepared transactions, leaves it: writers notify.
    let flag = format!("SELECT relay_idle FROM {}", table.qualified("_wakeup"));
    sqlx::query(&format!(
        "UPDATE {} SET relay_idle = true",
        table.qualified("_wakeup")
    ))
    .execute(pool)
    .await
    .unwrap();
    let sink = Arc::new(MemorySink::new());
    let worker = Worker::new(test_worker_config("w"), storage.clone(), sink.clone()).unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    // The relay finds nothing and waits: where prepared transactions are allowed it does
    // not ask writers to notify, and clears the flag.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !sqlx::query_scalar::<_, bool>(&flag)
            .fetch_one(pool)
            .await
            .unwrap(),
        "an idle relay asks writers to notify although they may prepare"
    );
    let gid = format!("outbox-test-{}", uuid::Uuid::now_v7());
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    table
        .enqueue(&mut conn, &NewMessage::new("t", "prepared").key("k"))
        .await
        .unwrap();
    let prepared = sqlx::query(&format!("PREPARE TRANSACTION '{gid}'"))
        .execute(&mut *conn)
        .await;
    if prepared.is_err() {
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
    }
    prepared.expect("PREPARE TRANSACTION of a writer while the relay is idle");
    sqlx::query(&format!("COMMIT PREPARED '{gid}'"))
        .execute(&mut *conn)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sink.published().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the prepared message was not delivered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    handle.await.unwrap();
    assert_eq!(text(&sink.published()[0].payload), "prepared");
}
