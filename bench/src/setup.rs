//! What every benchmark needs: a fresh outbox schema, preloaded messages, sinks to publish to.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use outbox_core::{
    CancellationToken, Message, Outcome, Receipt, Result as OutboxResult, Sink, SinkCapabilities,
    Storage, Worker, WorkerConfig,
};
use outbox_postgres::{OutboxTable, PgStorage, PostgresConfig, StorageMode};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinHandle;

pub fn postgres_url() -> String {
    std::env::var("OUTBOX_BENCH_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn redis_url() -> String {
    std::env::var("OUTBOX_BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn text<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Starts a library relay of `config` from `storage` into `sink`; it runs until the
/// returned token is cancelled, and the returned task ends once it has stopped.
pub fn spawn_relay(
    config: WorkerConfig,
    storage: Arc<dyn Storage>,
    sink: Arc<dyn Sink>,
) -> Result<(JoinHandle<()>, CancellationToken), String> {
    let worker = Worker::new(config, storage, sink).map_err(text)?;
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    Ok((relay, shutdown))
}

/// An outbox table in a schema of its own, dropped by [`BenchOutbox::drop_schema`].
pub struct BenchOutbox {
    pub schema: String,
    pub table: OutboxTable,
    pub pool: PgPool,
    /// How the table was migrated, and how its relays run it.
    pub mode: StorageMode,
}

impl BenchOutbox {
    /// A lease-mode table (the default mode).
    pub async fn new() -> Result<Self, String> {
        Self::new_in(StorageMode::Lease).await
    }

    /// A table migrated for `mode` (log mode with the default 16 shards).
    pub async fn new_in(mode: StorageMode) -> Result<Self, String> {
        let schema = format!("bench_{:08x}", fastrand::u32(..));
        let url = postgres_url();
        let mut config = PostgresConfig::new(&url).table(&schema, "outbox");
        config.mode = mode;
        let storage = PgStorage::new(config).map_err(text)?;
        storage.migrate().await.map_err(text)?;
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect(&url)
            .await
            .map_err(text)?;
        Ok(BenchOutbox {
            table: OutboxTable::new(&schema, "outbox").map_err(text)?,
            schema,
            pool,
            mode,
        })
    }

    /// A relay's storage with a pool of its own, as a separate relay process would have.
    pub fn storage(&self, per_key_order: bool) -> Result<Arc<PgStorage>, String> {
        self.storage_with(per_key_order, outbox_postgres::DEFAULT_MAX_PER_KEY)
    }

    /// A relay's storage with its own pool and the given `max_per_key`.
    pub fn storage_with(
        &self,
        per_key_order: bool,
        max_per_key: usize,
    ) -> Result<Arc<PgStorage>, String> {
        Ok(Arc::new(
            PgStorage::new(self.config(per_key_order, max_per_key)).map_err(text)?,
        ))
    }

    /// A relay's storage settings for this table, in its mode.
    pub fn config(&self, per_key_order: bool, max_per_key: usize) -> PostgresConfig {
        let mut config = PostgresConfig::new(postgres_url()).table(&self.schema, "outbox");
        config.mode = self.mode;
        config.per_key_order = per_key_order;
        config.max_per_key = max_per_key;
        // The test server allows prepared transactions (`cargo xtask services`); no writer
        // here prepares, so the wake-up stays on, as on a server that does not.
        config.wakeup_with_prepared_transactions = true;
        config
    }

    /// Inserts `n` messages with 200-byte payloads over `keys` keys, server-side, then
    /// analyses and vacuums the table so every run starts from the same state.
    pub async fn preload(&self, n: u64, keys: u64) -> Result<(), String> {
        let sql = format!(
            "INSERT INTO {} (id, topic, partition_key, payload)
             SELECT gen_random_uuid(), 'bench', 'k' || (i % $2), convert_to(repeat('x', 200), 'UTF8')
             FROM generate_series(1, $1) AS i",
            self.table.qualified("")
        );
        sqlx::query(&sql)
            .bind(n as i64)
            .bind(keys as i64)
            .execute(&self.pool)
            .await
            .map_err(text)?;
        sqlx::query(&format!("VACUUM ANALYZE {}", self.table.qualified("")))
            .execute(&self.pool)
            .await
            .map_err(text)?;
        Ok(())
    }

    pub async fn drop_schema(self) -> Result<(), String> {
        sqlx::query(&format!(r#"DROP SCHEMA "{}" CASCADE"#, self.schema))
            .execute(&self.pool)
            .await
            .map_err(text)?;
        Ok(())
    }
}

/// Delivers everything at once: the relay with no broker, for the database ceiling.
pub struct NullSink;

#[async_trait]
impl Sink for NullSink {
    async fn publish(&self, batch: &[Message]) -> OutboxResult<Vec<Outcome>> {
        Ok(batch
            .iter()
            .map(|_| Outcome::Delivered(Receipt::default()))
            .collect())
    }

    async fn health(&self) -> OutboxResult<()> {
        Ok(())
    }
}

/// Counts the deliveries of the sink it wraps, so a drain knows when it is done without
/// querying the table.
pub struct CountingSink {
    pub inner: Arc<dyn Sink>,
    pub delivered: Arc<AtomicU64>,
}

#[async_trait]
impl Sink for CountingSink {
    async fn publish(&self, batch: &[Message]) -> OutboxResult<Vec<Outcome>> {
        let outcomes = self.inner.publish(batch).await?;
        let n = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Delivered(_)))
            .count();
        self.delivered.fetch_add(n as u64, Ordering::Relaxed);
        Ok(outcomes)
    }

    async fn health(&self) -> OutboxResult<()> {
        self.inner.health().await
    }

    fn capabilities(&self) -> SinkCapabilities {
        self.inner.capabilities()
    }
}

/// The brokers a drain can publish to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkKind {
    /// No broker: the database ceiling.
    Null,
    Redis,
    Amqp,
    Nats,
    Kafka,
}

impl SinkKind {
    /// The relay's `max_per_key` for this sink: examples/kafka.toml lowers it for Kafka,
    /// whose round trips take milliseconds; the others keep the default.
    pub fn max_per_key(self) -> usize {
        match self {
            SinkKind::Kafka => 4,
            _ => outbox_postgres::DEFAULT_MAX_PER_KEY,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SinkKind::Null => "none",
            SinkKind::Redis => "redis",
            SinkKind::Amqp => "amqp",
            SinkKind::Nats => "nats",
            SinkKind::Kafka => "kafka",
        }
    }

    /// Makes what the broker needs before `run` publishes: an exchange with a queue bound to
    /// it (AMQP), a stream capturing the run's subjects (NATS).
    pub async fn prepare(self, run: &str) -> Result<(), String> {
        use outbox_test_support::{amqp, kafka, nats};
        match self {
            SinkKind::Amqp => {
                let kind = outbox_amqp::lapin::ExchangeKind::Fanout;
                amqp::declare_destination(run, kind, &format!("{run}.q"), "").await
            }
            SinkKind::Nats => {
                let js = nats::try_connect().await?;
                nats::try_create_stream(&js, run, vec![format!("{run}.>")]).await
            }
            SinkKind::Kafka => {
                kafka::try_create_topic(&kafka::brokers(), &format!("{run}.bench"), 3, &[]).await
            }
            SinkKind::Null | SinkKind::Redis => Ok(()),
        }
    }

    /// A new sink instance (one per relay: sinks are not shared between relays), writing
    /// under `run`'s own names.
    pub fn build(self, run: &str) -> Result<Arc<dyn Sink>, String> {
        Ok(match self {
            SinkKind::Null => Arc::new(NullSink),
            SinkKind::Redis => Arc::new(
                outbox_redis::RedisSink::new(
                    outbox_redis::RedisConfig::new(redis_url()).stream_prefix(format!("{run}:")),
                )
                .map_err(text)?,
            ),
            SinkKind::Amqp => Arc::new(
                outbox_amqp::AmqpSink::lazy(outbox_amqp::AmqpConfig::new(
                    outbox_test_support::amqp::url(),
                    outbox_core::Template::new(run).map_err(text)?,
                ))
                .map_err(text)?,
            ),
            SinkKind::Nats => Arc::new(
                outbox_nats::NatsSink::new(
                    outbox_nats::NatsConfig::new(outbox_test_support::nats::url())
                        .subject(format!("{run}."), outbox_core::Template::topic()),
                )
                .map_err(text)?,
            ),
            SinkKind::Kafka => {
                let mut config =
                    outbox_kafka::KafkaConfig::new(outbox_test_support::kafka::brokers());
                config.topic_template =
                    outbox_core::Template::new(format!("{run}.{{topic}}")).map_err(text)?;
                config.properties.insert("linger.ms".into(), "5".into());
                Arc::new(outbox_kafka::KafkaSink::new(config).map_err(text)?)
            }
        })
    }

    /// Removes what a run left in the broker.
    pub async fn cleanup(self, run: &str) -> Result<(), String> {
        match self {
            SinkKind::Redis => {
                let client = outbox_redis::redis::Client::open(redis_url()).map_err(text)?;
                let mut conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .map_err(text)?;
                let keys: Vec<String> = outbox_redis::redis::cmd("KEYS")
                    .arg(format!("{run}:*"))
                    .query_async(&mut conn)
                    .await
                    .map_err(text)?;
                for key in keys {
                    let _: () = outbox_redis::redis::cmd("DEL")
                        .arg(key)
                        .query_async(&mut conn)
                        .await
                        .map_err(text)?;
                }
            }
            SinkKind::Amqp => {
                outbox_test_support::amqp::remove_destination(run, &format!("{run}.q")).await?;
            }
            SinkKind::Nats => {
                let js = outbox_test_support::nats::try_connect().await?;
                outbox_test_support::nats::delete_stream(&js, run).await?;
            }
            SinkKind::Kafka => {
                let topic = format!("{run}.bench");
                outbox_test_support::kafka::delete_topics(
                    &outbox_test_support::kafka::brokers(),
                    &[&topic],
                )
                .await?;
            }
            SinkKind::Null => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use outbox_core::NewMessage;

    use super::*;

    /// What every drain does before and after it measures, against the real brokers: each
    /// sink's destination is made, takes a publish under the run's names, and is removed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_sinks_destination_is_made_takes_a_publish_and_is_removed() {
        for kind in [
            SinkKind::Redis,
            SinkKind::Amqp,
            SinkKind::Nats,
            SinkKind::Kafka,
        ] {
            let run = outbox_test_support::unique_name("bench_setup");
            let name = kind.name();
            kind.prepare(&run)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let sink = kind.build(&run).unwrap_or_else(|e| panic!("{name}: {e}"));
            let message = Message::from(NewMessage::new("bench", "x").key("k"));
            let outcomes = sink
                .publish(&[message])
                .await
                .unwrap_or_else(|e| panic!("{name}: publish: {e}"));
            assert!(
                matches!(outcomes[..], [Outcome::Delivered(_)]),
                "{name}: {outcomes:?}"
            );
            kind.cleanup(&run)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}
