#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub use outbox_core as core;
pub use outbox_core::*;

/// PostgreSQL outbox storage (cargo feature `postgres`).
#[cfg(feature = "postgres")]
pub use outbox_postgres as postgres;
