#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
pub mod consumer;
mod error;
mod sink;
pub mod wire;

pub use config::KafkaConfig;
pub use sink::KafkaSink;

/// The Kafka client this sink is built on, for tests and tools that need an admin client
/// or a consumer of the same version.
pub use rdkafka;

use std::sync::Arc;

use outbox_core::{Sink, SinkRegistry};

/// The sink type name in the relay's configuration: `[sink] type = "kafka"`.
pub const TYPE: &str = "kafka";

/// Registers the Kafka sink under [`TYPE`]: the factory reads a [`KafkaConfig`] from the
/// `[sink]` table ([`Settings::from_value`](outbox_core::config::Settings::from_value): unknown keys are refused, errors are keyed by
/// the setting) and builds the producer; brokers are reached when the first batch or health
/// check needs them.
pub fn register(registry: &mut SinkRegistry) {
    registry.register_settings(TYPE, |config: KafkaConfig| async move {
        let sink = KafkaSink::new(config)?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    });
}
