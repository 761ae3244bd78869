//! The spool sink's settings.

use std::path::PathBuf;

use outbox_core::{Error, Result};
use serde::Deserialize;

/// Where the spool writes, and the largest payload it takes.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpoolConfig {
    /// The directory the topic files are written in; it must exist.
    pub dir: PathBuf,
    /// Largest payload in bytes; a larger one is dead-lettered (`Permanent`).
    pub max_payload: usize,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            dir: PathBuf::new(),
            max_payload: 1024 * 1024,
        }
    }
}

impl SpoolConfig {
    /// Settings spooling into `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        SpoolConfig {
            dir: dir.into(),
            ..SpoolConfig::default()
        }
    }

    /// Refuses settings the sink cannot work with, naming the key.
    pub fn validate(&self) -> Result<()> {
        if self.dir.as_os_str().is_empty() {
            return Err(Error::setting("dir", "is empty: set the spool directory"));
        }
        if self.max_payload == 0 {
            return Err(Error::setting("max_payload", "must be at least 1 byte"));
        }
        Ok(())
    }
}
