//! An example outbox sink written outside the workspace: spools messages into one
//! JSON-lines file per topic. See README.md.
#![deny(missing_docs)]

mod config;
mod error;
mod sink;

pub use config::SpoolConfig;
pub use sink::{SpoolSink, SpooledLine};

/// The `type` name a registry would use for this sink.
pub const TYPE: &str = "spool";
