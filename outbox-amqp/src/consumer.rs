//! For consumers of the queues this sink's messages are routed to: the envelope of a
//! [`Delivery`] of the lapin client (from `basic_consume`, or `basic_get`'s
//! `message.delivery`). The payload is `delivery.data`.
//!
//! ```no_run
//! # async fn run(mut deliveries: outbox_amqp::lapin::Consumer) -> outbox_core::Result<()> {
//! use futures_util::StreamExt;
//! use outbox_amqp::consumer;
//! use outbox_amqp::lapin::options::BasicAckOptions;
//!
//! while let Some(Ok(delivery)) = deliveries.next().await {
//!     let received = consumer::received(&delivery)?;
//!     // In one database transaction: the inbox records received.id, the handler runs
//!     // (on delivery.data) if it is new; commit, then acknowledge.
//!     # let _ = received;
//!     delivery
//!         .ack(BasicAckOptions::default())
//!         .await
//!         .map_err(|e| outbox_core::Error::unavailable(e.to_string()))?;
//! }
//! # Ok(())
//! # }
//! ```

use lapin::message::Delivery;
use lapin::types::AMQPValue;
use outbox_core::Result;
use outbox_core::envelope::{CONTENT_TYPE, ID, TOPIC};

pub use outbox_core::envelope::Received;

/// The envelope of a delivery: its id to de-duplicate by, topic, key, created time, content
/// type and trace context, from the text values of its `headers` table
/// ([`Received::from_headers`]). The basic properties the sink fills as well stand in for a
/// header that is missing: `message_id` for `outbox-id`, `type` for `outbox-topic`,
/// `content_type` for `content-type`. A delivery that is not an outbox message, or a
/// malformed one, is a [`Permanent`](outbox_core::ErrorKind::Permanent) error: reject it
/// without requeueing (to a dead-letter exchange, if the queue has one), do not retry it.
pub fn received(delivery: &Delivery) -> Result<Received> {
    let properties = &delivery.properties;
    let mut fields: Vec<(&str, &[u8])> = properties
        .headers()
        .iter()
        .flat_map(|table| table.inner())
        .filter_map(|(name, value)| Some((name.as_str(), text(value)?)))
        .collect();
    let native = [
        (ID, properties.message_id()),
        (TOPIC, properties.kind()),
        (CONTENT_TYPE, properties.content_type()),
    ];
    for (name, value) in native {
        let missing = !fields.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
        if let Some(value) = value
            && missing
        {
            fields.push((name, value.as_str().as_bytes()));
        }
    }
    Received::from_headers(fields)
}

/// A header value as bytes: the sink writes long strings; short strings and byte arrays are
/// text too. Other kinds (numbers, tables) are not envelope values.
fn text(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::LongString(text) => Some(text.as_bytes()),
        AMQPValue::ShortString(text) => Some(text.as_str().as_bytes()),
        AMQPValue::ByteArray(bytes) => Some(bytes.as_slice()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use lapin::BasicProperties;
    use lapin::types::{FieldTable, LongString};
    use outbox_core::envelope::Envelope;
    use outbox_core::{ErrorKind, Message, NewMessage};

    use super::*;

    fn delivery(properties: BasicProperties) -> Delivery {
        let mut delivery = Delivery::mock(1, "x".into(), "orders".into(), false, Vec::new());
        delivery.properties = properties;
        delivery
    }

    #[test]
    fn the_headers_table_gives_the_envelope() {
        let message: Message = NewMessage::new("orders", "{}")
            .key("o-1")
            .header("content-type", "application/json")
            .into();
        let mut headers = FieldTable::default();
        for (name, value) in Envelope::of(&message).fields() {
            let value = AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()));
            headers.insert(name.into(), value);
        }
        headers.insert("x-tenant".into(), AMQPValue::LongInt(7));
        let received = received(&delivery(
            BasicProperties::default()
                .with_headers(headers)
                .with_message_id("not read: the header wins".into()),
        ))
        .unwrap();
        assert_eq!(received.id, message.id);
        assert_eq!(received.topic, "orders");
        assert_eq!(received.key.as_deref(), Some("o-1"));
        assert_eq!(received.content_type.as_deref(), Some("application/json"));
        assert!(received.created_at.is_some());
    }

    #[test]
    fn the_properties_stand_in_for_missing_headers() {
        let id = "0194195c-7a00-7c3e-8b5e-3f0d3c8e2a11";
        let mut headers = FieldTable::default();
        headers.insert("outbox-key".into(), AMQPValue::ShortString("k".into()));
        let received = received(&delivery(
            BasicProperties::default()
                .with_headers(headers)
                .with_message_id(id.into())
                .with_type("orders".into())
                .with_content_type("text/plain".into()),
        ))
        .unwrap();
        assert_eq!(received.id.to_string(), id);
        assert_eq!(received.topic, "orders");
        assert_eq!(received.key.as_deref(), Some("k"));
        assert_eq!(received.content_type.as_deref(), Some("text/plain"));
    }

    #[test]
    fn a_delivery_of_another_publisher_is_refused_for_good() {
        let error = received(&delivery(BasicProperties::default())).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert_eq!(
            error.message(),
            "not an outbox message: no outbox-id header"
        );
        let other = BasicProperties::default().with_message_id("order-42".into());
        let error = received(&delivery(other)).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert!(error.message().contains("is not a UUID"), "{error}");
    }
}
