#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod error;
mod sink;

pub use config::{DEFAULT_MAX_PAYLOAD, RedisConfig, Streams};
pub use sink::{RedisSink, fields};

/// The connection pool crate, re-exported so users and tests need no dependency of their own.
pub use deadpool_redis;
/// The Redis client crate, re-exported for the same reason.
pub use deadpool_redis::redis;
