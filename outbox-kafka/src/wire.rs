//! The names the Kafka sink writes on the wire. A consumer finds the partition key as the
//! record's key (none when the message has none), the payload as its value (exact bytes),
//! and in its headers every header of the message, then [`ID`] (the outbox id, a UUID, to
//! de-duplicate by), [`TOPIC`] (the outbox topic), [`CREATED_AT`] (RFC 3339, UTC,
//! microseconds) and, with a trace context, [`TRACEPARENT`] and [`TRACESTATE`]; these win over
//! a message header of the same name. The record's timestamp is the producer's send time.

/// Header with the outbox message id (a UUID), for consumers to de-duplicate by.
pub const ID: &str = "outbox-id";
/// Header with the outbox topic the message was enqueued for.
pub const TOPIC: &str = "outbox-topic";
/// Header with the time the message was enqueued (RFC 3339, UTC, microseconds).
pub const CREATED_AT: &str = "outbox-created-at";
/// W3C trace context header, when the message has one.
pub const TRACEPARENT: &str = "traceparent";
/// W3C trace state header, when the message has one.
pub const TRACESTATE: &str = "tracestate";
