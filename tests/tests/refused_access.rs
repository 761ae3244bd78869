//! Logins the server refuses and grants that are missing, on each SQL storage, at start-up
//! (connect, migrate) and at run time (claim, figures, enqueue): each is a `Config` error,
//! not retryable, that says what was wrong, where and what to do, and never shows the
//! password; it comes at once, not after a time-out. Once the grant its message names is
//! given, the same storage works.
//!
//! - PostgreSQL (the shared server, trust authentication for 127.0.0.1, so a refused login is
//!   a role or a database that does not exist): a role with LOGIN and no privilege on a
//!   schema of its own holding an outbox table, and one without CREATE for migrations.
//! - MariaDB: a user of the test's own with a password, reached with a wrong one; the same
//!   user with no grant, and with a grant on another table only.
//! - SQLite: the database on a read-only file system (a read-only bind mount, which stops
//!   root too): a migrated file in WAL mode, one in rollback-journal mode as an application
//!   made it, and a file that does not exist yet.
//!
//! Roles and users are dropped again when the test ends, a failed one included.

mod mounts;

use std::path::Path;
use std::time::{Duration, Instant};

use mounts::Mount;
use outbox_core::{Error, ErrorKind, NewMessage, Settlement, Storage};
use outbox_mysql::{MySqlConfig, MySqlStorage};
use outbox_postgres::{PgStorage, PostgresConfig};
use outbox_sqlite::{SqliteConfig, SqliteStorage};
use outbox_tests::{
    Service, TestOutbox, drop_mysql_tables, mysql_url, open_sqlite, postgres_url, unique_name,
    with_database,
};
use sqlx::Connection;

/// A refusal must come at once: well within the pools' 5 s time-outs.
const AT_ONCE: Duration = Duration::from_secs(3);

const LEASE: Duration = Duration::from_secs(30);

/// `error` is a configuration error, not retryable, whose text holds each of `says` and not
/// `secret`.
#[track_caller]
fn assert_refused(what: &str, error: &Error, says: &[&str], secret: Option<&str>) {
    let text = error.to_string();
    assert_eq!(error.kind(), ErrorKind::Config, "{what}: {text}");
    assert!(!error.is_retryable(), "{what}: {text}");
    for part in says {
        assert!(text.contains(part), "{what}: `{part}` missing from: {text}");
    }
    if let Some(secret) = secret {
        assert!(!text.contains(secret), "{what}: the password shows: {text}");
        assert!(
            !format!("{error:?}").contains(secret),
            "{what}: the password shows in Debug: {error:?}"
        );
    }
}

/// Runs `call`, which must fail at once.
async fn refused<T: std::fmt::Debug>(
    what: &str,
    call: impl std::future::Future<Output = outbox_core::Result<T>>,
) -> Error {
    let started = Instant::now();
    let error = call.await.expect_err(what);
    assert!(
        started.elapsed() < AT_ONCE,
        "{what}: refused only after {:?}: {error}",
        started.elapsed()
    );
    error
}

/// Once the grants are in place, the relay's side works: a claim takes `message` (committed
/// alone in the outbox) and a settlement delivers it.
async fn claim_and_deliver_once_granted(storage: &dyn Storage, message: &NewMessage) {
    let claim = storage
        .claim("w", 10, LEASE)
        .await
        .expect("claim once granted");
    assert_eq!(claim.messages.len(), 1);
    let delivered = Settlement {
        delivered: vec![outbox_core::Delivery {
            id: message.id,
            receipt: outbox_core::Receipt::new("r"),
        }],
        ..Settlement::default()
    };
    assert_eq!(
        storage
            .settle(&claim.token, &delivered)
            .await
            .expect("settle once granted"),
        1
    );
}

/// `url` with its user info replaced by `login` (`user` or `user:password`).
fn with_login(url: &str, login: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let rest = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{login}@{rest}")
}

/// Runs SQL statements as the administrator from any context (a `Drop` inside a test's
/// runtime included, through [`outbox_tests::clean_up`]). Errors are ignored, as in a
/// clean-up.
fn clean_up(statements: Vec<String>, postgres: bool) {
    outbox_tests::clean_up(async move {
        if postgres {
            let mut conn = sqlx::PgConnection::connect(&postgres_url()).await.ok()?;
            for sql in statements {
                let _ = sqlx::query(&sql).execute(&mut conn).await;
            }
        } else {
            let mut conn = outbox_mysql::sqlx::MySqlConnection::connect(&mysql_url())
                .await
                .ok()?;
            for sql in statements {
                let _ = outbox_mysql::sqlx::query(&sql).execute(&mut conn).await;
            }
        }
        Some(())
    });
}

// --- PostgreSQL ---

/// A PostgreSQL role of the test's own with LOGIN and no privileges; dropped (with what was
/// granted to it) when dropped.
struct Role(String);

impl Role {
    async fn create(prefix: &str) -> Role {
        let name = unique_name(prefix);
        let mut admin = sqlx::PgConnection::connect(&postgres_url())
            .await
            .unwrap_or_else(|e| Service::Postgres.missing(e));
        sqlx::query(&format!(r#"CREATE ROLE "{name}" LOGIN"#))
            .execute(&mut admin)
            .await
            .expect("create a role");
        Role(name)
    }

    fn url(&self) -> String {
        with_login(&postgres_url(), &self.0)
    }

    async fn grant(&self, sql: &str) {
        let mut admin = sqlx::PgConnection::connect(&postgres_url())
            .await
            .expect("PostgreSQL");
        let sql = sql.replace("<role>", &format!("\"{}\"", self.0));
        sqlx::query(&sql).execute(&mut admin).await.expect(&sql);
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let role = &self.0;
        clean_up(
            vec![
                format!(r#"DROP OWNED BY "{role}""#),
                format!(r#"DROP ROLE IF EXISTS "{role}""#),
            ],
            true,
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_role_or_database_that_does_not_exist_is_refused_at_once() {
    Service::Postgres.require();
    let ghost = unique_name("ghost");
    let secret = "Pw-never-printed-7f3a";
    let url = with_login(&postgres_url(), &format!("{ghost}:{secret}"));
    let config = PostgresConfig::new(&url).table(unique_name("t"), "outbox");
    assert!(
        !format!("{config:?}").contains(secret),
        "the configuration's Debug shows the password"
    );
    let storage = PgStorage::new(config).expect("valid settings");
    let says = [
        ghost.as_str(),
        "does not exist",
        "the server refused the login",
        "the role exists and has LOGIN",
    ];
    let error = refused("migrate as a role that does not exist", storage.migrate()).await;
    assert_refused("migrate", &error, &says, Some(secret));
    let error = refused("claim", storage.claim("w", 10, LEASE)).await;
    assert_refused("claim", &error, &says, Some(secret));
    let error = refused("figures", storage.stats()).await;
    assert_refused("figures", &error, &says, Some(secret));
    let error = refused("health", storage.health()).await;
    assert_refused("health", &error, &says, Some(secret));

    let database = unique_name("no_db");
    let storage = PgStorage::new(PostgresConfig::new(with_database(
        &postgres_url(),
        &database,
    )))
    .expect("valid settings");
    let says = [
        database.as_str(),
        "does not exist",
        "the database named in `url` does not exist",
        "CREATE DATABASE",
    ];
    let error = refused(
        "migrate into a database that does not exist",
        storage.migrate(),
    )
    .await;
    assert_refused("migrate", &error, &says, None);
    let error = refused("claim", storage.claim("w", 10, LEASE)).await;
    assert_refused("claim", &error, &says, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_role_without_grants_is_refused_and_told_what_to_grant() {
    let outbox = TestOutbox::new().await;
    let schema = outbox.table.schema().to_string();
    let role = Role::create("nogrant").await;
    let storage =
        PgStorage::new(PostgresConfig::new(role.url()).table(&schema, "outbox")).expect("config");
    let no_usage = [
        format!("permission denied for schema {schema}"),
        "the role lacks a privilege on the outbox tables".to_string(),
        "GRANT USAGE ON SCHEMA <schema> TO <role>".to_string(),
    ];
    let no_usage: Vec<&str> = no_usage.iter().map(String::as_str).collect();
    let error = refused("claim without grants", storage.claim("w", 10, LEASE)).await;
    assert_refused("claim", &error, &no_usage, None);
    let error = refused("figures without grants", storage.stats()).await;
    assert_refused("figures", &error, &no_usage, None);

    // The application's enqueue as that role.
    let message = NewMessage::new("grants", b"{}".to_vec()).key("k");
    let mut app = sqlx::PgConnection::connect(&role.url())
        .await
        .expect("the role logs in");
    let mut tx = app.begin().await.expect("begin");
    let error = refused(
        "enqueue without grants",
        outbox.table.enqueue(&mut tx, &message),
    )
    .await;
    assert_refused("enqueue", &error, &no_usage, None);
    drop(tx);

    // With USAGE on the schema only, the error names the table.
    role.grant(&format!(r#"GRANT USAGE ON SCHEMA "{schema}" TO <role>"#))
        .await;
    let error = refused("claim with USAGE only", storage.claim("w", 10, LEASE)).await;
    assert_refused(
        "claim",
        &error,
        &[
            "permission denied for table",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA",
        ],
        None,
    );

    // Granted what the message says: enqueue, claim and settle work.
    for grant in [
        r#"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "<schema>" TO <role>"#,
        r#"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA "<schema>" TO <role>"#,
    ] {
        role.grant(&grant.replace("<schema>", &schema)).await;
    }
    let mut tx = app.begin().await.expect("begin");
    outbox
        .table
        .enqueue(&mut tx, &message)
        .await
        .expect("enqueue once granted");
    tx.commit().await.expect("commit");
    claim_and_deliver_once_granted(&storage, &message).await;
    let stats = storage.stats().await.expect("figures once granted");
    assert_eq!((stats.pending, stats.in_flight), (0, 0), "{stats:?}");
    app.close().await.ok();
    drop(storage);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_role_without_create_cannot_migrate_and_is_told_what_it_needs() {
    Service::Postgres.require();
    let role = Role::create("nocreate").await;
    let schema = unique_name("nocreate");
    let storage =
        PgStorage::new(PostgresConfig::new(role.url()).table(&schema, "outbox")).expect("config");
    let error = refused("migrate without CREATE", storage.migrate()).await;
    assert_refused(
        "migrate",
        &error,
        &[
            "migration failed",
            "permission denied for database",
            "migrations need CREATE on the database",
            "outbox migrate --print-sql",
        ],
        None,
    );
    outbox_tests::drop_schemas(&[schema]);
}

// --- MariaDB ---

/// A MariaDB user of the test's own with a password; dropped when dropped.
struct User {
    name: String,
    password: String,
}

impl User {
    async fn create() -> User {
        let user = User {
            name: unique_name("u"),
            password: format!("Right-{}", unique_name("pw")),
        };
        user.admin(&format!(
            "CREATE USER '{}'@'%' IDENTIFIED BY '{}'",
            user.name, user.password
        ))
        .await;
        user
    }

    async fn admin(&self, sql: &str) {
        let mut admin = outbox_mysql::sqlx::MySqlConnection::connect(&mysql_url())
            .await
            .unwrap_or_else(|e| panic!("MariaDB must be running at {}: {e}", mysql_url()));
        outbox_mysql::sqlx::query(sql)
            .execute(&mut admin)
            .await
            .expect(sql);
    }

    fn url(&self, password: &str) -> String {
        with_login(&mysql_url(), &format!("{}:{password}", self.name))
    }
}

impl Drop for User {
    fn drop(&mut self) {
        clean_up(
            vec![format!("DROP USER IF EXISTS '{}'@'%'", self.name)],
            false,
        );
    }
}

/// Drops an outbox table's tables when dropped.
struct Tables(outbox_mysql::OutboxTable);

impl Drop for Tables {
    fn drop(&mut self) {
        drop_mysql_tables(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_wrong_password_or_missing_grants_are_refused_with_what_to_fix() {
    let user = User::create().await;
    let wrong = "Wrong-password-3c1d";
    let config = MySqlConfig::new(user.url(wrong));
    let error = refused(
        "connect with a wrong password",
        MySqlStorage::connect(config),
    )
    .await;
    let redacted = format!("url `mysql://{}:***@", user.name);
    assert_refused(
        "wrong password",
        &error,
        &[
            &redacted,
            "the server refused the user or password",
            "Access denied",
        ],
        Some(wrong),
    );
    // Nothing granted: the user may not use the database.
    let config = MySqlConfig::new(user.url(&user.password));
    let error = refused("connect without grants", MySqlStorage::connect(config)).await;
    assert_refused(
        "no grant",
        &error,
        &[&redacted, "may not use database `test`", "GRANT"],
        Some(&user.password),
    );

    // A table of its own, migrated by root; the user may read another table only.
    let table = unique_name("t");
    let root = MySqlStorage::new(MySqlConfig::new(mysql_url()).table(&table)).expect("config");
    root.migrate().await.expect("migrate as root");
    let _tables = Tables(root.table().clone());
    user.admin(&format!(
        "GRANT SELECT ON `test`.`{table}_migrations` TO '{}'@'%'",
        user.name
    ))
    .await;
    let config = MySqlConfig::new(user.url(&user.password)).table(&table);
    let storage = MySqlStorage::connect(config)
        .await
        .expect("the user may use the database now");
    let says = [
        "command denied",
        "the user lacks a privilege on the outbox tables in database `test`",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON `test`.* TO the user, then restart the relay",
    ];
    let error = refused("claim without grants", storage.claim("w", 10, LEASE)).await;
    assert_refused("claim", &error, &says, Some(&user.password));
    let error = refused("figures without grants", storage.stats()).await;
    assert_refused("figures", &error, &says, Some(&user.password));
    let message = NewMessage::new("grants", b"{}".to_vec()).key("k");
    let app = outbox_mysql::sqlx::MySqlPool::connect(&user.url(&user.password))
        .await
        .expect("the user logs in");
    let mut tx = app.begin().await.expect("begin");
    let error = refused(
        "enqueue without grants",
        root.table().enqueue(&mut tx, &message),
    )
    .await;
    assert_refused(
        "enqueue",
        &error,
        &[
            "INSERT command denied",
            "the user lacks a privilege on the outbox tables",
        ],
        Some(&user.password),
    );
    drop(tx);
    let fresh = unique_name("t");
    let migrator = MySqlStorage::new(MySqlConfig::new(user.url(&user.password)).table(&fresh))
        .expect("config");
    let _fresh_tables = Tables(migrator.table().clone());
    let error = refused("migrate without CREATE", migrator.migrate()).await;
    assert_refused(
        "migrate",
        &error,
        &[
            "command denied",
            "migrations need CREATE and INDEX",
            "outbox migrate --print-sql",
        ],
        Some(&user.password),
    );

    // Granted what the message says, and restarted (MariaDB gives a database grant to new
    // sessions only): enqueue, claim and settle work.
    user.admin(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON `test`.* TO '{}'@'%'",
        user.name
    ))
    .await;
    app.close().await;
    drop(storage);
    let app = outbox_mysql::sqlx::MySqlPool::connect(&user.url(&user.password))
        .await
        .expect("the user logs in");
    let config = MySqlConfig::new(user.url(&user.password)).table(&table);
    let storage = MySqlStorage::connect(config).await.expect("connect");
    let mut tx = app.begin().await.expect("begin");
    root.table()
        .enqueue(&mut tx, &message)
        .await
        .expect("enqueue once granted");
    tx.commit().await.expect("commit");
    claim_and_deliver_once_granted(&storage, &message).await;
    app.close().await;
}

// --- SQLite ---

/// Makes `path` a migrated outbox database with one message, in rollback-journal mode as
/// an application's own SQLite would have made it, never touched by a relay (which would
/// switch it to WAL).
async fn journal_mode_database(path: &Path) {
    use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
    let mut conn = outbox_sqlite::sqlx::SqliteConnection::connect_with(
        &SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Delete),
    )
    .await
    .expect("create the database");
    let table = outbox_sqlite::OutboxTable::new("outbox").expect("table");
    table.migrate(&mut conn).await.expect("migrate");
    let mut tx = conn.begin().await.expect("begin");
    table
        .enqueue(&mut tx, &NewMessage::new("t", b"x".to_vec()))
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    conn.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_on_a_read_only_file_system_is_refused_naming_path() {
    let disk = Mount::tmpfs(16 << 20);
    // A database the relay made (WAL mode), closed cleanly: no -wal or -shm file left.
    let wal = disk.file("wal.db");
    let storage = open_sqlite(SqliteConfig::new(&wal)).await;
    // The same database as a process that died leaves it: its -wal and -shm files still
    // there (SQLite then reads it even on a read-only file system).
    for suffix in ["", "-wal", "-shm"] {
        std::fs::copy(
            disk.file(&format!("wal.db{suffix}")),
            disk.file(&format!("crashed.db{suffix}")),
        )
        .expect("copy the open database");
    }
    storage.pool().close().await;
    drop(storage);
    journal_mode_database(&disk.file("journal.db")).await;
    let read_only = Mount::read_only_view(&disk.path);

    for (name, what) in [
        ("wal.db", "a WAL database"),
        (
            "crashed.db",
            "a WAL database with its -wal and -shm left behind",
        ),
        ("journal.db", "a rollback-journal database"),
        ("new.db", "a database still to be created"),
    ] {
        let path = read_only.file(name);
        let shown = format!("path `{}`", path.display());
        let says = [shown.as_str(), "read-only file system"];
        let error = refused(
            &format!("open {what} on a read-only file system"),
            SqliteStorage::open(SqliteConfig::new(&path)),
        )
        .await;
        assert_refused(what, &error, &says, None);
        // A storage built lazily finds out at its first claim: at once when SQLite cannot
        // open the file, after the pool's wait for a connection (busy_timeout + 1 s) when
        // it opens it but cannot switch it to WAL mode.
        let lazy = SqliteStorage::new(SqliteConfig {
            busy_timeout: Duration::from_millis(500),
            ..SqliteConfig::new(&path)
        })
        .expect("settings");
        let error = refused(
            &format!("claim on {what} on a read-only file system"),
            lazy.claim("w", 10, LEASE),
        )
        .await;
        assert_refused(what, &error, &says, None);
    }

    // An application that opens the rollback-journal file (SQLite falls back to read-only)
    // and enqueues is told why it cannot.
    let mut app = outbox_sqlite::sqlx::SqliteConnection::connect_with(
        &outbox_sqlite::sqlx::sqlite::SqliteConnectOptions::new()
            .filename(read_only.file("journal.db")),
    )
    .await
    .expect("SQLite opens a read-only file for reading");
    let mut tx = app.begin().await.expect("begin");
    let error = outbox_sqlite::OutboxTable::new("outbox")
        .expect("table")
        .enqueue(&mut tx, &NewMessage::new("t", b"y".to_vec()))
        .await
        .expect_err("an enqueue into a read-only file");
    assert_refused(
        "enqueue",
        &error,
        &[
            "enqueue failed",
            "read-only",
            "attempt to write a readonly database",
        ],
        None,
    );
    drop(tx);
    app.close().await.ok();
}

/// The write check at start-up that finds a read-only file does not wait for the write lock:
/// with an application's transaction holding it, a storage (an `outbox status`) opens at
/// once, and its claim waits for the lock as always.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_start_up_write_check_does_not_wait_for_an_application_transaction() {
    let disk = Mount::tmpfs(16 << 20);
    let path = disk.file("app.db");
    let _storage = open_sqlite(SqliteConfig::new(&path)).await;
    let mut app = outbox_sqlite::sqlx::SqliteConnection::connect_with(
        &outbox_sqlite::sqlx::sqlite::SqliteConnectOptions::new().filename(&path),
    )
    .await
    .expect("the application's connection");
    let tx = app
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("the application takes the write lock");
    let started = Instant::now();
    let other = SqliteStorage::open(SqliteConfig::new(&path))
        .await
        .expect("a storage opens while the lock is held");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "opening waited {:?} for the application's transaction",
        started.elapsed()
    );
    assert_eq!(other.stats().await.expect("figures").pending, 0);
    tx.rollback().await.expect("rollback");
    other
        .claim("w", 10, LEASE)
        .await
        .expect("a claim once the lock is free");
}
