#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod admin;
mod config;
mod connection;
mod error;
mod rows;
mod sql;
mod storage;
mod table;
mod wakeup;

pub use admin::{DeadLetterFilter, DeadLetterRow, TopicStats};
pub use config::{DEFAULT_MAX_PER_KEY, PostgresConfig};
/// The sqlx this crate is built with, so an application enqueues through the same version.
pub use sqlx;
pub use storage::PgStorage;
pub use table::OutboxTable;
