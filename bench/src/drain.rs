//! Drain: how fast relays empty a preloaded outbox into each sink, against the database and
//! sink ceilings and a naive relay measured in the same run; and how the drain rate holds
//! up as the backlog grows.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{CancellationToken, Worker, WorkerConfig};
use outbox_postgres::StorageMode;

use crate::baselines;
use crate::report::{Report, Resources};
use crate::setup::{BenchOutbox, CountingSink, SinkKind, text};
use crate::{Scale, median};

/// Messages claimed at once by the benchmarked relays.
pub const BATCH: usize = 500;

/// The outcome of one drain.
pub struct Drain {
    pub rate: f64,
    pub resources: Resources,
}

/// Starts `relays` workers on `outbox`, each with its own storage pool and sink instance,
/// and waits until `expected` messages were delivered. Returns events per second.
pub async fn drain(
    outbox: &BenchOutbox,
    kind: SinkKind,
    run: &str,
    relays: usize,
    per_key_order: bool,
    expected: u64,
) -> Result<Drain, String> {
    let delivered = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for i in 0..relays {
        let sink = Arc::new(CountingSink {
            inner: kind.build(run)?,
            delivered: delivered.clone(),
        });
        let config = WorkerConfig {
            batch_size: BATCH,
            poll_interval: Duration::from_millis(50),
            ..WorkerConfig::new(format!("bench-{i}"))
        };
        let storage = outbox.storage_with(per_key_order, kind.max_per_key())?;
        workers.push(Worker::new(config, storage, sink).map_err(text)?);
    }
    run_workers(
        workers,
        &delivered,
        expected,
        &format!("drain to {}", kind.name()),
    )
    .await
}

/// Runs `workers` until `delivered` (counted by their sinks) reaches `expected`, then shuts
/// them down. Returns events per second from their start until the last delivery.
pub async fn run_workers(
    workers: Vec<Worker>,
    delivered: &AtomicU64,
    expected: u64,
    what: &str,
) -> Result<Drain, String> {
    let shutdown = CancellationToken::new();
    let resources = Resources::start();
    let started = Instant::now();
    let handles: Vec<_> = workers
        .into_iter()
        .map(|w| {
            let shutdown = shutdown.clone();
            tokio::spawn(async move { w.run(shutdown).await })
        })
        .collect();
    let deadline = started + Duration::from_secs(600);
    while delivered.load(Ordering::Relaxed) < expected {
        if Instant::now() > deadline {
            shutdown.cancel();
            return Err(format!("{what} did not finish in 10 minutes"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let resources = resources.finish(expected);
    shutdown.cancel();
    for handle in handles {
        handle.await.map_err(text)?;
    }
    Ok(Drain {
        rate: expected as f64 / elapsed.as_secs_f64(),
        resources,
    })
}

/// A fresh preloaded outbox in `mode`, one drain, cleaned up.
pub async fn one_drain(
    scale: Scale,
    kind: SinkKind,
    relays: usize,
    per_key_order: bool,
    mode: StorageMode,
) -> Result<Drain, String> {
    let outbox = BenchOutbox::new_in(mode).await?;
    outbox.preload(scale.drain_messages, scale.keys).await?;
    let run = outbox.schema.clone();
    kind.prepare(&run).await?;
    let result = drain(
        &outbox,
        kind,
        &run,
        relays,
        per_key_order,
        scale.drain_messages,
    )
    .await;
    kind.cleanup(&run).await?;
    outbox.drop_schema().await?;
    result
}

pub async fn run(scale: Scale, report: &mut Report) -> Result<(), String> {
    let n = scale.drain_messages;
    println!(
        "\n== drain: {n} messages of 200 bytes over {} keys, batches of {BATCH} ==",
        scale.keys
    );
    let bare = bare_delete_ceiling(scale, report, "drain").await?;
    let naive = median(
        repeat(scale.runs, || {
            baselines::naive_relay(scale, SinkKind::Redis)
        })
        .await?,
    );
    report.add(
        "drain",
        "naive relay → redis",
        naive,
        "events/s",
        Some(("bare delete", bare)),
    );
    let redis_ceiling = median(
        repeat(scale.runs, || {
            baselines::sink_ceiling(scale, SinkKind::Redis)
        })
        .await?,
    );
    for (kind, runs) in sinks(scale) {
        let ceiling = match kind {
            SinkKind::Null => None,
            SinkKind::Redis => Some(redis_ceiling),
            _ => Some(median(
                repeat(runs, || baselines::sink_ceiling(scale, kind)).await?,
            )),
        };
        if let Some(ceiling) = ceiling {
            let name = format!("ceiling: {} publish, no database", kind.name());
            report.add(
                "drain",
                &name,
                ceiling,
                "events/s",
                Some(("bare delete", bare)),
            );
        }
        for per_key_order in [true, false] {
            for &relays in relay_counts(scale) {
                let mut rates = Vec::new();
                for _ in 0..runs {
                    let drained =
                        one_drain(scale, kind, relays, per_key_order, StorageMode::Lease).await?;
                    if kind == SinkKind::Redis && relays == 1 && per_key_order {
                        report.resources = Some(drained.resources);
                    }
                    rates.push(drained.rate);
                }
                let name = format!(
                    "{} relay{} → {}, key order {}",
                    relays,
                    if relays == 1 { "" } else { "s" },
                    kind.name(),
                    if per_key_order { "on" } else { "off" }
                );
                let rate = median(rates);
                report.add(
                    "drain",
                    &name,
                    rate,
                    "events/s",
                    Some(("bare delete", bare)),
                );
                if let Some(ceiling) = ceiling {
                    report.add_ratio(
                        "drain",
                        &format!("{name} vs its sink ceiling"),
                        rate / ceiling,
                    );
                }
                if kind == SinkKind::Redis {
                    report.add_ratio("drain", &format!("{name} vs naive relay"), rate / naive);
                }
                report.plot(
                    kind.name(),
                    relays,
                    per_key_order,
                    rate,
                    bare,
                    redis_ceiling,
                    naive,
                );
            }
        }
    }
    Ok(())
}

/// Drain rate at a small and a large backlog, one relay to Redis with key order on.
pub async fn backlog(scale: Scale, report: &mut Report) -> Result<(), String> {
    println!(
        "\n== backlog: drain rate at 10,000 and at {} waiting messages ==",
        scale.large_backlog
    );
    let mut rates = Vec::new();
    for backlog in [10_000, scale.large_backlog] {
        let outbox = BenchOutbox::new().await?;
        outbox.preload(backlog, scale.keys).await?;
        let run = outbox.schema.clone();
        // Measure the first 10,000 deliveries, so both rates cover the same work.
        let drained = drain(&outbox, SinkKind::Redis, &run, 1, true, 10_000.min(backlog)).await?;
        SinkKind::Redis.cleanup(&run).await?;
        outbox.drop_schema().await?;
        rates.push(drained.rate);
        report.add(
            "backlog",
            &format!("backlog {backlog}: first 10,000 → redis"),
            drained.rate,
            "events/s",
            None,
        );
    }
    report.add_ratio("backlog", "large backlog vs 10,000", rates[1] / rates[0]);
    Ok(())
}

/// The relay counts a drain section compares: 1, 2 and 4 (1 and 4 in a quick run).
pub fn relay_counts(scale: Scale) -> &'static [usize] {
    if scale.quick { &[1, 4] } else { &[1, 2, 4] }
}

/// Every sink a drain section runs against, with its number of runs: the database ceiling
/// (the null sink) and Redis are the headline figures, the median of every run; the other
/// brokers get one run each, to keep the whole benchmark within minutes.
pub fn sinks(scale: Scale) -> [(SinkKind, usize); 5] {
    [
        (SinkKind::Null, scale.runs),
        (SinkKind::Redis, scale.runs),
        (SinkKind::Amqp, 1),
        (SinkKind::Nats, 1),
        (SinkKind::Kafka, 1),
    ]
}

/// Measures PostgreSQL's ceiling, a bare `DELETE … SKIP LOCKED` loop (the median of the
/// runs), and reports it in `section`: the drains of both modes are read against it.
pub async fn bare_delete_ceiling(
    scale: Scale,
    report: &mut Report,
    section: &str,
) -> Result<f64, String> {
    let bare = median(repeat(scale.runs, || baselines::bare_delete(scale)).await?);
    report.add_bare_ceiling(section, "DELETE … SKIP LOCKED", bare);
    Ok(bare)
}

/// The figures of `runs` runs of `f`, in order (take their [`median`](crate::median)).
pub async fn repeat<F, Fut>(runs: usize, f: F) -> Result<Vec<f64>, String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<f64, String>>,
{
    let mut values = Vec::new();
    for _ in 0..runs {
        values.push(f().await?);
    }
    Ok(values)
}
