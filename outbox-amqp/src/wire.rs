//! The names the AMQP sink writes on the wire. A consumer finds the payload in the body
//! (exact bytes); the outbox id in the `message_id` property, the topic in `type`, the
//! created time in `timestamp` (seconds since the epoch), the `app_id` setting in `app_id`,
//! and the message's `content-type` header in `content_type` ([`DEFAULT_CONTENT_TYPE`] when it
//! has none); and in the headers table, as long strings, every outbox header plus [`KEY`]
//! (the partition key, when there is one) and [`TRACEPARENT`] and [`TRACESTATE`] (the W3C
//! trace context, when there is one). Messages are persistent (`delivery_mode` 2).

/// Header that carries the message's partition key.
pub const KEY: &str = "outbox-key";
/// Header that carries the W3C `traceparent`.
pub const TRACEPARENT: &str = "traceparent";
/// Header that carries the W3C `tracestate`.
pub const TRACESTATE: &str = "tracestate";
/// The `content_type` property of a message without a `content-type` header.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";
