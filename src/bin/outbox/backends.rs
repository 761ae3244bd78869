//! The backends this program knows of, in one table (the `backends!` invocation below), and
//! the storages and sinks compiled into this build, in registries that configuration picks
//! from. `--help`, the configuration errors and the registries all read the table; the tidy
//! test (xtask/src/tidy.rs) reads it too, and checks that it names every backend crate of the
//! workspace with a cargo feature of the facade. A new backend is one row here.

use outbox::{SinkRegistry, StorageRegistry};

/// The storage type when `[storage]` names none (configurations written before there was a
/// choice).
pub const DEFAULT_STORAGE: &str = "postgres";

/// A backend this program knows of: one row of the table.
#[derive(Debug)]
pub struct Backend {
    /// Its type name in configuration: `[storage] type` or `[sink] type`.
    pub name: &'static str,
    /// The cargo feature of the facade that compiles it in.
    pub feature: &'static str,
    /// What it stores in or delivers to, for `--help`.
    pub what: &'static str,
}

/// Expands the table: for each kind, the list of its rows (`STORAGES`, `SINKS`) and a
/// function that registers every row compiled in (`#[cfg(feature = …)]` on each call). A row
/// is `"type", feature "feature", "what it is", register_fn;`; a row without `register_fn`
/// is registered by the function of another row of the same feature.
macro_rules! backends {
    ($(
        $(#[$doc:meta])*
        $list:ident, $registry:ty, $register_all:ident {
            $( $name:literal, feature $feature:literal, $what:literal $(, $register:path)?; )*
        }
    )*) => {$(
        $(#[$doc])*
        pub const $list: &[Backend] = &[
            $( Backend { name: $name, feature: $feature, what: $what }, )*
        ];

        /// Registers every row of the list above that this build has.
        // A build with none of them leaves `registry` unused.
        #[allow(unused_variables)]
        fn $register_all(registry: &mut $registry) {
            $($(
                #[cfg(feature = $feature)]
                $register(registry);
            )?)*
        }
    )*};
}

backends! {
    /// Every storage type: its `[storage] type` name, the cargo feature that adds it and
    /// what it stores in.
    STORAGES, StorageRegistry, register_storages {
        "postgres", feature "postgres", "PostgreSQL", outbox::postgres::register;
        "sqlite", feature "sqlite", "SQLite", outbox::sqlite::register;
        "mysql", feature "mysql", "MySQL, MariaDB", outbox::mysql::register;
    }
    /// Every sink type: its `[sink] type` name, the cargo feature that adds it and what it
    /// delivers to.
    SINKS, SinkRegistry, register_sinks {
        "redis", feature "redis", "Redis Streams", outbox::redis::register;
        "amqp", feature "amqp", "AMQP 0-9-1, RabbitMQ", outbox::amqp::register;
        "kafka", feature "kafka", "Kafka", outbox::kafka::register;
        "nats", feature "nats", "NATS JetStream", outbox::nats::register;
        "file", feature "file", "JSON lines appended to a file", outbox::file::register;
        // outbox::file::register registers it, beside `file`.
        "stdout", feature "file", "JSON lines on standard output";
    }
}

/// Every storage type this build has; the others are noted with the cargo feature that adds
/// them, so asking for one says how to get it.
pub fn storages() -> StorageRegistry {
    let mut registry = StorageRegistry::new();
    register_storages(&mut registry);
    for storage in STORAGES {
        registry.note_missing(storage.name, storage.feature);
    }
    registry
}

/// Every sink type this build has; the others are noted with the cargo feature that adds
/// them, so asking for one says how to get it.
pub fn sinks() -> SinkRegistry {
    let mut registry = SinkRegistry::new();
    register_sinks(&mut registry);
    for sink in SINKS {
        registry.note_missing(sink.name, sink.feature);
    }
    registry
}

/// The backends for `--help`: every storage and sink, and which ones this build has.
pub fn help() -> String {
    let list = |backends: &[Backend]| {
        backends
            .iter()
            .map(|backend| format!("{} ({})", backend.name, backend.what))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "Storages: {}.\nSinks: {}.\nThis build has: {}, {}; the others are added by the cargo \
         feature of the same name{}.",
        list(STORAGES),
        list(SINKS),
        storages().names().join(", "),
        sinks().names().join(", "),
        STORAGES
            .iter()
            .chain(SINKS)
            .filter(|backend| backend.name != backend.feature)
            .map(|backend| format!(" ({}: `{}`)", backend.name, backend.feature))
            .collect::<String>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lists `--help` prints, as they read before the table.
    #[test]
    fn help_names_every_backend_and_the_features_of_other_names() {
        let help = help();
        let mut lines = help.lines();
        assert_eq!(
            lines.next(),
            Some("Storages: postgres (PostgreSQL), sqlite (SQLite), mysql (MySQL, MariaDB).")
        );
        assert_eq!(
            lines.next(),
            Some(
                "Sinks: redis (Redis Streams), amqp (AMQP 0-9-1, RabbitMQ), kafka (Kafka), nats \
                 (NATS JetStream), file (JSON lines appended to a file), stdout (JSON lines on \
                 standard output)."
            )
        );
        let last = lines.next().unwrap_or_default();
        assert!(last.starts_with("This build has: "), "{last}");
        assert!(
            last.ends_with(
                "; the others are added by the cargo feature of the same name (stdout: `file`)."
            ),
            "{last}"
        );
    }
}
