#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod error;
mod sink;

pub use config::{KafkaConfig, TOPIC_PLACEHOLDER};
pub use sink::{
    HEADER_CREATED_AT, HEADER_ID, HEADER_TOPIC, HEADER_TRACEPARENT, HEADER_TRACESTATE, KafkaSink,
};

/// The Kafka client this sink is built on, for tests and tools that need an admin client
/// or a consumer of the same version.
pub use rdkafka;
