//! The names the Kafka sink writes on the wire. A consumer finds the partition key as the
//! record's key (none when the message has none), the payload as its value (exact bytes),
//! the created time as its timestamp (`CreateTime`, in milliseconds), and in its headers
//! the message's own headers, then the envelope of [`outbox_core::envelope`] (the same names
//! on every broker, docs/envelope.md): [`VERSION`], [`ID`], [`TOPIC`], [`KEY`] (when the
//! message has a key), [`CREATED_AT`], [`CONTENT_TYPE`], [`TRACEPARENT`] and [`TRACESTATE`]
//! (with a trace context). A message header whose name is an envelope name is not sent: the
//! envelope's value wins.

pub use outbox_core::envelope::{
    CONTENT_TYPE, CREATED_AT, ID, KEY, TOPIC, TRACEPARENT, TRACESTATE, VERSION,
};
