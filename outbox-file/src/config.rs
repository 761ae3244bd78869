//! Settings of the `file` and `stdout` sinks.

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Error, Result};

/// The shortest `publish_timeout` either sink accepts.
const MIN_TIMEOUT: Duration = Duration::from_millis(10);

/// Settings of the `file` sink: the `[sink]` table of the relay's configuration file
/// (`type = "file"`, durations written `"5s"` or `"500ms"`, unknown keys refused) and the
/// Rust API alike. `path` is required; the other keys have defaults.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    /// The file the messages are appended to, one JSON line each. It is created if missing;
    /// its directory must exist (checked at start-up). A relative path is relative to the
    /// relay's working directory.
    pub path: PathBuf,
    /// Whether each batch is synced to the disk (`fdatasync`) before it is reported
    /// delivered (default true). Without it a crash of the machine (not of the relay) can
    /// lose batches the relay took as delivered.
    pub sync: bool,
    /// Longest wait for one batch to be written and synced (default 5 s). A slower disk
    /// counts as unavailable: the batch is released uncharged. Keep it shorter than the
    /// worker's lease.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
}

impl Default for FileConfig {
    fn default() -> Self {
        FileConfig {
            path: PathBuf::new(),
            sync: true,
            publish_timeout: Duration::from_secs(5),
        }
    }
}

impl Settings for FileConfig {
    /// Checks every setting; the error is keyed by the bad one (the caller places it in its
    /// section with [`Error::in_section`]). Looks at the file system: the directory of
    /// `path` must exist, and `path`, if it exists, must be a regular file.
    fn validate(&self) -> Result<()> {
        if self.path.as_os_str().is_empty() {
            return Err(Error::setting(
                "path",
                "is missing; give the file to append the messages to, e.g. \
                 path = \"/var/lib/outbox/messages.jsonl\"",
            ));
        }
        let shown = self.path.display();
        if self.path.file_name().is_none() {
            return Err(Error::setting(
                "path",
                format!("`{shown}` names a directory, not a file; add the file's name"),
            ));
        }
        let directory = directory_of(&self.path);
        match std::fs::metadata(directory) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(Error::setting(
                    "path",
                    format!("`{shown}`: `{}` is not a directory", directory.display()),
                ));
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::setting(
                    "path",
                    format!(
                        "`{shown}`: the directory `{}` does not exist; create it (the sink \
                         creates the file, not its directory)",
                        directory.display()
                    ),
                ));
            }
            Err(error) => {
                return Err(Error::setting(
                    "path",
                    format!(
                        "`{shown}`: cannot look at the directory `{}`: {error}",
                        directory.display()
                    ),
                ));
            }
        }
        match std::fs::metadata(&self.path) {
            Ok(meta) if meta.is_dir() => {
                return Err(Error::setting(
                    "path",
                    format!("`{shown}` is a directory; give a file inside it"),
                ));
            }
            Ok(meta) if !meta.is_file() => {
                return Err(Error::setting(
                    "path",
                    format!(
                        "`{shown}` is not a regular file (a device, pipe or socket); this sink \
                         appends to regular files (type = \"stdout\" writes to standard output)"
                    ),
                ));
            }
            // A file to append to, or none yet (made on the first write); anything else
            // (permissions) shows up as unavailable from the health check.
            _ => {}
        }
        outbox_core::config::check_publish_timeout(self.publish_timeout, MIN_TIMEOUT)
    }
}

impl FileConfig {
    /// Defaults for appending to `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileConfig {
            path: path.into(),
            ..Self::default()
        }
    }
}

outbox_core::setters!(FileConfig {
    /// Sets whether each batch is synced to the disk before it is reported delivered.
    sync(sync: bool) => sync = sync;
    /// Sets the longest wait for one batch to be written (and synced).
    publish_timeout(timeout: Duration) => publish_timeout = timeout;
});

/// The directory `path` sits in (`.` for a bare file name).
pub(crate) fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// Settings of the `stdout` sink: the `[sink]` table of the relay's configuration file
/// (`type = "stdout"`, unknown keys refused) and the Rust API alike.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StdoutConfig {
    /// Longest wait for standard output to take one batch (default 5 s). Output that is
    /// not read (a full pipe) counts as unavailable: the batch is released uncharged.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
}

impl Default for StdoutConfig {
    fn default() -> Self {
        StdoutConfig {
            publish_timeout: Duration::from_secs(5),
        }
    }
}

impl Settings for StdoutConfig {
    /// Checks every setting; the error is keyed by the bad one.
    fn validate(&self) -> Result<()> {
        outbox_core::config::check_publish_timeout(self.publish_timeout, MIN_TIMEOUT)
    }
}

outbox_core::setters!(StdoutConfig {
    /// Sets the longest wait for standard output to take one batch.
    publish_timeout(timeout: Duration) => publish_timeout = timeout;
});

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::TempDir;
    use outbox_core::ErrorKind;

    fn error_of(result: Result<impl std::fmt::Debug>) -> String {
        let error = result.unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Config, "{error}");
        error.in_section("sink").message().to_string()
    }

    #[test]
    fn reads_json_with_defaults_and_durations() {
        let dir = TempDir::new();
        let path = dir.path().join("out.jsonl");
        let config = FileConfig::from_value(serde_json::json!({ "path": path })).unwrap();
        assert_eq!(config, FileConfig::new(&path));
        assert!(config.sync, "sync is on by default");
        assert_eq!(config.publish_timeout, Duration::from_secs(5));
        let config = FileConfig::from_value(serde_json::json!({
            "path": path, "sync": false, "publish_timeout": "250ms",
        }))
        .unwrap();
        assert!(!config.sync);
        assert_eq!(config.publish_timeout, Duration::from_millis(250));

        let config = StdoutConfig::from_value(serde_json::json!({})).unwrap();
        assert_eq!(config.publish_timeout, Duration::from_secs(5));
        let config = StdoutConfig::from_value(serde_json::json!({ "publish_timeout": "1s" }));
        assert_eq!(config.unwrap().publish_timeout, Duration::from_secs(1));
    }

    #[test]
    fn refused_values_name_their_key() {
        let dir = TempDir::new();
        let path = dir.path().join("out.jsonl");
        outbox_testkit::check_sink_settings_refused::<FileConfig>([
            (serde_json::json!({}), "sink.path is missing"),
            (
                serde_json::json!({ "path": path, "fsync": true }),
                "sink.fsync: unknown field `fsync`",
            ),
            (
                serde_json::json!({ "path": path, "sync": "yes" }),
                "sink.sync: invalid type",
            ),
            (
                serde_json::json!({ "path": path, "publish_timeout": "soon" }),
                "sink.publish_timeout: ",
            ),
            (
                serde_json::json!({ "path": path, "publish_timeout": "0s" }),
                "sink.publish_timeout is 0ns",
            ),
        ]);
        let directory = error_of(FileConfig::from_value(
            serde_json::json!({ "path": dir.path() }),
        ));
        assert!(directory.contains("is a directory"), "{directory}");

        outbox_testkit::check_sink_settings_refused::<StdoutConfig>([
            (
                serde_json::json!({ "path": "/tmp/x" }),
                "sink.path: unknown field `path`",
            ),
            (
                serde_json::json!({ "publish_timeout": 5 }),
                "sink.publish_timeout: ",
            ),
            (
                serde_json::json!({ "publish_timeout": "1ms" }),
                "sink.publish_timeout is 1ms",
            ),
        ]);
    }

    #[test]
    fn a_missing_directory_is_a_config_error_naming_path() {
        let dir = TempDir::new();
        let path = dir.path().join("not-made").join("out.jsonl");
        let error = error_of(FileConfig::from_value(serde_json::json!({ "path": path })));
        assert!(error.starts_with("sink.path `"), "{error}");
        assert!(
            error.contains("not-made` does not exist; create it"),
            "{error}"
        );
        // The same from the Rust API, without a section.
        let error = FileConfig::new(&path).validate().unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Config);
        assert!(error.message().starts_with("path `"), "{error}");
        // A file where the directory should be.
        std::fs::write(dir.path().join("plain"), "").unwrap();
        let path = dir.path().join("plain").join("out.jsonl");
        let error = FileConfig::new(&path).validate().unwrap_err();
        assert!(error.message().contains("is not a directory"), "{error}");
    }

    #[cfg(unix)]
    #[test]
    fn a_device_is_refused() {
        let error = FileConfig::new("/dev/null").validate().unwrap_err();
        assert!(
            error
                .message()
                .starts_with("path `/dev/null` is not a regular file"),
            "{error}"
        );
    }

    #[test]
    fn a_bare_file_name_is_in_the_working_directory() {
        assert_eq!(directory_of(Path::new("out.jsonl")), Path::new("."));
        assert_eq!(directory_of(Path::new("a/out.jsonl")), Path::new("a"));
        assert_eq!(directory_of(Path::new("/out.jsonl")), Path::new("/"));
    }
}
