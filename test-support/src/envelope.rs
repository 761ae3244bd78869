//! The envelope as a consumer in another language reads it: by the names docs/envelope.md
//! documents, written out here rather than taken from `outbox_core::envelope`, so a renamed
//! constant fails the tests instead of silently changing the wire.

use outbox_core::{Message, NewMessage, Outcome, Sink, TraceContext};

/// The documented names, in the documented order.
pub const NAMES: [&str; 8] = [
    "outbox-envelope",
    "outbox-id",
    "outbox-topic",
    "outbox-key",
    "outbox-created-at",
    "content-type",
    "traceparent",
    "tracestate",
];

/// Asserts that a message read back from a broker carries the envelope of `sent`: `field`
/// looks a header (or stream field, or JSON field) up by its name as the broker's plain
/// client returns it. Checks every value and its format: the version `1`, the hyphenated id,
/// the topic, the key (absent without one), the created time (RFC 3339, UTC, six fractional
/// digits, equal to the microsecond), the content type (`application/octet-stream` without a
/// `content-type` header) and the trace context (absent without one). `what` names the
/// message in failures.
pub fn assert_envelope(sent: &Message, what: &str, field: impl Fn(&str) -> Option<String>) {
    let id = sent.id;
    let get = |name: &str| field(name);
    assert_eq!(
        get("outbox-envelope").as_deref(),
        Some("1"),
        "outbox-envelope of {what} {id}"
    );
    assert_eq!(
        get("outbox-id"),
        Some(id.hyphenated().to_string()),
        "outbox-id of {what}"
    );
    assert_eq!(
        get("outbox-topic").as_deref(),
        Some(sent.topic.as_str()),
        "outbox-topic of {what} {id}"
    );
    assert_eq!(get("outbox-key"), sent.key, "outbox-key of {what} {id}");

    let created = get("outbox-created-at")
        .unwrap_or_else(|| panic!("outbox-created-at of {what} {id} is missing"));
    let fraction = created
        .strip_suffix('Z')
        .and_then(|t| t.rsplit_once('.'))
        .map(|(_, f)| f.len());
    assert_eq!(
        fraction,
        Some(6),
        "outbox-created-at of {what} {id} is UTC with microseconds: {created}"
    );
    let parsed = chrono::DateTime::parse_from_rfc3339(&created)
        .unwrap_or_else(|e| panic!("outbox-created-at of {what} {id} `{created}`: {e}"));
    assert_eq!(
        parsed.timestamp_micros(),
        sent.created_at.timestamp_micros(),
        "outbox-created-at of {what} {id} to the microsecond: {created}"
    );

    let content_type = sent
        .headers
        .get("content-type")
        .map_or("application/octet-stream", String::as_str);
    assert_eq!(
        get("content-type").as_deref(),
        Some(content_type),
        "content-type of {what} {id}"
    );
    let trace = sent.trace_context.as_ref();
    assert_eq!(
        get("traceparent").as_deref(),
        trace.map(|t| t.traceparent.as_str()),
        "traceparent of {what} {id}"
    );
    assert_eq!(
        get("tracestate").as_deref(),
        trace
            .and_then(|t| t.tracestate.as_deref())
            .filter(|s| !s.is_empty()),
        "tracestate of {what} {id}"
    );
}

/// A message of `topic` with every envelope field: a key, a JSON content type and a trace
/// context with a trace state; with an application header of its own (`x-tenant: acme`) and
/// one named like an envelope field (`outbox-id: forged`), which must not change the
/// envelope.
pub fn full(topic: &str) -> Message {
    NewMessage::new(topic, "{}")
        .key("o-1")
        .header("content-type", "application/json")
        .header("outbox-id", "forged")
        .header("x-tenant", "acme")
        .trace_context(TraceContext {
            traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
            tracestate: Some("rojo=00f067aa0ba902b7".into()),
        })
        .into()
}

/// A message of `topic` with none of the optional envelope fields (no key, no headers, no
/// trace context), a payload that is not UTF-8, created an hour ago (so a timestamp taken
/// from it cannot pass for the send time).
pub fn bare(topic: &str) -> Message {
    let mut bare: Message = NewMessage::new(topic, vec![0xff]).into();
    bare.trace_context = None;
    bare.created_at -= chrono::Duration::hours(1);
    bare
}

/// Publishes [`full`] and [`bare`] of `topic` through `sink` in one call, checks that both
/// were delivered, and returns them as sent, in that order.
pub async fn publish_full_and_bare(sink: &dyn Sink, topic: &str) -> [Message; 2] {
    let sent = [full(topic), bare(topic)];
    let outcomes = sink.publish(&sent).await.expect("publish");
    for (message, outcome) in sent.iter().zip(&outcomes) {
        if let Outcome::Failed(error) = outcome {
            panic!("message {} was not delivered: {error}", message.id);
        }
    }
    assert_eq!(outcomes.len(), 2, "one outcome per message");
    sent
}
