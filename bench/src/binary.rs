//! The `outbox` binary as the relay under test: built once (`cargo build --release` of the
//! `outbox` package with the `kafka` feature), run with a generated configuration against a
//! fresh log-mode table, stopped with SIGTERM. Also the harness both the binary's and the
//! library's latency runs share: timed producers and consumers of Redis and Kafka that
//! record when each message id arrived.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{CancellationToken, NewMessage};
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::message::{Headers, Message as _};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_postgres::{OutboxTable, StorageMode};
use outbox_redis::redis::{self, AsyncCommands};
use sqlx::PgPool;
use uuid::Uuid;

use crate::setup::{BenchOutbox, SinkKind, postgres_url, redis_url, text};

const KAFKA_BROKERS: &str = "127.0.0.1:9092";
/// Partitions of the topics [`SinkKind::prepare`] creates.
const KAFKA_PARTITIONS: i32 = 3;

/// When each message id arrived at the consumer (the first time).
#[derive(Clone, Default)]
pub struct Arrivals(Arc<Mutex<HashMap<Uuid, Instant>>>);

impl Arrivals {
    fn record(&self, id: Uuid, at: Instant) {
        if let Ok(mut map) = self.0.lock() {
            map.entry(id).or_insert(at);
        }
    }

    fn len(&self) -> usize {
        self.0.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// A copy of what arrived so far.
    pub fn snapshot(&self) -> HashMap<Uuid, Instant> {
        self.0.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Waits until `n` ids arrived or `timeout` passed.
    pub async fn wait_for(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.len() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Enqueues single-message transactions of `topic` at `rate` per second for `duration` from
/// 4 producers (16 above 400/s); returns each message's id and when its commit returned.
pub async fn produce(
    pool: PgPool,
    table: OutboxTable,
    topic: &'static str,
    rate: u64,
    duration: Duration,
) -> Result<Vec<(Uuid, Instant)>, String> {
    let producers: u64 = if rate > 400 { 16 } else { 4 };
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..producers {
        let (pool, table) = (pool.clone(), table.clone());
        let interval = Duration::from_secs_f64(producers as f64 / rate as f64);
        tasks.push(tokio::spawn(async move {
            let mut ticker = tokio::time::interval_at(
                tokio::time::Instant::now() + interval.mul_f64(p as f64 / producers as f64),
                interval,
            );
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut sent = Vec::new();
            while started.elapsed() < duration {
                ticker.tick().await;
                let message = NewMessage::new(topic, vec![b'x'; 200])
                    .key(format!("k{}", (p * 7919 + sent.len() as u64) % 1000));
                let mut tx = pool.begin().await.map_err(text)?;
                table.enqueue(&mut tx, &message).await.map_err(text)?;
                tx.commit().await.map_err(text)?;
                sent.push((message.id, Instant::now()));
            }
            Ok::<_, String>(sent)
        }));
    }
    let mut sent = Vec::new();
    for task in tasks {
        sent.extend(task.await.map_err(text)??);
    }
    Ok(sent)
}

/// What [`offer`] measured.
pub struct Timed {
    /// The messages committed per second.
    pub achieved: f64,
    /// How many messages were committed.
    pub sent: usize,
    /// The latency of each message that arrived, commit to arrival, in milliseconds, sorted.
    pub latencies: Vec<f64>,
}

/// Offers `rate` messages of `topic` per second for `duration` to `outbox` ([`produce`]),
/// then waits up to 30 s for them to arrive in `arrivals`.
pub async fn offer(
    outbox: &BenchOutbox,
    topic: &'static str,
    rate: u64,
    duration: Duration,
    arrivals: &Arrivals,
) -> Result<Timed, String> {
    let started = Instant::now();
    let sent = produce(
        outbox.pool.clone(),
        outbox.table.clone(),
        topic,
        rate,
        duration,
    )
    .await?;
    let achieved = sent.len() as f64 / started.elapsed().as_secs_f64();
    arrivals.wait_for(sent.len(), Duration::from_secs(30)).await;
    let arrived = arrivals.snapshot();
    let mut latencies: Vec<f64> = sent
        .iter()
        .filter_map(|(id, at)| {
            arrived
                .get(id)
                .map(|got| got.saturating_duration_since(*at))
        })
        .map(|latency| latency.as_secs_f64() * 1000.0)
        .collect();
    latencies.sort_by(f64::total_cmp);
    Ok(Timed {
        achieved,
        sent: sent.len(),
        latencies,
    })
}

/// Reads `stream` until shut down, recording each message id's arrival.
pub async fn consume_redis(
    stream: String,
    arrivals: Arrivals,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let client = redis::Client::open(redis_url()).map_err(text)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(text)?;
    let mut last = "0-0".to_string();
    let options = redis::streams::StreamReadOptions::default()
        .block(100)
        .count(1000);
    while !shutdown.is_cancelled() {
        let reply: redis::streams::StreamReadReply = conn
            .xread_options(&[&stream], &[&last], &options)
            .await
            .map_err(text)?;
        let at = Instant::now();
        for key in reply.keys {
            for entry in key.ids {
                last = entry.id.clone();
                let id: Option<String> = entry.get(outbox_redis::wire::ID);
                if let Some(id) = id.and_then(|s| Uuid::parse_str(&s).ok()) {
                    arrivals.record(id, at);
                }
            }
        }
    }
    Ok(())
}

fn kafka_consumer(topic: &str) -> Result<BaseConsumer, String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", KAFKA_BROKERS)
        .set("group.id", format!("{topic}.consumer"))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "5")
        .set("fetch.min.bytes", "1")
        .create()
        .map_err(text)?;
    let mut partitions = TopicPartitionList::new();
    for p in 0..KAFKA_PARTITIONS {
        partitions
            .add_partition_offset(topic, p, Offset::Beginning)
            .map_err(text)?;
    }
    consumer.assign(&partitions).map_err(text)?;
    Ok(consumer)
}

/// Reads `topic`'s partitions from the beginning until shut down, recording each message
/// id's arrival (on a blocking thread: librdkafka's consumer polls).
pub async fn consume_kafka(
    topic: String,
    arrivals: Arrivals,
    shutdown: CancellationToken,
) -> Result<(), String> {
    tokio::task::spawn_blocking(move || {
        let consumer = kafka_consumer(&topic)?;
        while !shutdown.is_cancelled() {
            let Some(message) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let message = message.map_err(text)?;
            let at = Instant::now();
            let id = message.headers().and_then(|headers| {
                headers
                    .iter()
                    .find(|h| h.key == outbox_kafka::wire::ID)
                    .and_then(|h| h.value)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|s| Uuid::parse_str(s).ok())
            });
            if let Some(id) = id {
                arrivals.record(id, at);
            }
        }
        Ok(())
    })
    .await
    .map_err(text)?
}

/// A running `outbox relay` process.
struct Relay {
    child: Child,
    config: PathBuf,
    log: PathBuf,
}

impl Relay {
    /// Fails with the end of its log when the process has exited.
    fn check(&mut self) -> Result<(), String> {
        if let Some(status) = self.child.try_wait().map_err(text)? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: String = log
                .lines()
                .rev()
                .take(10)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            return Err(format!("the outbox relay exited with {status}:\n{tail}"));
        }
        Ok(())
    }

    /// SIGTERM, then up to 20 s for the graceful shutdown, then SIGKILL.
    async fn stop(mut self) -> Result<(), String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().map_err(text)?.is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = std::fs::remove_file(&self.config);
        let _ = std::fs::remove_file(&self.log);
        Ok(())
    }
}

/// The built `outbox` binary.
pub struct Binary {
    path: PathBuf,
}

impl Binary {
    /// Builds `target/release/outbox` with the Kafka sink (a no-op when it is up to date).
    pub fn build() -> Result<Self, String> {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(&root)
            .args([
                "build",
                "--release",
                "--package",
                "outbox",
                "--bin",
                "outbox",
                "--features",
                "kafka",
            ])
            .status()
            .map_err(|e| format!("cannot run cargo to build the outbox binary: {e}"))?;
        if !status.success() {
            return Err(format!("building the outbox binary failed ({status})"));
        }
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        let target = if target.is_absolute() {
            target
        } else {
            root.join(target)
        };
        Ok(Binary {
            path: target.join("release").join("outbox"),
        })
    }

    /// Starts the relay on `outbox`'s table (log mode) publishing to `kind` under `run`'s
    /// names, with `batch_size`.
    fn start(
        &self,
        outbox: &BenchOutbox,
        kind: SinkKind,
        run: &str,
        batch: usize,
    ) -> Result<Relay, String> {
        let sink = match kind {
            SinkKind::Redis => format!(
                "type = \"redis\"\nurl = \"{}\"\nstream_prefix = \"{run}:\"",
                redis_url()
            ),
            SinkKind::Kafka => format!(
                "type = \"kafka\"\nbootstrap_servers = \"{KAFKA_BROKERS}\"\ntopic_template = \"{run}.{{topic}}\""
            ),
            other => return Err(format!("no binary configuration for {}", other.name())),
        };
        let config = format!(
            "[storage]\nurl = \"{url}\"\nschema = \"{schema}\"\ntable = \"outbox\"\nmode = \"{mode}\"\nmax_per_key = {max_per_key}\n\n\
             [relay]\nbatch_size = {batch}\n\n[sink]\n{sink}\n\n[observability]\nlog_level = \"warn\"\n",
            url = postgres_url(),
            schema = outbox.schema,
            mode = StorageMode::Log.name(),
            max_per_key = kind.max_per_key(),
        );
        let dir = std::env::temp_dir();
        let config_path = dir.join(format!("{run}.toml"));
        let log_path = dir.join(format!("{run}.log"));
        std::fs::write(&config_path, config).map_err(text)?;
        let log = std::fs::File::create(&log_path).map_err(text)?;
        let child = Command::new(&self.path)
            .arg("--config")
            .arg(&config_path)
            .arg("relay")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.path.display()))?;
        Ok(Relay {
            child,
            config: config_path,
            log: log_path,
        })
    }

    /// Drains a preloaded backlog of `n` with one relay process; the process's start-up is
    /// left out of the rate.
    pub async fn drain(
        &self,
        kind: SinkKind,
        batch: usize,
        n: u64,
        keys: u64,
    ) -> Result<f64, String> {
        let outbox = BenchOutbox::new_in(StorageMode::Log).await?;
        outbox.preload(n, keys).await?;
        let run = outbox.schema.clone();
        kind.prepare(&run).await?;
        // Progress from the database, the same for every broker: the clock starts when the
        // relay owns its shards (the process is up) and stops when every shard's cursor
        // has passed its last row (all delivered and settled).
        let t = outbox.table.qualified("");
        let shards = outbox.table.qualified("_shards");
        let last: Vec<(i32, String, i64)> = sqlx::query_as(&format!(
            "SELECT DISTINCT ON (shard) shard, xid::text, seq FROM {t}
             ORDER BY shard, xid DESC, seq DESC"
        ))
        .fetch_all(&outbox.pool)
        .await
        .map_err(text)?;
        let (ids, xids, seqs): (Vec<i32>, Vec<String>, Vec<i64>) =
            last.into_iter()
                .fold(Default::default(), |mut acc, (a, b, c)| {
                    acc.0.push(a);
                    acc.1.push(b);
                    acc.2.push(c);
                    acc
                });
        let behind = format!(
            "SELECT count(*) FILTER (WHERE s.owner IS NOT NULL),
                    count(*) FILTER (WHERE (s.cursor_xid, s.cursor_seq) < (m.xid::xid8, m.seq))
             FROM {shards} s JOIN unnest($1::int[], $2::text[], $3::bigint[]) AS m(shard, xid, seq)
               ON m.shard = s.shard"
        );
        let mut relay = self.start(&outbox, kind, &run, batch)?;
        let result = async {
            let deadline = Instant::now() + Duration::from_secs(180);
            let mut started: Option<Instant> = None;
            loop {
                let (owned, left): (i64, i64) = sqlx::query_as(&behind)
                    .bind(&ids)
                    .bind(&xids)
                    .bind(&seqs)
                    .fetch_one(&outbox.pool)
                    .await
                    .map_err(text)?;
                if owned > 0 && started.is_none() {
                    started = Some(Instant::now());
                }
                if left == 0 {
                    let at = started.unwrap_or_else(Instant::now);
                    return Ok(n as f64 / at.elapsed().as_secs_f64().max(1e-6));
                }
                relay.check()?;
                if Instant::now() > deadline {
                    let log = std::fs::read_to_string(&relay.log).unwrap_or_default();
                    return Err(format!(
                        "the outbox binary did not drain {n} to {} in 3 minutes ({left} shards behind); its log:\n{log}",
                        kind.name()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        .await;
        relay.stop().await?;
        kind.cleanup(&run).await?;
        outbox.drop_schema().await?;
        result
    }

    /// Commit-to-arrival latency through one relay process at `rate` messages/s for
    /// `duration`. Returns the achieved rate and the latencies in milliseconds.
    pub async fn latency(
        &self,
        kind: SinkKind,
        batch: usize,
        rate: u64,
        duration: Duration,
    ) -> Result<(f64, Vec<f64>), String> {
        let outbox = BenchOutbox::new_in(StorageMode::Log).await?;
        let run = outbox.schema.clone();
        kind.prepare(&run).await?;
        let mut relay = self.start(&outbox, kind, &run, batch)?;
        let shutdown = CancellationToken::new();
        let arrivals = Arrivals::default();
        let consumer = match kind {
            SinkKind::Kafka => tokio::spawn(consume_kafka(
                format!("{run}.bench"),
                arrivals.clone(),
                shutdown.clone(),
            )),
            _ => tokio::spawn(consume_redis(
                format!("{run}:bench"),
                arrivals.clone(),
                shutdown.clone(),
            )),
        };
        // Let the relay start, take its shards and go idle, and the consumer connect.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let result = async {
            relay.check()?;
            let timed = offer(&outbox, "bench", rate, duration, &arrivals).await?;
            relay.check()?;
            if timed.latencies.len() != timed.sent {
                let log = std::fs::read_to_string(&relay.log).unwrap_or_default();
                return Err(format!(
                    "the binary's latency run to {} lost messages: sent {}, arrived {}; the relay's log:\n{log}",
                    kind.name(),
                    timed.sent,
                    timed.latencies.len()
                ));
            }
            Ok((timed.achieved, timed.latencies))
        }
        .await;
        shutdown.cancel();
        let consumed = consumer.await.map_err(text)?;
        relay.stop().await?;
        kind.cleanup(&run).await?;
        outbox.drop_schema().await?;
        let out = result?;
        consumed?;
        Ok(out)
    }
}
