//! NATS JetStream: a client of the test's own, streams, and an ordered reader.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;

use crate::Service;

/// NATS for tests: `$OUTBOX_TEST_NATS_URL`, or the local server.
pub fn url() -> String {
    Service::Nats.url()
}

/// A JetStream context on a connection of the test's own; panics naming the server when it
/// does not answer within 5 s.
pub async fn connect() -> jetstream::Context {
    try_connect()
        .await
        .unwrap_or_else(|e| Service::Nats.missing(e))
}

/// A JetStream context on a connection of its own, or what failed when the server does not
/// answer within 5 s.
pub async fn try_connect() -> Result<jetstream::Context, String> {
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url().as_str())
        .await
        .map_err(|e| format!("NATS at {}: {e}", outbox_core::redact_url(&url())))?;
    Ok(jetstream::new(client))
}

/// Creates stream `name` capturing `subjects`, in memory, emptied after an hour so that
/// repeated runs leave little behind, de-duplicating by message id over two minutes; panics
/// when it cannot.
pub async fn create_stream(js: &jetstream::Context, name: &str, subjects: Vec<String>) {
    if let Err(error) = try_create_stream(js, name, subjects).await {
        panic!("{error}");
    }
}

/// [`create_stream`], saying what failed.
pub async fn try_create_stream(
    js: &jetstream::Context,
    name: &str,
    subjects: Vec<String>,
) -> Result<(), String> {
    js.create_stream(stream::Config {
        name: name.to_string(),
        subjects,
        storage: stream::StorageType::Memory,
        max_age: Duration::from_secs(3600),
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .map(drop)
    .map_err(|e| format!("creating JetStream stream {name} at {}: {e}", url()))
}

/// Deletes stream `name`, saying what failed.
pub async fn delete_stream(js: &jetstream::Context, name: &str) -> Result<(), String> {
    js.delete_stream(name)
        .await
        .map(drop)
        .map_err(|e| format!("deleting JetStream stream {name} at {}: {e}", url()))
}

/// Every message of stream `name`, in stream order, once it holds at least `at_least` (or
/// `timeout` passed).
pub async fn read(
    js: &jetstream::Context,
    name: &str,
    at_least: usize,
    timeout: Duration,
) -> Vec<jetstream::Message> {
    let mut stream = js.get_stream(name).await.expect("the test's stream");
    let deadline = tokio::time::Instant::now() + timeout;
    let count = loop {
        let held = stream.info().await.expect("stream info").state.messages as usize;
        if held >= at_least || tokio::time::Instant::now() >= deadline {
            break held;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if count == 0 {
        return Vec::new();
    }
    let ordered = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .expect("ordered consumer");
    let mut messages = ordered.messages().await.expect("consume").take(count);
    let mut read = Vec::with_capacity(count);
    while let Some(next) = tokio::time::timeout(Duration::from_secs(10), messages.next())
        .await
        .expect("stream message within 10 s")
    {
        read.push(next.expect("stream message"));
    }
    read
}

/// The headers of a message by name, each with its last value.
pub fn headers(message: &async_nats::Message) -> BTreeMap<String, String> {
    message
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .filter_map(|(name, values)| Some((name.to_string(), values.last()?.to_string())))
        .collect()
}
