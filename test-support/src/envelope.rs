//! The envelope as a consumer in another language reads it: by the names docs/envelope.md
//! documents, written out here rather than taken from `outbox_core::envelope`, so a renamed
//! constant fails the tests instead of silently changing the wire.

use outbox_core::Message;

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
