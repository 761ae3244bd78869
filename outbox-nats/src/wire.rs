//! The names the sink writes on the wire, for consumers.
//!
//! Each message is one JetStream message on its subject, its payload byte for byte. Its
//! headers are the message's own headers as they are, plus [`ID`] (always), [`KEY`] (the
//! default of `key_header`, when the message has a partition key), [`TRACEPARENT`] and
//! [`TRACESTATE`] (with a trace context), and [`EXPECTED_STREAM`] (when `stream` is set).
//! The message's receipt is `stream:sequence` from JetStream's acknowledgement.

/// The message id, a hyphenated UUID: JetStream drops a message whose id it stored within
/// the stream's duplicate window, and consumers de-duplicate by it.
pub const ID: &str = "Nats-Msg-Id";
/// The partition key, when the message has one: the default of
/// [`NatsConfig::key_header`](crate::NatsConfig::key_header).
pub const KEY: &str = "Outbox-Key";
/// The W3C `traceparent`, when the message has a trace context.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C `tracestate`, when the trace context has one.
pub const TRACESTATE: &str = "tracestate";
/// The stream the message must land in, when
/// [`NatsConfig::stream`](crate::NatsConfig::stream) is set: JetStream refuses the message
/// if another stream captures its subject.
pub const EXPECTED_STREAM: &str = "Nats-Expected-Stream";

#[cfg(test)]
mod tests {
    #[test]
    fn jetstream_headers_are_the_clients_own() {
        assert_eq!(super::ID, async_nats::header::NATS_MESSAGE_ID.to_string());
        assert_eq!(
            super::EXPECTED_STREAM,
            async_nats::header::NATS_EXPECTED_STREAM.to_string()
        );
    }
}
