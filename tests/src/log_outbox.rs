//! A log-mode outbox in a database of its own, for the log-mode suites
//! (`tests/tests/postgres_log.rs`, `postgres_log_replica.rs`, the horizon claims).

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Sink, WorkerConfig};
use outbox_postgres::{PgStorage, PostgresConfig, StorageMode};
use sqlx::postgres::PgPoolOptions;

use crate::{PgOutbox, Relay, Service, drop_database, postgres_url, unique_name};

/// A log-mode outbox in a database of its own (the readable horizon is per database, so
/// one test's open transactions never delay another's), dropped with it. It dereferences to
/// its [`PgOutbox`] (table, pool on the primary, storage; enqueue, relays, figures).
pub struct LogOutbox {
    outbox: PgOutbox,
    /// The URL of the test's database.
    pub url: String,
    /// The test's database, on the server of [`postgres_url`].
    pub database: String,
}

impl std::ops::Deref for LogOutbox {
    type Target = PgOutbox;

    fn deref(&self) -> &PgOutbox {
        &self.outbox
    }
}

impl LogOutbox {
    /// A fresh database with a log-mode outbox of `shards` shards; `adjust` may change the
    /// settings further.
    pub async fn new(shards: u32, adjust: impl FnOnce(&mut PostgresConfig)) -> LogOutbox {
        Self::in_database(unique_name("outbox_log"), shards, adjust).await
    }

    /// [`LogOutbox::new`] in a database named `database` (made here, so a name of
    /// [`unique_name`]'s), for settings that name it, such as a replica's URL. A PostgreSQL
    /// that is not running fails the test with its address ([`Service::missing`]).
    pub async fn in_database(
        database: String,
        shards: u32,
        adjust: impl FnOnce(&mut PostgresConfig),
    ) -> LogOutbox {
        let server = postgres_url();
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&server)
            .await
            .unwrap_or_else(|e| Service::Postgres.missing(e));
        sqlx::query(&format!(r#"CREATE DATABASE "{database}""#))
            .execute(&admin)
            .await
            .expect("create the test's database");
        admin.close().await;
        let url = with_database(&server, &database);
        let mut config = PostgresConfig::new(&url);
        config.mode = StorageMode::Log;
        config.shards = shards;
        adjust(&mut config);
        let storage = PgStorage::new(config).expect("valid test configuration");
        storage.migrate().await.expect("migrate for log mode");
        LogOutbox {
            outbox: PgOutbox::connect(storage, &url).await,
            url,
            database,
        }
    }

    /// Another relay's storage on the same table (its own shards and memory).
    pub fn another_relay(&self) -> Arc<PgStorage> {
        Arc::new(PgStorage::new(self.storage.config().clone()).expect("valid configuration"))
    }

    /// Starts a worker over `storage` (this outbox's or [`LogOutbox::another_relay`]'s) with
    /// `config`.
    pub fn relay_on(
        &self,
        storage: Arc<PgStorage>,
        config: WorkerConfig,
        sink: Arc<dyn Sink>,
    ) -> Relay {
        Relay::start(config, storage, sink)
    }

    /// Rows in the log not yet behind a cursor, and rows kept aside, counted in SQL on the
    /// primary: what any process sees.
    pub async fn undelivered(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT (SELECT count(*) FROM {o} o JOIN {s} s ON s.shard = o.shard
                     WHERE (o.xid, o.seq) > (s.cursor_xid, s.cursor_seq))
                  + (SELECT count(*) FROM {h})",
            o = self.table.qualified(""),
            s = self.table.qualified("_shards"),
            h = self.table.qualified("_held"),
        ))
        .fetch_one(&self.pool)
        .await
        .expect("count undelivered rows")
    }

    /// Rows in the log, behind a cursor or not.
    pub async fn log_rows(&self) -> i64 {
        let sql = format!("SELECT count(*) FROM {}", self.table.qualified(""));
        sqlx::query_scalar(&sql)
            .fetch_one(&self.pool)
            .await
            .expect("count the log's rows")
    }

    /// Waits until every row is behind a cursor and nothing is kept aside.
    pub async fn wait_until_delivered(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = self.undelivered().await;
            if left == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{left} rows not delivered after {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until no key is parked: the owner unparks a released or replayed key on its
    /// next claim after the key's kept rows are all delivered.
    pub async fn wait_until_unparked(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.stats().await.parked_keys > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a key stayed parked"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for LogOutbox {
    fn drop(&mut self) {
        drop_database(&self.database);
    }
}

/// `url` with its database replaced by `database` (a query string is kept).
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    match base.rsplit_once('/') {
        Some((server, _)) => format!("{server}/{database}{query}"),
        None => panic!("postgres URL without a database: {url}"),
    }
}
