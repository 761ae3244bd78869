//! The sink alone against the real RabbitMQ ($OUTBOX_TEST_AMQP_URL, default
//! amqp://guest:guest@127.0.0.1:5672/%2f). Each test uses its own exchanges and queues.
//! The tests through PostgreSQL and the relay are in the workspace's `tests` crate.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use outbox_amqp::lapin::ExchangeKind;
use outbox_amqp::lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions};
use outbox_amqp::lapin::types::{AMQPValue, FieldTable};
use outbox_amqp::{AmqpConfig, AmqpSink, ExchangeSetup, Unroutable};
use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, Template, TraceContext};
use outbox_test_support::amqp::{Broker, message_id, text, url};
use outbox_test_support::{Proxy, free_addr, host_port, through, unique_name};
use outbox_testkit::{assert_unavailable_within, refused_sink_build};

/// A template the test knows to be valid (an exchange name, `{topic}`, …).
fn template(text: &str) -> Template {
    Template::new(text).unwrap_or_else(|e| panic!("template `{text}`: {e}"))
}

/// A sink for `config`; fails the test loudly if the broker is not there.
async fn sink(config: AmqpConfig) -> AmqpSink {
    AmqpSink::connect(config)
        .await
        .unwrap_or_else(|e| panic!("cannot start the AMQP sink against {}: {e}", url()))
}

fn receipt(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Delivered(receipt) => receipt.to_string(),
        Outcome::Failed(error) => panic!("expected a delivery, got {error}"),
    }
}

fn failure(outcome: &Outcome) -> (ErrorKind, String) {
    match outcome {
        Outcome::Failed(error) => (error.kind(), error.to_string()),
        Outcome::Delivered(receipt) => panic!("expected a failure, got a delivery ({receipt})"),
    }
}

/// The test's own connection, with a fresh exchange of `kind` and a fresh queue bound to it
/// with `binding`: the broker and the names of both.
async fn destination(kind: ExchangeKind, binding: &str) -> (Broker, String, String) {
    let broker = Broker::connect().await;
    let (exchange, queue) = broker.exchange_and_queue(kind, binding).await;
    (broker, exchange, queue)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn properties_headers_and_payload_arrive_exactly() {
    let (broker, exchange, queue) = destination(ExchangeKind::Topic, "orders.#").await;
    let sink = sink(AmqpConfig::new(url(), template(&exchange))).await;

    let trace = TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: Some("vendor=1".into()),
    };
    let json = NewMessage::json("orders.created", &BTreeMap::from([("id", 7)]))
        .unwrap()
        .key("o-7")
        .header("tenant", "acme")
        .trace_context(trace.clone());
    let binary = NewMessage::new("orders.paid", vec![0u8, 159, 146, 150, 255, 0]);
    let empty = NewMessage::new("orders.created", Vec::new()).key("o-8");
    let batch: Vec<Message> = [json, binary, empty]
        .into_iter()
        .map(Message::from)
        .collect();

    let outcomes = sink.publish(&batch).await.expect("publish");
    assert_eq!(outcomes.len(), 3);
    assert_eq!(receipt(&outcomes[0]), format!("{exchange}/orders.created"));
    assert_eq!(receipt(&outcomes[1]), format!("{exchange}/orders.paid"));

    let got = broker.take(&queue, 3).await;
    for (delivery, sent) in got.iter().zip(&batch) {
        assert_eq!(delivery.data, sent.payload, "payload bytes of {}", sent.id);
        assert_eq!(delivery.exchange.as_str(), exchange);
        assert_eq!(delivery.routing_key.as_str(), sent.topic);
        let p = &delivery.properties;
        assert_eq!(p.delivery_mode(), &Some(2), "persistent");
        assert_eq!(message_id(delivery), sent.id.to_string());
        assert_eq!(
            p.kind().as_ref().map(|s| s.to_string()),
            Some(sent.topic.clone())
        );
        assert_eq!(
            p.app_id().as_ref().map(|s| s.to_string()),
            Some("outbox".into())
        );
        assert_eq!(p.timestamp(), &Some(sent.created_at.timestamp() as u64));
    }
    let p0 = &got[0].properties;
    assert_eq!(
        p0.content_type().as_ref().map(|s| s.to_string()),
        Some("application/json".into())
    );
    // The envelope (docs/envelope.md) by its documented names, then the message's headers.
    let envelope = |sent: &Message, content_type: &str| {
        let mut table = FieldTable::default();
        table.insert("outbox-envelope".into(), text("1"));
        table.insert("outbox-id".into(), text(&sent.id.to_string()));
        table.insert("outbox-topic".into(), text(&sent.topic));
        if let Some(key) = &sent.key {
            table.insert("outbox-key".into(), text(key));
        }
        let created = outbox_core::envelope::format_created_at(&sent.created_at);
        table.insert("outbox-created-at".into(), text(&created));
        table.insert("content-type".into(), text(content_type));
        table
    };
    let mut expected = envelope(&batch[0], "application/json");
    expected.insert("tenant".into(), text("acme"));
    expected.insert("traceparent".into(), text(&trace.traceparent));
    expected.insert("tracestate".into(), text("vendor=1"));
    assert_eq!(p0.headers().as_ref(), Some(&expected));

    let p1 = &got[1].properties;
    assert_eq!(
        p1.content_type().as_ref().map(|s| s.to_string()),
        Some("application/octet-stream".into())
    );
    assert_eq!(
        p1.headers().as_ref(),
        Some(&envelope(&batch[1], "application/octet-stream")),
        "no key, no headers: the envelope only"
    );
    assert_eq!(
        got[2].properties.headers().as_ref(),
        Some(&envelope(&batch[2], "application/octet-stream"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_and_templates_pick_exchange_and_routing_key() {
    let broker = Broker::connect().await;
    let events = broker.exchange(ExchangeKind::Direct).await;
    let audit = broker.exchange(ExchangeKind::Fanout).await;
    let by_key = broker.queue(&events, "orders.o-1").await;
    let audited = broker.queue(&audit, "").await;
    let config = AmqpConfig::new(url(), template(&events))
        .routing_key(template("{topic}.{key}"))
        .route("audit", template(&audit), template("log"));
    let sink = sink(config).await;

    let batch: Vec<Message> = [
        NewMessage::new("orders", b"a".to_vec()).key("o-1"),
        NewMessage::new("audit", b"b".to_vec()),
        NewMessage::new("orders", b"c".to_vec()).key("o-1"),
    ]
    .into_iter()
    .map(Message::from)
    .collect();
    let outcomes = sink.publish(&batch).await.expect("publish");
    assert_eq!(receipt(&outcomes[0]), format!("{events}/orders.o-1"));
    assert_eq!(receipt(&outcomes[1]), format!("{audit}/log"));
    assert_eq!(receipt(&outcomes[2]), format!("{events}/orders.o-1"));
    let got = broker.take(&by_key, 2).await;
    assert_eq!([&got[0].data[..], &got[1].data[..]], [b"a", b"c"]);
    assert_eq!(broker.take(&audited, 1).await[0].data, b"b");

    // `{key}` alone is empty for a message without a key: that message fails for good.
    let config = AmqpConfig::new(url(), template(&events)).routing_key(template("{key}"));
    let sink = self::sink(config).await;
    let outcomes = sink
        .publish(&[NewMessage::new("orders", b"x".to_vec()).into()])
        .await
        .expect("publish");
    let (kind, text) = failure(&outcomes[0]);
    assert_eq!(kind, ErrorKind::Permanent);
    assert!(text.contains("empty routing key"), "{text}");
}

/// Publishes, in one call and all of `key`, `1` and `3` to topic `routed` (bound to `queue`
/// on the sink's direct exchange) and `2` between them to `nowhere` (bound to no queue):
/// checks that `1` and `3` are delivered and reach `queue`, and returns `2` and its outcome.
async fn publish_around_a_returned_one(
    broker: &Broker,
    sink: &AmqpSink,
    queue: &str,
    key: Option<&str>,
) -> (Message, Outcome) {
    let batch: Vec<Message> = [("routed", "1"), ("nowhere", "2"), ("routed", "3")]
        .into_iter()
        .map(|(topic, body)| {
            let mut message = Message::from(NewMessage::new(topic, body.as_bytes().to_vec()));
            message.key = key.map(str::to_string);
            message
        })
        .collect();
    let mut outcomes = sink.publish(&batch).await.expect("publish");
    receipt(&outcomes[0]);
    receipt(&outcomes[2]);
    let got = broker.take(queue, 2).await;
    assert_eq!([&got[0].data[..], &got[1].data[..]], [b"1", b"3"]);
    (batch[1].clone(), outcomes.swap_remove(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_messages_fail_as_configured_and_the_others_arrive() {
    let (broker, exchange, queue) = destination(ExchangeKind::Direct, "routed").await;
    for (setting, expected) in [
        (Unroutable::Retry, ErrorKind::Temporary),
        (Unroutable::DeadLetter, ErrorKind::Permanent),
    ] {
        let sink = sink(AmqpConfig::new(url(), template(&exchange)).unroutable(setting)).await;
        let (returned, outcome) = publish_around_a_returned_one(&broker, &sink, &queue, None).await;
        let (kind, text) = failure(&outcome);
        assert_eq!(kind, expected, "{text}");
        assert!(
            text.contains("NO_ROUTE") && text.contains(&returned.id.to_string()),
            "{text}"
        );
        // The channel survives a return: the next batch goes through.
        let outcomes = sink
            .publish(&[NewMessage::new("routed", b"4".to_vec()).into()])
            .await;
        receipt(&outcomes.expect("publish")[0]);
        assert_eq!(broker.take(&queue, 1).await[0].data, b"4");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_at_start_up() {
    let broker = Broker::connect().await;
    let url = url();

    // A missing exchange with passive set-up (the default).
    let missing = unique_name("outbox_test_missing");
    let error = AmqpSink::connect(AmqpConfig::new(&url, template(&missing)))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(
        error
            .to_string()
            .contains(&format!("exchange `{missing}` does not exist")),
        "{error}"
    );

    // Declaring an existing exchange with another kind.
    let topic = broker.exchange(ExchangeKind::Topic).await;
    let _queue = broker.queue(&topic, "#").await;
    let config = AmqpConfig::new(&url, template(&topic))
        .exchange_setup(ExchangeSetup::Declare)
        .exchange_kind(ExchangeKind::Fanout);
    let error = AmqpSink::connect(config).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(error.to_string().contains("PRECONDITION"), "{error}");

    // Not an AMQP URI, and a routing template that gives empty keys.
    let error = AmqpSink::connect(AmqpConfig::new("http://x", template(&topic)))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Config);
    // Keyed relative to the sink's section, which the relay puts in front.
    assert!(error.message().starts_with("url `http://x`"), "{error}");
    let error =
        AmqpSink::connect(AmqpConfig::new(&url, template(&topic)).routing_key(template("")))
            .await
            .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Config);
    assert!(
        error.message().starts_with("routing_key is empty"),
        "{error}"
    );

    // Wrong credentials: configuration, and the password is not shown.
    let bad = url.replacen("guest:guest", "guest:wrong-s3cret", 1);
    assert_ne!(bad, url, "the test expects guest:guest in {url}");
    let error = AmqpSink::connect(AmqpConfig::new(&bad, template(&topic)))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(!format!("{error:?}").contains("wrong-s3cret"), "{error:?}");
    assert!(error.to_string().contains("refused the login"), "{error}");
    let (base, _vhost) = url.rsplit_once('/').expect("a vhost in the test URL");
    let no_vhost = format!("{base}/{}", unique_name("no_such_vhost"));
    let error = AmqpSink::connect(AmqpConfig::new(&no_vhost, template(&topic)))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");

    // Nothing listening: unavailable, promptly.
    let closed = free_addr();
    let started = Instant::now();
    let error = AmqpSink::connect(AmqpConfig::new(
        format!("amqp://guest:guest@{closed}"),
        template(&topic),
    ))
    .await
    .unwrap_err();
    assert_unavailable_within(&error, started.elapsed(), Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_creates_exchanges_and_topic_exchanges_are_checked_on_first_use() {
    let broker = Broker::connect().await;
    let prefix = unique_name("outbox_test_t");
    let existing = broker.exchange(ExchangeKind::Fanout).await;
    // The exchange is named after the topic: `existing` exists, the other does not.
    let queue = broker.queue(&existing, "").await;
    let config = AmqpConfig::new(url(), template("{topic}"));
    let sink = sink(config).await;
    let batch: Vec<Message> = [
        NewMessage::new(existing.as_str(), b"1".to_vec()),
        NewMessage::new(format!("{prefix}_absent"), b"2".to_vec()),
        NewMessage::new(existing.as_str(), b"3".to_vec()),
    ]
    .into_iter()
    .map(Message::from)
    .collect();
    let outcomes = sink.publish(&batch).await.expect("publish");
    receipt(&outcomes[0]);
    let (kind, text) = failure(&outcomes[1]);
    assert_eq!(kind, ErrorKind::Temporary, "{text}");
    assert!(text.contains("does not exist"), "{text}");
    receipt(&outcomes[2]);
    assert_eq!(broker.take(&queue, 2).await.len(), 2);
    sink.health()
        .await
        .expect("healthy after a refused exchange");

    // With `declare`, the sink creates the exchange (durable) and publishing works.
    let declared = format!("{prefix}_declared");
    let config = AmqpConfig::new(url(), template(&declared))
        .exchange_setup(ExchangeSetup::Declare)
        .exchange_kind(ExchangeKind::Topic);
    let sink = self::sink(config).await;
    let queue = broker.queue(&declared, "#").await;
    let outcomes = sink
        .publish(&[NewMessage::new("t", b"x".to_vec()).into()])
        .await;
    receipt(&outcomes.expect("publish")[0]);
    assert_eq!(broker.take(&queue, 1).await[0].data, b"x");
    broker
        .channel
        .exchange_delete(declared.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete the declared exchange");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_fail_for_good_without_harming_the_batch() {
    let (broker, exchange, queue) = destination(ExchangeKind::Fanout, "").await;
    let config = AmqpConfig {
        max_payload: 1024,
        ..AmqpConfig::new(url(), template(&exchange))
    };
    let sink = sink(config).await;
    assert_eq!(sink.capabilities().max_payload, Some(1024));
    let batch: Vec<Message> = [
        NewMessage::new("t", vec![1u8; 1025]),
        NewMessage::new("t", b"ok".to_vec()).header("big", "x".repeat(200_000)),
        NewMessage::new("t", b"fine".to_vec()).header("y".repeat(300), "v"),
        NewMessage::new("t", vec![2u8; 1024]),
    ]
    .into_iter()
    .map(Message::from)
    .collect();
    let outcomes = sink.publish(&batch).await.expect("publish");
    let (kind, text) = failure(&outcomes[0]);
    assert_eq!(kind, ErrorKind::Permanent);
    assert!(text.contains("sink.max_payload"), "{text}");
    let (kind, text) = failure(&outcomes[1]);
    assert_eq!(kind, ErrorKind::Permanent);
    assert!(text.contains("frame size"), "{text}");
    let (kind, text) = failure(&outcomes[2]);
    assert_eq!(kind, ErrorKind::Permanent);
    assert!(text.contains("header name"), "{text}");
    receipt(&outcomes[3]);
    assert_eq!(broker.take(&queue, 1).await[0].data, vec![2u8; 1024]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_connection_reports_unavailable_and_reconnects() {
    let (broker, exchange, queue) = destination(ExchangeKind::Fanout, "").await;
    let url = url();
    let proxy = Proxy::start(&host_port(&url)).await;
    let mut config = AmqpConfig::new(through(&url, &proxy.addr()), template(&exchange));
    config.connect_timeout = Duration::from_secs(2);
    config.publish_timeout = Duration::from_secs(2);
    let sink = sink(config).await;
    let one = |body: &str| -> Vec<Message> {
        vec![NewMessage::new("t", body.as_bytes().to_vec()).into()]
    };
    receipt(&sink.publish(&one("before")).await.expect("publish")[0]);

    proxy.cut();
    let started = Instant::now();
    match sink.publish(&one("during")).await {
        Err(error) => assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}"),
        Ok(outcomes) => assert_eq!(failure(&outcomes[0]).0, ErrorKind::Unavailable),
    }
    let error = sink.health().await.expect_err("health while cut");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let error = sink.health().await.expect_err("health while cut");
    assert_unavailable_within(&error, started.elapsed(), Duration::from_secs(6));

    proxy.restore();
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Err(error) = sink.health().await {
        assert!(
            Instant::now() < deadline,
            "no reconnect within 20 s: {error}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    receipt(&sink.publish(&one("after")).await.expect("publish")[0]);
    let got = broker.take(&queue, 2).await;
    // "during" may or may not have reached the broker before the cut; never after it.
    assert_eq!(got.first().map(|d| &d.data[..]), Some(&b"before"[..]));
    assert_eq!(got.last().map(|d| &d.data[..]), Some(&b"after"[..]));
}

/// Publishes `total` messages in calls of `per_call`; returns messages per second.
async fn rate(sink: &AmqpSink, total: usize, per_call: usize) -> f64 {
    let messages: Vec<Message> = (0..total)
        .map(|i| {
            NewMessage::new("bench", format!("{i:08}").into_bytes())
                .key(format!("k{}", i % 50))
                .into()
        })
        .collect();
    let started = Instant::now();
    for chunk in messages.chunks(per_call) {
        for outcome in sink.publish(chunk).await.expect("publish") {
            receipt(&outcome);
        }
    }
    total as f64 / started.elapsed().as_secs_f64()
}

/// Per-batch confirms against one confirm round trip per message, into a durable queue
/// (persistent messages are confirmed once written). Prints the figures for the docs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_confirms_beat_one_confirm_per_message() {
    let broker = Broker::connect().await;
    let exchange = broker.exchange(ExchangeKind::Fanout).await;
    let queue = unique_name("outbox_test_durable");
    let mut arguments = FieldTable::default();
    arguments.insert("x-expires".into(), AMQPValue::LongInt(600_000));
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    broker
        .channel
        .queue_declare(queue.as_str().into(), options, arguments)
        .await
        .expect("declare durable queue");
    broker.bind(&queue, &exchange, "").await;
    let sink = sink(AmqpConfig::new(url(), template(&exchange))).await;

    rate(&sink, 200, 100).await; // warm up
    let total = 2_000;
    let per_message = rate(&sink, total, 1).await;
    let per_batch = rate(&sink, total, 100).await;
    let ratio = per_batch / per_message;
    println!(
        "AMQP publish rate, {total} persistent messages into a durable queue: one confirm per \
         message {per_message:.0} msg/s, per-batch confirms (100 per batch) {per_batch:.0} \
         msg/s, ratio {ratio:.1}x"
    );
    let got = broker.take(&queue, 200 + 2 * total).await;
    let bodies: Vec<&[u8]> = got.iter().skip(200).map(|d| &d.data[..]).collect();
    let expected: Vec<Vec<u8>> = (0..total)
        .chain(0..total)
        .map(|i| format!("{i:08}").into_bytes())
        .collect();
    assert!(
        bodies.iter().zip(&expected).all(|(a, b)| *a == &b[..]),
        "queue order differs from publish order"
    );
    broker
        .channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete queue");
    assert!(ratio >= 2.0, "batched confirms are only {ratio:.1}x faster");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_deleted_while_running_fails_the_message_not_the_connection() {
    let broker = Broker::connect().await;
    let exchange = unique_name("outbox_test_deleted");
    broker
        .channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Fanout,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare exchange");
    let queue = broker.queue(&exchange, "").await;
    let sink = sink(AmqpConfig::new(url(), template(&exchange))).await;
    let batch = |n: u8| -> Vec<Message> {
        (0..n)
            .map(|i| NewMessage::new("t", vec![i]).into())
            .collect()
    };
    for outcome in sink.publish(&batch(2)).await.expect("publish") {
        receipt(&outcome);
    }
    assert_eq!(broker.take(&queue, 2).await.len(), 2);

    broker
        .channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete exchange");
    // The broker closes the channel on the first message: that one is charged, the ones
    // after it lost their channel and are released uncharged.
    let outcomes = sink.publish(&batch(3)).await.expect("publish");
    let kinds: Vec<ErrorKind> = outcomes.iter().map(|o| failure(o).0).collect();
    assert_eq!(
        kinds,
        [
            ErrorKind::Temporary,
            ErrorKind::Unavailable,
            ErrorKind::Unavailable
        ]
    );
    assert!(
        failure(&outcomes[0]).1.contains("NOT_FOUND"),
        "{}",
        failure(&outcomes[0]).1
    );
    // Next call: a fresh connection finds the exchange missing; every message is charged.
    let outcomes = sink.publish(&batch(2)).await.expect("publish");
    for outcome in &outcomes {
        let (kind, text) = failure(outcome);
        assert_eq!(kind, ErrorKind::Temporary, "{text}");
        assert!(text.contains("does not exist"), "{text}");
    }
    sink.health().await.expect("the connection itself is fine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_builds_the_sink_from_the_configuration_table() {
    let (broker, exchange, queue) = destination(ExchangeKind::Fanout, "").await;
    let mut registry = outbox_core::SinkRegistry::new();
    outbox_amqp::register(&mut registry);
    assert_eq!(registry.names(), [outbox_amqp::TYPE]);

    let config = serde_json::json!({ "url": url(), "exchange": exchange, "publish_timeout": "5s" });
    let sink = registry
        .build("amqp", config)
        .await
        .expect("build the sink");
    let outcomes = sink
        .publish(&[NewMessage::new("t", b"via registry".to_vec()).into()])
        .await;
    receipt(&outcomes.expect("publish")[0]);
    assert_eq!(broker.take(&queue, 1).await[0].data, b"via registry");

    let missing =
        serde_json::json!({ "url": url(), "exchange": unique_name("outbox_test_missing") });
    let error = refused_sink_build(&registry, "amqp", missing).await;
    assert!(error.to_string().contains("does not exist"), "{error}");

    // Errors are keyed relative to the table; the relay puts the section in front.
    let bad = serde_json::json!({ "url": url(), "exchange": exchange, "publish_timeout": "soon" });
    let error = refused_sink_build(&registry, "amqp", bad).await;
    assert!(
        error.message().starts_with("sink.publish_timeout: "),
        "{error}"
    );
}

/// Why the sink leaves `ordered_key_runs` off: on one confirm-mode channel a message the
/// broker returns (mandatory, no queue) does not stop the next publish, so a key's later
/// message published in the same call lands although the earlier one failed, and the
/// worker's retry of that one would land after it. The sink could only hold the promise by
/// waiting for each message's confirm before the key's next one: a confirm round trip per
/// message of a key, which is what the worker's rounds cost already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returned_message_does_not_stop_the_next_one_so_key_runs_stay_off() {
    let (broker, exchange, queue) = destination(ExchangeKind::Direct, "routed").await;
    let sink = sink(AmqpConfig::new(url(), template(&exchange))).await;
    assert!(
        !sink.capabilities().ordered_key_runs,
        "the AMQP sink must not declare ordered_key_runs: see this test"
    );
    // `3` is published after the returned `2` of its key on the same channel, and
    // delivered all the same.
    let (_, outcome) = publish_around_a_returned_one(&broker, &sink, &queue, Some("k")).await;
    failure(&outcome);
}

/// docs/sinks/amqp.md, `exchange_setup`: "`amq.*` exchanges are only ever checked". The broker
/// refuses to declare a name starting `amq.` (ACCESS_REFUSED), and `amq.direct` is not of the
/// kind `topic` configured: a sink that declared it, fixed or named after a topic, would not
/// start or would fail the message.
mod amqp_reserved_exchanges {
    use super::*;
    use outbox_amqp::lapin::ExchangeKind;
    use outbox_core::{Outcome, Sink, Template};
    use outbox_test_support::amqp::{Broker, url};

    fn template(text: &str) -> Template {
        Template::new(text).expect("a template")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn amq_exchanges_are_only_checked_even_under_declare() {
        let broker = Broker::connect().await;
        let key = unique_name("amq_key");
        let queue = broker.queue("amq.direct", &key).await;
        for exchange in ["amq.direct", "amq.{topic}"] {
            let config = AmqpConfig::new(url(), template(exchange))
                .routing_key(template("{key}"))
                .exchange_setup(ExchangeSetup::Declare)
                .exchange_kind(ExchangeKind::Topic);
            let sink = match tokio::time::timeout(
                Duration::from_secs(20),
                AmqpSink::connect(config),
            )
            .await
            {
                Ok(Ok(sink)) => sink,
                Ok(Err(e)) => panic!("exchange `{exchange}` under declare: start-up refused: {e}"),
                Err(_) => panic!("exchange `{exchange}`: start-up did not return"),
            };
            let message: Message = NewMessage::new("direct", exchange).key(&key).into();
            let outcomes = sink.publish(&[message]).await.expect("publish");
            match &outcomes[0] {
                Outcome::Delivered(_) => {}
                Outcome::Failed(e) => panic!("exchange `{exchange}` under declare: {e}"),
            }
            let got = broker.take(&queue, 1).await;
            assert_eq!(got[0].data, exchange.as_bytes());
        }
    }
}
