#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod error;
mod storage;
mod table;

pub use config::PostgresConfig;
pub use storage::{DeadLetterFilter, DeadLetterRow, MAX_PER_KEY, PgStorage, TopicStats};
pub use table::OutboxTable;
