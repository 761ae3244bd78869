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
//!
//! The reading side is [`Received::from_headers`]: a consumer gives it the names and values
//! its broker's client returns and gets the id to de-duplicate by, the topic, the key, the
//! created time and the trace context back (each sink crate's `consumer` module does this
//! for its broker's usual client).

use std::borrow::Cow;

use chrono::{DateTime, SecondsFormat, Utc};
use uuid::Uuid;

use crate::{Error, Message, Result, TraceContext};

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

/// A message's envelope as a consumer reads it back from a delivery: what identifies the
/// message whatever the broker. The payload and the message's own headers are where the
/// broker's client gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// [`ID`]: the same on every delivery of the message; de-duplicate by it (an inbox).
    pub id: Uuid,
    /// [`TOPIC`]: the message's outbox topic.
    pub topic: String,
    /// [`KEY`], when the message has a partition key.
    pub key: Option<String>,
    /// [`CREATED_AT`], to the microsecond, when the delivery carries it.
    pub created_at: Option<DateTime<Utc>>,
    /// [`CONTENT_TYPE`], when the delivery carries it.
    pub content_type: Option<String>,
    /// [`TRACEPARENT`] and [`TRACESTATE`], when the message has a trace context: the parent
    /// of the consumer's span.
    pub trace: Option<TraceContext>,
}

impl Received {
    /// Reads the envelope from a delivery's headers (or stream fields) as (name, value)
    /// pairs, in any order; other names are ignored. Names match ignoring ASCII case (some
    /// clients change it); a name given twice takes its last value, as Kafka's
    /// `lastHeader` does.
    ///
    /// Every error is [`Permanent`](crate::ErrorKind::Permanent): redelivering the message
    /// will not change it, so dead-letter or skip it rather than retry. A delivery without
    /// [`ID`] is not an outbox message ("not an outbox message: no outbox-id header"), nor
    /// is one whose [`ID`] is not a UUID. An outbox message is refused when its
    /// [`VERSION`] is not [`VERSION_VALUE`] (a newer envelope: upgrade the consumer), when
    /// it has no [`TOPIC`], when a value is not UTF-8, or when [`CREATED_AT`] is not an
    /// RFC 3339 time.
    pub fn from_headers<'a>(
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Result<Received> {
        let mut found: [Option<&[u8]>; NAMES.len()] = [None; NAMES.len()];
        for (name, value) in headers {
            if let Some(at) = NAMES.iter().position(|n| n.eq_ignore_ascii_case(name)) {
                found[at] = Some(value);
            }
        }
        let field = |name: &str| {
            NAMES
                .iter()
                .position(|n| *n == name)
                .and_then(|at| found[at])
        };

        let Some(raw_id) = field(ID) else {
            return Err(Error::permanent(
                "not an outbox message: no outbox-id header",
            ));
        };
        let id = std::str::from_utf8(raw_id)
            .ok()
            .and_then(|text| Uuid::parse_str(text).ok())
            .ok_or_else(|| {
                Error::permanent(format!(
                    "not an outbox message: its outbox-id `{}` is not a UUID",
                    shown(raw_id)
                ))
            })?;
        let text = |name: &str| -> Result<Option<&str>> {
            field(name)
                .map(|value| {
                    std::str::from_utf8(value).map_err(|_| {
                        Error::permanent(format!(
                            "outbox message {id}: its {name} `{}` is not UTF-8",
                            shown(value)
                        ))
                    })
                })
                .transpose()
        };

        if let Some(version) = text(VERSION)?
            && version != VERSION_VALUE
        {
            return Err(Error::permanent(format!(
                "outbox message {id}: envelope version `{}` is not known (this consumer \
                 reads version {VERSION_VALUE}); upgrade the consumer",
                shown(version.as_bytes())
            )));
        }
        let topic = text(TOPIC)?
            .ok_or_else(|| Error::permanent(format!("outbox message {id}: no {TOPIC} header")))?;
        let created_at = text(CREATED_AT)?
            .map(|value| {
                DateTime::parse_from_rfc3339(value)
                    .map(|t| t.with_timezone(&Utc))
                    .map_err(|e| {
                        Error::permanent(format!(
                            "outbox message {id}: its {CREATED_AT} `{}` is not an RFC 3339 \
                             time ({e})",
                            shown(value.as_bytes())
                        ))
                    })
            })
            .transpose()?;
        let trace = match text(TRACEPARENT)?.filter(|p| !p.is_empty()) {
            Some(parent) => Some(TraceContext {
                traceparent: parent.to_string(),
                tracestate: text(TRACESTATE)?
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
            }),
            None => None,
        };
        Ok(Received {
            id,
            topic: topic.to_string(),
            key: text(KEY)?.map(str::to_string),
            created_at,
            content_type: text(CONTENT_TYPE)?.map(str::to_string),
            trace,
        })
    }
}

/// A value for an error message: its first 64 bytes, lossily as text.
fn shown(value: &[u8]) -> String {
    let cut = &value[..value.len().min(64)];
    let text = String::from_utf8_lossy(cut);
    if cut.len() < value.len() {
        format!("{text}…")
    } else {
        text.into_owned()
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::{NewMessage, TraceContext};

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// A message with every field set: key, an application header (`x-tenant`), a trace
    /// context with a state, and a creation time with nanoseconds.
    fn full_message() -> Message {
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
        message
    }

    fn names(envelope: &Envelope<'_>) -> Vec<&'static str> {
        envelope.fields().into_iter().map(|(n, _)| n).collect()
    }

    #[test]
    fn a_full_message_renders_every_field_in_order() {
        let message = full_message();
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

    /// The envelope of `message` as (name, bytes) pairs, as a broker hands them back.
    fn wire(message: &Message) -> Vec<(String, Vec<u8>)> {
        Envelope::of(message)
            .fields()
            .into_iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    fn read(fields: &[(String, Vec<u8>)]) -> Result<Received> {
        Received::from_headers(fields.iter().map(|(n, v)| (n.as_str(), v.as_slice())))
    }

    fn read_pairs(pairs: &[(&str, &str)]) -> Result<Received> {
        Received::from_headers(pairs.iter().map(|(n, v)| (*n, v.as_bytes())))
    }

    #[test]
    fn every_field_written_is_read_back() {
        let message = full_message();
        let mut fields = wire(&message);
        // Other headers and fields around the envelope are ignored.
        fields.insert(0, ("x-tenant".into(), b"acme".to_vec()));
        fields.push(("payload".into(), vec![0xff, 0x00]));
        let received = read(&fields).unwrap();
        assert_eq!(
            received,
            Received {
                id: message.id,
                topic: "orders".into(),
                key: Some("o-1".into()),
                created_at: Utc.timestamp_opt(1_738_324_800, 123_456_000).single(),
                content_type: Some("application/json".into()),
                trace: message.trace_context.clone(),
            }
        );
    }

    #[test]
    fn a_bare_message_reads_without_its_optional_fields() {
        let message: Message = NewMessage::new("t", Vec::new()).into();
        let received = read(&wire(&message)).unwrap();
        assert_eq!(received.id, message.id);
        assert_eq!(received.topic, "t");
        assert_eq!(received.key, None);
        assert_eq!(received.trace, None);
        assert_eq!(received.content_type.as_deref(), Some(DEFAULT_CONTENT_TYPE));
        let created = received.created_at.unwrap();
        assert_eq!(
            created.timestamp_micros(),
            message.created_at.timestamp_micros()
        );
    }

    #[test]
    fn names_match_ignoring_case_and_the_last_value_wins() {
        let id = Uuid::now_v7();
        let received = read_pairs(&[
            ("Outbox-Id", "0194195c-7a00-7c3e-8b5e-3f0d3c8e2a11"),
            ("OUTBOX-ID", &id.to_string()),
            ("Outbox-Topic", "orders"),
            ("Outbox-Key", "k"),
            ("Content-Type", "text/plain"),
            ("TraceParent", PARENT),
            ("tracestate", ""),
        ])
        .unwrap();
        assert_eq!(received.id, id);
        assert_eq!(received.key.as_deref(), Some("k"));
        assert_eq!(received.content_type.as_deref(), Some("text/plain"));
        assert_eq!(received.created_at, None);
        let trace = received.trace.unwrap();
        assert_eq!(
            (trace.traceparent.as_str(), trace.tracestate),
            (PARENT, None)
        );
    }

    #[test]
    fn a_delivery_without_a_valid_id_is_not_an_outbox_message() {
        let missing = read_pairs(&[("outbox-topic", "t"), ("outbox-idx", "1")]).unwrap_err();
        assert_eq!(missing.kind(), crate::ErrorKind::Permanent);
        assert_eq!(
            missing.message(),
            "not an outbox message: no outbox-id header"
        );
        assert!(!missing.is_retryable());
        for bad in ["", "42", "forged"] {
            let error = read_pairs(&[("outbox-id", bad), ("outbox-topic", "t")]).unwrap_err();
            assert_eq!(error.kind(), crate::ErrorKind::Permanent, "{error}");
            assert_eq!(
                error.message(),
                format!("not an outbox message: its outbox-id `{bad}` is not a UUID")
            );
        }
        let bytes = [0xffu8; 100];
        let error = Received::from_headers([("outbox-id", &bytes[..])]).unwrap_err();
        assert_eq!(error.kind(), crate::ErrorKind::Permanent);
        assert!(error.message().ends_with("…` is not a UUID"), "{error}");
    }

    #[test]
    fn a_malformed_outbox_message_is_refused_for_good() {
        let id = "0194195c-7a00-7c3e-8b5e-3f0d3c8e2a11";
        let refused = |pairs: &[(&str, &str)]| {
            let mut all = vec![("outbox-id", id), ("outbox-topic", "t")];
            all.extend_from_slice(pairs);
            let error = read_pairs(&all).unwrap_err();
            assert_eq!(error.kind(), crate::ErrorKind::Permanent, "{error}");
            assert!(
                error
                    .message()
                    .starts_with(&format!("outbox message {id}: ")),
                "{error}"
            );
            error.message().to_string()
        };
        let created = refused(&[("outbox-created-at", "yesterday")]);
        assert!(
            created.contains("outbox-created-at `yesterday` is not an RFC 3339 time"),
            "{created}"
        );
        let version = refused(&[("outbox-envelope", "2")]);
        assert!(
            version.contains("envelope version `2` is not known"),
            "{version}"
        );
        let error = read_pairs(&[("outbox-id", id)]).unwrap_err();
        assert!(
            error.message().ends_with("no outbox-topic header"),
            "{error}"
        );
        let error = Received::from_headers([
            ("outbox-id", id.as_bytes()),
            ("outbox-topic", &[0xc3, 0x28][..]),
        ])
        .unwrap_err();
        assert!(error.message().contains("outbox-topic"), "{error}");
        assert!(error.message().ends_with("is not UTF-8"), "{error}");
    }

    /// Every error quotes at most 64 bytes of a value; the version and the created time
    /// were quoted whole (found by the fuzz target, fuzz/corpus/envelope/err-found-*-long.txt).
    #[test]
    fn errors_quote_at_most_64_bytes_of_a_value() {
        let id = "0194195c-7a00-7c3e-8b5e-3f0d3c8e2a11";
        let long = format!("2025-01-31T12:00:00Z{}", "x".repeat(1000));
        let version = "9".repeat(1000);
        for (name, value) in [("outbox-created-at", &long), ("outbox-envelope", &version)] {
            let error =
                read_pairs(&[("outbox-id", id), ("outbox-topic", "t"), (name, value)]).unwrap_err();
            assert_eq!(error.kind(), crate::ErrorKind::Permanent);
            assert!(
                error.message().contains(&format!("`{}…`", &value[..64])),
                "{error}"
            );
            assert!(error.message().len() < 250, "{error}");
        }
    }

    #[test]
    fn the_id_alone_is_enough_besides_the_topic() {
        let id = "0194195c-7a00-7c3e-8b5e-3f0d3c8e2a11";
        let received = read_pairs(&[("outbox-id", id), ("outbox-topic", "t")]).unwrap();
        assert_eq!(received.id.to_string(), id);
        assert_eq!(
            (
                received.key,
                received.created_at,
                received.content_type,
                received.trace
            ),
            (None, None, None, None)
        );
        // A tracestate without a traceparent is no trace context.
        let received = read_pairs(&[
            ("outbox-id", id),
            ("outbox-topic", "t"),
            ("tracestate", "a=b"),
        ]);
        assert_eq!(received.unwrap().trace, None);
    }
}
