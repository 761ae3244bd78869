//! Settings of the AMQP sink: the `[sink]` table of the relay's configuration and the Rust
//! API alike.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use lapin::ExchangeKind;
use lapin::uri::AMQPUri;
use outbox_core::config::Settings;
use outbox_core::{Backoff, Error, Result, Template, redact_url};
use serde::{Deserialize, Deserializer};

/// Longest exchange name or routing key AMQP 0-9-1 can carry (a short string).
pub(crate) const MAX_NAME_LEN: usize = 255;

/// Default of [`AmqpConfig::max_payload`]: 16 MiB, RabbitMQ 4's default `max_message_size`.
pub const DEFAULT_MAX_PAYLOAD: usize = 16 * 1024 * 1024;

/// RabbitMQ's hard limit on a message.
const BROKER_MAX_PAYLOAD: usize = 512 * 1024 * 1024;

/// What the sink does with the exchanges it publishes to (`exchange_setup = "passive"` or
/// `"declare"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExchangeSetup {
    /// Only check that each exchange exists (a passive declare); a missing one is an error.
    /// The default: the topology belongs to whoever runs the broker.
    #[default]
    Passive,
    /// Declare each exchange, durable, of [`AmqpConfig::exchange_kind`] (creating it if
    /// missing). Exchanges named `amq.*` are reserved by the broker and are always checked
    /// passively.
    Declare,
}

/// What a message that no queue takes (returned by the broker under `mandatory`) becomes
/// (`unroutable = "retry"` or `"dead_letter"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unroutable {
    /// A temporary failure: charged as an attempt and retried with backoff, so it is delivered
    /// once a binding appears, and dead-lettered after the worker's `max_attempts`.
    #[default]
    Retry,
    /// A permanent failure: dead-lettered at once.
    DeadLetter,
}

/// Where messages of one topic go: `routes.<topic> = { exchange = "…", routing_key = "…" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Exchange name template, `{topic}` allowed (`""` is the broker's default exchange).
    pub exchange: Template,
    /// Routing key template, `{topic}` and `{key}` allowed (default `{topic}`).
    #[serde(default = "Template::topic")]
    pub routing_key: Template,
}

impl Route {
    /// A route to `exchange` with `routing_key`.
    pub fn new(exchange: Template, routing_key: Template) -> Self {
        Route {
            exchange,
            routing_key,
        }
    }
}

/// Settings of the AMQP sink: the `[sink]` table of the relay's configuration (with
/// `type = "amqp"`; durations written as `"5s"` or `"500ms"`, unknown keys refused) and the
/// Rust API alike. Every key but `url` and `exchange` has a default. `Debug` hides the
/// password in the URI.
///
/// Exchange names and routing keys are [`Template`]s: `{topic}` is replaced by the message's
/// topic and, in routing keys only, `{key}` by its partition key (empty when it has none).
/// A topic listed in `routes` uses that route; any other topic uses `exchange` and
/// `routing_key`.
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
/// # with an amqps:// url:
/// # tls_ca_file = "/etc/outbox/rabbit-ca.pem"
/// # tls_cert_file = "/etc/outbox/relay.pem"
/// # tls_key_file = "/etc/outbox/relay.key"
/// ```
#[derive(Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmqpConfig {
    /// Broker URI, `amqp://user:password@host:5672/vhost` or `amqps://...` for TLS (required;
    /// the file also takes the key `uri`). The vhost is percent-encoded (`%2f` is `/`, the
    /// default when the path is missing).
    #[serde(alias = "uri")]
    pub url: String,
    /// With `amqps://`: a PEM file of the certificate authorities that sign the broker's
    /// certificate, trusted in addition to the system's root certificates (default none).
    pub tls_ca_file: Option<PathBuf>,
    /// With `amqps://`: a PEM client certificate for brokers that ask for one
    /// (`ssl_options.verify = verify_peer`), with [`tls_key_file`](Self::tls_key_file)
    /// (default none).
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of [`tls_cert_file`](Self::tls_cert_file) (PKCS#8, PKCS#1 or
    /// SEC1, unencrypted; default none).
    pub tls_key_file: Option<PathBuf>,
    /// Exchange template for topics not in `routes` (required; `""` is the broker's default
    /// exchange).
    pub exchange: Option<Template>,
    /// Routing key template for topics not in `routes` (default `{topic}`).
    pub routing_key: Template,
    /// Explicit routes by topic; they take precedence over `exchange` and `routing_key`.
    pub routes: BTreeMap<String, Route>,
    /// Check the exchanges passively (default) or declare them.
    pub exchange_setup: ExchangeSetup,
    /// The kind of the exchanges declared with [`ExchangeSetup::Declare`] (`direct`,
    /// `fanout`, `topic`, `headers` or a plugin's type; `None`, the default, is `topic`).
    /// Refused with [`ExchangeSetup::Passive`].
    #[serde(deserialize_with = "exchange_kind")]
    pub exchange_kind: Option<ExchangeKind>,
    /// What a message no queue takes becomes (default [`Unroutable::Retry`]).
    pub unroutable: Unroutable,
    /// The `app_id` property of every message (default `outbox`).
    pub app_id: String,
    /// Largest payload in bytes; a larger message is dead-lettered without being sent
    /// (default 16 MiB, RabbitMQ 4's default `max_message_size`).
    pub max_payload: usize,
    /// How long connecting, opening a channel, checking an exchange or a health check may take
    /// (default 5 s).
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How long publishing one batch and receiving all its confirms may take (default 10 s).
    /// Keep it shorter than the worker's lease.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
    /// Waits between reconnection attempts after the connection or channel is lost (default
    /// 100 ms doubling to 10 s, jitter 0.2; a key left out of the file's table keeps this
    /// default). Until a reconnect succeeds, health checks report down.
    #[serde(deserialize_with = "reconnect_backoff")]
    pub reconnect_backoff: Backoff,
}

impl Default for AmqpConfig {
    /// The defaults, with no URL and no exchange (which [`AmqpConfig::validate`] refuses).
    fn default() -> Self {
        AmqpConfig {
            url: String::new(),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            exchange: None,
            routing_key: Template::topic(),
            routes: BTreeMap::new(),
            exchange_setup: ExchangeSetup::Passive,
            exchange_kind: None,
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
}

outbox_core::debug_fields!(AmqpConfig, |config| {
    url: redact_url(&config.url),
    tls_ca_file, tls_cert_file, tls_key_file, exchange, routing_key, routes, exchange_setup,
    exchange_kind, unroutable, app_id, max_payload, connect_timeout, publish_timeout,
    reconnect_backoff,
});

impl Settings for AmqpConfig {
    /// Checks every setting; the error is keyed by the bad one, relative to the sink's
    /// section.
    fn validate(&self) -> Result<()> {
        if self.url.is_empty() {
            return Err(Error::setting(
                "url",
                "is missing: give the broker's URI, e.g. amqp://user:password@host:5672/%2f",
            ));
        }
        self.parse_uri()?;
        // The TLS files need an `amqps://` URL and must exist; a certificate needs its key.
        outbox_core::config::check_tls_files_of_url(
            &self.url,
            "amqps://",
            self.tls_ca_file.as_deref(),
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
        )?;
        let default = self.default_route()?;
        check_exchange("exchange", &default.exchange)?;
        check_routing_key("routing_key", &default.routing_key)?;
        for (topic, route) in &self.routes {
            if topic.is_empty() {
                return Err(Error::setting(
                    "routes",
                    "has an entry for an empty topic; name the topic it routes",
                ));
            }
            check_exchange(&format!("routes.{topic}.exchange"), &route.exchange)?;
            check_routing_key(&format!("routes.{topic}.routing_key"), &route.routing_key)?;
        }
        match (self.exchange_setup, &self.exchange_kind) {
            (ExchangeSetup::Passive, Some(_)) => {
                return Err(Error::setting(
                    "exchange_kind",
                    "only applies with exchange_setup = \"declare\"",
                ));
            }
            (ExchangeSetup::Declare, Some(ExchangeKind::Custom(kind)))
                if kind.trim().is_empty() =>
            {
                return Err(Error::setting(
                    "exchange_kind",
                    "is empty; use direct, fanout, topic, headers or a plugin's type such as \
                     x-consistent-hash",
                ));
            }
            _ => {}
        }
        if self.app_id.len() > MAX_NAME_LEN {
            return Err(Error::setting(
                "app_id",
                format!(
                    "is {} bytes long; AMQP allows at most {MAX_NAME_LEN}",
                    self.app_id.len()
                ),
            ));
        }
        if self.max_payload == 0 || self.max_payload > BROKER_MAX_PAYLOAD {
            return Err(Error::setting(
                "max_payload",
                format!(
                    "is {}; it must be between 1 and {BROKER_MAX_PAYLOAD} bytes (RabbitMQ's \
                     limit), and at most the broker's max_message_size",
                    self.max_payload
                ),
            ));
        }
        outbox_core::config::check_not_zero("connect_timeout", self.connect_timeout)?;
        outbox_core::config::check_not_zero("publish_timeout", self.publish_timeout)?;
        self.reconnect_backoff
            .validate()
            .map_err(|e| e.in_section("reconnect_backoff"))
    }
}

impl AmqpConfig {
    /// Defaults for the broker at `url`, publishing to `exchange` with the topic as routing
    /// key. `"events".parse()?` or [`Template::new`] makes the template.
    pub fn new(url: impl Into<String>, exchange: Template) -> Self {
        AmqpConfig {
            url: url.into(),
            exchange: Some(exchange),
            ..Self::default()
        }
    }

    /// Routes `topic` to `exchange` with `routing_key`.
    pub fn route(
        mut self,
        topic: impl Into<String>,
        exchange: Template,
        routing_key: Template,
    ) -> Self {
        self.routes
            .insert(topic.into(), Route::new(exchange, routing_key));
        self
    }

    /// The route of topics not in `routes`: `exchange` with `routing_key`.
    pub(crate) fn default_route(&self) -> Result<Route> {
        match &self.exchange {
            Some(exchange) => Ok(Route::new(exchange.clone(), self.routing_key.clone())),
            None => Err(Error::setting(
                "exchange",
                "is missing: name the exchange to publish to (\"\" is the broker's default \
                 exchange, \"{topic}\" names it after the message's topic)",
            )),
        }
    }

    /// The kind of exchange to declare, or `None` to check exchanges passively.
    pub(crate) fn declared_kind(&self) -> Option<ExchangeKind> {
        match self.exchange_setup {
            ExchangeSetup::Passive => None,
            ExchangeSetup::Declare => {
                Some(self.exchange_kind.clone().unwrap_or(ExchangeKind::Topic))
            }
        }
    }

    /// The URI, parsed; a config error says what is wrong with it.
    pub(crate) fn parse_uri(&self) -> Result<AMQPUri> {
        let redacted = redact_url(&self.url);
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(Error::setting(
                "url",
                format!(
                    "`{redacted}` is not an AMQP URI; expected \
                     amqp://user:password@host:5672/vhost (or amqps:// for TLS)"
                ),
            ));
        }
        let mut uri = AMQPUri::from_str(&self.url).map_err(|e| {
            // The parser's message may quote the URI; keep only the redacted one.
            let reason = if e.contains(&self.url) {
                "it could not be parsed".to_string()
            } else {
                e
            };
            Error::setting(
                "url",
                format!(
                    "`{redacted}` is not a valid AMQP URI ({reason}); expected \
                     amqp://user:password@host:5672/vhost with the vhost percent-encoded"
                ),
            )
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

outbox_core::setters!(AmqpConfig {
    /// Sets the routing key template for topics not in `routes`.
    routing_key(template: Template) => routing_key = template;
    /// Sets how exchanges are set up.
    exchange_setup(setup: ExchangeSetup) => exchange_setup = setup;
    /// Sets the kind of the exchanges declared with [`ExchangeSetup::Declare`].
    exchange_kind(kind: ExchangeKind) => exchange_kind = Some(kind);
    /// Sets what an unroutable message becomes.
    unroutable(unroutable: Unroutable) => unroutable = unroutable;
    /// Sets the longest wait for publishing one batch and receiving all its confirms.
    publish_timeout(timeout: Duration) => publish_timeout = timeout;
});

/// `exchange_kind` in the file: `direct`, `fanout`, `topic`, `headers`, or a plugin's type.
fn exchange_kind<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<ExchangeKind>, D::Error> {
    let name = String::deserialize(deserializer)?;
    Ok(Some(match name.as_str() {
        "direct" => ExchangeKind::Direct,
        "fanout" => ExchangeKind::Fanout,
        "topic" => ExchangeKind::Topic,
        "headers" => ExchangeKind::Headers,
        _ => ExchangeKind::Custom(name),
    }))
}

/// `reconnect_backoff` in the file: a [`Backoff`] table whose missing keys keep this sink's
/// default (100 ms doubling to 10 s) rather than [`Backoff::default`]'s.
fn reconnect_backoff<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Backoff, D::Error> {
    let table = serde_json::Map::<String, serde_json::Value>::deserialize(deserializer)?;
    let given: Backoff = outbox_core::config::from_value(table.clone().into())
        .map_err(|e| serde::de::Error::custom(e.message()))?;
    let mut backoff = AmqpConfig::default().reconnect_backoff;
    for key in table.keys() {
        match key.as_str() {
            "initial" => backoff.initial = given.initial,
            "multiplier" => backoff.multiplier = given.multiplier,
            "max" => backoff.max = given.max,
            "jitter" => backoff.jitter = given.jitter,
            _ => {}
        }
    }
    Ok(backoff)
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

/// An exchange template takes only `{topic}`, and must fit in a short string.
fn check_exchange(key: &str, template: &Template) -> Result<()> {
    template.refuse_key(key)?;
    check_length(key, template)
}

/// A routing key template that renders empty for every message is a mistake; one that only
/// uses `{key}` renders empty for messages without a key, which then fail one by one.
fn check_routing_key(key: &str, template: &Template) -> Result<()> {
    if template.as_str().is_empty() {
        return Err(Error::setting(
            key,
            "is empty, so every message would get an empty routing key; use `{topic}` (the \
             default), `{key}` or a fixed text",
        ));
    }
    check_length(key, template)
}

fn check_length(key: &str, template: &Template) -> Result<()> {
    let len = template.as_str().len();
    if len > MAX_NAME_LEN {
        return Err(Error::setting(
            key,
            format!("is {len} bytes long; AMQP allows at most {MAX_NAME_LEN}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(text: &str) -> Template {
        Template::new(text).unwrap()
    }

    fn config() -> AmqpConfig {
        AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", template("events"))
    }

    /// The error of an invalid config, placed in the `sink` section as the relay does.
    fn error_of(config: AmqpConfig) -> String {
        let error = config.validate().expect_err("config should be refused");
        assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
        error.in_section("sink").to_string()
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
            assert!(message.contains("sink.url `"), "{message}");
            assert!(!message.contains("s3cret"), "{message}");
        }
        let error = AmqpConfig {
            url: String::new(),
            ..config()
        }
        .validate()
        .unwrap_err();
        assert!(error.message().starts_with("url is missing"), "{error}");
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
        let message = error_of(config().routing_key(template("")));
        assert!(message.contains("sink.routing_key is empty"), "{message}");
        let message = error_of(AmqpConfig {
            exchange: Some(template("x.{key}")),
            ..config()
        });
        assert!(
            message.contains("sink.exchange `x.{key}` uses {key}"),
            "{message}"
        );
        let message = error_of(config().route("orders", template("shop"), template("")));
        assert!(
            message.contains("sink.routes.orders.routing_key is empty"),
            "{message}"
        );
        let message = error_of(config().route("orders", template("{key}"), template("x")));
        assert!(message.contains("sink.routes.orders.exchange"), "{message}");
        let message = error_of(config().route("", template("shop"), template("x")));
        assert!(
            message.contains("sink.routes has an entry for an empty topic"),
            "{message}"
        );
        let message = error_of(config().routing_key(template(&"k".repeat(256))));
        assert!(
            message.contains("sink.routing_key is 256 bytes long"),
            "{message}"
        );
        let message = error_of(AmqpConfig {
            exchange: None,
            ..config()
        });
        assert!(message.contains("sink.exchange is missing"), "{message}");
        config()
            .routing_key(template("{topic}.{key}"))
            .route("orders", template("shop.{topic}"), template("{key}"))
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
        assert_eq!(config.exchange_setup, ExchangeSetup::Declare);
        assert_eq!(config.declared_kind(), Some(ExchangeKind::Fanout));
        assert_eq!(config.unroutable, Unroutable::DeadLetter);
        assert_eq!(config.publish_timeout, Duration::from_secs(3));
        assert_eq!(config.reconnect_backoff.max, Duration::from_secs(2));
        assert_eq!(config.reconnect_backoff.initial, Duration::from_millis(100));
        assert_eq!(
            config.routes["audit"],
            Route::new(template("audit-log"), template("{topic}"))
        );
        assert_eq!(config.routing_key, template("{topic}"));
        assert_eq!(config.exchange, Some(template("events")));

        let minimal = serde_json::json!({ "url": "amqp://h", "exchange": "x" });
        let minimal = AmqpConfig::from_value(minimal).unwrap();
        assert_eq!(minimal, AmqpConfig::new("amqp://h", template("x")));
        assert_eq!(minimal.declared_kind(), None);
        let declare =
            serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchange_setup": "declare" });
        assert_eq!(
            AmqpConfig::from_value(declare).unwrap().declared_kind(),
            Some(ExchangeKind::Topic)
        );
        outbox_testkit::check_sink_settings_refused::<AmqpConfig>([
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchang": "y" }),
                "sink.exchang: unknown field `exchang`",
            ),
            (
                serde_json::json!({ "url": "amqp://h" }),
                "sink.exchange is missing",
            ),
            (
                serde_json::json!({ "exchange": "x" }),
                "sink.url is missing",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "publish_timeout": "soon" }),
                "sink.publish_timeout: ",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "unroutable": "drop" }),
                "sink.unroutable: unknown variant `drop`",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchange_setup": "create" }),
                "sink.exchange_setup: unknown variant `create`",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchange_kind": "topic" }),
                "sink.exchange_kind only applies",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "exchange_setup": "declare", "exchange_kind": " " }),
                "sink.exchange_kind is empty",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "routing_key": "" }),
                "sink.routing_key is empty",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "routing_key": "{topik}" }),
                "sink.routing_key: `{topik}` uses the unknown placeholder",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "routes": { "a": { "routing_key": "k" } } }),
                "sink.routes.a: missing field `exchange`",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "reconnect_backoff": { "max": "1ms" } }),
                "sink.reconnect_backoff.max must be at least initial",
            ),
            (
                serde_json::json!({ "url": "amqp://h", "exchange": "x", "reconnect_backoff": { "maximum": "1s" } }),
                "sink.reconnect_backoff: maximum: unknown field `maximum`",
            ),
            (
                serde_json::json!({ "url": "redis://h", "exchange": "x" }),
                "sink.url `redis://h` is not an AMQP URI",
            ),
        ]);
    }

    #[test]
    fn tls_files_need_an_amqps_url_exist_and_go_in_pairs() {
        // Any readable file passes validation; its content is checked when the sink is made.
        let readable = || Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
        let tls = || AmqpConfig {
            url: "amqps://guest:guest@127.0.0.1:5671/%2f".into(),
            ..config()
        };
        AmqpConfig {
            tls_ca_file: readable(),
            tls_cert_file: readable(),
            tls_key_file: readable(),
            ..tls()
        }
        .validate()
        .unwrap();
        for key in ["tls_ca_file", "tls_cert_file", "tls_key_file"] {
            let mut plain = config();
            match key {
                "tls_ca_file" => plain.tls_ca_file = readable(),
                "tls_cert_file" => plain.tls_cert_file = readable(),
                _ => plain.tls_key_file = readable(),
            }
            let message = error_of(plain);
            assert!(
                message.contains(&format!(
                    "sink.{key} needs a TLS connection: write the url as amqps://"
                )),
                "{message}"
            );
        }
        let message = error_of(AmqpConfig {
            tls_cert_file: readable(),
            ..tls()
        });
        assert!(
            message.contains("sink.tls_cert_file and tls_key_file go together"),
            "{message}"
        );
        let message = error_of(AmqpConfig {
            tls_key_file: readable(),
            ..tls()
        });
        assert!(message.contains("tls_key_file go together"), "{message}");
        let message = error_of(AmqpConfig {
            tls_ca_file: Some("/nowhere/ca.pem".into()),
            ..tls()
        });
        assert!(
            message.contains("sink.tls_ca_file `/nowhere/ca.pem` cannot be read"),
            "{message}"
        );
        let config = AmqpConfig::from_value(serde_json::json!({
            "url": "amqps://relay:pw@rabbit/%2f",
            "exchange": "events",
            "tls_ca_file": readable(),
        }))
        .unwrap();
        assert_eq!(config.tls_ca_file, readable());
        let error = AmqpConfig::from_value(serde_json::json!({
            "url": "amqps://relay:pw@rabbit/%2f",
            "exchange": "events",
            "tls_ca": "/etc/ca.pem",
        }))
        .unwrap_err()
        .in_section("sink")
        .to_string();
        assert!(error.contains("sink.tls_ca: unknown field"), "{error}");
    }

    #[test]
    fn timeouts_and_backoff_are_checked() {
        let message = error_of(AmqpConfig {
            publish_timeout: Duration::ZERO,
            ..config()
        });
        assert!(message.contains("sink.publish_timeout is 0"), "{message}");
        let mut bad = config();
        bad.reconnect_backoff.multiplier = 0.0;
        let message = error_of(bad);
        assert!(
            message.contains("sink.reconnect_backoff.multiplier"),
            "{message}"
        );
    }
}
