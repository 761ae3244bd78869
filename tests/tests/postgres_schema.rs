//! Migrations and names of the PostgreSQL outbox tables against the real server: the
//! wake-up channel of the longest names, concurrent migrators in a fresh schema, and the
//! upgrade that builds an index concurrently.

use std::time::Duration;

use outbox_core::NewMessage;
use outbox_postgres::OutboxTable;
use outbox_tests::{postgres_url, unique_name};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::{Connection, PgConnection};

/// Drops its schemas when the test ends, passed or not.
struct Schemas(Vec<String>);

impl Drop for Schemas {
    fn drop(&mut self) {
        outbox_tests::drop_schemas(&self.0);
    }
}

async fn connect() -> PgConnection {
    let url = postgres_url();
    PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL must be running at {url}: {e}"))
}

/// `prefix` made unique, then padded with `x` to `len` characters.
fn long_name(prefix: &str, len: usize) -> String {
    let name = unique_name(prefix);
    format!("{name}{}", "x".repeat(len - name.len()))
}

async fn set_relay_idle(conn: &mut PgConnection, table: &OutboxTable) {
    sqlx::query(&format!(
        "UPDATE {} SET relay_idle = true",
        table.qualified("_wakeup")
    ))
    .execute(conn)
    .await
    .expect("set the idle flag");
}

async fn enqueue_one(conn: &mut PgConnection, table: &OutboxTable) -> outbox_core::Result<()> {
    let mut tx = conn.begin().await.expect("begin");
    table
        .enqueue(&mut tx, &NewMessage::new("t", b"{}".to_vec()).key("k"))
        .await?;
    tx.commit().await.expect("commit");
    Ok(())
}

/// Enqueues one message into `table` while a relay is idle: the channel of the notification
/// `listener` receives for it (within 10 s).
async fn notified(
    conn: &mut PgConnection,
    table: &OutboxTable,
    listener: &mut PgListener,
) -> String {
    set_relay_idle(conn, table).await;
    enqueue_one(conn, table)
        .await
        .expect("enqueue while a relay is idle");
    let notification = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification within 10 s")
        .expect("receive");
    notification.channel().to_string()
}

async fn version(conn: &mut PgConnection, table: &OutboxTable) -> i32 {
    sqlx::query_scalar(&format!(
        "SELECT max(version) FROM {}",
        table.qualified("_migrations")
    ))
    .fetch_one(conn)
    .await
    .expect("read the migration version")
}

/// Whether the unkeyed index exists and is valid (`None`: it does not exist).
async fn unkeyed_index_valid(conn: &mut PgConnection, table: &OutboxTable) -> Option<bool> {
    sqlx::query_scalar("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)")
        .bind(format!(
            r#""{}"."{}_unkeyed_seq""#,
            table.schema(),
            table.table()
        ))
        .fetch_optional(conn)
        .await
        .expect("read pg_index")
}

/// The latest migration version; the tests expect every migration applied.
const LATEST: i32 = 5;

#[tokio::test]
async fn longest_names_notify_on_a_valid_channel() {
    let (schema, name) = (long_name("s", 40), long_name("outbox", 40));
    let _cleanup = Schemas(vec![schema.clone()]);
    let table = OutboxTable::new(&schema, &name).expect("40-character names are valid");
    let channel = table.channel();
    assert!(channel.len() <= 63, "{channel}");
    let mut conn = connect().await;

    // A table migrated by an older release: its trigger notifies on `schema.table`, 81 bytes.
    table.migrate_to(&mut conn, 2).await.expect("migrate to 2");
    sqlx::raw_sql(&format!(
        "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql AS $fn$
         BEGIN
             IF (SELECT relay_idle FROM {}) THEN PERFORM pg_notify('{schema}.{name}', ''); END IF;
             RETURN NULL;
         END $fn$",
        table.qualified("_notify"),
        table.qualified("_wakeup")
    ))
    .execute(&mut conn)
    .await
    .expect("install the old trigger function");
    set_relay_idle(&mut conn, &table).await;
    let err = enqueue_one(&mut conn, &table)
        .await
        .expect_err("the old channel name is too long");
    assert!(format!("{err:?}").contains("too long"), "{err:?}");

    // Migration 3 fixes it.
    table.migrate(&mut conn).await.expect("migrate");
    assert_eq!(version(&mut conn, &table).await, LATEST);
    let mut listener = PgListener::connect(&postgres_url())
        .await
        .expect("listener");
    listener.listen(&channel).await.expect("LISTEN");
    assert_eq!(notified(&mut conn, &table, &mut listener).await, channel);

    // A table created fresh gets the short channel from migration 1 on.
    let fresh = OutboxTable::new(&schema, &long_name("fresh", 40)).expect("valid names");
    fresh.migrate(&mut conn).await.expect("migrate fresh");
    listener.listen(&fresh.channel()).await.expect("LISTEN");
    assert_eq!(
        notified(&mut conn, &fresh, &mut listener).await,
        fresh.channel()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tables_migrated_at_once_into_a_new_schema() {
    for round in 0..4 {
        let schema = unique_name("race");
        let _cleanup = Schemas(vec![schema.clone()]);
        let mut conns = Vec::new();
        for _ in 0..8 {
            conns.push(connect().await);
        }
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(conns.len()));
        let tasks: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(i, mut conn)| {
                let table = OutboxTable::new(&schema, &format!("outbox_{i}")).expect("names");
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    table.migrate(&mut conn).await
                })
            })
            .collect();
        for (i, task) in tasks.into_iter().enumerate() {
            task.await
                .expect("migration task")
                .unwrap_or_else(|e| panic!("round {round}, table {i}: {e:?}"));
        }
        let mut conn = connect().await;
        for i in 0..8 {
            let table = OutboxTable::new(&schema, &format!("outbox_{i}")).expect("names");
            assert_eq!(version(&mut conn, &table).await, LATEST);
        }
    }
}

/// A table at migration 1, as an older release left it, with `rows` messages.
async fn table_at_version_1(rows: i64) -> (OutboxTable, Schemas) {
    let schema = unique_name("up");
    let cleanup = Schemas(vec![schema.clone()]);
    let table = OutboxTable::new(&schema, "outbox").expect("names");
    let mut conn = connect().await;
    table.migrate_to(&mut conn, 1).await.expect("migrate to 1");
    assert_eq!(unkeyed_index_valid(&mut conn, &table).await, None);
    sqlx::query(&format!(
        "INSERT INTO {} (topic, partition_key, payload)
         SELECT 't', CASE WHEN n % 2 = 0 THEN 'k' || (n % 100) END, '\\x00'
         FROM generate_series(1, $1) AS n",
        table.qualified("")
    ))
    .bind(rows)
    .execute(&mut conn)
    .await
    .expect("fill the table");
    (table, cleanup)
}

async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .expect("backend pid")
}

/// Waits until backend `pid` is blocked in `CREATE INDEX CONCURRENTLY`.
async fn wait_for_blocked_index_build(conn: &mut PgConnection, pid: i32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'
                 AND query ILIKE 'CREATE INDEX CONCURRENTLY%')",
        )
        .bind(pid)
        .fetch_one(&mut *conn)
        .await
        .expect("read pg_stat_activity");
        if waiting {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the migration never reached CREATE INDEX CONCURRENTLY"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An application transaction that has inserted into the outbox and stays open, so an
/// index build on the table must wait for it.
async fn open_writer(table: &OutboxTable) -> PgConnection {
    let mut conn = connect().await;
    sqlx::raw_sql("BEGIN")
        .execute(&mut conn)
        .await
        .expect("begin");
    table
        .enqueue(&mut conn, &NewMessage::new("t", b"{}".to_vec()))
        .await
        .expect("enqueue in the open transaction");
    conn
}

/// What the index-build tests start from: a table at version 1 with `rows` rows
/// ([`table_at_version_1`]), a writer's transaction open on it ([`open_writer`]), and a
/// migration on a connection of its own whose index build waits for that writer.
struct BlockedUpgrade {
    table: OutboxTable,
    _cleanup: Schemas,
    /// A connection of the test's, for looking.
    observer: PgConnection,
    /// The open writer.
    open: PgConnection,
    /// The migrating backend's pid.
    pid: i32,
    /// The migration, which gives back the result and the connection (still open, as in a
    /// pool).
    migration: tokio::task::JoinHandle<(outbox_core::Result<()>, PgConnection)>,
}

async fn upgrade_blocked_by_a_writer(rows: i64) -> BlockedUpgrade {
    let (table, cleanup) = table_at_version_1(rows).await;
    let mut observer = connect().await;
    let open = open_writer(&table).await;
    let mut migrator = connect().await;
    let pid = backend_pid(&mut migrator).await;
    let migration = tokio::spawn({
        let table = table.clone();
        async move {
            let result = table.migrate(&mut migrator).await;
            (result, migrator)
        }
    });
    wait_for_blocked_index_build(&mut observer, pid).await;
    BlockedUpgrade {
        table,
        _cleanup: cleanup,
        observer,
        open,
        pid,
        migration,
    }
}

#[tokio::test]
async fn upgrade_builds_the_index_without_blocking_writers() {
    // The build waits for the open writer. A plain CREATE INDEX would hold (or queue for) a
    // SHARE lock that blocks every new INSERT until it finishes.
    let mut up = upgrade_blocked_by_a_writer(20_000).await;
    let blocking: Vec<String> = sqlx::query_scalar(
        "SELECT mode FROM pg_locks WHERE pid = $1 AND relation = to_regclass($2)
             AND mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')",
    )
    .bind(up.pid)
    .bind(up.table.qualified(""))
    .fetch_all(&mut up.observer)
    .await
    .expect("read pg_locks");
    assert!(blocking.is_empty(), "the migration holds {blocking:?}");

    // Another writer gets through meanwhile.
    let mut writer = connect().await;
    sqlx::query("SET lock_timeout = '3s'")
        .execute(&mut writer)
        .await
        .expect("set lock_timeout");
    enqueue_one(&mut writer, &up.table)
        .await
        .expect("an insert during the index build is not blocked");

    sqlx::raw_sql("COMMIT")
        .execute(&mut up.open)
        .await
        .expect("commit");
    tokio::time::timeout(Duration::from_secs(60), up.migration)
        .await
        .expect("the migration finishes")
        .expect("migration task")
        .0
        .expect("migrate");
    assert_eq!(
        unkeyed_index_valid(&mut up.observer, &up.table).await,
        Some(true)
    );
    assert_eq!(version(&mut up.observer, &up.table).await, LATEST);
    let definition: String = sqlx::query_scalar("SELECT pg_get_indexdef(to_regclass($1))")
        .bind(format!(r#""{}".outbox_unkeyed_seq"#, up.table.schema()))
        .fetch_one(&mut up.observer)
        .await
        .expect("index definition");
    assert!(
        definition.ends_with("USING btree (seq) WHERE (partition_key IS NULL)"),
        "{definition}"
    );
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", up.table.qualified("")))
        .fetch_one(&mut up.observer)
        .await
        .expect("count");
    assert_eq!(rows, 20_002);
}

#[tokio::test]
async fn interrupted_index_build_is_repaired() {
    // Interrupt the build while it waits for the open writer.
    let mut up = upgrade_blocked_by_a_writer(1_000).await;
    sqlx::query("SELECT pg_cancel_backend($1)")
        .bind(up.pid)
        .execute(&mut up.observer)
        .await
        .expect("cancel the build");
    let (result, _still_open) = tokio::time::timeout(Duration::from_secs(20), up.migration)
        .await
        .expect("the cancelled migration returns")
        .expect("migration task");
    assert!(result.is_err(), "the cancelled build must fail");
    assert_eq!(
        unkeyed_index_valid(&mut up.observer, &up.table).await,
        Some(false)
    );
    assert_eq!(version(&mut up.observer, &up.table).await, 1);
    sqlx::raw_sql("COMMIT")
        .execute(&mut up.open)
        .await
        .expect("commit");

    // The failed migrator's connection is still open (as in a pool): it released its lock,
    // and the next migration drops the invalid index and builds it again.
    let mut conn = connect().await;
    tokio::time::timeout(Duration::from_secs(60), up.table.migrate(&mut conn))
        .await
        .expect("the migration lock was released")
        .expect("migrate");
    assert_eq!(unkeyed_index_valid(&mut conn, &up.table).await, Some(true));
    assert_eq!(version(&mut conn, &up.table).await, LATEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_upgrades_of_a_populated_table() {
    let (table, _cleanup) = table_at_version_1(50_000).await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&postgres_url())
        .await
        .expect("pool");
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (table, pool) = (table.clone(), pool.clone());
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.expect("connection");
                table.migrate(&mut conn).await
            })
        })
        .collect();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("migrations finish")
            .expect("migration task")
            .expect("migrate");
    }
    let mut conn = pool.acquire().await.expect("connection");
    assert_eq!(unkeyed_index_valid(&mut conn, &table).await, Some(true));
    let versions: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT version FROM {} ORDER BY version",
        table.qualified("_migrations")
    ))
    .fetch_all(&mut *conn)
    .await
    .expect("versions");
    assert_eq!(versions, (1..=LATEST).collect::<Vec<_>>());
    // Again, on the pooled connections the migrators used: idempotent, and no lock left.
    table.migrate(&mut conn).await.expect("migrate again");
    drop(conn);
    for _ in 0..4 {
        let mut conn = pool.acquire().await.expect("connection");
        tokio::time::timeout(Duration::from_secs(10), table.migrate(&mut conn))
            .await
            .expect("no migration lock left behind")
            .expect("migrate again");
    }
}
