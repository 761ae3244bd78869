//! The names the sink writes on the wire, for consumers.
//!
//! Each message is one JetStream message on its subject, its payload byte for byte. Its
//! headers are the message's own headers as they are, then the envelope of
//! [`outbox_core::envelope`] (the same names on every broker, docs/envelope.md): [`VERSION`],
//! [`ID`], [`TOPIC`], [`KEY`] (when the message has a key), [`CREATED_AT`], [`CONTENT_TYPE`],
//! [`TRACEPARENT`] and [`TRACESTATE`] (with a trace context). A message header whose name is
//! an envelope name is not sent: the envelope's value wins. Besides, [`MSG_ID`] carries the
//! id for JetStream's de-duplication, the key is repeated under
//! [`NatsConfig::key_header`](crate::NatsConfig::key_header) when that is set, and
//! [`EXPECTED_STREAM`] is there when [`NatsConfig::stream`](crate::NatsConfig::stream) is
//! set. The message's receipt is `stream:sequence` from JetStream's acknowledgement.

pub use outbox_core::envelope::{
    CONTENT_TYPE, CREATED_AT, ID, KEY, TOPIC, TRACEPARENT, TRACESTATE, VERSION,
};

/// JetStream's own header with the message id (the same value as [`ID`]): JetStream drops a
/// message whose id it stored within the stream's duplicate window.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The stream the message must land in, when
/// [`NatsConfig::stream`](crate::NatsConfig::stream) is set: JetStream refuses the message
/// if another stream captures its subject.
pub const EXPECTED_STREAM: &str = "Nats-Expected-Stream";

#[cfg(test)]
mod tests {
    #[test]
    fn jetstream_headers_are_the_clients_own() {
        assert_eq!(
            super::MSG_ID,
            async_nats::header::NATS_MESSAGE_ID.to_string()
        );
        assert_eq!(
            super::EXPECTED_STREAM,
            async_nats::header::NATS_EXPECTED_STREAM.to_string()
        );
    }
}
