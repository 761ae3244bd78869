//! The relay processes: their configuration file, start, kill -9, graceful stop, logs.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::{Context, Result};

/// The relay settings the run uses: a short lease and small batches, so that faults hit
/// claims in every state, and attempts high enough that no retried message is ever
/// dead-lettered (only the poison topic's, which fail for good).
pub struct Settings {
    pub lease: Duration,
    pub batch_size: usize,
    pub max_per_key: usize,
}

/// The relay's configuration file (docs/configuration.md). Every relay process reads the
/// same file: worker ids differ by process id. `place` is what the `[storage]` table says
/// of the storage itself (`Database::storage_keys`: the run's schema or table, the mode,
/// retention); `sink` is the body of the `[sink]` table.
pub fn config(url: &str, place: &str, settings: &Settings, sink: &str) -> String {
    format!(
        r#"# Written by outbox-chaos.
[storage]
url = "{url}"
{place}
max_connections = 4
connect_timeout = "2s"
per_key_order = true
max_per_key = {max_per_key}

[relay]
batch_size = {batch}
poll_interval = "250ms"
lease = "{lease}s"
max_attempts = 1000
shutdown_timeout = "3s"
backoff = {{ initial = "100ms", max = "1s", multiplier = 2.0, jitter = 0.2 }}

[sink]
{sink}
[observability]
# Log mode's shard hand-overs and cleanups are debug lines: the report counts them.
log_level = "info,outbox_postgres::log=debug"
summary_interval = "30s"
"#,
        batch = settings.batch_size,
        lease = settings.lease.as_secs(),
        max_per_key = settings.max_per_key,
    )
}

/// `outbox --config FILE migrate`: creates the tables before the writers start.
pub async fn migrate(binary: &Path, config: &Path) -> Result<()> {
    let output = Command::new(binary)
        .arg("--config")
        .arg(config)
        .arg("migrate")
        .output()
        .await
        .ctx(binary.display())?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`outbox migrate` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

pub struct Relays {
    binary: PathBuf,
    config: PathBuf,
    logs: PathBuf,
    children: Vec<Option<Child>>,
}

impl Relays {
    pub fn new(binary: &Path, config: &Path, logs: &Path, count: usize) -> Relays {
        Relays {
            binary: binary.to_path_buf(),
            config: config.to_path_buf(),
            logs: logs.to_path_buf(),
            children: (0..count).map(|_| None).collect(),
        }
    }

    pub fn count(&self) -> usize {
        self.children.len()
    }

    pub fn log(&self, relay: usize) -> PathBuf {
        self.logs.join(format!("relay-{relay}.log"))
    }

    /// Starts relay `relay`; its output is appended to its log, restarts included.
    pub fn start(&mut self, relay: usize) -> Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log(relay));
        let log = log.ctx(self.log(relay).display())?;
        let stderr = log.try_clone().ctx("relay log")?;
        let child = Command::new(&self.binary)
            .arg("--config")
            .arg(&self.config)
            .arg("relay")
            .env("NO_COLOR", "1") // plain log files, searchable by text
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .ctx(self.binary.display())?;
        self.children[relay] = Some(child);
        Ok(())
    }

    /// kill -9, and reaps the process.
    pub async fn kill(&mut self, relay: usize) {
        if let Some(mut child) = self.children[relay].take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// SIGTERM, as at a shutdown (the relay gives its shards up), and waits for it to exit;
    /// killed after `grace`. Returns whether it exited on its own.
    pub async fn terminate(&mut self, relay: usize, grace: Duration) -> bool {
        let Some(mut child) = self.children[relay].take() else {
            return true;
        };
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        if tokio::time::timeout(grace, child.wait()).await.is_ok() {
            return true;
        }
        let _ = child.start_kill();
        let _ = child.wait().await;
        false
    }

    /// Relays that exited without being told to, with their status; their slots are freed.
    pub fn exited(&mut self) -> Vec<(usize, ExitStatus)> {
        let mut exited = Vec::new();
        for (relay, slot) in self.children.iter_mut().enumerate() {
            if let Some(child) = slot
                && let Ok(Some(status)) = child.try_wait()
            {
                exited.push((relay, status));
                *slot = None;
            }
        }
        exited
    }

    /// SIGTERM to every relay; one that has not exited after `grace` is killed. Returns the
    /// relays that had to be killed.
    pub async fn stop(&mut self, grace: Duration) -> Vec<usize> {
        for child in self.children.iter().flatten() {
            if let Some(pid) = child.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
        }
        let mut killed = Vec::new();
        for (relay, slot) in self.children.iter_mut().enumerate() {
            if let Some(mut child) = slot.take()
                && tokio::time::timeout(grace, child.wait()).await.is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
                killed.push(relay);
            }
        }
        killed
    }

    /// The last `lines` lines of a relay's log.
    pub fn tail(&self, relay: usize, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log(relay)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The sum of the numbers after `field` (as in `rows=12`) on the log lines of all relays
    /// that contain `needle`.
    pub fn sum_in_logs(&self, needle: &str, field: &str) -> u64 {
        (0..self.count())
            .map(|relay| {
                let text = std::fs::read_to_string(self.log(relay)).unwrap_or_default();
                text.lines()
                    .filter(|line| line.contains(needle))
                    .filter_map(|line| number_after(line, field))
                    .sum::<u64>()
            })
            .sum()
    }

    /// How many log lines of all relays contain `needle`.
    pub fn count_in_logs(&self, needle: &str) -> usize {
        (0..self.count())
            .map(|relay| {
                std::fs::read_to_string(self.log(relay))
                    .unwrap_or_default()
                    .lines()
                    .filter(|line| line.contains(needle))
                    .count()
            })
            .sum()
    }
}

/// The number right after `field` in `line`: `number_after("x rows=12 y", "rows=")` is 12.
fn number_after(line: &str, field: &str) -> Option<u64> {
    let rest = &line[line.find(field)? + field.len()..];
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..digits].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::number_after;

    #[test]
    fn number_after_reads_the_digits_after_the_field() {
        let line = "DEBUG outbox_postgres::log: removed delivered rows behind the cursors rows=128";
        assert_eq!(number_after(line, "rows="), Some(128));
        assert_eq!(number_after("rows=7 more", "rows="), Some(7));
        assert_eq!(number_after("no figure here", "rows="), None);
        assert_eq!(number_after("rows=x", "rows="), None);
    }
}
