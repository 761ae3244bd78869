//! The sinks compiled into this build, in a registry that configuration picks from.

use outbox::SinkRegistry;

/// Every sink type this build has; the others are noted with the cargo feature that adds
/// them, so asking for one says how to get it.
pub fn registry() -> SinkRegistry {
    let mut registry = SinkRegistry::new();
    #[cfg(feature = "redis")]
    outbox::redis::register(&mut registry);
    #[cfg(feature = "amqp")]
    outbox::amqp::register(&mut registry);
    #[cfg(feature = "kafka")]
    outbox::kafka::register(&mut registry);
    #[cfg(feature = "nats")]
    outbox::nats::register(&mut registry);
    for name in ["redis", "amqp", "kafka", "nats"] {
        registry.note_missing(name, name);
    }
    registry
}
