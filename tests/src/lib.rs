//! Shared support for the integration suites: a fresh, migrated outbox schema per test
//! ([`TestOutbox`]), a log-mode outbox in a database of its own ([`LogOutbox`]), relays
//! running in the background and the end-to-end scripts every broker runs (the
//! conformance suites are in `outbox-testkit`). What does not need the outbox (service URLs,
//! names, the proxy, broker helpers) is in `outbox-test-support`, re-exported here where the
//! suites used it from. tests/README.md says where a new test goes.
//!
//! Every test talks to the real services. A server that is not there makes the test fail
//! with a message naming it; nothing is skipped.

mod log_outbox;

pub use log_outbox::{LogOutbox, with_database};
pub use outbox_test_support::relay::{
    PgOutbox, Relay, TestOutbox, dead_letters_of, drop_database, drop_schemas, end_to_end,
    run_on_postgres, test_worker_config, wait_until_drained,
};
pub use outbox_test_support::{
    Proxy, Service, TempDir, by_key, clean_up, deliveries, free_addr, free_port, host_port, kafka,
    mysql_url, payloads, poll, postgres_url, text, unique_name,
};

/// `total` messages over `keys` keys in turn (`k0`, `k1`, …): the n-th message of a key has
/// the payload `n` in five digits, so that [`assert_key_order`] can tell each key's order.
pub fn over_keys(total: usize, keys: usize) -> Vec<outbox_core::NewMessage> {
    (0..total)
        .map(|i| {
            outbox_core::NewMessage::new("t", format!("{:05}", i / keys))
                .key(format!("k{}", i % keys))
        })
        .collect()
}

/// `n` messages without a key on the topic `t`, whose payloads count from `0`.
pub fn numbered(n: usize) -> Vec<outbox_core::NewMessage> {
    (0..n)
        .map(|i| outbox_core::NewMessage::new("t", i.to_string()))
        .collect()
}

/// Messages on the topic `t` with the key `key` and these payloads, in order.
pub fn keyed(key: &str, payloads: &[&str]) -> Vec<outbox_core::NewMessage> {
    payloads
        .iter()
        .map(|p| outbox_core::NewMessage::new("t", *p).key(key))
        .collect()
}

/// Asserts that every key of `by_key` (payloads per key, as [`by_key`] reads them) holds the
/// payloads of [`over_keys`]`(total, keys)`, all of them, in order.
pub fn assert_key_order(
    by_key: &std::collections::BTreeMap<String, Vec<String>>,
    total: usize,
    keys: usize,
) {
    let expected: Vec<String> = (0..total / keys).map(|i| format!("{i:05}")).collect();
    for (key, payloads) in by_key {
        assert_eq!(payloads, &expected, "order broken for key {key}");
    }
}

/// Four relays over `storage` deliver 20,000 messages over 200 keys ([`over_keys`]) exactly
/// once, every key in order: `enqueue` writes them first, `batch` at a time (the
/// application's way), then the relays, in batches of 250, drain the storage.
pub async fn four_relays_deliver_once_in_key_order(
    storage: std::sync::Arc<dyn outbox_core::Storage>,
    enqueue: impl AsyncFn(&[outbox_core::NewMessage]),
    batch: usize,
) {
    let (keys, total) = (200, 20_000);
    for messages in over_keys(total, keys).chunks(batch) {
        enqueue(messages).await;
    }
    let sink = std::sync::Arc::new(outbox_core::memory::MemorySink::new());
    let relays: Vec<Relay> = (0..4)
        .map(|i| {
            let config = outbox_core::WorkerConfig {
                batch_size: 250,
                ..test_worker_config(&format!("w{i}"))
            };
            Relay::start(config, storage.clone(), sink.clone())
        })
        .collect();
    wait_until_drained(&*storage, std::time::Duration::from_secs(120)).await;
    for relay in relays {
        relay.stop().await;
    }
    let published = sink.published();
    assert_eq!(published.len(), total, "every message exactly once");
    let distinct: std::collections::HashSet<_> = published.iter().map(|m| m.id).collect();
    assert_eq!(distinct.len(), total, "every message delivered, none twice");
    assert_key_order(&by_key(&published), total, keys);
}

/// A PostgreSQL transaction holding messages it has not committed yet: what a storage
/// harness of the testkit hands out from `StorageFixture::begin` ([`PgWrite::begin`]).
pub struct PgWrite(sqlx::Transaction<'static, sqlx::Postgres>);

impl PgWrite {
    /// Begins a transaction on `outbox` and enqueues `messages` in it.
    pub async fn begin(
        outbox: &PgOutbox,
        messages: &[outbox_core::NewMessage],
    ) -> Box<dyn outbox_testkit::PendingWrite> {
        let mut tx = outbox.pool.begin().await.expect("begin");
        outbox
            .table
            .enqueue_many(&mut tx, messages)
            .await
            .expect("enqueue");
        Box::new(PgWrite(tx))
    }
}

#[async_trait::async_trait]
impl outbox_testkit::PendingWrite for PgWrite {
    async fn commit(self: Box<Self>) {
        self.0.commit().await.expect("commit");
    }
    async fn rollback(self: Box<Self>) {
        self.0.rollback().await.expect("rollback");
    }
}

/// Runs `make`'s future to its end on a blocking thread and returns what it gives: for an
/// outbox fixture made inside an `async_trait` method, which must be `Send` where sqlx's
/// futures are not (a higher-ranked lifetime in its executor).
pub async fn on_a_blocking_thread<T, F>(make: impl FnOnce() -> F + Send + 'static) -> T
where
    T: Send + 'static,
    F: std::future::Future<Output = T>,
{
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || runtime.block_on(make()))
        .await
        .expect("making a fresh outbox")
}

/// A SQLite storage on `config`'s file, opened (the file made if missing) and migrated.
pub async fn open_sqlite(config: outbox_sqlite::SqliteConfig) -> outbox_sqlite::SqliteStorage {
    let storage = outbox_sqlite::SqliteStorage::open(config)
        .await
        .expect("open the database");
    storage.migrate().await.expect("migrate");
    storage
}

/// Drops a MySQL outbox's tables (every one its migrations make:
/// [`outbox_mysql::OutboxTable::drop_sql`]) from any context (see [`run_on_mysql`]).
pub fn drop_mysql_tables(table: &outbox_mysql::OutboxTable) {
    run_on_mysql(vec![table.drop_sql()]);
}

/// Runs `statements` in turn on one connection to the MySQL server of [`mysql_url`], from any
/// context, a `Drop` inside a test's runtime included (through [`clean_up`]), after a lock
/// timeout of 5 s (a failed test may hold its transaction open: give up rather than wait);
/// errors are ignored, as in a clean-up. MySQL's [`run_on_postgres`].
pub fn run_on_mysql(statements: Vec<String>) {
    use outbox_mysql::sqlx::{Connection, MySqlConnection};
    let url = mysql_url();
    clean_up(async move {
        let mut conn = MySqlConnection::connect(&url).await.ok()?;
        let timeout = "SET SESSION lock_wait_timeout = 5".to_string();
        for statement in std::iter::once(timeout).chain(statements) {
            let _ = outbox_mysql::sqlx::query(&statement)
                .execute(&mut conn)
                .await;
        }
        Some(())
    });
}

/// A pool of at most `max_connections` to `url`, a server of `service`; a server that does
/// not answer fails the test with its address ([`Service::missing`]).
pub async fn pool<DB: sqlx::Database>(
    service: Service,
    url: &str,
    max_connections: u32,
) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(max_connections)
        .connect(url)
        .await
        .unwrap_or_else(|e| service.missing(e))
}

/// Bad input to a storage is a clear error, never a panic: `message` (after a good one, in
/// one enqueue) is refused as `Permanent` with a message, and nothing of the batch is
/// written.
pub async fn assert_refused_as_permanent(
    storage: &dyn outbox_core::StorageAdmin,
    what: &str,
    message: outbox_core::NewMessage,
) {
    let good = outbox_core::NewMessage::new("t", "good").key("k");
    let error = match storage.enqueue(&[good, message]).await {
        Ok(()) => panic!("{what}: enqueued"),
        Err(e) => e,
    };
    assert_eq!(
        error.kind(),
        outbox_core::ErrorKind::Permanent,
        "{what}: {error}"
    );
    assert!(!error.message().is_empty(), "{what}: an empty message");
    let stats = storage.stats().await.expect("stats");
    assert_eq!(
        stats.pending, 0,
        "{what}: the refused enqueue wrote part of its batch"
    );
}

/// After refused enqueues ([`assert_refused_as_permanent`]) a good one goes through, and it
/// is all a claim finds.
pub async fn assert_a_good_enqueue_goes_through(storage: &dyn outbox_core::StorageAdmin) {
    storage
        .enqueue(&[outbox_core::NewMessage::new("t", "after").key("k")])
        .await
        .expect("a good enqueue after the refused ones");
    let claim = storage
        .claim("bad", 10, std::time::Duration::from_secs(30))
        .await
        .expect("claim");
    let payloads: Vec<&[u8]> = claim.messages.iter().map(|m| &m.payload[..]).collect();
    assert_eq!(payloads, [b"after"]);
}
