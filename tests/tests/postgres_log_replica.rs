//! Log mode reading from a read replica (`replica_url`): the local streaming replica that
//! `cargo xtask services` starts on 127.0.0.1:5433 (`OUTBOX_TEST_POSTGRES_REPLICA_URL`
//! points elsewhere). Rows and the horizon come from the replica, everything else stays on
//! the primary. Each test has its own database.
//!
//! Only `replay_paused_on_the_replica_delays_but_loses_nothing` pauses the replica's replay;
//! the other tests wait long enough to ride out such a pause.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::NewMessage;
use outbox_core::memory::MemorySink;
use outbox_tests::{LogOutbox, Relay, by_key, poll, unique_name, with_database};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// How long anything may take to reach the replica and be delivered (a paused replay in
/// another test of this file included).
const PATIENCE: Duration = Duration::from_secs(90);

/// The replica's server URL (database `postgres`).
fn replica_server() -> String {
    std::env::var("OUTBOX_TEST_POSTGRES_REPLICA_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5433/postgres".into())
}

/// A connection to the replica's server, or a loud failure naming how to start it.
async fn replica_admin() -> PgPool {
    let url = replica_server();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the PostgreSQL read replica must run at {} (start it with `cargo xtask \
                 services`, or set OUTBOX_TEST_POSTGRES_REPLICA_URL): {e}",
                outbox_core::redact_url(&url)
            )
        });
    let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&pool)
        .await
        .expect("ask the replica whether it is a standby");
    assert!(
        standby,
        "{} is not a standby (pg_is_in_recovery() is false): it must be a streaming replica \
         of the tests' PostgreSQL",
        outbox_core::redact_url(&url)
    );
    pool
}

/// A log-mode outbox ([`LogOutbox`]) in a database of its own whose relay reads from the
/// replica, made once the replica has replayed its tables.
struct ReplicaOutbox(LogOutbox);

impl std::ops::Deref for ReplicaOutbox {
    type Target = LogOutbox;

    fn deref(&self) -> &LogOutbox {
        &self.0
    }
}

impl ReplicaOutbox {
    async fn new(shards: u32) -> ReplicaOutbox {
        let replica = replica_admin().await;
        let database = unique_name("outbox_replica");
        let on_replica_url = with_database(&replica_server(), &database);
        let outbox = LogOutbox::in_database(database, shards, |config| {
            config.replica_url = Some(on_replica_url.clone());
        })
        .await;
        // The replica has the tables once it has replayed the migration.
        let shards_table = outbox.table.qualified("_shards");
        poll(PATIENCE, Duration::from_millis(100), || async {
            let on_replica = PgPoolOptions::new()
                .max_connections(1)
                .connect(&on_replica_url)
                .await;
            if let Ok(on_replica) = on_replica {
                let ok = sqlx::query(&format!("SELECT 1 FROM {shards_table} LIMIT 1"))
                    .fetch_optional(&on_replica)
                    .await
                    .is_ok_and(|row| row.is_some());
                on_replica.close().await;
                if ok {
                    return Ok(());
                }
            }
            Err("the replica did not replay the test's database and tables".to_string())
        })
        .await;
        replica.close().await;
        ReplicaOutbox(outbox)
    }

    /// [`ReplicaOutbox::new`] with a relay (`replica-test`) running into a sink of its own.
    async fn relayed(shards: u32) -> (ReplicaOutbox, Arc<MemorySink>, Relay) {
        let outbox = ReplicaOutbox::new(shards).await;
        let sink = Arc::new(MemorySink::new());
        let relay = outbox.relay("replica-test", sink.clone());
        (outbox, sink, relay)
    }

    /// Waits until the sink has `n` messages and every row is behind a cursor.
    async fn wait_until_published(&self, sink: &MemorySink, n: usize) {
        poll(PATIENCE, Duration::from_millis(50), || async {
            let (left, published) = (self.undelivered().await, sink.published().len());
            match left == 0 && published >= n {
                true => Ok(()),
                false => Err(format!(
                    "{left} rows not delivered ({published} of {n} published)"
                )),
            }
        })
        .await
    }

    /// Waits until the replica has replayed this database's rows up to `n` rows in the log.
    async fn wait_until_replica_has(&self, n: i64) {
        let on_replica = PgPoolOptions::new()
            .max_connections(1)
            .connect(&with_database(&replica_server(), &self.database))
            .await
            .expect("connect to the replica");
        let count = format!("SELECT count(*) FROM {}", self.table.qualified(""));
        poll(PATIENCE, Duration::from_millis(20), || async {
            let rows: i64 = sqlx::query_scalar(&count)
                .fetch_one(&on_replica)
                .await
                .expect("count rows on the replica");
            match rows >= n {
                true => Ok(()),
                false => Err(format!("the replica has {rows} of {n} rows")),
            }
        })
        .await;
        on_replica.close().await;
    }
}

/// Resumes the replica's replay when dropped, so a failing test leaves it running.
struct Paused;

impl Paused {
    async fn pause(replica: &PgPool) -> Paused {
        sqlx::query("SELECT pg_wal_replay_pause()")
            .execute(replica)
            .await
            .expect("pause replay on the replica");
        poll(
            Duration::from_secs(10),
            Duration::from_millis(20),
            || async {
                let state: String = sqlx::query_scalar("SELECT pg_get_wal_replay_pause_state()")
                    .fetch_one(replica)
                    .await
                    .expect("read the replica's pause state");
                match state.as_str() {
                    "paused" => Ok(Paused),
                    _ => Err(format!("replay did not pause: {state}")),
                }
            },
        )
        .await
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let resume = "SELECT pg_wal_replay_resume()".to_string();
        outbox_tests::run_on_postgres(replica_server(), vec![resume]);
    }
}

fn keyed(key: &str, payload: String) -> NewMessage {
    NewMessage::new("t", payload.into_bytes()).key(key)
}

/// `count` messages over `keys` keys, `prefix-<n>`, in per-key order.
fn batch(prefix: &str, count: usize, keys: usize) -> Vec<NewMessage> {
    (0..count)
        .map(|i| keyed(&format!("k{}", i % keys), format!("{prefix}-{i:04}")))
        .collect()
}

/// Every key's payloads are in increasing order, none twice.
fn assert_in_order(sink: &MemorySink) {
    for (key, payloads) in by_key(&sink.published()) {
        let mut sorted = payloads.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(payloads, sorted, "key {key} out of order or repeated");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_reading_from_the_replica_delivers_everything_in_key_order() {
    let (outbox, sink, relay) = ReplicaOutbox::relayed(4).await;
    let mut expected = 0;
    for round in 0..10 {
        let messages = batch(&format!("m{round:02}"), 30, 7);
        expected += messages.len();
        outbox.enqueue(&messages).await;
    }
    outbox.wait_until_published(&sink, expected).await;
    assert_eq!(sink.published().len(), expected, "each message once");
    assert_in_order(&sink);

    // The rows came from the replica: the relay's read sessions are there.
    let replica = replica_admin().await;
    let sessions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = $1 AND application_name = 'outbox-relay'",
    )
    .bind(&outbox.database)
    .fetch_one(&replica)
    .await
    .expect("count the relay's sessions on the replica");
    assert!(sessions > 0, "the relay has no session on the replica");
    relay.stop().await;
}

/// Paused replay freezes the replica's rows and horizon: the relay delivers nothing new
/// while its ownership and cursors on the primary carry on; once replay resumes, every
/// message comes, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_paused_on_the_replica_delays_but_loses_nothing() {
    let (outbox, sink, relay) = ReplicaOutbox::relayed(4).await;
    let before = batch("a", 40, 5);
    outbox.enqueue(&before).await;
    outbox.wait_until_published(&sink, before.len()).await;

    let replica = replica_admin().await;
    let paused = Paused::pause(&replica).await;
    let mut during = 0;
    for round in 0..5 {
        let messages = batch(&format!("b{round}"), 20, 5);
        during += messages.len();
        outbox.enqueue(&messages).await;
    }
    // Committed on the primary, invisible on the paused replica: nothing new goes out.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        sink.published().len(),
        before.len(),
        "messages were delivered while the replica's replay was paused"
    );
    assert_eq!(outbox.undelivered().await, during as i64);
    // The horizon is the replica's: the rows it has not replayed count as waiting.
    let lag = outbox_core::Storage::horizon(&*outbox.storage)
        .await
        .expect("horizon lag")
        .expect("log mode");
    assert!(lag.waiting >= during as u64, "{lag:?}");

    drop(paused);
    outbox
        .wait_until_published(&sink, before.len() + during)
        .await;
    assert_eq!(sink.published().len(), before.len() + during);
    assert_in_order(&sink);
    relay.stop().await;
}

/// A transaction that took its id before later ones committed, and commits last: the
/// replica knows its id is running (from the later ids it replayed), so its horizon stays
/// below it, and the row is delivered first in its key's order, not skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_committing_transaction_is_delivered_from_the_replica() {
    let (outbox, sink, relay) = ReplicaOutbox::relayed(2).await;

    // Its id is taken before the others, with nothing written to the WAL for it yet.
    let mut late = outbox.pool.begin().await.expect("begin");
    let _xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(&mut *late)
        .await
        .expect("take a transaction id");
    for i in 1..=5 {
        outbox
            .enqueue(&[
                keyed("k", format!("after-{i}")),
                keyed("other", format!("other-{i}")),
            ])
            .await;
    }
    // The replica has the later rows, and the horizon keeps them back.
    outbox.wait_until_replica_has(10).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        sink.published().is_empty(),
        "rows above a running transaction were delivered: {:?}",
        by_key(&sink.published())
    );

    outbox
        .table
        .enqueue(&mut late, &keyed("k", "late".into()))
        .await
        .expect("enqueue in the late transaction");
    late.commit().await.expect("commit the late transaction");
    outbox.wait_until_published(&sink, 11).await;
    let keys = by_key(&sink.published());
    assert_eq!(
        keys["k"],
        [
            "late", "after-1", "after-2", "after-3", "after-4", "after-5"
        ],
        "the late row comes first in its key's order (its transaction id is the oldest)"
    );
    assert_eq!(keys["other"].len(), 5);
    relay.stop().await;
}
