//! Settings of the Redis Streams sink.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::{Error, Result, redact_url};

/// Redis's own limit on one bulk argument (`proto-max-bulk-len`, 512 MiB by default).
pub const DEFAULT_MAX_PAYLOAD: usize = 512 * 1024 * 1024;

/// Which stream each topic is appended to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Streams {
    /// The stream is this template with every `{topic}` replaced by the message's topic
    /// (default `{topic}`). A template without `{topic}` sends every topic to one stream.
    Template(String),
    /// An explicit map from topic to stream. A message whose topic is not in the map can
    /// never be delivered and is dead-lettered (add the topic and replay it).
    Map(BTreeMap<String, String>),
}

impl Default for Streams {
    fn default() -> Self {
        Streams::Template("{topic}".into())
    }
}

/// Settings of the Redis Streams sink. `Debug` hides the password in the URL.
#[derive(Clone, PartialEq)]
pub struct RedisConfig {
    /// Connection URL: `redis://[user:password@]host:port[/db]`, or `rediss://...` for TLS
    /// (the server certificate is checked against the system's root certificates).
    pub url: String,
    /// Connections the pool may open (default 2). A sink publishes on one connection, kept
    /// between batches until it fails; more are opened only when one sink is shared by
    /// several workers publishing at the same time.
    pub pool_size: usize,
    /// Longest wait for a connection, a command or a batch's replies (default 5 s). A
    /// time-out counts as the broker being unavailable. Keep it shorter than the worker's lease.
    pub command_timeout: Duration,
    /// Prepended to every stream name (default empty), e.g. `prod:`.
    pub stream_prefix: String,
    /// Which stream each topic goes to (default the template `{topic}`).
    pub streams: Streams,
    /// Trim each stream on append to about this many entries (`XADD ... MAXLEN ~ N`); `None`
    /// (the default) never trims.
    pub max_len: Option<u64>,
    /// De-duplication: when set, each message id is recorded for this long and a message
    /// whose id was already appended is not appended again (its first entry id is returned
    /// as the receipt). `None` (the default) turns it off. It must outlast any redelivery:
    /// give it hours, not seconds.
    pub dedup_ttl: Option<Duration>,
    /// Prefix of the per-message de-duplication keys (default `outbox:dedup:`); the key is
    /// this prefix followed by the message id.
    pub dedup_key_prefix: String,
    /// Largest payload in bytes that is sent (default 512 MiB, Redis's `proto-max-bulk-len`);
    /// a larger message is dead-lettered instead of making the server drop the connection.
    pub max_payload: usize,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact_url(&self.url))
            .field("pool_size", &self.pool_size)
            .field("command_timeout", &self.command_timeout)
            .field("stream_prefix", &self.stream_prefix)
            .field("streams", &self.streams)
            .field("max_len", &self.max_len)
            .field("dedup_ttl", &self.dedup_ttl)
            .field("dedup_key_prefix", &self.dedup_key_prefix)
            .field("max_payload", &self.max_payload)
            .finish()
    }
}

impl RedisConfig {
    /// Defaults for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            pool_size: 2,
            command_timeout: Duration::from_secs(5),
            stream_prefix: String::new(),
            streams: Streams::default(),
            max_len: None,
            dedup_ttl: None,
            dedup_key_prefix: "outbox:dedup:".into(),
            max_payload: DEFAULT_MAX_PAYLOAD,
        }
    }

    /// Sets the prefix of every stream name.
    pub fn stream_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.stream_prefix = prefix.into();
        self
    }

    /// Sends each topic to the stream named by `template`, where `{topic}` stands for the topic.
    pub fn stream_template(mut self, template: impl Into<String>) -> Self {
        self.streams = Streams::Template(template.into());
        self
    }

    /// Sends each topic to the stream the map names for it.
    pub fn stream_map<T, S>(mut self, map: impl IntoIterator<Item = (T, S)>) -> Self
    where
        T: Into<String>,
        S: Into<String>,
    {
        self.streams = Streams::Map(map.into_iter().map(|(t, s)| (t.into(), s.into())).collect());
        self
    }

    /// Trims each stream to about `max_len` entries.
    pub fn max_len(mut self, max_len: u64) -> Self {
        self.max_len = Some(max_len);
        self
    }

    /// Turns de-duplication on, remembering each message id for `ttl`.
    pub fn dedup(mut self, ttl: Duration) -> Self {
        self.dedup_ttl = Some(ttl);
        self
    }

    /// Sets the command time-out.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Checks every setting; the error names the bad one and says what to do.
    pub fn validate(&self) -> Result<()> {
        const SCHEMES: [&str; 4] = ["redis://", "rediss://", "redis+unix://", "unix://"];
        if !SCHEMES.iter().any(|s| self.url.starts_with(s)) {
            return Err(Error::config(format!(
                "sink.url `{}` is not a Redis URL; expected redis://[:password@]host:port[/db], or rediss://... for TLS",
                redact_url(&self.url)
            )));
        }
        if let Err(error) =
            deadpool_redis::redis::IntoConnectionInfo::into_connection_info(self.url.as_str())
        {
            return Err(Error::config(format!(
                "sink.url `{}` is not a valid Redis URL ({}); expected redis://[:password@]host:port[/db]",
                redact_url(&self.url),
                error.detail().unwrap_or(error.category())
            )));
        }
        if self.pool_size == 0 {
            return Err(Error::config("sink.pool_size is 0; it must be at least 1"));
        }
        if self.command_timeout.is_zero() {
            return Err(Error::config(
                "sink.command_timeout is 0; give it a duration such as 5 s",
            ));
        }
        match &self.streams {
            Streams::Template(template) if template.trim().is_empty() => {
                return Err(Error::config(
                    "sink.stream_template is empty; give a stream name such as `{topic}` or `events:{topic}`",
                ));
            }
            Streams::Template(_) => {}
            Streams::Map(map) if map.is_empty() => {
                return Err(Error::config(
                    "sink.streams is an empty map; map each topic to a stream, or use sink.stream_template",
                ));
            }
            Streams::Map(map) => {
                if let Some((topic, _)) = map
                    .iter()
                    .find(|(t, s)| t.is_empty() || s.trim().is_empty())
                {
                    return Err(Error::config(format!(
                        "sink.streams maps topic `{topic}` to an empty stream name (or has an empty topic); give each topic a stream"
                    )));
                }
            }
        }
        if self.max_len == Some(0) {
            return Err(Error::config(
                "sink.max_len is 0, which would trim every stream empty; leave it unset to keep everything, or give a length",
            ));
        }
        if let Some(ttl) = self.dedup_ttl {
            if ttl < Duration::from_millis(1) {
                return Err(Error::config(
                    "sink.dedup_ttl is 0; leave it unset to turn de-duplication off, or give a duration such as 24 h",
                ));
            }
            if self.dedup_key_prefix.is_empty() {
                return Err(Error::config(
                    "sink.dedup_key_prefix is empty; give a prefix such as `outbox:dedup:`",
                ));
            }
        }
        if self.max_payload == 0 {
            return Err(Error::config(
                "sink.max_payload is 0; it must be at least 1 byte (Redis's default limit is 512 MiB)",
            ));
        }
        Ok(())
    }

    /// The stream a message of `topic` is appended to, or `None` when an explicit map has no
    /// entry for it.
    pub fn stream_for(&self, topic: &str) -> Option<String> {
        let name = match &self.streams {
            Streams::Template(template) => template.replace("{topic}", topic),
            Streams::Map(map) => map.get(topic)?.clone(),
        };
        Some(format!("{}{name}", self.stream_prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(config: RedisConfig) -> String {
        config.validate().unwrap_err().to_string()
    }

    #[test]
    fn bad_settings_name_their_key() {
        let ok = RedisConfig::new("redis://127.0.0.1:6379");
        ok.validate().unwrap();
        assert!(err(RedisConfig::new("localhost:6379")).contains("sink.url"));
        assert!(err(RedisConfig::new("http://x")).contains("not a Redis URL"));
        assert!(err(RedisConfig::new("redis://host:notaport")).contains("sink.url"));
        assert!(err(ok.clone().stream_template("")).contains("sink.stream_template is empty"));
        assert!(err(ok.clone().stream_template("  ")).contains("sink.stream_template"));
        assert!(err(ok.clone().max_len(0)).contains("sink.max_len is 0"));
        assert!(err(ok.clone().dedup(Duration::ZERO)).contains("sink.dedup_ttl"));
        assert!(
            err(RedisConfig {
                pool_size: 0,
                ..ok.clone()
            })
            .contains("sink.pool_size")
        );
        assert!(err(ok.clone().command_timeout(Duration::ZERO)).contains("sink.command_timeout"));
        assert!(
            err(ok.clone().stream_map(Vec::<(String, String)>::new())).contains("sink.streams")
        );
        assert!(err(ok.clone().stream_map([("orders", "")])).contains("`orders`"));
        assert!(
            err(RedisConfig {
                max_payload: 0,
                ..ok.clone()
            })
            .contains("sink.max_payload")
        );
        let kind = ok.clone().max_len(0).validate().unwrap_err().kind();
        assert_eq!(kind, outbox_core::ErrorKind::Config);
    }

    #[test]
    fn tls_and_unix_urls_are_accepted() {
        RedisConfig::new("rediss://:pw@redis.example.com:6380/0")
            .validate()
            .unwrap();
        RedisConfig::new("redis+unix:///run/redis.sock")
            .validate()
            .unwrap();
    }

    #[test]
    fn debug_hides_the_password() {
        let config = RedisConfig::new("redis://:hunter2@127.0.0.1:6379/0");
        let text = format!("{config:?}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("redis://:***@127.0.0.1:6379/0"), "{text}");
        let error = RedisConfig::new("redis://:hunter2@h:bad")
            .validate()
            .unwrap_err();
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }

    #[test]
    fn stream_names() {
        let config = RedisConfig::new("redis://h").stream_prefix("t1:");
        assert_eq!(config.stream_for("orders").as_deref(), Some("t1:orders"));
        let config = config.stream_template("events:{topic}:v1");
        assert_eq!(
            config.stream_for("orders").as_deref(),
            Some("t1:events:orders:v1")
        );
        let config = config.stream_template("all");
        assert_eq!(config.stream_for("orders").as_deref(), Some("t1:all"));
        let config = config.stream_map([("orders", "o")]);
        assert_eq!(config.stream_for("orders").as_deref(), Some("t1:o"));
        assert_eq!(config.stream_for("users"), None);
    }
}

/// The keys of the `[sink]` table in the relay's configuration file (`type = "redis"`);
/// each is the [`RedisConfig`] field of the same name. Unknown keys are refused.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    url: String,
    pool_size: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    command_timeout: Option<Duration>,
    stream_prefix: Option<String>,
    /// `{topic}` template; give this or `streams`, not both.
    stream_template: Option<String>,
    /// Explicit topic → stream map.
    streams: Option<BTreeMap<String, String>>,
    max_len: Option<u64>,
    #[serde(default, with = "humantime_serde")]
    dedup_ttl: Option<Duration>,
    dedup_key_prefix: Option<String>,
    max_payload: Option<usize>,
}

impl RedisConfig {
    /// Reads the settings from the `[sink]` table of the relay's configuration (as JSON,
    /// without `type`) and validates them. Errors name the bad key.
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        let file: FileConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let at = if path == "." {
                String::new()
            } else {
                format!("sink.{path}: ")
            };
            Error::config(format!("redis sink configuration: {at}{}", e.inner()))
        })?;
        let mut config = RedisConfig::new(file.url);
        config.pool_size = file.pool_size.unwrap_or(config.pool_size);
        config.command_timeout = file.command_timeout.unwrap_or(config.command_timeout);
        config.stream_prefix = file.stream_prefix.unwrap_or_default();
        config.streams = match (file.stream_template, file.streams) {
            (Some(_), Some(_)) => {
                return Err(Error::config(
                    "sink.stream_template and sink.streams are both set; give a template or a map, not both",
                ));
            }
            (Some(template), None) => Streams::Template(template),
            (None, Some(map)) => Streams::Map(map),
            (None, None) => Streams::default(),
        };
        config.max_len = file.max_len;
        config.dedup_ttl = file.dedup_ttl;
        config.dedup_key_prefix = file.dedup_key_prefix.unwrap_or(config.dedup_key_prefix);
        config.max_payload = file.max_payload.unwrap_or(config.max_payload);
        config.validate()?;
        Ok(config)
    }
}
