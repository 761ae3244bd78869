//! Latency: single-message transactions at a fixed rate; a consumer of the Redis stream
//! records the time from each commit to the message's arrival.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{CancellationToken, NewMessage, Worker, WorkerConfig};
use outbox_postgres::StorageMode;
use outbox_redis::redis::{self, AsyncCommands};
use uuid::Uuid;

use crate::Scale;
use crate::report::Report;
use crate::setup::{BenchOutbox, SinkKind, redis_url, text};

const PRODUCERS: u64 = 16;

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

/// Offers `rate` single-message transactions per second for `duration` to a table in `mode`
/// with one library relay publishing to Redis. Returns the achieved rate and the sorted
/// latencies in milliseconds.
pub async fn measure(
    rate: u64,
    duration: Duration,
    mode: StorageMode,
) -> Result<(f64, Vec<f64>), String> {
    let outbox = BenchOutbox::new_in(mode).await?;
    let run = outbox.schema.clone();
    let stream = format!("{run}:latency");
    let worker = Worker::new(
        WorkerConfig::new("bench-latency"),
        outbox.storage(true)?,
        SinkKind::Redis.build(&run)?,
    )
    .map_err(text)?;
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await; // let the relay go idle and listen

    let committed: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
    let consumer = tokio::spawn(consume(stream.clone(), committed.clone(), shutdown.clone()));
    let started = Instant::now();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let (pool, table, committed) =
            (outbox.pool.clone(), outbox.table.clone(), committed.clone());
        let interval = Duration::from_secs_f64(PRODUCERS as f64 / rate as f64);
        producers.push(tokio::spawn(async move {
            let mut ticker = tokio::time::interval_at(
                tokio::time::Instant::now() + interval.mul_f64(p as f64 / PRODUCERS as f64),
                interval,
            );
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut sent = 0u64;
            while started.elapsed() < duration {
                ticker.tick().await;
                let message = NewMessage::new("latency", vec![b'x'; 200])
                    .key(format!("k{}", (p * 7919 + sent) % 1000));
                let mut tx = pool.begin().await.map_err(text)?;
                table.enqueue(&mut tx, &message).await.map_err(text)?;
                tx.commit().await.map_err(text)?;
                committed
                    .lock()
                    .map_err(text)?
                    .insert(message.id, Instant::now());
                sent += 1;
            }
            Ok::<u64, String>(sent)
        }));
    }
    let mut sent = 0;
    for p in producers {
        sent += p.await.map_err(text)??;
    }
    let achieved = sent as f64 / started.elapsed().as_secs_f64();
    // Let the last messages arrive.
    let deadline = Instant::now() + Duration::from_secs(30);
    let latencies = loop {
        let arrived = consumer.is_finished();
        let pending = committed.lock().map_err(text)?.len();
        if pending == 0 || arrived || Instant::now() > deadline {
            shutdown.cancel();
            break consumer.await.map_err(text)??;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    relay.await.map_err(text)?;
    SinkKind::Redis.cleanup(&run).await?;
    outbox.drop_schema().await?;
    if latencies.len() as u64 != sent {
        return Err(format!(
            "latency run lost messages: sent {sent}, arrived {}",
            latencies.len()
        ));
    }
    let mut latencies = latencies;
    latencies.sort_by(f64::total_cmp);
    Ok((achieved, latencies))
}

/// Reads the stream until shut down; returns each message's latency in milliseconds.
async fn consume(
    stream: String,
    committed: Arc<Mutex<HashMap<Uuid, Instant>>>,
    shutdown: CancellationToken,
) -> Result<Vec<f64>, String> {
    let client = redis::Client::open(redis_url()).map_err(text)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(text)?;
    let mut last = "0-0".to_string();
    let mut latencies = Vec::new();
    let options = redis::streams::StreamReadOptions::default()
        .block(100)
        .count(1000);
    while !shutdown.is_cancelled() {
        let reply: redis::streams::StreamReadReply = conn
            .xread_options(&[&stream], &[&last], &options)
            .await
            .map_err(text)?;
        let arrived = Instant::now();
        for key in reply.keys {
            for entry in key.ids {
                last = entry.id.clone();
                let id: Option<String> = entry.get(outbox_redis::wire::ID);
                let Some(id) = id.and_then(|s| Uuid::parse_str(&s).ok()) else {
                    continue;
                };
                // The commit is recorded just after it returns, so allow for a message that
                // arrives first: retry the lookup briefly.
                let mut at = committed.lock().map_err(text)?.remove(&id);
                for _ in 0..100 {
                    if at.is_some() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    at = committed.lock().map_err(text)?.remove(&id);
                }
                if let Some(at) = at {
                    latencies.push(arrived.saturating_duration_since(at).as_secs_f64() * 1000.0);
                }
            }
        }
    }
    Ok(latencies)
}
