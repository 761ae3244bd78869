//! The broker side of a run, per sink: what to create before the relays start, the `[sink]`
//! table that points the relays at the proxy, reading back everything the broker took (in
//! its order of receipt), and cleaning up.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use outbox_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use outbox_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use outbox_amqp::lapin::{self, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_core::redact_url;
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::message::Message as _;
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_nats::async_nats::jetstream;
use outbox_redis::redis::{self, AsyncCommands, streams::StreamRangeReply};
use outbox_test_support::kafka::{Tansu, try_create_topic};
use outbox_test_support::{Service, free_addr, through};
use outbox_test_support::{nats, redis as test_redis};
use tokio_util::sync::CancellationToken;

use crate::writers::{POISON_TOPIC, TOPIC};
use crate::{Context, Faults, Result};

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Kind {
    Amqp,
    Redis,
    Kafka,
    Nats,
}

impl Kind {
    /// The longest one publish round may take with every time-out at `timeout` seconds, as
    /// the sink counts it (docs/sinks/): AMQP connects then awaits confirms, NATS hands over
    /// then awaits acks, Kafka waits its publish time-out plus 5 s.
    pub fn round_timeout(self, timeout: u64) -> u64 {
        match self {
            Kind::Amqp | Kind::Nats => 2 * timeout,
            Kind::Redis => timeout,
            Kind::Kafka => timeout + 5,
        }
    }
}

/// Payloads in the order the broker received them.
pub type Arrivals = Arc<Mutex<Vec<Vec<u8>>>>;

pub enum Broker {
    Amqp(Amqp),
    Redis,
    Kafka(Tansu),
    Nats(jetstream::Context),
}

/// The address the proxy forwards to. Kafka clients connect to the address the broker
/// advertises, not the one they were given, so a proxy in front of the shared tansu would be
/// bypassed after the first request: Kafka runs get a tansu of their own, on this free
/// port, that advertises the proxy.
pub fn upstream(kind: Kind) -> String {
    match kind {
        Kind::Amqp => Service::Amqp.addr(),
        Kind::Redis => Service::Redis.addr(),
        Kind::Nats => Service::Nats.addr(),
        Kind::Kafka => free_addr(),
    }
}

impl Broker {
    /// Creates the destination `name` (exchange and queue, stream, topic); `proxy` is the
    /// address the relays will use.
    pub async fn setup(
        kind: Kind,
        name: &str,
        upstream: &str,
        proxy: &str,
        seed: u64,
        faults: Arc<Faults>,
    ) -> Result<Broker> {
        Ok(match kind {
            Kind::Amqp => Broker::Amqp(Amqp::setup(name, seed, faults).await?),
            Kind::Redis => {
                let _: () = redis::cmd("PING")
                    .query_async(&mut redis_connection().await?)
                    .await
                    .ctx(redact_url(&Service::Redis.url()))?;
                Broker::Redis
            }
            Kind::Kafka => Broker::Kafka(start_tansu(name, upstream, proxy).await?),
            Kind::Nats => {
                let js = nats::try_connect().await?;
                nats::try_create_stream(&js, name, vec![format!("{name}.>")]).await?;
                Broker::Nats(js)
            }
        })
    }

    /// The body of the relays' `[sink]` table: through the proxy, every time-out `timeout`.
    pub fn sink_table(&self, name: &str, proxy: &str, timeout: u64) -> String {
        let t = format!("\"{timeout}s\"");
        let url = |service: Service| through(&service.url(), proxy);
        match self {
            Broker::Amqp(_) => format!(
                "type = \"amqp\"\nurl = \"{}\"\nexchange = \"{name}\"\n\
                 exchange_setup = \"declare\"\nexchange_kind = \"topic\"\nunroutable = \"dead_letter\"\n\
                 connect_timeout = {t}\npublish_timeout = {t}\n\
                 reconnect_backoff = {{ initial = \"100ms\", max = \"1s\" }}\n",
                url(Service::Amqp)
            ),
            Broker::Redis => format!(
                "type = \"redis\"\nurl = \"{}\"\npool_size = 2\n\
                 publish_timeout = {t}\nstream_prefix = \"{name}:\"\n",
                url(Service::Redis)
            ),
            Broker::Kafka(_) => format!(
                "type = \"kafka\"\nbootstrap_servers = \"{proxy}\"\ntopic_template = \"{name}\"\n\
                 publish_timeout = {t}\nhealth_timeout = {t}\n"
            ),
            Broker::Nats(_) => format!(
                "type = \"nats\"\nurl = \"{}\"\nsubject_prefix = \"{name}.\"\n\
                 subject = \"{{topic}}\"\nstream = \"{name}\"\npublish_timeout = {t}\n",
                url(Service::Nats)
            ),
        }
    }

    /// Whether the run has a poison topic (AMQP: returned, so dead-lettered, until
    /// [`Broker::route_poison`]); the operator acts on the dead letters it makes.
    pub fn has_poison(&self) -> bool {
        matches!(self, Broker::Amqp(_))
    }

    /// Routes the poison topic to the run's queue, for the replays at the end.
    pub async fn route_poison(&self, name: &str) -> Result<()> {
        if let Broker::Amqp(amqp) = self {
            let (bind, none) = (QueueBindOptions::default(), FieldTable::default());
            let routing = POISON_TOPIC.into();
            let bound = amqp
                .channel
                .queue_bind(name.into(), name.into(), routing, bind, none);
            bound.await.ctx("binding the queue to the poison topic")?;
        }
        Ok(())
    }

    /// What the consumer received so far, where the run consumes while it goes (AMQP).
    pub fn receipts(&self) -> Option<Arrivals> {
        match self {
            Broker::Amqp(amqp) => Some(amqp.arrivals.clone()),
            _ => None,
        }
    }

    /// Ends the consumer's lagging (AMQP), for the drain.
    pub fn steady(&self) {
        if let Broker::Amqp(amqp) = self {
            amqp.steady.cancel();
        }
    }

    /// Everything the broker received, in its order of receipt.
    pub async fn collect(&mut self, name: &str, proxy: &str) -> Result<Vec<Vec<u8>>> {
        match self {
            Broker::Amqp(amqp) => amqp.drain(name).await,
            Broker::Redis => redis_range(&format!("{name}:{TOPIC}")).await,
            Broker::Kafka(_) => kafka_read(proxy, name).await,
            Broker::Nats(js) => nats_read(js, name).await,
        }
    }

    /// Deletes what [`Broker::setup`] created; a failure is reported, not fatal.
    pub async fn cleanup(&mut self, name: &str) {
        let result = match self {
            Broker::Amqp(amqp) => amqp.cleanup(name).await,
            Broker::Redis => test_redis::remove_prefixed(&format!("{name}:")).await,
            Broker::Kafka(tansu) => tansu.stop().await.ctx("stopping tansu"),
            Broker::Nats(js) => nats::delete_stream(js, name).await,
        };
        if let Err(error) = result {
            eprintln!("chaos: cleaning up {name} on the broker: {error}");
        }
    }
}

pub struct Amqp {
    connection: Connection,
    channel: Channel,
    arrivals: Arrivals,
    /// Cancelled when the consumer must stop lagging; `stop` ends it.
    steady: CancellationToken,
    stop: CancellationToken,
    consumer: tokio::task::JoinHandle<Result<()>>,
}

impl Amqp {
    /// The exchange the relays publish to (declared as they declare it) and one queue bound
    /// to it, limited to 5 messages with `x-overflow = reject-publish`, consumed by a
    /// consumer that records arrivals and now and then lags.
    async fn setup(name: &str, seed: u64, faults: Arc<Faults>) -> Result<Amqp> {
        let url = Service::Amqp.url();
        let connect = Connection::connect(&url, ConnectionProperties::default());
        let rabbitmq = format!("RabbitMQ at {}", redact_url(&url));
        let connection = tokio::time::timeout(Duration::from_secs(5), connect)
            .await
            .ctx(format_args!("{rabbitmq} did not answer within 5 s"))?
            .ctx(rabbitmq)?;
        let channel = connection.create_channel().await.ctx("RabbitMQ")?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let (topic, none) = (ExchangeKind::Topic, FieldTable::default());
        let declared = channel.exchange_declare(name.into(), topic, durable, none.clone());
        declared.await.ctx("declaring the exchange")?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-max-length".into(), AMQPValue::LongInt(5));
        let overflow = AMQPValue::LongString(LongString::from("reject-publish"));
        arguments.insert("x-overflow".into(), overflow);
        // The queue of a run that crashed goes away after half an hour unused.
        arguments.insert("x-expires".into(), AMQPValue::LongInt(1_800_000));
        let options = QueueDeclareOptions::default();
        let declared = channel.queue_declare(name.into(), options, arguments);
        declared.await.ctx("declaring the queue")?;
        // Bound to the run's topic only: the poison topic is routed nowhere until the end.
        let bind = QueueBindOptions::default();
        let bound = channel.queue_bind(name.into(), name.into(), TOPIC.into(), bind, none.clone());
        bound.await.ctx("binding the queue")?;
        // Manual acks and a prefetch of 1: a lagging consumer holds one message, the rest wait
        // in the queue and count against its limit, so refusals start at once.
        let consuming = connection.create_channel().await.ctx("RabbitMQ")?;
        let qos = consuming.basic_qos(1, BasicQosOptions::default());
        qos.await.ctx("basic.qos")?;
        let options = BasicConsumeOptions::default();
        let consumer = consuming.basic_consume(name.into(), "chaos".into(), options, none);
        let consumer = consumer.await.ctx("basic.consume")?;
        let arrivals = Arrivals::default();
        let (steady, stop) = (CancellationToken::new(), CancellationToken::new());
        let lag = Lag {
            rng: fastrand::Rng::with_seed(seed),
            steady: steady.clone(),
            faults,
        };
        let task = consume(consumer, arrivals.clone(), lag, stop.clone());
        Ok(Amqp {
            connection,
            channel,
            arrivals,
            steady,
            stop,
            consumer: tokio::spawn(task),
        })
    }

    /// Lets the consumer empty the queue (ready count 0, nothing new for a second), then
    /// stops it.
    async fn drain(&mut self, name: &str) -> Result<Vec<Vec<u8>>> {
        self.steady.cancel();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = (usize::MAX, Instant::now());
        while Instant::now() < deadline && !self.consumer.is_finished() {
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let queue = self
                .channel
                .queue_declare(name.into(), passive, FieldTable::default());
            let ready = queue.await.ctx("checking the queue")?.message_count();
            let got = self.arrivals.lock().map(|a| a.len()).unwrap_or(0);
            if got != last.0 {
                last = (got, Instant::now());
            }
            if ready == 0 && last.1.elapsed() >= Duration::from_secs(1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.stop.cancel();
        (&mut self.consumer).await.ctx("the AMQP consumer task")??;
        Ok(self
            .arrivals
            .lock()
            .map_err(|_| "arrivals poisoned")?
            .clone())
    }

    async fn cleanup(&mut self, name: &str) -> Result<()> {
        self.stop.cancel();
        let options = Default::default();
        self.channel
            .queue_delete(name.into(), options)
            .await
            .ctx("queue.delete")?;
        let options = Default::default();
        self.channel
            .exchange_delete(name.into(), options)
            .await
            .ctx("exchange.delete")?;
        self.connection.close(200, "OK".into()).await.ctx("closing")
    }
}

/// How the AMQP consumer lags: every 1–4 s it takes nothing for 0.5–2.5 s, so the queue
/// fills to its limit and RabbitMQ refuses (nacks) publishes, which the relays retry. Short
/// and frequent, so that keys often wait to retry while others flow again.
struct Lag {
    rng: fastrand::Rng,
    steady: CancellationToken,
    faults: Arc<Faults>,
}

impl Lag {
    fn next_pause(&mut self) -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_millis(self.rng.u64(1000..4000))
    }

    async fn pause(&mut self) {
        if self.steady.is_cancelled() {
            return;
        }
        self.faults.pauses.fetch_add(1, Relaxed);
        let pause = Duration::from_millis(self.rng.u64(500..2500));
        let _ = tokio::time::timeout(pause, self.steady.cancelled()).await;
    }
}

/// Records each delivery in order of receipt, then acknowledges it.
async fn consume(
    mut consumer: lapin::Consumer,
    arrivals: Arrivals,
    mut lag: Lag,
    stop: CancellationToken,
) -> Result<()> {
    let mut pause_at = lag.next_pause();
    loop {
        let next = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            next = tokio::time::timeout_at(pause_at, consumer.next()) => next,
        };
        let delivery = match next {
            Err(_) => {
                lag.pause().await;
                pause_at = lag.next_pause();
                continue;
            }
            Ok(None) => return Err("RabbitMQ cancelled the chaos consumer".into()),
            Ok(Some(delivery)) => delivery.ctx("the chaos consumer failed")?,
        };
        let received = arrivals.lock().map(|mut a| a.push(delivery.data.clone()));
        received.map_err(|_| "arrivals poisoned")?;
        let acked = delivery.acker.ack(BasicAckOptions::default());
        acked.await.ctx("acknowledging a delivery")?;
    }
}

async fn redis_connection() -> Result<redis::aio::MultiplexedConnection> {
    let url = Service::Redis.url();
    let redis = format!("Redis at {}", redact_url(&url));
    let client = redis::Client::open(url).ctx(&redis)?;
    let connect = client.get_multiplexed_async_connection();
    tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .ctx(format_args!("{redis} did not answer within 5 s"))?
        .ctx(redis)
}

/// The whole stream, oldest entry first, 1,000 entries per XRANGE.
async fn redis_range(stream: &str) -> Result<Vec<Vec<u8>>> {
    let mut con = redis_connection().await?;
    let (mut payloads, mut start) = (Vec::new(), "-".to_string());
    loop {
        let reply: StreamRangeReply = con
            .xrange_count(stream, &start, "+", 1000)
            .await
            .ctx(format_args!("XRANGE {stream}"))?;
        let Some(last) = reply.ids.last() else {
            return Ok(payloads);
        };
        start = format!("({}", last.id); // exclusive: after the last entry read
        payloads.extend(
            reply
                .ids
                .iter()
                .map(|e| e.get(outbox_redis::wire::PAYLOAD).unwrap_or_default()),
        );
    }
}

/// A tansu of the run's own (killed on drop), listening on `listen` and advertising
/// `proxy`, with a topic `name` of one partition, so offsets are the order of receipt.
async fn start_tansu(name: &str, listen: &str, proxy: &str) -> Result<Tansu> {
    // In the run's directory, with the relays' logs: kept when the run fails.
    let dir = std::env::temp_dir().join(name);
    std::fs::create_dir_all(&dir).ctx(dir.display())?;
    let tansu = Tansu::start(listen, proxy, dir.join("tansu.log")).await?;
    try_create_topic(proxy, name, 1, &[]).await?;
    Ok(tansu)
}

/// The topic's one partition from the start to its high watermark.
async fn kafka_read(brokers: &str, topic: &str) -> Result<Vec<Vec<u8>>> {
    let (brokers, topic) = (brokers.to_string(), topic.to_string());
    let read = move || -> Result<Vec<Vec<u8>>> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("outbox-chaos-{topic}"))
            .set("enable.auto.commit", "false")
            .create()
            .ctx("Kafka consumer")?;
        let timeout = Duration::from_secs(10);
        let (_, high) = consumer
            .fetch_watermarks(&topic, 0, timeout)
            .ctx("watermarks")?;
        let mut assignment = TopicPartitionList::new();
        let from_start = assignment.add_partition_offset(&topic, 0, Offset::Beginning);
        from_start.ctx("assignment")?;
        consumer.assign(&assignment).ctx("assign")?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut payloads, mut next) = (Vec::new(), 0);
        // Up to the high watermark, then on until nothing comes for 2 s: tansu 0.6 was seen
        // to report a watermark a few records short of its last, which is not a loss.
        let mut quiet = Instant::now();
        while next < high || quiet.elapsed() < Duration::from_secs(2) {
            if Instant::now() >= deadline {
                return Err(format!("read {next} of {high} records of {topic}"));
            }
            if let Some(message) = consumer.poll(Duration::from_millis(200)) {
                let message = message.ctx(format_args!("consuming {topic}"))?;
                payloads.push(message.payload().unwrap_or_default().to_vec());
                next = message.offset() + 1;
                quiet = Instant::now();
            }
        }
        if next != high {
            println!(
                "chaos: {topic} had records up to offset {next}, past its high watermark {high}"
            );
        }
        Ok(payloads)
    };
    tokio::task::spawn_blocking(read)
        .await
        .ctx("Kafka consumer task")?
}

/// The whole stream in stream order, through an ordered consumer.
async fn nats_read(js: &jetstream::Context, name: &str) -> Result<Vec<Vec<u8>>> {
    let mut stream = js.get_stream(name).await.ctx("stream")?;
    let count = stream.info().await.ctx("stream info")?.state.messages as usize;
    if count == 0 {
        return Ok(Vec::new());
    }
    let config = jetstream::consumer::pull::OrderedConfig::default();
    let ordered = stream
        .create_consumer(config)
        .await
        .ctx("ordered consumer")?;
    let mut messages = ordered.messages().await.ctx("consuming")?.take(count);
    let mut payloads = Vec::with_capacity(count);
    loop {
        match tokio::time::timeout(Duration::from_secs(10), messages.next()).await {
            Ok(Some(message)) => payloads.push(message.ctx("consuming")?.payload.to_vec()),
            Ok(None) => return Ok(payloads),
            Err(_) => return Err(format!("read {} of {count} from {name}", payloads.len())),
        }
    }
}
