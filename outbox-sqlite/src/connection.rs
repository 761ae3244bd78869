//! The relay's connection pool.

use std::time::{Duration, Instant};

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Executor, Row, SqliteConnection};

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

/// The pool for `config`. Connects lazily; every new connection switches the database to
/// WAL mode if it is not in it yet (see [`ensure_wal`]).
pub(crate) fn pool(config: &SqliteConfig) -> SqlitePool {
    let busy_timeout = config.busy_timeout;
    SqlitePoolOptions::new()
        .max_connections(config.max_connections)
        // A connection is busy only for the statements of one call, which wait for the
        // write lock at most `busy_timeout`.
        .acquire_timeout(busy_timeout + Duration::from_secs(1))
        .after_connect(move |conn, _| Box::pin(ensure_wal(conn, busy_timeout)))
        .connect_lazy_with(options(config))
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
