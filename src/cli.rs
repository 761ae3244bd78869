//! The parsers of the `outbox` binary (cargo feature `cli`): its configuration file and the
//! JSON lines of `outbox enqueue --stdin`. They live in the library so that the fuzz targets
//! (fuzz/) and tests reach them; they are the binary's internals, not a stable API.

pub mod config;
pub mod enqueue;
