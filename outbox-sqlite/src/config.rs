//! Settings of the SQLite storage.

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Error, Result};

pub use outbox_sql::DEFAULT_MAX_PER_KEY;
use outbox_sql::config::{check_max_connections, check_max_per_key, check_retention};

/// Settings of the SQLite storage: the `[storage]` section of the relay's file and the Rust
/// API alike. Every key but `path` has a default.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqliteConfig {
    /// The database file, e.g. `/var/lib/app/app.db` (relative paths are relative to the
    /// relay's working directory). Created if missing; its directory must exist.
    pub path: PathBuf,
    /// Name of the outbox table (default `outbox`); the dead-letter and other tables are
    /// named after it.
    pub table: String,
    /// Deliver messages that share a partition key in enqueue order (default on).
    pub per_key_order: bool,
    /// With per-key order, the most messages of one key in one claim (default 8): the
    /// worker publishes a key's messages one round after another, so this bounds the rounds
    /// per batch.
    pub max_per_key: usize,
    /// Keep delivered messages, with their receipt, for this long; `None` (the default)
    /// deletes them on delivery.
    #[serde(with = "humantime_serde")]
    pub retention: Option<Duration>,
    /// How long a statement waits for another connection's write lock before the storage
    /// counts as unavailable (default 5 s). Application transactions that write hold that
    /// lock until they end.
    #[serde(with = "humantime_serde")]
    pub busy_timeout: Duration,
    /// Connections the relay may open (default 4). Writes go one at a time whatever the
    /// number (SQLite has one writer); more connections only let reads run alongside.
    pub max_connections: u32,
}

impl Default for SqliteConfig {
    /// The defaults, with no path (which [`SqliteConfig::validate`] refuses).
    fn default() -> Self {
        SqliteConfig {
            path: PathBuf::new(),
            table: "outbox".into(),
            per_key_order: true,
            max_per_key: DEFAULT_MAX_PER_KEY,
            retention: None,
            busy_timeout: Duration::from_secs(5),
            max_connections: 4,
        }
    }
}

impl Settings for SqliteConfig {
    /// Checks every setting; the error is keyed by the bad one (the caller places it in its
    /// section with [`Error::in_section`]). It does not look at the file system:
    /// [`check_path`](SqliteConfig::check_path) does.
    fn validate(&self) -> Result<()> {
        let path = self.path.to_string_lossy();
        if path.is_empty() {
            return Err(Error::setting(
                "path",
                "is missing: give the database file, e.g. /var/lib/app/app.db",
            ));
        }
        if path == ":memory:" || path.starts_with("file:") || path.starts_with("sqlite:") {
            return Err(Error::setting(
                "path",
                format!(
                    "`{path}` is not a file path; give the path of the database file (not a URL, \
                     and not :memory:, which every connection would see as its own empty \
                     database)"
                ),
            ));
        }
        crate::OutboxTable::new(&self.table)?;
        check_max_connections(self.max_connections)?;
        check_max_per_key(self.max_per_key)?;
        check_retention(self.retention)?;
        if self.busy_timeout.is_zero() {
            return Err(Error::setting(
                "busy_timeout",
                "is 0; give the relay time to wait for application transactions, e.g. 5s",
            ));
        }
        Ok(())
    }
}

impl SqliteConfig {
    /// Defaults for the database file at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SqliteConfig {
            path: path.into(),
            ..Self::default()
        }
    }

    /// Checks that the file can be where `path` says: its directory exists, and the path is
    /// not a directory itself. Whether the file is a database shows when it is opened.
    pub fn check_path(&self) -> Result<()> {
        let path = &self.path;
        if path.is_dir() {
            return Err(Error::setting(
                "path",
                format!(
                    "`{}` is a directory; give the database file inside it, e.g. `{}`",
                    path.display(),
                    path.join("app.db").display()
                ),
            ));
        }
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(Error::setting(
                "path",
                format!(
                    "`{}` is in a directory that does not exist (`{}`); create the directory or \
                     fix the path",
                    path.display(),
                    dir.display()
                ),
            ));
        }
        Ok(())
    }
}

outbox_core::setters!(SqliteConfig {
    /// Sets the table name.
    table(table: impl Into<String>) => table = table.into();
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_keyed_errors() {
        let config = SqliteConfig::from_value(serde_json::json!({ "path": "/tmp/x.db" })).unwrap();
        assert_eq!(config, SqliteConfig::new("/tmp/x.db"));
        assert_eq!(config.max_per_key, DEFAULT_MAX_PER_KEY);
        assert_eq!(config.busy_timeout, Duration::from_secs(5));
        assert!(config.per_key_order);
        let config = SqliteConfig::from_value(serde_json::json!({
            "path": "app.db", "table": "events", "per_key_order": false, "max_per_key": 2,
            "retention": "1h", "busy_timeout": "250ms", "max_connections": 2
        }))
        .unwrap();
        assert_eq!(config.retention, Some(Duration::from_secs(3600)));
        assert_eq!(config.busy_timeout, Duration::from_millis(250));
        for (value, expected) in [
            (serde_json::json!({}), "path is missing"),
            (
                serde_json::json!({ "path": ":memory:" }),
                "path `:memory:` is not a file path",
            ),
            (
                serde_json::json!({ "path": "sqlite://app.db" }),
                "path `sqlite://app.db` is not",
            ),
            (
                serde_json::json!({ "path": "a.db", "table": "Bad-Name" }),
                "table `Bad-Name`",
            ),
            (
                serde_json::json!({ "path": "a.db", "max_per_key": 0 }),
                "max_per_key is 0",
            ),
            (
                serde_json::json!({ "path": "a.db", "max_connections": 0 }),
                "max_connections is 0",
            ),
            (
                serde_json::json!({ "path": "a.db", "retention": "0s" }),
                "retention is 0",
            ),
            (
                serde_json::json!({ "path": "a.db", "busy_timeout": "0s" }),
                "busy_timeout is 0",
            ),
            (
                serde_json::json!({ "path": "a.db", "busy_timeout": "soon" }),
                "busy_timeout: ",
            ),
            (
                serde_json::json!({ "path": "a.db", "url": "x" }),
                "url: unknown field `url`",
            ),
        ] {
            let error = SqliteConfig::from_value(value.clone())
                .unwrap_err()
                .in_section("storage");
            assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
            assert!(
                error.message().starts_with(&format!("storage.{expected}")),
                "{value}: {error}"
            );
        }
    }

    #[test]
    fn the_path_must_be_in_a_directory_that_exists() {
        let missing = SqliteConfig::new("/nonexistent-outbox-dir/sub/app.db");
        let error = missing.check_path().unwrap_err().in_section("storage");
        assert!(
            error
                .message()
                .starts_with("storage.path `/nonexistent-outbox-dir/sub/app.db` is in a directory that does not exist"),
            "{error}"
        );
        let dir = SqliteConfig::new(std::env::temp_dir());
        assert!(
            dir.check_path()
                .unwrap_err()
                .message()
                .contains("is a directory"),
        );
        assert!(SqliteConfig::new("relative.db").check_path().is_ok());
    }
}
