#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
pub mod consumer;
mod error;
mod sink;
pub mod wire;

use std::sync::Arc;

use outbox_core::{Sink, SinkRegistry};

pub use config::NatsConfig;
pub use sink::NatsSink;

/// The NATS client crate, re-exported so users and tests need no dependency of their own.
pub use async_nats;

/// The sink type name in the relay's configuration: `[sink] type = "nats"`.
pub const TYPE: &str = "nats";

/// Registers the NATS sink under [`TYPE`]: the factory reads a [`NatsConfig`] from the
/// `[sink]` table (see [`Settings::from_value`](outbox_core::config::Settings::from_value); errors are keyed by the setting, relative
/// to the section) and builds a [`NatsSink`], which connects on first use.
pub fn register(registry: &mut SinkRegistry) {
    registry.register_settings(TYPE, |config: NatsConfig| async move {
        let sink = NatsSink::new(config)?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn registers_a_factory_that_names_bad_keys() {
        let good = serde_json::json!({ "subject_prefix": "outbox." });
        let bad = serde_json::json!({ "publish_timeout": 5 });
        outbox_testkit::check_sink_register(register, TYPE, good, bad, "publish_timeout").await;
    }
}
