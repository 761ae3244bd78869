//! For consumers of the streams this sink writes: the envelope of an entry read with the
//! redis client (`XREADGROUP`, `XAUTOCLAIM`, `XRANGE` into [`StreamId`]), and its payload.
//!
//! ```no_run
//! # async fn run(mut con: outbox_redis::redis::aio::MultiplexedConnection) -> outbox_core::Result<()> {
//! use outbox_redis::consumer;
//! use outbox_redis::redis::AsyncCommands;
//! use outbox_redis::redis::streams::{StreamReadOptions, StreamReadReply};
//!
//! let options = StreamReadOptions::default().group("billing", "billing-1").count(100);
//! let reply: Option<StreamReadReply> = con
//!     .xread_options(&["orders"], &[">"], &options)
//!     .await
//!     .map_err(|e| outbox_core::Error::unavailable(e.to_string()))?;
//! for entry in reply.iter().flat_map(|r| &r.keys).flat_map(|k| &k.ids) {
//!     let received = consumer::received(entry)?;
//!     let payload = consumer::payload(entry).unwrap_or_default();
//!     // In one database transaction: the inbox records received.id, the handler runs if
//!     // it is new; commit, then XACK the entry.
//! #   let _ = (received, payload);
//! }
//! # Ok(())
//! # }
//! ```

use outbox_core::Result;

use crate::redis::Value;
use crate::redis::streams::StreamId;
use crate::wire;

pub use outbox_core::envelope::Received;

/// The envelope of a stream entry: its id to de-duplicate by, topic, key, created time,
/// content type and trace context, from the entry's fields
/// ([`Received::from_headers`]; `header:` fields are the message's own headers and are not
/// read). An entry that is not an outbox message, or a malformed one, is a
/// [`Permanent`](outbox_core::ErrorKind::Permanent) error: acknowledge it (or move it
/// aside), do not retry it.
pub fn received(entry: &StreamId) -> Result<Received> {
    Received::from_headers(
        entry
            .map
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), bytes(value)?))),
    )
}

/// The message's payload, byte for byte: the entry's [`wire::PAYLOAD`] field (`None` when
/// the entry has none).
pub fn payload(entry: &StreamId) -> Option<&[u8]> {
    entry.map.get(wire::PAYLOAD).and_then(bytes)
}

/// A field's value as bytes: Redis returns field values as bulk strings (RESP3 may give
/// simple or verbatim strings); anything else is not a value the sink writes.
fn bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(text) => Some(text.as_bytes()),
        Value::VerbatimString { text, .. } => Some(text.as_bytes()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use outbox_core::envelope::Envelope;
    use outbox_core::{ErrorKind, Message, NewMessage};

    use super::*;

    /// The entry the sink writes for `message`, as the client parses it.
    fn entry(message: &Message) -> StreamId {
        let mut map: HashMap<String, Value> = Envelope::of(message)
            .fields()
            .into_iter()
            .map(|(n, v)| (n.to_string(), Value::BulkString(v.as_bytes().to_vec())))
            .collect();
        map.insert(
            wire::PAYLOAD.into(),
            Value::BulkString(message.payload.clone()),
        );
        for (name, value) in &message.headers {
            let field = format!("{}{name}", wire::HEADER_PREFIX);
            map.insert(field, Value::BulkString(value.as_bytes().to_vec()));
        }
        StreamId {
            id: "1-0".into(),
            map,
            ..StreamId::default()
        }
    }

    #[test]
    fn an_entry_gives_its_envelope_and_payload() {
        let message: Message = NewMessage::new("orders", vec![0xff, 0])
            .key("o-1")
            .header("outbox-id", "forged")
            .into();
        let entry = entry(&message);
        let received = received(&entry).unwrap();
        assert_eq!(
            received.id, message.id,
            "the header:outbox-id field is not read"
        );
        assert_eq!(received.topic, "orders");
        assert_eq!(received.key.as_deref(), Some("o-1"));
        assert_eq!(payload(&entry), Some(&[0xff, 0][..]));
    }

    #[test]
    fn an_entry_of_another_writer_is_refused_for_good() {
        let entry = StreamId {
            id: "1-0".into(),
            map: HashMap::from([("id".to_string(), Value::BulkString(b"7".to_vec()))]),
            ..StreamId::default()
        };
        let error = received(&entry).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert_eq!(
            error.message(),
            "not an outbox message: no outbox-id header"
        );
        assert_eq!(payload(&entry), None);
    }
}
