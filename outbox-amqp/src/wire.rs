//! The names the AMQP sink writes on the wire. A consumer finds the payload in the body
//! (exact bytes), and the envelope of [`outbox_core::envelope`] (the same names on every
//! broker, docs/envelope.md) in the headers table, each field a long string: [`VERSION`],
//! [`ID`], [`TOPIC`], [`KEY`] (when the message has a key), [`CREATED_AT`],
//! [`CONTENT_TYPE`], [`TRACEPARENT`] and [`TRACESTATE`] (with a trace context). The message's
//! own headers are in the same table; one whose name is an envelope name is not sent (the
//! envelope's value wins).
//!
//! The native properties are filled as well: `message_id` (the id), `content_type` (the
//! content type, [`DEFAULT_CONTENT_TYPE`] when the message has none), `timestamp` (the created
//! time in whole seconds since the epoch), `type` (the topic), `app_id` (the `app_id`
//! setting), and `delivery_mode` 2 (persistent).

pub use outbox_core::envelope::{
    CONTENT_TYPE, CREATED_AT, DEFAULT_CONTENT_TYPE, ID, KEY, TOPIC, TRACEPARENT, TRACESTATE,
    VERSION,
};
