#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub use outbox_core as core;
pub use outbox_core::*;

#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod cli;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod fuzzing;

/// PostgreSQL outbox storage (cargo feature `postgres`).
#[cfg(feature = "postgres")]
pub use outbox_postgres as postgres;

/// MySQL and MariaDB outbox storage (cargo feature `mysql`).
#[cfg(feature = "mysql")]
pub use outbox_mysql as mysql;
/// SQLite outbox storage (cargo feature `sqlite`).
#[cfg(feature = "sqlite")]
pub use outbox_sqlite as sqlite;

/// Redis Streams sink (cargo feature `redis`).
#[cfg(feature = "redis")]
pub use outbox_redis as redis;

/// AMQP 0-9-1 sink (cargo feature `amqp`).
#[cfg(feature = "amqp")]
pub use outbox_amqp as amqp;

/// Kafka sink (cargo feature `kafka`).
#[cfg(feature = "kafka")]
pub use outbox_kafka as kafka;

/// NATS JetStream sink (cargo feature `nats`).
#[cfg(feature = "nats")]
pub use outbox_nats as nats;

/// File and standard output sinks, JSON lines (cargo feature `file`).
#[cfg(feature = "file")]
pub use outbox_file as file;
