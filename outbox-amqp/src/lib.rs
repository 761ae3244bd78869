#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod connection;
pub mod consumer;
mod error;
mod sink;
pub mod wire;

use std::sync::Arc;

use outbox_core::{Sink, SinkRegistry};

pub use config::{AmqpConfig, DEFAULT_MAX_PAYLOAD, ExchangeSetup, Route, Unroutable};
pub use sink::AmqpSink;

/// The AMQP client this sink is built on, for code (and tests) that talk to the broker
/// directly.
pub use lapin;

/// The sink type name in the relay's configuration: `[sink] type = "amqp"`.
pub const TYPE: &str = "amqp";

/// Registers the AMQP sink under [`TYPE`]: the factory reads an [`AmqpConfig`] from the
/// `[sink]` table ([`Settings::from_value`](outbox_core::config::Settings::from_value): unknown keys are refused, errors are keyed by
/// the setting) and connects with [`AmqpSink::connect`], so a missing exchange or a refused
/// login stops the start-up with a configuration error.
pub fn register(registry: &mut SinkRegistry) {
    registry.register_settings(TYPE, |config: AmqpConfig| async move {
        let sink = AmqpSink::connect(config).await?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    });
}
