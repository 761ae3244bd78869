//! The backends this program knows of, in one list, and the storages and sinks compiled
//! into this build, in registries that configuration picks from. `--help`, the
//! configuration errors and the registries all read the lists below; the tidy test checks
//! that they name every backend crate of the workspace.

use outbox::{SinkRegistry, StorageRegistry};

/// The storage type when `[storage]` names none (configurations written before there was a
/// choice).
pub const DEFAULT_STORAGE: &str = "postgres";

/// Every storage type: its `[storage]` name and what it stores in.
pub const STORAGES: [(&str, &str); 3] = [
    ("postgres", "PostgreSQL"),
    ("sqlite", "SQLite"),
    ("mysql", "MySQL, MariaDB"),
];

/// Every sink type: its `[sink] type` name (also its cargo feature, but for those in
/// [`SINK_FEATURES`]) and what it delivers to.
pub const SINKS: [(&str, &str); 6] = [
    ("redis", "Redis Streams"),
    ("amqp", "AMQP 0-9-1, RabbitMQ"),
    ("kafka", "Kafka"),
    ("nats", "NATS JetStream"),
    ("file", "JSON lines appended to a file"),
    ("stdout", "JSON lines on standard output"),
];

/// Sink types added by a cargo feature of another name: (type, feature).
pub const SINK_FEATURES: [(&str, &str); 1] = [("stdout", "file")];

/// The cargo feature that adds sink type `name`.
fn sink_feature(name: &str) -> &str {
    SINK_FEATURES
        .iter()
        .find(|(sink, _)| *sink == name)
        .map_or(name, |(_, feature)| feature)
}

/// Every storage type this build has; the others are noted with the cargo feature that adds
/// them, so asking for one says how to get it.
pub fn storages() -> StorageRegistry {
    let mut registry = StorageRegistry::new();
    #[cfg(feature = "postgres")]
    outbox::postgres::register(&mut registry);
    #[cfg(feature = "sqlite")]
    outbox::sqlite::register(&mut registry);
    #[cfg(feature = "mysql")]
    outbox::mysql::register(&mut registry);
    for (name, _) in STORAGES {
        registry.note_missing(name, name);
    }
    registry
}

/// Every sink type this build has; the others are noted with the cargo feature that adds
/// them, so asking for one says how to get it.
pub fn sinks() -> SinkRegistry {
    let mut registry = SinkRegistry::new();
    #[cfg(feature = "redis")]
    outbox::redis::register(&mut registry);
    #[cfg(feature = "amqp")]
    outbox::amqp::register(&mut registry);
    #[cfg(feature = "kafka")]
    outbox::kafka::register(&mut registry);
    #[cfg(feature = "nats")]
    outbox::nats::register(&mut registry);
    #[cfg(feature = "file")]
    outbox::file::register(&mut registry);
    for (name, _) in SINKS {
        registry.note_missing(name, sink_feature(name));
    }
    registry
}

/// The backends for `--help`: every storage and sink, and which ones this build has.
pub fn help() -> String {
    let list = |types: &[(&str, &str)]| {
        types
            .iter()
            .map(|(name, what)| format!("{name} ({what})"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "Storages: {}.\nSinks: {}.\nThis build has: {}, {}; the others are added by the cargo \
         feature of the same name{}.",
        list(&STORAGES),
        list(&SINKS),
        storages().names().join(", "),
        sinks().names().join(", "),
        SINK_FEATURES
            .iter()
            .map(|(name, feature)| format!(" ({name}: `{feature}`)"))
            .collect::<String>()
    )
}
