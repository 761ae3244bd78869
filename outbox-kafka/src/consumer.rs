//! For consumers of the topics this sink produces to: the envelope of a record read with
//! rdkafka, any [`Message`] (a `BorrowedMessage` from a consumer's `recv`/`poll`, or an
//! `OwnedMessage`). The payload is `message.payload()`.
//!
//! ```no_run
//! # async fn run(kafka: outbox_kafka::rdkafka::consumer::StreamConsumer) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use outbox_kafka::consumer;
//! use outbox_kafka::rdkafka::consumer::{CommitMode, Consumer};
//! use outbox_kafka::rdkafka::Message;
//!
//! loop {
//!     let record = kafka.recv().await?;
//!     let received = consumer::received(&record)?;
//!     let payload = record.payload().unwrap_or_default();
//!     // In one database transaction: the inbox records received.id, the handler runs if
//!     // it is new; commit, then commit the offset.
//!     # let _ = (received, payload);
//!     kafka.commit_message(&record, CommitMode::Async)?;
//! }
//! # }
//! ```

use outbox_core::Result;
use outbox_core::envelope::KEY;
use rdkafka::Message;
use rdkafka::message::Headers;

pub use outbox_core::envelope::Received;

/// The envelope of a record: its id to de-duplicate by, topic, key, created time, content
/// type and trace context, from its headers ([`Received::from_headers`]; a header given
/// twice takes its last value, as Kafka's `lastHeader`). The record key, the partition key
/// the sink sets, stands in for a missing `outbox-key` header. A record that is not an
/// outbox message, or a malformed one, is a
/// [`Permanent`](outbox_core::ErrorKind::Permanent) error: commit past it (after copying it
/// to a dead-letter topic, say), do not retry it.
pub fn received(message: &impl Message) -> Result<Received> {
    let mut fields: Vec<(&str, &[u8])> = message
        .headers()
        .into_iter()
        .flat_map(|headers| headers.iter())
        .map(|header| (header.key, header.value.unwrap_or_default()))
        .collect();
    let keyed = fields
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case(KEY));
    if let Some(key) = message.key()
        && !keyed
    {
        fields.push((KEY, key));
    }
    Received::from_headers(fields)
}

#[cfg(test)]
mod tests {
    use outbox_core::envelope::Envelope;
    use outbox_core::{ErrorKind, NewMessage};
    use rdkafka::Timestamp;
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};

    use super::*;

    fn record(key: Option<&str>, headers: OwnedHeaders) -> OwnedMessage {
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            key.map(|k| k.as_bytes().to_vec()),
            "orders".into(),
            Timestamp::CreateTime(0),
            0,
            0,
            Some(headers),
        )
    }

    #[test]
    fn the_headers_give_the_envelope() {
        let sent: outbox_core::Message = NewMessage::new("orders", "{}").key("o-1").into();
        let envelope = Envelope::of(&sent);
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "x-tenant",
            value: Some("acme"),
        });
        for (name, value) in envelope.fields() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let received = received(&record(Some("o-1"), headers)).unwrap();
        assert_eq!(received.id, sent.id);
        assert_eq!(received.topic, "orders");
        assert_eq!(received.key.as_deref(), Some("o-1"));
        assert!(received.created_at.is_some());
    }

    #[test]
    fn the_record_key_stands_in_for_a_missing_key_header() {
        let id = "0194195c-7a00-7c3e-8b5e-3f0d3c8e2a11";
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "outbox-id",
                value: Some(id),
            })
            .insert(Header {
                key: "outbox-topic",
                value: Some("orders"),
            });
        let received = received(&record(Some("o-9"), headers)).unwrap();
        assert_eq!(received.id.to_string(), id);
        assert_eq!(received.key.as_deref(), Some("o-9"));
    }

    #[test]
    fn a_record_of_another_producer_is_refused_for_good() {
        let headers = OwnedHeaders::new().insert(Header {
            key: "outbox-id",
            value: None::<&[u8]>,
        });
        let error = received(&record(None, headers)).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert!(error.message().contains("is not a UUID"), "{error}");
        let error = received(&record(Some("k"), OwnedHeaders::new())).unwrap_err();
        assert_eq!(
            error.message(),
            "not an outbox message: no outbox-id header"
        );
    }
}
