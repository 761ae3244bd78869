//! The spool sink: one JSON line per message in `<dir>/<topic>.jsonl`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use outbox_core::{Message, Outcome, Receipt, Result, Sink, SinkCapabilities};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::SpoolConfig;
use crate::error::{io, refused};

/// One spooled message, as a line of a topic's file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpooledLine {
    /// The message id (de-duplication key).
    pub id: Uuid,
    /// The partition key.
    pub key: Option<String>,
    /// The headers.
    pub headers: BTreeMap<String, String>,
    /// The payload, in lower-case hex: JSON cannot hold bytes.
    pub payload_hex: String,
}

impl SpooledLine {
    /// The payload's bytes; `None` if the hex is broken.
    pub fn payload(&self) -> Option<Vec<u8>> {
        let hex = self.payload_hex.as_bytes();
        if !hex.len().is_multiple_of(2) {
            return None;
        }
        hex.chunks(2)
            .map(|pair| {
                let text = std::str::from_utf8(pair).ok()?;
                u8::from_str_radix(text, 16).ok()
            })
            .collect()
    }
}

/// Spools messages into a directory. Publishes are written and flushed before they are
/// reported delivered; a message id already in its topic's file is not written again.
pub struct SpoolSink {
    config: SpoolConfig,
    /// The ids in each topic's file, read from the file on first use.
    seen: Mutex<HashMap<String, HashSet<Uuid>>>,
}

impl SpoolSink {
    /// A sink with validated settings.
    pub fn new(config: SpoolConfig) -> Result<Self> {
        config.validate()?;
        Ok(SpoolSink {
            config,
            seen: Mutex::new(HashMap::new()),
        })
    }

    /// The file a topic's messages go to; `None` for a topic that is not a plain file name.
    pub fn file_of(&self, topic: &str) -> Option<PathBuf> {
        let plain = !topic.is_empty()
            && !topic.starts_with('.')
            && topic
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        plain.then(|| self.config.dir.join(format!("{topic}.jsonl")))
    }

    /// Reads a topic's spooled lines, in the order they were written.
    pub fn read(&self, topic: &str) -> Result<Vec<SpooledLine>> {
        let Some(path) = self.file_of(topic) else {
            return Err(refused(format!("topic {topic:?} is not a plain file name")));
        };
        let file = match std::fs::File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("open", &path, e)),
        };
        let mut lines = Vec::new();
        for line in BufReader::new(file).lines() {
            let line = line.map_err(|e| io("read", &path, e))?;
            let parsed = serde_json::from_str(&line).map_err(|e| {
                refused(format!(
                    "{} holds a line that is not a spooled message: {e}",
                    path.display()
                ))
            })?;
            lines.push(parsed);
        }
        Ok(lines)
    }

    /// What becomes of one message: refused, already spooled, or a line to write to a file.
    fn plan(
        &self,
        seen: &mut HashMap<String, HashSet<Uuid>>,
        message: &Message,
    ) -> Result<Result<(PathBuf, String), Outcome>> {
        if message.payload.len() > self.config.max_payload {
            let why = format!(
                "payload of {} bytes is over max_payload {}",
                message.payload.len(),
                self.config.max_payload
            );
            return Ok(Err(Outcome::Failed(refused(why))));
        }
        let Some(path) = self.file_of(&message.topic) else {
            let why = format!("topic {:?} is not a plain file name", message.topic);
            return Ok(Err(Outcome::Failed(refused(why))));
        };
        if !seen.contains_key(&message.topic) {
            let ids = self
                .read(&message.topic)?
                .into_iter()
                .map(|l| l.id)
                .collect();
            seen.insert(message.topic.clone(), ids);
        }
        if !seen
            .entry(message.topic.clone())
            .or_default()
            .insert(message.id)
        {
            return Ok(Err(Outcome::Delivered(receipt(&path, message))));
        }
        let line = SpooledLine {
            id: message.id,
            key: message.key.clone(),
            headers: message.headers.clone(),
            payload_hex: message.payload.iter().map(|b| format!("{b:02x}")).collect(),
        };
        let mut text = serde_json::to_string(&line)
            .map_err(|e| refused(format!("cannot encode message {}: {e}", message.id)))?;
        text.push('\n');
        Ok(Ok((path, text)))
    }
}

fn receipt(path: &Path, message: &Message) -> Receipt {
    Receipt::new(format!("{}#{}", path.display(), message.id))
}

#[async_trait]
impl Sink for SpoolSink {
    /// Appends the batch's lines to their files, then syncs each file once: nothing is
    /// reported delivered before it is on disk. A write that fails fails the batch
    /// (retryable), and the ids it planned are forgotten, so a retry writes them.
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut outcomes = Vec::with_capacity(batch.len());
        let mut files: BTreeMap<PathBuf, String> = BTreeMap::new();
        for message in batch {
            match self.plan(&mut seen, message)? {
                Err(outcome) => outcomes.push(outcome),
                Ok((path, line)) => {
                    outcomes.push(Outcome::Delivered(receipt(&path, message)));
                    files.entry(path).or_default().push_str(&line);
                }
            }
        }
        for (path, text) in &files {
            let written = OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut file| {
                    file.write_all(text.as_bytes())?;
                    file.sync_data()
                });
            if let Err(e) = written {
                // What is on disk now is unknown: read the files again on the next call.
                seen.clear();
                return Err(io("write", path, e));
            }
        }
        Ok(outcomes)
    }

    async fn health(&self) -> Result<()> {
        let dir = &self.config.dir;
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => Ok(()),
            Ok(_) => Err(io(
                "use",
                dir,
                std::io::Error::other("it is not a directory"),
            )),
            Err(e) => Err(io("open", dir, e)),
        }
    }

    fn capabilities(&self) -> SinkCapabilities {
        SinkCapabilities::default()
            .with_deduplication(true)
            .with_max_payload(Some(self.config.max_payload))
    }
}
