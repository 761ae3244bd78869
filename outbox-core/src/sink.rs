//! The sink trait: where a relay publishes messages.

use async_trait::async_trait;

use crate::{Error, Message, Result};

/// What the broker returned for a delivered message (a stream entry id, a partition and
/// offset, ...), kept with the message when delivered rows are retained.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Receipt(pub String);

impl Receipt {
    /// A receipt with this text.
    pub fn new(text: impl Into<String>) -> Self {
        Receipt(text.into())
    }
}

impl std::fmt::Display for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The result of publishing one message.
#[derive(Debug)]
pub enum Outcome {
    /// The broker took the message.
    Delivered(Receipt),
    /// The message was not delivered; the error's kind decides what happens to it:
    /// [`Unavailable`](crate::ErrorKind::Unavailable) releases it without charging an attempt,
    /// [`Temporary`](crate::ErrorKind::Temporary) charges an attempt and retries it later,
    /// [`Permanent`](crate::ErrorKind::Permanent) dead-letters it.
    Failed(Error),
}

/// What a sink guarantees, declared as data so the conformance suite runs what applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SinkCapabilities {
    /// Messages of one key published in one call land in the order given.
    pub keeps_order: bool,
    /// A message published twice (same id) is stored once.
    pub deduplicates: bool,
    /// Largest payload in bytes the sink accepts, if it knows.
    pub max_payload: Option<usize>,
    /// Several messages of one key may share a `publish` call: they land in the order given,
    /// and once one of them fails none of the key's later messages in the call lands (they
    /// are reported failed, and the worker puts them back uncharged). With per-key order,
    /// the worker then publishes a whole batch in one call instead of one round per message
    /// of a key. Off by default: a sink that pipelines (a later command lands after an
    /// earlier one failed) must leave it off.
    pub ordered_key_runs: bool,
}

impl Default for SinkCapabilities {
    fn default() -> Self {
        SinkCapabilities {
            keeps_order: true,
            deduplicates: false,
            max_payload: None,
            ordered_key_runs: false,
        }
    }
}

crate::setters!(SinkCapabilities {
    /// Sets whether the sink de-duplicates by message id.
    with_deduplication(deduplicates: bool) => deduplicates = deduplicates;
    /// Sets whether several messages of one key may share a call (see
    /// [`ordered_key_runs`](SinkCapabilities::ordered_key_runs)).
    with_ordered_key_runs(ordered_key_runs: bool) => ordered_key_runs = ordered_key_runs;
    /// Sets the largest payload the sink accepts.
    with_max_payload(max_payload: Option<usize>) => max_payload = max_payload;
});

/// Where a relay publishes messages (a Redis stream, an AMQP exchange, a Kafka topic).
///
/// The batch contract:
/// - `publish` is never called concurrently on one instance, so an implementation may keep
///   one connection or channel per instance;
/// - it must not block forever: every network wait has a time-out, and a time-out is an
///   [`Unavailable`](crate::ErrorKind::Unavailable) error;
/// - retries are not its job: it reports and the worker decides;
/// - a batch never holds two messages of one partition key when the storage keeps per-key
///   order, so the sink needs no ordering logic of its own; unless the sink declares
///   [`ordered_key_runs`](SinkCapabilities::ordered_key_runs), which is its promise to keep
///   a key's messages in order within a call and to stop a key at its first failure.
#[async_trait]
pub trait Sink: Send + Sync {
    /// Publishes `batch` and returns one outcome per message, in the same order. An `Err`
    /// means the whole batch failed (for example the connection dropped) and no message
    /// may be taken as delivered.
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>>;

    /// Checks that the broker answers, within a time-out.
    async fn health(&self) -> Result<()>;

    /// What this sink guarantees.
    fn capabilities(&self) -> SinkCapabilities {
        SinkCapabilities::default()
    }

    /// The longest one `publish` call can take before it gives up with an
    /// [`Unavailable`](crate::ErrorKind::Unavailable) error, if the sink bounds it (its
    /// configured time-out plus any grace). The worker refuses a lease shorter than the
    /// worst case of a batch: this times the rounds a batch may take.
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        None
    }
}
