//! Settings of the Redis Streams sink.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Error, Result, Template, redact_url};

/// Redis's own limit on one bulk argument (`proto-max-bulk-len`, 512 MiB by default).
pub const DEFAULT_MAX_PAYLOAD: usize = 512 * 1024 * 1024;

/// Settings of the Redis Streams sink: the `[sink]` table of the relay's configuration file
/// (`type = "redis"`, durations written `"5s"`, unknown keys refused) and the Rust API alike.
/// Every key but `url` has a default. `Debug` hides the password in the URL.
#[derive(Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// Connection URL: `redis://[user:password@]host:port[/db]`, or `rediss://...` for TLS
    /// (the server certificate is checked against the system's root certificates, or
    /// against [`tls_ca_file`](Self::tls_ca_file)). No default.
    pub url: String,
    /// With `rediss://`: a PEM file of the certificate authorities that sign the server's
    /// certificate, trusted instead of the system's roots (default none).
    pub tls_ca_file: Option<PathBuf>,
    /// With `rediss://`: a PEM client certificate for servers that ask for one
    /// (`tls-auth-clients yes`), with [`tls_key_file`](Self::tls_key_file) (default none).
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of [`tls_cert_file`](Self::tls_cert_file) (default none).
    pub tls_key_file: Option<PathBuf>,
    /// Connections the pool may open (default 2). A sink publishes on one connection, kept
    /// between batches until it fails; more are opened only when one sink is shared by
    /// several workers publishing at the same time.
    pub pool_size: usize,
    /// Longest wait for a connection, a `PING` or a batch's replies (default 5 s). A
    /// time-out counts as the broker being unavailable. Keep it shorter than the worker's
    /// lease.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
    /// Prepended to every stream name (default empty), e.g. `prod:`.
    pub stream_prefix: String,
    /// The stream of each topic when [`streams`](Self::streams) is not set: `{topic}` is
    /// replaced by the message's topic (default `{topic}`); `{key}` is refused. A template
    /// without `{topic}` sends every topic to one stream.
    pub stream_template: Template,
    /// An explicit map from topic to stream, instead of the template (default none). A
    /// message whose topic is not in the map can never be delivered and is dead-lettered
    /// (add the topic and replay it).
    pub streams: Option<BTreeMap<String, String>>,
    /// Trim each stream on append to about this many entries (`XADD ... MAXLEN ~ N`); `None`
    /// (the default) never trims.
    pub max_len: Option<u64>,
    /// De-duplication: when set, each message id is recorded for this long and a message
    /// whose id was already appended is not appended again (its first entry id is returned
    /// as the receipt). `None` (the default) turns it off. It must outlast any redelivery:
    /// give it hours, not seconds.
    #[serde(with = "humantime_serde")]
    pub dedup_ttl: Option<Duration>,
    /// Prefix of the per-message de-duplication keys (default `outbox:dedup:`); the key is
    /// this prefix followed by the message id.
    pub dedup_key_prefix: String,
    /// Largest payload in bytes that is sent (default 512 MiB, Redis's `proto-max-bulk-len`);
    /// a larger message is dead-lettered instead of making the server drop the connection.
    pub max_payload: usize,
}

impl Default for RedisConfig {
    /// The defaults, with no URL (which [`RedisConfig::validate`] refuses).
    fn default() -> Self {
        RedisConfig {
            url: String::new(),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            pool_size: 2,
            publish_timeout: Duration::from_secs(5),
            stream_prefix: String::new(),
            stream_template: Template::topic(),
            streams: None,
            max_len: None,
            dedup_ttl: None,
            dedup_key_prefix: "outbox:dedup:".into(),
            max_payload: DEFAULT_MAX_PAYLOAD,
        }
    }
}

outbox_core::debug_fields!(RedisConfig, |config| {
    url: redact_url(&config.url),
    pool_size, publish_timeout, stream_prefix, stream_template, streams, max_len, dedup_ttl,
    dedup_key_prefix, max_payload,
});

impl Settings for RedisConfig {
    /// Checks every setting; the error is keyed by the bad one (the caller places it in its
    /// section with [`Error::in_section`]) and says what to do.
    fn validate(&self) -> Result<()> {
        const SCHEMES: [&str; 4] = ["redis://", "rediss://", "redis+unix://", "unix://"];
        if self.url.is_empty() {
            return Err(Error::setting(
                "url",
                "is missing: give the Redis server, e.g. redis://127.0.0.1:6379",
            ));
        }
        if !SCHEMES.iter().any(|s| self.url.starts_with(s)) {
            return Err(Error::setting(
                "url",
                format!(
                    "`{}` is not a Redis URL; expected redis://[:password@]host:port[/db], or rediss://... for TLS",
                    redact_url(&self.url)
                ),
            ));
        }
        if let Err(error) =
            deadpool_redis::redis::IntoConnectionInfo::into_connection_info(self.url.as_str())
        {
            return Err(Error::setting(
                "url",
                format!(
                    "`{}` is not a valid Redis URL ({}); expected redis://[:password@]host:port[/db]",
                    redact_url(&self.url),
                    error.detail().unwrap_or(error.category())
                ),
            ));
        }
        outbox_core::config::check_tls_files_of_url(
            &self.url,
            "rediss://",
            self.tls_ca_file.as_deref(),
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
        )?;
        outbox_core::config::check_at_least_one("pool_size", self.pool_size as u64)?;
        if self.publish_timeout.is_zero() {
            return Err(Error::setting(
                "publish_timeout",
                "is 0; give it a duration such as 5 s",
            ));
        }
        if self.stream_template.as_str().trim().is_empty() {
            return Err(Error::setting(
                "stream_template",
                "is empty; give a stream name such as `{topic}` or `events:{topic}`",
            ));
        }
        self.stream_template.refuse_key("stream_template")?;
        if let Some(map) = &self.streams {
            if self.stream_template != Template::topic() {
                return Err(Error::setting(
                    "stream_template",
                    "is set together with streams; give a template or a map, not both",
                ));
            }
            if map.is_empty() {
                return Err(Error::setting(
                    "streams",
                    "is an empty map; map each topic to a stream, or use stream_template",
                ));
            }
            if let Some((topic, _)) = map
                .iter()
                .find(|(t, s)| t.is_empty() || s.trim().is_empty())
            {
                return Err(Error::setting(
                    "streams",
                    format!(
                        "maps topic `{topic}` to an empty stream name (or has an empty topic); give each topic a stream"
                    ),
                ));
            }
        }
        if self.max_len == Some(0) {
            return Err(Error::setting(
                "max_len",
                "is 0, which would trim every stream empty; leave it unset to keep everything, or give a length",
            ));
        }
        if let Some(ttl) = self.dedup_ttl {
            if ttl < Duration::from_millis(1) {
                return Err(Error::setting(
                    "dedup_ttl",
                    "is 0; leave it unset to turn de-duplication off, or give a duration such as 24 h",
                ));
            }
            if self.dedup_key_prefix.is_empty() {
                return Err(Error::setting(
                    "dedup_key_prefix",
                    "is empty; give a prefix such as `outbox:dedup:`",
                ));
            }
        }
        if self.max_payload == 0 {
            return Err(Error::setting(
                "max_payload",
                "is 0; it must be at least 1 byte (Redis's default limit is 512 MiB)",
            ));
        }
        Ok(())
    }
}

impl RedisConfig {
    /// Defaults for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            ..Self::default()
        }
    }

    /// Sends each topic to the stream the map names for it (instead of the template).
    pub fn stream_map<T, S>(mut self, map: impl IntoIterator<Item = (T, S)>) -> Self
    where
        T: Into<String>,
        S: Into<String>,
    {
        self.stream_template = Template::topic();
        self.streams = Some(map.into_iter().map(|(t, s)| (t.into(), s.into())).collect());
        self
    }

    /// The stream a message of `topic` is appended to, or `None` when the stream map has no
    /// entry for it.
    pub fn stream_for(&self, topic: &str) -> Option<String> {
        let name = match &self.streams {
            Some(map) => map.get(topic)?.clone(),
            None => self.stream_template.render(topic, ""),
        };
        Some(format!("{}{name}", self.stream_prefix))
    }
}

outbox_core::setters!(RedisConfig {
    /// Sets the prefix of every stream name.
    stream_prefix(prefix: impl Into<String>) => stream_prefix = prefix.into();
    /// Sends each topic to the stream named by `template` (and drops any stream map).
    stream_template(template: Template) => stream_template = template, streams = None;
    /// Trims each stream to about `max_len` entries.
    max_len(max_len: u64) => max_len = Some(max_len);
    /// Turns de-duplication on, remembering each message id for `ttl`.
    dedup(ttl: Duration) => dedup_ttl = Some(ttl);
    /// Sets the longest wait for a connection or a batch's replies.
    publish_timeout(timeout: Duration) => publish_timeout = timeout;
});

#[cfg(test)]
mod tests {
    use super::*;

    fn err(config: RedisConfig) -> String {
        config.validate().unwrap_err().to_string()
    }

    fn template(text: &str) -> Template {
        Template::new(text).unwrap()
    }

    #[test]
    fn bad_settings_name_their_key() {
        let ok = RedisConfig::new("redis://127.0.0.1:6379");
        ok.validate().unwrap();
        assert!(err(RedisConfig::default()).contains("url is missing"));
        assert!(err(RedisConfig::new("localhost:6379")).contains("url `localhost:6379`"));
        assert!(err(RedisConfig::new("http://x")).contains("not a Redis URL"));
        assert!(err(RedisConfig::new("redis://host:notaport")).contains("url `"));
        assert!(err(ok.clone().stream_template(template(""))).contains("stream_template is empty"));
        assert!(err(ok.clone().stream_template(template("  "))).contains("stream_template"));
        assert!(
            err(ok.clone().stream_template(template("s:{key}")))
                .contains("stream_template `s:{key}` uses {key}")
        );
        assert!(err(ok.clone().max_len(0)).contains("max_len is 0"));
        assert!(err(ok.clone().dedup(Duration::ZERO)).contains("dedup_ttl is 0"));
        assert!(
            err(RedisConfig {
                pool_size: 0,
                ..ok.clone()
            })
            .contains("pool_size is 0")
        );
        assert!(err(ok.clone().publish_timeout(Duration::ZERO)).contains("publish_timeout is 0"));
        assert!(
            err(ok.clone().stream_map(Vec::<(String, String)>::new()))
                .contains("streams is an empty map")
        );
        assert!(err(ok.clone().stream_map([("orders", "")])).contains("`orders`"));
        assert!(
            err(RedisConfig {
                stream_template: template("events:{topic}"),
                ..ok.clone().stream_map([("orders", "o")])
            })
            .contains("stream_template is set together with streams")
        );
        assert!(
            err(RedisConfig {
                max_payload: 0,
                ..ok.clone()
            })
            .contains("max_payload is 0")
        );
        let error = ok.clone().max_len(0).validate().unwrap_err();
        assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
        assert_eq!(
            error.in_section("sink").message(),
            "sink.max_len is 0, which would trim every stream empty; leave it unset to keep \
             everything, or give a length"
        );
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
        let config = config.stream_template(template("events:{topic}:v1"));
        assert_eq!(
            config.stream_for("orders").as_deref(),
            Some("t1:events:orders:v1")
        );
        let config = config.stream_template(template("all"));
        assert_eq!(config.stream_for("orders").as_deref(), Some("t1:all"));
        let config = config.stream_map([("orders", "o")]);
        config.validate().unwrap();
        assert_eq!(config.stream_for("orders").as_deref(), Some("t1:o"));
        assert_eq!(config.stream_for("users"), None);
    }

    #[test]
    fn reads_the_file_section_and_keys_its_errors() {
        let config = RedisConfig::from_value(serde_json::json!({
            "url": "redis://:s3cret@127.0.0.1:6379",
            "publish_timeout": "250ms",
            "stream_prefix": "prod:",
            "stream_template": "events:{topic}",
            "dedup_ttl": "24h",
        }))
        .unwrap();
        assert_eq!(
            config,
            RedisConfig::new("redis://:s3cret@127.0.0.1:6379")
                .publish_timeout(Duration::from_millis(250))
                .stream_prefix("prod:")
                .stream_template(template("events:{topic}"))
                .dedup(Duration::from_secs(24 * 3600))
        );
        let map = RedisConfig::from_value(serde_json::json!({
            "url": "redis://h",
            "streams": { "orders.paid": "orders" },
        }))
        .unwrap();
        assert_eq!(map.stream_for("orders.paid").as_deref(), Some("orders"));

        outbox_testkit::check_sink_settings_refused::<RedisConfig>([
            (
                serde_json::json!({ "url": "redis://h", "command_timeout": "5s" }),
                "sink.command_timeout: unknown field",
            ),
            (
                serde_json::json!({ "url": "redis://h", "publish_timeout": "soon" }),
                "sink.publish_timeout: ",
            ),
            (
                serde_json::json!({ "url": "redis://h", "stream_template": "{topc}" }),
                "sink.stream_template: `{topc}` uses the unknown placeholder",
            ),
            (
                serde_json::json!({ "url": "redis://h", "max_len": 0 }),
                "sink.max_len is 0",
            ),
            (
                serde_json::json!({
                    "url": "redis://h",
                    "stream_template": "a:{topic}",
                    "streams": { "t": "s" },
                }),
                "sink.stream_template is set together with streams",
            ),
            (serde_json::json!({ "pool_size": 1 }), "sink.url is missing"),
        ]);
    }
}
