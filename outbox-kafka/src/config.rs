//! Settings of the Kafka sink: the `[sink]` table of the relay's configuration and the Rust
//! API alike.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Error, Result, Template};
use rdkafka::ClientConfig;
use serde::Deserialize;

/// librdkafka properties this sink sets itself; each has a field of [`KafkaConfig`] instead.
const OWNED_PROPERTIES: &[(&str, &str)] = &[
    ("bootstrap.servers", "bootstrap_servers"),
    ("metadata.broker.list", "bootstrap_servers"),
    ("message.timeout.ms", "publish_timeout"),
    ("delivery.timeout.ms", "publish_timeout"),
];

/// Each `tls_*` key and the librdkafka property it sets.
const TLS_PROPERTIES: [(&str, &str); 3] = [
    ("tls_ca_file", "ssl.ca.location"),
    ("tls_cert_file", "ssl.certificate.location"),
    ("tls_key_file", "ssl.key.location"),
];

/// What to do about a build without TLS support.
const BUILD_WITH_SSL: &str = "this build has no TLS for Kafka: rebuild with cargo feature `kafka-ssl` of the outbox facade (outbox-kafka's `ssl`), e.g. `cargo build --release --features kafka-ssl`";

/// Settings of the Kafka sink: the `[sink]` table of the relay's configuration (with
/// `type = "kafka"`; durations written as `"5s"` or `"500ms"`, unknown keys refused) and the
/// Rust API alike. Every key but `bootstrap_servers` has a default. `Debug` hides the values
/// of secret properties (`sasl.password`, `ssl.key.password`, ...).
///
/// TLS (`tls_ca_file`, `tls_cert_file` and `tls_key_file`, or `security.protocol` `ssl` or
/// `sasl_ssl` in `properties`) needs the crate's `ssl` feature (the facade's `kafka-ssl`);
/// without it such settings are refused by [`validate`](Self::validate).
///
/// ```toml
/// [sink]
/// type = "kafka"
/// bootstrap_servers = "kafka-1:9092,kafka-2:9092"
/// topic_template = "outbox.{topic}"
/// topics = { "orders.paid" = "orders" }
/// publish_timeout = "10s"
/// health_timeout = "5s"
/// properties = { "compression.type" = "lz4" }
/// ```
#[derive(Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// Comma-separated `host:port` list of brokers to bootstrap from
    /// (librdkafka's `bootstrap.servers`), e.g. `127.0.0.1:9092` (required).
    pub bootstrap_servers: String,
    /// Kafka topic for an outbox topic that [`topics`](Self::topics) does not name:
    /// `{topic}` is replaced by the outbox topic (default `{topic}`, the same name; `{key}`
    /// is refused).
    pub topic_template: Template,
    /// Kafka topic for each named outbox topic; wins over the template.
    pub topics: BTreeMap<String, String>,
    /// librdkafka properties passed through as they are (`security.protocol`, `sasl.*`,
    /// `ssl.*`, `linger.ms`, `compression.type`, `client.id`, ...). They override this
    /// sink's defaults (`enable.idempotence=true`, `acks=all`,
    /// `max.in.flight.requests.per.connection=5`, `partitioner=murmur2_random`,
    /// `client.id=outbox`).
    pub properties: BTreeMap<String, String>,
    /// How long librdkafka may try to deliver a message before reporting a time-out
    /// (its `message.timeout.ms`; default 10 s). A publish waits at most this long plus a
    /// few seconds, so the worker's lease must be longer.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
    /// Time-out of the health check's metadata request (default 5 s).
    #[serde(with = "humantime_serde")]
    pub health_timeout: Duration,
    /// A PEM file of the certificate authorities that sign the brokers' certificates,
    /// trusted instead of the system's roots (librdkafka's `ssl.ca.location`; default none).
    /// Any `tls_*` key turns TLS on: `security.protocol` becomes `ssl` unless `properties`
    /// set it to `sasl_ssl`.
    pub tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate for brokers that verify clients (`ssl.client.auth`), with
    /// [`tls_key_file`](Self::tls_key_file) (librdkafka's `ssl.certificate.location`;
    /// default none).
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of [`tls_cert_file`](Self::tls_cert_file) (librdkafka's
    /// `ssl.key.location`; an encrypted key's passphrase goes in `properties` as
    /// `ssl.key.password`; default none).
    pub tls_key_file: Option<PathBuf>,
}

impl Default for KafkaConfig {
    /// The defaults, with no brokers (which [`KafkaConfig::validate`] refuses).
    fn default() -> Self {
        KafkaConfig {
            bootstrap_servers: String::new(),
            topic_template: Template::topic(),
            topics: BTreeMap::new(),
            properties: BTreeMap::new(),
            publish_timeout: Duration::from_secs(10),
            health_timeout: Duration::from_secs(5),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

outbox_core::debug_fields!(KafkaConfig, |config| {
    bootstrap_servers, topic_template, topics,
    properties: shown_properties(&config.properties),
    publish_timeout, health_timeout, tls_ca_file, tls_cert_file, tls_key_file,
});

/// `properties` with the value of each secret one ([`is_secret_property`]) hidden.
fn shown_properties(properties: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    (properties.iter())
        .map(|(k, v)| {
            let shown = if is_secret_property(k) {
                "***"
            } else {
                v.as_str()
            };
            (k.as_str(), shown)
        })
        .collect()
}

impl Settings for KafkaConfig {
    /// Checks every setting; the error is keyed by the bad one, relative to the sink's
    /// section. librdkafka checks the passed-through properties when the sink is made
    /// ([`KafkaSink::new`](crate::KafkaSink::new)).
    fn validate(&self) -> Result<()> {
        if self.bootstrap_servers.trim().is_empty() {
            return Err(Error::setting(
                "bootstrap_servers",
                "is missing: give the brokers as host:port[,host:port...], e.g. 127.0.0.1:9092",
            ));
        }
        for server in self.bootstrap_servers.split(',').map(str::trim) {
            if server.contains("://") {
                return Err(Error::setting(
                    "bootstrap_servers",
                    format!(
                        "entry `{server}` has a URL scheme; give host:port (set security.protocol in properties for TLS or SASL)"
                    ),
                ));
            }
            let port_ok = server.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !port_ok {
                return Err(Error::setting(
                    "bootstrap_servers",
                    format!("entry `{server}` is not host:port, e.g. 127.0.0.1:9092"),
                ));
            }
        }

        self.topic_template.refuse_key("topic_template")?;
        if self.topic_template.as_str().trim().is_empty() {
            return Err(Error::setting(
                "topic_template",
                "is empty; use {topic} for the outbox topic's own name",
            ));
        }
        // Check the fixed part of the template with a sample outbox topic.
        if let Err(why) = check_topic_name(&self.topic_template.render("t", "")) {
            return Err(Error::setting(
                "topic_template",
                format!(
                    "`{}` cannot make a Kafka topic name: {why}",
                    self.topic_template
                ),
            ));
        }
        for (outbox_topic, kafka_topic) in &self.topics {
            if let Err(why) = check_topic_name(kafka_topic) {
                return Err(Error::setting(
                    format!("topics.{outbox_topic}"),
                    format!("is `{kafka_topic}`, which is not a Kafka topic name: {why}"),
                ));
            }
        }

        outbox_core::config::check_publish_timeout(self.publish_timeout, Duration::from_secs(1))?;
        outbox_core::config::check_not_zero("health_timeout", self.health_timeout)?;

        for (name, field) in OWNED_PROPERTIES {
            if self.properties.contains_key(*name) {
                return Err(Error::setting(
                    format!("properties.{name}"),
                    format!("is set by the sink; use {field} instead"),
                ));
            }
        }
        if self.properties.contains_key("transactional.id") {
            return Err(Error::setting(
                "properties.transactional.id",
                "is set, but this sink uses no Kafka transactions (it is at-least-once with an idempotent producer); remove the property",
            ));
        }
        for name in ["acks", "request.required.acks"] {
            if self.properties.get(name).map(|v| v.trim()) == Some("0") {
                return Err(Error::setting(
                    format!("properties.{name}"),
                    "is 0: the broker would confirm nothing and messages could be lost; use all (the default) or 1",
                ));
            }
        }
        let idempotent = self
            .properties
            .get("enable.idempotence")
            .is_none_or(|v| v.trim().eq_ignore_ascii_case("true"));
        if !idempotent {
            let in_flight = self
                .properties
                .get("max.in.flight.requests.per.connection")
                .or_else(|| self.properties.get("max.in.flight"))
                .map(|v| v.trim());
            if in_flight != Some("1") {
                return Err(Error::setting(
                    "properties.enable.idempotence",
                    "is false, so internal retries could reorder a key's messages; also set max.in.flight.requests.per.connection to 1, or keep idempotence on",
                ));
            }
        }
        self.check_tls(cfg!(feature = "ssl"))
    }
}

impl KafkaConfig {
    /// Defaults for the brokers at `bootstrap_servers` (`host:port[,host:port...]`).
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            ..Self::default()
        }
    }

    /// Sends messages of `outbox_topic` to `kafka_topic`.
    pub fn topic(
        mut self,
        outbox_topic: impl Into<String>,
        kafka_topic: impl Into<String>,
    ) -> Self {
        self.topics.insert(outbox_topic.into(), kafka_topic.into());
        self
    }

    /// Sets a librdkafka property, e.g. `("compression.type", "lz4")`.
    pub fn property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(name.into(), value.into());
        self
    }

    /// The `tls_*` keys with their librdkafka property and their file, when set.
    fn tls_files(&self) -> impl Iterator<Item = (&'static str, &'static str, &Path)> {
        let files = [&self.tls_ca_file, &self.tls_cert_file, &self.tls_key_file];
        TLS_PROPERTIES
            .into_iter()
            .zip(files)
            .filter_map(|((key, property), file)| Some((key, property, file.as_deref()?)))
    }

    /// `security.protocol` from `properties`, in lower case.
    fn security_protocol(&self) -> Option<String> {
        let protocol = self.properties.get("security.protocol")?;
        Some(protocol.trim().to_ascii_lowercase())
    }

    /// Checks the TLS settings, for a build with (`ssl_built`) or without TLS support.
    fn check_tls(&self, ssl_built: bool) -> Result<()> {
        let protocol = self.security_protocol();
        let tls_protocol = matches!(protocol.as_deref(), Some("ssl" | "sasl_ssl"));
        if !ssl_built {
            if let Some((key, _, _)) = self.tls_files().next() {
                return Err(Error::setting(
                    key,
                    format!("needs TLS, but {BUILD_WITH_SSL}"),
                ));
            }
            if tls_protocol {
                return Err(Error::setting(
                    "properties.security.protocol",
                    format!(
                        "is {}, which needs TLS, but {BUILD_WITH_SSL}",
                        protocol.unwrap_or_default()
                    ),
                ));
            }
            for name in ["sasl.mechanism", "sasl.mechanisms"] {
                if let Some(mechanism) = self.properties.get(name)
                    && mechanism.trim().to_ascii_uppercase().starts_with("SCRAM")
                {
                    return Err(Error::setting(
                        format!("properties.{name}"),
                        format!(
                            "is {}, which needs OpenSSL, but {BUILD_WITH_SSL}",
                            mechanism.trim()
                        ),
                    ));
                }
            }
            if let Some(name) = self.properties.keys().find(|n| n.starts_with("ssl.")) {
                return Err(Error::setting(
                    format!("properties.{name}"),
                    format!("is a TLS setting, but {BUILD_WITH_SSL}"),
                ));
            }
        }
        for (key, property, file) in self.tls_files() {
            if self.properties.contains_key(property) {
                return Err(Error::setting(
                    key,
                    format!("and properties.{property} both name the file; keep {key} only"),
                ));
            }
            if let Some(other) = protocol.as_deref().filter(|_| !tls_protocol) {
                return Err(Error::setting(
                    key,
                    format!(
                        "needs TLS, but properties.security.protocol is {other}: set it to ssl (or sasl_ssl for SASL over TLS), or leave it out (the tls_* keys imply ssl)"
                    ),
                ));
            }
            if file.to_str().is_none() {
                return Err(Error::setting(
                    key,
                    format!(
                        "`{}` is not valid UTF-8, which librdkafka needs; rename the file",
                        file.display()
                    ),
                ));
            }
        }
        outbox_core::config::check_tls_files(
            self.tls_ca_file.as_deref(),
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
        )?;
        Ok(())
    }

    /// The `tls_*` key of the librdkafka property `name` that it sets, when it is set.
    pub(crate) fn tls_key_of(&self, name: &str) -> Option<&'static str> {
        self.tls_files()
            .find(|(_, property, _)| *property == name)
            .map(|(key, _, _)| key)
    }

    /// The Kafka topic for an outbox topic: its entry in [`topics`](Self::topics), or the
    /// template filled in. Errors (permanent) when the result is not a legal topic name.
    pub fn kafka_topic(&self, outbox_topic: &str) -> Result<String> {
        if let Some(topic) = self.topics.get(outbox_topic) {
            return Ok(topic.clone());
        }
        let topic = self.topic_template.render(outbox_topic, "");
        check_topic_name(&topic)
            .map_err(|why| crate::error::illegal_topic(outbox_topic, &topic, &why))?;
        Ok(topic)
    }

    /// The librdkafka configuration: this sink's defaults, then the passed-through properties.
    pub(crate) fn client_config(&self) -> ClientConfig {
        let timeout_ms = self.publish_timeout.as_millis();
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", self.bootstrap_servers.trim())
            .set("client.id", "outbox")
            // Idempotence keeps each partition in order across librdkafka's own retries
            // with up to 5 requests in flight, and writes no duplicates for them.
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("max.in.flight.requests.per.connection", "5")
            .set("message.timeout.ms", timeout_ms.to_string())
            // The Java client's key hash, so a key lands on the same partition whichever
            // client wrote it (librdkafka's own default hashes with CRC32).
            .set("partitioner", "murmur2_random")
            // The worker hands over a whole round at once and waits for its reports, so the
            // batch is already formed: librdkafka's 5 ms default wait for more messages would
            // be paid once per round (with per-key order, as many rounds per claim as it holds messages of one key).
            .set("linger.ms", "1")
            // Fail messages for a missing topic well before the delivery time-out, so they
            // are dead-lettered as "unknown topic" rather than retried as time-outs.
            .set(
                "topic.metadata.propagation.max.ms",
                (timeout_ms / 2).min(5_000).to_string(),
            );
        let mut tls = false;
        for (_, property, file) in self.tls_files() {
            config.set(property, file.to_string_lossy());
            tls = true;
        }
        if tls && self.security_protocol().is_none() {
            config.set("security.protocol", "ssl");
        }
        for (name, value) in &self.properties {
            config.set(name.trim(), value.trim());
        }
        config
    }
}

outbox_core::setters!(KafkaConfig {
    /// Sets the topic template, e.g. `outbox.{topic}` (`"outbox.{topic}".parse()?` or
    /// [`Template::new`] makes it).
    topic_template(template: Template) => topic_template = template;
    /// Sets the longest wait for a message's delivery report (librdkafka's
    /// `message.timeout.ms`).
    publish_timeout(timeout: Duration) => publish_timeout = timeout;
});

/// Whether a librdkafka property holds a secret that must not be logged.
pub(crate) fn is_secret_property(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "password",
        "secret",
        "passphrase",
        "private.key",
        "ssl.key.pem",
        "sasl.oauthbearer.config",
    ]
    .iter()
    .any(|s| name.contains(s))
}

/// Kafka's rule for topic names: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
fn check_topic_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("it is empty".into());
    }
    if name.len() > 249 {
        return Err(format!(
            "it is {} characters long; Kafka allows 249",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return Err("`.` and `..` are reserved".into());
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "`{c}` is not allowed (only letters, digits, `.`, `_`, `-`)"
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

    /// The `Config` error of a check that refused the config (`validate`, `check_tls`),
    /// placed in the `sink` section as the relay does.
    fn refused(checked: Result<()>) -> String {
        let err = checked.expect_err("config should be refused");
        assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
        err.in_section("sink").to_string()
    }

    #[test]
    fn defaults_are_valid_and_idempotent() {
        let config = KafkaConfig::new("127.0.0.1:9092, kafka-2:9093");
        config.validate().unwrap();
        let client = config.client_config();
        assert_eq!(client.get("enable.idempotence"), Some("true"));
        assert_eq!(client.get("acks"), Some("all"));
        assert_eq!(
            client.get("max.in.flight.requests.per.connection"),
            Some("5")
        );
        assert_eq!(client.get("message.timeout.ms"), Some("10000"));
        assert_eq!(
            client.get("topic.metadata.propagation.max.ms"),
            Some("5000")
        );
    }

    #[test]
    fn properties_override_defaults() {
        let config = KafkaConfig::new("k:9092")
            .property("linger.ms", "20")
            .property("client.id", "billing-relay");
        config.validate().unwrap();
        let client = config.client_config();
        assert_eq!(client.get("linger.ms"), Some("20"));
        assert_eq!(client.get("client.id"), Some("billing-relay"));
    }

    #[test]
    fn bad_settings_name_their_key() {
        let ok = || KafkaConfig::new("k:1");
        let property = |name: &str, value: &str| ok().property(name, value);
        for (config, expected) in [
            (KafkaConfig::new(" "), "sink.bootstrap_servers is missing"),
            (KafkaConfig::new("kafka://k:9092"), "URL scheme"),
            (
                KafkaConfig::new("k"),
                "sink.bootstrap_servers entry `k` is not host:port",
            ),
            (KafkaConfig::new("k:0"), "not host:port"),
            (
                ok().topic_template(template("")),
                "sink.topic_template is empty",
            ),
            (
                ok().topic_template(template("out box.{topic}")),
                "sink.topic_template `out box.{topic}`",
            ),
            (
                ok().topic_template(template("{topic}.{key}")),
                "sink.topic_template `{topic}.{key}` uses {key}",
            ),
            (ok().topic("orders", "a/b"), "sink.topics.orders is `a/b`"),
            (
                KafkaConfig {
                    publish_timeout: Duration::from_millis(10),
                    ..ok()
                },
                "sink.publish_timeout is 10ms",
            ),
            (
                KafkaConfig {
                    health_timeout: Duration::ZERO,
                    ..ok()
                },
                "sink.health_timeout is 0",
            ),
            (
                property("bootstrap.servers", "x:1"),
                "sink.properties.bootstrap.servers is set by the sink; use bootstrap_servers",
            ),
            (property("message.timeout.ms", "5"), "use publish_timeout"),
            (
                property("transactional.id", "t"),
                "sink.properties.transactional.id",
            ),
            (property("acks", "0"), "sink.properties.acks is 0"),
            (
                property("enable.idempotence", "false"),
                "max.in.flight.requests.per.connection to 1",
            ),
        ] {
            let message = refused(config.validate());
            assert!(message.contains(expected), "{expected}: {message}");
        }
        KafkaConfig::new("k:1")
            .property("enable.idempotence", "false")
            .property("max.in.flight.requests.per.connection", "1")
            .validate()
            .unwrap();
    }

    #[test]
    fn reads_the_configuration_file_table_and_names_bad_keys() {
        let config = KafkaConfig::from_value(serde_json::json!({
            "bootstrap_servers": "k:9092",
            "topic_template": "outbox.{topic}",
            "topics": { "orders": "orders-v2" },
            "properties": { "linger.ms": "5" },
            "publish_timeout": "3s",
        }))
        .unwrap();
        let expected = KafkaConfig::new("k:9092")
            .topic_template(template("outbox.{topic}"))
            .topic("orders", "orders-v2")
            .property("linger.ms", "5")
            .publish_timeout(Duration::from_secs(3));
        assert_eq!(config, expected);
        let minimal = KafkaConfig::from_value(serde_json::json!({ "bootstrap_servers": "k:1" }));
        assert_eq!(minimal.unwrap(), KafkaConfig::new("k:1"));
        outbox_testkit::check_sink_settings_refused::<KafkaConfig>([
            (serde_json::json!({}), "sink.bootstrap_servers is missing"),
            (
                serde_json::json!({ "bootstrap_servers": "k:1", "delivery_timeout": "5s" }),
                "sink.delivery_timeout: unknown field `delivery_timeout`",
            ),
            (
                serde_json::json!({ "bootstrap_servers": "k:1", "publish_timeout": "soon" }),
                "sink.publish_timeout: ",
            ),
            (
                serde_json::json!({ "bootstrap_servers": "k:1", "topic_template": "a.{topc}" }),
                "sink.topic_template: `a.{topc}` uses the unknown placeholder",
            ),
            (
                serde_json::json!({ "bootstrap_servers": "k:1", "properties": { "linger.ms": 5 } }),
                "sink.properties.linger.ms: invalid type",
            ),
        ]);
    }

    #[test]
    fn topics_map_then_template() {
        let config = KafkaConfig::new("k:1")
            .topic_template(template("outbox.{topic}"))
            .topic("orders", "orders-v2");
        assert_eq!(config.kafka_topic("orders").unwrap(), "orders-v2");
        assert_eq!(config.kafka_topic("users").unwrap(), "outbox.users");
        let err = config.kafka_topic("bad topic").unwrap_err();
        assert_eq!(err.kind(), outbox_core::ErrorKind::Permanent);
        assert!(err.to_string().contains("`outbox.bad topic`"), "{err}");
    }

    /// A file that exists, for the TLS keys.
    fn readable() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")
    }

    #[test]
    fn tls_files_turn_tls_on_and_sasl_ssl_stays() {
        let config = KafkaConfig {
            tls_ca_file: Some(readable()),
            tls_cert_file: Some(readable()),
            tls_key_file: Some(readable()),
            ..KafkaConfig::new("k:9093")
        };
        config.check_tls(true).unwrap();
        let client = config.client_config();
        let path = readable().display().to_string();
        assert_eq!(client.get("security.protocol"), Some("ssl"));
        assert_eq!(client.get("ssl.ca.location"), Some(path.as_str()));
        assert_eq!(client.get("ssl.certificate.location"), Some(path.as_str()));
        assert_eq!(client.get("ssl.key.location"), Some(path.as_str()));
        let sasl = config
            .property("security.protocol", "SASL_SSL")
            .property("sasl.mechanism", "SCRAM-SHA-512");
        sasl.check_tls(true).unwrap();
        assert_eq!(
            sasl.client_config().get("security.protocol"),
            Some("SASL_SSL")
        );
        // No TLS keys: nothing TLS is set.
        let plain = KafkaConfig::new("k:9092").client_config();
        assert_eq!(plain.get("security.protocol"), None);
        assert_eq!(plain.get("ssl.ca.location"), None);
    }

    #[test]
    fn tls_settings_are_checked() {
        let ca_only = KafkaConfig {
            tls_ca_file: Some(readable()),
            ..KafkaConfig::new("k:9093")
        };
        ca_only.check_tls(true).unwrap();
        let half = KafkaConfig {
            tls_cert_file: Some(readable()),
            ..KafkaConfig::new("k:9093")
        };
        assert!(
            refused(half.check_tls(true))
                .contains("sink.tls_cert_file and tls_key_file go together"),
        );
        let missing = KafkaConfig {
            tls_ca_file: Some("/nowhere/ca.pem".into()),
            ..KafkaConfig::new("k:9093")
        };
        assert!(
            refused(missing.check_tls(true))
                .contains("sink.tls_ca_file `/nowhere/ca.pem` cannot be read"),
        );
        let plaintext = ca_only.clone().property("security.protocol", "plaintext");
        assert!(
            refused(plaintext.check_tls(true)).contains(
                "sink.tls_ca_file needs TLS, but properties.security.protocol is plaintext: set it to ssl"
            ),
        );
        let sasl_plaintext = ca_only
            .clone()
            .property("security.protocol", "SASL_PLAINTEXT");
        assert!(refused(sasl_plaintext.check_tls(true)).contains("is sasl_plaintext"));
        let twice = ca_only
            .clone()
            .property("ssl.ca.location", "/etc/ssl/ca.pem");
        assert!(
            refused(twice.check_tls(true)).contains(
                "sink.tls_ca_file and properties.ssl.ca.location both name the file; keep tls_ca_file only"
            ),
        );
        // The properties alone are librdkafka's to check.
        KafkaConfig::new("k:9093")
            .property("security.protocol", "ssl")
            .property("ssl.ca.location", "/etc/ssl/ca.pem")
            .check_tls(true)
            .unwrap();
    }

    #[test]
    fn tls_without_the_ssl_feature_says_how_to_build() {
        let ca = KafkaConfig {
            tls_ca_file: Some(readable()),
            ..KafkaConfig::new("k:9093")
        };
        let error = refused(ca.check_tls(false));
        assert!(
            error.contains("sink.tls_ca_file needs TLS, but this build has no TLS for Kafka")
                && error.contains("rebuild with cargo feature `kafka-ssl`"),
            "{error}"
        );
        let sasl_ssl = KafkaConfig::new("k:9093").property("security.protocol", "SASL_SSL");
        let error = refused(sasl_ssl.check_tls(false));
        assert!(
            error.contains("sink.properties.security.protocol is sasl_ssl, which needs TLS")
                && error.contains("kafka-ssl"),
            "{error}"
        );
        let scram = KafkaConfig::new("k:9093")
            .property("security.protocol", "sasl_plaintext")
            .property("sasl.mechanisms", "SCRAM-SHA-256");
        assert!(
            refused(scram.check_tls(false))
                .contains("sink.properties.sasl.mechanisms is SCRAM-SHA-256, which needs OpenSSL")
        );
        let ssl_property = KafkaConfig::new("k:9093").property("ssl.ca.location", "/ca.pem");
        assert!(
            refused(ssl_property.check_tls(false))
                .contains("sink.properties.ssl.ca.location is a TLS setting")
        );
        // SASL PLAIN without TLS needs no OpenSSL.
        KafkaConfig::new("k:9092")
            .property("security.protocol", "sasl_plaintext")
            .property("sasl.mechanism", "PLAIN")
            .check_tls(false)
            .unwrap();
        // validate() checks for the build it is in.
        assert_eq!(ca.validate().is_ok(), cfg!(feature = "ssl"));
    }

    #[test]
    fn reads_the_tls_keys_from_the_table() {
        let path = readable().display().to_string();
        let config = KafkaConfig::from_value(serde_json::json!({
            "bootstrap_servers": "k:9093",
            "tls_ca_file": path,
            "tls_cert_file": path,
            "tls_key_file": path,
        }));
        if cfg!(feature = "ssl") {
            let config = config.unwrap();
            assert_eq!(config.tls_ca_file, Some(readable()));
            assert_eq!(config.tls_key_of("ssl.key.location"), Some("tls_key_file"));
        } else {
            let error = config.unwrap_err().in_section("sink").to_string();
            assert!(error.contains("kafka-ssl"), "{error}");
        }
    }

    #[test]
    fn debug_hides_secrets() {
        let config = KafkaConfig::new("k:1")
            .property("sasl.username", "relay")
            .property("sasl.password", "hunter2")
            .property("ssl.key.password", "hunter3");
        let shown = format!("{config:?}");
        assert!(shown.contains("relay"), "{shown}");
        assert!(!shown.contains("hunter"), "{shown}");
    }
}
