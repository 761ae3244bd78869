#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
pub mod consumer;
mod error;
mod sink;
pub mod wire;

pub use config::{DEFAULT_MAX_PAYLOAD, RedisConfig};
pub use sink::RedisSink;

/// The connection pool crate, re-exported so users and tests need no dependency of their own.
pub use deadpool_redis;
/// The Redis client crate, re-exported for the same reason.
pub use deadpool_redis::redis;

use std::sync::Arc;

use outbox_core::{Sink, SinkRegistry};

/// The sink type name in the relay's configuration: `[sink] type = "redis"`.
pub const TYPE: &str = "redis";

/// Registers the Redis Streams sink under [`TYPE`]: the factory reads a [`RedisConfig`]
/// from the `[sink]` table (see [`Settings::from_value`](outbox_core::config::Settings::from_value); errors are keyed by the setting,
/// relative to the section) and builds the sink. It does not connect: a Redis that is down
/// shows up in the health check, not as a start-up failure.
pub fn register(registry: &mut SinkRegistry) {
    registry.register_settings(TYPE, |config: RedisConfig| async move {
        let sink = RedisSink::new(config)?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn registers_a_factory_that_names_bad_keys() {
        let good = serde_json::json!({ "url": "redis://127.0.0.1:1" });
        let bad = serde_json::json!({ "url": "redis://127.0.0.1:1", "publish_timeout": 5 });
        outbox_testkit::check_sink_register(register, TYPE, good, bad, "publish_timeout").await;
    }
}
