//! Enqueue cost: commits per second from 16 writers of single-message transactions, with
//! the wake-up in each of its states, against the same table without the trigger.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{NewMessage, WorkerConfig};

use crate::report::Report;
use crate::setup::{BenchOutbox, NullSink, spawn_relay, text};
use crate::{Scale, drain, median};

/// The writers of every enqueue measurement.
pub const WRITERS: usize = 16;

/// How the wake-up is set while the writers commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// No wake-up trigger on the table at all: the baseline.
    NoTrigger,
    /// Trigger present, relay busy: writers read the flag and do not notify.
    Quiet,
    /// Every commit notifies (the flag stuck on): the worst case.
    EveryCommit,
    /// A relay draining meanwhile, wake-up off.
    RelayPolling,
    /// A relay draining meanwhile, wake-up on.
    RelayWakeup,
}

pub async fn run(scale: Scale, report: &mut Report) -> Result<(), String> {
    println!("\n== enqueue cost: {WRITERS} writers, single-message transactions ==");
    let modes = [
        Mode::NoTrigger,
        Mode::Quiet,
        Mode::EveryCommit,
        Mode::RelayPolling,
        Mode::RelayWakeup,
    ];
    let mut rates = Vec::new();
    for mode in modes {
        let runs = drain::repeat(scale.runs, || enqueue_run(mode, scale.enqueue_duration)).await?;
        rates.push((mode, median(runs)));
    }
    let baseline = rates[0].1;
    for (mode, rate) in rates {
        report.add(
            "enqueue",
            &format!("{mode:?}"),
            rate,
            "commits/s",
            Some(("NoTrigger", baseline)),
        );
    }
    Ok(())
}

async fn enqueue_run(mode: Mode, duration: Duration) -> Result<f64, String> {
    let outbox = BenchOutbox::new().await?;
    let wakeup = outbox.table.qualified("_wakeup");
    match mode {
        Mode::NoTrigger => {
            sqlx::query(&format!(
                "DROP TRIGGER outbox_wakeup ON {}",
                outbox.table.qualified("")
            ))
            .execute(&outbox.pool)
            .await
            .map_err(text)?;
        }
        Mode::EveryCommit => {
            sqlx::query(&format!("UPDATE {wakeup} SET relay_idle = true"))
                .execute(&outbox.pool)
                .await
                .map_err(text)?;
        }
        _ => {}
    }
    let relay = if matches!(mode, Mode::RelayPolling | Mode::RelayWakeup) {
        let mut config = outbox_postgres::PostgresConfig::new(crate::setup::postgres_url())
            .table(&outbox.schema, "outbox");
        config.wakeup = mode == Mode::RelayWakeup;
        // No writer here prepares its transactions (see `setup::Outbox::config`).
        config.wakeup_with_prepared_transactions = true;
        let storage = Arc::new(outbox_postgres::PgStorage::new(config).map_err(text)?);
        let config = WorkerConfig {
            batch_size: 500,
            ..WorkerConfig::new("bench")
        };
        Some(spawn_relay(config, storage, Arc::new(NullSink))?)
    } else {
        None
    };
    let rate = commits_per_second(&outbox, duration).await?;
    if let Some((relay, shutdown)) = relay {
        shutdown.cancel();
        relay.await.map_err(text)?;
    }
    outbox.drop_schema().await?;
    Ok(rate)
}

/// Commits per second of `WRITERS` writers, each committing single-message transactions
/// into `outbox` in a loop for `duration` (keys spread over 1000).
pub async fn commits_per_second(outbox: &BenchOutbox, duration: Duration) -> Result<f64, String> {
    let commits = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (pool, table, commits) = (outbox.pool.clone(), outbox.table.clone(), commits.clone());
        tasks.push(tokio::spawn(async move {
            let payload = vec![b'x'; 200];
            let mut i = 0u64;
            while Instant::now() < deadline {
                let mut tx = pool.begin().await.map_err(text)?;
                let message = NewMessage::new("bench", payload.clone())
                    .key(format!("k{}", (w as u64 * 7919 + i) % 1000));
                table.enqueue(&mut tx, &message).await.map_err(text)?;
                tx.commit().await.map_err(text)?;
                commits.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<(), String>(())
        }));
    }
    let started = Instant::now();
    for task in tasks {
        task.await.map_err(text)??;
    }
    let rate = commits.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    Ok(rate)
}
