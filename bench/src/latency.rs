//! Latency: single-message transactions at a fixed rate; a consumer of the Redis stream
//! records the time from each commit to the message's arrival (the producers and the
//! consumer of [`binary`], which the binary's latency runs use too).

use std::time::Duration;

use outbox_core::WorkerConfig;
use outbox_postgres::StorageMode;

use crate::Scale;
use crate::binary::{self, Arrivals};
use crate::report::Report;
use crate::setup::{BenchOutbox, SinkKind, spawn_relay, text};

pub async fn run(scale: Scale, report: &mut Report) -> Result<(), String> {
    println!("\n== latency: commit to arrival in the Redis stream, one relay, wake-up on ==");
    for rate in [500u64, 5_000] {
        let (achieved, latencies) =
            measure(rate, scale.latency_duration, StorageMode::Lease).await?;
        let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize];
        let name = format!("{rate}/s offered ({achieved:.0}/s achieved)");
        report.add("latency", &format!("{name} p50"), pct(0.50), "ms", None);
        report.add("latency", &format!("{name} p95"), pct(0.95), "ms", None);
        report.add("latency", &format!("{name} p99"), pct(0.99), "ms", None);
        report.add("latency", &format!("{name} max"), pct(1.0), "ms", None);
    }
    Ok(())
}

/// Offers `rate` single-message transactions per second for `duration` (from 16 producers:
/// every rate here is above 400/s, see [`binary::produce`]) to a table in `mode` with one
/// library relay publishing to Redis. Returns the achieved rate and the sorted latencies in
/// milliseconds.
pub async fn measure(
    rate: u64,
    duration: Duration,
    mode: StorageMode,
) -> Result<(f64, Vec<f64>), String> {
    let outbox = BenchOutbox::new_in(mode).await?;
    let run = outbox.schema.clone();
    let (relay, shutdown) = spawn_relay(
        WorkerConfig::new("bench-latency"),
        outbox.storage(true)?,
        SinkKind::Redis.build(&run)?,
    )?;
    tokio::time::sleep(Duration::from_millis(500)).await; // let the relay go idle and listen

    let arrivals = Arrivals::default();
    let consumer = tokio::spawn(binary::consume_redis(
        format!("{run}:latency"),
        arrivals.clone(),
        shutdown.clone(),
    ));
    let timed = binary::offer(&outbox, "latency", rate, duration, &arrivals).await?;
    shutdown.cancel();
    consumer.await.map_err(text)??;
    relay.await.map_err(text)?;
    SinkKind::Redis.cleanup(&run).await?;
    outbox.drop_schema().await?;
    if timed.latencies.len() != timed.sent {
        return Err(format!(
            "latency run lost messages: sent {}, arrived {}",
            timed.sent,
            timed.latencies.len()
        ));
    }
    Ok((timed.achieved, timed.latencies))
}
