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

use std::sync::Arc;

use outbox_core::{Sink, SinkRegistry};

/// The sink type name in the relay's configuration: `[sink] type = "redis"`.
pub const TYPE: &str = "redis";

/// Registers the Redis Streams sink under [`TYPE`]: the factory reads a [`RedisConfig`]
/// from the `[sink]` table (see [`RedisConfig::from_value`]) and builds the sink. It does not
/// connect: a Redis that is down shows up in the health check, not as a start-up failure.
pub fn register(registry: &mut SinkRegistry) {
    registry.register(TYPE, |config| async move {
        let sink = RedisSink::new(RedisConfig::from_value(config)?)?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    });
}
