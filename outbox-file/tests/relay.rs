//! The `file` and `stdout` sinks (outbox-file) on real files and a captured writer: the
//! conformance suite for each, what stands in for a broker outage, and the end-to-end
//! scripts through PostgreSQL.
//!
//! Neither sink has a network address, so the suite's two checks that point a sink at one
//! (`sink_health_is_down_on_a_closed_port`, `sink_health_times_out_on_a_silent_server`) are
//! not run for them; what they prove is proved here for a file whose directory goes away
//! (through the relay) and in outbox-file's crate tests for a read-only file and for an
//! output nobody reads or that nobody reads any more.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, TraceContext};
use outbox_file::base64::Engine;
use outbox_file::base64::engine::general_purpose::STANDARD;
use outbox_file::{FileConfig, FileSink, StdoutConfig, StdoutSink, wire};
use outbox_test_support::envelope::assert_envelope;
use outbox_test_support::relay::TestOutbox;
use outbox_test_support::relay::end_to_end::{self, Arrived, Fixture};
use outbox_test_support::{Service, unique_name};
use outbox_testkit::{Destination, Received, SinkHarness, assert_error_says, refused_sink_build};

/// The sinks' time-out in these tests.
const TIMEOUT: Duration = Duration::from_secs(2);

/// One line as a consumer reads it, checked against the layout of `outbox_file::wire`.
#[derive(Debug, Clone)]
struct Line {
    id: uuid::Uuid,
    topic: String,
    key: Option<String>,
    headers: BTreeMap<String, String>,
    trace_context: Option<TraceContext>,
    payload: Vec<u8>,
    /// Where the line starts in what was written.
    offset: usize,
    /// Every top-level field whose value is a string, by name, as a consumer's JSON parser
    /// sees it.
    fields: BTreeMap<String, String>,
}

/// Every line of `bytes`; panics on anything the layout does not allow.
fn parse(bytes: &[u8]) -> Vec<Line> {
    assert!(
        bytes.is_empty() || bytes.ends_with(b"\n"),
        "the output ends in a cut-off line"
    );
    let mut offset = 0;
    let mut lines = Vec::new();
    for raw in bytes.split_inclusive(|b| *b == b'\n') {
        let at = offset;
        offset += raw.len();
        let text = std::str::from_utf8(raw).expect("every line is UTF-8");
        let value: serde_json::Value = serde_json::from_str(text.trim_end_matches('\n'))
            .unwrap_or_else(|e| panic!("line at {at} is not JSON ({e}): {text:?}"));
        let object = value.as_object().expect("each line is a JSON object");
        let text_of = |name: &str| -> Option<String> {
            match object.get(name) {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(other) => panic!("`{name}` is not a string: {other}"),
            }
        };
        let payload = text_of(wire::PAYLOAD).expect("payload");
        let payload = match text_of(wire::PAYLOAD_ENCODING).as_deref() {
            Some(wire::UTF8) => payload.into_bytes(),
            Some(wire::BASE64) => STANDARD.decode(payload).expect("base64 payload"),
            other => panic!("payload_encoding {other:?}"),
        };
        let headers = object
            .get(wire::HEADERS)
            .and_then(|h| h.as_object())
            .expect("headers is an object")
            .iter()
            .map(|(name, value)| {
                let value = value.as_str().expect("header values are strings");
                (name.clone(), value.to_string())
            })
            .collect();
        let created_at = text_of(wire::CREATED_AT).expect("outbox-created-at");
        chrono::DateTime::parse_from_rfc3339(&created_at).expect("outbox-created-at is RFC 3339");
        lines.push(Line {
            id: text_of(wire::ID)
                .expect("outbox-id")
                .parse()
                .expect("outbox-id is a UUID"),
            topic: text_of(wire::TOPIC).expect("outbox-topic"),
            key: text_of(wire::KEY),
            headers,
            trace_context: end_to_end::trace_context(
                text_of(wire::TRACEPARENT),
                text_of(wire::TRACESTATE),
            ),
            payload,
            offset: at,
            fields: object
                .iter()
                .filter_map(|(name, value)| Some((name.clone(), value.as_str()?.to_string())))
                .collect(),
        });
    }
    lines
}

/// What the suite compares, from the lines of one destination (all of its topic).
fn received(lines: Vec<Line>, topic: &str) -> Vec<Received> {
    lines
        .into_iter()
        .map(|line| {
            assert_eq!(line.topic, topic, "a line of another topic");
            Received {
                payload: line.payload,
                headers: line.headers,
                key: line.key,
            }
        })
        .collect()
}

/// A directory of the test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let path = std::env::temp_dir().join(unique_name("outbox-file"));
        std::fs::create_dir_all(&path).expect("make a temporary directory");
        Scratch(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn file_sink(path: &Path) -> FileSink {
    FileSink::new(FileConfig::new(path).publish_timeout(TIMEOUT)).expect("valid configuration")
}

/// The `file` sink: each destination is a file of its own in the harness's directory.
struct Files {
    dir: Scratch,
}

impl Files {
    fn new() -> Files {
        Files {
            dir: Scratch::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.0.join(format!("{name}.jsonl"))
    }

    fn lines(&self, name: &str) -> Vec<Line> {
        match std::fs::read(self.path(name)) {
            Ok(bytes) => parse(&bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("read {}: {e}", self.path(name).display()),
        }
    }
}

/// A `Write` the test keeps a handle to while a `stdout` sink writes into it.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("buffer").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines(&self) -> Vec<Line> {
        parse(&self.0.lock().expect("buffer"))
    }
}

/// The `stdout` sink over a captured writer: each destination is a buffer of its own.
#[derive(Default)]
struct Stdout {
    outputs: Mutex<HashMap<String, Captured>>,
}

impl Stdout {
    fn sink(&self, name: &str) -> StdoutSink {
        let captured = Captured::default();
        self.outputs
            .lock()
            .expect("outputs")
            .insert(name.to_string(), captured.clone());
        let config = StdoutConfig::default().publish_timeout(TIMEOUT);
        StdoutSink::with_writer(config, captured).expect("valid configuration")
    }

    fn lines(&self, name: &str) -> Vec<Line> {
        let outputs = self.outputs.lock().expect("outputs");
        outputs.get(name).map(Captured::lines).unwrap_or_default()
    }
}

/// What the two sinks' suites differ in: the sink that writes to an output of `name` (a
/// file, a buffer), and that output's lines.
trait Output: Send + Sync {
    fn sink_to(&self, name: &str) -> Arc<dyn Sink>;
    fn lines_of(&self, name: &str) -> Vec<Line>;
}

impl Output for Files {
    fn sink_to(&self, name: &str) -> Arc<dyn Sink> {
        Arc::new(file_sink(&self.path(name)))
    }

    fn lines_of(&self, name: &str) -> Vec<Line> {
        self.lines(name)
    }
}

impl Output for Stdout {
    fn sink_to(&self, name: &str) -> Arc<dyn Sink> {
        Arc::new(self.sink(name))
    }

    fn lines_of(&self, name: &str) -> Vec<Line> {
        self.lines(name)
    }
}

/// The suite's harness over either output: each destination is an output of its own.
struct Harness<O>(O);

#[async_trait]
impl<O: Output> SinkHarness for Harness<O> {
    fn timeout(&self) -> Duration {
        TIMEOUT
    }

    async fn destination(&self) -> Destination {
        let topic = unique_name("conformance");
        Destination {
            sink: self.0.sink_to(&topic),
            topic,
        }
    }

    /// The output is complete once `publish` returned (the file is written, the buffer
    /// flushed): no waiting.
    async fn read(&self, destination: &Destination, _at_least: usize) -> Vec<Received> {
        received(self.0.lines_of(&destination.topic), &destination.topic)
    }

    /// No network address: see the_directory_going_away_is_an_outage for a file's outages,
    /// and outbox-file's crate tests of an output nobody reads.
    async fn sink_at(&self, _addr: &str) -> Option<Arc<dyn Sink>> {
        None
    }
}

/// The suite on files (the checks that need a network address skip).
mod file {
    use super::*;

    outbox_testkit::sink_conformance_tests!(Harness(Files::new()));
}

/// The suite on a captured standard output (the checks that need a network address skip).
mod stdout {
    use super::*;

    outbox_testkit::sink_conformance_tests!(Harness(Stdout::default()));
}

/// Under the end-to-end scripts a destination is a file of its own; its lines are read back
/// with the offset of each as the receipt.
#[async_trait]
impl Fixture for Files {
    type Native = BTreeMap<String, String>;
    type Destination = String;

    /// The file sink reaches no server; the only one the scripts use is PostgreSQL.
    const SERVICE: Service = Service::Postgres;

    async fn destination(&self, _topics: &[&str], _via: Option<&str>) -> String {
        unique_name("relay")
    }

    async fn sink(&self, name: &String, _via: Option<&str>) -> Arc<dyn Sink> {
        Arc::new(file_sink(&self.path(name)))
    }

    async fn read(&self, name: &String, count: usize) -> Vec<Arrived<BTreeMap<String, String>>> {
        let lines = self.lines(name);
        assert!(lines.len() >= count, "{} of {count} lines", lines.len());
        lines.into_iter().map(arrived).collect()
    }
}

fn arrived(line: Line) -> Arrived<BTreeMap<String, String>> {
    Arrived {
        id: line.id,
        topic: line.topic,
        key: line.key,
        payload: line.payload,
        headers: line.headers,
        trace_context: line.trace_context,
        receipt: Some(line.offset.to_string()),
        native: line.fields,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_appends_from_postgres_to_a_file_in_key_order() {
    for (message, got) in end_to_end::round_trip(&Files::new()).await {
        // The envelope by its documented names, as any JSON parser reads the line.
        assert_envelope(&Message::from(message), "line", |name| {
            got.native.get(name).cloned()
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_published_before_a_crash_are_appended_again() {
    end_to_end::redelivery_after_a_crash(&Files::new()).await;
}

/// The relay's outage, for a file: its directory goes away while the relay runs. Health says
/// unavailable with what to do, nothing is written, no attempt is charged and nothing is
/// dead-lettered; once the directory is back everything is appended once, in key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_directory_going_away_is_an_outage() {
    let scratch = Scratch::new();
    let dir = scratch.0.join("out");
    std::fs::create_dir(&dir).unwrap();
    let path = dir.join("messages.jsonl");
    let sink: Arc<dyn Sink> = Arc::new(file_sink(&path));
    let outbox = TestOutbox::new().await;
    let relay = outbox.relay("file-outage", sink.clone());
    let message = |i: usize| NewMessage::new("t", format!("{i}")).key(format!("k{}", i % 5));
    let first: Vec<NewMessage> = (0..50).map(message).collect();
    outbox.enqueue(&first).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;

    // The relay's background health check may create the file again between the removal of
    // the file and of its directory: remove until the directory is gone.
    let removing = Instant::now();
    while let Err(e) = std::fs::remove_dir_all(&dir) {
        assert!(
            removing.elapsed() < Duration::from_secs(5),
            "cannot remove {dir:?}: {e}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let health = sink
        .health()
        .await
        .expect_err("health without the directory");
    assert!(started.elapsed() < TIMEOUT * 2, "{:?}", started.elapsed());
    let gone = "does not exist any more; create it again";
    assert_error_says(&health, ErrorKind::Unavailable, gone);
    let batch = [Message::from(message(1000)), Message::from(message(1001))];
    for outcome in sink.publish(&batch).await.expect("one outcome per message") {
        match outcome {
            Outcome::Failed(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}"),
            Outcome::Delivered(r) => panic!("delivered without a directory: {r}"),
        }
    }
    let second: Vec<NewMessage> = (50..250).map(message).collect();
    outbox.enqueue(&second).await;
    end_to_end::assert_held_by_the_outage(&outbox, second.len(), Duration::from_secs(1)).await;

    std::fs::create_dir(&dir).unwrap();
    outbox
        .drained_with_no_dead_letters(Duration::from_secs(60))
        .await;
    relay.stop().await;
    // The file was made anew: it holds the messages sent after the outage, once each, in
    // enqueue order per key.
    let lines = parse(&std::fs::read(&path).unwrap());
    let ids: Vec<uuid::Uuid> = lines.iter().map(|l| l.id).collect();
    let mut sorted = ids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len(), "each message once");
    assert_eq!(ids.len(), second.len(), "every message after the outage");
    for key in 0..5 {
        let key = format!("k{key}");
        let sent: Vec<&[u8]> = second
            .iter()
            .filter(|m| m.key.as_deref() == Some(&key))
            .map(|m| m.payload.as_slice())
            .collect();
        let got: Vec<&[u8]> = lines
            .iter()
            .filter(|l| l.key.as_deref() == Some(&key))
            .map(|l| l.payload.as_slice())
            .collect();
        assert_eq!(got, sent, "key {key} in enqueue order");
    }
}

/// The stdout sink through the relay, over a captured writer: every message once, each key
/// in enqueue order, receipts numbering the lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_writes_from_postgres_to_stdout_in_key_order() {
    let stdout = Stdout::default();
    let outbox = TestOutbox::with_config(|c| c.retention = Some(Duration::from_secs(3600))).await;
    let messages = end_to_end::round_trip_messages();
    outbox.enqueue(&messages).await;
    let relay = outbox.relay("stdout-w1", Arc::new(stdout.sink("relay")));
    outbox
        .drained_with_no_dead_letters(Duration::from_secs(60))
        .await;
    relay.stop().await;
    let lines = stdout.lines("relay");
    assert_eq!(lines.len(), messages.len(), "every message once");
    let receipts = outbox.receipts().await;
    for (number, line) in lines.iter().enumerate() {
        assert_eq!(
            receipts[&line.id],
            (number + 1).to_string(),
            "receipt of {}",
            line.id
        );
    }
    let by_id: HashMap<uuid::Uuid, &Line> = lines.iter().map(|l| (l.id, l)).collect();
    for message in &messages {
        let line = by_id[&message.id];
        assert_eq!(line.payload, message.payload, "payload of {}", message.id);
        assert_eq!(line.topic, message.topic);
        assert_eq!(line.key, message.key);
        assert_eq!(line.headers, message.headers);
        assert_eq!(line.trace_context, message.trace_context);
        assert_envelope(&Message::from(message.clone()), "line", |name| {
            line.fields.get(name).cloned()
        });
    }
    let position: HashMap<uuid::Uuid, usize> =
        lines.iter().enumerate().map(|(i, l)| (l.id, i)).collect();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for message in messages.iter().filter(|m| m.key.is_some()) {
        let key = message.key.as_deref().unwrap_or_default();
        let at = position[&message.id];
        if let Some(before) = last.insert(key, at) {
            assert!(before < at, "key {key} out of enqueue order");
        }
    }
}

/// The registry builds both types from configuration, as the relay binary does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_builds_both_types_from_configuration() {
    let scratch = Scratch::new();
    let path = scratch.0.join("out.jsonl");
    let mut registry = outbox_core::SinkRegistry::new();
    outbox_file::register(&mut registry);
    let file = registry
        .build(
            outbox_file::TYPE,
            serde_json::json!({ "path": path, "sync": false }),
        )
        .await
        .expect("file sink");
    let message = Message::from(NewMessage::new("orders", vec![0xff, 0xfe]).key("k"));
    let outcomes = file.publish(std::slice::from_ref(&message)).await.unwrap();
    assert!(matches!(&outcomes[..], [Outcome::Delivered(r)] if r.0 == "0"));
    let lines = parse(&std::fs::read(&path).unwrap());
    assert_eq!(lines[0].payload, message.payload);
    let stdout = registry
        .build(
            outbox_file::STDOUT_TYPE,
            serde_json::json!({ "publish_timeout": "1s" }),
        )
        .await
        .expect("stdout sink");
    assert_eq!(stdout.publish_timeout(), Some(Duration::from_secs(1)));
    stdout.health().await.expect("standard output is writable");
    let missing = serde_json::json!({ "path": scratch.0.join("no/x") });
    let error = refused_sink_build(&registry, outbox_file::TYPE, missing).await;
    assert!(error.message().starts_with("sink.path `"), "{error}");
}
