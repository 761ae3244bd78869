#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod admin;
mod config;
mod connection;
mod error;
mod inbox;
mod rows;
mod sql;
mod storage;
mod table;

pub use config::{DEFAULT_MAX_PER_KEY, SqliteConfig};
/// The operator's types live in `outbox-core` (every storage shares them); re-exported here for
/// code written against this crate.
pub use outbox_core::{DeadLetterFilter, DeadLetterRow, ParkedKey, TopicStats};
/// The storage type name in the relay's configuration: `[storage] type = "sqlite"`.
pub const TYPE: &str = "sqlite";

/// Registers the SQLite storage under [`TYPE`]: the factory reads a [`SqliteConfig`] from the
/// `[storage]` section (errors keyed by the setting) and opens a [`SqliteStorage`], which
/// checks that `path` is (or can become) a SQLite database, so a wrong path is a
/// configuration error at start-up.
pub fn register(registry: &mut outbox_core::StorageRegistry) {
    registry.register_settings(TYPE, |config: SqliteConfig| async move {
        let storage = SqliteStorage::open(config).await?;
        Ok(std::sync::Arc::new(storage) as std::sync::Arc<dyn outbox_core::StorageAdmin>)
    });
}

pub use inbox::Inbox;
/// The sqlx this crate is built with, so an application enqueues through the same version.
pub use sqlx;
pub use storage::SqliteStorage;
pub use table::OutboxTable;
