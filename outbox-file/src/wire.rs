//! The names the sinks write, for consumers.
//!
//! Each message is one line of JSON (an object, then `\n`; no line break inside it, since
//! JSON strings escape theirs) with these fields, in this order:
//!
//! | field | value |
//! |---|---|
//! | [`ID`] | the message id, a hyphenated UUID |
//! | [`TOPIC`] | the message's topic |
//! | [`KEY`] | the partition key, or `null` when the message has none |
//! | [`HEADERS`] | the message's headers, an object of strings (`{}` when it has none) |
//! | [`CREATED_AT`] | when the message was made, RFC 3339 in UTC with microseconds |
//! | [`TRACEPARENT`], [`TRACESTATE`] | the W3C trace context; each only when the message has it |
//! | [`PAYLOAD_ENCODING`] | [`UTF8`] or [`BASE64`] |
//! | [`PAYLOAD`] | the payload: its text when the bytes are UTF-8, else their base64 (standard alphabet, padded) |
//!
//! The receipt of a message is where its line starts: the byte offset in the file for the
//! `file` sink, the line's number (from 1) in the sink's output for the `stdout` sink.

/// The message id, a hyphenated UUID: consumers de-duplicate redeliveries by it.
pub const ID: &str = "id";
/// The message's topic.
pub const TOPIC: &str = "topic";
/// The partition key, or `null`.
pub const KEY: &str = "key";
/// The message's headers, an object of string values.
pub const HEADERS: &str = "headers";
/// When the message was made, RFC 3339 (`2025-01-31T12:00:00.123456Z`).
pub const CREATED_AT: &str = "created_at";
/// The W3C `traceparent`, when the message has a trace context.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C `tracestate`, when the trace context has one.
pub const TRACESTATE: &str = "tracestate";
/// The payload, as text ([`UTF8`]) or base64 ([`BASE64`]).
pub const PAYLOAD: &str = "payload";
/// How [`PAYLOAD`] is written: [`UTF8`] or [`BASE64`].
pub const PAYLOAD_ENCODING: &str = "payload_encoding";
/// [`PAYLOAD_ENCODING`] of a payload whose bytes are UTF-8: [`PAYLOAD`] is that text.
pub const UTF8: &str = "utf8";
/// [`PAYLOAD_ENCODING`] of a payload whose bytes are not UTF-8: [`PAYLOAD`] is their base64
/// in the standard alphabet with padding (`base64::engine::general_purpose::STANDARD`).
pub const BASE64: &str = "base64";
