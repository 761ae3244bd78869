//! Error handling against librdkafka's mock cluster, which can inject broker errors and
//! take brokers down (tansu cannot).

use std::time::Duration;

use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink};
use outbox_kafka::rdkafka::mocking::MockCluster;
use outbox_kafka::rdkafka::producer::DefaultProducerContext;
use outbox_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr as Err};
use outbox_kafka::{KafkaConfig, KafkaSink};
use outbox_test_support::kafka::consume;
use outbox_test_support::unique_name;

/// A one-broker mock cluster with a topic of the test's own (named after `name`), of one
/// partition: the topic and the cluster.
fn cluster(name: &str) -> (String, MockCluster<'static, DefaultProducerContext>) {
    let topic = unique_name(name);
    let mock = MockCluster::new(1).expect("mock cluster");
    mock.create_topic(&topic, 1, 1).expect("mock topic");
    (topic, mock)
}

/// The settings of every sink here: a 3 s delivery time-out, and short librdkafka retry
/// waits that keep these tests quick.
fn config(mock: &MockCluster<'static, DefaultProducerContext>) -> KafkaConfig {
    let mut config = KafkaConfig::new(mock.bootstrap_servers());
    config.publish_timeout = Duration::from_secs(3);
    config
        .property("retry.backoff.ms", "10")
        .property("linger.ms", "0")
}

fn sink(mock: &MockCluster<'static, DefaultProducerContext>) -> KafkaSink {
    let mut config = config(mock);
    config.health_timeout = Duration::from_secs(1);
    KafkaSink::new(config).expect("sink")
}

/// A [`cluster`] and a [`sink`] to it that has delivered one message, `first`.
async fn delivering(
    name: &str,
    first: &str,
) -> (
    String,
    MockCluster<'static, DefaultProducerContext>,
    KafkaSink,
) {
    let (topic, mock) = cluster(name);
    let sink = sink(&mock);
    delivered(&publish(&sink, &topic, first).await);
    (topic, mock, sink)
}

fn message(topic: &str, payload: &str) -> Message {
    NewMessage::new(topic, payload.to_string())
        .key(payload.to_string())
        .into()
}

fn failed(outcome: &Outcome) -> &outbox_core::Error {
    match outcome {
        Outcome::Failed(e) => e,
        Outcome::Delivered(r) => panic!("expected a failure, got delivered at {r}"),
    }
}

fn delivered(outcome: &Outcome) {
    if let Outcome::Failed(e) = outcome {
        panic!("expected delivery: {e}");
    }
}

/// The outcome of publishing one message of `payload` (also its key) to `topic`.
async fn publish(sink: &KafkaSink, topic: &str, payload: &str) -> Outcome {
    let mut outcomes = sink
        .publish(&[message(topic, payload)])
        .await
        .expect("publish");
    outcomes.remove(0)
}

/// The payloads written to the one partition of `topic`, once `count` came (within 10 s).
async fn payloads(
    mock: &MockCluster<'static, DefaultProducerContext>,
    topic: &str,
    count: usize,
) -> Vec<String> {
    let records = consume(
        &mock.bootstrap_servers(),
        topic,
        1,
        count,
        Duration::from_secs(10),
    )
    .await;
    records
        .into_iter()
        .map(|r| String::from_utf8(r.payload).expect("UTF-8 payload"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn retryable_broker_errors_are_retried_by_the_producer_and_written_once() {
    let (topic, mock) = cluster("retry");
    let sink = sink(&mock);
    sink.health().await.expect("healthy");
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[
            Err::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            Err::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            Err::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
            Err::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            Err::RD_KAFKA_RESP_ERR__TRANSPORT,
        ],
    );
    let batch: Vec<Message> = (0..5).map(|i| message(&topic, &format!("m{i}"))).collect();
    let outcomes = sink.publish(&batch).await.expect("publish");
    outcomes.iter().for_each(delivered);

    // Idempotence: the retries after a time-out or a dropped connection wrote nothing twice.
    assert_eq!(
        payloads(&mock, &topic, 5).await,
        ["m0", "m1", "m2", "m3", "m4"],
        "once each, in order"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn fatal_broker_errors_fail_only_their_message_for_good() {
    let mock = MockCluster::new(1).expect("mock cluster");
    let sink = sink(&mock);
    let mut written = Vec::new();
    for (injected, reason) in [
        (
            Err::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE,
            "MessageSizeTooLarge",
        ),
        (
            Err::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
            "TopicAuthorizationFailed",
        ),
        (Err::RD_KAFKA_RESP_ERR_INVALID_RECORD, "InvalidRecord"),
        (Err::RD_KAFKA_RESP_ERR_POLICY_VIOLATION, "PolicyViolation"),
    ] {
        // A topic per case: librdkafka refuses further messages to a topic it was told it
        // may not write to, until its next metadata refresh.
        let topic = unique_name("fatal");
        mock.create_topic(&topic, 1, 1).expect("mock topic");
        mock.request_errors(RDKafkaApiKey::Produce, &[injected]);
        let outcome = publish(&sink, &topic, reason).await;
        let error = failed(&outcome);
        assert_eq!(error.kind(), ErrorKind::Permanent, "{reason}: {error}");
        assert!(
            error.to_string().contains(reason),
            "the reason is kept: {error}"
        );
        // The next message goes through: one refused message does not stop the producer.
        let next = unique_name("next");
        mock.create_topic(&next, 1, 1).expect("mock topic");
        delivered(&publish(&sink, &next, &format!("after {reason}")).await);
        written.push((topic, next));
    }
    for (refused, next) in written {
        assert_eq!(payloads(&mock, &next, 1).await.len(), 1);
        let refused = payloads(&mock, &refused, 0).await;
        assert!(
            refused.is_empty(),
            "a refused message is not written: {refused:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_topic_from_metadata_is_permanent() {
    let (topic, mock) = cluster("known");
    let missing = unique_name("missing");
    mock.topic_error(&missing, Err::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)
        .expect("topic error");
    let sink = sink(&mock);
    let outcomes = sink
        .publish(&[message(&missing, "lost"), message(&topic, "kept")])
        .await
        .expect("publish");
    let error = failed(&outcomes[0]);
    assert_eq!(error.kind(), ErrorKind::Permanent, "{error}");
    assert!(error.to_string().contains(&missing), "{error}");
    delivered(&outcomes[1]);
}

#[tokio::test(flavor = "multi_thread")]
async fn broker_down_is_unavailable_and_delivery_resumes_when_it_is_back() {
    let (topic, mock, sink) = delivering("down", "before").await;

    mock.broker_down(1).expect("broker down");
    let err = sink.health().await.expect_err("the only broker is down");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let outcome = publish(&sink, &topic, "during").await;
    assert_eq!(failed(&outcome).kind(), ErrorKind::Unavailable);

    mock.broker_up(1).expect("broker up");
    // As the worker does: wait for the health check, publish, and on `Unavailable` (the
    // partition leader's connection may still be in librdkafka's reconnect backoff when
    // the check passes) try again; nothing may fail any other way.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    for payload in ["during", "after"] {
        loop {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no delivery 40 s after broker_up"
            );
            if sink.health().await.is_err() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let outcome = publish(&sink, &topic, payload).await;
            match &outcome {
                Outcome::Delivered(_) => break,
                Outcome::Failed(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}"),
            }
        }
    }
    assert_eq!(
        payloads(&mock, &topic, 3).await,
        ["before", "during", "after"],
        "once each, in order"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_producer_that_failed_fatally_or_was_fenced_is_replaced() {
    let (topic, mock, sink) = delivering("desync", "first").await;
    // A sequence gap at the head of the partition (librdkafka can no longer vouch for order
    // or once-ness and raises a fatal error), and the broker refusing the producer's epoch:
    // either way this producer is done for.
    for (injected, name) in [
        (
            Err::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
            "out of order",
        ),
        (Err::RD_KAFKA_RESP_ERR_PRODUCER_FENCED, "fenced"),
        (
            Err::RD_KAFKA_RESP_ERR_INVALID_PRODUCER_EPOCH,
            "invalid epoch",
        ),
    ] {
        mock.request_errors(RDKafkaApiKey::Produce, &[injected]);
        let outcome = publish(&sink, &topic, name).await;
        let error = failed(&outcome);
        assert_eq!(
            error.kind(),
            ErrorKind::Temporary,
            "{name}: worth another attempt: {error}"
        );
        // The retry runs on a new producer and goes through.
        sink.health().await.expect("healthy again");
        let retried = format!("{name} retried");
        delivered(&publish(&sink, &topic, &retried).await);
    }
    assert_eq!(
        payloads(&mock, &topic, 4).await,
        [
            "first",
            "out of order retried",
            "fenced retried",
            "invalid epoch retried"
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_that_stops_answering_cannot_hold_a_publish() {
    let (topic, mock, sink) = delivering("silent", "first").await;

    // Answers take a minute, far past the delivery time-out (3 s here): the publish must
    // end near that time-out as Unavailable, not wait for the answer.
    mock.broker_round_trip_time(1, Duration::from_secs(60))
        .expect("slow broker");
    let started = std::time::Instant::now();
    let outcome = publish(&sink, &topic, "stuck").await;
    let took = started.elapsed();
    assert_eq!(
        failed(&outcome).kind(),
        ErrorKind::Unavailable,
        "{:?}",
        outcome
    );
    assert!(
        took < Duration::from_secs(10),
        "3 s delivery time-out + 5 s, took {took:?}"
    );

    // Delivery resumes once the broker answers in time again.
    mock.broker_round_trip_time(1, Duration::ZERO)
        .expect("fast broker");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let outcome = publish(&sink, &topic, "after").await;
        match &outcome {
            Outcome::Delivered(_) => break,
            Outcome::Failed(e) => assert!(std::time::Instant::now() < deadline, "not back: {e}"),
        }
    }
}

/// Why the sink leaves `ordered_key_runs` off: the idempotent producer does not stop a
/// partition at a refused message. librdkafka bumps the producer epoch and renumbers the
/// messages after it, which are then written, so a key's later message in the same call
/// lands although the earlier one failed (and the worker's retry of that one would land
/// after it). Each message goes in a produce request of its own here
/// (`batch.num.messages=1`), as a key's run longer than a batch would.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_message_does_not_stop_the_later_ones_of_its_partition_so_key_runs_stay_off() {
    let (topic, mock) = cluster("run");
    let sink = KafkaSink::new(config(&mock).property("batch.num.messages", "1")).expect("sink");
    assert!(
        !sink.capabilities().ordered_key_runs,
        "the Kafka sink must not declare ordered_key_runs: see this test"
    );
    sink.health().await.expect("healthy");
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[
            Err::RD_KAFKA_RESP_ERR_NO_ERROR,
            Err::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE,
        ],
    );
    let batch: Vec<Message> = ["m0", "m1", "m2"]
        .iter()
        .map(|p| NewMessage::new(&topic, p.to_string()).key("k").into())
        .collect();
    let outcomes = sink.publish(&batch).await.expect("publish");
    delivered(&outcomes[0]);
    assert_eq!(failed(&outcomes[1]).kind(), ErrorKind::Permanent);
    // Behind the refused message of its key and partition, and written all the same.
    delivered(&outcomes[2]);
    assert_eq!(payloads(&mock, &topic, 2).await, ["m0", "m2"]);
}
