//! The Kafka sink: one idempotent producer, a batch produced at once.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::envelope::{self, Envelope};
use outbox_core::{Message, Outcome, Receipt, Result, Sink, SinkCapabilities};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientConfig, ClientContext};
use tokio::time::{Instant, sleep, timeout_at};

use crate::KafkaConfig;
use crate::error::{
    config_error, delivery_error, health_failed, health_not_finished, no_report, producer_closed,
    session_broken,
};
use outbox_core::config::Settings;

/// Extra wait for delivery reports past librdkafka's own `message.timeout.ms`, which
/// normally reports first; this bounds a publish whose reports librdkafka holds back (the
/// producer is then replaced).
const REPORT_GRACE: Duration = Duration::from_secs(5);

/// How long to wait between tries while librdkafka's local queue is full.
const QUEUE_FULL_WAIT: Duration = Duration::from_millis(20);

/// Publishes outbox messages to Kafka with an idempotent producer (librdkafka through
/// rdkafka).
///
/// Each message goes to the Kafka topic its outbox topic maps to, keyed by its partition
/// key (no key when it has none) and timestamped with its created time, with its headers
/// plus the envelope ([`crate::wire`]). A batch is handed to librdkafka in order
/// and every delivery report is awaited; the receipt is `partition:offset`.
pub struct KafkaSink {
    config: KafkaConfig,
    client_config: ClientConfig,
    /// Replaced when librdkafka raises a fatal error (an idempotent producer cannot recover
    /// from one) or holds delivery reports past the deadline; a clone is used for each call.
    producer: Mutex<SinkProducer>,
    /// librdkafka's last broker error since the last success, shared by the producers.
    broker_error: BrokerError,
}

/// The producer, with the sink's context.
type SinkProducer = FutureProducer<SinkContext>;

/// librdkafka's last broker error (its reason), until a delivery or health check succeeds.
type BrokerError = Arc<Mutex<Option<String>>>;

/// The producers' context: logs librdkafka's errors as rdkafka's default context does, and
/// keeps the last one, so that an unavailable publish or health check can say why the
/// brokers could not be reached (a refused TLS handshake, a failed SASL authentication, a
/// refused connection); librdkafka reports those apart from the calls that fail.
struct SinkContext {
    broker_error: BrokerError,
}

impl ClientContext for SinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::error!("librdkafka: {error}: {reason}");
        // "All brokers are down" follows the error that says why: keep that one.
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::AllBrokersDown) {
            *lock(&self.broker_error) = Some(reason.to_string());
        }
    }
}

/// Locks `mutex`, also after a panic elsewhere (what it guards stays usable).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

outbox_core::debug_shows_config!(KafkaSink);

impl KafkaSink {
    /// Checks the settings and creates the producer. It connects in the background: an
    /// unreachable broker shows in [`Sink::health`], not here.
    pub fn new(config: KafkaConfig) -> Result<Self> {
        config.validate()?;
        let client_config = config.client_config();
        let broker_error = BrokerError::default();
        let producer = create_producer(&config, &client_config, &broker_error)?;
        tracing::info!(
            bootstrap_servers = %config.bootstrap_servers,
            topic_template = %config.topic_template,
            tls = client_config
                .get("security.protocol")
                .is_some_and(|p| p.to_ascii_lowercase().ends_with("ssl")),
            "Kafka sink ready"
        );
        Ok(KafkaSink {
            config,
            client_config,
            producer: Mutex::new(producer),
            broker_error,
        })
    }

    /// The sink's settings.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// The producer in use, replaced first if it has raised a fatal error.
    fn producer(&self) -> Result<SinkProducer> {
        let mut current = lock(&self.producer);
        if let Some((code, reason)) = current.client().fatal_error() {
            // An idempotent producer cannot recover from a fatal error (for example a
            // sequence gap the broker refused); a new one starts a new producer id.
            tracing::warn!(?code, %reason, "Kafka producer hit a fatal error; creating a new one");
            self.replace(&mut current)?;
        }
        Ok(current.clone())
    }

    /// Puts a new producer in place of `current`. Dropping the old one purges whatever it
    /// still holds, so nothing the worker was told had failed is written later.
    fn replace(&self, current: &mut SinkProducer) -> Result<()> {
        let new = create_producer(&self.config, &self.client_config, &self.broker_error)?;
        let old = std::mem::replace(current, new);
        // Dropping purges and flushes for up to half a second: keep it off the runtime.
        drop(tokio::task::spawn_blocking(move || drop(old)));
        Ok(())
    }

    /// librdkafka's last broker error since the last success, if any.
    fn broker_error(&self) -> Option<String> {
        lock(&self.broker_error).clone()
    }

    /// Hands one message to librdkafka, waiting while its local queue is full.
    async fn enqueue(
        &self,
        producer: &SinkProducer,
        message: &Message,
        topic: &str,
        queue_deadline: Instant,
    ) -> Result<DeliveryFuture> {
        // The created time is the record's timestamp (CreateTime), as the envelope's
        // `outbox-created-at` is, so time-based consumers see when it happened.
        let mut record = FutureRecord::to(topic)
            .payload(message.payload.as_slice())
            .timestamp(message.created_at.timestamp_millis())
            .headers(headers(message));
        if let Some(key) = &message.key {
            record = record.key(key.as_str());
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < queue_deadline =>
                {
                    record = back;
                    sleep(QUEUE_FULL_WAIT).await;
                }
                Err((error, _)) => {
                    let broker_error = self.broker_error();
                    return Err(delivery_error(
                        error,
                        topic,
                        &self.config.bootstrap_servers,
                        broker_error.as_deref(),
                    ));
                }
            }
        }
    }
}

#[async_trait]
impl Sink for KafkaSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        let producer = self.producer()?;
        let deadline = Instant::now() + self.config.publish_timeout + REPORT_GRACE;
        let queue_deadline = Instant::now() + self.config.publish_timeout;

        // Hand every message to librdkafka in order first, so the batch goes out together;
        // then collect the reports.
        let mut pending: Vec<(String, Result<DeliveryFuture>)> = Vec::with_capacity(batch.len());
        for message in batch {
            let (topic, sent) = match self.config.kafka_topic(&message.topic) {
                Ok(topic) => {
                    let sent = self
                        .enqueue(&producer, message, &topic, queue_deadline)
                        .await;
                    (topic, sent)
                }
                Err(error) => (message.topic.clone(), Err(error)),
            };
            pending.push((topic, sent));
        }

        let mut outcomes = Vec::with_capacity(batch.len());
        // Set when the producer must be replaced: reports overdue, or its idempotence
        // session broken.
        let mut reset: Option<&str> = None;
        for (topic, sent) in pending {
            let outcome = match sent {
                Err(error) => Outcome::Failed(error),
                Ok(delivery) => match timeout_at(deadline, delivery).await {
                    Ok(Ok(Ok(delivered))) => Outcome::Delivered(Receipt::new(format!(
                        "{}:{}",
                        delivered.partition, delivered.offset
                    ))),
                    Ok(Ok(Err((error, _)))) => {
                        if error.rdkafka_error_code().is_some_and(session_broken) {
                            reset = Some("its producer id or epoch was refused");
                        }
                        Outcome::Failed(delivery_error(
                            error,
                            &topic,
                            &self.config.bootstrap_servers,
                            self.broker_error().as_deref(),
                        ))
                    }
                    Ok(Err(_canceled)) => Outcome::Failed(producer_closed(&topic)),
                    Err(_elapsed) => {
                        reset = Some("delivery reports are overdue");
                        Outcome::Failed(no_report(
                            &topic,
                            &self.config.bootstrap_servers,
                            self.config.publish_timeout + REPORT_GRACE,
                            self.broker_error().as_deref(),
                        ))
                    }
                },
            };
            outcomes.push(outcome);
        }
        drop(producer);
        if outcomes.iter().any(|o| matches!(o, Outcome::Delivered(_))) {
            // The brokers took messages: an earlier broker error no longer explains anything.
            lock(&self.broker_error).take();
        }
        let replaced = if let Some(why) = reset {
            // Overdue: librdkafka still holds messages the worker now takes as undelivered
            // (its idempotent producer can hold back a time-out while it cannot reach the
            // broker); dropping the producer drops them rather than letting them land later.
            // Refused id or epoch: this producer will be refused again (tansu does this
            // after a connection cut during an epoch bump); a new one gets a new id.
            tracing::warn!(reason = why, "replacing the Kafka producer");
            let mut current = lock(&self.producer);
            self.replace(&mut current)
        } else {
            // Replace a producer that failed fatally now, so the next call starts clean.
            self.producer().map(drop)
        };
        // The outcomes above stand either way.
        if let Err(error) = replaced {
            tracing::error!(%error, "could not replace the Kafka producer");
        }
        Ok(outcomes)
    }

    async fn health(&self) -> Result<()> {
        let producer = self.producer()?;
        let timeout = self.config.health_timeout;
        let checked = tokio::task::spawn_blocking(move || request_metadata(&producer, timeout))
            .await
            .map_err(health_not_finished)?;
        match checked {
            Ok(()) => {
                lock(&self.broker_error).take();
                Ok(())
            }
            Err(code) => Err(health_failed(
                &self.config.bootstrap_servers,
                timeout,
                code,
                self.broker_error().as_deref(),
            )),
        }
    }

    /// `ordered_key_runs` stays off: the idempotent producer keeps a partition's order but
    /// does not stop it at a failed message (a refused batch bumps the epoch and the later
    /// ones are written; a message timed out in the queue leaves a gap, also with
    /// `enable.gapless.guarantee`), so a key's later message in the same call could land
    /// after its failed earlier one (`tests/mock.rs` shows it; docs/sinks/kafka.md).
    fn capabilities(&self) -> SinkCapabilities {
        // The largest message depends on the topic's max.message.bytes, which the producer
        // does not know: too large a message is reported and dead-lettered.
        SinkCapabilities::default()
            .with_ordered_key_runs(false)
            .with_deduplication(false)
            .with_max_payload(None)
    }

    /// `publish_timeout` (librdkafka's `message.timeout.ms`), plus the grace the sink gives
    /// late delivery reports.
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        Some(self.config.publish_timeout + REPORT_GRACE)
    }
}

/// A producer with `client_config` (made from `config`) that keeps its broker errors in
/// `broker_error`.
fn create_producer(
    config: &KafkaConfig,
    client_config: &ClientConfig,
    broker_error: &BrokerError,
) -> Result<SinkProducer> {
    let context = SinkContext {
        broker_error: broker_error.clone(),
    };
    client_config
        .create_with_context(context)
        .map_err(|error| config_error(error, config))
}

/// The Kafka headers of a message: its own, then the envelope (which wins over its own of
/// the same name: those are left out).
fn headers(message: &Message) -> OwnedHeaders {
    let envelope = Envelope::of(message);
    let fields = envelope.fields();
    envelope::application_headers(message)
        .chain(fields.iter().map(|(name, value)| (*name, value.as_ref())))
        .fold(
            OwnedHeaders::new_with_capacity(message.headers.len() + fields.len()),
            |h, (key, value)| {
                h.insert(Header {
                    key,
                    value: Some(value),
                })
            },
        )
}

/// A metadata request for the brokers and the topics this producer already uses (not the
/// whole cluster's topics, which can be large), within `timeout`.
fn request_metadata(
    producer: &SinkProducer,
    timeout: Duration,
) -> std::result::Result<(), RDKafkaErrorCode> {
    use rdkafka::bindings as rd;
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let mut metadata: *const rd::rd_kafka_metadata_t = std::ptr::null();
    // SAFETY: the client handle lives as long as `producer`, which we hold; with
    // all_topics = 0 and no topic handle, librdkafka asks for the brokers and locally
    // known topics, and on success hands us a metadata object that we free once below.
    let err = unsafe {
        rd::rd_kafka_metadata(
            producer.client().native_ptr(),
            0,
            std::ptr::null_mut(),
            &mut metadata,
            timeout_ms,
        )
    };
    if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        return Err(err.into());
    }
    if !metadata.is_null() {
        // SAFETY: `metadata` came from the successful call above and is freed only here.
        unsafe { rd::rd_kafka_metadata_destroy(metadata) };
    }
    Ok(())
}
