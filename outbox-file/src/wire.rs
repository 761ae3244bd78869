//! The names the sinks write, for consumers.
//!
//! Each message is one line of JSON (an object, then `\n`; no line break inside it, since
//! JSON strings escape theirs) with these fields, in this order: first the envelope of
//! [`outbox_core::envelope`] (the same names on every broker, docs/envelope.md), then the
//! sinks' own fields.
//!
//! | field | value |
//! |---|---|
//! | [`VERSION`] | the envelope version, `"1"` |
//! | [`ID`] | the message id, a hyphenated UUID |
//! | [`TOPIC`] | the message's topic |
//! | [`KEY`] | the partition key; absent when the message has none |
//! | [`CREATED_AT`] | when the message was made, RFC 3339 in UTC with microseconds |
//! | [`CONTENT_TYPE`] | the `content-type` header, else `application/octet-stream` |
//! | [`TRACEPARENT`], [`TRACESTATE`] | the W3C trace context; each only when the message has it |
//! | [`HEADERS`] | the message's headers, an object of strings (`{}` when it has none), every one of them |
//! | [`PAYLOAD_ENCODING`] | [`UTF8`] or [`BASE64`] |
//! | [`PAYLOAD`] | the payload: its text when the bytes are UTF-8, else their base64 (standard alphabet, padded) |
//!
//! The receipt of a message is where its line starts: the byte offset in the file for the
//! `file` sink, the line's number (from 1) in the sink's output for the `stdout` sink.

pub use outbox_core::envelope::{
    CONTENT_TYPE, CREATED_AT, ID, KEY, TOPIC, TRACEPARENT, TRACESTATE, VERSION,
};

/// The message's headers, an object of string values.
pub const HEADERS: &str = "headers";
/// The payload, as text ([`UTF8`]) or base64 ([`BASE64`]).
pub const PAYLOAD: &str = "payload";
/// How [`PAYLOAD`] is written: [`UTF8`] or [`BASE64`].
pub const PAYLOAD_ENCODING: &str = "payload_encoding";
/// [`PAYLOAD_ENCODING`] of a payload whose bytes are UTF-8: [`PAYLOAD`] is that text.
pub const UTF8: &str = "utf8";
/// [`PAYLOAD_ENCODING`] of a payload whose bytes are not UTF-8: [`PAYLOAD`] is their base64
/// in the standard alphabet with padding (`base64::engine::general_purpose::STANDARD`).
pub const BASE64: &str = "base64";
