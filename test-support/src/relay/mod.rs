//! A relay over PostgreSQL for tests (feature `relay`): a fresh, migrated outbox schema per
//! test ([`TestOutbox`], a [`PgOutbox`]), relays running in the background ([`Relay`]), and the end-to-end
//! scripts every broker runs over a small [`Fixture`](end_to_end::Fixture) of its own
//! ([`end_to_end`]). Sink crates run those scripts from their own tests; nothing here
//! depends on a sink crate.

pub mod end_to_end;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::{
    Backoff, CancellationToken, Claim, NewMessage, QueueStats, Sink, Storage, StorageAdmin, Worker,
    WorkerConfig,
};
use outbox_postgres::sqlx::{
    self, Connection, PgConnection, PgPool, Postgres, Transaction, postgres::PgPoolOptions,
};
use outbox_postgres::{OutboxTable, PgStorage, PostgresConfig};

use crate::{Service, clean_up, postgres_url, unique_name};

/// Worker settings for tests: fast polling and short backoff.
pub fn test_worker_config(worker_id: &str) -> WorkerConfig {
    WorkerConfig {
        poll_interval: Duration::from_millis(50),
        backoff: Backoff {
            initial: Duration::from_millis(50),
            multiplier: 2.0,
            max: Duration::from_millis(500),
            jitter: 0.2,
        },
        shutdown_timeout: Duration::from_secs(5),
        ..WorkerConfig::new(worker_id)
    }
}

/// What the application and the relay see of a PostgreSQL outbox: its table, a pool on its
/// database and its storage. [`TestOutbox`] and the log-mode outbox of the `outbox-tests`
/// crate dereference to it, so their tests enqueue and start relays the same way.
pub struct PgOutbox {
    /// The table names and enqueue statements.
    pub table: OutboxTable,
    /// A pool for the application side (enqueueing, inspecting).
    pub pool: PgPool,
    /// The relay side.
    pub storage: Arc<PgStorage>,
}

impl PgOutbox {
    /// The outbox of `storage` (migrated), with a pool of 20 connections to `url`; a server
    /// that does not answer fails the test with its address.
    pub async fn connect(storage: PgStorage, url: &str) -> PgOutbox {
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect(url)
            .await
            .unwrap_or_else(|e| Service::Postgres.missing(e));
        PgOutbox {
            table: storage.table().clone(),
            pool,
            storage: Arc::new(storage),
        }
    }

    /// Enqueues `messages` in one committed transaction.
    pub async fn enqueue(&self, messages: &[NewMessage]) {
        let mut tx = self.pool.begin().await.expect("begin");
        self.table
            .enqueue_many(&mut tx, messages)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }

    /// Begins a transaction and enqueues `message` in it, leaving it open for the test to
    /// commit or roll back when it chooses.
    pub async fn begin_with(&self, message: &NewMessage) -> Transaction<'static, Postgres> {
        let mut tx = self.pool.begin().await.expect("begin");
        self.table.enqueue(&mut tx, message).await.expect("enqueue");
        tx
    }

    /// Starts a relay with [`test_worker_config`].
    pub fn relay(&self, worker_id: &str, sink: Arc<dyn Sink>) -> Relay {
        self.relay_with(test_worker_config(worker_id), sink)
    }

    /// Starts a relay with the given settings.
    pub fn relay_with(&self, config: WorkerConfig, sink: Arc<dyn Sink>) -> Relay {
        Relay::start(config, self.storage.clone(), sink)
    }

    /// A claim of at most `limit` messages by `worker` for `lease`, as a relay makes it; an
    /// error fails the test.
    pub async fn claim(&self, worker: &str, limit: usize, lease: Duration) -> Claim {
        Storage::claim(&*self.storage, worker, limit, lease)
            .await
            .unwrap_or_else(|e| panic!("claim by {worker}: {e}"))
    }

    /// Acknowledges every message of `claim` (receipt `r`) on this outbox's storage; the
    /// count of rows it settled.
    pub async fn ack(&self, claim: &Claim) -> u64 {
        let delivered = crate::deliveries(&claim.messages, |_| "r".into());
        Storage::ack(&*self.storage, &claim.token, &delivered)
            .await
            .unwrap_or_else(|e| panic!("ack: {e}"))
    }

    /// Every row `sql` selects on the application's pool; an error fails the test.
    pub async fn rows<T>(&self, sql: &str) -> Vec<T>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        sqlx::query_as(sql)
            .fetch_all(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Runs the statement `sql` on the application's pool; an error fails the test.
    pub async fn execute(&self, sql: &str) {
        sqlx::query(sql)
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Queue figures, as this outbox's storage sees them.
    pub async fn stats(&self) -> QueueStats {
        outbox_core::Storage::stats(&*self.storage)
            .await
            .expect("queue figures")
    }

    /// Moves the times in `column` of the outbox's table `suffix` (`""` for the outbox
    /// itself) back by `by`: the database's clock cannot move, so a harness's `advance`
    /// does this instead.
    pub async fn move_times_back(&self, suffix: &str, column: &str, by: Duration) {
        let sql = format!(
            "UPDATE {} SET {column} = {column} - $1 * interval '1 millisecond'",
            self.table.qualified(suffix)
        );
        sqlx::query(&sql)
            .bind(by.as_millis() as i64)
            .execute(&self.pool)
            .await
            .expect("moving stored times back");
    }

    /// Dead letters as (id, last error), oldest first.
    pub async fn dead_letters(&self) -> Vec<(uuid::Uuid, String)> {
        dead_letters_of(&*self.storage).await
    }
}

/// An outbox in a schema of its own, migrated, dropped again when the value is dropped.
pub struct TestOutbox(PgOutbox);

impl std::ops::Deref for TestOutbox {
    type Target = PgOutbox;

    fn deref(&self) -> &PgOutbox {
        &self.0
    }
}

impl TestOutbox {
    /// A fresh outbox with the default settings (per-key order on, wake-up on).
    pub async fn new() -> TestOutbox {
        Self::with_config(|_| {}).await
    }

    /// A fresh outbox whose settings `adjust` may change (the schema is already unique).
    pub async fn with_config(adjust: impl FnOnce(&mut PostgresConfig)) -> TestOutbox {
        let url = postgres_url();
        let mut config = PostgresConfig::new(&url).table(unique_name("t"), "outbox");
        adjust(&mut config);
        let storage = PgStorage::new(config).expect("valid test configuration");
        if let Err(error) = storage.migrate().await {
            Service::Postgres.missing(error);
        }
        TestOutbox(PgOutbox::connect(storage, &url).await)
    }

    /// Waits until nothing is pending or in flight ([`wait_until_drained`]).
    pub async fn wait_until_drained(&self, timeout: Duration) {
        wait_until_drained(&*self.storage, timeout).await
    }

    /// Waits until nothing is pending or in flight; panics at once, with the reasons, if
    /// anything is dead-lettered meanwhile, and with the figures on time-out.
    pub async fn drained_with_no_dead_letters(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let stats = self.stats().await;
            if stats.dead_lettered > 0 {
                panic!("dead-lettered: {:?}", self.dead_letters().await);
            }
            if stats.pending == 0 && stats.in_flight == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "not drained within {timeout:?}: {stats:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `check` holds for the queue figures, polling; panics with `what` after
    /// 30 s.
    pub async fn wait_for(&self, what: &str, check: impl Fn(&QueueStats) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let stats = self.stats().await;
            if check(&stats) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what} within 30 s: {stats:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The receipts kept with the delivered rows (retention on), by message id.
    pub async fn receipts(&self) -> HashMap<uuid::Uuid, String> {
        let delivered = self.table.qualified("_delivered");
        let rows: Vec<(uuid::Uuid, String)> = self
            .rows(&format!("SELECT id, receipt FROM {delivered}"))
            .await;
        rows.into_iter().collect()
    }

    /// The attempts column of every message in the outbox, in enqueue order.
    pub async fn attempts(&self) -> Vec<i32> {
        let outbox = self.table.qualified("");
        let rows: Vec<(i32,)> = self
            .rows(&format!("SELECT attempts FROM {outbox} ORDER BY seq"))
            .await;
        rows.into_iter().map(|(attempts,)| attempts).collect()
    }
}

/// Waits until nothing is pending or in flight in `storage`; panics with the figures on
/// time-out.
pub async fn wait_until_drained(storage: &dyn Storage, timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let stats = storage.stats().await.expect("queue figures");
        if stats.pending == 0 && stats.in_flight == 0 {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("outbox not drained after {timeout:?}: {stats:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A storage's dead letters as (id, last error), oldest first.
pub async fn dead_letters_of(storage: &dyn StorageAdmin) -> Vec<(uuid::Uuid, String)> {
    storage
        .dead_letters(&Default::default(), 100_000)
        .await
        .expect("dead letters")
        .into_iter()
        .map(|d| (d.message.id, d.last_error))
        .collect()
}

impl Drop for TestOutbox {
    fn drop(&mut self) {
        drop_schemas(&[self.table.schema().to_string()]);
    }
}

/// Drops these schemas and everything in them, from any context (see [`run_on_postgres`]).
pub fn drop_schemas(schemas: &[String]) {
    // A test that failed may still hold a transaction on these tables: give up on the
    // schema (it keeps its unique name) rather than wait for it forever.
    let statements = std::iter::once("SET lock_timeout = '5s'".to_string())
        .chain(
            schemas
                .iter()
                .map(|s| format!(r#"DROP SCHEMA IF EXISTS "{s}" CASCADE"#)),
        )
        .collect();
    run_on_postgres(postgres_url(), statements);
}

/// Drops the database `database` of the server of [`postgres_url`], closing its sessions,
/// from any context (see [`run_on_postgres`]).
pub fn drop_database(database: &str) {
    let drop = format!(r#"DROP DATABASE IF EXISTS "{database}" WITH (FORCE)"#);
    run_on_postgres(postgres_url(), vec![drop]);
}

/// Runs `statements` in turn on one connection to the PostgreSQL server at `url`, from any
/// context, a `Drop` inside a test's runtime included (through [`clean_up`]); errors are
/// ignored, as in a clean-up.
pub fn run_on_postgres(url: String, statements: Vec<String>) {
    clean_up(async move {
        let mut conn = PgConnection::connect(&url).await.ok()?;
        for statement in statements {
            let _ = sqlx::query(&statement).execute(&mut conn).await;
        }
        Some(())
    });
}

/// A relay running in the background.
pub struct Relay {
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Starts a worker over `storage` with `config`, in the background.
    pub fn start(config: WorkerConfig, storage: Arc<dyn Storage>, sink: Arc<dyn Sink>) -> Relay {
        let worker = Worker::new(config, storage, sink).expect("valid worker configuration");
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { worker.run(shutdown).await }
        });
        Relay { shutdown, handle }
    }

    /// Shuts the relay down gracefully (in log mode it gives its shards up) and waits for it.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.handle.await.expect("relay task panicked");
    }

    /// Whether the relay's task has ended (a worker only ends when told to, or on a panic).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Stops the relay as a crash would: no shutdown, its claims (and in log mode its
    /// shards) wait out their lease.
    pub fn kill(self) {
        self.handle.abort();
    }
}
