//! The names the sink writes on the wire, for consumers.
//!
//! Each message is one entry of its stream: first the envelope fields of
//! [`outbox_core::envelope`] (the same names on every broker, docs/envelope.md:
//! [`VERSION`], [`ID`], [`TOPIC`], [`KEY`] when the message has a key, [`CREATED_AT`],
//! [`CONTENT_TYPE`], and [`TRACEPARENT`]/[`TRACESTATE`] with a trace context), then
//! [`PAYLOAD`], then one field per header of the message, named [`HEADER_PREFIX`] followed by
//! the header's name. The entry id Redis gives the entry is the message's receipt.

pub use outbox_core::envelope::{
    CONTENT_TYPE, CREATED_AT, ID, KEY, TOPIC, TRACEPARENT, TRACESTATE, VERSION,
};

/// The payload, byte for byte (may be empty, need not be UTF-8).
pub const PAYLOAD: &str = "payload";
/// Prefix of header fields: header `x-tenant` is field `header:x-tenant`. Every header is
/// there, also one whose name is an envelope name (fields and headers do not collide).
pub const HEADER_PREFIX: &str = "header:";
