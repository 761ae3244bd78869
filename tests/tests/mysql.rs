//! The MySQL / MariaDB storage against the real server (MariaDB on 127.0.0.1:3306, database
//! `test`; `OUTBOX_TEST_MYSQL_URL` overrides it): the storage conformance suite, four relays
//! over 20,000 messages, a sink outage, the plain-INSERT contract and bad input. Every test
//! uses tables of its own, so they run in parallel. A server that is not running fails the
//! tests with its address.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{ErrorKind, NewMessage, Storage, StorageAdmin, StorageRegistry};
use outbox_mysql::sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use outbox_mysql::sqlx::{self, MySql, Transaction};
use outbox_mysql::{MySqlConfig, MySqlStorage, OutboxTable};
use outbox_testkit::{HarnessTraits, PendingWrite, StorageFixture, StorageHarness};
use outbox_tests::{four_relays_deliver_once_in_key_order, payloads, unique_name};

use outbox_tests::mysql_url;

fn missing(error: impl std::fmt::Display) -> ! {
    outbox_tests::Service::MySql.missing(error)
}

/// An outbox in tables of its own (`t_<random>`), migrated, dropped with the value.
struct TestOutbox {
    table: OutboxTable,
    pool: MySqlPool,
    storage: Arc<MySqlStorage>,
}

impl TestOutbox {
    async fn with_config(adjust: impl FnOnce(&mut MySqlConfig)) -> TestOutbox {
        let mut config = MySqlConfig::new(mysql_url()).table(unique_name("t"));
        adjust(&mut config);
        let storage = MySqlStorage::new(config).expect("valid test configuration");
        if let Err(error) = storage.migrate().await {
            missing(error);
        }
        let pool = MySqlPoolOptions::new()
            .max_connections(20)
            .connect(&mysql_url())
            .await
            .unwrap_or_else(|e| missing(e));
        TestOutbox {
            table: storage.table().clone(),
            pool,
            storage: Arc::new(storage),
        }
    }

    async fn enqueue(&self, messages: &[NewMessage]) {
        let mut tx = self.pool.begin().await.expect("begin");
        self.table
            .enqueue_many(&mut tx, messages)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
}

impl Drop for TestOutbox {
    fn drop(&mut self) {
        outbox_tests::drop_mysql_tables(&self.table);
    }
}

/// MySQL: each fixture is a fresh, migrated table of its own.
///
/// **Positions.** `AUTO_INCREMENT` hands out `seq` at the INSERT, as PostgreSQL's sequence
/// does, so the plain fixture writes a message when the suite begins its transaction and the
/// row stays uncommitted (and locked by that transaction) until the suite commits: the real
/// thing. The randomised model keeps such transactions open while it replays dead letters,
/// and InnoDB makes a replay wait for them: putting a dead letter's id back into the unique
/// `id` index checks for duplicates under a next-key lock, which waits for an uncommitted
/// row whose id sorts next while the old, deleted entry of the same id is not yet purged
/// (an open transaction holds the purge back). In the model's single task that wait never
/// ends. So the model runs with `positions_reserved`: `begin` reserves the `seq` values (an
/// INSERT rolled back at once: InnoDB does not hand those values out again) and the rows are
/// written with them just before the COMMIT, so each message still takes its place when it
/// is begun, as the model numbers them. docs/storage/mysql.md lists the wait as a limit.
struct MySqlHarness {
    positions_reserved: bool,
}

struct Fixture {
    outbox: TestOutbox,
    positions_reserved: bool,
    /// The relay's storage (a new one after each restart).
    relay: std::sync::Mutex<Arc<MySqlStorage>>,
}

impl Fixture {
    fn relay(&self) -> Arc<MySqlStorage> {
        self.relay.lock().expect("the relay's storage").clone()
    }
}

struct Write {
    tx: Transaction<'static, MySql>,
    /// With reserved positions: the rows to write at commit, from this `seq` on.
    reserved: Option<(i64, Vec<NewMessage>, OutboxTable)>,
}

#[async_trait]
impl PendingWrite for Write {
    async fn commit(mut self: Box<Self>) {
        if let Some((first, messages, table)) = self.reserved.take() {
            let sql = format!(
                "INSERT INTO {} (seq, id, topic, partition_key, payload, headers, traceparent, \
                 tracestate, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                table.qualified("")
            );
            for (seq, m) in (first..).zip(&messages) {
                let (traceparent, tracestate) = match &m.trace_context {
                    Some(t) => (Some(t.traceparent.clone()), t.tracestate.clone()),
                    None => (None, None),
                };
                sqlx::query(&sql)
                    .bind(seq)
                    .bind(m.id.to_string())
                    .bind(&m.topic)
                    .bind(&m.key)
                    .bind(&m.payload)
                    .bind(serde_json::to_string(&m.headers).expect("headers as JSON"))
                    .bind(traceparent)
                    .bind(tracestate)
                    .bind(m.created_at.naive_utc())
                    .execute(&mut *self.tx)
                    .await
                    .expect("writing at the reserved positions");
            }
        }
        self.tx.commit().await.expect("commit");
    }
    async fn rollback(self: Box<Self>) {
        self.tx.rollback().await.expect("rollback");
    }
}

#[async_trait]
impl StorageFixture for Fixture {
    fn storage(&self) -> Arc<dyn Storage> {
        self.relay()
    }

    fn admin(&self) -> Arc<dyn StorageAdmin> {
        self.outbox.storage.clone()
    }

    async fn restart(&self, stop: bool) -> bool {
        if stop {
            self.relay().stop().await.expect("stop");
        }
        let config = self.outbox.storage.config().clone();
        *self.relay.lock().expect("the relay's storage") =
            Arc::new(MySqlStorage::new(config).expect("valid configuration"));
        true
    }

    fn replica(&self) -> Option<Arc<dyn Storage>> {
        let config = self.outbox.storage.config().clone();
        Some(Arc::new(
            MySqlStorage::new(config).expect("valid configuration"),
        ))
    }

    async fn begin(&self, messages: &[NewMessage]) -> Box<dyn PendingWrite> {
        let outbox = &self.outbox;
        let mut tx = outbox.pool.begin().await.expect("begin");
        if !self.positions_reserved || messages.is_empty() {
            outbox
                .table
                .enqueue_many(&mut tx, messages)
                .await
                .expect("enqueue");
            return Box::new(Write { tx, reserved: None });
        }
        let mut reserve = outbox.pool.begin().await.expect("begin");
        let values = vec!["('reserved', '')"; messages.len()].join(", ");
        sqlx::query(&format!(
            "INSERT INTO {} (topic, payload) VALUES {values}",
            outbox.table.qualified("")
        ))
        .execute(&mut *reserve)
        .await
        .expect("reserving positions");
        let first: i64 = sqlx::query_scalar("SELECT CAST(LAST_INSERT_ID() AS SIGNED)")
            .fetch_one(&mut *reserve)
            .await
            .expect("the first reserved position");
        reserve
            .rollback()
            .await
            .expect("rollback of the reservation");
        Box::new(Write {
            tx,
            reserved: Some((first, messages.to_vec(), outbox.table.clone())),
        })
    }

    async fn advance(&self, by: Duration) {
        // The database's clock cannot move: move every stored time back instead, at READ
        // COMMITTED, which skips the rows an open transaction has inserted (an UPDATE at
        // REPEATABLE READ that scans the table would wait for them).
        let table = self.outbox.table.qualified("");
        let mut conn = self.outbox.pool.acquire().await.expect("a connection");
        sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut *conn)
            .await
            .expect("READ COMMITTED");
        let sql =
            format!("UPDATE {table} SET available_at = available_at - INTERVAL ? MICROSECOND");
        sqlx::query(&sql)
            .bind(by.as_micros() as i64)
            .execute(&mut *conn)
            .await
            .expect("moving stored times back");
        sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *conn)
            .await
            .expect("back to REPEATABLE READ");
    }
}

#[async_trait]
impl StorageHarness for MySqlHarness {
    fn traits(&self) -> HarnessTraits {
        match self.positions_reserved {
            true => HarnessTraits::default(),
            false => HarnessTraits::default().writes_wait_for_open_transactions(),
        }
    }

    async fn fresh(&self, per_key_order: bool) -> Box<dyn StorageFixture> {
        let outbox = TestOutbox::with_config(|c| c.per_key_order = per_key_order).await;
        let relay = std::sync::Mutex::new(outbox.storage.clone());
        Box::new(Fixture {
            outbox,
            positions_reserved: self.positions_reserved,
            relay,
        })
    }
}

/// Every check with the messages written when the suite begins their transaction
/// (uncommitted rows in the table meanwhile): the randomised model skips (see
/// [`MySqlHarness`]).
mod conformance {
    outbox_testkit::storage_conformance_tests!(super::MySqlHarness {
        positions_reserved: false
    });
}

/// Every check, the randomised model included, with positions reserved at `begin` and rows
/// written at commit (see [`MySqlHarness`]).
mod positions_reserved {
    outbox_testkit::storage_conformance_tests!(super::MySqlHarness {
        positions_reserved: true
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_deliver_20000_messages_over_200_keys_once_in_key_order() {
    let outbox = TestOutbox::with_config(|_| {}).await;
    let enqueue = async |batch: &[NewMessage]| outbox.enqueue(batch).await;
    four_relays_deliver_once_in_key_order(outbox.storage.clone(), enqueue, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_language_enqueues_with_a_plain_insert() {
    let outbox = TestOutbox::with_config(|_| {}).await;
    let table = outbox.table.qualified("");
    sqlx::query(&format!(
        "INSERT INTO {table} (topic, partition_key, payload, headers) VALUES (?, ?, ?, ?)"
    ))
    .bind("orders.paid")
    .bind("order-42")
    .bind(&b"{\"id\":42}"[..])
    .bind(r#"{"content-type": "application/json"}"#)
    .execute(&outbox.pool)
    .await
    .expect("a plain INSERT with the defaults");
    sqlx::query(&format!(
        "INSERT INTO {table} (topic, payload) VALUES ('bare', x'00ff')"
    ))
    .execute(&outbox.pool)
    .await
    .expect("a plain INSERT without key or headers");
    for (what, sql) in [
        (
            "an empty topic",
            format!("INSERT INTO {table} (topic, payload) VALUES ('', 'x')"),
        ),
        (
            "an id that is not a lower-case UUID",
            format!("INSERT INTO {table} (id, topic, payload) VALUES ('NOT-A-UUID', 't', 'x')"),
        ),
        (
            "no payload",
            format!("INSERT INTO {table} (topic) VALUES ('t')"),
        ),
        (
            "headers that are not JSON",
            format!("INSERT INTO {table} (topic, payload, headers) VALUES ('t', 'x', 'nope')"),
        ),
    ] {
        assert!(
            sqlx::query(&sql).execute(&outbox.pool).await.is_err(),
            "{what} must be refused at the INSERT"
        );
    }
    let claim = outbox
        .storage
        .claim("w", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    assert_eq!(claim.messages.len(), 2);
    let first = &claim.messages[0];
    assert_eq!(first.topic, "orders.paid");
    assert_eq!(first.key.as_deref(), Some("order-42"));
    assert_eq!(first.payload, b"{\"id\":42}");
    assert_eq!(
        first.headers.get("content-type").map(String::as_str),
        Some("application/json")
    );
    let age = chrono::Utc::now() - first.created_at;
    assert!(
        age.num_seconds().abs() < 60,
        "created_at defaults to now in UTC: {age}"
    );
    assert_eq!(claim.messages[1].payload, vec![0u8, 255]);
    assert!(claim.messages[1].headers.is_empty());
}

/// Deliveries of `messages`, with made-up receipts.
fn deliveries(messages: &[outbox_core::Message]) -> Vec<outbox_core::Delivery> {
    outbox_tests::deliveries(messages, |m| format!("r-{}", m.id))
}

/// The claim rewrites a row without growing it (a grown row splits its full page, which
/// made claims several times dearer): a row waits with a token-sized placeholder, the claim
/// writes only the token and the lease. Acknowledgements delete by primary key when the
/// storage claimed the rows itself and through the `id` index when another instance did;
/// either way only under the claim's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_rewrite_rows_in_place_and_acks_are_fenced_on_either_path() {
    let outbox = TestOutbox::with_config(|_| {}).await;
    let table = outbox.table.qualified("");
    outbox
        .enqueue(
            &(0..4)
                .map(|i| NewMessage::new("t", format!("m{i}")).key(format!("k{i}")))
                .collect::<Vec<_>>(),
        )
        .await;
    sqlx::query(&format!(
        "INSERT INTO {table} (topic, payload) VALUES ('plain', 'x')"
    ))
    .execute(&outbox.pool)
    .await
    .expect("a plain INSERT");
    let sizes = |what: &'static str| {
        let sql = format!(
            "SELECT CAST(COALESCE(SUM(LENGTH(claim_token) = 36), 0) AS SIGNED),
                    CAST(COALESCE(SUM(claimed_by IS NOT NULL), 0) AS SIGNED) FROM {table}"
        );
        let pool = outbox.pool.clone();
        async move {
            let (tokens, named): (i64, i64) = sqlx::query_as(&sql)
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            (tokens, named)
        }
    };
    assert_eq!(
        sizes("waiting").await,
        (5, 0),
        "waiting rows carry a token-sized placeholder, whoever wrote them"
    );
    let stats = outbox.storage.stats().await.expect("stats");
    assert_eq!(
        (stats.pending, stats.in_flight),
        (5, 0),
        "the placeholder holds nothing"
    );

    // A claim of this storage, acknowledged by another instance (which never saw the seqs).
    let other = MySqlStorage::new(outbox.storage.config().clone()).expect("second storage");
    let first = outbox
        .storage
        .claim("a", 2, Duration::from_secs(30))
        .await
        .expect("claim");
    assert_eq!(first.messages.len(), 2);
    assert_eq!(sizes("claimed").await, (5, 0), "the claim grows no row");
    assert_eq!(
        other
            .ack(&first.token, &deliveries(&first.messages))
            .await
            .expect("ack by id"),
        2
    );

    // A stale token changes nothing on the primary-key path; the live one deletes.
    let stale = outbox
        .storage
        .claim("a", 3, Duration::from_millis(200))
        .await
        .expect("claim");
    assert_eq!(stale.messages.len(), 3);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let live = other
        .claim("b", 3, Duration::from_secs(30))
        .await
        .expect("claim");
    assert_eq!(
        live.messages.len(),
        3,
        "the expired lease gives the rows to the other relay"
    );
    assert_eq!(
        outbox
            .storage
            .ack(&stale.token, &deliveries(&stale.messages))
            .await
            .expect("stale ack"),
        0,
        "an acknowledgement under an expired token deletes nothing"
    );
    assert_eq!(
        other
            .ack(&live.token, &deliveries(&live.messages))
            .await
            .expect("ack by seq"),
        3
    );
    let left: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
        .fetch_one(&outbox.pool)
        .await
        .expect("count");
    assert_eq!(left, 0);
}

/// Relays share the sweep's cursor: a claim starts after the key the last claim of any relay
/// ended on, not where this relay's own last claim did (then each relay swept again over
/// the keys the others had just taken). Without the cursor's table claims still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_share_where_the_next_sweep_starts() {
    let outbox = TestOutbox::with_config(|c| c.max_per_key = 1).await;
    outbox
        .enqueue(
            &(0..12)
                .map(|i| NewMessage::new("t", format!("m{i}")).key(format!("k{}", i % 6)))
                .collect::<Vec<_>>(),
        )
        .await;
    let other = MySqlStorage::new(outbox.storage.config().clone()).expect("second storage");
    let keys = |claim: &outbox_core::Claim| {
        claim
            .messages
            .iter()
            .map(|m| m.key.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    let lease = Duration::from_secs(30);
    let first = outbox.storage.claim("a", 2, lease).await.expect("claim");
    assert_eq!(keys(&first), ["k0", "k1"]);
    outbox
        .storage
        .ack(&first.token, &deliveries(&first.messages))
        .await
        .expect("ack");
    // k0 and k1 are free again (each has a second message): the other relay goes on after
    // k1 all the same.
    let second = other.claim("b", 2, lease).await.expect("claim");
    assert_eq!(
        keys(&second),
        ["k2", "k3"],
        "the other relay starts where the last claim ended"
    );
    sqlx::query(&format!(
        "DROP TABLE {}",
        outbox.table.qualified("_claim_cursor")
    ))
    .execute(&outbox.pool)
    .await
    .expect("drop the cursor's table");
    let third = other
        .claim("b", 2, lease)
        .await
        .expect("claim without the shared cursor");
    assert_eq!(keys(&third), ["k4", "k5"], "its own cursor, after k3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_delivered_rows_with_their_receipt() {
    let outbox = TestOutbox::with_config(|c| c.retention = Some(Duration::from_millis(300))).await;
    outbox
        .enqueue(&[NewMessage::new("t", "kept").key("k")])
        .await;
    let claim = outbox
        .storage
        .claim("w", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    let id = claim.messages[0].id;
    let acked = outbox
        .storage
        .ack(
            &claim.token,
            &[outbox_core::Delivery {
                id,
                receipt: outbox_core::Receipt("r-1".into()),
            }],
        )
        .await
        .expect("ack");
    assert_eq!(acked, 1);
    let delivered = outbox.table.qualified("_delivered");
    let receipt: Option<String> = sqlx::query_scalar(&format!(
        "SELECT CAST(receipt AS CHAR) FROM {delivered} WHERE id = ?"
    ))
    .bind(id.to_string())
    .fetch_optional(&outbox.pool)
    .await
    .expect("delivered row");
    assert_eq!(receipt.as_deref(), Some("r-1"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    outbox.storage.maintain().await.expect("housekeeping");
    let left: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {delivered}"))
        .fetch_one(&outbox.pool)
        .await
        .expect("count");
    assert_eq!(left, 0, "housekeeping removes rows past the retention");
}

/// Builds the storage as the relay does, from a `[storage]` table.
async fn build(storage: serde_json::Value) -> outbox_core::Error {
    let mut registry = StorageRegistry::new();
    outbox_mysql::register(&mut registry);
    match registry.build("mysql", storage.clone()).await {
        Ok(_) => panic!("the storage was built from {storage}"),
        Err(e) => e.in_section("storage"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_clear_error_naming_the_setting() {
    let url = mysql_url();
    // The server must be up for the next two to mean anything.
    MySqlStorage::new(MySqlConfig::new(&url))
        .expect("config")
        .health()
        .await
        .unwrap_or_else(|e| missing(e));
    let wrong_password = url.replacen("mysql://root", "mysql://root:wrong-password", 1);
    let error = build(serde_json::json!({ "url": wrong_password })).await;
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(error.message().starts_with("storage.url `"), "{error}");
    assert!(
        error.message().contains("refused the user or password"),
        "{error}"
    );
    assert!(
        !error.message().contains("wrong-password"),
        "the password leaked: {error}"
    );

    let error = build(serde_json::json!({ "url": url, "database": "no_such_database_here" })).await;
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(
        error.message().starts_with(
            "storage.database names database `no_such_database_here`, which does not exist"
        ),
        "{error}"
    );
    let missing_in_url = format!(
        "{}/no_such_database_here",
        url.rsplit_once('/').map_or(url.as_str(), |(base, _)| base)
    );
    let error = build(serde_json::json!({ "url": missing_in_url })).await;
    assert!(
        error.message().starts_with("storage.url names database"),
        "{error}"
    );

    let error = build(serde_json::json!({ "url": url, "table": "Orders; DROP TABLE x" })).await;
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(
        error
            .message()
            .starts_with("storage.table `Orders; DROP TABLE x` is not allowed"),
        "{error}"
    );

    // Not migrated: a claim says what to do.
    let storage = MySqlStorage::new(MySqlConfig::new(&url).table(unique_name("never_migrated")))
        .expect("config");
    let error = storage
        .claim("w", 10, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Schema, "{error}");
    assert!(error.message().contains("outbox migrate"), "{error}");
}

/// `describe` names the storage and its server. The operator's repairs are the testkit's
/// `admin_the_operators_repairs`, which the conformance modules above run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_names_the_server() {
    let outbox = TestOutbox::with_config(|_| {}).await;
    let described = outbox.storage.describe();
    assert!(described.starts_with("mysql mysql://"), "{described}");
}

/// `TABLE_SUFFIXES` lists every table the migrations make, so `drop_sql` removes an outbox
/// for good (tests, benchmarks and operators rely on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_sql_removes_every_table_the_migrations_make() {
    let name = unique_name("t_all");
    let storage = MySqlStorage::new(MySqlConfig::new(mysql_url()).table(&name)).expect("valid");
    storage.migrate().await.expect("MariaDB must be running");
    let pool = MySqlPool::connect(&mysql_url()).await.expect("MariaDB");
    let made: Vec<String> = sqlx::query_scalar(
        "SELECT table_name FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name LIKE CONCAT(?, '%') ORDER BY table_name",
    )
    .bind(&name)
    .fetch_all(&pool)
    .await
    .expect("list tables");
    let mut listed: Vec<String> = outbox_mysql::TABLE_SUFFIXES
        .iter()
        .map(|suffix| format!("{name}{suffix}"))
        .collect();
    listed.sort();
    assert_eq!(
        made, listed,
        "TABLE_SUFFIXES must name every table migrate makes"
    );
    sqlx::query(&storage.table().drop_sql())
        .execute(&pool)
        .await
        .expect("drop");
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name LIKE CONCAT(?, '%')",
    )
    .bind(&name)
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(left, 0);
}

/// A table at the version before `retrying` was shared: relays count the figures themselves
/// rather than fail; `migrate` adds the column, and adds it again without an error when a
/// crash came between the `ALTER TABLE` (not transactional here) and the version's record.
#[tokio::test]
async fn the_retrying_column_migration_is_optional_for_relays_and_safe_to_rerun() {
    let outbox = TestOutbox::with_config(|_| {}).await;
    outbox.enqueue(&[NewMessage::new("t", b"x".to_vec())]).await;
    let stats = outbox.table.qualified("_stats");
    sqlx::query(&format!("ALTER TABLE {stats} DROP COLUMN retrying"))
        .execute(&outbox.pool)
        .await
        .expect("drop the column");
    for turn in ["its turn to count", "another relay counted"] {
        let figures = outbox
            .storage
            .shared_stats(Duration::from_secs(3600))
            .await
            .expect("figures counted here");
        assert_eq!(
            (figures.pending, figures.measured_at),
            (1, None),
            "{turn}: {figures:?}"
        );
    }
    let versions = outbox.table.qualified("_migrations");
    let latest: i64 = sqlx::query_scalar(&format!(
        "SELECT CAST(MAX(version) AS SIGNED) FROM {versions}"
    ))
    .fetch_one(&outbox.pool)
    .await
    .expect("latest version");
    let forget = |version: i64| {
        let sql = format!("DELETE FROM {versions} WHERE version = {version}");
        let pool = outbox.pool.clone();
        async move {
            sqlx::query(&sql)
                .execute(&pool)
                .await
                .expect("forget the latest version");
        }
    };
    forget(latest).await;
    outbox
        .storage
        .migrate()
        .await
        .expect("migrate adds the column");
    // Forgotten again with the column there: the crash case.
    forget(latest).await;
    outbox
        .storage
        .migrate()
        .await
        .expect("a column already there is a step done");
    // The next relay's turn comes (the hour of the calls above is over).
    sqlx::query(&format!("UPDATE {stats} SET refresh_after = '1970-01-01'"))
        .execute(&outbox.pool)
        .await
        .expect("end the interval");
    let figures = outbox
        .storage
        .shared_stats(Duration::from_secs(3600))
        .await
        .expect("shared figures");
    assert!(figures.measured_at.is_some(), "shared again: {figures:?}");
}

/// docs/storage/mysql.md "How locks and gap locks behave under the claim": "a claim never
/// waits for an open application transaction"; acknowledgements look rows up by primary key
/// or the forced `id` index ("a DELETE that scans waits for rows an open transaction
/// inserted"); "rows of open transactions are invisible to the relay and hold nothing back".
/// Every claim and settlement below runs while an application transaction that inserted rows
/// of the same keys (and a keyless one) is open, and must finish at once, not after
/// `lock_wait_timeout`.
mod mysql_open_transaction {
    use super::*;
    use outbox_core::{DeadLetter, Delivery, Receipt, Retry};
    use outbox_mysql::{MySqlConfig, MySqlStorage};

    /// Far below `lock_wait_timeout` (10 s): a statement that waited for the open
    /// transaction would take that long and then fail.
    const QUICK: Duration = Duration::from_secs(3);
    const LEASE: Duration = Duration::from_secs(60);

    async fn quick<T>(
        what: &str,
        f: impl std::future::Future<Output = outbox_core::Result<T>>,
    ) -> T {
        match tokio::time::timeout(QUICK, f).await {
            Err(_) => panic!("{what} waited {QUICK:?} for the open application transaction"),
            Ok(Err(e)) => panic!("{what} failed while an application transaction is open: {e}"),
            Ok(Ok(v)) => v,
        }
    }

    fn keyed(key: &str, payload: &str) -> NewMessage {
        NewMessage::new("t", payload.to_string()).key(key)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_and_settlements_never_wait_for_an_open_application_transaction() {
        let t = TestOutbox::with_config(|_| {}).await;
        let s = &t.storage;
        // Another relay instance on the same tables: its acks go through the `id` index.
        let other =
            MySqlStorage::new(MySqlConfig::new(mysql_url()).table(s.table().table().to_string()))
                .expect("config");
        s.enqueue(&[
            keyed("a", "a1"),
            keyed("b", "b1"),
            keyed("c", "c1"),
            keyed("d", "d1"),
            keyed("e", "e1"),
            NewMessage::new("t", "free1"),
        ])
        .await
        .expect("enqueue");

        let pool = outbox_mysql::sqlx::MySqlPool::connect(&mysql_url())
            .await
            .expect("connect");
        let mut app = pool.begin().await.expect("begin");
        s.table()
            .enqueue_many(
                &mut app,
                &[
                    keyed("a", "a2"),
                    keyed("b", "b2"),
                    keyed("z", "z1"),
                    NewMessage::new("t", "free2"),
                ],
            )
            .await
            .expect("the application's insert");

        let c = quick("a claim", s.claim("w", 100, LEASE)).await;
        let mut got = payloads(&c.messages);
        got.sort();
        assert_eq!(
            got,
            ["a1", "b1", "c1", "d1", "e1", "free1"],
            "the claim takes the committed rows, nothing of the open transaction"
        );
        let by = |p: &str| {
            c.messages
                .iter()
                .find(|m| m.payload == p.as_bytes())
                .expect("claimed")
                .id
        };
        let delivery = |id| Delivery {
            id,
            receipt: Receipt::new("r"),
        };
        let renewed = quick(
            "a lease renewal",
            s.extend_lease(&c.token, &[by("e1")], LEASE),
        )
        .await;
        assert_eq!(renewed, 1);
        let acked = quick(
            "an acknowledgement by another instance (by id)",
            other.ack(&c.token, &[delivery(by("a1"))]),
        )
        .await;
        assert_eq!(acked, 1);
        let retried = quick(
            "a retry",
            s.retry(
                &c.token,
                &[Retry {
                    id: by("b1"),
                    delay: Duration::from_secs(3600),
                    error: "later".into(),
                }],
            ),
        )
        .await;
        assert_eq!(retried, 1);
        let dead = quick(
            "a dead letter",
            s.dead_letter(
                &c.token,
                &[DeadLetter {
                    id: by("c1"),
                    error: "poison".into(),
                }],
            ),
        )
        .await;
        assert_eq!(dead, 1);
        let released = quick("a release", s.release(&c.token, &[by("d1")])).await;
        assert_eq!(released, 1);
        let acked = quick(
            "an acknowledgement by the claiming instance (by seq)",
            s.ack(&c.token, &[delivery(by("e1")), delivery(by("free1"))]),
        )
        .await;
        assert_eq!(acked, 2);
        let c = quick("a second claim", s.claim("w", 100, LEASE)).await;
        assert_eq!(
            payloads(&c.messages),
            ["d1"],
            "d1 released, b waits, c parked"
        );
        quick("a release", s.release(&c.token, &[c.messages[0].id])).await;

        app.commit().await.expect("the application commits");
        let c = quick("a claim after the commit", s.claim("w", 100, LEASE)).await;
        let mut got = payloads(&c.messages);
        got.sort();
        assert_eq!(
            got,
            ["a2", "d1", "free2", "z1"],
            "the committed rows flow; b2 waits behind b1's retry"
        );
    }
}

/// docs/storage/mysql.md: migrations are recorded in `<table>_migrations` "and never runs one
/// twice"; migrators take turns (`GET_LOCK`). Four relays migrating one new table at once must
/// all succeed (a second run of a step would fail: `CREATE TABLE` of an existing table, or the
/// version's primary key), each version recorded once, and the tables work.
mod mysql_migrations {
    use super::*;
    use outbox_mysql::{MySqlConfig, MySqlStorage};

    /// Drops the tables, whatever happens.
    struct Dropped(outbox_mysql::OutboxTable);

    impl Drop for Dropped {
        fn drop(&mut self) {
            outbox_tests::drop_mysql_tables(&self.0);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_migrators_at_once_run_each_migration_once() {
        let config = MySqlConfig::new(mysql_url()).table(unique_name("t"));
        let migrators: Vec<MySqlStorage> = (0..4)
            .map(|_| MySqlStorage::new(config.clone()).expect("config"))
            .collect();
        // Dropped at the end whatever happens.
        let storage = MySqlStorage::new(config).expect("config");
        let _dropped = Dropped(storage.table().clone());
        let results = futures_util::future::join_all(migrators.iter().map(|m| m.migrate())).await;
        for (i, result) in results.iter().enumerate() {
            if let Err(e) = result {
                panic!("migrator {i} of 4 failed: {e}");
            }
        }
        let pool = outbox_mysql::sqlx::MySqlPool::connect(&mysql_url())
            .await
            .expect("connect");
        let (count, max): (i64, i64) = outbox_mysql::sqlx::query_as(&format!(
            "SELECT CAST(COUNT(*) AS SIGNED), CAST(MAX(version) AS SIGNED) FROM {}",
            storage.table().qualified("_migrations")
        ))
        .fetch_one(&pool)
        .await
        .expect("the migrations table");
        assert!(max >= 1);
        assert_eq!(count, max, "each version recorded once, none skipped");
        storage.migrate().await.expect("migrating again is a no-op");
        storage
            .enqueue(&[NewMessage::new("t", "x")])
            .await
            .expect("the migrated tables take messages");
    }
}

/// docs/storage/mysql.md: "Keys up to 255 bytes, topics up to 255 characters ... an enqueue of
/// a larger one fails as `Permanent`"; at the limits both are kept whole. A refused enqueue
/// writes nothing, and the next good one goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_topics_over_their_limits_are_refused_as_permanent() {
    use outbox_tests::{assert_a_good_enqueue_goes_through, assert_refused_as_permanent};
    let outbox = TestOutbox::with_config(|_| {}).await;
    let s = &*outbox.storage;
    let long_key = NewMessage::new("t", "x").key("k".repeat(256));
    assert_refused_as_permanent(s, "a 256-byte key", long_key).await;
    let long_topic = NewMessage::new("é".repeat(256), "x");
    assert_refused_as_permanent(s, "a 256-character topic", long_topic).await;
    s.enqueue(&[NewMessage::new("é".repeat(255), "x").key("k".repeat(255))])
        .await
        .expect("a 255-byte key and a 255-character topic");
    let c = s
        .claim("bad", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    assert_eq!(c.messages[0].key.as_deref(), Some("k".repeat(255).as_str()));
    assert_eq!(c.messages[0].topic, "é".repeat(255));
    let delivered = [outbox_core::Delivery {
        id: c.messages[0].id,
        receipt: outbox_core::Receipt::new("r"),
    }];
    s.ack(&c.token, &delivered).await.expect("ack");
    assert_a_good_enqueue_goes_through(s).await;
}
