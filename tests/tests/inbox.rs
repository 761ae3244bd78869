//! The inbox of each storage against the real database: PostgreSQL and MariaDB on their
//! standard ports (`OUTBOX_TEST_POSTGRES_URL`, `OUTBOX_TEST_MYSQL_URL` override them), SQLite
//! in a temporary directory. The same checks run on all three (the testkit's `inbox_*` checks,
//! through an `InboxHarness` each): a new id is processed once, a failed handler leaves no record, the business
//! change and the record commit together, consumers are independent, two transactions
//! racing on one id process it once, purge works in batches, migrations are repeatable and
//! concurrent, and bad names and misuse are refused. PostgreSQL also runs a randomised model
//! of deliveries, one after the other and concurrent. Every test has tables of its own, so
//! they run in parallel; a server that is not running fails the tests with its address.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::Result;
use outbox_testkit::{InboxFixture, InboxHarness, InboxTransaction};
use outbox_tests::{Service, postgres_url, unique_name};
use uuid::Uuid;

/// How long a racing transaction is watched to be sure it waits for the first one.
const RACE_WAIT: Duration = Duration::from_millis(300);

/// What the three SQL inbox fixtures share, so each storage writes only its own SQL: the
/// consumer's transaction (`Tx`), the harness and the `InboxFixture` methods that only call the
/// inbox or run one statement. `$fixture` has `pool`, `inbox`, `new()`, `effects_table()`,
/// `inbox_table()`, `migrations_table(table)` and `inbox_named(table)`. In the statements
/// `{}` is the table: `insert` records a business change, `count` counts the rows of
/// (consumer, id) and `backdate` moves a record's time back by its first parameter (the age
/// as `bind_age` makes it); the id is bound as `bind_id` makes it. The fixture's other
/// methods follow in braces.
macro_rules! sql_inbox_fixture {
    (
        $fixture:ident,
        $db:ty,
        insert: $insert:literal,
        count: $count:literal,
        backdate: $backdate:literal,
        bind_id: $bind_id:expr,
        bind_age: $bind_age:expr,
        { $($own:tt)* }
    ) => {
        /// A consumer's transaction on the fixture's inbox and business table.
        pub struct Tx {
            tx: Transaction<'static, $db>,
            inbox: Inbox,
            effects: String,
        }

        #[async_trait]
        impl InboxTransaction for Tx {
            async fn process(&mut self, consumer: &str, id: Uuid) -> Result<bool> {
                self.inbox.process(&mut self.tx, consumer, id).await
            }

            async fn record_effect(&mut self, consumer: &str, id: Uuid) {
                sqlx::query(&format!($insert, self.effects))
                    .bind(consumer)
                    .bind(($bind_id)(id))
                    .execute(&mut *self.tx)
                    .await
                    .expect("business change");
            }

            async fn commit(self: Box<Self>) {
                self.tx.commit().await.expect("commit")
            }

            async fn rollback(self: Box<Self>) {
                self.tx.rollback().await.expect("rollback")
            }
        }

        /// Each check's inbox.
        pub struct Harness;

        #[async_trait]
        impl InboxHarness for Harness {
            async fn fresh(&self) -> Box<dyn InboxFixture> {
                Box::new($fixture::new().await)
            }
        }

        #[async_trait]
        impl InboxFixture for $fixture {
            async fn begin(&self) -> Box<dyn InboxTransaction> {
                Box::new(Tx {
                    tx: self.pool.begin().await.expect("begin"),
                    inbox: self.inbox.clone(),
                    effects: self.effects_table(),
                })
            }

            async fn process_outside_transaction(&self, consumer: &str, id: Uuid) -> Result<bool> {
                let mut conn = self.pool.acquire().await.expect("connection");
                self.inbox.process(&mut conn, consumer, id).await
            }

            async fn purge(&self, older_than: Duration, limit: u32) -> Result<u64> {
                let mut conn = self.pool.acquire().await.expect("connection");
                self.inbox.purge(&mut conn, older_than, limit).await
            }

            async fn process_in(&self, table: &str, consumer: &str, id: Uuid) -> Result<bool> {
                let inbox = self.inbox_named(table)?;
                let mut tx = self.pool.begin().await.expect("begin");
                let new = inbox.process(&mut tx, consumer, id).await?;
                tx.commit().await.expect("commit");
                Ok(new)
            }

            fn new_inbox(&self, table: &str) -> Result<()> {
                self.inbox_named(table).map(drop)
            }

            async fn effects(&self, consumer: &str, id: Uuid) -> i64 {
                self.count(&self.effects_table(), consumer, id).await
            }

            async fn recorded(&self, consumer: &str, id: Uuid) -> bool {
                self.count(&self.inbox_table(), consumer, id).await > 0
            }

            async fn backdate(&self, consumer: &str, id: Uuid, by: Duration) {
                sqlx::query(&format!($backdate, self.inbox_table()))
                    .bind(($bind_age)(by))
                    .bind(consumer)
                    .bind(($bind_id)(id))
                    .execute(&self.pool)
                    .await
                    .expect("backdate");
            }

            async fn versions(&self, table: &str) -> i64 {
                let sql = format!("SELECT COUNT(*) FROM {}", self.migrations_table(table));
                sqlx::query_scalar(&sql)
                    .fetch_one(&self.pool)
                    .await
                    .expect("read versions")
            }

            $($own)*
        }

        impl $fixture {
            /// The rows of (consumer, id) in `table`.
            async fn count(&self, table: &str, consumer: &str, id: Uuid) -> i64 {
                sqlx::query_scalar(&format!($count, table))
                    .bind(consumer)
                    .bind(($bind_id)(id))
                    .fetch_one(&self.pool)
                    .await
                    .unwrap_or_else(|e| panic!("count in {table}: {e}"))
            }
        }

        outbox_testkit::inbox_conformance_tests!(Harness);
    };
}

mod postgres {
    use outbox_postgres::Inbox;
    use outbox_postgres::sqlx::postgres::PgPool;
    use outbox_postgres::sqlx::{self, Connection, PgConnection, Postgres, Transaction};

    use super::*;

    /// An inbox and a business table in a schema of their own, dropped with the value.
    pub struct Pg {
        pub inbox: Inbox,
        pub pool: PgPool,
        pub schema: String,
    }

    impl Drop for Pg {
        fn drop(&mut self) {
            outbox_tests::drop_schemas(std::slice::from_ref(&self.schema));
        }
    }

    fn missing(error: impl std::fmt::Display) -> ! {
        Service::Postgres.missing(error)
    }

    impl Pg {
        fn effects_table(&self) -> String {
            format!(r#""{}".effects"#, self.schema)
        }

        fn inbox_table(&self) -> String {
            format!(r#""{}"."{}""#, self.schema, self.inbox.table())
        }

        fn migrations_table(&self, table: &str) -> String {
            format!(r#""{}"."{table}_migrations""#, self.schema)
        }

        fn inbox_named(&self, table: &str) -> Result<Inbox> {
            Inbox::new(&self.schema, table)
        }
    }

    impl Pg {
        pub async fn new() -> Pg {
            let pool = outbox_tests::pool(Service::Postgres, &postgres_url(), 8).await;
            let schema = unique_name("inbox");
            let inbox = Inbox::new(&schema, "inbox").expect("valid names");
            let mut conn = pool.acquire().await.unwrap_or_else(|e| missing(e));
            inbox.migrate(&mut conn).await.expect("migrate");
            let pg = Pg {
                inbox,
                pool,
                schema,
            };
            sqlx::query(&format!(
                "CREATE TABLE {} (consumer text NOT NULL, message_id uuid NOT NULL)",
                pg.effects_table()
            ))
            .execute(&mut *conn)
            .await
            .expect("business table");
            pg
        }
    }

    sql_inbox_fixture!(
        Pg,
        Postgres,
        insert: "INSERT INTO {} (consumer, message_id) VALUES ($1, $2)",
        count: "SELECT count(*) FROM {} WHERE consumer = $1 AND message_id = $2",
        backdate: "UPDATE {} SET processed_at = processed_at - $1 * interval '1 second' \
                   WHERE consumer = $2 AND message_id = $3",
        bind_id: |id: Uuid| id,
        bind_age: |by: Duration| by.as_secs_f64(),
        {
            async fn migrate(&self, table: &str) -> Result<()> {
                let inbox = self.inbox_named(table)?;
                let mut conn = PgConnection::connect(&postgres_url())
                    .await
                    .unwrap_or_else(|e| missing(e));
                inbox.migrate(&mut conn).await
            }

            fn business_table(&self) -> String {
                "effects".into()
            }
        }
    );

    #[tokio::test]
    async fn a_bad_schema_name_is_refused() {
        let err = Inbox::new("Bad-Schema", "inbox").expect_err("a bad schema name");
        assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
        assert!(
            err.to_string()
                .contains("schema `Bad-Schema` is not allowed"),
            "{err}"
        );
    }

    /// Inbox and outbox migrators creating the same new schema at once take turns on the
    /// same lock: none fails on the schema the other created.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inbox_and_outbox_migrators_share_a_new_schema() {
        let schema = unique_name("inbox");
        let _cleanup = DropSchema(schema.clone());
        let connect = || async {
            PgConnection::connect(&postgres_url())
                .await
                .unwrap_or_else(|e| missing(e))
        };
        let inboxes = (0..3).map(|i| {
            let schema = schema.clone();
            async move {
                let inbox = Inbox::new(&schema, &format!("inbox_{i}")).expect("names");
                inbox.migrate(&mut connect().await).await
            }
        });
        let outboxes = (0..2).map(|i| {
            let schema = schema.clone();
            async move {
                let table = outbox_postgres::OutboxTable::new(&schema, &format!("outbox_{i}"))
                    .expect("names");
                table.migrate(&mut connect().await).await
            }
        });
        let (inboxes, outboxes) = tokio::join!(
            futures_util::future::join_all(inboxes),
            futures_util::future::join_all(outboxes)
        );
        for result in inboxes.into_iter().chain(outboxes) {
            result.expect("a migrator of the new schema");
        }
    }

    /// Drops a schema when the test ends.
    struct DropSchema(String);

    impl Drop for DropSchema {
        fn drop(&mut self) {
            outbox_tests::drop_schemas(std::slice::from_ref(&self.0));
        }
    }

    /// At REPEATABLE READ, a duplicate committed after the snapshot cannot be skipped
    /// silently: PostgreSQL raises a serialization failure, a retryable error.
    #[tokio::test]
    async fn a_race_at_repeatable_read_is_a_serialization_failure() {
        let s = Pg::new().await;
        let id = Uuid::now_v7();
        let mut late = s.pool.begin().await.expect("begin");
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *late)
            .await
            .expect("isolation");
        sqlx::query("SELECT 1")
            .execute(&mut *late)
            .await
            .expect("take the snapshot");
        let mut first = s.pool.begin().await.expect("begin");
        assert!(
            s.inbox
                .process(&mut first, "billing", id)
                .await
                .expect("first")
        );
        first.commit().await.expect("commit");
        let err = s
            .inbox
            .process(&mut late, "billing", id)
            .await
            .expect_err("a serialization failure");
        assert_eq!(err.kind(), outbox_core::ErrorKind::Temporary, "{err}");
        assert!(err.is_retryable());
        late.rollback().await.expect("rollback");
        // Redelivered, it is a duplicate.
        let mut again = s.pool.begin().await.expect("begin");
        assert!(
            !s.inbox
                .process(&mut again, "billing", id)
                .await
                .expect("again")
        );
        again.rollback().await.expect("rollback");
    }

    /// A randomised model: deliveries of a few ids to a few consumers, with duplicates and
    /// failing handlers (rollbacks), first one after the other, where `process` must say
    /// exactly what a set of committed (consumer, id) predicts, then from four concurrent
    /// workers. Either way the handler's committed runs are exactly one per (consumer, id)
    /// that some delivery committed, and the inbox holds exactly those. The seed is printed
    /// on failure; `OUTBOX_TEST_SEED` replays one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn randomised_deliveries_run_each_handler_once() {
        let seed = std::env::var("OUTBOX_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fastrand::u64(..));
        let mut rng = fastrand::Rng::with_seed(seed);
        let s = Arc::new(Pg::new().await);
        let consumers = ["billing", "shipping", "audit"];

        // One after the other: every answer is predicted.
        let ids: Vec<Uuid> = (0..8).map(|_| Uuid::now_v7()).collect();
        let mut committed: HashSet<(String, Uuid)> = HashSet::new();
        for step in 0..300 {
            let key = (
                consumers[rng.usize(..consumers.len())].to_string(),
                ids[rng.usize(..ids.len())],
            );
            let fails = rng.u8(..100) < 30;
            let new = deliver(&s, &key, fails).await;
            assert_eq!(
                new,
                !committed.contains(&key),
                "step {step} (seed {seed}): process said {new} for {key:?}"
            );
            if !fails {
                committed.insert(key);
            }
        }
        check_model(&s, &consumers, &ids, &committed, seed).await;

        // Four workers at once over shared deliveries of fresh ids, many duplicates.
        let ids: Vec<Uuid> = (0..6).map(|_| Uuid::now_v7()).collect();
        let deliveries: Vec<((String, Uuid), bool)> = (0..240)
            .map(|_| {
                let key = (
                    consumers[rng.usize(..consumers.len())].to_string(),
                    ids[rng.usize(..ids.len())],
                );
                (key, rng.u8(..100) < 30)
            })
            .collect();
        let queue = Arc::new(std::sync::Mutex::new(deliveries));
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let (s, queue) = (s.clone(), queue.clone());
                tokio::spawn(async move {
                    // (key, whether this delivery ran the handler and committed)
                    let mut outcomes: Vec<((String, Uuid), bool, bool)> = Vec::new();
                    loop {
                        let Some((key, fails)) = queue.lock().expect("queue").pop() else {
                            return outcomes;
                        };
                        let new = deliver(&s, &key, fails).await;
                        outcomes.push((key, new, !fails));
                    }
                })
            })
            .collect();
        let mut committed = HashSet::new();
        let mut runs: HashMap<(String, Uuid), u32> = HashMap::new();
        for worker in workers {
            for (key, new, commits) in worker.await.expect("worker") {
                if commits {
                    if new {
                        *runs.entry(key.clone()).or_default() += 1;
                    }
                    committed.insert(key);
                }
            }
        }
        for key in &committed {
            assert_eq!(
                runs.get(key),
                Some(&1),
                "(seed {seed}) committed handler runs of {key:?}"
            );
        }
        check_model(&s, &consumers, &ids, &committed, seed).await;
    }

    /// One delivery of `key` = (consumer, id): the handler runs if `process` says the id is
    /// new, and the transaction rolls back if the handler `fails`, else commits. What
    /// `process` said.
    async fn deliver(s: &Pg, key: &(String, Uuid), fails: bool) -> bool {
        let mut tx = s.begin().await;
        let new = tx.process(&key.0, key.1).await.expect("process");
        if new {
            tx.record_effect(&key.0, key.1).await;
        }
        if fails {
            tx.rollback().await;
        } else {
            tx.commit().await;
        }
        new
    }

    /// The database agrees with the model: one committed handler run and one record per
    /// committed (consumer, id), none for the others.
    async fn check_model(
        s: &Pg,
        consumers: &[&str],
        ids: &[Uuid],
        committed: &HashSet<(String, Uuid)>,
        seed: u64,
    ) {
        for consumer in consumers {
            for id in ids {
                let key = (consumer.to_string(), *id);
                let expected = committed.contains(&key);
                assert_eq!(
                    s.effects(consumer, *id).await,
                    i64::from(expected),
                    "(seed {seed}) handler runs of {key:?}"
                );
                assert_eq!(
                    s.recorded(consumer, *id).await,
                    expected,
                    "(seed {seed}) inbox record of {key:?}"
                );
            }
        }
    }
}

mod sqlite {
    use outbox_sqlite::Inbox;
    use outbox_sqlite::sqlx::sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    };
    use outbox_sqlite::sqlx::{self, Connection, Sqlite, SqliteConnection, Transaction};
    use outbox_tests::TempDir;

    use super::*;

    /// An inbox and a business table in a database file in a directory of its own, removed
    /// with the value.
    pub struct Lite {
        inbox: Inbox,
        pool: SqlitePool,
        /// Last, so the file goes after the pool.
        dir: TempDir,
    }

    impl Lite {
        fn options(&self) -> SqliteConnectOptions {
            options(self.dir.path())
        }

        fn effects_table(&self) -> String {
            "effects".into()
        }

        fn inbox_table(&self) -> String {
            self.inbox.table().to_string()
        }

        fn migrations_table(&self, table: &str) -> String {
            format!(r#""{table}_migrations""#)
        }

        fn inbox_named(&self, table: &str) -> Result<Inbox> {
            Inbox::new(table)
        }
    }

    /// WAL, as the outbox's storage uses, and a busy timeout longer than any race here.
    fn options(dir: &std::path::Path) -> SqliteConnectOptions {
        SqliteConnectOptions::new()
            .filename(dir.join("app.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10))
    }

    impl Lite {
        pub async fn new() -> Lite {
            let dir = TempDir::new("outbox-inbox");
            let pool = SqlitePoolOptions::new()
                .max_connections(4)
                .connect_with(options(dir.path()))
                .await
                .expect("open the SQLite database");
            let inbox = Inbox::new("inbox").expect("valid name");
            let mut conn = pool.acquire().await.expect("connection");
            inbox.migrate(&mut conn).await.expect("migrate");
            sqlx::query("CREATE TABLE effects (consumer TEXT NOT NULL, message_id TEXT NOT NULL)")
                .execute(&mut *conn)
                .await
                .expect("business table");
            Lite { inbox, pool, dir }
        }
    }

    sql_inbox_fixture!(
        Lite,
        Sqlite,
        insert: "INSERT INTO {} (consumer, message_id) VALUES (?, ?)",
        count: "SELECT count(*) FROM {} WHERE consumer = ? AND message_id = ?",
        backdate: "UPDATE {} SET processed_at = processed_at - ? WHERE consumer = ? AND message_id = ?",
        bind_id: |id: Uuid| id.to_string(),
        bind_age: |by: Duration| by.as_millis() as i64,
        {

            async fn migrate(&self, table: &str) -> Result<()> {
                let inbox = self.inbox_named(table)?;
                let mut conn = SqliteConnection::connect_with(&self.options())
                    .await
                    .expect("open the SQLite database");
                inbox.migrate(&mut conn).await
            }

            fn business_table(&self) -> String {
                "effects".into()
            }
        }
    );

    /// A consumer transaction begun with `BEGIN IMMEDIATE` takes the write lock at once, so
    /// it may read before it records the message: the advice of `Inbox::process`.
    #[tokio::test]
    async fn begin_immediate_transactions_race_safely() {
        let s = Lite::new().await;
        let id = Uuid::now_v7();
        let mut first = s.pool.acquire().await.expect("connection");
        let mut second = s.pool.acquire().await.expect("connection");
        let mut tx1 = first.begin_with("BEGIN IMMEDIATE").await.expect("begin");
        sqlx::query("SELECT count(*) FROM effects")
            .execute(&mut *tx1)
            .await
            .expect("read first");
        assert!(
            s.inbox
                .process(&mut tx1, "billing", id)
                .await
                .expect("first")
        );
        let done = AtomicBool::new(false);
        let second_run = async {
            let mut tx2 = second.begin_with("BEGIN IMMEDIATE").await.expect("begin");
            done.store(true, Ordering::SeqCst);
            sqlx::query("SELECT count(*) FROM effects")
                .execute(&mut *tx2)
                .await
                .expect("read second");
            let new = s
                .inbox
                .process(&mut tx2, "billing", id)
                .await
                .expect("second");
            tx2.commit().await.expect("commit");
            new
        };
        let first_end = async {
            tokio::time::sleep(RACE_WAIT).await;
            assert!(!done.load(Ordering::SeqCst), "BEGIN IMMEDIATE must wait");
            tx1.commit().await.expect("commit");
        };
        let (second_new, ()) = tokio::join!(second_run, first_end);
        assert!(!second_new, "the second sees the first's record");
    }
}

mod mysql {
    use outbox_mysql::Inbox;
    use outbox_mysql::sqlx::mysql::MySqlPool;
    use outbox_mysql::sqlx::{self, Connection, MySql, MySqlConnection, Transaction};

    use super::*;

    use outbox_tests::mysql_url;

    fn missing(error: impl std::fmt::Display) -> ! {
        Service::MySql.missing(error)
    }

    /// The database of the test URL.
    fn database() -> String {
        let url = mysql_url();
        let path = url.rsplit('/').next().unwrap_or_default();
        path.split('?').next().unwrap_or_default().to_string()
    }

    /// An inbox and a business table (`<prefix>_inbox`, `<prefix>_effects`) in the test
    /// database, dropped with the value, with every inbox a test made.
    pub struct My {
        inbox: Inbox,
        pool: MySqlPool,
        prefix: String,
        made: std::sync::Mutex<Vec<String>>,
    }

    impl Drop for My {
        fn drop(&mut self) {
            let mut tables = vec![self.effects_table(), self.inbox_table()];
            tables.extend(self.made.lock().map(|m| m.clone()).unwrap_or_default());
            // A table named twice fails the whole DROP.
            tables.sort();
            tables.dedup();
            let tables: Vec<String> = tables
                .iter()
                .flat_map(|t| [format!("`{t}`"), format!("`{t}_migrations`")])
                .collect();
            outbox_tests::run_on_mysql(vec![format!("DROP TABLE IF EXISTS {}", tables.join(", "))]);
        }
    }

    impl My {
        fn effects_table(&self) -> String {
            format!("{}_effects", self.prefix)
        }

        fn inbox_table(&self) -> String {
            self.inbox.table().to_string()
        }

        fn migrations_table(&self, table: &str) -> String {
            format!("`{table}_migrations`")
        }

        fn inbox_named(&self, table: &str) -> Result<Inbox> {
            Inbox::new(&database(), table)
        }
    }

    impl My {
        pub async fn new() -> My {
            let pool = outbox_tests::pool(Service::MySql, &mysql_url(), 8).await;
            let prefix = unique_name("t");
            let inbox = Inbox::new(&database(), &format!("{prefix}_inbox")).expect("valid names");
            let my = My {
                inbox,
                pool,
                prefix,
                made: Default::default(),
            };
            let mut conn = my.pool.acquire().await.unwrap_or_else(|e| missing(e));
            my.inbox.migrate(&mut conn).await.expect("migrate");
            sqlx::query(&format!(
                "CREATE TABLE `{}` (consumer VARCHAR(255) NOT NULL, message_id CHAR(36) NOT NULL) \
                 ENGINE=InnoDB",
                my.effects_table()
            ))
            .execute(&mut *conn)
            .await
            .expect("business table");
            drop(conn);
            my
        }
    }

    sql_inbox_fixture!(
        My,
        MySql,
        insert: "INSERT INTO `{}` (consumer, message_id) VALUES (?, ?)",
        count: "SELECT COUNT(*) FROM `{}` WHERE consumer = ? AND message_id = ?",
        backdate: "UPDATE `{}` SET processed_at = processed_at - INTERVAL ? SECOND \
                   WHERE consumer = ? AND message_id = ?",
        bind_id: |id: Uuid| id.to_string(),
        bind_age: |by: Duration| by.as_secs() as i64,
        {

            async fn migrate(&self, table: &str) -> Result<()> {
                let inbox = self.inbox_named(table)?;
                if let Ok(mut made) = self.made.lock() {
                    made.push(table.to_string());
                }
                let mut conn = MySqlConnection::connect(&mysql_url())
                    .await
                    .unwrap_or_else(|e| missing(e));
                inbox.migrate(&mut conn).await
            }

            fn business_table(&self) -> String {
                self.effects_table()
            }
        }
    );
}
