//! Settings of the Kafka sink.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::{Error, Result};
use rdkafka::ClientConfig;

/// The placeholder in [`KafkaConfig::topic_template`] that stands for the outbox topic.
pub const TOPIC_PLACEHOLDER: &str = "{topic}";

/// librdkafka properties this sink sets itself; each has a field of [`KafkaConfig`] instead.
const OWNED_PROPERTIES: &[(&str, &str)] = &[
    ("bootstrap.servers", "sink.bootstrap_servers"),
    ("metadata.broker.list", "sink.bootstrap_servers"),
    ("message.timeout.ms", "sink.delivery_timeout"),
    ("delivery.timeout.ms", "sink.delivery_timeout"),
];

/// Settings of the Kafka sink. `Debug` hides the values of secret properties
/// (`sasl.password`, `ssl.key.password`, ...).
#[derive(Clone, PartialEq)]
pub struct KafkaConfig {
    /// Comma-separated `host:port` list of brokers to bootstrap from
    /// (librdkafka's `bootstrap.servers`), e.g. `127.0.0.1:9092`.
    pub bootstrap_servers: String,
    /// Kafka topic for an outbox topic that [`topics`](Self::topics) does not name:
    /// `{topic}` is replaced by the outbox topic (default `{topic}`, the same name).
    pub topic_template: String,
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
    pub delivery_timeout: Duration,
    /// Time-out of the health check's metadata request (default 5 s).
    pub health_timeout: Duration,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let shown = if is_secret_property(k) {
                    "***"
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("topic_template", &self.topic_template)
            .field("topics", &self.topics)
            .field("properties", &properties)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("health_timeout", &self.health_timeout)
            .finish()
    }
}

impl KafkaConfig {
    /// Defaults for the brokers at `bootstrap_servers` (`host:port[,host:port...]`).
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            topic_template: TOPIC_PLACEHOLDER.into(),
            topics: BTreeMap::new(),
            properties: BTreeMap::new(),
            delivery_timeout: Duration::from_secs(10),
            health_timeout: Duration::from_secs(5),
        }
    }

    /// Sets the topic template (`{topic}` stands for the outbox topic), e.g. `outbox.{topic}`.
    pub fn topic_template(mut self, template: impl Into<String>) -> Self {
        self.topic_template = template.into();
        self
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

    /// Checks every setting; the error names the bad one. librdkafka checks the passed-through
    /// properties when the sink is made ([`KafkaSink::new`](crate::KafkaSink::new)).
    pub fn validate(&self) -> Result<()> {
        let servers: Vec<&str> = self.bootstrap_servers.split(',').map(str::trim).collect();
        if servers.iter().all(|s| s.is_empty()) {
            return Err(Error::config(
                "sink.bootstrap_servers is empty; give the brokers as host:port[,host:port...], e.g. 127.0.0.1:9092",
            ));
        }
        for server in &servers {
            if server.contains("://") {
                return Err(Error::config(format!(
                    "sink.bootstrap_servers entry `{server}` has a URL scheme; give host:port (set security.protocol in sink.properties for TLS or SASL)"
                )));
            }
            let port_ok = server.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !port_ok {
                return Err(Error::config(format!(
                    "sink.bootstrap_servers entry `{server}` is not host:port, e.g. 127.0.0.1:9092"
                )));
            }
        }

        if self.topic_template.trim().is_empty() {
            return Err(Error::config(
                "sink.topic_template is empty; use {topic} for the outbox topic's own name",
            ));
        }
        // Check the fixed part of the template with a sample outbox topic.
        let sample = self.topic_template.replace(TOPIC_PLACEHOLDER, "t");
        if let Err(why) = check_topic_name(&sample) {
            return Err(Error::config(format!(
                "sink.topic_template `{}` cannot make a Kafka topic name: {why}",
                self.topic_template
            )));
        }
        for (outbox_topic, kafka_topic) in &self.topics {
            if let Err(why) = check_topic_name(kafka_topic) {
                return Err(Error::config(format!(
                    "sink.topics: outbox topic `{outbox_topic}` maps to `{kafka_topic}`, which is not a Kafka topic name: {why}"
                )));
            }
        }

        if self.delivery_timeout < Duration::from_secs(1) {
            return Err(Error::config(format!(
                "sink.delivery_timeout is {:?}; it must be at least 1 s (and shorter than the worker's lease)",
                self.delivery_timeout
            )));
        }
        if self.health_timeout.is_zero() {
            return Err(Error::config(
                "sink.health_timeout is 0; it must be greater than zero",
            ));
        }

        for (name, field) in OWNED_PROPERTIES {
            if self.properties.contains_key(*name) {
                return Err(Error::config(format!(
                    "sink.properties.{name} is set by the sink; use {field} instead"
                )));
            }
        }
        if self.properties.contains_key("transactional.id") {
            return Err(Error::config(
                "sink.properties.transactional.id: Kafka transactions are not used by this sink (it is at-least-once with an idempotent producer); remove the property",
            ));
        }
        if self.properties.get("acks").map(|v| v.trim()) == Some("0")
            || self
                .properties
                .get("request.required.acks")
                .map(|v| v.trim())
                == Some("0")
        {
            return Err(Error::config(
                "sink.properties.acks is 0: the broker would confirm nothing and messages could be lost; use all (the default) or 1",
            ));
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
                return Err(Error::config(
                    "sink.properties.enable.idempotence is false, so internal retries could reorder a key's messages; also set max.in.flight.requests.per.connection to 1, or keep idempotence on",
                ));
            }
        }
        Ok(())
    }

    /// The Kafka topic for an outbox topic: its entry in [`topics`](Self::topics), or the
    /// template filled in. Errors (permanent) when the result is not a legal topic name.
    pub fn kafka_topic(&self, outbox_topic: &str) -> Result<String> {
        if let Some(topic) = self.topics.get(outbox_topic) {
            return Ok(topic.clone());
        }
        let topic = self.topic_template.replace(TOPIC_PLACEHOLDER, outbox_topic);
        check_topic_name(&topic).map_err(|why| {
            Error::permanent(format!(
                "outbox topic `{outbox_topic}` maps to Kafka topic `{topic}` through sink.topic_template, which is not a legal name: {why}; map it in sink.topics"
            ))
        })?;
        Ok(topic)
    }

    /// The librdkafka configuration: this sink's defaults, then the passed-through properties.
    pub(crate) fn client_config(&self) -> ClientConfig {
        let timeout_ms = self.delivery_timeout.as_millis();
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
        for (name, value) in &self.properties {
            config.set(name.trim(), value.trim());
        }
        config
    }
}

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

    fn invalid(config: KafkaConfig) -> String {
        let err = config.validate().expect_err("config should be refused");
        assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
        err.to_string()
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
        assert!(invalid(KafkaConfig::new(" ")).contains("sink.bootstrap_servers is empty"));
        assert!(invalid(KafkaConfig::new("kafka://k:9092")).contains("URL scheme"));
        assert!(invalid(KafkaConfig::new("k")).contains("`k` is not host:port"));
        assert!(invalid(KafkaConfig::new("k:0")).contains("not host:port"));
        assert!(
            invalid(KafkaConfig::new("k:1").topic_template("")).contains("sink.topic_template")
        );
        assert!(
            invalid(KafkaConfig::new("k:1").topic_template("out box.{topic}"))
                .contains("sink.topic_template `out box.{topic}`")
        );
        assert!(invalid(KafkaConfig::new("k:1").topic("orders", "a/b")).contains("sink.topics"));
        let mut c = KafkaConfig::new("k:1");
        c.delivery_timeout = Duration::from_millis(10);
        assert!(invalid(c).contains("sink.delivery_timeout"));
        let mut c = KafkaConfig::new("k:1");
        c.health_timeout = Duration::ZERO;
        assert!(invalid(c).contains("sink.health_timeout"));
        assert!(
            invalid(KafkaConfig::new("k:1").property("bootstrap.servers", "x:1"))
                .contains("use sink.bootstrap_servers")
        );
        assert!(
            invalid(KafkaConfig::new("k:1").property("message.timeout.ms", "5"))
                .contains("use sink.delivery_timeout")
        );
        assert!(
            invalid(KafkaConfig::new("k:1").property("transactional.id", "t"))
                .contains("transactional.id")
        );
        assert!(invalid(KafkaConfig::new("k:1").property("acks", "0")).contains("acks is 0"));
        assert!(
            invalid(KafkaConfig::new("k:1").property("enable.idempotence", "false"))
                .contains("max.in.flight.requests.per.connection to 1")
        );
        KafkaConfig::new("k:1")
            .property("enable.idempotence", "false")
            .property("max.in.flight.requests.per.connection", "1")
            .validate()
            .unwrap();
    }

    #[test]
    fn topics_map_then_template() {
        let config = KafkaConfig::new("k:1")
            .topic_template("outbox.{topic}")
            .topic("orders", "orders-v2");
        assert_eq!(config.kafka_topic("orders").unwrap(), "orders-v2");
        assert_eq!(config.kafka_topic("users").unwrap(), "outbox.users");
        let err = config.kafka_topic("bad topic").unwrap_err();
        assert_eq!(err.kind(), outbox_core::ErrorKind::Permanent);
        assert!(err.to_string().contains("`outbox.bad topic`"), "{err}");
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

/// The keys of the `[sink]` table in the relay's configuration file (`type = "kafka"`);
/// each is the [`KafkaConfig`] field of the same name. Unknown keys are refused.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    bootstrap_servers: String,
    topic_template: Option<String>,
    #[serde(default)]
    topics: BTreeMap<String, String>,
    #[serde(default)]
    properties: BTreeMap<String, String>,
    #[serde(default, with = "humantime_serde")]
    delivery_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    health_timeout: Option<Duration>,
}

impl KafkaConfig {
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
            Error::config(format!("kafka sink configuration: {at}{}", e.inner()))
        })?;
        let mut config = KafkaConfig::new(file.bootstrap_servers);
        config.topic_template = file.topic_template.unwrap_or(config.topic_template);
        config.topics = file.topics;
        config.properties = file.properties;
        config.delivery_timeout = file.delivery_timeout.unwrap_or(config.delivery_timeout);
        config.health_timeout = file.health_timeout.unwrap_or(config.health_timeout);
        config.validate()?;
        Ok(config)
    }
}
