//! Every failure of the Kafka sink, mapped onto the engine's [`ErrorKind`]s.
//!
//! In short: brokers that cannot be reached or do not answer in time, and a cluster that
//! cannot take writes right now, are `Unavailable` (no attempt charged); a message the
//! cluster can never take as it is (too large, unknown or illegal topic, not authorised) is
//! `Permanent`; anything else is `Temporary`; settings librdkafka refuses are `Config`.

use std::time::Duration;

use outbox_core::{Error, ErrorKind};
use rdkafka::error::{KafkaError, RDKafkaErrorCode as Code};

use crate::KafkaConfig;

/// What kind of failure a librdkafka error code is for one message.
pub(crate) fn kind_of(code: Code) -> ErrorKind {
    match code {
        // The brokers cannot be reached or did not answer in time, or the cluster cannot
        // take writes right now: nothing is wrong with the message.
        Code::BrokerTransportFailure
        | Code::Resolve
        | Code::MessageTimedOut
        | Code::AllBrokersDown
        | Code::OperationTimedOut
        | Code::TimedOutQueue
        | Code::QueueFull
        | Code::BrokerDestroy
        | Code::DestroyBroker
        | Code::UnknownBroker
        | Code::PurgeQueue
        | Code::PurgeInflight
        | Code::Interrupted
        | Code::SSL
        | Code::Authentication
        | Code::SaslAuthenticationFailed
        | Code::ClusterAuthorizationFailed
        | Code::RequestTimedOut
        | Code::NetworkException
        | Code::LeaderNotAvailable
        | Code::NotLeaderForPartition
        | Code::BrokerNotAvailable
        | Code::ReplicaNotAvailable
        | Code::NotEnoughReplicas
        | Code::NotEnoughReplicasAfterAppend
        | Code::KafkaStorageError
        | Code::NotController
        | Code::FencedLeaderEpoch
        | Code::UnknownLeaderEpoch
        | Code::PreferredLeaderNotAvailable
        | Code::EligibleLeadersNotAvailable
        | Code::ThrottlingQuotaExceeded => ErrorKind::Unavailable,
        // This message can never be written as it is: dead-letter it with the reason.
        Code::MessageSizeTooLarge
        | Code::InvalidMessageSize
        | Code::MessageBatchTooLarge
        | Code::UnknownTopicOrPartition
        | Code::UnknownTopic
        | Code::UnknownPartition
        | Code::UnknownTopicId
        | Code::InvalidTopic
        | Code::TopicAuthorizationFailed
        | Code::InvalidRecord
        | Code::InvalidTimestamp
        | Code::PolicyViolation
        | Code::UnsupportedForMessageFormat
        | Code::BadMessage
        | Code::InvalidArgument => ErrorKind::Permanent,
        // Anything else (corrupt request, producer fenced or fatal, unexpected codes)
        // may pass on another attempt: charge it and retry with backoff.
        _ => ErrorKind::Temporary,
    }
}

/// `message`, then librdkafka's last broker error when there is one: why the brokers could
/// not be reached (a refused TLS handshake, a failed SASL authentication, a refused
/// connection), which librdkafka reports apart from the failed call.
fn with_broker_error(message: String, broker_error: Option<&str>) -> String {
    match broker_error {
        Some(reason) => format!("{message}; librdkafka's last broker error: {reason}"),
        None => message,
    }
}

/// The engine's error for a message that librdkafka did not deliver to `topic`;
/// `broker_error` is librdkafka's last broker error, told when the brokers are unavailable.
pub(crate) fn delivery_error(
    error: KafkaError,
    topic: &str,
    servers: &str,
    broker_error: Option<&str>,
) -> Error {
    let Some(code) = error.rdkafka_error_code() else {
        return Error::temporary(format!("Kafka topic `{topic}`: delivery failed"))
            .with_source(error);
    };
    let kind = kind_of(code);
    let message = match kind {
        ErrorKind::Unavailable => with_broker_error(
            format!("Kafka at {servers} did not take the message for topic `{topic}` ({code:?})"),
            broker_error,
        ),
        ErrorKind::Permanent => {
            format!("Kafka refused the message for topic `{topic}` for good ({code:?})")
        }
        _ => format!("Kafka did not take the message for topic `{topic}` ({code:?})"),
    };
    Error::new(kind, message).with_source(error)
}

/// An outbox topic whose Kafka topic (through the template) is not a legal name: that
/// message is permanent.
pub(crate) fn illegal_topic(outbox_topic: &str, topic: &str, why: &str) -> Error {
    Error::permanent(format!(
        "outbox topic `{outbox_topic}` maps to Kafka topic `{topic}` through sink.topic_template, which is not a legal name: {why}; map it in sink.topics"
    ))
}

/// No delivery report within `waited`: unavailable (the producer is replaced).
pub(crate) fn no_report(
    topic: &str,
    servers: &str,
    waited: Duration,
    broker_error: Option<&str>,
) -> Error {
    Error::unavailable(with_broker_error(
        format!("no delivery report from Kafka at {servers} within {waited:?} for topic `{topic}`"),
        broker_error,
    ))
}

/// The producer went away before reporting on a message: unavailable.
pub(crate) fn producer_closed(topic: &str) -> Error {
    Error::unavailable(format!(
        "the Kafka producer closed before reporting on the message for topic `{topic}`"
    ))
}

/// The health check's metadata request failed or took longer than `waited`: unavailable.
pub(crate) fn health_failed(
    servers: &str,
    waited: Duration,
    code: Code,
    broker_error: Option<&str>,
) -> Error {
    Error::unavailable(with_broker_error(
        format!("Kafka at {servers} did not answer a metadata request within {waited:?}"),
        broker_error,
    ))
    .with_source(KafkaError::MetadataFetch(code))
}

/// The health check's task did not finish (it panicked or was cancelled): unavailable.
pub(crate) fn health_not_finished(error: tokio::task::JoinError) -> Error {
    Error::unavailable("the Kafka health check did not finish").with_source(error)
}

/// Whether an idempotent producer's id or epoch is no good any more after `code`: the
/// message is `Temporary` (see [`kind_of`]), and the sink replaces the producer so that the
/// retry runs under a new producer id.
pub(crate) fn session_broken(code: Code) -> bool {
    matches!(
        code,
        Code::ProducerFenced
            | Code::InvalidProducerEpoch
            | Code::UnknownProducerId
            | Code::OutOfOrderSequenceNumber
            | Code::Fenced
            | Code::Fatal
    )
}

/// The engine's error for librdkafka refusing the configuration, keyed by the property (or
/// by the `tls_*` key of `config` that set it, e.g. a CA file that is not PEM). The value is
/// left out, as it may be a secret.
pub(crate) fn config_error(error: KafkaError, config: &KafkaConfig) -> Error {
    match error {
        KafkaError::ClientConfig(_, description, name, _value) => {
            let description = if crate::config::is_secret_property(&name) {
                "invalid value".to_string()
            } else {
                description
            };
            let key = match config.tls_key_of(&name) {
                Some(key) => key.to_string(),
                None => format!("properties.{name}"),
            };
            Error::setting(key, format!("is refused by librdkafka: {description}"))
        }
        KafkaError::ClientCreation(description) => {
            // librdkafka loads the TLS files here and names the property of a bad one.
            let tls_key = [
                "ssl.ca.location",
                "ssl.certificate.location",
                "ssl.key.location",
            ]
            .into_iter()
            .filter(|property| description.contains(property))
            .find_map(|property| config.tls_key_of(property));
            match tls_key {
                Some(key) => {
                    Error::setting(key, format!("is refused by librdkafka: {description}"))
                }
                None => Error::setting(
                    "properties",
                    format!("are refused by librdkafka: {description}"),
                ),
            }
        }
        other => Error::config("could not create the Kafka producer").with_source(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_size_topic_and_authorisation_errors() {
        assert_eq!(kind_of(Code::MessageTimedOut), ErrorKind::Unavailable);
        assert_eq!(kind_of(Code::AllBrokersDown), ErrorKind::Unavailable);
        assert_eq!(kind_of(Code::NotEnoughReplicas), ErrorKind::Unavailable);
        assert_eq!(kind_of(Code::MessageSizeTooLarge), ErrorKind::Permanent);
        assert_eq!(kind_of(Code::UnknownTopic), ErrorKind::Permanent);
        assert_eq!(kind_of(Code::UnknownTopicOrPartition), ErrorKind::Permanent);
        assert_eq!(
            kind_of(Code::TopicAuthorizationFailed),
            ErrorKind::Permanent
        );
        assert_eq!(kind_of(Code::InvalidMessage), ErrorKind::Temporary);
        assert_eq!(kind_of(Code::Fatal), ErrorKind::Temporary);
    }

    #[test]
    fn delivery_error_names_topic_and_code() {
        let err = delivery_error(
            KafkaError::MessageProduction(Code::MessageSizeTooLarge),
            "orders",
            "k:9092",
            Some("SSL handshake failed"),
        );
        assert_eq!(err.kind(), ErrorKind::Permanent);
        let text = err.to_string();
        assert!(
            text.contains("`orders`") && text.contains("MessageSizeTooLarge"),
            "{text}"
        );
        // The broker error only explains an unavailable broker, not a refused message.
        assert!(!text.contains("SSL"), "{text}");
        let err = delivery_error(
            KafkaError::MessageProduction(Code::MessageTimedOut),
            "o",
            "k:9092",
            Some("SSL handshake failed"),
        );
        let text = err.to_string();
        assert!(
            text.contains("Kafka at k:9092")
                && text.contains("last broker error: SSL handshake failed"),
            "{text}"
        );
        assert_eq!(
            illegal_topic("a b", "a b", "no").kind(),
            ErrorKind::Permanent
        );
        assert_eq!(
            no_report("o", "k:1", Duration::from_secs(1), None).kind(),
            ErrorKind::Unavailable
        );
        assert_eq!(producer_closed("o").kind(), ErrorKind::Unavailable);
        assert!(session_broken(Code::ProducerFenced) && !session_broken(Code::MessageTimedOut));
        assert_eq!(kind_of(Code::ProducerFenced), ErrorKind::Temporary);
    }
}
