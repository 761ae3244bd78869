//! The storage conformance suite against the SQLite storage: real database files in
//! temporary directories, a relay's `SqliteStorage` and an application's own pool on each.
//!
//! **Two open transactions.** The suite opens several transactions at once and commits them
//! in either order. SQLite has one writer at a time: a transaction that has written holds the
//! write lock until it ends, so a second one cannot write (nor can a claim run) while the
//! first is open; in the single-task suite that would wait until `busy_timeout` and fail.
//! So `begin` opens a real transaction (a deferred `BEGIN` on a connection of its own, which
//! takes no lock) and the messages are written in it when the suite commits, just before the
//! `COMMIT`: what a writer of SQLite produces, with the rows invisible until the commit and a
//! rollback leaving nothing.
//!
//! **Positions.** Written that way, a message takes its place in its key's order at its
//! commit, as every SQLite writer's does (`seq` is taken at INSERT, and no other transaction
//! can write between that INSERT and the COMMIT). Two checks of the suite model PostgreSQL's
//! order instead, where a message takes its place when it is written, before a later
//! transaction that commits first: the late-commit check and the randomised model (which
//! numbers messages when they are written). They test the claim rule on a due row that
//! appears ahead of a waiting one, which on SQLite happens through replays rather than late
//! commits. To run them as they are, the harness `Sqlite { positions_at_write: true }`
//! reserves the `seq` values at `begin` (from `sqlite_sequence`, as PostgreSQL's sequence
//! does) and writes the rows with them at commit; the storage under test is the same. The
//! harness with `positions_at_write: false` writes through `OutboxTable::enqueue_many`, the
//! application's API, and runs every check that does not depend on those positions.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{NewMessage, Storage, StorageAdmin};
use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use outbox_sqlite::sqlx::{self, Sqlite as Db, Transaction};
use outbox_sqlite::{OutboxTable, SqliteConfig, SqliteStorage};
use outbox_testkit::{HarnessTraits, PendingWrite, StorageFixture, StorageHarness};
use outbox_tests::{TempDir, open_sqlite};
use uuid::Uuid;

/// SQLite: each fixture is a fresh database file, migrated.
struct Sqlite {
    /// Messages take their `seq` when `begin` writes them (PostgreSQL's order) rather than
    /// at their commit (SQLite's).
    positions_at_write: bool,
}

struct SqliteFixture {
    /// The relay's storage (a new one after each restart).
    relay: Mutex<Arc<SqliteStorage>>,
    /// The application's side: its own connections to the same file.
    app: SqlitePool,
    table: OutboxTable,
    positions_at_write: bool,
    /// Last, so the file goes after the pools.
    _dir: TempDir,
}

struct SqliteWrite {
    tx: Transaction<'static, Db>,
    table: OutboxTable,
    messages: Vec<NewMessage>,
    /// The `seq` of the first message, when positions were taken at `begin`.
    first_seq: Option<i64>,
}

impl SqliteWrite {
    /// Writes the messages with the `seq` values reserved for them: the table's columns as
    /// the plain-INSERT contract has them, plus `seq`, which only this test sets.
    async fn insert_at(&mut self, first_seq: i64) {
        let sql = format!(
            "INSERT INTO {} (seq, id, topic, partition_key, payload, headers, traceparent, \
             tracestate, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            self.table.quoted("")
        );
        for (seq, m) in (first_seq..).zip(&self.messages) {
            let (traceparent, tracestate) = match &m.trace_context {
                Some(t) => (Some(t.traceparent.clone()), t.tracestate.clone()),
                None => (None, None),
            };
            sqlx::query(&sql)
                .bind(seq)
                .bind(m.id.hyphenated().to_string())
                .bind(&m.topic)
                .bind(&m.key)
                .bind(&m.payload)
                .bind(serde_json::to_string(&m.headers).expect("headers as JSON"))
                .bind(traceparent)
                .bind(tracestate)
                .bind(m.created_at.timestamp_micros())
                .execute(&mut *self.tx)
                .await
                .expect("writing at the reserved positions");
        }
    }
}

impl SqliteFixture {
    fn relay(&self) -> Arc<SqliteStorage> {
        self.relay.lock().expect("the relay's storage").clone()
    }
}

#[async_trait]
impl PendingWrite for SqliteWrite {
    async fn commit(mut self: Box<Self>) {
        match self.first_seq {
            Some(first) => self.insert_at(first).await,
            None => self
                .table
                .enqueue_many(&mut self.tx, &self.messages)
                .await
                .expect("enqueue"),
        }
        self.tx.commit().await.expect("commit");
    }

    async fn rollback(self: Box<Self>) {
        self.tx.rollback().await.expect("rollback");
    }
}

#[async_trait]
impl StorageFixture for SqliteFixture {
    fn storage(&self) -> Arc<dyn Storage> {
        self.relay()
    }

    fn admin(&self) -> Arc<dyn StorageAdmin> {
        self.relay()
    }

    async fn restart(&self, stop: bool) -> bool {
        let old = self.relay();
        if stop {
            old.stop().await.expect("stop");
        }
        let config = old.config().clone();
        let new = SqliteStorage::open(config).await.expect("opening the file");
        *self.relay.lock().expect("the relay's storage") = Arc::new(new);
        true
    }

    async fn begin(&self, messages: &[NewMessage]) -> Box<dyn PendingWrite> {
        let tx = self.app.begin().await.expect("begin");
        let first_seq = if self.positions_at_write && !messages.is_empty() {
            let n = messages.len() as i64;
            let last: i64 = sqlx::query_scalar(
                "UPDATE sqlite_sequence SET seq = seq + ?1 WHERE name = ?2 RETURNING seq",
            )
            .bind(n)
            .bind(self.table.table())
            .fetch_one(&self.app)
            .await
            .expect("reserving positions");
            Some(last - n + 1)
        } else {
            None
        };
        Box::new(SqliteWrite {
            tx,
            table: self.table.clone(),
            messages: messages.to_vec(),
            first_seq,
        })
    }

    async fn advance(&self, by: Duration) {
        // The database's clock cannot move: move every stored time back instead.
        let sql = format!(
            "UPDATE {} SET available_at = available_at - ?",
            self.table.quoted("")
        );
        sqlx::query(&sql)
            .bind(by.as_millis() as i64)
            .execute(&self.app)
            .await
            .expect("moving stored times back");
    }
}

#[async_trait]
impl StorageHarness for Sqlite {
    fn traits(&self) -> HarnessTraits {
        match self.positions_at_write {
            true => HarnessTraits::default(),
            false => HarnessTraits::default().positions_at_commit(),
        }
    }

    async fn fresh(&self, per_key_order: bool) -> Box<dyn StorageFixture> {
        let dir = TempDir::new("outbox-sqlite");
        let path = dir.file("app.db");
        let config = SqliteConfig {
            per_key_order,
            ..SqliteConfig::new(&path)
        };
        let storage = open_sqlite(config).await;
        let table = storage.table().clone();
        // Twelve transactions may be open at once, each on a connection of its own.
        let app = SqlitePoolOptions::new()
            .max_connections(20)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&path)
                    .busy_timeout(Duration::from_secs(10)),
            )
            .await
            .expect("the application's pool");
        sqlx::query(
            "INSERT INTO sqlite_sequence (name, seq) SELECT ?1, 0
             WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = ?1)",
        )
        .bind(table.table())
        .execute(&app)
        .await
        .expect("starting the sequence");
        Box::new(SqliteFixture {
            relay: Mutex::new(Arc::new(storage)),
            app,
            table,
            positions_at_write: self.positions_at_write,
            _dir: dir,
        })
    }
}

/// Every check, with positions taken when a message is written (PostgreSQL's order).
mod positions_at_write {
    outbox_testkit::storage_conformance_tests!(super::Sqlite {
        positions_at_write: true
    });
}

/// Through the application's API, positions taken at commit (SQLite's order): the two checks
/// that number messages when they are written skip (see the top of this file).
mod commit_order {
    outbox_testkit::storage_conformance_tests!(super::Sqlite {
        positions_at_write: false
    });
}

/// The security review's SQLite finding (issue 30, item 3): a row whose key is TEXT that is
/// not valid UTF-8 (a C binding can write it) stalled its claim for good, with the good
/// messages claimed beside it, and made every dead-letter listing fail. Now the claim
/// dead-letters it with why and parks its key; the other messages go out at once; the
/// listing shows it, its key read lossily.
#[tokio::test]
async fn a_row_that_cannot_be_read_is_dead_lettered_and_the_rest_flows() {
    let dir = TempDir::new("outbox-sqlite");
    let path = dir.file("app.db");
    let storage = open_sqlite(SqliteConfig::new(&path)).await;
    let app = SqlitePool::connect_with(SqliteConnectOptions::new().filename(&path))
        .await
        .expect("the application's pool");
    let outbox = storage.table().quoted("");
    for (key, payload) in [("CAST(X'ff3c62' AS TEXT)", "A"), ("'after-bad-utf8'", "B")] {
        sqlx::query(&format!(
            "INSERT INTO {outbox} (id, topic, partition_key, payload) VALUES (?, 'ok', {key}, ?)"
        ))
        .bind(Uuid::now_v7().hyphenated().to_string())
        .bind(payload.as_bytes())
        .execute(&app)
        .await
        .expect("a writer that stores bytes as TEXT");
    }
    let claim = storage
        .claim("w", 10, Duration::from_secs(30))
        .await
        .expect("a row that cannot be read does not fail the claim");
    let keys: Vec<_> = claim.messages.iter().map(|m| m.key.clone()).collect();
    assert_eq!(keys, [Some("after-bad-utf8".to_string())]);

    let dead = storage
        .dead_letters(&Default::default(), 10)
        .await
        .expect("the listing shows a dead letter that is not valid UTF-8");
    let [row] = &dead[..] else {
        panic!("one dead letter: {dead:?}")
    };
    assert_eq!(row.message.key.as_deref(), Some("\u{fffd}<b"));
    assert_eq!(row.message.payload, b"A");
    assert!(
        row.last_error.contains("partition_key") && row.last_error.contains("UTF-8"),
        "{}",
        row.last_error
    );
    let parked = storage.parked_keys().await.expect("parked keys");
    assert_eq!(parked.len(), 1, "its key is parked: {parked:?}");
    // Nothing is left claimed or pending behind it.
    let again = storage
        .claim("w", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    assert!(again.messages.is_empty(), "{:?}", again.messages);
}
