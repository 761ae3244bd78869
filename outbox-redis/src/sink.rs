//! The Redis Streams sink: each message becomes one stream entry, a batch one pipeline.

use std::borrow::Cow;
use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;
use deadpool_redis::redis::{self, AsyncConnectionConfig, Cmd, Pipeline, RedisResult, Script};
use deadpool_redis::{Connection, Manager, Pool, Runtime};
use outbox_core::envelope::{self, Envelope};
use outbox_core::{
    Error, ErrorKind, Message, Outcome, Receipt, Result, Sink, SinkCapabilities, redact_url,
};
use tokio::time::{Instant, timeout_at};

use crate::error::{
    bad_url, no_ping_reply, no_reply, ping_error, pool_error, pool_not_built, redis_error,
    too_large, unmapped_topic,
};
use crate::{RedisConfig, wire};

/// Appends the entry unless the message id was seen, all in one atomic step, so that a
/// message redelivered after a lost acknowledgement is not appended twice. The id is
/// recorded only after the append succeeded: a failed append (WRONGTYPE) leaves nothing
/// behind that would hide the message on its next attempt. Returns the entry id, the first
/// one for a duplicate.
///
/// KEYS[1] stream, KEYS[2] de-duplication key; ARGV[1] TTL in ms, ARGV[2] MAXLEN (0: no
/// trimming), ARGV[3..] the entry's fields and values.
const DEDUP_SCRIPT: &str = r"
local seen = redis.call('GET', KEYS[2])
if seen then
  return seen
end
local id
if ARGV[2] ~= '0' then
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
else
  id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
end
redis.call('SET', KEYS[2], id, 'PX', ARGV[1])
return id
";

/// A [`Sink`] that appends each message to a Redis stream (`XADD`), a whole batch in one
/// pipelined round trip. The receipt of a delivered message is its stream entry id.
pub struct RedisSink {
    config: RedisConfig,
    pool: Pool,
    /// The connection kept between calls, so a batch costs one round trip and not also the
    /// pool's check of a connection taken out of it.
    kept: Mutex<Option<Connection>>,
    dedup: Option<Script>,
}

impl std::fmt::Debug for RedisSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSink")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The CA and client certificate files of `config`, read, when it names any.
fn tls_certificates(config: &RedisConfig) -> Result<Option<redis::TlsCertificates>> {
    let read = |key: &str, file: &Option<std::path::PathBuf>| -> Result<Option<Vec<u8>>> {
        file.as_ref()
            .map(|path| {
                std::fs::read(path).map_err(|e| {
                    Error::setting(key, format!("`{}` cannot be read: {e}", path.display()))
                })
            })
            .transpose()
    };
    let root_cert = read("tls_ca_file", &config.tls_ca_file)?;
    let client_cert = read("tls_cert_file", &config.tls_cert_file)?;
    let client_key = read("tls_key_file", &config.tls_key_file)?;
    let client_tls = match (client_cert, client_key) {
        (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
            client_cert,
            client_key,
        }),
        _ => None,
    };
    Ok(
        (root_cert.is_some() || client_tls.is_some()).then_some(redis::TlsCertificates {
            client_tls,
            root_cert,
        }),
    )
}

impl RedisSink {
    /// A sink with validated settings. Connects lazily: call [`Sink::health`] to check the
    /// server at start-up.
    pub fn new(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        if config.url.starts_with("rediss://") {
            // The TLS stack needs a crypto provider; keep one that is already installed.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let timeout = Some(config.publish_timeout);
        let connection = AsyncConnectionConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout);
        let manager = match tls_certificates(&config)? {
            // The client's TLS settings go into the connection info the pool connects with.
            Some(certificates) => {
                let client = redis::Client::build_with_tls(config.url.as_str(), certificates)
                    .map_err(|e| bad_url(&config.url, e))?;
                Manager::new_with_config(client.get_connection_info().clone(), connection)
            }
            None => Manager::new_with_config(config.url.as_str(), connection),
        }
        .map_err(|e| bad_url(&config.url, e))?;
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(timeout)
            .create_timeout(timeout)
            .recycle_timeout(timeout)
            .build()
            .map_err(pool_not_built)?;
        let dedup = config.dedup_ttl.map(|_| Script::new(DEDUP_SCRIPT));
        tracing::debug!(url = %redact_url(&config.url), "redis sink ready");
        Ok(RedisSink {
            config,
            pool,
            kept: Mutex::new(None),
            dedup,
        })
    }

    /// The settings.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The stream a message of `topic` goes to, or a permanent error when the stream map has
    /// no entry for it.
    pub fn stream_for(&self, topic: &str) -> Result<String> {
        self.config
            .stream_for(topic)
            .ok_or_else(|| unmapped_topic(topic))
    }

    /// Checks a message and names its stream.
    fn prepare(&self, message: &Message) -> Result<String> {
        if message.payload.len() > self.config.max_payload {
            return Err(too_large(message.payload.len(), self.config.max_payload));
        }
        self.stream_for(&message.topic)
    }

    /// The command that appends `message` to `stream`.
    fn append_command(&self, stream: &str, message: &Message) -> Cmd {
        let max_len = self.config.max_len;
        let mut cmd = match (&self.dedup, self.config.dedup_ttl) {
            (Some(script), Some(ttl)) => {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(script.get_hash())
                    .arg(2)
                    .arg(stream)
                    .arg(format!("{}{}", self.config.dedup_key_prefix, message.id))
                    .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
                    .arg(max_len.unwrap_or(0));
                cmd
            }
            _ => {
                let mut cmd = redis::cmd("XADD");
                cmd.arg(stream);
                if let Some(max_len) = max_len {
                    cmd.arg("MAXLEN").arg("~").arg(max_len);
                }
                cmd.arg("*");
                cmd
            }
        };
        for (name, value) in entry(message) {
            cmd.arg(name.as_ref()).arg(value.as_ref());
        }
        cmd
    }

    /// The kept connection, or one from the pool.
    async fn checkout(&self) -> Result<Connection> {
        let kept = self
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match kept {
            Some(connection) => Ok(connection),
            None => self.pool.get().await.map_err(|e| {
                let url = redact_url(&self.config.url);
                pool_error(&format!("cannot connect to {url}"), e)
            }),
        }
    }

    /// Keeps a connection that works for the next call.
    fn keep(&self, connection: Connection) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.is_none() {
            *kept = Some(connection);
        }
    }

    /// Runs `pipe` within the publish time-out. A connection that failed or timed out is
    /// closed rather than handed back to the pool.
    async fn run(&self, pipe: &Pipeline, what: &str) -> Result<Vec<RedisResult<String>>> {
        self.run_until(pipe, what, Instant::now() + self.config.publish_timeout)
            .await
    }

    async fn run_until(
        &self,
        pipe: &Pipeline,
        what: &str,
        deadline: Instant,
    ) -> Result<Vec<RedisResult<String>>> {
        let mut connection = match timeout_at(deadline, self.checkout()).await {
            Ok(connection) => connection?,
            Err(_) => return Err(self.timed_out("connecting")),
        };
        match timeout_at(deadline, pipe.query_async(&mut *connection)).await {
            Ok(Ok(replies)) => {
                self.keep(connection);
                Ok(replies)
            }
            Ok(Err(error)) if error.is_timeout() => {
                drop(Connection::take(connection));
                Err(self.timed_out(what))
            }
            Ok(Err(error)) => {
                drop(Connection::take(connection));
                let error = redis_error(what, error);
                tracing::warn!(url = %redact_url(&self.config.url), %error, "redis connection failed; closing it");
                Err(error)
            }
            Err(_) => {
                drop(Connection::take(connection));
                Err(self.timed_out(what))
            }
        }
    }

    fn timed_out(&self, what: &str) -> Error {
        let error = crate::error::timed_out(what, &self.config.url, self.config.publish_timeout);
        tracing::warn!(%error, "redis time-out");
        error
    }
}

/// The fields of the stream entry of `message`, in order (see [`wire`]): the envelope, the
/// payload, then the headers.
fn entry(message: &Message) -> Vec<(Cow<'_, str>, Cow<'_, [u8]>)> {
    let envelope = Envelope::of(message);
    let mut entry: Vec<(Cow<'_, str>, Cow<'_, [u8]>)> =
        Vec::with_capacity(envelope::NAMES.len() + 1 + message.headers.len());
    for (name, value) in envelope.fields() {
        entry.push((name.into(), value.into_owned().into_bytes().into()));
    }
    entry.push((wire::PAYLOAD.into(), message.payload.as_slice().into()));
    for (name, value) in &message.headers {
        let field = format!("{}{name}", wire::HEADER_PREFIX);
        entry.push((field.into(), value.as_bytes().into()));
    }
    entry
}

#[async_trait]
impl Sink for RedisSink {
    async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
        let prepared: Vec<Result<String>> = batch.iter().map(|m| self.prepare(m)).collect();
        let mut replies = if prepared.iter().any(Result::is_ok) {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            if let Some(script) = &self.dedup {
                // Loading an already loaded script is cheap and makes EVALSHA work even on a
                // server that was restarted or flushed its scripts, in the same round trip.
                pipe.load_script(script);
            }
            for (message, stream) in batch.iter().zip(&prepared) {
                if let Ok(stream) = stream {
                    pipe.add_command(self.append_command(stream, message));
                }
            }
            let mut replies = self.run(&pipe, "publishing a batch").await?.into_iter();
            if self.dedup.is_some()
                && let Some(Err(error)) = replies.next()
            {
                return Err(redis_error("loading the de-duplication script", error));
            }
            replies
        } else {
            Vec::new().into_iter()
        };

        let mut outcomes = Vec::with_capacity(batch.len());
        let mut broken = false;
        for (message, stream) in batch.iter().zip(prepared) {
            let outcome = match stream {
                Err(error) => Outcome::Failed(error),
                Ok(stream) => match replies.next() {
                    Some(Ok(entry_id)) => Outcome::Delivered(Receipt(entry_id)),
                    Some(Err(error)) => {
                        let context =
                            format!("appending message {} to stream `{stream}`", message.id);
                        let error = redis_error(&context, error);
                        broken |= error.kind() == ErrorKind::Unavailable;
                        Outcome::Failed(error)
                    }
                    None => Outcome::Failed(no_reply(message.id)),
                },
            };
            outcomes.push(outcome);
        }
        if broken {
            // A server-wide refusal (read-only replica after a failover, out of memory):
            // start from a fresh connection next time.
            if let Some(connection) = self
                .kept
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
            {
                drop(Connection::take(connection));
            }
        }
        tracing::debug!(messages = batch.len(), "published to redis");
        Ok(outcomes)
    }

    async fn health(&self) -> Result<()> {
        let mut pipe = redis::pipe();
        pipe.cmd("PING");
        let what = format!("PING {}", redact_url(&self.config.url));
        let deadline = Instant::now() + self.config.publish_timeout;
        let idle = self
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        let replies = match self.run_until(&pipe, &what, deadline).await {
            // The kept connection may have been closed while idle (server `timeout`, a
            // restart): try a fresh one in the time left before calling the server down.
            Err(error) if idle && Instant::now() < deadline => {
                tracing::debug!(%error, "kept redis connection failed; trying a new one");
                self.run_until(&pipe, &what, deadline).await?
            }
            result => result?,
        };
        match replies.into_iter().next() {
            Some(Ok(_)) => Ok(()),
            Some(Err(error)) => Err(ping_error(error)),
            None => Err(no_ping_reply()),
        }
    }

    fn capabilities(&self) -> SinkCapabilities {
        SinkCapabilities::default()
            .with_deduplication(self.dedup.is_some())
            .with_max_payload(Some(self.config.max_payload))
    }

    /// A batch is one pipelined round trip within `publish_timeout`.
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        Some(self.config.publish_timeout)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use outbox_core::{NewMessage, TraceContext};

    use super::*;

    #[test]
    fn entry_holds_every_part_of_the_message() {
        let message: Message = NewMessage::new("orders", vec![0, 159, 146, 150])
            .key("o-1")
            .header("content-type", "application/octet-stream")
            .header("x-tenant", "t1")
            .trace_context(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: Some("vendor=1".into()),
            })
            .into();
        let fields: BTreeMap<String, Vec<u8>> = entry(&message)
            .into_iter()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let text = |name: &str| String::from_utf8(fields[name].clone()).unwrap();
        assert_eq!(text("outbox-envelope"), "1");
        assert_eq!(text("outbox-id"), message.id.to_string());
        assert_eq!(text("outbox-topic"), "orders");
        assert_eq!(text("outbox-key"), "o-1");
        assert_eq!(fields["payload"], vec![0, 159, 146, 150]);
        assert_eq!(text("content-type"), "application/octet-stream");
        assert_eq!(text("header:content-type"), "application/octet-stream");
        assert_eq!(text("header:x-tenant"), "t1");
        assert_eq!(text("tracestate"), "vendor=1");
        assert!(text("traceparent").starts_with("00-4bf9"));
        let created = chrono::DateTime::parse_from_rfc3339(&text("outbox-created-at")).unwrap();
        assert_eq!(
            created.timestamp_micros(),
            message.created_at.timestamp_micros()
        );
        assert!(text("outbox-created-at").ends_with('Z'));
        assert_eq!(fields.len(), 11);
    }

    #[test]
    fn optional_fields_are_left_out() {
        let message: Message = NewMessage::new("t", Vec::new()).into();
        let names: Vec<String> = entry(&message)
            .into_iter()
            .map(|(k, _)| k.into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "outbox-envelope",
                "outbox-id",
                "outbox-topic",
                "outbox-created-at",
                "content-type",
                "payload"
            ]
        );
    }
}
