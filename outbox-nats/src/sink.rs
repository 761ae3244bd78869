//! The NATS JetStream sink: each message becomes one JetStream publish; a batch is sent in one
//! go and its acknowledgements are awaited together.

use std::str::FromStr;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::{Context, ContextBuilder, PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::{ConnectOptions, HeaderMap, HeaderName, HeaderValue, ServerAddr};
use async_trait::async_trait;
use bytes::Bytes;
use outbox_core::envelope::{self, Envelope};
use outbox_core::{Message, Outcome, Receipt, Result, Sink, SinkCapabilities};
use tokio::sync::OnceCell;
use tokio::time::{Instant, timeout, timeout_at};

use crate::config::{Credentials, redact_servers};
use crate::error::{
    Stage, Unsendable, Waited, connect_error, disconnected, health_error, health_refused, not_sent,
    publish_error, timed_out, unsendable,
};
use crate::{NatsConfig, wire};
use outbox_core::config::Settings;

/// Extra wait on top of the client's own time-outs before a call is cut off: they should
/// always fire first, this only guards against a wait that has none.
const GRACE: Duration = Duration::from_secs(1);

/// Publishes messages to NATS JetStream. Connects on first use, then the client reconnects
/// by itself; while it is disconnected, publishes and health checks fail at once as
/// `Unavailable`.
pub struct NatsSink {
    config: NatsConfig,
    servers: Vec<ServerAddr>,
    /// How to authenticate: what `credentials_file` or `nkey_file` holds, else `token`, else
    /// the credentials the URL carried (taken out of `servers`). Secret: not in `Debug`.
    credentials: Option<Credentials>,
    /// The redacted server list, for logs and errors.
    shown: String,
    jetstream: OnceCell<Context>,
}

outbox_core::debug_shows_config!(NatsSink);

/// One message of a window: already settled, or waiting for its ack.
enum Pending {
    Settled(Outcome),
    Acking(String, PublishAckFuture),
}

impl NatsSink {
    /// A sink for `config`. Validates the configuration; connects lazily, so a server that
    /// is down shows up as an `Unavailable` error from the first call, not here.
    pub fn new(config: NatsConfig) -> Result<Self> {
        config.validate()?;
        let (servers, in_url) = config.servers()?;
        // Validation refused a file together with a token or credentials in the URL; the
        // `token` setting wins over credentials in the URL.
        let credentials = match (config.file_credentials()?, &config.token) {
            (Some(from_file), _) => Some(from_file),
            (None, Some(token)) => Some(Credentials::Token(token.clone())),
            (None, None) => in_url,
        };
        Ok(NatsSink {
            shown: redact_servers(&config.url),
            config,
            servers,
            credentials,
            jetstream: OnceCell::new(),
        })
    }

    /// The sink's settings.
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    /// The JetStream context, connecting first if this is the first call.
    async fn jetstream(&self) -> Result<&Context> {
        self.jetstream
            .get_or_try_init(|| async {
                let t = self.config.publish_timeout;
                let mut options = ConnectOptions::new()
                    .name(&self.config.name)
                    .connection_timeout(t)
                    .request_timeout(Some(t))
                    .max_reconnects(None);
                // A private CA or a client certificate means TLS, whatever the URL's scheme.
                if let Some(ca) = &self.config.tls_ca_file {
                    options = options.add_root_certificates(ca.clone()).require_tls(true);
                }
                if let (Some(cert), Some(key)) =
                    (&self.config.tls_cert_file, &self.config.tls_key_file)
                {
                    options = options
                        .add_client_certificate(cert.clone(), key.clone())
                        .require_tls(true);
                }
                // Credentials go to the client as options, never in the addresses it logs.
                options = match &self.credentials {
                    Some(Credentials::Token(token)) => options.token(token.clone()),
                    Some(Credentials::UserPassword(user, password)) => {
                        options.user_and_password(user.clone(), password.clone())
                    }
                    // Parsed once already when the sink was built, so this does not fail.
                    Some(Credentials::Creds(creds)) => {
                        options.credentials(creds).map_err(|why| {
                            outbox_core::Error::setting(
                                "credentials_file",
                                format!("is not a NATS credentials file ({why})"),
                            )
                        })?
                    }
                    Some(Credentials::NkeySeed(seed)) => options.nkey(seed.clone()),
                    None => options,
                };
                // The client tries each server once, each within the time-out.
                let all = t * self.servers.len() as u32 + GRACE;
                let client = match timeout(all, options.connect(self.servers.clone())).await {
                    Ok(Ok(client)) => client,
                    Ok(Err(error)) => return Err(connect_error(&self.shown, error)),
                    Err(_) => return Err(timed_out(&self.shown, Waited::Connect)),
                };
                tracing::info!(servers = %self.shown, "connected to NATS");
                Ok(ContextBuilder::new()
                    .timeout(t)
                    // An ack abandoned after a time-out holds its in-flight slot this long.
                    .ack_timeout(t)
                    .max_ack_inflight(self.config.max_pending_acks)
                    .backpressure_on_inflight(true)
                    .build(client))
            })
            .await
    }

    /// The context if the connection is up; `Unavailable` at once while it is down, so
    /// nothing is queued in the client to go out on some later reconnect.
    async fn connected(&self) -> Result<&Context> {
        let jetstream = self.jetstream().await?;
        match jetstream.client().connection_state() {
            State::Connected | State::Pending => Ok(jetstream),
            State::Disconnected => Err(disconnected(&self.shown)),
        }
    }

    /// The subject and headers of `message`, or why it can never be published.
    fn prepare(&self, message: &Message) -> Result<(String, HeaderMap)> {
        let subject = self
            .config
            .subject_for(&message.topic)
            .map_err(|why| unsendable(Unsendable::Subject(&message.topic, &why)))?;
        let mut map = HeaderMap::new();
        for name in message.headers.keys() {
            if name.to_ascii_lowercase().starts_with("nats-") {
                return Err(unsendable(Unsendable::ReservedHeader(name)));
            }
        }
        for (name, value) in envelope::application_headers(message) {
            map.insert(header_name(name)?, header_value(name, value)?);
        }
        let envelope = Envelope::of(message);
        for (name, value) in envelope.fields() {
            map.insert(name, header_value(name, &value)?);
        }
        if let (Some(key), Some(key_header)) = (&message.key, &self.config.key_header) {
            map.insert(header_name(key_header)?, header_value(key_header, key)?);
        }
        map.insert(wire::MSG_ID, envelope.id.as_str());
        if let Some(stream) = &self.config.stream {
            map.insert(wire::EXPECTED_STREAM, stream.as_str());
        }
        Ok((subject, map))
    }

    /// Publishes one window of messages: all of them first, then their acks together.
    /// Sets `broken` when the connection failed, and then sends nothing more.
    async fn publish_window(
        &self,
        jetstream: &Context,
        window: &[Message],
        broken: &mut Option<String>,
    ) -> Vec<Outcome> {
        let deadline = Instant::now() + self.config.publish_timeout;
        let mut pending = Vec::with_capacity(window.len());
        for message in window {
            if let Some(why) = broken.as_ref() {
                pending.push(Pending::Settled(Outcome::Failed(not_sent(why))));
                continue;
            }
            let (subject, map) = match self.prepare(message) {
                Ok(prepared) => prepared,
                Err(error) => {
                    pending.push(Pending::Settled(Outcome::Failed(error)));
                    continue;
                }
            };
            let publish = PublishMessage::build()
                .payload(Bytes::copy_from_slice(&message.payload))
                .headers(map);
            let sent = timeout_at(deadline, jetstream.send_publish(subject.clone(), publish)).await;
            pending.push(match sent {
                Ok(Ok(ack)) => Pending::Acking(subject, ack),
                Ok(Err(error)) => {
                    let error = publish_error(&subject, Stage::Send, error);
                    if error.kind() == outbox_core::ErrorKind::Unavailable {
                        *broken = Some(error.to_string());
                    }
                    Pending::Settled(Outcome::Failed(error))
                }
                Err(_) => {
                    let error = timed_out(&self.shown, Waited::Handover);
                    *broken = Some(error.to_string());
                    Pending::Settled(Outcome::Failed(error))
                }
            });
        }

        // Each outcome says whether JetStream had no responder for the subject.
        let acks = futures_util::future::join_all(pending.into_iter().map(|p| async move {
            match p {
                Pending::Settled(outcome) => (outcome, false),
                Pending::Acking(subject, ack) => match ack.await {
                    Ok(ack) => {
                        if ack.duplicate {
                            tracing::debug!(%subject, stream = %ack.stream, sequence = ack.sequence, "JetStream dropped a duplicate");
                        }
                        let receipt = Receipt::new(format!("{}:{}", ack.stream, ack.sequence));
                        (Outcome::Delivered(receipt), false)
                    }
                    Err(error) => {
                        let no_responder = error.kind() == PublishErrorKind::StreamNotFound;
                        let error = publish_error(&subject, Stage::Ack, error);
                        (Outcome::Failed(error), no_responder)
                    }
                },
            }
        }));
        // Each ack has the client's time-out; this only guards against one that has none.
        let mut outcomes: Vec<(Outcome, bool)> =
            match timeout(self.config.publish_timeout + GRACE, acks).await {
                Ok(outcomes) => outcomes,
                Err(_) => window
                    .iter()
                    .map(|_| (Outcome::Failed(timed_out(&self.shown, Waited::Acks)), false))
                    .collect(),
            };
        // No responder means no stream captures the subject, or JetStream itself is gone (a
        // server shutting down stops JetStream before it closes connections). Only the first
        // is the message's fault: where JetStream does not answer either, it is an outage
        // and charges nothing.
        if outcomes.iter().any(|(_, no_responder)| *no_responder)
            && let Err(down) = self.jetstream_answers(jetstream).await
        {
            let why = format!("{down}; publishes found no JetStream responder meanwhile");
            for (outcome, no_responder) in &mut outcomes {
                if *no_responder {
                    *outcome = Outcome::Failed(outbox_core::Error::unavailable(why.clone()));
                }
            }
        }
        let outcomes: Vec<Outcome> = outcomes.into_iter().map(|(o, _)| o).collect();
        // A window with no ack at all and time-outs means the connection is gone.
        let delivered = outcomes.iter().any(|o| matches!(o, Outcome::Delivered(_)));
        let unavailable = outcomes.iter().any(
            |o| matches!(o, Outcome::Failed(e) if e.kind() == outbox_core::ErrorKind::Unavailable),
        );
        if !delivered && unavailable && broken.is_none() {
            *broken = Some(format!(
                "nats: {} stopped answering during the batch",
                self.shown
            ));
        }
        outcomes
    }

    /// Whether JetStream answers: the account query ($JS.API.INFO) answers only where
    /// JetStream is enabled and running. Read as plain JSON: the client's typed
    /// `query_account` expects fields that servers before 2.10 do not send.
    async fn jetstream_answers(&self, jetstream: &Context) -> Result<()> {
        let empty = serde_json::json!({});
        let query = jetstream.request::<_, _, serde_json::Value>("INFO", &empty);
        match timeout(self.config.publish_timeout + GRACE, query).await {
            Ok(Ok(reply)) => match reply.get("error") {
                None => Ok(()),
                Some(error) => Err(health_refused(&self.shown, error)),
            },
            Ok(Err(error)) => Err(health_error(&self.shown, error)),
            Err(_) => Err(timed_out(&self.shown, Waited::Health)),
        }
    }
}

fn header_name(name: &str) -> Result<HeaderName> {
    HeaderName::from_str(name).map_err(|_| unsendable(Unsendable::HeaderName(name)))
}

fn header_value(name: &str, value: &str) -> Result<HeaderValue> {
    HeaderValue::from_str(value).map_err(|_| unsendable(Unsendable::HeaderValue(name)))
}

#[async_trait]
impl Sink for NatsSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let jetstream = self.connected().await?;
        let started = Instant::now();
        let mut outcomes = Vec::with_capacity(batch.len());
        let mut broken = None;
        for window in batch.chunks(self.config.max_pending_acks) {
            outcomes.extend(self.publish_window(jetstream, window, &mut broken).await);
        }
        if let Some(why) = &broken {
            tracing::warn!(servers = %self.shown, error = %why, "NATS connection failed during a batch");
        }
        tracing::debug!(messages = batch.len(), elapsed = ?started.elapsed(), "published to JetStream");
        Ok(outcomes)
    }

    async fn health(&self) -> Result<()> {
        let jetstream = self.connected().await?;
        self.jetstream_answers(jetstream).await
    }

    fn capabilities(&self) -> SinkCapabilities {
        // The server's max_payload (headers included) is known once connected.
        let max_payload = self
            .jetstream
            .get()
            .map(|j| j.client().server_info().max_payload)
            .filter(|&n| n > 0);
        SinkCapabilities::default()
            .with_deduplication(true)
            .with_max_payload(max_payload)
    }

    /// Once connected, a window of `max_pending_acks` messages is handed over within
    /// `publish_timeout` and acknowledged within another; a window that times out fails the
    /// rest of the batch at once as unavailable.
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        Some(self.config.publish_timeout * 2)
    }
}
