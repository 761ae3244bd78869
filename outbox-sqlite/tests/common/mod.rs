//! What the crate's tests share: real database files in temporary directories.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_sqlite::sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use outbox_sqlite::{SqliteConfig, SqliteStorage};

/// A directory of its own under the system's temporary directory, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "outbox-sqlite-{}-{:016x}",
            std::process::id(),
            fastrand_u64()
        ));
        std::fs::create_dir_all(&dir).expect("making a temporary directory");
        TempDir(dir)
    }

    /// A path in it.
    pub fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A random number without another dependency: the std hasher is seeded at random.
fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.finish()
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
