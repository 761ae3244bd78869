//! Shared support for the integration suites: a fresh, migrated outbox schema per test,
//! relays running in the background, and a TCP proxy that tests cut to simulate outages.
//!
//! Every test talks to the real services. A server that is not there makes the test fail
//! with a message naming it; nothing is skipped.

pub mod conformance;
pub mod kafka;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{Backoff, CancellationToken, NewMessage, QueueStats, Sink, Worker, WorkerConfig};
use outbox_postgres::{OutboxTable, PgStorage, PostgresConfig};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::net::{TcpListener, TcpStream};

/// PostgreSQL for tests: `$OUTBOX_TEST_POSTGRES_URL`, or the local server's `test` database.
pub fn postgres_url() -> String {
    std::env::var("OUTBOX_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// A name no other test uses: `prefix`, an underscore and 16 random hex digits.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{:016x}", fastrand::u64(..))
}

/// The `host:port` of a server URL such as `amqp://user:password@host:5672/vhost`, for
/// putting a [`Proxy`] in front of it.
pub fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority
        .rsplit('@')
        .next()
        .unwrap_or(authority)
        .to_string()
}

/// Worker settings for tests: fast polling and short backoff.
pub fn test_worker_config(worker_id: &str) -> WorkerConfig {
    WorkerConfig {
        poll_interval: Duration::from_millis(50),
        backoff: Backoff {
            initial: Duration::from_millis(50),
            multiplier: 2.0,
            max: Duration::from_millis(500),
            jitter: 0.2,
        },
        shutdown_timeout: Duration::from_secs(5),
        ..WorkerConfig::new(worker_id)
    }
}

/// An outbox in a schema of its own, migrated, dropped again when the value is dropped.
pub struct TestOutbox {
    /// The table names and enqueue statements.
    pub table: OutboxTable,
    /// A pool for the application side (enqueueing, inspecting).
    pub pool: PgPool,
    /// The relay side.
    pub storage: Arc<PgStorage>,
}

impl TestOutbox {
    /// A fresh outbox with the default settings (per-key order on, wake-up on).
    pub async fn new() -> TestOutbox {
        Self::with_config(|_| {}).await
    }

    /// A fresh outbox whose settings `adjust` may change (the schema is already unique).
    pub async fn with_config(adjust: impl FnOnce(&mut PostgresConfig)) -> TestOutbox {
        let url = postgres_url();
        let mut config = PostgresConfig::new(&url).table(unique_name("t"), "outbox");
        adjust(&mut config);
        let storage = PgStorage::new(config).expect("valid test configuration");
        if let Err(error) = storage.migrate().await {
            panic!(
                "PostgreSQL must be running at {url} (start it with `cargo xtask services`): {error}"
            );
        }
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL must be running at {url}: {e}"));
        TestOutbox {
            table: storage.table().clone(),
            pool,
            storage: Arc::new(storage),
        }
    }

    /// Enqueues `messages` in one committed transaction.
    pub async fn enqueue(&self, messages: &[NewMessage]) {
        let mut tx = self.pool.begin().await.expect("begin");
        self.table
            .enqueue_many(&mut tx, messages)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }

    /// Starts a relay with [`test_worker_config`].
    pub fn relay(&self, worker_id: &str, sink: Arc<dyn Sink>) -> Relay {
        self.relay_with(test_worker_config(worker_id), sink)
    }

    /// Starts a relay with the given settings.
    pub fn relay_with(&self, config: WorkerConfig, sink: Arc<dyn Sink>) -> Relay {
        let worker =
            Worker::new(config, self.storage.clone(), sink).expect("valid worker configuration");
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { worker.run(shutdown).await }
        });
        Relay { shutdown, handle }
    }

    /// Queue figures.
    pub async fn stats(&self) -> QueueStats {
        outbox_core::Storage::stats(&*self.storage)
            .await
            .expect("queue figures")
    }

    /// Waits until nothing is pending or in flight; panics with the figures on time-out.
    pub async fn wait_until_drained(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let stats = self.stats().await;
            if stats.pending == 0 && stats.in_flight == 0 {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!("outbox not drained after {timeout:?}: {stats:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The attempts column of every message in the outbox, in enqueue order.
    pub async fn attempts(&self) -> Vec<i32> {
        sqlx::query_scalar(&format!(
            "SELECT attempts FROM {} ORDER BY seq",
            self.table.qualified("")
        ))
        .fetch_all(&self.pool)
        .await
        .expect("read attempts")
    }

    /// Dead letters as (id, last error), oldest first.
    pub async fn dead_letters(&self) -> Vec<(uuid::Uuid, String)> {
        self.storage
            .dead_letters(100_000)
            .await
            .expect("dead letters")
            .into_iter()
            .map(|d| (d.message.id, d.last_error))
            .collect()
    }
}

impl Drop for TestOutbox {
    fn drop(&mut self) {
        drop_schemas(&[self.table.schema().to_string()]);
    }
}

/// Drops these schemas and everything in them, from any context (a `Drop` inside a test's
/// runtime included); errors are ignored, as in a clean-up.
pub fn drop_schemas(schemas: &[String]) {
    let sql: Vec<String> = schemas
        .iter()
        .map(|s| format!(r#"DROP SCHEMA IF EXISTS "{s}" CASCADE"#))
        .collect();
    let url = postgres_url();
    // A runtime cannot block inside another: clean up from a thread with its own.
    let cleanup = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        runtime.block_on(async {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect(&url)
                .await
                .ok()?;
            for statement in sql {
                sqlx::query(&statement).execute(&pool).await.ok()?;
            }
            Some(())
        })
    });
    let _ = cleanup.join();
}

/// A relay running in the background.
pub struct Relay {
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Shuts the relay down gracefully and waits for it.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.handle.await.expect("relay task panicked");
    }
}

/// A TCP proxy in front of a real server, which a test cuts to simulate an outage without
/// stopping the shared server.
pub struct Proxy {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    connections: Arc<Mutex<CancellationToken>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let up = Arc::new(AtomicBool::new(true));
        let connections = Arc::new(Mutex::new(CancellationToken::new()));
        let target = target.to_string();
        let accept = tokio::spawn({
            let (up, connections) = (up.clone(), connections.clone());
            async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if !up.load(Ordering::SeqCst) {
                        drop(inbound); // cut: close at once
                        continue;
                    }
                    let cut = connections.lock().expect("proxy lock").clone();
                    let target = target.clone();
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(&target).await else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.cancelled() => {}
                        }
                    });
                }
            }
        });
        Proxy {
            addr,
            up,
            connections,
            accept,
        }
    }

    /// The address clients should use instead of the server's: `127.0.0.1:port`.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Drops every live connection and closes new ones at once.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        let old = std::mem::replace(
            &mut *self.connections.lock().expect("proxy lock"),
            CancellationToken::new(),
        );
        old.cancel();
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.connections.lock().map(|c| c.cancel()).ok();
    }
}
