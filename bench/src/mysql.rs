//! MySQL / MariaDB: relays draining a preloaded outbox table (1, 2 and 4 relays, key order
//! on and off, to no sink and to Redis), against a bare `SELECT … FOR UPDATE SKIP LOCKED` +
//! `DELETE` loop on the same kind of table measured in the same run. Every drain has tables
//! of its own in database `test` (`OUTBOX_TEST_MYSQL_URL` overrides the server), dropped
//! afterwards.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use outbox_core::{NewMessage, Worker, WorkerConfig};
use outbox_mysql::sqlx::{self, MySqlPool, Row};
use outbox_mysql::{MySqlConfig, MySqlStorage, OutboxTable};

use crate::baselines;
use crate::drain::{self, BATCH};
use crate::report::Report;
use crate::setup::{CountingSink, SinkKind, text};
use crate::{Scale, median};

// test-support's list of services, read here without depending on the crate; the
// benchmark uses only the MySQL URL of it.
#[allow(dead_code)]
#[path = "../../test-support/src/service.rs"]
mod service;

/// `$OUTBOX_TEST_MYSQL_URL`, or the local server's `test` database.
fn mysql_url() -> String {
    service::Service::MySql.url()
}

/// A fresh, migrated outbox table of its own.
struct Table {
    name: String,
    table: OutboxTable,
    pool: MySqlPool,
}

impl Table {
    async fn new() -> Result<Self, String> {
        let name = format!("bench_{:016x}", fastrand::u64(..));
        let storage =
            MySqlStorage::new(MySqlConfig::new(mysql_url()).table(&name)).map_err(text)?;
        storage
            .migrate()
            .await
            .map_err(|e| format!("MariaDB at {} (`cargo xtask services`): {e}", mysql_url()))?;
        let pool = MySqlPool::connect(&mysql_url()).await.map_err(text)?;
        Ok(Table {
            name,
            table: storage.table().clone(),
            pool,
        })
    }

    fn config(&self, per_key_order: bool) -> MySqlConfig {
        let mut config = MySqlConfig::new(mysql_url()).table(&self.name);
        config.per_key_order = per_key_order;
        config
    }

    /// `n` messages with 200-byte payloads over `keys` keys, 500 per statement.
    async fn preload(&self, n: u64, keys: u64) -> Result<(), String> {
        let payload = vec![b'x'; 200];
        let messages: Vec<NewMessage> = (0..n)
            .map(|i| NewMessage::new("bench", payload.clone()).key(format!("k{}", i % keys)))
            .collect();
        let mut conn = self.pool.acquire().await.map_err(text)?;
        for chunk in messages.chunks(5_000) {
            let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(text)?;
            self.table
                .enqueue_many(&mut tx, chunk)
                .await
                .map_err(text)?;
            tx.commit().await.map_err(text)?;
        }
        Ok(())
    }

    async fn count(&self) -> Result<i64, String> {
        sqlx::query(&format!(
            "SELECT COUNT(*) FROM {}",
            self.table.qualified("")
        ))
        .fetch_one(&self.pool)
        .await
        .and_then(|row| row.try_get(0))
        .map_err(text)
    }

    async fn drop_tables(self) {
        if let Err(e) = sqlx::query(&self.table.drop_sql())
            .execute(&self.pool)
            .await
        {
            eprintln!("warning: dropping {}: {e}", self.name);
        }
    }
}

/// The ceiling: on one connection, in a transaction per batch, `SELECT` the oldest 500 rows
/// (every column) `FOR UPDATE SKIP LOCKED`, `DELETE` them by `seq`, commit. MySQL has no
/// `DELETE … RETURNING` with `SKIP LOCKED`, so this is the least a claim-and-remove costs.
async fn bare_delete(scale: Scale) -> Result<f64, String> {
    let table = Table::new().await?;
    table.preload(scale.drain_messages, scale.keys).await?;
    let t = table.table.qualified("");
    let select = format!("SELECT * FROM {t} ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED");
    let mut conn = table.pool.acquire().await.map_err(text)?;
    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *conn)
        .await
        .map_err(text)?;
    let rate = baselines::rows_per_second(async || {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(text)?;
        let rows = sqlx::query(&select)
            .bind(BATCH as i64)
            .fetch_all(&mut *tx)
            .await
            .map_err(text)?;
        if rows.is_empty() {
            return Ok(0);
        }
        let seqs: Vec<i64> = rows
            .iter()
            .map(|r| r.try_get::<i64, _>("seq"))
            .collect::<Result<_, _>>()
            .map_err(text)?;
        let delete = format!(
            "DELETE FROM {t} WHERE seq IN ({})",
            vec!["?"; seqs.len()].join(", ")
        );
        let mut query = sqlx::query(&delete);
        for seq in &seqs {
            query = query.bind(seq);
        }
        query.execute(&mut *tx).await.map_err(text)?;
        tx.commit().await.map_err(text)?;
        Ok(seqs.len())
    })
    .await?;
    drop(conn);
    table.drop_tables().await;
    Ok(rate)
}

/// A fresh preloaded table, `relays` relays (each with its own pool and sink) draining it.
async fn one_drain(
    scale: Scale,
    kind: SinkKind,
    relays: usize,
    per_key_order: bool,
) -> Result<f64, String> {
    let table = Table::new().await?;
    table.preload(scale.drain_messages, scale.keys).await?;
    let run = format!("{}-{}", table.name, kind.name());
    kind.prepare(&run).await?;
    let delivered = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for i in 0..relays {
        let storage = Arc::new(MySqlStorage::new(table.config(per_key_order)).map_err(text)?);
        let sink = Arc::new(CountingSink {
            inner: kind.build(&run)?,
            delivered: delivered.clone(),
        });
        let config = WorkerConfig {
            batch_size: BATCH,
            poll_interval: Duration::from_millis(50),
            ..WorkerConfig::new(format!("bench-{i}"))
        };
        workers.push(Worker::new(config, storage, sink).map_err(text)?);
    }
    let what = format!("mysql drain to {}", kind.name());
    let drained = drain::run_workers(workers, &delivered, scale.drain_messages, &what).await?;
    let left = table.count().await?;
    if left != 0 {
        eprintln!("warning: {what}: {left} messages still in the outbox after the drain");
    }
    kind.cleanup(&run).await?;
    table.drop_tables().await;
    Ok(drained.rate)
}

pub async fn run(scale: Scale, report: &mut Report) -> Result<(), String> {
    let n = scale.drain_messages;
    let version: String = {
        let pool = MySqlPool::connect(&mysql_url())
            .await
            .map_err(|e| format!("MariaDB at {} (`cargo xtask services`): {e}", mysql_url()))?;
        sqlx::query_scalar("SELECT CAST(VERSION() AS CHAR)")
            .fetch_one(&pool)
            .await
            .map_err(text)?
    };
    report
        .machine
        .push_str(&format!("; MySQL/MariaDB {version}"));
    println!(
        "\n== mysql ({version}): {n} messages of 200 bytes over {} keys, batches of {BATCH} ==",
        scale.keys
    );
    let bare = median(drain::repeat(scale.runs, || bare_delete(scale)).await?);
    report.add_bare_ceiling("mysql", "SELECT … FOR UPDATE SKIP LOCKED + DELETE", bare);
    for kind in [SinkKind::Null, SinkKind::Redis] {
        for per_key_order in [false, true] {
            for relays in [1, 2, 4] {
                let name = format!(
                    "{relays} relay{} → {}, key order {}",
                    if relays == 1 { "" } else { "s" },
                    kind.name(),
                    if per_key_order { "on" } else { "off" }
                );
                let rates =
                    drain::repeat(scale.runs, || one_drain(scale, kind, relays, per_key_order))
                        .await?;
                report.add(
                    "mysql",
                    &name,
                    median(rates),
                    "events/s",
                    Some(("bare delete", bare)),
                );
            }
        }
    }
    Ok(())
}
