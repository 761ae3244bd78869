//! What is left of the claims audit (claims of docs/ARCHITECTURE.md and docs/guarantees.md
//! that no other test held the code to): the two tests that run a relay over real storages.
//! The audit's other tests moved to their subjects' homes (tests/README.md): the
//! storage-level checks to the conformance suite (`outbox-testkit/src/storage.rs`, run by
//! every storage harness), the worker tests on the in-memory storage and sink to
//! `outbox-core/src/worker/tests.rs`.
//!
//! `relay`: retries, dead letters and parking through a relay on the real PostgreSQL, SQLite
//! (a file) and MariaDB; it needs a relay, so it is not a storage check (a `relay_*` family
//! of the testkit would be its home).
//! `log_mode`: relays joining under load in PostgreSQL's log mode, in a database of its own.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::MemorySink;
use outbox_core::{
    CancellationToken, Error, Message, NewMessage, Outcome, Result, Sink, Storage, StorageAdmin,
    Worker, WorkerConfig,
};

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

fn payloads(messages: &[Message]) -> Vec<String> {
    messages.iter().map(|m| text(&m.payload)).collect()
}

/// Starts a worker in the background; cancel the token to stop it.
fn start(
    config: WorkerConfig,
    storage: Arc<dyn Storage>,
    sink: Arc<dyn Sink>,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let worker = Worker::new(config, storage, sink).expect("valid worker configuration");
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    (shutdown, handle)
}

mod relay {
    use super::*;
    use outbox_core::DeadLetterFilter;
    use outbox_tests::{TestOutbox, test_worker_config, unique_name};

    fn keyed(key: &str, payload: &str) -> NewMessage {
        NewMessage::new("t", payload.to_string()).key(key)
    }

    /// docs/ARCHITECTURE.md, `Temporary`: "charges an attempt; retries after backoff;
    /// dead-letters at `max_attempts`"; docs/guarantees.md: "its key's later messages
    /// (including new ones) are parked, then delivered in order after a replay". Through a
    /// relay: exactly `max_attempts` publishes of the poison message, none of its key's later
    /// ones meanwhile, and after the replay the key in order.
    async fn retry_accounting_and_parking_through_a_relay<S>(s: Arc<S>)
    where
        S: StorageAdmin + 'static,
    {
        s.enqueue(&[keyed("p", "p1"), keyed("p", "p2"), keyed("f", "f1")])
            .await
            .expect("enqueue");
        let sink = Arc::new(MemorySink::new());
        let tries = Arc::new(AtomicUsize::new(0));
        let poisoned = Arc::new(AtomicBool::new(true));
        sink.fail_when({
            let (tries, poisoned) = (tries.clone(), poisoned.clone());
            move |m| {
                (m.payload == b"p1" && poisoned.load(Ordering::SeqCst)).then(|| {
                    tries.fetch_add(1, Ordering::SeqCst);
                    Error::temporary("broker said no")
                })
            }
        });
        let cfg = WorkerConfig {
            max_attempts: 3,
            ..test_worker_config("claims")
        };
        let (shutdown, handle) = start(cfg, s.clone(), sink.clone());
        let wait = |what: &'static str, done: Box<dyn Fn(&outbox_core::QueueStats) -> bool>| {
            let s = s.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                loop {
                    let stats = s.stats().await.expect("stats");
                    if done(&stats) {
                        return;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "{what}: {stats:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        wait("p1 dead-lettered", Box::new(|st| st.dead_lettered == 1)).await;
        s.enqueue(&[keyed("p", "p3")]).await.expect("enqueue");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(tries.load(Ordering::SeqCst), 3, "publishes of p1");
        let dead = s
            .dead_letters(&DeadLetterFilter::default(), 10)
            .await
            .expect("dead letters");
        assert_eq!(dead.len(), 1);
        assert_eq!(
            dead[0].message.attempts, 3,
            "attempts recorded on the dead letter"
        );
        assert!(
            dead[0].last_error.contains("3 attempts") && dead[0].last_error.contains("said no"),
            "{}",
            dead[0].last_error
        );
        assert_eq!(
            payloads(&sink.published()),
            ["f1"],
            "p2 and p3 stay parked behind the dead letter"
        );
        poisoned.store(false, Ordering::SeqCst);
        assert_eq!(
            s.replay_dead_letters(&[dead[0].message.id]).await.unwrap(),
            1
        );
        wait(
            "drained",
            Box::new(|st| st.pending == 0 && st.in_flight == 0),
        )
        .await;
        shutdown.cancel();
        handle.await.expect("relay task");
        assert_eq!(
            payloads(&sink.published()),
            ["f1", "p1", "p2", "p3"],
            "after the replay the key goes in order"
        );
        assert_eq!(tries.load(Ordering::SeqCst), 3);
    }

    mod postgres {
        use super::*;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retry_accounting_and_parking_through_a_relay() {
            let outbox = TestOutbox::new().await;
            super::retry_accounting_and_parking_through_a_relay(outbox.storage.clone()).await;
        }
    }

    mod sqlite {
        use super::*;
        use outbox_sqlite::{SqliteConfig, SqliteStorage};
        use std::path::PathBuf;

        /// A fresh, migrated database file in a directory of its own, removed when dropped.
        struct File {
            dir: PathBuf,
            storage: Arc<SqliteStorage>,
        }

        impl File {
            async fn new() -> File {
                let dir = std::env::temp_dir().join(unique_name("outbox-claims"));
                std::fs::create_dir_all(&dir).expect("making a temporary directory");
                let storage = SqliteStorage::open(SqliteConfig::new(dir.join("app.db")))
                    .await
                    .expect("opening the file");
                storage.migrate().await.expect("migrating");
                File {
                    dir,
                    storage: Arc::new(storage),
                }
            }
        }

        impl Drop for File {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retry_accounting_and_parking_through_a_relay() {
            let f = File::new().await;
            super::retry_accounting_and_parking_through_a_relay(f.storage.clone()).await;
        }
    }

    mod mysql {
        use super::*;
        use outbox_mysql::{MySqlConfig, MySqlStorage};

        use outbox_tests::mysql_url;

        /// Tables of their own (`t_<random>`), migrated, dropped with the value.
        struct Tables(Arc<MySqlStorage>);

        impl Tables {
            async fn new() -> Tables {
                let config = MySqlConfig::new(mysql_url()).table(unique_name("t"));
                let storage = MySqlStorage::new(config).expect("valid test configuration");
                storage.migrate().await.unwrap_or_else(|e| {
                    panic!(
                        "MariaDB must be running at {} (`cargo xtask services`): {e}",
                        mysql_url()
                    )
                });
                Tables(Arc::new(storage))
            }
        }

        impl Drop for Tables {
            fn drop(&mut self) {
                outbox_tests::drop_mysql_tables(self.0.table());
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retry_accounting_and_parking_through_a_relay() {
            let t = Tables::new().await;
            super::retry_accounting_and_parking_through_a_relay(t.0.clone()).await;
        }
    }
}

mod log_mode {
    use super::*;
    use outbox_postgres::{PgStorage, PostgresConfig, StorageMode};
    use outbox_tests::{postgres_url, test_worker_config, unique_name};
    use sqlx::postgres::PgPoolOptions;

    /// A log-mode outbox in a database of its own (the horizon is per database), dropped
    /// with the value.
    struct LogDb {
        storage: Arc<PgStorage>,
        database: String,
    }

    impl LogDb {
        async fn new(shards: u32) -> LogDb {
            let server = postgres_url();
            let database = unique_name("outbox_claims");
            let admin = PgPoolOptions::new()
                .max_connections(1)
                .connect(&server)
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL must be running at {server}: {e}"));
            sqlx::query(&format!(r#"CREATE DATABASE "{database}""#))
                .execute(&admin)
                .await
                .expect("create the test's database");
            admin.close().await;
            let (base, _) = server.rsplit_once('/').expect("a URL with a database");
            let mut config = PostgresConfig::new(format!("{base}/{database}"));
            config.mode = StorageMode::Log;
            config.shards = shards;
            let storage = PgStorage::new(config).expect("valid test configuration");
            storage.migrate().await.expect("migrate for log mode");
            LogDb {
                storage: Arc::new(storage),
                database,
            }
        }

        /// Another relay's storage on the same table.
        fn another_relay(&self) -> Arc<PgStorage> {
            Arc::new(PgStorage::new(self.storage.config().clone()).expect("valid configuration"))
        }
    }

    impl Drop for LogDb {
        fn drop(&mut self) {
            let sql = format!(
                r#"DROP DATABASE IF EXISTS "{}" WITH (FORCE)"#,
                self.database
            );
            let url = postgres_url();
            // A runtime cannot block inside another: clean up from a thread with its own.
            let _ = std::thread::spawn(move || {
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
                    sqlx::query(&sql).execute(&pool).await.ok()
                })
            })
            .join();
        }
    }

    /// A [`MemorySink`] whose every call takes 5 ms, so a backlog lasts long enough for
    /// relays to join while it drains.
    struct Paced(MemorySink);

    #[async_trait]
    impl Sink for Paced {
        async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.0.publish(batch).await
        }
        async fn health(&self) -> Result<()> {
            self.0.health().await
        }
    }

    /// docs/ARCHITECTURE.md "Ownership and fencing": "When relays join, one above its share
    /// stops reading the shards it hands over, forgets what it read of them and never handed
    /// out, and gives each up once nothing of it is out (so the next owner redelivers
    /// nothing)". The existing four-relay test kills a relay too and so allows thousands of
    /// redeliveries; here nobody dies: two relays join one that owns every shard, under
    /// load, and every message must arrive exactly once, each key in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relays_joining_under_load_take_shards_over_without_redelivering() {
        let db = LogDb::new(8).await;
        let (keys, total) = (80, 8000);
        for chunk in (0..total).collect::<Vec<_>>().chunks(2000) {
            let batch: Vec<NewMessage> = chunk
                .iter()
                .map(|i| {
                    NewMessage::new("t", format!("{:05}", i / keys)).key(format!("k{}", i % keys))
                })
                .collect();
            db.storage.enqueue(&batch).await.expect("enqueue");
        }
        let sink = Arc::new(Paced(MemorySink::new()));
        let config = |name: &str| WorkerConfig {
            batch_size: 100,
            lease: Duration::from_secs(2),
            ..test_worker_config(name)
        };
        let first = db.another_relay();
        let mut relays = vec![start(config("w0"), first.clone(), sink.clone())];
        while sink.0.published().len() < total / 8 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            first.owned_shards().await.len(),
            8,
            "w0 alone owns every shard"
        );
        let late: Vec<Arc<PgStorage>> = (0..2).map(|_| db.another_relay()).collect();
        for (i, storage) in late.iter().enumerate() {
            relays.push(start(
                config(&format!("w{}", i + 1)),
                storage.clone(),
                sink.clone(),
            ));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut joined = false;
        let mut joined_at = 0;
        loop {
            if !joined {
                let mut all = true;
                for storage in &late {
                    all &= !storage.owned_shards().await.is_empty();
                }
                joined = all;
                if joined {
                    joined_at = sink.0.published().len();
                }
            }
            let published = sink.0.published().len();
            if joined && published >= total {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "after 60 s: joined {joined}, {published} of {total} published"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Anything redelivered would arrive shortly after the last first delivery.
        tokio::time::sleep(Duration::from_secs(3)).await;
        for (shutdown, handle) in relays {
            shutdown.cancel();
            handle.await.expect("relay task");
        }
        let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let published = sink.0.published();
        for m in &published {
            by_key
                .entry(m.key.clone().unwrap_or_default())
                .or_default()
                .push(text(&m.payload));
        }
        let expected: Vec<String> = (0..total / keys).map(|i| format!("{i:05}")).collect();
        for (key, got) in &by_key {
            assert_eq!(got, &expected, "key {key}: duplicates or order broken");
        }
        assert_eq!(published.len(), total, "each message exactly once");
        assert!(
            joined_at < total * 3 / 4,
            "the joining relays got their shards only after {joined_at} of {total} were \
             published: the hand-over did not happen under load"
        );
    }
}
