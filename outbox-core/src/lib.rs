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

/// Implements `Debug` for a settings struct field by field, as `#[derive(Debug)]` would,
/// except that a field written `name: expression` is shown as that expression: the way to
/// hide a secret. The closure-like head names the value being shown:
///
/// ```
/// # use outbox_core::redact_url;
/// struct MyConfig { url: String, pool_size: u32 }
/// outbox_core::debug_fields!(MyConfig, |config| {
///     url: redact_url(&config.url),
///     pool_size,
/// });
/// let config = MyConfig { url: "redis://:s3cret@host".into(), pool_size: 4 };
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
///
/// List every field (in the order they should show): one left out is not shown.
#[macro_export]
macro_rules! debug_fields {
    ($type:ident, |$this:ident| { $($field:ident $(: $shown:expr)?),* $(,)? }) => {
        impl ::std::fmt::Debug for $type {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                let $this = self;
                f.debug_struct(::std::stringify!($type))
                    $(.field(
                        ::std::stringify!($field),
                        &$crate::__debug_field!($this.$field $(, $shown)?),
                    ))*
                    .finish()
            }
        }
    };
}

/// One field's value for [`debug_fields!`]: the field itself, or what it is shown as.
#[doc(hidden)]
#[macro_export]
macro_rules! __debug_field {
    ($value:expr) => {
        $value
    };
    ($value:expr, $shown:expr) => {
        $shown
    };
}
