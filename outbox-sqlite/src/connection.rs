//! The relay's connection pool.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::sqlite::{
    SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
    SqliteTransactionManager,
};
use sqlx::{Connection, Executor, Row, SqliteConnection, TransactionManager};

use crate::SqliteConfig;
use crate::error::{Cause, cause};

/// The connection settings of the relay: the file (created if missing), the busy time-out,
/// and `synchronous = NORMAL`: in WAL mode a commit then survives a crash of the process
/// (not of the machine) without waiting for the disk. A relay's write lost with the machine
/// only means a redelivery, which at-least-once allows.
pub(crate) fn options(config: &SqliteConfig) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(&config.path)
        .create_if_missing(true)
        .busy_timeout(config.busy_timeout)
        .synchronous(SqliteSynchronous::Normal)
}

/// The last error of a new connection's set-up ([`ensure_wal`]). sqlx only logs an error of
/// `after_connect` and tries another connection until the pool's time-out, so a file that can
/// never be switched to WAL mode (read-only) would surface as a bare pool time-out; the
/// storage reports this error instead (see `SqliteStorage::error`).
#[derive(Debug, Clone, Default)]
pub(crate) struct SetupError(Arc<Mutex<Option<(Instant, sqlx::Error)>>>);

impl SetupError {
    fn record(&self, error: sqlx::Error) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), error));
    }

    /// The error recorded within the last `within`, if any (an older one cannot be why a
    /// wait of that length ran out).
    pub(crate) fn take(&self, within: Duration) -> Option<sqlx::Error> {
        let recorded = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        recorded
            .filter(|(at, _)| at.elapsed() <= within)
            .map(|(_, error)| error)
    }
}

/// The pool for `config`. Connects lazily; every new connection switches the database to
/// WAL mode if it is not in it yet (see [`ensure_wal`]); a failure of that is kept in
/// `setup`.
pub(crate) fn pool(config: &SqliteConfig, setup: &SetupError) -> SqlitePool {
    let busy_timeout = config.busy_timeout;
    let setup = setup.clone();
    SqlitePoolOptions::new()
        .max_connections(config.max_connections)
        // A connection is busy only for the statements of one call, which wait for the
        // write lock at most `busy_timeout`.
        .acquire_timeout(busy_timeout + Duration::from_secs(1))
        // A connection whose transaction could not be ended is closed, not reused: when a
        // statement or COMMIT fails with SQLITE_FULL or SQLITE_IOERR, SQLite rolls the
        // transaction back itself, the ROLLBACK that follows fails ("no transaction is
        // active"), and sqlx then counts the connection as still in a transaction for good:
        // every later BEGIN on it fails ("attempted to call begin_with at non-zero transaction
        // depth"), long after the disk has room again.
        .after_release(|conn, _| {
            Box::pin(async move { Ok(SqliteTransactionManager::get_transaction_depth(conn) == 0) })
        })
        .after_connect(move |conn, _| {
            let setup = setup.clone();
            Box::pin(async move {
                ensure_wal(conn, busy_timeout).await.map_err(|error| {
                    let text = error.to_string();
                    setup.record(error);
                    sqlx::Error::Protocol(text)
                })
            })
        })
        .connect_lazy_with(options(config))
}

/// Opens one connection to the file outside the pool and sets it up as the pool would, so
/// that a file that cannot be opened or switched to WAL mode fails at once with SQLite's own
/// error (the pool would retry until its time-out); then makes sure it can be written (see
/// [`check_writable`]).
pub(crate) async fn check(config: &SqliteConfig) -> Result<(), sqlx::Error> {
    let mut conn = SqliteConnection::connect_with(&options(config)).await?;
    let result = match ensure_wal(&mut conn, config.busy_timeout).await {
        Ok(()) => check_writable(&mut conn).await,
        Err(error) => Err(error),
    };
    let _ = conn.close().await;
    result
}

/// SQLite opens a file it may not write read-only without a word, and a WAL file whose
/// `-shm` was left behind (a process that exited without closing) reads fine even on a
/// read-only file system; even `BEGIN IMMEDIATE` succeeds. Only a write tells: this one
/// writes `user_version` back unchanged and rolls back. It does not wait for the write
/// lock (an `outbox status` must not wait for an application's transaction): a lock held by
/// someone else ends the check, with no error (the relay's statements wait for it, as
/// always); a read-only file is an error.
async fn check_writable(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    let version: i64 = conn.fetch_one("PRAGMA user_version").await?.try_get(0)?;
    conn.execute("PRAGMA busy_timeout = 0").await?;
    if let Err(error) = conn.execute("BEGIN IMMEDIATE").await {
        return match cause(&error) {
            Cause::ReadOnly => Err(error),
            _ => Ok(()),
        };
    }
    let wrote = conn
        .execute(format!("PRAGMA user_version = {version}").as_str())
        .await;
    let _ = conn.execute("ROLLBACK").await;
    match wrote {
        Err(error) if cause(&error) == Cause::ReadOnly => Err(error),
        _ => Ok(()),
    }
}

/// Switches the database to WAL mode (a lasting property of the file), so readers never wait
/// for the writer and the writer never waits for readers. The switch needs the file to
/// itself for a moment and SQLite does not wait for that with the busy time-out, so a busy
/// switch (another process opening the file at the same moment) is retried until
/// `busy_timeout` is over.
pub(crate) async fn ensure_wal(
    conn: &mut SqliteConnection,
    busy_timeout: Duration,
) -> Result<(), sqlx::Error> {
    let mode: String = conn.fetch_one("PRAGMA journal_mode").await?.try_get(0)?;
    if mode.eq_ignore_ascii_case("wal") {
        return Ok(());
    }
    let started = Instant::now();
    loop {
        match conn.fetch_one("PRAGMA journal_mode = WAL").await {
            Ok(row) => {
                let mode: String = row.try_get(0)?;
                if mode.eq_ignore_ascii_case("wal") {
                    tracing::info!("switched the outbox database to WAL mode");
                    return Ok(());
                }
                return Err(sqlx::Error::Configuration(
                    format!("the database cannot use WAL mode (journal_mode stays `{mode}`)")
                        .into(),
                ));
            }
            Err(e) if cause(&e) == Cause::Busy && started.elapsed() < busy_timeout => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
}
