#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod admin;
mod backoff;
pub mod config;
pub mod envelope;
mod error;
mod message;
pub mod metrics;
mod printable;
mod redact;
mod registry;
mod sink;
mod storage;
mod trace;

#[cfg(any(test, feature = "memory"))]
pub mod memory;
#[cfg(feature = "runner")]
mod worker;

pub use admin::{DeadLetterFilter, DeadLetterRow, ParkedKey, StorageAdmin, TopicStats};
pub use backoff::Backoff;
pub use config::Template;
pub use error::{Error, ErrorKind, Result};
pub use message::{Message, NewMessage, TraceContext};
pub use printable::printable;
pub use redact::{redact_url, redact_url_token};
pub use registry::{BoxFuture, Factory, Registry, SinkFactory, SinkRegistry, StorageRegistry};
pub use sink::{Outcome, Receipt, Sink, SinkCapabilities};
pub use storage::{
    Claim, ClaimToken, DeadLetter, Delivery, HorizonLag, QueueStats, Retry, Settlement, Storage,
    StorageCapabilities,
};
#[cfg(feature = "runner")]
pub use tokio_util::sync::CancellationToken;
#[cfg(feature = "runner")]
pub use worker::{RunHealth, Worker, WorkerConfig};

/// Implements `Debug` for a backend type that shows only its `config` field:
/// `outbox_core::debug_shows_config!(MySink);` prints `MySink { config: …, .. }`.
///
/// The configuration's own `Debug` hides its secrets (passwords, tokens, URL credentials);
/// the client handles, pools and buffers beside it say nothing useful, so they are left out.
#[macro_export]
macro_rules! debug_shows_config {
    ($type:ident) => {
        impl ::std::fmt::Debug for $type {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.debug_struct(::std::stringify!($type))
                    .field("config", &self.config)
                    .finish_non_exhaustive()
            }
        }
    };
}
