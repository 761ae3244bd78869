//! Settings of the AMQP sink.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use lapin::ExchangeKind;
use lapin::uri::AMQPUri;
use outbox_core::{Backoff, Error, Result, redact_url};
use serde::Deserialize;

/// Longest exchange name or routing key AMQP 0-9-1 can carry (a short string).
pub(crate) const MAX_NAME_LEN: usize = 255;

/// Default of [`AmqpConfig::max_payload`]: 16 MiB, RabbitMQ 4's default `max_message_size`.
pub const DEFAULT_MAX_PAYLOAD: usize = 16 * 1024 * 1024;

/// RabbitMQ's hard limit on a message.
const BROKER_MAX_PAYLOAD: usize = 512 * 1024 * 1024;

/// What the sink does with the exchanges it publishes to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ExchangeSetup {
    /// Only check that each exchange exists (a passive declare); a missing one is an error.
    /// The default: the topology belongs to whoever runs the broker.
    #[default]
    Passive,
    /// Declare each exchange, durable, of this kind (creating it if missing). Exchanges named
    /// `amq.*` are reserved by the broker and are always checked passively.
    Declare(ExchangeKind),
}

/// What a message that no queue takes (returned by the broker under `mandatory`) becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unroutable {
    /// A temporary failure: charged as an attempt and retried with backoff, so it is delivered
    /// once a binding appears, and dead-lettered after the worker's `max_attempts`.
    #[default]
    Retry,
    /// A permanent failure: dead-lettered at once.
    DeadLetter,
}

/// Where messages of one topic go. Both fields are templates (see [`AmqpConfig`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Exchange name template (`""` is the broker's default exchange).
    pub exchange: String,
    /// Routing key template.
    pub routing_key: String,
}

impl Route {
    /// A route to `exchange` with `routing_key`.
    pub fn new(exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        Route {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }
    }
}

/// Settings of the AMQP sink. `Debug` hides the password in the URI.
///
/// Exchange names and routing keys are templates: `{topic}` is replaced by the message's
/// topic and, in routing keys only, `{key}` by its partition key (empty when it has none).
/// A topic listed in `routes` uses that route; any other topic uses `exchange` and
/// `routing_key`.
#[derive(Clone, PartialEq)]
pub struct AmqpConfig {
    /// Broker URI, `amqp://user:password@host:5672/vhost` or `amqps://...` for TLS. The
    /// vhost is percent-encoded (`%2f` is `/`, the default when the path is missing).
    pub url: String,
    /// Exchange template for topics not in `routes`.
    pub exchange: String,
    /// Routing key template for topics not in `routes` (default `{topic}`).
    pub routing_key: String,
    /// Explicit routes by topic; they take precedence over the templates.
    pub routes: BTreeMap<String, Route>,
    /// Check the exchanges passively (default) or declare them.
    pub exchange_setup: ExchangeSetup,
    /// What a message no queue takes becomes (default [`Unroutable::Retry`]).
    pub unroutable: Unroutable,
    /// The `app_id` property of every message (default `outbox`).
    pub app_id: String,
    /// Largest payload in bytes; a larger message is dead-lettered without being sent
    /// (default 16 MiB, RabbitMQ 4's default `max_message_size`).
    pub max_payload: usize,
    /// How long connecting, opening a channel, checking an exchange or a health check may take
    /// (default 5 s).
    pub connect_timeout: Duration,
    /// How long publishing one batch and receiving all its confirms may take (default 10 s).
    /// Keep it shorter than the worker's lease.
    pub publish_timeout: Duration,
    /// Waits between reconnection attempts after the connection or channel is lost (default
    /// 100 ms doubling to 10 s). Until a reconnect succeeds, health checks report down.
    pub reconnect_backoff: Backoff,
}

impl std::fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &redact_url(&self.url))
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .field("routes", &self.routes)
            .field("exchange_setup", &self.exchange_setup)
            .field("unroutable", &self.unroutable)
            .field("app_id", &self.app_id)
            .field("max_payload", &self.max_payload)
            .field("connect_timeout", &self.connect_timeout)
            .field("publish_timeout", &self.publish_timeout)
            .field("reconnect_backoff", &self.reconnect_backoff)
            .finish()
    }
}

impl AmqpConfig {
    /// Defaults for the broker at `url`, publishing to `exchange` with the topic as routing key.
    pub fn new(url: impl Into<String>, exchange: impl Into<String>) -> Self {
        AmqpConfig {
            url: url.into(),
            exchange: exchange.into(),
            routing_key: "{topic}".into(),
            routes: BTreeMap::new(),
            exchange_setup: ExchangeSetup::Passive,
            unroutable: Unroutable::Retry,
            app_id: "outbox".into(),
            max_payload: DEFAULT_MAX_PAYLOAD,
            connect_timeout: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(10),
            reconnect_backoff: Backoff {
                initial: Duration::from_millis(100),
                multiplier: 2.0,
                max: Duration::from_secs(10),
                jitter: 0.2,
            },
        }
    }

    /// Sets the routing key template for topics not in `routes`.
    pub fn routing_key(mut self, template: impl Into<String>) -> Self {
        self.routing_key = template.into();
        self
    }

    /// Routes `topic` to `exchange` with `routing_key` (both templates).
    pub fn route(
        mut self,
        topic: impl Into<String>,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.routes
            .insert(topic.into(), Route::new(exchange, routing_key));
        self
    }

    /// Sets how exchanges are set up.
    pub fn exchange_setup(mut self, setup: ExchangeSetup) -> Self {
        self.exchange_setup = setup;
        self
    }

    /// Sets what an unroutable message becomes.
    pub fn unroutable(mut self, unroutable: Unroutable) -> Self {
        self.unroutable = unroutable;
        self
    }

    /// Reads the settings from the `[sink]` table of the relay's configuration (as JSON,
    /// without `type`) and validates them. Errors name the bad key. See [`FileConfig`] for
    /// the keys.
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        let file: FileConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let at = if path == "." {
                String::new()
            } else {
                format!("sink.{path}: ")
            };
            Error::config(format!("amqp sink configuration: {at}{}", e.inner()))
        })?;
        let config = file.into_config()?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every setting; the error names the bad one.
    pub fn validate(&self) -> Result<()> {
        self.parse_uri()?;
        check_template("sink.exchange", &self.exchange, &["topic"])?;
        check_template("sink.routing_key", &self.routing_key, &["topic", "key"])?;
        check_routing_key_not_empty("sink.routing_key", &self.routing_key)?;
        for (topic, route) in &self.routes {
            if topic.is_empty() {
                return Err(Error::config(
                    "sink.routes has an entry for an empty topic; name the topic it routes",
                ));
            }
            let key = format!("sink.routes.{topic}.exchange");
            check_template(&key, &route.exchange, &["topic"])?;
            let key = format!("sink.routes.{topic}.routing_key");
            check_template(&key, &route.routing_key, &["topic", "key"])?;
            check_routing_key_not_empty(&key, &route.routing_key)?;
        }
        if let ExchangeSetup::Declare(ExchangeKind::Custom(kind)) = &self.exchange_setup
            && kind.trim().is_empty()
        {
            return Err(Error::config(
                "sink.exchange_setup declares exchanges of an empty custom kind; use direct, \
                 fanout, topic, headers or a plugin's type such as x-consistent-hash",
            ));
        }
        if self.app_id.len() > MAX_NAME_LEN {
            return Err(Error::config(format!(
                "sink.app_id is {} bytes long; AMQP allows at most {MAX_NAME_LEN}",
                self.app_id.len()
            )));
        }
        if self.max_payload == 0 || self.max_payload > BROKER_MAX_PAYLOAD {
            return Err(Error::config(format!(
                "sink.max_payload is {}; it must be between 1 and {BROKER_MAX_PAYLOAD} bytes \
                 (RabbitMQ's limit), and at most the broker's max_message_size",
                self.max_payload
            )));
        }
        for (key, value) in [
            ("sink.connect_timeout", self.connect_timeout),
            ("sink.publish_timeout", self.publish_timeout),
        ] {
            if value.is_zero() {
                return Err(Error::config(format!(
                    "{key} is 0; it must be greater than zero"
                )));
            }
        }
        self.reconnect_backoff
            .validate()
            .map_err(|e| Error::config(format!("sink.reconnect_{}", e.message())))
    }

    /// The URI, parsed; a config error says what is wrong with it.
    pub(crate) fn parse_uri(&self) -> Result<AMQPUri> {
        let redacted = redact_url(&self.url);
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(Error::config(format!(
                "sink.url `{redacted}` is not an AMQP URI; expected \
                 amqp://user:password@host:5672/vhost (or amqps:// for TLS)"
            )));
        }
        let mut uri = AMQPUri::from_str(&self.url).map_err(|e| {
            // The parser's message may quote the URI; keep only the redacted one.
            let reason = if e.contains(&self.url) {
                "it could not be parsed".to_string()
            } else {
                e
            };
            Error::config(format!(
                "sink.url `{redacted}` is not a valid AMQP URI ({reason}); expected \
                 amqp://user:password@host:5672/vhost with the vhost percent-encoded"
            ))
        })?;
        // The parser reads only domain names and takes any other host for localhost; keep
        // an IPv6 literal as written.
        if let Some(host) = host_of(&self.url)
            && host.starts_with('[')
        {
            uri.authority.host = host.trim_start_matches('[').trim_end_matches(']').into();
        }
        Ok(uri)
    }
}

/// The `[sink]` table of the relay's configuration for `type = "amqp"`: the keys of
/// [`AmqpConfig`], with durations written as `"5s"` or `"500ms"`. Unknown keys are refused.
///
/// ```toml
/// [sink]
/// type = "amqp"
/// url = "amqp://relay:secret@rabbit:5672/%2f"    # or `uri`
/// exchange = "events"
/// routing_key = "{topic}"
/// exchange_setup = "declare"                     # or "passive" (default)
/// exchange_kind = "topic"                        # with "declare"; default "topic"
/// unroutable = "dead_letter"                     # or "retry" (default)
/// publish_timeout = "10s"
/// reconnect_backoff = { initial = "100ms", max = "10s" }
/// routes.audit = { exchange = "audit-log", routing_key = "{topic}.{key}" }
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// See [`AmqpConfig::url`].
    #[serde(alias = "uri")]
    pub url: String,
    /// See [`AmqpConfig::exchange`].
    pub exchange: String,
    /// See [`AmqpConfig::routing_key`].
    pub routing_key: Option<String>,
    /// See [`AmqpConfig::routes`].
    #[serde(default)]
    pub routes: BTreeMap<String, FileRoute>,
    /// `passive` (default) or `declare`.
    pub exchange_setup: Option<String>,
    /// With `declare`: `direct`, `fanout`, `topic` (default), `headers`, or a plugin's type.
    pub exchange_kind: Option<String>,
    /// `retry` (default) or `dead_letter`.
    pub unroutable: Option<String>,
    /// See [`AmqpConfig::app_id`].
    pub app_id: Option<String>,
    /// See [`AmqpConfig::max_payload`].
    pub max_payload: Option<usize>,
    /// See [`AmqpConfig::connect_timeout`].
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
    /// See [`AmqpConfig::publish_timeout`].
    #[serde(default, with = "humantime_serde")]
    pub publish_timeout: Option<Duration>,
    /// See [`AmqpConfig::reconnect_backoff`]; missing fields keep their defaults.
    #[serde(default)]
    pub reconnect_backoff: FileBackoff,
}

/// A route in the configuration file: see [`Route`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRoute {
    /// Exchange name template.
    pub exchange: String,
    /// Routing key template (default `{topic}`).
    #[serde(default = "topic_template")]
    pub routing_key: String,
}

fn topic_template() -> String {
    "{topic}".into()
}

/// The reconnect backoff in the configuration file: see [`Backoff`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileBackoff {
    /// Wait after the first failure.
    #[serde(default, with = "humantime_serde")]
    pub initial: Option<Duration>,
    /// Growth per failure.
    pub multiplier: Option<f64>,
    /// Upper bound of a wait.
    #[serde(default, with = "humantime_serde")]
    pub max: Option<Duration>,
    /// Fraction of each wait taken off at random.
    pub jitter: Option<f64>,
}

impl FileConfig {
    fn into_config(self) -> Result<AmqpConfig> {
        let mut config = AmqpConfig::new(self.url, self.exchange);
        if let Some(routing_key) = self.routing_key {
            config.routing_key = routing_key;
        }
        config.routes = self
            .routes
            .into_iter()
            .map(|(topic, r)| (topic, Route::new(r.exchange, r.routing_key)))
            .collect();
        let kind = self.exchange_kind.as_deref().map(exchange_kind);
        config.exchange_setup = match (self.exchange_setup.as_deref(), kind) {
            (None | Some("passive"), None) => ExchangeSetup::Passive,
            (None | Some("passive"), Some(_)) => {
                return Err(Error::config(
                    "sink.exchange_kind only applies with sink.exchange_setup = \"declare\"",
                ));
            }
            (Some("declare"), kind) => ExchangeSetup::Declare(kind.unwrap_or(ExchangeKind::Topic)),
            (Some(other), _) => {
                return Err(Error::config(format!(
                    "sink.exchange_setup is `{other}`; use \"passive\" (check that exchanges \
                     exist) or \"declare\" (create them)"
                )));
            }
        };
        config.unroutable = match self.unroutable.as_deref() {
            None | Some("retry") => Unroutable::Retry,
            Some("dead_letter") => Unroutable::DeadLetter,
            Some(other) => {
                return Err(Error::config(format!(
                    "sink.unroutable is `{other}`; use \"retry\" or \"dead_letter\""
                )));
            }
        };
        if let Some(app_id) = self.app_id {
            config.app_id = app_id;
        }
        if let Some(max_payload) = self.max_payload {
            config.max_payload = max_payload;
        }
        if let Some(timeout) = self.connect_timeout {
            config.connect_timeout = timeout;
        }
        if let Some(timeout) = self.publish_timeout {
            config.publish_timeout = timeout;
        }
        let b = &mut config.reconnect_backoff;
        let f = self.reconnect_backoff;
        b.initial = f.initial.unwrap_or(b.initial);
        b.multiplier = f.multiplier.unwrap_or(b.multiplier);
        b.max = f.max.unwrap_or(b.max);
        b.jitter = f.jitter.unwrap_or(b.jitter);
        Ok(config)
    }
}

fn exchange_kind(name: &str) -> ExchangeKind {
    match name {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "topic" => ExchangeKind::Topic,
        "headers" => ExchangeKind::Headers,
        custom => ExchangeKind::Custom(custom.to_string()),
    }
}

/// The host part of a URL, as written.
fn host_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let host_port = &authority[authority.rfind('@').map_or(0, |at| at + 1)..];
    if host_port.starts_with('[') {
        return Some(&host_port[..host_port.find(']').map_or(host_port.len(), |i| i + 1)]);
    }
    Some(&host_port[..host_port.find(':').unwrap_or(host_port.len())])
}

/// Checks that a template uses only the placeholders `allowed`, and is short enough.
fn check_template(key: &str, template: &str, allowed: &[&str]) -> Result<()> {
    let names = allowed
        .iter()
        .map(|n| format!("{{{n}}}"))
        .collect::<Vec<_>>()
        .join(" and ");
    let mut rest = template;
    while let Some(open) = rest.find(['{', '}']) {
        if rest[open..].starts_with('}') {
            return Err(Error::config(format!(
                "{key} `{template}` has a `}}` without a `{{`; the placeholders are {names}"
            )));
        }
        let Some(close) = rest[open..].find('}') else {
            return Err(Error::config(format!(
                "{key} `{template}` has an unclosed `{{`; the placeholders are {names}"
            )));
        };
        let name = &rest[open + 1..open + close];
        if !allowed.contains(&name) {
            return Err(Error::config(format!(
                "{key} `{template}` uses the unknown placeholder `{{{name}}}`; the placeholders \
                 are {names}"
            )));
        }
        rest = &rest[open + close + 1..];
    }
    if template.len() > MAX_NAME_LEN {
        return Err(Error::config(format!(
            "{key} is {} bytes long; AMQP allows at most {MAX_NAME_LEN}",
            template.len()
        )));
    }
    Ok(())
}

/// A routing key template that renders empty for every message is a mistake; one that only
/// uses `{key}` renders empty for messages without a key, which then fail one by one.
fn check_routing_key_not_empty(key: &str, template: &str) -> Result<()> {
    if template.is_empty() {
        return Err(Error::config(format!(
            "{key} is empty, so every message would get an empty routing key; use `{{topic}}` \
             (the default), `{{key}}` or a fixed text"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AmqpConfig {
        AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "events")
    }

    fn error_of(config: AmqpConfig) -> String {
        let error = config.validate().expect_err("config should be refused");
        assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
        error.to_string()
    }

    #[test]
    fn defaults_are_valid_and_debug_hides_the_password() {
        config().validate().unwrap();
        let debug = format!("{:?}", config());
        assert!(debug.contains("amqp://guest:***@127.0.0.1"), "{debug}");
        assert!(!debug.contains("guest:guest"), "{debug}");
    }

    #[test]
    fn bad_uris_name_the_key_and_hide_the_password() {
        for url in [
            "http://guest:s3cret@127.0.0.1",
            "amqp://guest:s3cret@127.0.0.1:notaport/",
            "amqp://guest:s3cret@127.0.0.1:5672/%2f?heartbeat=x",
            "127.0.0.1:5672",
        ] {
            let message = error_of(AmqpConfig {
                url: url.into(),
                ..config()
            });
            assert!(message.contains("sink.url"), "{message}");
            assert!(!message.contains("s3cret"), "{message}");
        }
        AmqpConfig {
            url: "amqps://u:p@rabbit.example:5671/prod".into(),
            ..config()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn ip_hosts_are_kept() {
        let uri = config().parse_uri().unwrap();
        assert_eq!(uri.authority.host, "127.0.0.1");
        assert_eq!(uri.authority.port, 5672);
        assert_eq!(uri.vhost, "/");
        let v6 = AmqpConfig {
            url: "amqp://u:p@[::1]:5673/app".into(),
            ..config()
        };
        let uri = v6.parse_uri().unwrap();
        assert_eq!(
            (uri.authority.host.as_str(), uri.authority.port),
            ("::1", 5673)
        );
        assert_eq!(uri.vhost, "app");
    }

    #[test]
    fn templates_are_checked() {
        let message = error_of(config().routing_key(""));
        assert!(message.contains("sink.routing_key is empty"), "{message}");
        let message = error_of(config().routing_key("{topik}"));
        assert!(
            message.contains("unknown placeholder `{topik}`"),
            "{message}"
        );
        let message = error_of(AmqpConfig {
            exchange: "x.{key}".into(),
            ..config()
        });
        assert!(message.contains("sink.exchange"), "{message}");
        let message = error_of(config().routing_key("a.{topic"));
        assert!(message.contains("unclosed"), "{message}");
        let message = error_of(config().route("orders", "shop", ""));
        assert!(
            message.contains("sink.routes.orders.routing_key is empty"),
            "{message}"
        );
        let message = error_of(config().route("", "shop", "x"));
        assert!(message.contains("empty topic"), "{message}");
        config()
            .routing_key("{topic}.{key}")
            .route("orders", "shop.{topic}", "{key}")
            .validate()
            .unwrap();
    }

    #[test]
    fn reads_the_configuration_file_table_and_names_bad_keys() {
        let config = AmqpConfig::from_value(serde_json::json!({
            "uri": "amqp://relay:pw@rabbit/%2f",
            "exchange": "events",
            "exchange_setup": "declare",
            "exchange_kind": "fanout",
            "unroutable": "dead_letter",
            "publish_timeout": "3s",
            "reconnect_backoff": { "max": "2s" },
            "routes": { "audit": { "exchange": "audit-log" } },
        }))
        .unwrap();
        assert_eq!(
            config.exchange_setup,
            ExchangeSetup::Declare(ExchangeKind::Fanout)
        );
        assert_eq!(config.unroutable, Unroutable::DeadLetter);
        assert_eq!(config.publish_timeout, Duration::from_secs(3));
        assert_eq!(config.reconnect_backoff.max, Duration::from_secs(2));
        assert_eq!(config.reconnect_backoff.initial, Duration::from_millis(100));
        assert_eq!(config.routes["audit"], Route::new("audit-log", "{topic}"));
        assert_eq!(config.routing_key, "{topic}");

        let minimal = serde_json::json!({ "url": "amqp://h", "exchange": "x" });
        assert_eq!(
            AmqpConfig::from_value(minimal).unwrap().exchange_setup,
            ExchangeSetup::Passive
        );
        for (bad, key) in [
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchang": "y" }),
                "exchang",
            ),
            (serde_json::json!({ "url": "amqp://h" }), "exchange"),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "publish_timeout": "soon" }),
                "sink.publish_timeout",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "unroutable": "drop" }),
                "sink.unroutable",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchange_setup": "create" }),
                "sink.exchange_setup",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchange_kind": "topic" }),
                "sink.exchange_kind",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "routing_key": "" }),
                "sink.routing_key",
            ),
            (
                serde_json::json!({ "url": "redis://h", "exchange": "x" }),
                "sink.url",
            ),
        ] {
            let error = AmqpConfig::from_value(bad).unwrap_err();
            assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
            assert!(error.to_string().contains(key), "{key}: {error}");
        }
    }

    #[test]
    fn timeouts_and_backoff_are_checked() {
        let message = error_of(AmqpConfig {
            publish_timeout: Duration::ZERO,
            ..config()
        });
        assert!(message.contains("sink.publish_timeout"), "{message}");
        let mut bad = config();
        bad.reconnect_backoff.multiplier = 0.0;
        let message = error_of(bad);
        assert!(
            message.contains("sink.reconnect_backoff.multiplier"),
            "{message}"
        );
    }
}
