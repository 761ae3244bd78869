//! The `file` and `stdout` sinks: each message becomes one JSON line (one encoder for both,
//! [`encode`]); a batch is written with one write, synced (the `file` sink) or flushed (the
//! `stdout` sink), and only then reported delivered.
//!
//! The blocking writes run on a thread of each sink's own ([`Writer`]), one at a time and
//! each within `publish_timeout`, so no async thread waits on a disk or a pipe, and a write
//! that never finishes (a stalled disk, a reader that stopped reading) holds up neither the
//! runtime's shutdown nor the process's exit, as a task of `spawn_blocking` would.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use outbox_core::envelope::Envelope;
use outbox_core::{Error, Message, Outcome, Receipt, Result, Sink, SinkCapabilities};
use serde::ser::{SerializeMap, Serializer};
use tokio::sync::{Mutex, oneshot};
use tokio::time::{Instant, timeout_at};

use crate::error::{file_io, no_thread, not_a_file, stalled, stdout_io, timed_out, write_panicked};
use crate::{FileConfig, StdoutConfig, wire};
use outbox_core::config::Settings;

// --- The line: one place for the encoding of both sinks. ---

/// A message as the JSON object of its line (field names from [`wire`]).
struct Line<'a>(&'a Message);

impl serde::Serialize for Line<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let message = self.0;
        let mut map = serializer.serialize_map(None)?;
        for (name, value) in Envelope::of(message).fields() {
            map.serialize_entry(name, &value)?;
        }
        map.serialize_entry(wire::HEADERS, &message.headers)?;
        match std::str::from_utf8(&message.payload) {
            Ok(text) => {
                map.serialize_entry(wire::PAYLOAD_ENCODING, wire::UTF8)?;
                map.serialize_entry(wire::PAYLOAD, text)?;
            }
            Err(_) => {
                map.serialize_entry(wire::PAYLOAD_ENCODING, wire::BASE64)?;
                map.serialize_entry(wire::PAYLOAD, &STANDARD.encode(&message.payload))?;
            }
        }
        map.end()
    }
}

/// A batch as JSON lines, ready for one write.
struct Encoded {
    /// The lines, after `lead` (bytes the caller may or may not write in front).
    bytes: Vec<u8>,
    /// Per message: where its line starts, counted from the end of the lead, or why it
    /// could not be encoded.
    lines: Vec<Result<usize>>,
}

impl Encoded {
    /// How many messages have a line.
    fn written(&self) -> usize {
        self.lines.iter().filter(|line| line.is_ok()).count()
    }

    /// The outcome of each message once the lines went out: `receipt(start, index)` gives
    /// the receipt of a line from its start and its index among the lines written.
    fn delivered(self, receipt: impl Fn(usize, usize) -> String) -> Vec<Outcome> {
        let mut index = 0;
        self.lines
            .into_iter()
            .map(|line| match line {
                Ok(start) => {
                    index += 1;
                    Outcome::Delivered(Receipt::new(receipt(start, index - 1)))
                }
                Err(error) => Outcome::Failed(error),
            })
            .collect()
    }

    /// The outcome of each message when the write failed with `error`: every message with a
    /// line fails with it.
    fn failed(self, error: Error) -> Vec<Outcome> {
        let text = describe(&error);
        let kind = error.kind();
        let mut first = Some(error);
        self.lines
            .into_iter()
            .map(|line| match line {
                Ok(_) => Outcome::Failed(first.take().unwrap_or_else(|| Error::new(kind, &text))),
                Err(error) => Outcome::Failed(error),
            })
            .collect()
    }
}

/// An error's message with its source, for the copies a failed batch hands to each message.
fn describe(error: &Error) -> String {
    match std::error::Error::source(error) {
        Some(source) => format!("{}: {source}", error.message()),
        None => error.message().to_string(),
    }
}

/// Encodes `batch` as JSON lines after `lead`. A message that cannot be encoded (none can:
/// every field is a string or a map of strings) would fail alone as `Permanent`, and its
/// key's later messages in the batch would not be written (`ordered_key_runs`).
fn encode(batch: &[Message], lead: &[u8]) -> Encoded {
    let size: usize = batch.iter().map(|m| m.payload.len() * 4 / 3 + 256).sum();
    let mut bytes = Vec::with_capacity(lead.len() + size);
    bytes.extend_from_slice(lead);
    let mut failed_keys = std::collections::HashSet::new();
    let lines = batch
        .iter()
        .map(|message| {
            if let Some(key) = message.key.as_ref().filter(|k| failed_keys.contains(*k)) {
                return Err(Error::unavailable(format!(
                    "message {} not written: an earlier message of key `{key}` failed",
                    message.id
                )));
            }
            let start = bytes.len();
            match serde_json::to_writer(&mut bytes, &Line(message)) {
                Ok(()) => {
                    bytes.push(b'\n');
                    Ok(start - lead.len())
                }
                Err(error) => {
                    bytes.truncate(start);
                    failed_keys.extend(message.key.clone());
                    Err(
                        Error::permanent(format!("cannot encode message {} as JSON", message.id))
                            .with_source(error),
                    )
                }
            }
        })
        .collect();
    Encoded { bytes, lines }
}

// --- The writer thread, shared by both sinks. ---

type Job<T> = Box<dyn FnOnce(&mut T) + Send>;

/// A thread of the sink's own that owns its output (`T`) and runs the blocking writes, one
/// at a time. A call waits at most the time-out, for an earlier write to finish and for its
/// own; a write that outlives its call finishes on the thread, and until it has, later calls
/// fail at once after the time-out instead of queueing more behind it.
struct Writer<T> {
    jobs: mpsc::Sender<Job<T>>,
    /// Held from the moment a call starts until its write has finished on the thread.
    busy: Arc<Mutex<()>>,
    timeout: Duration,
    /// What the errors name: `file `/var/lib/outbox/messages.jsonl``, `stdout`.
    target: String,
}

impl<T: Send + 'static> Writer<T> {
    fn start(name: &str, target: String, timeout: Duration, output: T) -> Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job<T>>();
        std::thread::Builder::new()
            .name(format!("outbox-{name}"))
            .spawn(move || {
                let mut output = output;
                // Ends when the sink is dropped. A panicking write (a bug) fails its call
                // and leaves the thread to serve the next one.
                for job in queue {
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut output)));
                }
            })
            .map_err(|error| no_thread(&target, error))?;
        Ok(Writer {
            jobs,
            busy: Arc::new(Mutex::new(())),
            timeout,
            target,
        })
    }

    /// Runs `job` on the output within the time-out.
    async fn run<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut T) -> R + Send + 'static,
    ) -> Result<R> {
        let deadline = Instant::now() + self.timeout;
        let busy = timeout_at(deadline, self.busy.clone().lock_owned())
            .await
            .map_err(|_| stalled(&self.target, self.timeout))?;
        let (reply, answer) = oneshot::channel();
        let job: Job<T> = Box::new(move |output| {
            let _busy = busy;
            let _ = reply.send(job(output));
        });
        if self.jobs.send(job).is_err() {
            return Err(write_panicked(&self.target));
        }
        match timeout_at(deadline, answer).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) => Err(write_panicked(&self.target)),
            Err(_) => Err(timed_out(&self.target, self.timeout)),
        }
    }
}

fn capabilities() -> SinkCapabilities {
    // Lines land in the order given, a batch in one write: all of it lands or none (but a
    // message that cannot be encoded, which stops its key), so a key's messages can share
    // a batch. Nothing is de-duplicated (a redelivered message is a second line with the
    // same id); no size limit of its own.
    SinkCapabilities::default()
        .with_ordered_key_runs(true)
        .with_deduplication(false)
        .with_max_payload(None)
}

// --- The `file` sink. ---

/// Appends each message as one JSON line to a file (see [`wire`] for the fields). Each batch
/// is one write, synced to the disk (unless `sync` is off) before it is reported delivered;
/// a message's receipt is the byte offset where its line starts.
///
/// The file is opened for each batch (created if missing), so a file moved away by log
/// rotation is started anew at the same path. The sink must be the only writer of its file.
pub struct FileSink {
    config: FileConfig,
    writer: Writer<()>,
}

outbox_core::debug_shows_config!(FileSink);

impl FileSink {
    /// A sink for `config`. Validates the configuration (the directory must exist; see
    /// [`FileConfig::validate`]); the file itself is opened, and created if missing, by the
    /// first `health` or `publish`.
    pub fn new(config: FileConfig) -> Result<Self> {
        config.validate()?;
        let target = format!("file `{}`", config.path.display());
        let writer = Writer::start("file", target, config.publish_timeout, ())?;
        Ok(FileSink { config, writer })
    }

    /// The sink's settings.
    pub fn config(&self) -> &FileConfig {
        &self.config
    }
}

/// Opens `path` to read and append, creating it if missing; says whether it was created.
fn open(path: &Path) -> Result<(File, bool)> {
    let mut options = OpenOptions::new();
    options.read(true).append(true);
    let (file, created) = match options.open(path) {
        Ok(file) => (file, false),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            let file = options
                .create(true)
                .open(path)
                .map_err(|error| file_io("create", path, &error))?;
            tracing::info!(path = %path.display(), "created the file");
            (file, true)
        }
        Err(error) => return Err(file_io("open", path, &error)),
    };
    let meta = file
        .metadata()
        .map_err(|error| file_io("read the size of", path, &error))?;
    if !meta.is_file() {
        return Err(not_a_file(path));
    }
    Ok((file, created))
}

/// Appends `bytes` to the file at `path`, their first byte (a `\n`) only when the file does
/// not end with a line break (a line cut short when a relay or the machine died during a
/// write), so every line starts on a line of its own. Then syncs, if asked. Returns the
/// offset where the lines after the first byte start.
fn append(path: &Path, bytes: &[u8], sync: bool) -> Result<u64> {
    let (mut file, created) = open(path)?;
    let read_error = |error: io::Error| file_io("read the end of", path, &error);
    let size = file.metadata().map_err(read_error)?.len();
    let mut lead = 0;
    if size > 0 {
        let mut last = [0u8];
        file.seek(SeekFrom::Start(size - 1)).map_err(read_error)?;
        file.read_exact(&mut last).map_err(read_error)?;
        if last[0] != b'\n' {
            tracing::warn!(path = %path.display(), "the file ends in a cut-off line; starting on a new line");
            lead = 1;
        }
    }
    let data = &bytes[1 - lead..];
    let written = file.write_all(data).and_then(|()| match sync {
        true => file.sync_data(),
        false => Ok(()),
    });
    if let Err(error) = written {
        // Cut the batch off again, so no part of it stays behind as a cut-off line (the sink
        // is the only writer of its file). If that fails too, the next batch starts on a
        // new line.
        if let Err(cut) = file.set_len(size) {
            tracing::warn!(path = %path.display(), error = %cut, "could not cut a failed batch off the file");
        }
        return Err(file_io("append the batch to", path, &error));
    }
    if created && sync {
        sync_directory(path)?;
    }
    Ok(size + lead as u64)
}

/// Syncs the directory of a file just created, so that the file's name survives a crash of
/// the machine along with its lines.
fn sync_directory(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let directory = crate::config::directory_of(path);
        File::open(directory)
            .and_then(|dir| dir.sync_all())
            .map_err(|error| file_io("sync the directory of", path, &error))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[async_trait]
impl Sink for FileSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let mut encoded = encode(batch, b"\n");
        if encoded.written() == 0 {
            return Ok(encoded.delivered(|_, _| String::new()));
        }
        let bytes = std::mem::take(&mut encoded.bytes);
        let size = bytes.len() - 1;
        let path: PathBuf = self.config.path.clone();
        let sync = self.config.sync;
        let result = self
            .writer
            .run(move |_: &mut ()| append(&path, &bytes, sync))
            .await
            .and_then(|written| written);
        match result {
            Ok(offset) => {
                tracing::debug!(path = %self.config.path.display(), messages = batch.len(), bytes = size, elapsed = ?started.elapsed(), "appended a batch");
                Ok(encoded.delivered(|start, _| (offset + start as u64).to_string()))
            }
            Err(error) => {
                tracing::warn!(path = %self.config.path.display(), %error, "could not append a batch");
                Ok(encoded.failed(error))
            }
        }
    }

    /// Opens the file to read and append (creating it if missing) within `publish_timeout`:
    /// fails when the directory went away, the file is not writable, or an earlier write is
    /// stalled. A full disk shows up on `publish` only.
    async fn health(&self) -> Result<()> {
        let path = self.config.path.clone();
        let sync = self.config.sync;
        self.writer
            .run(move |_: &mut ()| {
                let (_, created) = open(&path)?;
                match created && sync {
                    true => sync_directory(&path),
                    false => Ok(()),
                }
            })
            .await
            .and_then(|opened| opened)
    }

    fn capabilities(&self) -> SinkCapabilities {
        capabilities()
    }

    /// One write and one sync of the whole batch, within `publish_timeout`.
    fn publish_timeout(&self) -> Option<Duration> {
        Some(self.config.publish_timeout)
    }
}

// --- The `stdout` sink. ---

/// Where the `stdout` sink writes, and what it has written.
struct Output {
    out: Box<dyn Write + Send>,
    /// Lines written so far.
    lines: u64,
    /// The last write found the reader gone (a broken pipe): nothing written will be read.
    broken: bool,
}

/// Writes each message as one JSON line to standard output (see [`wire`] for the fields),
/// one write and a flush per batch; a message's receipt is its line's number (from 1) in
/// this sink's output. [`StdoutSink::with_writer`] writes to any other [`Write`] instead
/// (a test's buffer, a pipe).
pub struct StdoutSink {
    config: StdoutConfig,
    writer: Writer<Output>,
}

outbox_core::debug_shows_config!(StdoutSink);

impl StdoutSink {
    /// A sink writing to the process's standard output.
    pub fn new(config: StdoutConfig) -> Result<Self> {
        Self::with_writer(config, io::stdout())
    }

    /// A sink writing to `out` instead of standard output, with the same lines, flushes and
    /// time-out.
    pub fn with_writer(config: StdoutConfig, out: impl Write + Send + 'static) -> Result<Self> {
        config.validate()?;
        let output = Output {
            out: Box::new(out),
            lines: 0,
            broken: false,
        };
        let writer = Writer::start("stdout", "stdout".into(), config.publish_timeout, output)?;
        Ok(StdoutSink { config, writer })
    }

    /// The sink's settings.
    pub fn config(&self) -> &StdoutConfig {
        &self.config
    }
}

#[async_trait]
impl Sink for StdoutSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut encoded = encode(batch, b"");
        let count = encoded.written() as u64;
        if count == 0 {
            return Ok(encoded.delivered(|_, _| String::new()));
        }
        let bytes = std::mem::take(&mut encoded.bytes);
        let result = self
            .writer
            .run(move |output: &mut Output| {
                let written = output
                    .out
                    .write_all(&bytes)
                    .and_then(|()| output.out.flush());
                output.broken = matches!(&written, Err(e) if e.kind() == io::ErrorKind::BrokenPipe);
                written.map_err(|error| stdout_io(&error))?;
                let first = output.lines + 1;
                output.lines += count;
                Ok(first)
            })
            .await
            .and_then(|written| written);
        match result {
            Ok(first) => Ok(encoded.delivered(|_, index| (first + index as u64).to_string())),
            Err(error) => {
                tracing::warn!(%error, "could not write a batch to standard output");
                Ok(encoded.failed(error))
            }
        }
    }

    /// Fails while an earlier write is stalled (nobody reads the output) or after a write
    /// found the reader gone (a broken pipe).
    async fn health(&self) -> Result<()> {
        let broken = self.writer.run(|output: &mut Output| output.broken).await?;
        match broken {
            true => Err(stdout_io(&io::Error::from(io::ErrorKind::BrokenPipe))),
            false => Ok(()),
        }
    }

    fn capabilities(&self) -> SinkCapabilities {
        capabilities()
    }

    /// One write and one flush of the whole batch, within `publish_timeout`.
    fn publish_timeout(&self) -> Option<Duration> {
        Some(self.config.publish_timeout)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex as StdMutex;

    use chrono::TimeZone;
    use outbox_core::{ErrorKind, NewMessage, TraceContext};

    use super::*;
    use crate::tests::TempDir;
    use outbox_testkit::receipts;

    const TIMEOUT: Duration = Duration::from_secs(2);

    fn message(payload: impl Into<Vec<u8>>) -> Message {
        Message::from(NewMessage::new("orders", payload).key("k"))
    }

    fn file_sink(path: &Path) -> FileSink {
        FileSink::new(FileConfig::new(path).publish_timeout(TIMEOUT)).unwrap()
    }

    fn lines(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    fn failures(outcomes: &[Outcome]) -> Vec<&Error> {
        outcomes
            .iter()
            .map(|outcome| match outcome {
                Outcome::Failed(error) => error,
                Outcome::Delivered(receipt) => panic!("delivered: {receipt}"),
            })
            .collect()
    }

    #[test]
    fn a_line_has_every_field() {
        let mut m = Message::from(
            NewMessage::new("orders", r#"{"total":"12.50"}"#)
                .key("o-1")
                .header("content-type", "application/json")
                .header("x-note", "two\nlines \"quoted\"")
                .trace_context(TraceContext {
                    traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                    tracestate: Some("rojo=00f067aa0ba902b7".into()),
                }),
        );
        m.id = "01943a5e-7b2c-7d3e-8f40-123456789abc".parse().unwrap();
        m.created_at = chrono::Utc.with_ymd_and_hms(2025, 1, 31, 12, 0, 0).unwrap()
            + chrono::Duration::microseconds(123_456);
        let encoded = encode(std::slice::from_ref(&m), b"");
        assert_eq!(
            String::from_utf8(encoded.bytes).unwrap(),
            concat!(
                r#"{"outbox-envelope":"1","outbox-id":"01943a5e-7b2c-7d3e-8f40-123456789abc","#,
                r#""outbox-topic":"orders","outbox-key":"o-1","#,
                r#""outbox-created-at":"2025-01-31T12:00:00.123456Z","#,
                r#""content-type":"application/json","#,
                r#""traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","#,
                r#""tracestate":"rojo=00f067aa0ba902b7","#,
                r#""headers":{"content-type":"application/json","x-note":"two\nlines \"quoted\""},"#,
                r#""payload_encoding":"utf8","#,
                r#""payload":"{\"total\":\"12.50\"}"}"#,
                "\n"
            )
        );
        m.key = None;
        m.headers.clear();
        m.trace_context = None;
        m.payload = vec![0xff, 0x00, 0xfe];
        let encoded = encode(std::slice::from_ref(&m), b"");
        let line: serde_json::Value = serde_json::from_slice(&encoded.bytes).unwrap();
        assert!(line.get(wire::KEY).is_none(), "no key, no field");
        assert_eq!(line[wire::CONTENT_TYPE], "application/octet-stream");
        assert_eq!(line[wire::HEADERS], serde_json::json!({}));
        assert!(line.get(wire::TRACEPARENT).is_none() && line.get(wire::TRACESTATE).is_none());
        assert_eq!(line[wire::PAYLOAD_ENCODING], wire::BASE64);
        assert_eq!(line[wire::PAYLOAD], "/wD+");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn payloads_that_are_not_utf8_round_trip_through_base64_exactly() {
        let dir = TempDir::new();
        let path = dir.path().join("out.jsonl");
        let sink = file_sink(&path);
        let payloads: Vec<Vec<u8>> = vec![
            (0..=255u8).collect(),
            vec![0xc3, 0x28],
            vec![0xe2, 0x82],
            b"caf\xc3\xa9 \xe2\x9c\x93".to_vec(),
            Vec::new(),
            vec![0, b'\n', b'"', b'\\'],
        ];
        let batch: Vec<Message> = payloads.iter().cloned().map(message).collect();
        receipts(&sink.publish(&batch).await.unwrap());
        let lines = lines(&path);
        assert_eq!(lines.len(), payloads.len());
        for (line, sent) in lines.iter().zip(&payloads) {
            let text = line[wire::PAYLOAD].as_str().unwrap();
            let got = match line[wire::PAYLOAD_ENCODING].as_str().unwrap() {
                wire::UTF8 => {
                    assert!(
                        std::str::from_utf8(sent).is_ok(),
                        "{sent:?} written as text"
                    );
                    text.as_bytes().to_vec()
                }
                wire::BASE64 => {
                    assert!(
                        std::str::from_utf8(sent).is_err(),
                        "{sent:?} written as base64"
                    );
                    STANDARD.decode(text).unwrap()
                }
                other => panic!("payload_encoding {other}"),
            };
            assert_eq!(&got, sent);
        }
        assert_eq!(lines[0][wire::PAYLOAD_ENCODING], wire::BASE64);
        assert_eq!(lines[3][wire::PAYLOAD], "café ✓");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn receipts_are_the_byte_offsets_of_the_lines() {
        let dir = TempDir::new();
        let path = dir.path().join("out.jsonl");
        let sink = file_sink(&path);
        let first: Vec<Message> = (0..3).map(|i| message(format!("m{i}"))).collect();
        let second = vec![message("a longer payload, so the lines differ")];
        let mut all = receipts(&sink.publish(&first).await.unwrap());
        all.extend(receipts(&sink.publish(&second).await.unwrap()));
        assert_eq!(all[0], "0");
        let bytes = std::fs::read(&path).unwrap();
        for (receipt, sent) in all.iter().zip(first.iter().chain(&second)) {
            let at: usize = receipt.parse().unwrap();
            assert!(
                at == 0 || bytes[at - 1] == b'\n',
                "offset {at} starts a line"
            );
            let line = bytes[at..].split(|b| *b == b'\n').next().unwrap();
            let line: serde_json::Value = serde_json::from_slice(line).unwrap();
            assert_eq!(line[wire::ID], sent.id.to_string());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cut_off_last_line_is_left_on_its_own_line() {
        let dir = TempDir::new();
        let path = dir.path().join("out.jsonl");
        // What a relay killed during a write leaves behind.
        std::fs::write(&path, "{\"id\":\"01943a5e").unwrap();
        let sink = file_sink(&path);
        let sent = message("after the crash");
        let receipts = receipts(&sink.publish(std::slice::from_ref(&sent)).await.unwrap());
        assert_eq!(receipts, ["16"]);
        let text = std::fs::read_to_string(&path).unwrap();
        let (cut, line) = text.split_once('\n').unwrap();
        assert_eq!(cut, "{\"id\":\"01943a5e");
        let line: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(line[wire::ID], sent.id.to_string());
    }

    #[test]
    fn sync_is_on_by_default() {
        let dir = TempDir::new();
        let sink = FileSink::new(FileConfig::new(dir.path().join("out.jsonl"))).unwrap();
        assert!(sink.config().sync);
        assert_eq!(sink.publish_timeout(), Some(Duration::from_secs(5)));
        let caps = sink.capabilities();
        assert!(caps.keeps_order && !caps.deduplicates && caps.max_payload.is_none());
    }

    #[test]
    fn a_missing_directory_is_refused_by_new() {
        let dir = TempDir::new();
        let path = dir.path().join("missing").join("out.jsonl");
        let error = FileSink::new(FileConfig::new(path)).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Config);
        assert!(error.message().starts_with("path `"), "{error}");
        assert!(
            error.message().contains("does not exist; create it"),
            "{error}"
        );
    }

    /// Runs the test `name` of this module again in a child process as user `nobody` when
    /// this process is root, who may write a file whatever its mode. Returns whether the
    /// caller is to run the test's body itself: in that child, or when not root.
    #[cfg(target_os = "linux")]
    fn unprivileged(name: &str) -> bool {
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::process::CommandExt;
        const CHILD: &str = "OUTBOX_FILE_TEST_AS_NOBODY";
        if std::env::var_os(CHILD).is_some() {
            return true;
        }
        let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        if !root {
            return true;
        }
        let test = format!("sink::tests::{name}");
        // Through /proc/self/exe, so that a checkout in a directory only root may enter
        // does not keep `nobody` from starting the binary.
        let status = std::process::Command::new("/proc/self/exe")
            .args(["--exact", &test, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .uid(65534)
            .gid(65534)
            .status()
            .expect("run the test again as user nobody");
        assert!(
            status.success(),
            "{test} failed when run as user nobody: {status}"
        );
        false
    }

    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_only_file_is_unavailable_with_what_to_do() {
        use std::os::unix::fs::PermissionsExt;
        if !unprivileged("a_read_only_file_is_unavailable_with_what_to_do") {
            return;
        }
        let dir = TempDir::new();
        let path = dir.path().join("out.jsonl");
        std::fs::write(&path, "").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
        let sink = file_sink(&path);
        let batch = vec![message("a"), message("b")];
        let outcomes = sink.publish(&batch).await.unwrap();
        assert_eq!(outcomes.len(), 2);
        for error in failures(&outcomes) {
            assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
            let text = error.to_string();
            assert!(text.contains("file: cannot open `"), "{text}");
            assert!(text.contains("give it read and write permission"), "{text}");
        }
        let health = sink.health().await.unwrap_err();
        assert_eq!(health.kind(), ErrorKind::Unavailable, "{health}");
        // Once the permission is given, the same sink goes on.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        sink.health().await.unwrap();
        assert_eq!(receipts(&sink.publish(&batch).await.unwrap()).len(), 2);
        assert_eq!(lines(&path).len(), 2);
    }

    /// A buffer that a test keeps a handle to while the sink writes into it.
    #[derive(Clone, Default)]
    struct Shared(Arc<StdMutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A writer that takes `room` bytes, then fails (a disk that fills up mid-batch).
    struct Filling(Shared, usize);

    impl Write for Filling {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            let room = self.1.min(bytes.len());
            if room == 0 {
                return Err(io::Error::other("no space left"));
            }
            self.1 -= room;
            self.0.write(&bytes[..room])
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_failing_mid_batch_fails_every_message_and_lands_only_a_prefix() {
        // What `ordered_key_runs` promises: no message is reported delivered from a failed
        // write, and what did land is the batch's first lines, so no message of a key
        // landed after an earlier one of that key that did not.
        let buffer = Shared::default();
        let sink = stdout_sink(Filling(buffer.clone(), 300), TIMEOUT);
        assert!(sink.capabilities().ordered_key_runs);
        let batch: Vec<Message> = (0..6).map(|i| message(format!("m{i}"))).collect();
        let outcomes = sink.publish(&batch).await.unwrap();
        assert_eq!(outcomes.len(), batch.len());
        for outcome in &outcomes {
            assert!(
                matches!(outcome, Outcome::Failed(_)),
                "a message of a failed write was reported {outcome:?}"
            );
        }
        let landed = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let expected = String::from_utf8(encode(&batch, b"").bytes).unwrap();
        assert!(!landed.is_empty() && landed.len() < expected.len());
        assert!(expected.starts_with(&landed), "not a prefix: {landed}");
    }

    fn stdout_sink(out: impl Write + Send + 'static, timeout: Duration) -> StdoutSink {
        StdoutSink::with_writer(StdoutConfig::default().publish_timeout(timeout), out).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stdout_writes_the_same_lines_numbered_from_one() {
        let buffer = Shared::default();
        let sink = stdout_sink(buffer.clone(), TIMEOUT);
        let first = vec![message("1"), message(vec![0xff])];
        let second = vec![message("3")];
        assert_eq!(receipts(&sink.publish(&first).await.unwrap()), ["1", "2"]);
        assert_eq!(receipts(&sink.publish(&[]).await.unwrap()), [] as [&str; 0]);
        assert_eq!(receipts(&sink.publish(&second).await.unwrap()), ["3"]);
        let all: Vec<Message> = first.into_iter().chain(second).collect();
        assert_eq!(*buffer.0.lock().unwrap(), encode(&all, b"").bytes);
        sink.health().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stdout_without_a_reader_is_unavailable() {
        let (reader, writer) = io::pipe().unwrap();
        drop(reader);
        let sink = stdout_sink(writer, TIMEOUT);
        let outcomes = sink.publish(&[message("a"), message("b")]).await.unwrap();
        for error in failures(&outcomes) {
            assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
            assert!(error.to_string().contains("(broken pipe)"), "{error}");
        }
        let health = sink.health().await.unwrap_err();
        assert_eq!(health.kind(), ErrorKind::Unavailable, "{health}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stdout_that_is_not_read_times_out_and_recovers() {
        let timeout = Duration::from_millis(300);
        let (mut reader, writer) = io::pipe().unwrap();
        let sink = stdout_sink(writer, timeout);
        // More than a pipe holds: the write blocks until someone reads.
        let big = message(vec![b'x'; 1 << 20]);
        let started = std::time::Instant::now();
        let outcomes = sink.publish(std::slice::from_ref(&big)).await.unwrap();
        let elapsed = started.elapsed();
        let error = failures(&outcomes)[0];
        let late = "not written within sink.publish_timeout";
        outbox_testkit::assert_error_says(error, ErrorKind::Unavailable, late);
        assert!(
            elapsed < timeout + Duration::from_millis(500),
            "{elapsed:?}"
        );
        // The write is still stuck: the next call fails after the time-out, writing nothing.
        let health = sink.health().await.unwrap_err();
        assert!(
            health
                .message()
                .contains("an earlier write has not finished"),
            "{health}"
        );
        let small = message("small");
        let outcomes = sink.publish(std::slice::from_ref(&small)).await.unwrap();
        assert!(
            failures(&outcomes)[0]
                .message()
                .contains("an earlier write")
        );

        let drain = std::thread::spawn(move || {
            let mut all = Vec::new();
            reader.read_to_end(&mut all).map(|_| all)
        });
        let mut healthy = false;
        for _ in 0..50 {
            if sink.health().await.is_ok() {
                healthy = true;
                break;
            }
        }
        assert!(healthy, "health did not pass once the output was read");
        assert_eq!(
            receipts(&sink.publish(std::slice::from_ref(&small)).await.unwrap()),
            ["2"]
        );
        drop(sink); // closes the pipe once the writer thread ends
        let all = drain.join().unwrap().unwrap();
        // The late write did finish: the message shows up, and would again on its retry.
        assert_eq!(all, encode(&[big, small], b"").bytes);
    }
}
