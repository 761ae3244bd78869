//! Benchmarks of the outbox engine against the real services on this machine. Every figure
//! is reported with a baseline measured in the same run, as a ratio: the machines are
//! shared and noisy, so absolute numbers mean little on their own.
//!
//! `cargo xtask bench [--quick] [enqueue]`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_core::memory::MemorySink;
use outbox_core::{CancellationToken, NewMessage, Worker, WorkerConfig};
use outbox_postgres::{OutboxTable, PgStorage, PostgresConfig};
use sqlx::postgres::PgPoolOptions;

fn postgres_url() -> String {
    std::env::var("OUTBOX_BENCH_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let seconds = if quick { 3 } else { 10 };
    let runs = if quick { 1 } else { 3 };
    println!(
        "machine: {} cores; {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        os_description()
    );
    if let Err(error) = enqueue_cost(Duration::from_secs(seconds), runs).await {
        eprintln!("benchmark failed: {error}");
        std::process::exit(1);
    }
}

fn os_description() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// How the wake-up is set while 16 writers commit single-message transactions.
#[derive(Clone, Copy, Debug)]
enum WakeupMode {
    /// No wake-up trigger on the table at all: the baseline.
    NoTrigger,
    /// Trigger present, relay busy (writers read the flag and do not notify).
    Quiet,
    /// Trigger present and every commit notifies (the relay idle, listening).
    EveryCommit,
    /// A real relay with the wake-up on, draining while the writers write.
    LiveRelay,
    /// A real relay with the wake-up off (polling only), draining while the writers write.
    LiveRelayPolling,
}

async fn enqueue_cost(duration: Duration, runs: usize) -> Result<(), String> {
    let writers = 16;
    println!(
        "\n== enqueue cost: {writers} writers, single-message transactions, {duration:?} per run, median of {runs} =="
    );
    let modes = [
        WakeupMode::NoTrigger,
        WakeupMode::Quiet,
        WakeupMode::EveryCommit,
        WakeupMode::LiveRelayPolling,
        WakeupMode::LiveRelay,
    ];
    let mut results = Vec::new();
    for mode in modes {
        let mut rates = Vec::new();
        for _ in 0..runs {
            rates.push(enqueue_run(mode, writers, duration).await?);
        }
        rates.sort_by(f64::total_cmp);
        results.push((mode, rates[rates.len() / 2]));
    }
    let baseline = results[0].1;
    println!("{:<22} {:>12} {:>10}", "mode", "commits/s", "ratio");
    for (mode, rate) in &results {
        println!(
            "{:<22} {:>12.0} {:>10.2}",
            format!("{mode:?}"),
            rate,
            rate / baseline
        );
    }
    Ok(())
}

async fn enqueue_run(mode: WakeupMode, writers: usize, duration: Duration) -> Result<f64, String> {
    let url = postgres_url();
    let schema = format!("bench_{:08x}", fastrand::u32(..));
    let mut config = PostgresConfig::new(&url).table(&schema, "outbox");
    config.wakeup = !matches!(mode, WakeupMode::LiveRelayPolling);
    let storage = Arc::new(PgStorage::new(config).map_err(|e| e.to_string())?);
    storage.migrate().await.map_err(|e| e.to_string())?;
    let table = OutboxTable::new(&schema, "outbox").map_err(|e| e.to_string())?;
    let pool = PgPoolOptions::new()
        .max_connections(writers as u32 + 2)
        .connect(&url)
        .await
        .map_err(|e| e.to_string())?;
    let wakeup = table.qualified("_wakeup");
    match mode {
        WakeupMode::NoTrigger => {
            sqlx::query(&format!(
                r#"DROP TRIGGER outbox_wakeup ON {}"#,
                table.qualified("")
            ))
            .execute(&pool)
            .await
            .map_err(|e| e.to_string())?;
        }
        WakeupMode::EveryCommit => {
            sqlx::query(&format!("UPDATE {wakeup} SET relay_idle = true"))
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
        }
        _ => {}
    }
    let shutdown = CancellationToken::new();
    let relay = if matches!(mode, WakeupMode::LiveRelay | WakeupMode::LiveRelayPolling) {
        let worker = Worker::new(
            WorkerConfig {
                batch_size: 500,
                ..WorkerConfig::new("bench")
            },
            storage.clone(),
            Arc::new(MemorySink::new()),
        )
        .map_err(|e| e.to_string())?;
        let shutdown = shutdown.clone();
        Some(tokio::spawn(async move { worker.run(shutdown).await }))
    } else {
        None
    };
    let commits = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (pool, table, commits) = (pool.clone(), table.clone(), commits.clone());
        tasks.push(tokio::spawn(async move {
            let payload = vec![b'x'; 200];
            let mut i = 0u64;
            while Instant::now() < deadline {
                let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
                let message = NewMessage::new("bench", payload.clone())
                    .key(format!("k{}", (w as u64 * 7919 + i) % 1000));
                table
                    .enqueue(&mut tx, &message)
                    .await
                    .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())?;
                commits.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<(), String>(())
        }));
    }
    let started = Instant::now();
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    let rate = commits.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    if let Some(relay) = relay {
        relay.await.map_err(|e| e.to_string())?;
    }
    drop(storage);
    sqlx::query(&format!(r#"DROP SCHEMA "{schema}" CASCADE"#))
        .execute(&pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok(rate)
}
