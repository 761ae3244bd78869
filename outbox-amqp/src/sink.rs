//! The AMQP sink: publishes each batch on one confirm-mode channel and awaits the broker's
//! confirms together.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use lapin::options::{
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    PublisherConfirm,
};
use outbox_core::{
    Error, ErrorKind, Message, Outcome, Receipt, Result, Sink, SinkCapabilities, redact_url,
};
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout, timeout_at};

use crate::config::{AmqpConfig, ExchangeSetup, MAX_NAME_LEN, Unroutable};
use crate::error::{from_lapin, reply_code};

/// Header that carries the message's partition key.
pub const KEY_HEADER: &str = "outbox-key";
/// Header that carries the W3C `traceparent`.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// Header that carries the W3C `tracestate`.
pub const TRACESTATE_HEADER: &str = "tracestate";
/// Content type of a message without a `content-type` header.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

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
    uri: AMQPUri,
    /// The URI without its password, for logs and errors.
    url: String,
    state: Mutex<State>,
}

impl std::fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSink")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The connection, and what is known about reconnecting when there is none.
#[derive(Default)]
struct State {
    link: Option<Link>,
    /// Failed connection attempts in a row.
    failures: u32,
    /// No new attempt before this.
    retry_at: Option<Instant>,
    /// Why the last attempt failed.
    last_error: String,
}

/// An open connection with its publishing channel.
struct Link {
    connection: Connection,
    channel: Channel,
    /// Exchanges checked or declared on this connection.
    ready: HashSet<String>,
}

impl Link {
    fn is_open(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }
}

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
    /// Errors: [`ErrorKind::Config`] for bad settings, a missing exchange with passive set-up,
    /// an exchange declared with another kind, or refused credentials;
    /// [`ErrorKind::Unavailable`] when the broker cannot be reached in time.
    pub async fn connect(config: AmqpConfig) -> Result<Self> {
        config.validate()?;
        let uri = config.parse_uri()?;
        let sink = AmqpSink {
            url: redact_url(&config.url),
            uri,
            config,
            state: Mutex::new(State::default()),
        };
        let mut link = sink.open_link(true).await?;
        for exchange in sink.fixed_exchanges() {
            sink.setup_exchange(&mut link, &exchange)
                .await
                .map_err(|e| sink.startup_error(e))?;
        }
        tracing::info!(url = %sink.url, "connected to the AMQP broker");
        sink.state.lock().await.link = Some(link);
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
        let uri = config.parse_uri()?;
        Ok(AmqpSink {
            url: redact_url(&config.url),
            uri,
            config,
            state: Mutex::new(State::default()),
        })
    }

    /// The settings this sink runs with.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// Closes the connection (within `connect_timeout`). Later calls reconnect.
    pub async fn close(&self) {
        let link = self.state.lock().await.link.take();
        if let Some(link) = link {
            let close = link.connection.close(200, "outbox relay stopping".into());
            if let Ok(Err(error)) = timeout(self.config.connect_timeout, close).await {
                tracing::debug!(url = %self.url, %error, "closing the AMQP connection");
            }
        }
    }

    /// An exchange that is missing or declared otherwise can only be fixed by the operator:
    /// at start-up that is a configuration error.
    fn startup_error(&self, error: Error) -> Error {
        if error.kind() == ErrorKind::Unavailable {
            return error;
        }
        Error::config(text(&error))
    }

    /// Exchanges whose names do not depend on the topic.
    fn fixed_exchanges(&self) -> Vec<String> {
        let mut names: Vec<String> = std::iter::once(&self.config.exchange)
            .chain(self.config.routes.values().map(|r| &r.exchange))
            .filter(|name| !name.contains("{topic}"))
            .cloned()
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Connects and opens the publishing channel in confirm mode, within `connect_timeout`.
    /// A refused login is a configuration error `at_startup`; later it is unavailable, like
    /// any other failure to connect.
    async fn open_link(&self, at_startup: bool) -> Result<Link> {
        let open = async {
            let properties =
                ConnectionProperties::default().with_connection_name("outbox relay".into());
            let connection = Connection::connect_uri(self.uri.clone(), properties).await?;
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(Link {
                connection,
                channel,
                ready: HashSet::new(),
            })
        };
        match timeout(self.config.connect_timeout, open).await {
            Ok(Ok(link)) => Ok(link),
            // 403 ACCESS_REFUSED: user or password; 530 NOT_ALLOWED: vhost.
            Ok(Err(error)) if at_startup && matches!(reply_code(&error), Some(403 | 530)) => {
                Err(Error::config(format!(
                    "the AMQP broker at {} refused the login; check the user, password and \
                     vhost in sink.url",
                    self.url
                ))
                .with_source(error))
            }
            Ok(Err(error)) => Err(Error::unavailable(format!(
                "cannot connect to the AMQP broker at {}",
                self.url
            ))
            .with_source(error)),
            Err(_) => Err(Error::unavailable(format!(
                "connecting to the AMQP broker at {} timed out after {:?} (sink.connect_timeout)",
                self.url, self.config.connect_timeout
            ))),
        }
    }

    /// The open link, reconnecting if it was lost and the reconnect backoff allows.
    async fn link<'s>(&self, state: &'s mut State) -> Result<&'s mut Link> {
        if state.link.as_ref().is_some_and(|link| !link.is_open()) {
            tracing::warn!(url = %self.url, "AMQP connection or channel lost; reconnecting");
            state.link = None;
        }
        if state.link.is_none() {
            if let Some(at) = state.retry_at
                && Instant::now() < at
            {
                return Err(Error::unavailable(format!(
                    "not connected to the AMQP broker at {}; next attempt in {:?} after {} \
                     failed (last error: {})",
                    self.url,
                    at - Instant::now(),
                    state.failures,
                    state.last_error
                )));
            }
            match self.open_link(false).await {
                Ok(link) => {
                    if state.failures > 0 {
                        tracing::info!(url = %self.url, failures = state.failures, "reconnected to the AMQP broker");
                    }
                    state.failures = 0;
                    state.retry_at = None;
                    state.link = Some(link);
                }
                Err(error) => {
                    state.failures = state.failures.saturating_add(1);
                    let wait = self.config.reconnect_backoff.delay(state.failures);
                    state.retry_at = Some(Instant::now() + wait);
                    state.last_error = error.to_string();
                    tracing::warn!(url = %self.url, %error, ?wait, "cannot reconnect to the AMQP broker");
                    return Err(error);
                }
            }
        }
        state
            .link
            .as_mut()
            .ok_or_else(|| Error::unavailable("AMQP connection missing after connecting"))
    }

    /// Checks or declares `name` once per connection. A refused declare closes its channel,
    /// so it runs on a short-lived channel of its own, never the publishing one.
    async fn setup_exchange(&self, link: &mut Link, name: &str) -> Result<()> {
        // The default exchange ("") always exists and cannot be declared.
        if name.is_empty() || link.ready.contains(name) {
            return Ok(());
        }
        let (kind, passive) = match &self.config.exchange_setup {
            ExchangeSetup::Declare(kind) if !name.starts_with("amq.") => (kind.clone(), false),
            _ => (ExchangeKind::default(), true),
        };
        let exchange = ShortString::try_new(name).map_err(|_| {
            Error::permanent(format!(
                "exchange name `{name}` is longer than {MAX_NAME_LEN} bytes"
            ))
        })?;
        let connection = &link.connection;
        let declare = async {
            let channel = connection.create_channel().await?;
            let options = ExchangeDeclareOptions {
                passive,
                durable: true,
                ..ExchangeDeclareOptions::default()
            };
            channel
                .exchange_declare(exchange, kind, options, FieldTable::default())
                .await?;
            // The broker closed the channel already if the declare was refused.
            channel.close(200, "OK".into()).await
        };
        let verb = if passive { "checking" } else { "declaring" };
        match timeout(self.config.connect_timeout, declare).await {
            Ok(Ok(())) => {
                link.ready.insert(name.to_string());
                Ok(())
            }
            Ok(Err(error)) if passive && reply_code(&error) == Some(404) => {
                Err(Error::temporary(format!(
                    "exchange `{name}` does not exist on {}; create it, or set \
                     sink.exchange_setup to declare exchanges",
                    self.url
                ))
                .with_source(error))
            }
            Ok(Err(error)) => Err(from_lapin(
                format!("{verb} exchange `{name}` on {}", self.url),
                error,
            )),
            Err(_) => Err(Error::unavailable(format!(
                "{verb} exchange `{name}` on {} timed out after {:?} (sink.connect_timeout)",
                self.url, self.config.connect_timeout
            ))),
        }
    }

    /// Renders the route and builds the properties; a message that can never be published
    /// as it is fails permanently here, before anything is sent.
    fn prepare(&self, message: &Message) -> Result<Prepared> {
        let id = message.id;
        let (exchange_template, key_template) = match self.config.routes.get(&message.topic) {
            Some(route) => (&route.exchange, &route.routing_key),
            None => (&self.config.exchange, &self.config.routing_key),
        };
        let key = message.key.as_deref().unwrap_or("");
        let exchange = exchange_template.replace("{topic}", &message.topic);
        let routing_key = render(key_template, &message.topic, key);
        if routing_key.is_empty() {
            return Err(Error::permanent(format!(
                "routing key template `{key_template}` gives an empty routing key for message \
                 {id} (topic `{}`, partition key {:?}); give such messages a key or change the \
                 template",
                message.topic, message.key
            )));
        }
        let short = |what: &str, text: String| {
            ShortString::try_new(text).map_err(|e| {
                Error::permanent(format!("{what} of message {id} is too long for AMQP: {e}"))
            })
        };
        let exchange = short("the exchange name", exchange)?;
        let routing_key = short("the routing key", routing_key)?;
        if message.payload.len() > self.config.max_payload {
            return Err(Error::permanent(format!(
                "message {id} has {} bytes of payload, more than sink.max_payload ({} bytes)",
                message.payload.len(),
                self.config.max_payload
            )));
        }

        let mut headers = FieldTable::default();
        let mut header_size = 0;
        let mut add = |name: &str, value: &str| -> Result<()> {
            let name = ShortString::try_new(name).map_err(|_| {
                Error::permanent(format!(
                    "message {id} has a header name longer than {MAX_NAME_LEN} bytes"
                ))
            })?;
            // Encoded as name length, name, type tag, value length, value.
            header_size += name.as_str().len() + value.len() + 6;
            headers.insert(name, AMQPValue::LongString(LongString::from(value)));
            Ok(())
        };
        for (name, value) in &message.headers {
            add(name, value)?;
        }
        if let Some(key) = &message.key {
            add(KEY_HEADER, key)?;
        }
        if let Some(trace) = &message.trace_context {
            add(TRACEPARENT_HEADER, &trace.traceparent)?;
            if let Some(state) = &trace.tracestate {
                add(TRACESTATE_HEADER, state)?;
            }
        }
        let content_type = message.content_type().unwrap_or(DEFAULT_CONTENT_TYPE);
        let id_text = id.to_string();
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
        // Set up each exchange this batch uses, once per connection.
        let mut refused: HashMap<String, Error> = HashMap::new();
        for (_, p) in &prepared {
            let name = p.exchange.as_str();
            if refused.contains_key(name) {
                continue;
            }
            match self.setup_exchange(link, name).await {
                Ok(()) => {}
                Err(error) if error.kind() == ErrorKind::Unavailable => return Err(error),
                Err(error) => {
                    tracing::warn!(url = %self.url, exchange = name, %error, "exchange not usable");
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
                outcomes[i] = Some(Outcome::Failed(Error::permanent(format!(
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
                    let error = Error::unavailable(format!(
                        "publishing to the AMQP broker at {} failed",
                        self.url
                    ))
                    .with_source(error);
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
        for (i, receipt, confirm) in pending {
            let outcome = if let Some(error) = &lost {
                Outcome::Failed(copy(error))
            } else {
                match timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(None))) => Outcome::Delivered(receipt),
                    Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                        let text = format!(
                            "no queue took message {} (exchange/routing key {receipt}): the \
                             broker returned it with {} {}",
                            batch[i].id, returned.reply_code, returned.reply_text
                        );
                        Outcome::Failed(match self.config.unroutable {
                            Unroutable::Retry => Error::temporary(text),
                            Unroutable::DeadLetter => Error::permanent(text),
                        })
                    }
                    Ok(Ok(Confirmation::Nack(_))) => Outcome::Failed(Error::temporary(format!(
                        "the broker refused message {} (basic.nack; exchange/routing key \
                         {receipt})",
                        batch[i].id
                    ))),
                    Ok(Ok(Confirmation::NotRequested)) => {
                        let error = Error::unavailable(format!(
                            "the channel to {} is not in confirm mode",
                            self.url
                        ));
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
                        lost = Some(Error::unavailable(format!(
                            "the channel to {} closed before the broker confirmed: {}",
                            self.url,
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
        Ok(broken.is_some() || lost.is_some())
    }

    fn timed_out(&self, what: &str) -> Error {
        Error::unavailable(format!(
            "{what} to the AMQP broker at {} timed out after {:?} (sink.publish_timeout)",
            self.url, self.config.publish_timeout
        ))
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
            let mut state = self.state.lock().await;
            let link = self.link(&mut state).await?;
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
        let mut state = self.state.lock().await;
        let link = self.link(&mut state).await?;
        // One round trip on the publishing channel; basic.qos changes nothing for a publisher.
        let check = link.channel.basic_qos(0, BasicQosOptions::default());
        let error = match timeout(self.config.connect_timeout, check).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(error)) => Error::unavailable(format!(
                "health check of the AMQP broker at {} failed",
                self.url
            ))
            .with_source(error),
            Err(_) => Error::unavailable(format!(
                "health check of the AMQP broker at {} timed out after {:?} \
                 (sink.connect_timeout)",
                self.url, self.config.connect_timeout
            )),
        };
        state.link = None;
        Err(error)
    }

    fn capabilities(&self) -> SinkCapabilities {
        SinkCapabilities::default().with_max_payload(Some(self.config.max_payload))
    }

    /// Reconnecting (within `connect_timeout`) then publishing and confirming the batch
    /// (within `publish_timeout`).
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        Some(self.config.connect_timeout + self.config.publish_timeout)
    }
}

/// Replaces `{topic}` and `{key}` in a routing key template.
fn render(template: &str, topic: &str, key: &str) -> String {
    template.replace("{topic}", topic).replace("{key}", key)
}

/// An error of the same kind and text, for each message it concerns.
fn copy(error: &Error) -> Error {
    Error::new(error.kind(), text(error))
}

/// The error's message and sources, without the kind in front.
fn text(error: &Error) -> String {
    let text = error.to_string();
    let prefix = format!("{} error: ", error.kind());
    text.strip_prefix(&prefix).unwrap_or(&text).to_string()
}
