//! What every benchmark needs: a fresh outbox schema, preloaded messages, sinks to publish to.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use outbox_core::{Message, Outcome, Receipt, Result as OutboxResult, Sink, SinkCapabilities};
use outbox_postgres::{OutboxTable, PgStorage, PostgresConfig, StorageMode};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

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

const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const NATS_URL: &str = "nats://127.0.0.1:4222";
const KAFKA_BROKERS: &str = "127.0.0.1:9092";

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
        match self {
            SinkKind::Amqp => {
                use outbox_amqp::lapin::{
                    Connection, ConnectionProperties, ExchangeKind, options::*, types::FieldTable,
                };
                let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
                    .await
                    .map_err(text)?;
                let channel = conn.create_channel().await.map_err(text)?;
                channel
                    .exchange_declare(
                        run.into(),
                        ExchangeKind::Fanout,
                        ExchangeDeclareOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(text)?;
                let queue = format!("{run}.q");
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(text)?;
                channel
                    .queue_bind(
                        queue.as_str().into(),
                        run.into(),
                        "".into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(text)?;
                conn.close(200, "done".into()).await.map_err(text)?;
            }
            SinkKind::Nats => {
                use outbox_nats::async_nats::jetstream::{self, stream};
                let client = outbox_nats::async_nats::connect(NATS_URL)
                    .await
                    .map_err(text)?;
                jetstream::new(client)
                    .create_stream(stream::Config {
                        name: run.to_string(),
                        subjects: vec![format!("{run}.>")],
                        storage: stream::StorageType::Memory,
                        ..Default::default()
                    })
                    .await
                    .map_err(text)?;
            }
            SinkKind::Kafka => {
                use outbox_kafka::rdkafka::admin::{
                    AdminClient, AdminOptions, NewTopic, TopicReplication,
                };
                let admin: AdminClient<outbox_kafka::rdkafka::client::DefaultClientContext> =
                    outbox_kafka::rdkafka::ClientConfig::new()
                        .set("bootstrap.servers", KAFKA_BROKERS)
                        .create()
                        .map_err(text)?;
                let topic = format!("{run}.bench");
                let options =
                    AdminOptions::new().operation_timeout(Some(std::time::Duration::from_secs(10)));
                for result in admin
                    .create_topics(
                        [&NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
                        &options,
                    )
                    .await
                    .map_err(text)?
                {
                    result.map_err(|(t, e)| format!("creating topic {t}: {e}"))?;
                }
            }
            SinkKind::Null | SinkKind::Redis => {}
        }
        Ok(())
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
                    AMQP_URL,
                    outbox_core::Template::new(run).map_err(text)?,
                ))
                .map_err(text)?,
            ),
            SinkKind::Nats => Arc::new(
                outbox_nats::NatsSink::new(
                    outbox_nats::NatsConfig::new(NATS_URL)
                        .subject(format!("{run}."), outbox_core::Template::topic()),
                )
                .map_err(text)?,
            ),
            SinkKind::Kafka => {
                let mut config = outbox_kafka::KafkaConfig::new(KAFKA_BROKERS);
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
                use outbox_amqp::lapin::{Connection, ConnectionProperties, options::*};
                let conn = Connection::connect(AMQP_URL, ConnectionProperties::default())
                    .await
                    .map_err(text)?;
                let channel = conn.create_channel().await.map_err(text)?;
                channel
                    .queue_delete(
                        format!("{run}.q").as_str().into(),
                        QueueDeleteOptions::default(),
                    )
                    .await
                    .map_err(text)?;
                channel
                    .exchange_delete(run.into(), ExchangeDeleteOptions::default())
                    .await
                    .map_err(text)?;
                conn.close(200, "done".into()).await.map_err(text)?;
            }
            SinkKind::Nats => {
                let client = outbox_nats::async_nats::connect(NATS_URL)
                    .await
                    .map_err(text)?;
                outbox_nats::async_nats::jetstream::new(client)
                    .delete_stream(run)
                    .await
                    .map_err(text)?;
            }
            SinkKind::Kafka => {
                use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions};
                let admin: AdminClient<outbox_kafka::rdkafka::client::DefaultClientContext> =
                    outbox_kafka::rdkafka::ClientConfig::new()
                        .set("bootstrap.servers", KAFKA_BROKERS)
                        .create()
                        .map_err(text)?;
                admin
                    .delete_topics(&[&format!("{run}.bench")], &AdminOptions::new())
                    .await
                    .map_err(text)?;
            }
            SinkKind::Null => {}
        }
        Ok(())
    }
}
