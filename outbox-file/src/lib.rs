#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod error;
mod sink;
pub mod wire;

use std::sync::Arc;

use outbox_core::{Error, Sink, SinkRegistry};

pub use config::{FileConfig, StdoutConfig};
pub use sink::{FileSink, StdoutSink};

/// The base64 crate, re-exported so consumers and tests need no dependency of their own:
/// a payload that is not UTF-8 is written with `base64::engine::general_purpose::STANDARD`.
pub use base64;

/// The type name of the file sink in the relay's configuration: `[sink] type = "file"`.
pub const TYPE: &str = "file";

/// The type name of the standard output sink: `[sink] type = "stdout"`.
pub const STDOUT_TYPE: &str = "stdout";

/// Registers both sinks: [`TYPE`] (a [`FileSink`] built from a [`FileConfig`]) and
/// [`STDOUT_TYPE`] (a [`StdoutSink`] on the process's standard output, from a
/// [`StdoutConfig`]). The factories read the `[sink]` table (see
/// [`Settings::from_value`](outbox_core::config::Settings::from_value); errors are keyed by
/// the setting, relative to the section). The file sink's factory looks at the file system
/// (the directory of `path` must exist) off the async threads; it does not open the file
/// yet.
pub fn register(registry: &mut SinkRegistry) {
    use outbox_core::config::Settings;
    registry.register(TYPE, |config| async move {
        let build = move || FileSink::new(FileConfig::from_value(config)?);
        let sink = tokio::task::spawn_blocking(build).await.map_err(|error| {
            Error::config("file: the configuration check failed").with_source(error)
        })??;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    });
    registry.register_settings(STDOUT_TYPE, |config: StdoutConfig| async move {
        let sink = StdoutSink::new(config)?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use outbox_core::{Message, NewMessage, Outcome};

    use super::*;

    /// A directory of a test's own under the system's temporary directory, removed when
    /// dropped.
    pub(crate) struct TempDir(PathBuf);

    impl TempDir {
        pub(crate) fn new() -> TempDir {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or_default();
            let name = format!(
                "outbox-file-{}-{nanos}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            std::fs::create_dir_all(&path).expect("make a temporary directory");
            TempDir(path)
        }

        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn registers_both_types_with_factories_that_name_bad_keys() {
        let dir = TempDir::new();
        let path = dir.path().join("out.jsonl");
        let mut registry = SinkRegistry::new();
        register(&mut registry);
        assert_eq!(registry.names(), [TYPE, STDOUT_TYPE]);

        let file = registry
            .build(
                TYPE,
                serde_json::json!({ "path": path, "publish_timeout": "2s" }),
            )
            .await
            .unwrap();
        assert_eq!(
            file.publish_timeout(),
            Some(std::time::Duration::from_secs(2))
        );
        file.health().await.unwrap();
        let message = Message::from(NewMessage::new("orders", "{}"));
        let outcomes = file.publish(std::slice::from_ref(&message)).await.unwrap();
        assert!(
            matches!(&outcomes[..], [Outcome::Delivered(r)] if r.0 == "0"),
            "{outcomes:?}"
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(&message.id.to_string()), "{text}");

        let stdout = registry.build(STDOUT_TYPE, serde_json::json!({})).await;
        let stdout = stdout.unwrap();
        stdout.health().await.unwrap();
        assert!(!stdout.capabilities().deduplicates);

        for (type_name, table, expected) in [
            (
                TYPE,
                serde_json::json!({ "path": path, "fsync": false }),
                "sink.fsync: unknown field",
            ),
            (
                TYPE,
                serde_json::json!({ "path": path, "sync": "always" }),
                "sink.sync: invalid type",
            ),
            (TYPE, serde_json::json!({}), "sink.path is missing"),
            (
                STDOUT_TYPE,
                serde_json::json!({ "path": path }),
                "sink.path: unknown field `path`",
            ),
            (
                STDOUT_TYPE,
                serde_json::json!({ "publish_timeout": "often" }),
                "sink.publish_timeout: ",
            ),
        ] {
            let error = outbox_testkit::refused_sink_build(&registry, type_name, table).await;
            assert!(error.message().starts_with(expected), "{error}");
        }
        let gone = dir.path().join("none").join("out.jsonl");
        let table = serde_json::json!({ "path": gone });
        let no_dir = outbox_testkit::refused_sink_build(&registry, TYPE, table).await;
        let no_dir = no_dir.message();
        assert!(no_dir.starts_with("sink.path `"), "{no_dir}");
        assert!(no_dir.contains("does not exist; create it"), "{no_dir}");
    }
}
