#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod error;
mod storage;
mod table;

pub use config::{DEFAULT_MAX_PER_KEY, PostgresConfig};
pub use storage::{DeadLetterFilter, DeadLetterRow, PgStorage, TopicStats};
pub use table::OutboxTable;
