//! The sink's link to the broker: one connection with one publishing channel in confirm
//! mode, opened within `connect_timeout` and reopened on the next call after a loss, with
//! `reconnect_backoff` between failed attempts. Exchanges are checked (or declared) once per
//! connection. With `amqps://`, the TLS files of the settings are read once, when the sink is
//! made.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connect, Connection, ConnectionProperties, ExchangeKind};
use outbox_core::{Backoff, Error, Result, redact_url};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::{Mutex, MutexGuard};
use tokio::time::{Instant, timeout};

use crate::AmqpConfig;
use crate::config::MAX_NAME_LEN;
use crate::error::{
    connect_failed, from_lapin, missing_exchange, not_connected, reply_code, timed_out,
    unpublishable,
};

/// Opens, keeps and reopens the connection of one sink.
pub(crate) struct Connector {
    uri: AMQPUri,
    /// The CA and client certificate of `amqps://` connections (empty: the system's roots,
    /// no client certificate).
    tls: OwnedTLSConfig,
    /// The URI without its password, for logs and errors.
    url: String,
    connect_timeout: Duration,
    reconnect_backoff: Backoff,
    /// The kind exchanges are declared with; `None` checks them passively.
    declare: Option<ExchangeKind>,
    state: Mutex<State>,
}

/// The connection, and what is known about reconnecting when there is none.
#[derive(Default)]
pub(crate) struct State {
    /// The open connection, if any; set to `None` to start afresh on the next call.
    pub(crate) link: Option<Link>,
    /// Failed connection attempts in a row.
    failures: u32,
    /// No new attempt before this.
    retry_at: Option<Instant>,
    /// Why the last attempt failed.
    last_error: String,
}

/// An open connection with its publishing channel.
pub(crate) struct Link {
    pub(crate) connection: Connection,
    pub(crate) channel: Channel,
    /// Exchanges checked or declared on this connection.
    ready: HashSet<String>,
}

impl Link {
    fn is_open(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }
}

impl Connector {
    /// A connector for `config` (validated), not connected yet.
    pub(crate) fn new(config: &AmqpConfig) -> Result<Self> {
        Ok(Connector {
            uri: config.parse_uri()?,
            tls: tls_config(config)?,
            url: redact_url(&config.url),
            connect_timeout: config.connect_timeout,
            reconnect_backoff: config.reconnect_backoff,
            declare: config.declared_kind(),
            state: Mutex::new(State::default()),
        })
    }

    /// The broker's URI without its password.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The connection state; held for a whole batch, so calls do not interleave on the
    /// channel.
    pub(crate) async fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().await
    }

    /// Connects and opens the publishing channel in confirm mode, within `connect_timeout`.
    /// A refused login is a configuration error `at_startup`; later it is unavailable, like
    /// any other failure to connect.
    pub(crate) async fn open(&self, at_startup: bool) -> Result<Link> {
        let open = async {
            let properties =
                ConnectionProperties::default().with_connection_name("outbox relay".into());
            let runtime = lapin::runtime::default_runtime()?;
            let connection = self
                .uri
                .clone()
                .connect_with_config(properties, self.tls.clone(), runtime)
                .await?;
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
        match timeout(self.connect_timeout, open).await {
            Ok(Ok(link)) => Ok(link),
            Ok(Err(error)) => Err(connect_failed(&self.url, error, at_startup)),
            Err(_) => Err(timed_out(
                format_args!("connecting to the AMQP broker at {}", self.url),
                self.connect_timeout,
                "connect_timeout",
            )),
        }
    }

    /// The open link, reconnecting if it was lost and the reconnect backoff allows.
    pub(crate) async fn link<'s>(&self, state: &'s mut State) -> Result<&'s mut Link> {
        if state.link.as_ref().is_some_and(|link| !link.is_open()) {
            tracing::warn!(url = %self.url, "AMQP connection or channel lost; reconnecting");
            state.link = None;
        }
        if state.link.is_none() {
            if let Some(at) = state.retry_at
                && Instant::now() < at
            {
                return Err(not_connected(
                    &self.url,
                    at - Instant::now(),
                    state.failures,
                    &state.last_error,
                ));
            }
            match self.open(false).await {
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
                    let wait = self.reconnect_backoff.delay(state.failures);
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
    pub(crate) async fn setup_exchange(&self, link: &mut Link, name: &str) -> Result<()> {
        // The default exchange ("") always exists and cannot be declared.
        if name.is_empty() || link.ready.contains(name) {
            return Ok(());
        }
        let (kind, passive) = match &self.declare {
            Some(kind) if !name.starts_with("amq.") => (kind.clone(), false),
            _ => (ExchangeKind::default(), true),
        };
        let exchange = ShortString::try_new(name).map_err(|_| {
            unpublishable(format!(
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
        match timeout(self.connect_timeout, declare).await {
            Ok(Ok(())) => {
                link.ready.insert(name.to_string());
                Ok(())
            }
            Ok(Err(error)) if passive && reply_code(&error) == Some(404) => {
                Err(missing_exchange(name, &self.url, error))
            }
            Ok(Err(error)) => Err(from_lapin(
                format!("{verb} exchange `{name}` on {}", self.url),
                error,
            )),
            Err(_) => Err(timed_out(
                format_args!("{verb} exchange `{name}` on {}", self.url),
                self.connect_timeout,
                "connect_timeout",
            )),
        }
    }

    /// Closes the connection (within `connect_timeout`). Later calls reconnect.
    pub(crate) async fn close(&self) {
        let link = self.state.lock().await.link.take();
        if let Some(link) = link {
            let close = link.connection.close(200, "outbox relay stopping".into());
            if let Ok(Err(error)) = timeout(self.connect_timeout, close).await {
                tracing::debug!(url = %self.url, %error, "closing the AMQP connection");
            }
        }
    }
}

/// The TLS settings of `config` (validated), its files read and checked: a file that cannot
/// be read or holds no usable PEM is a configuration error naming it.
fn tls_config(config: &AmqpConfig) -> Result<OwnedTLSConfig> {
    let cert_chain = match &config.tls_ca_file {
        Some(path) => Some(read_certificates("tls_ca_file", path)?),
        None => None,
    };
    let identity = match (&config.tls_cert_file, &config.tls_key_file) {
        (Some(cert), Some(key)) => Some(OwnedIdentity::PKCS8 {
            pem: read_certificates("tls_cert_file", cert)?.into_bytes(),
            key: read_key("tls_key_file", key)?,
        }),
        _ => None,
    };
    Ok(OwnedTLSConfig {
        identity,
        cert_chain,
    })
}

/// The file at `path`, read; the error names the setting `key` and the file.
fn read(key: &str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| Error::setting(key, format!("`{}` cannot be read: {e}", path.display())))
}

/// A PEM file of one or more certificates, as text.
fn read_certificates(key: &str, path: &Path) -> Result<String> {
    let bad = |reason: String| {
        Error::setting(
            key,
            format!(
                "`{}` {reason}; give a PEM file of certificates (-----BEGIN CERTIFICATE-----)",
                path.display()
            ),
        )
    };
    let text =
        String::from_utf8(read(key, path)?).map_err(|_| bad("is not a text file".to_string()))?;
    let mut found = 0;
    for certificate in CertificateDer::pem_slice_iter(text.as_bytes()) {
        certificate.map_err(|e| bad(format!("is not valid PEM ({e})")))?;
        found += 1;
    }
    if found == 0 {
        return Err(bad("holds no certificate".to_string()));
    }
    Ok(text)
}

/// A PEM file of a private key, as bytes.
fn read_key(key: &str, path: &Path) -> Result<Vec<u8>> {
    let bytes = read(key, path)?;
    if let Err(e) = PrivateKeyDer::from_pem_slice(&bytes) {
        return Err(Error::setting(
            key,
            format!(
                "`{}` holds no usable private key ({e}); give an unencrypted PEM key \
                 (PKCS#8, PKCS#1 or SEC1)",
                path.display()
            ),
        ));
    }
    Ok(bytes)
}
