//! The AMQP sink: publishes each batch on one confirm-mode channel and awaits the broker's
//! confirms together.

use std::collections::HashMap;

use async_trait::async_trait;
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Confirmation, PublisherConfirm};
use outbox_core::envelope::{self, Envelope};
use outbox_core::{Error, ErrorKind, Message, Outcome, Receipt, Result, Sink, SinkCapabilities};
use tokio::time::{Instant, timeout, timeout_at};

use crate::config::{AmqpConfig, MAX_NAME_LEN, Route};
use crate::connection::{Connector, Link};
use crate::error::{
    at_startup, channel_lost, copy, from_lapin, nacked, returned, text, timed_out, transport,
    unpublishable,
};
use outbox_core::config::Settings;

/// Publishes outbox messages to an AMQP 0-9-1 broker (RabbitMQ) with publisher confirms.
///
/// One connection and one channel in confirm mode per sink. A batch is published message by
/// message in the order given, then all its confirms are awaited under one deadline, so a
/// batch costs one round trip rather than one per message. Messages are persistent and
/// published `mandatory`: one that no queue takes comes back and fails as configured by
/// [`AmqpConfig::unroutable`](crate::AmqpConfig::unroutable).
///
/// A lost connection or channel is reopened on the next call, with
/// [`reconnect_backoff`](crate::AmqpConfig::reconnect_backoff) between failed attempts; until
/// then [`health`](Sink::health) and [`publish`](Sink::publish) report
/// [`ErrorKind::Unavailable`], which charges no attempt.
pub struct AmqpSink {
    config: AmqpConfig,
    /// The route of topics not in `routes`.
    default_route: Route,
    connection: Connector,
}

outbox_core::debug_shows_config!(AmqpSink);

/// A message turned into what `basic.publish` needs.
struct Prepared {
    exchange: ShortString,
    routing_key: ShortString,
    properties: BasicProperties,
    /// Upper bound of the encoded content header, to check against the frame size.
    header_size: usize,
}

impl AmqpSink {
    /// Validates `config`, connects, and checks (or declares) every exchange that does not
    /// depend on the topic. Exchanges named after topics are set up when first used.
    ///
    /// Errors: [`ErrorKind::Config`] for bad settings (keyed relative to the sink's section),
    /// a missing exchange with passive set-up, an exchange declared with another kind, or
    /// refused credentials; [`ErrorKind::Unavailable`] when the broker cannot be reached in
    /// time.
    pub async fn connect(config: AmqpConfig) -> Result<Self> {
        let sink = Self::lazy(config)?;
        let mut link = sink.connection.open(true).await?;
        for exchange in sink.fixed_exchanges() {
            sink.connection
                .setup_exchange(&mut link, &exchange)
                .await
                .map_err(at_startup)?;
        }
        tracing::info!(url = %sink.connection.url(), "connected to the AMQP broker");
        sink.connection.lock().await.link = Some(link);
        Ok(sink)
    }

    /// Validates `config` without connecting: the first publish or health check connects
    /// (with the reconnect backoff), and every exchange is checked or declared when first
    /// used. For a relay that may start before its broker, and for tests of a broker that
    /// is not there.
    ///
    /// Errors: [`ErrorKind::Config`] for bad settings.
    pub fn lazy(config: AmqpConfig) -> Result<Self> {
        config.validate()?;
        Ok(AmqpSink {
            default_route: config.default_route()?,
            connection: Connector::new(&config)?,
            config,
        })
    }

    /// The settings this sink runs with.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// Closes the connection (within `connect_timeout`). Later calls reconnect.
    pub async fn close(&self) {
        self.connection.close().await;
    }

    /// Exchanges whose names do not depend on the topic.
    fn fixed_exchanges(&self) -> Vec<String> {
        let mut names: Vec<String> = std::iter::once(&self.default_route)
            .chain(self.config.routes.values())
            .filter(|route| !route.exchange.uses_topic())
            .map(|route| route.exchange.as_str().to_string())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Renders the route and builds the properties; a message that can never be published
    /// as it is fails permanently here, before anything is sent.
    fn prepare(&self, message: &Message) -> Result<Prepared> {
        let id = message.id;
        let route = self
            .config
            .routes
            .get(&message.topic)
            .unwrap_or(&self.default_route);
        let key = message.key.as_deref().unwrap_or("");
        let exchange = route.exchange.render(&message.topic, key);
        let routing_key = route.routing_key.render(&message.topic, key);
        if routing_key.is_empty() {
            return Err(unpublishable(format!(
                "routing key template `{}` gives an empty routing key for message {id} (topic \
                 `{}`, partition key {:?}); give such messages a key or change the template",
                route.routing_key, message.topic, message.key
            )));
        }
        let short = |what: &str, text: String| {
            ShortString::try_new(text).map_err(|e| {
                unpublishable(format!("{what} of message {id} is too long for AMQP: {e}"))
            })
        };
        let exchange = short("the exchange name", exchange)?;
        let routing_key = short("the routing key", routing_key)?;
        if message.payload.len() > self.config.max_payload {
            return Err(unpublishable(format!(
                "message {id} has {} bytes of payload, more than sink.max_payload ({} bytes)",
                message.payload.len(),
                self.config.max_payload
            )));
        }

        let mut headers = FieldTable::default();
        let mut header_size = 0;
        let mut add = |name: &str, value: &str| -> Result<()> {
            let name = ShortString::try_new(name).map_err(|_| {
                unpublishable(format!(
                    "message {id} has a header name longer than {MAX_NAME_LEN} bytes"
                ))
            })?;
            // Encoded as name length, name, type tag, value length, value.
            header_size += name.as_str().len() + value.len() + 6;
            headers.insert(name, AMQPValue::LongString(LongString::from(value)));
            Ok(())
        };
        let envelope = Envelope::of(message);
        for (name, value) in envelope::application_headers(message) {
            add(name, value)?;
        }
        for (name, value) in envelope.fields() {
            add(name, &value)?;
        }
        let content_type = envelope.content_type;
        let id_text = envelope.id.clone();
        // Class, weight, body size, flags, delivery mode, timestamp, table length, and a
        // length byte per short string.
        header_size += 40
            + id_text.len()
            + content_type.len()
            + message.topic.len()
            + self.config.app_id.len();
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(id_text.into())
            .with_content_type(short("the content-type header", content_type.into())?)
            .with_timestamp(u64::try_from(message.created_at.timestamp()).unwrap_or(0))
            .with_type(short("the topic", message.topic.clone())?)
            .with_app_id(short("sink.app_id", self.config.app_id.clone())?)
            .with_headers(headers);
        Ok(Prepared {
            exchange,
            routing_key,
            properties,
            header_size,
        })
    }

    /// Publishes the prepared messages on `link` and awaits their confirms. Returns the
    /// outcomes by batch index, and whether the link must be dropped.
    async fn publish_on(
        &self,
        link: &mut Link,
        batch: &[Message],
        prepared: Vec<(usize, Prepared)>,
        outcomes: &mut [Option<Outcome>],
    ) -> Result<bool> {
        let url = self.connection.url();
        // Set up each exchange this batch uses, once per connection.
        let mut refused: HashMap<String, Error> = HashMap::new();
        for (_, p) in &prepared {
            let name = p.exchange.as_str();
            if refused.contains_key(name) {
                continue;
            }
            match self.connection.setup_exchange(link, name).await {
                Ok(()) => {}
                Err(error) if error.kind() == ErrorKind::Unavailable => return Err(error),
                Err(error) => {
                    tracing::warn!(url = %url, exchange = name, %error, "exchange not usable");
                    refused.insert(name.to_string(), error);
                }
            }
        }

        let frame_max = link.connection.configuration().frame_max() as usize;
        let deadline = Instant::now() + self.config.publish_timeout;
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let mut pending: Vec<(usize, Receipt, PublisherConfirm)> = Vec::new();
        let mut broken: Option<Error> = None;
        for (i, p) in prepared {
            if let Some(error) = refused.get(p.exchange.as_str()) {
                outcomes[i] = Some(Outcome::Failed(copy(error)));
                continue;
            }
            if let Some(error) = &broken {
                outcomes[i] = Some(Outcome::Failed(copy(error)));
                continue;
            }
            if p.header_size + 8 > frame_max {
                outcomes[i] = Some(Outcome::Failed(unpublishable(format!(
                    "the properties and headers of message {} take about {} bytes, more than \
                     the broker's frame size ({frame_max} bytes)",
                    batch[i].id, p.header_size
                ))));
                continue;
            }
            let receipt = Receipt::new(format!("{}/{}", p.exchange, p.routing_key));
            let publish = link.channel.basic_publish(
                p.exchange,
                p.routing_key,
                options,
                &batch[i].payload,
                p.properties,
            );
            match timeout_at(deadline, publish).await {
                Ok(Ok(confirm)) => pending.push((i, receipt, confirm)),
                Ok(Err(error)) => {
                    let error = transport(
                        format_args!("publishing to the AMQP broker at {url} failed"),
                        error,
                    );
                    outcomes[i] = Some(Outcome::Failed(copy(&error)));
                    broken = Some(error);
                }
                Err(_) => {
                    let error = self.timed_out("publishing");
                    outcomes[i] = Some(Outcome::Failed(copy(&error)));
                    broken = Some(error);
                }
            }
        }

        // All messages are on the wire: now collect the confirms, in order, under the same
        // deadline. The broker confirms in publishing order, so the first message whose
        // confirm is an error is the one the broker refused; those after it lost their
        // channel through no fault of their own and are released without an attempt.
        let mut lost: Option<Error> = None;
        // Returned messages, with the message whose confirm lapin attached each to: with an
        // ack for several messages at once (`multiple`) it attaches a return to any of them,
        // so a return is matched to its message by the message id it carries.
        let mut returns: Vec<(usize, BasicReturnMessage)> = Vec::new();
        for (i, receipt, confirm) in pending {
            let outcome = if let Some(error) = &lost {
                Outcome::Failed(copy(error))
            } else {
                match timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(None))) => Outcome::Delivered(receipt),
                    Ok(Ok(Confirmation::Ack(Some(back)))) => {
                        returns.push((i, back));
                        Outcome::Delivered(receipt)
                    }
                    Ok(Ok(Confirmation::Nack(_))) => Outcome::Failed(nacked(format!(
                        "the broker refused message {} (basic.nack; exchange/routing key \
                         {receipt})",
                        batch[i].id
                    ))),
                    Ok(Ok(Confirmation::NotRequested)) => {
                        let error =
                            channel_lost(format!("the channel to {url} is not in confirm mode"));
                        lost = Some(copy(&error));
                        Outcome::Failed(error)
                    }
                    Ok(Err(error)) => {
                        // A refusal (soft error) is this message's; a transport failure is
                        // nobody's: from_lapin makes the first Temporary, the second
                        // Unavailable.
                        let error = from_lapin(
                            format!("publishing message {} to {receipt}", batch[i].id),
                            error,
                        );
                        lost = Some(channel_lost(format!(
                            "the channel to {url} closed before the broker confirmed: {}",
                            text(&error)
                        )));
                        Outcome::Failed(error)
                    }
                    Err(_) => {
                        let error = self.timed_out("waiting for publisher confirms");
                        lost = Some(copy(&error));
                        Outcome::Failed(error)
                    }
                }
            };
            outcomes[i] = Some(outcome);
        }
        for (attached_to, back) in returns {
            let id = back
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str());
            let i = batch
                .iter()
                .position(|m| id == Some(m.id.to_string().as_str()))
                .unwrap_or(attached_to);
            let receipt = match &outcomes[i] {
                Some(Outcome::Delivered(receipt)) => receipt.to_string(),
                _ => continue,
            };
            outcomes[i] = Some(Outcome::Failed(returned(
                format!(
                    "no queue took message {} (exchange/routing key {receipt}): the broker \
                     returned it with {} {}",
                    batch[i].id, back.reply_code, back.reply_text
                ),
                self.config.unroutable,
            )));
        }
        Ok(broken.is_some() || lost.is_some())
    }

    fn timed_out(&self, what: &str) -> Error {
        timed_out(
            format_args!("{what} to the AMQP broker at {}", self.connection.url()),
            self.config.publish_timeout,
            "publish_timeout",
        )
    }
}

#[async_trait]
impl Sink for AmqpSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        let mut outcomes: Vec<Option<Outcome>> = batch.iter().map(|_| None).collect();
        let mut prepared = Vec::with_capacity(batch.len());
        for (i, message) in batch.iter().enumerate() {
            match self.prepare(message) {
                Ok(p) => prepared.push((i, p)),
                Err(error) => outcomes[i] = Some(Outcome::Failed(error)),
            }
        }
        if !prepared.is_empty() {
            let mut state = self.connection.lock().await;
            let link = self.connection.link(&mut state).await?;
            let drop_link = match self.publish_on(link, batch, prepared, &mut outcomes).await {
                Ok(drop_link) => drop_link,
                Err(error) => {
                    state.link = None;
                    return Err(error);
                }
            };
            if drop_link {
                // Unknown channel state: start afresh on the next call.
                state.link = None;
            }
        }
        outcomes
            .into_iter()
            .zip(batch)
            .map(|(outcome, message)| {
                outcome.ok_or_else(|| {
                    Error::temporary(format!("message {} was not published (a bug)", message.id))
                })
            })
            .collect()
    }

    async fn health(&self) -> Result<()> {
        let url = self.connection.url();
        let mut state = self.connection.lock().await;
        let link = self.connection.link(&mut state).await?;
        // One round trip on the publishing channel; basic.qos changes nothing for a publisher.
        let check = link.channel.basic_qos(0, BasicQosOptions::default());
        let error = match timeout(self.config.connect_timeout, check).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(error)) => transport(
                format_args!("health check of the AMQP broker at {url} failed"),
                error,
            ),
            Err(_) => timed_out(
                format_args!("health check of the AMQP broker at {url}"),
                self.config.connect_timeout,
                "connect_timeout",
            ),
        };
        state.link = None;
        Err(error)
    }

    /// `ordered_key_runs` stays off: a message the broker returns or nacks does not stop
    /// the next publish on the channel, so a key's later message in the same call would
    /// land after its failed earlier one (`tests/rabbitmq.rs` shows it). Holding the promise
    /// would take a confirm round trip per message of a key, which the worker's rounds cost
    /// already (docs/sinks/amqp.md).
    fn capabilities(&self) -> SinkCapabilities {
        SinkCapabilities::default()
            .with_ordered_key_runs(false)
            .with_max_payload(Some(self.config.max_payload))
    }

    /// Reconnecting (within `connect_timeout`) then publishing and confirming the batch
    /// (within `publish_timeout`).
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        Some(self.config.connect_timeout + self.config.publish_timeout)
    }
}
