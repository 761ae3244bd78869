//! The envelope: the names and value formats every sink uses for a message's identity, so a
//! consumer reads the same names whatever the broker (docs/envelope.md has the table).
//!
//! Every name is lower case ASCII letters and `-`, valid as a header name on AMQP, Kafka and
//! NATS, as a Redis stream field and as a JSON key. Each sink writes [`Envelope::fields`] under
//! these names (and fills the broker's native fields as well); its `wire` module names only
//! what is its own.
//!
//! On brokers where application headers and the envelope share one namespace (AMQP headers,
//! Kafka headers, NATS headers), an application header whose name is an envelope name
//! (compared ignoring ASCII case) is not sent: the envelope's value wins
//! ([`application_headers`]). An application `content-type`, `traceparent` or `tracestate`
//! header is the source of that envelope field when the message has no value of its own, so
//! its value still arrives.

use std::borrow::Cow;

use chrono::{DateTime, SecondsFormat, Utc};

use crate::Message;

/// The envelope version: [`VERSION_VALUE`] today. Fields may be added within a version
/// (consumers ignore names they do not know); renaming or removing a field, or changing a
/// value's format, makes a new version.
pub const VERSION: &str = "outbox-envelope";
/// The value of [`VERSION`] that this crate writes.
pub const VERSION_VALUE: &str = "1";
/// The message id, a hyphenated lower-case UUID (v7 when enqueued by this crate): the same
/// on every redelivery, so consumers de-duplicate by it.
pub const ID: &str = "outbox-id";
/// The message's outbox topic (not the stream, exchange, topic or subject it went to).
pub const TOPIC: &str = "outbox-topic";
/// The partition key; absent when the message has none.
pub const KEY: &str = "outbox-key";
/// When the message was made: RFC 3339 in UTC with microseconds,
/// `2025-01-31T12:00:00.123456Z` ([`format_created_at`]).
pub const CREATED_AT: &str = "outbox-created-at";
/// The media type of the payload: the message's `content-type` header, else
/// [`DEFAULT_CONTENT_TYPE`]. Always present.
pub const CONTENT_TYPE: &str = "content-type";
/// The W3C `traceparent`; absent without a trace context.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C `tracestate`; absent when empty or without a `traceparent`.
pub const TRACESTATE: &str = "tracestate";
/// [`CONTENT_TYPE`] of a message that has no `content-type` header.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

/// Every envelope name, in the order [`Envelope::fields`] gives them.
pub const NAMES: [&str; 8] = [
    VERSION,
    ID,
    TOPIC,
    KEY,
    CREATED_AT,
    CONTENT_TYPE,
    TRACEPARENT,
    TRACESTATE,
];

/// Whether `name` is an envelope name, ignoring ASCII case (so `Content-Type` is one).
pub fn is_envelope_name(name: &str) -> bool {
    NAMES.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// `created_at` as the envelope writes it: RFC 3339, UTC, microseconds, `Z`.
pub fn format_created_at(created_at: &DateTime<Utc>) -> String {
    created_at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The message's headers that do not collide with an envelope name, in name order: what a
/// sink whose application headers share the envelope's namespace sends besides it.
pub fn application_headers(message: &Message) -> impl Iterator<Item = (&str, &str)> {
    message
        .headers
        .iter()
        .filter(|(name, _)| !is_envelope_name(name))
        .map(|(name, value)| (name.as_str(), value.as_str()))
}

/// The header `name` of `message`: exactly, else ignoring ASCII case.
fn header<'a>(message: &'a Message, name: &str) -> Option<&'a str> {
    message
        .headers
        .get(name)
        .or_else(|| {
            message
                .headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        })
        .map(String::as_str)
}

/// The envelope values of one message, rendered as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<'a> {
    /// [`ID`]: the hyphenated UUID.
    pub id: String,
    /// [`TOPIC`].
    pub topic: &'a str,
    /// [`KEY`], when the message has a partition key.
    pub key: Option<&'a str>,
    /// [`CREATED_AT`], formatted by [`format_created_at`].
    pub created_at: String,
    /// [`CONTENT_TYPE`].
    pub content_type: &'a str,
    /// [`TRACEPARENT`], when the message has a trace context.
    pub traceparent: Option<&'a str>,
    /// [`TRACESTATE`], when the trace context has a non-empty one.
    pub tracestate: Option<&'a str>,
}

impl<'a> Envelope<'a> {
    /// The envelope of `message`. The trace context comes from
    /// [`Message::trace_context`], else from `traceparent`/`tracestate` headers set by hand.
    pub fn of(message: &'a Message) -> Self {
        let (traceparent, tracestate) = match &message.trace_context {
            Some(trace) => (
                Some(trace.traceparent.as_str()),
                trace.tracestate.as_deref(),
            ),
            None => match header(message, TRACEPARENT) {
                Some(parent) => (Some(parent), header(message, TRACESTATE)),
                None => (None, None),
            },
        };
        Envelope {
            id: message.id.to_string(),
            topic: &message.topic,
            key: message.key.as_deref(),
            created_at: format_created_at(&message.created_at),
            content_type: header(message, CONTENT_TYPE).unwrap_or(DEFAULT_CONTENT_TYPE),
            traceparent: traceparent.filter(|s| !s.is_empty()),
            tracestate: traceparent.and(tracestate).filter(|s| !s.is_empty()),
        }
    }

    /// Every field present, as (name, value), in the order of [`NAMES`]; absent ones (no
    /// key, no trace context) are left out.
    pub fn fields(&self) -> Vec<(&'static str, Cow<'_, str>)> {
        let mut fields: Vec<(&'static str, Cow<'_, str>)> = Vec::with_capacity(NAMES.len());
        fields.push((VERSION, VERSION_VALUE.into()));
        fields.push((ID, self.id.as_str().into()));
        fields.push((TOPIC, self.topic.into()));
        if let Some(key) = self.key {
            fields.push((KEY, key.into()));
        }
        fields.push((CREATED_AT, self.created_at.as_str().into()));
        fields.push((CONTENT_TYPE, self.content_type.into()));
        if let Some(parent) = self.traceparent {
            fields.push((TRACEPARENT, parent.into()));
        }
        if let Some(state) = self.tracestate {
            fields.push((TRACESTATE, state.into()));
        }
        fields
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::{NewMessage, TraceContext};

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn names(envelope: &Envelope<'_>) -> Vec<&'static str> {
        envelope.fields().into_iter().map(|(n, _)| n).collect()
    }

    #[test]
    fn a_full_message_renders_every_field_in_order() {
        let mut message: Message = NewMessage::json("orders", &[1])
            .unwrap()
            .key("o-1")
            .header("x-tenant", "acme")
            .trace_context(TraceContext {
                traceparent: PARENT.into(),
                tracestate: Some("rojo=1".into()),
            })
            .into();
        message.created_at = Utc
            .timestamp_opt(1_738_324_800, 123_456_789)
            .single()
            .unwrap();
        let envelope = Envelope::of(&message);
        let fields: Vec<(&str, String)> = envelope
            .fields()
            .into_iter()
            .map(|(n, v)| (n, v.into_owned()))
            .collect();
        let expected: Vec<(&str, String)> = vec![
            ("outbox-envelope", "1".into()),
            ("outbox-id", message.id.to_string()),
            ("outbox-topic", "orders".into()),
            ("outbox-key", "o-1".into()),
            // Nanoseconds are cut to microseconds, never rounded up.
            ("outbox-created-at", "2025-01-31T12:00:00.123456Z".into()),
            ("content-type", "application/json".into()),
            ("traceparent", PARENT.into()),
            ("tracestate", "rojo=1".into()),
        ];
        assert_eq!(fields, expected);
        assert_eq!(names(&envelope), NAMES);
    }

    #[test]
    fn a_bare_message_has_the_fields_that_are_always_there() {
        let mut message: Message = NewMessage::new("t", Vec::new()).into();
        message.created_at = Utc.timestamp_opt(0, 0).single().unwrap();
        let envelope = Envelope::of(&message);
        assert_eq!(
            names(&envelope),
            [VERSION, ID, TOPIC, CREATED_AT, CONTENT_TYPE]
        );
        assert_eq!(envelope.content_type, DEFAULT_CONTENT_TYPE);
        assert_eq!(envelope.created_at, "1970-01-01T00:00:00.000000Z");
        let parsed = DateTime::parse_from_rfc3339(&envelope.created_at).unwrap();
        assert_eq!(parsed, message.created_at);
    }

    #[test]
    fn an_empty_tracestate_is_left_out() {
        let message: Message = NewMessage::new("t", "x")
            .trace_context(TraceContext {
                traceparent: PARENT.into(),
                tracestate: Some(String::new()),
            })
            .into();
        let envelope = Envelope::of(&message);
        assert_eq!(envelope.traceparent, Some(PARENT));
        assert_eq!(envelope.tracestate, None);
    }

    #[test]
    fn hand_set_headers_feed_the_envelope_and_colliding_ones_are_not_sent_twice() {
        let message: Message = NewMessage::new("t", "x")
            .header("Content-Type", "text/plain")
            .header("traceparent", PARENT)
            .header("tracestate", "a=b")
            .header("outbox-id", "forged")
            .header("OUTBOX-KEY", "forged")
            .header("x-tenant", "acme")
            .into();
        let envelope = Envelope::of(&message);
        assert_eq!(envelope.content_type, "text/plain");
        assert_eq!(envelope.traceparent, Some(PARENT));
        assert_eq!(envelope.tracestate, Some("a=b"));
        assert_eq!(envelope.id, message.id.to_string(), "the envelope wins");
        assert_eq!(envelope.key, None);
        let own: Vec<(&str, &str)> = application_headers(&message).collect();
        assert_eq!(own, [("x-tenant", "acme")]);
    }

    #[test]
    fn a_trace_context_wins_over_hand_set_headers() {
        let message: Message = NewMessage::new("t", "x")
            .header("traceparent", "00-hand")
            .header("tracestate", "hand=1")
            .trace_context(TraceContext {
                traceparent: PARENT.into(),
                tracestate: None,
            })
            .into();
        let envelope = Envelope::of(&message);
        assert_eq!(envelope.traceparent, Some(PARENT));
        assert_eq!(envelope.tracestate, None, "no state mixed in from a header");
    }

    #[test]
    fn names_are_valid_on_every_broker() {
        for name in NAMES {
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'),
                "{name}"
            );
            assert!(!name.starts_with("nats-") && name.len() < 256, "{name}");
            assert!(is_envelope_name(&name.to_ascii_uppercase()));
        }
        assert!(!is_envelope_name("x-tenant"));
    }
}
