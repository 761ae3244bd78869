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
pub use backends::crates::*;
