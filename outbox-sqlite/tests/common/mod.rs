//! What the crate's tests share: real database files in temporary directories.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use outbox_sqlite::{SqliteConfig, SqliteStorage};
// A directory of a test's own under the system's temporary directory, removed when dropped.
pub use outbox_test_support::TempDir;

/// A directory of the test's own and the path of the database file `app.db` in it.
pub fn app_db() -> (TempDir, PathBuf) {
    let dir = TempDir::new("outbox-sqlite");
    let path = dir.file("app.db");
    (dir, path)
}

/// A relay's storage on `path` with `adjust`ed settings, opened and migrated.
pub async fn storage(path: &Path, adjust: impl FnOnce(&mut SqliteConfig)) -> SqliteStorage {
    let mut config = SqliteConfig::new(path);
    adjust(&mut config);
    let storage = SqliteStorage::open(config).await.expect("opening the file");
    storage.migrate().await.expect("migrating");
    storage
}

/// The application's own pool on `path`, as an application would open it.
pub async fn app_pool(path: &Path) -> SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .busy_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("the application's pool")
}

/// The database's clock, in milliseconds.
pub async fn now_ms(pool: &SqlitePool) -> i64 {
    outbox_sqlite::sqlx::query_scalar(
        "SELECT CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)",
    )
    .fetch_one(pool)
    .await
    .expect("reading the clock")
}

/// How many rows `table` has, read on `pool`.
pub async fn count(pool: &SqlitePool, table: &str) -> i64 {
    outbox_sqlite::sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(pool)
        .await
        .expect("counting rows")
}
