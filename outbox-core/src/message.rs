//! The message model: what an application enqueues and what a sink publishes.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// W3C trace context (<https://www.w3.org/TR/trace-context/>) carried from the enqueuing
/// transaction to the consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    /// The `traceparent` header value.
    pub traceparent: String,
    /// The `tracestate` header value, if any.
    pub tracestate: Option<String>,
}

/// A message to enqueue. Its id (UUID v7) and created time are fixed when it is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    /// Unique id, UUID v7: consumers de-duplicate redeliveries by it.
    pub id: Uuid,
    /// Logical destination; each sink maps it to a stream, exchange/routing key or topic.
    pub topic: String,
    /// The unit of ordering: messages sharing a key are delivered in enqueue order.
    pub key: Option<String>,
    /// The body, as exact bytes.
    pub payload: Vec<u8>,
    /// String headers passed to the broker.
    pub headers: BTreeMap<String, String>,
    /// When the message was made.
    pub created_at: DateTime<Utc>,
    /// Trace context of the enqueuing operation.
    pub trace_context: Option<TraceContext>,
}

impl NewMessage {
    /// A message for `topic` with `payload` bytes, a fresh UUID v7, the current time and
    /// the trace context of the current span, if it has one ([`TraceContext::current`]).
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        NewMessage {
            id: Uuid::now_v7(),
            topic: topic.into(),
            key: None,
            payload: payload.into(),
            headers: BTreeMap::new(),
            created_at: Utc::now(),
            trace_context: TraceContext::current(),
        }
    }

    /// A message whose payload is `value` serialised as JSON, with a
    /// `content-type: application/json` header.
    pub fn json<T: Serialize + ?Sized>(
        topic: impl Into<String>,
        value: &T,
    ) -> serde_json::Result<Self> {
        Ok(Self::new(topic, serde_json::to_vec(value)?).header("content-type", "application/json"))
    }

    /// Sets the partition key (the unit of ordering).
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the W3C trace context.
    pub fn trace_context(mut self, trace_context: TraceContext) -> Self {
        self.trace_context = Some(trace_context);
        self
    }
}

/// A stored message, as claimed from storage and handed to a sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Unique id (UUID v7 when enqueued by this crate).
    pub id: Uuid,
    /// Logical destination.
    pub topic: String,
    /// The unit of ordering.
    pub key: Option<String>,
    /// The body, as exact bytes.
    pub payload: Vec<u8>,
    /// String headers.
    pub headers: BTreeMap<String, String>,
    /// When the message was made.
    pub created_at: DateTime<Utc>,
    /// How many delivery attempts failed before this one.
    pub attempts: u32,
    /// Trace context of the enqueuing operation.
    pub trace_context: Option<TraceContext>,
}

impl Message {
    /// Deserialises the payload as JSON.
    pub fn json<'a, T: Deserialize<'a>>(&'a self) -> serde_json::Result<T> {
        serde_json::from_slice(&self.payload)
    }

    /// The `content-type` header, if set.
    pub fn content_type(&self) -> Option<&str> {
        self.headers.get("content-type").map(String::as_str)
    }
}

impl From<NewMessage> for Message {
    fn from(m: NewMessage) -> Self {
        Message {
            id: m.id,
            topic: m.topic,
            key: m.key,
            payload: m.payload,
            headers: m.headers,
            created_at: m.created_at,
            attempts: 0,
            trace_context: m.trace_context,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_and_v7_ids_increase() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct Order {
            id: u32,
        }
        let a = NewMessage::json("orders", &Order { id: 7 })
            .unwrap()
            .key("o-7");
        let b = NewMessage::new("orders", b"x".to_vec());
        assert_eq!(a.id.get_version_num(), 7);
        assert!(a.id < b.id, "UUID v7 ids sort by creation");
        let m = Message::from(a);
        assert_eq!(m.json::<Order>().unwrap(), Order { id: 7 });
        assert_eq!(m.content_type(), Some("application/json"));
        assert_eq!(m.key.as_deref(), Some("o-7"));
    }
}
