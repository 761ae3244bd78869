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

pub mod backends;
// A build without any backend feature has nothing to re-export.
#[allow(unused_imports)]
pub use backends::crates::*;
