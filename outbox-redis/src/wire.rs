//! The names the sink writes on the wire, for consumers.
//!
//! Each message is one entry of its stream. Every entry holds the fields [`ID`], [`TOPIC`],
//! [`PAYLOAD`] and [`CREATED_AT`]; [`KEY`], [`CONTENT_TYPE`], [`TRACEPARENT`] and
//! [`TRACESTATE`] only when the message has them; and one field per header of the message,
//! named [`HEADER_PREFIX`] followed by the header's name. The entry id Redis gives the entry
//! is the message's receipt.

/// The message id, a UUID in its hyphenated form; de-duplicate redeliveries by it.
pub const ID: &str = "id";
/// The message's topic.
pub const TOPIC: &str = "topic";
/// The partition key (the unit of ordering); absent when the message has none.
pub const KEY: &str = "key";
/// The payload, byte for byte.
pub const PAYLOAD: &str = "payload";
/// The `content-type` header, repeated here for convenience; absent when not set.
pub const CONTENT_TYPE: &str = "content_type";
/// When the message was made: RFC 3339, UTC, microseconds (`2025-01-31T12:00:00.123456Z`).
pub const CREATED_AT: &str = "created_at";
/// The W3C `traceparent`; absent without a trace context.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C `tracestate`; absent when empty.
pub const TRACESTATE: &str = "tracestate";
/// Prefix of header fields: header `x-tenant` is field `header:x-tenant`.
pub const HEADER_PREFIX: &str = "header:";
