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
        let mut registry = SinkRegistry::new();
        register(&mut registry);
        assert_eq!(registry.names(), [TYPE]);
        let built = registry
            .build(TYPE, serde_json::json!({ "subject_prefix": "outbox." }))
            .await;
        assert!(built.is_ok());
        let error = registry
            .build(TYPE, serde_json::json!({ "publish_timeout": 5 }))
            .await
            .err()
            .unwrap();
        assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
        assert!(error.message().starts_with("publish_timeout: "), "{error}");
    }
}
