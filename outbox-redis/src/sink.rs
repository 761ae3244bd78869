//! The Redis Streams sink: each message becomes one stream entry, a batch one pipeline.
//!
//! A key with several messages in a batch goes as one script ([`RUN_SCRIPT`]) that appends
//! them in order and stops at the first that fails: in a plain pipeline an `XADD` after a
//! failed one still lands, which would put a key's later message before its retried earlier
//! one. So the sink declares `ordered_key_runs`, and the worker sends it a whole batch at once.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;
use deadpool_redis::redis::{
    self, AsyncConnectionConfig, Cmd, Pipeline, RedisResult, Script, Value,
};
use deadpool_redis::{Connection, Manager, Pool, Runtime};
use outbox_core::envelope::{self, Envelope};
use outbox_core::{
    Error, ErrorKind, Message, Outcome, Receipt, Result, Sink, SinkCapabilities, redact_url,
};
use tokio::time::{Instant, timeout_at};

use crate::error::{
    bad_url, behind_failure, no_ping_reply, no_reply, ping_error, pool_error, pool_not_built,
    redis_error, too_large, unmapped_topic,
};
use crate::{RedisConfig, wire};
use outbox_core::config::Settings;

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

/// Appends the messages of one key's run in order, each to its stream, and stops at the first
/// append that fails, so that none of the key's later messages lands after it. With
/// de-duplication, a message whose id was seen is skipped (its first entry id is returned)
/// and an appended one is recorded, as [`DEDUP_SCRIPT`] does. Returns the entry ids, one per
/// message, in order; when an append failed, its error reply is the last element and the
/// messages after it are not tried.
///
/// KEYS: per message its stream, then (with de-duplication) its de-duplication key. ARGV[1]
/// TTL in ms (0: no de-duplication), ARGV[2] MAXLEN (0: no trimming), then per message the
/// number of its entry's fields and values, followed by them.
const RUN_SCRIPT: &str = r"
local ttl, maxlen = ARGV[1], ARGV[2]
local per = 1
if ttl ~= '0' then per = 2 end
local ids = {}
local a, k = 3, 1
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  local seen = false
  if per == 2 then seen = redis.call('GET', KEYS[k + 1]) end
  if seen then
    ids[#ids + 1] = seen
  else
    local id
    if maxlen ~= '0' then
      id = redis.pcall('XADD', KEYS[k], 'MAXLEN', '~', maxlen, '*', unpack(ARGV, a + 1, a + n))
    else
      id = redis.pcall('XADD', KEYS[k], '*', unpack(ARGV, a + 1, a + n))
    end
    if type(id) == 'table' and id.err then
      ids[#ids + 1] = id
      return ids
    end
    if per == 2 then redis.call('SET', KEYS[k + 1], id, 'PX', ttl) end
    ids[#ids + 1] = id
  end
  a = a + n + 1
  k = k + per
end
return ids
";

/// Where a message of a batch went: failed before the pipeline, alone in a command, or at a
/// position in its key's run script.
enum Plan {
    Failed(Error),
    Alone(usize),
    InRun(usize, usize),
}

/// What became of one message in the pipeline's replies.
enum Step {
    /// Its own reply: an entry id, or the error of its append (or of its whole run).
    Reply(RedisResult<Value>),
    /// Not tried: an earlier message of its run failed.
    Behind,
    /// No reply for it (should not happen).
    Missing,
}

/// The reply of a run script, as one step per message of the run (`length` of them): the
/// entry ids, then the failed append's error, then the messages not tried. An error reply
/// for the whole script (a server-wide refusal, a script error) is every message's.
fn split_run(reply: Option<RedisResult<Value>>, length: usize) -> Vec<Step> {
    match reply {
        Some(Ok(Value::Array(items))) => {
            let failed = items.iter().any(|v| matches!(v, Value::ServerError(_)));
            let mut steps: Vec<Step> = (items.into_iter())
                .map(|item| match item {
                    Value::ServerError(error) => Step::Reply(Err(error.into())),
                    value => Step::Reply(Ok(value)),
                })
                .take(length)
                .collect();
            while steps.len() < length {
                steps.push(if failed { Step::Behind } else { Step::Missing });
            }
            steps
        }
        Some(Err(error)) => (0..length)
            .map(|_| Step::Reply(Err(error.clone())))
            .collect(),
        Some(Ok(_)) | None => (0..length).map(|_| Step::Missing).collect(),
    }
}

/// A [`Sink`] that appends each message to a Redis stream (`XADD`), a whole batch in one
/// pipelined round trip. The receipt of a delivered message is its stream entry id.
pub struct RedisSink {
    config: RedisConfig,
    pool: Pool,
    /// The connection kept between calls, so a batch costs one round trip and not also the
    /// pool's check of a connection taken out of it.
    kept: Mutex<Option<Connection>>,
    dedup: Option<Script>,
    /// [`RUN_SCRIPT`], for the keys with several messages in a batch.
    runs: Script,
}

outbox_core::debug_shows_config!(RedisSink);

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
            runs: Script::new(RUN_SCRIPT),
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

    /// The command that appends a key's run, `(message, stream)` in order, with
    /// [`RUN_SCRIPT`].
    fn run_command(&self, run: &[(&Message, &str)]) -> Cmd {
        let ttl = match (&self.dedup, self.config.dedup_ttl) {
            (Some(_), Some(ttl)) => Some(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
            _ => None,
        };
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.runs.get_hash())
            .arg(run.len() * if ttl.is_some() { 2 } else { 1 });
        for (message, stream) in run {
            cmd.arg(*stream);
            if ttl.is_some() {
                cmd.arg(format!("{}{}", self.config.dedup_key_prefix, message.id));
            }
        }
        cmd.arg(ttl.unwrap_or(0))
            .arg(self.config.max_len.unwrap_or(0));
        for (message, _) in run {
            let entry = entry(message);
            cmd.arg(entry.len() * 2);
            for (name, value) in entry {
                cmd.arg(name.as_ref()).arg(value.as_ref());
            }
        }
        cmd
    }

    /// Plans `batch`: each message alone in a command, but a key with several messages in
    /// one run script, up to its first message that cannot be sent (its later ones are not
    /// tried). Returns the plan per message and the commands.
    fn plan(&self, batch: &[Message]) -> (Vec<Plan>, Vec<Cmd>) {
        let mut prepared: Vec<Option<Result<String>>> =
            batch.iter().map(|m| Some(self.prepare(m))).collect();
        let mut of_key: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, message) in batch.iter().enumerate() {
            if let Some(key) = &message.key {
                of_key.entry(key.as_str()).or_default().push(i);
            }
        }
        let mut plans: Vec<Option<Plan>> = batch.iter().map(|_| None).collect();
        let mut commands = Vec::new();
        for (i, message) in batch.iter().enumerate() {
            if plans[i].is_some() {
                continue; // placed with its key's run
            }
            let run = (message.key.as_deref())
                .and_then(|key| of_key.get(key))
                .filter(|run| run.len() > 1);
            let Some(run) = run else {
                plans[i] = Some(match prepared[i].take() {
                    Some(Ok(stream)) => {
                        commands.push(self.append_command(&stream, message));
                        Plan::Alone(commands.len() - 1)
                    }
                    Some(Err(error)) => Plan::Failed(error),
                    None => Plan::Failed(no_reply(message.id)),
                });
                continue;
            };
            let mut members: Vec<(usize, String)> = Vec::with_capacity(run.len());
            let mut stopped = false;
            for &j in run {
                if stopped {
                    let key = batch[j].key.as_deref().unwrap_or_default();
                    plans[j] = Some(Plan::Failed(behind_failure(batch[j].id, key)));
                    continue;
                }
                match prepared[j].take() {
                    Some(Ok(stream)) => members.push((j, stream)),
                    Some(Err(error)) => {
                        stopped = true;
                        plans[j] = Some(Plan::Failed(error));
                    }
                    None => plans[j] = Some(Plan::Failed(no_reply(batch[j].id))),
                }
            }
            if !members.is_empty() {
                let at = commands.len();
                let run: Vec<(&Message, &str)> = (members.iter())
                    .map(|(j, stream)| (&batch[*j], stream.as_str()))
                    .collect();
                commands.push(self.run_command(&run));
                for (position, (j, _)) in members.iter().enumerate() {
                    plans[*j] = Some(Plan::InRun(at, position));
                }
            }
        }
        let plans = (plans.into_iter().zip(batch))
            .map(|(plan, m)| plan.unwrap_or_else(|| Plan::Failed(no_reply(m.id))))
            .collect();
        (plans, commands)
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
    async fn run(&self, pipe: &Pipeline, what: &str) -> Result<Vec<RedisResult<Value>>> {
        self.run_until(pipe, what, Instant::now() + self.config.publish_timeout)
            .await
    }

    async fn run_until(
        &self,
        pipe: &Pipeline,
        what: &str,
        deadline: Instant,
    ) -> Result<Vec<RedisResult<Value>>> {
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
        let (plans, commands) = self.plan(batch);
        let has_runs = plans.iter().any(|p| matches!(p, Plan::InRun(..)));
        let mut replies: Vec<Option<RedisResult<Value>>> = if commands.is_empty() {
            Vec::new()
        } else {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            // Loading an already loaded script is cheap and makes EVALSHA work even on a
            // server that was restarted or flushed its scripts, in the same round trip.
            let loads: Vec<(&Script, &str)> = [
                (self.dedup.as_ref(), "loading the de-duplication script"),
                (has_runs.then_some(&self.runs), "loading the key-run script"),
            ]
            .into_iter()
            .filter_map(|(script, what)| script.map(|s| (s, what)))
            .collect();
            for (script, _) in &loads {
                pipe.load_script(script);
            }
            for command in commands {
                pipe.add_command(command);
            }
            let mut replies = self.run(&pipe, "publishing a batch").await?.into_iter();
            for (_, what) in &loads {
                if let Some(Err(error)) = replies.next() {
                    return Err(redis_error(what, error));
                }
            }
            replies.map(Some).collect()
        };
        // Each run's reply, split into one step per message, when first needed.
        let mut run_lengths: HashMap<usize, usize> = HashMap::new();
        for plan in &plans {
            if let Plan::InRun(at, _) = plan {
                *run_lengths.entry(*at).or_default() += 1;
            }
        }
        let mut runs: HashMap<usize, Vec<Step>> = HashMap::new();

        let mut outcomes = Vec::with_capacity(batch.len());
        let mut broken = false;
        for (message, plan) in batch.iter().zip(plans) {
            let step = match plan {
                Plan::Failed(error) => {
                    outcomes.push(Outcome::Failed(error));
                    continue;
                }
                Plan::Alone(at) => match replies.get_mut(at).and_then(Option::take) {
                    Some(reply) => Step::Reply(reply),
                    None => Step::Missing,
                },
                Plan::InRun(at, position) => {
                    let steps = runs.entry(at).or_insert_with(|| {
                        let reply = replies.get_mut(at).and_then(Option::take);
                        split_run(reply, run_lengths.get(&at).copied().unwrap_or(0))
                    });
                    steps
                        .get_mut(position)
                        .map_or(Step::Missing, |s| std::mem::replace(s, Step::Missing))
                }
            };
            let outcome = match step {
                Step::Reply(reply) => match reply.and_then(|v| Ok(redis::from_redis_value(v)?)) {
                    Ok(entry_id) => Outcome::Delivered(Receipt(entry_id)),
                    Err(error) => {
                        let stream = self
                            .stream_for(&message.topic)
                            .unwrap_or_else(|_| message.topic.clone());
                        let context =
                            format!("appending message {} to stream `{stream}`", message.id);
                        let error = redis_error(&context, error);
                        broken |= error.kind() == ErrorKind::Unavailable;
                        Outcome::Failed(error)
                    }
                },
                Step::Behind => Outcome::Failed(behind_failure(
                    message.id,
                    message.key.as_deref().unwrap_or_default(),
                )),
                Step::Missing => Outcome::Failed(no_reply(message.id)),
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

    /// A key's run goes as one script that stops at its first failed append, so several
    /// messages of a key may share a call (`ordered_key_runs`).
    fn capabilities(&self) -> SinkCapabilities {
        SinkCapabilities::default()
            .with_ordered_key_runs(true)
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
