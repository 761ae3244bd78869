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

pub use config::{DEFAULT_MAX_PER_KEY, MySqlConfig};
/// The operator's types live in `outbox-core` (every storage shares them); re-exported here for
/// code written against this crate.
pub use outbox_core::{DeadLetterFilter, DeadLetterRow, ParkedKey, TopicStats};
/// The storage type name in the relay's configuration: `[storage] type = "mysql"`.
pub const TYPE: &str = "mysql";

/// Registers the MySQL / MariaDB storage under [`TYPE`]: the factory reads a
/// [`MySqlConfig`] from the `[storage]` section (errors keyed by the setting) and connects
/// once ([`MySqlStorage::connect`]), so wrong credentials or a missing database are a
/// configuration error at start-up; a server that is down is retried by the relay.
pub fn register(registry: &mut outbox_core::StorageRegistry) {
    registry.register_settings(TYPE, |config: MySqlConfig| async move {
        let storage = MySqlStorage::connect(config).await?;
        Ok(std::sync::Arc::new(storage) as std::sync::Arc<dyn outbox_core::StorageAdmin>)
    });
}

pub use inbox::Inbox;
/// The sqlx this crate is built with, so an application enqueues through the same version.
pub use sqlx;
pub use storage::MySqlStorage;
pub use table::{OutboxTable, TABLE_SUFFIXES};
