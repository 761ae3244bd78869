//! For consumers of the streams this sink publishes to: the envelope of a message of the
//! async-nats client, a JetStream [`jetstream::Message`](async_nats::jetstream::Message)
//! (it dereferences to the [`Message`] read here) or a core one. The payload is
//! `message.payload`.
//!
//! ```no_run
//! # async fn run(pull: outbox_nats::async_nats::jetstream::consumer::PullConsumer) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use futures_util::StreamExt;
//! use outbox_nats::consumer;
//!
//! let mut messages = pull.messages().await?;
//! while let Some(message) = messages.next().await {
//!     let message = message?;
//!     let received = consumer::received(&message)?;
//!     // In one database transaction: the inbox records received.id, the handler runs
//!     // (on message.payload) if it is new; commit, then acknowledge.
//!     # let _ = received;
//!     message.ack().await?;
//! }
//! # Ok(())
//! # }
//! ```

use async_nats::Message;
use outbox_core::Result;

pub use outbox_core::envelope::Received;

/// The envelope of a message: its id to de-duplicate by, topic, key, created time, content
/// type and trace context, from its headers ([`Received::from_headers`]). A message that
/// is not an outbox message, or a malformed one, is a
/// [`Permanent`](outbox_core::ErrorKind::Permanent) error: terminate it (`AckKind::Term`)
/// rather than let JetStream redeliver it.
pub fn received(message: &Message) -> Result<Received> {
    Received::from_headers(message.headers.iter().flat_map(|headers| {
        headers.iter().flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| (name.as_ref(), value.as_ref()))
        })
    }))
}

#[cfg(test)]
mod tests {
    use async_nats::HeaderMap;
    use outbox_core::envelope::Envelope;
    use outbox_core::{ErrorKind, NewMessage};

    use super::*;

    fn message(headers: Option<HeaderMap>) -> Message {
        Message {
            subject: "outbox.orders".into(),
            reply: None,
            payload: bytes::Bytes::from_static(b"{}"),
            headers,
            status: None,
            description: None,
            length: 0,
        }
    }

    #[test]
    fn the_headers_give_the_envelope() {
        let sent: outbox_core::Message = NewMessage::new("orders", "{}").key("o-1").into();
        let mut headers = HeaderMap::new();
        headers.insert("x-tenant", "acme");
        for (name, value) in Envelope::of(&sent).fields() {
            headers.insert(name, value.as_ref());
        }
        let received = received(&message(Some(headers))).unwrap();
        assert_eq!(received.id, sent.id);
        assert_eq!(received.topic, "orders");
        assert_eq!(received.key.as_deref(), Some("o-1"));
        let created = received.created_at.unwrap();
        assert_eq!(
            created.timestamp_micros(),
            sent.created_at.timestamp_micros()
        );
    }

    #[test]
    fn a_message_of_another_publisher_is_refused_for_good() {
        for headers in [None, Some(HeaderMap::new())] {
            let error = received(&message(headers)).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::Permanent);
            assert_eq!(
                error.message(),
                "not an outbox message: no outbox-id header"
            );
        }
    }
}
