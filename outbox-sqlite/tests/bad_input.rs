//! A wrong `path` is a clear configuration error that names the setting, whether it comes
//! through the Rust API or the relay's registry.

mod common;

use common::TempDir;
use outbox_core::{ErrorKind, Storage, StorageRegistry};
use outbox_sqlite::{SqliteConfig, SqliteStorage};

async fn built(config: serde_json::Value) -> outbox_core::Error {
    let mut registry = StorageRegistry::new();
    outbox_sqlite::register(&mut registry);
    registry
        .build(outbox_sqlite::TYPE, config)
        .await
        .err()
        .expect("the storage must be refused")
        .in_section("storage")
}

/// Checks that `error` is a `Config` error that starts `` path `<path>` <problem> ``.
fn assert_refuses_path(error: &outbox_core::Error, path: &std::path::Path, problem: &str) {
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    let expected = format!("path `{}` {problem}", path.display());
    assert!(error.message().starts_with(&expected), "{error}");
}

#[tokio::test]
async fn a_path_in_a_missing_directory_is_refused_naming_path() {
    let dir = TempDir::new("outbox-sqlite");
    let path = dir.file("missing/sub/app.db");
    let error = SqliteStorage::new(SqliteConfig::new(&path)).unwrap_err();
    assert_refuses_path(&error, &path, "is in a directory that does not exist");
    let error = built(serde_json::json!({ "path": path })).await;
    assert_eq!(error.kind(), ErrorKind::Config);
    assert!(
        error.message().starts_with("storage.path `"),
        "the binary's error names the key: {error}"
    );
    assert!(
        !path.exists() && !dir.file("missing").exists(),
        "nothing was created"
    );
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_refused_naming_path() {
    let dir = TempDir::new("outbox-sqlite");
    let path = dir.file("notes.txt");
    std::fs::write(&path, "these are my notes, not a database\n".repeat(200)).unwrap();
    let error = SqliteStorage::open(SqliteConfig::new(&path))
        .await
        .unwrap_err();
    assert_refuses_path(&error, &path, "is not a SQLite database");
    let error = built(serde_json::json!({ "path": path })).await;
    assert!(
        error.message().starts_with("storage.path `")
            && error.message().contains("is not a SQLite database"),
        "{error}"
    );
    // Opened lazily, the same file fails the first call the same way, and stays untouched.
    let lazy = SqliteStorage::new(SqliteConfig::new(&path)).expect("lazy");
    let error = lazy
        .claim("w", 10, std::time::Duration::from_secs(30))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(
        error.message().contains("is not a SQLite database"),
        "{error}"
    );
    assert!(
        std::fs::read_to_string(&path)
            .unwrap()
            .starts_with("these are my notes")
    );
}

#[tokio::test]
async fn a_directory_as_path_is_refused_naming_path() {
    let dir = TempDir::new("outbox-sqlite");
    let error = built(serde_json::json!({ "path": dir.path() })).await;
    assert!(
        error.message().starts_with("storage.path `") && error.message().contains("is a directory"),
        "{error}"
    );
}

#[tokio::test]
async fn settings_are_checked_before_the_file() {
    let dir = TempDir::new("outbox-sqlite");
    let path = dir.file("app.db");
    for (config, expected) in [
        (serde_json::json!({}), "storage.path is missing"),
        (
            serde_json::json!({ "path": path, "max_per_key": 0 }),
            "storage.max_per_key is 0",
        ),
        (
            serde_json::json!({ "path": path, "table": "Orders" }),
            "storage.table `Orders` is not allowed",
        ),
        (
            serde_json::json!({ "path": path, "busy_timeout": "soon" }),
            "storage.busy_timeout: ",
        ),
        (
            serde_json::json!({ "path": path, "url": "sqlite://x" }),
            "storage.url: unknown field `url`",
        ),
    ] {
        let error = built(config.clone()).await;
        assert_eq!(error.kind(), ErrorKind::Config);
        assert!(error.message().starts_with(expected), "{config}: {error}");
    }
    assert!(!path.exists(), "a refused configuration creates no file");
}

#[tokio::test]
async fn a_database_without_the_tables_says_to_migrate() {
    let dir = TempDir::new("outbox-sqlite");
    let storage = SqliteStorage::open(SqliteConfig::new(dir.file("app.db")))
        .await
        .expect("a new, empty database");
    let error = storage
        .claim("w", 10, std::time::Duration::from_secs(30))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Schema, "{error}");
    assert!(error.message().contains("run `outbox migrate`"), "{error}");
}
