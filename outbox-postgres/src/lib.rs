#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod admin;
mod config;
mod connection;
mod error;
mod inbox;
mod lease;
mod log;
mod rows;
mod sql;
mod storage;
mod table;
mod wakeup;
mod wal;

pub use config::{DEFAULT_MAX_PER_KEY, DEFAULT_SHARDS, LogStart, PostgresConfig, StorageMode};
/// The operator's types live in `outbox-core` (every storage shares them); re-exported here for
/// code written against this crate.
pub use outbox_core::{DeadLetterFilter, DeadLetterRow, TopicStats};
/// The storage type name in the relay's configuration: `[storage] type = "postgres"`.
pub const TYPE: &str = "postgres";

/// Registers the PostgreSQL storage under [`TYPE`]: the factory reads a [`PostgresConfig`]
/// from the `[storage]` section (errors keyed by the setting) and builds a [`PgStorage`],
/// which connects lazily.
pub fn register(registry: &mut outbox_core::StorageRegistry) {
    registry.register_settings(TYPE, |config: PostgresConfig| async move {
        let storage = PgStorage::new(config)?;
        Ok(std::sync::Arc::new(storage) as std::sync::Arc<dyn outbox_core::StorageAdmin>)
    });
}

pub use inbox::Inbox;
/// The sqlx this crate is built with, so an application enqueues through the same version.
pub use sqlx;
pub use storage::PgStorage;
pub use table::OutboxTable;
