//! The backends this crate knows of, in one table (the `backends!` invocation below): the
//! re-exported backend crates (`outbox::nats`, …), and the storages and sinks compiled into
//! this build, in registries that configuration picks from. The binary's `--help`, its
//! configuration errors and the registries all read the table; the tidy test
//! (xtask/src/tidy.rs) reads it too, and checks that it names every backend crate of the
//! workspace with a cargo feature of the facade. A new backend is one row here (and its
//! dependency and feature in the root Cargo.toml).

use crate::{SinkRegistry, StorageRegistry};

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

/// Expands the table: for each kind, the list of its rows (`STORAGES`, `SINKS`), the function
/// that builds its registry (`storages()`, `sinks()`: every row compiled in registered, with
/// `#[cfg(feature = …)]` on each call, and the others noted as missing), and the
/// re-export of each row's crate (in [`crates`], which the crate root re-exports). A row is
/// `"type", feature "feature", "what it is", outbox_<name> as <name>;`: the crate's
/// `register` function registers the type. A row without a crate is registered by the crate
/// of another row of the same feature.
macro_rules! backends {
    ($(
        $(#[$doc:meta])*
        $list:ident, $registry:ty, $kind:literal, $build:ident {
            $( $name:literal, feature $feature:literal, $what:literal
                $(, $krate:ident as $module:ident)?; )*
        }
    )*) => {
        $(
            $(#[$doc])*
            pub const $list: &[Backend] = &[
                $( Backend { name: $name, feature: $feature, what: $what }, )*
            ];

            #[doc = concat!("Every ", $kind, " type this build has; the others are noted with the cargo")]
            /// feature that adds them, so asking for one says how to get it.
            pub fn $build() -> $registry {
                let mut registry = <$registry>::new();
                $($(
                    #[cfg(feature = $feature)]
                    crates::$module::register(&mut registry);
                )?)*
                for backend in $list {
                    registry.note_missing(backend.name, backend.feature);
                }
                registry
            }
        )*

        /// The backend crates of the table that this build has, each under its short name
        /// (`outbox::nats` is `outbox_nats`).
        pub mod crates {
            $($($(
                #[doc = concat!($what, " (cargo feature `", $feature, "`).")]
                #[cfg(feature = $feature)]
                pub use ::$krate as $module;
            )?)*)*
        }
    };
}

backends! {
    /// Every storage type: its `[storage] type` name, the cargo feature that adds it and
    /// what it stores in.
    STORAGES, StorageRegistry, "storage", storages {
        "postgres", feature "postgres", "PostgreSQL", outbox_postgres as postgres;
        "sqlite", feature "sqlite", "SQLite", outbox_sqlite as sqlite;
        "mysql", feature "mysql", "MySQL, MariaDB", outbox_mysql as mysql;
    }
    /// Every sink type: its `[sink] type` name, the cargo feature that adds it and what it
    /// delivers to.
    SINKS, SinkRegistry, "sink", sinks {
        "redis", feature "redis", "Redis Streams", outbox_redis as redis;
        "amqp", feature "amqp", "AMQP 0-9-1, RabbitMQ", outbox_amqp as amqp;
        "kafka", feature "kafka", "Kafka", outbox_kafka as kafka;
        "nats", feature "nats", "NATS JetStream", outbox_nats as nats;
        "file", feature "file", "JSON lines appended to a file", outbox_file as file;
        // outbox_file::register registers it, beside `file`.
        "stdout", feature "file", "JSON lines on standard output";
    }
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
