//! The sink suite of outbox-testkit on the spool: each destination is a topic file in a
//! directory of this run's own.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::Sink;
use outbox_spool::{SpoolConfig, SpoolSink};
use outbox_testkit::{Destination, Received, SinkHarness};

/// Spools into a fresh directory under the system's temporary directory.
struct Spool {
    dir: PathBuf,
}

impl Spool {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "outbox-spool-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        Spool { dir }
    }

    fn sink(&self) -> SpoolSink {
        let config = SpoolConfig {
            max_payload: 64 * 1024,
            ..SpoolConfig::new(&self.dir)
        };
        SpoolSink::new(config).expect("valid settings")
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[async_trait]
impl SinkHarness for Spool {
    fn timeout(&self) -> Duration {
        Duration::from_secs(1)
    }

    async fn destination(&self) -> Destination {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        Destination {
            sink: Arc::new(self.sink()),
            topic: format!("topic-{}", NEXT.fetch_add(1, Ordering::Relaxed)),
        }
    }

    /// The file is complete once `publish` returned: no waiting.
    async fn read(&self, destination: &Destination, _at_least: usize) -> Vec<Received> {
        let lines = self
            .sink()
            .read(&destination.topic)
            .expect("reading the spool");
        lines
            .into_iter()
            .map(|line| Received {
                payload: line.payload().expect("hex payload"),
                headers: line.headers,
                key: line.key,
            })
            .collect()
    }

    /// No network address: the closed-port and silent-server checks skip.
    async fn sink_at(&self, _addr: &str) -> Option<Arc<dyn Sink>> {
        None
    }
}

outbox_testkit::sink_conformance_tests!(Spool::new());

/// The table and the macros agree: the whole suite in one call passes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_suite_in_one_call() {
    outbox_testkit::run_sink_suite(&Spool::new()).await;
}

/// A missing directory is an outage (retryable), not a lost message.
#[tokio::test]
async fn a_missing_directory_is_unavailable() {
    let spool = Spool::new();
    let sink = spool.sink();
    std::fs::remove_dir_all(&spool.dir).expect("removing the directory");
    let err = sink.health().await.expect_err("no directory");
    assert_eq!(err.kind(), outbox_core::ErrorKind::Unavailable, "{err}");
    let message = outbox_core::Message::from(outbox_core::NewMessage::new("t", "x"));
    let err = sink.publish(&[message]).await.expect_err("no directory");
    assert!(err.is_retryable(), "{err}");
}
