//! The AMQP sink behind the relay, against the real PostgreSQL and the real RabbitMQ
//! (`$OUTBOX_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`). Each test
//! uses exchanges and queues of its own. Tests of the sink alone are in
//! outbox-amqp/tests/rabbitmq.rs.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use outbox_amqp::lapin::message::Delivery;
use outbox_amqp::lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use outbox_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use outbox_amqp::lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_amqp::{AmqpConfig, AmqpSink, Unroutable};
use outbox_core::{NewMessage, TraceContext, WorkerConfig};
use outbox_tests::{Proxy, TestOutbox, test_worker_config, unique_name};
use uuid::Uuid;

fn amqp_url() -> String {
    std::env::var("OUTBOX_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The test's own connection, to declare, bind and consume.
struct Broker {
    _connection: Connection,
    channel: Channel,
}

impl Broker {
    async fn connect() -> Broker {
        let url = amqp_url();
        let connect = Connection::connect(&url, ConnectionProperties::default());
        let connection = match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(e)) => panic!(
                "RabbitMQ must be running at {} ({e}); set OUTBOX_TEST_AMQP_URL to use another",
                outbox_core::redact_url(&url)
            ),
            Err(_) => panic!(
                "RabbitMQ at {} did not answer within 5 s",
                outbox_core::redact_url(&url)
            ),
        };
        let channel = connection.create_channel().await.expect("open a channel");
        Broker {
            _connection: connection,
            channel,
        }
    }

    /// A fresh topic exchange, deleted by the broker once its last queue is gone.
    async fn exchange(&self) -> String {
        let name = unique_name("outbox_test_x");
        let options = ExchangeDeclareOptions {
            auto_delete: true,
            ..Default::default()
        };
        self.channel
            .exchange_declare(
                name.as_str().into(),
                ExchangeKind::Topic,
                options,
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        name
    }

    /// A fresh queue of this connection (gone when it closes), bound with `binding`.
    async fn queue(&self, exchange: &str, binding: &str) -> String {
        let name = unique_name("outbox_test_q");
        let options = QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        };
        self.channel
            .queue_declare(name.as_str().into(), options, FieldTable::default())
            .await
            .expect("declare queue");
        self.bind(&name, exchange, binding).await;
        name
    }

    async fn bind(&self, queue: &str, exchange: &str, binding: &str) {
        self.channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind queue");
    }

    /// Exactly `count` messages from `queue`, in queue order; panics if fewer arrive within
    /// 60 s or more arrive.
    async fn take(&self, queue: &str, count: usize) -> Vec<Delivery> {
        let options = BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        };
        let tag = unique_name("c");
        let mut consumer = self
            .channel
            .basic_consume(
                queue.into(),
                tag.as_str().into(),
                options,
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let mut got = Vec::with_capacity(count);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while got.len() < count {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(delivery)) => got.push(delivery.expect("delivery")),
                Ok(None) => panic!("consumer of {queue} ended after {} of {count}", got.len()),
                Err(_) => panic!("only {} of {count} messages arrived in {queue}", got.len()),
            }
        }
        if let Ok(Some(extra)) =
            tokio::time::timeout(Duration::from_millis(500), consumer.next()).await
        {
            panic!("more messages than expected in {queue}: {extra:?}");
        }
        self.channel
            .basic_cancel(tag.as_str().into(), Default::default())
            .await
            .expect("cancel consumer");
        got
    }
}

async fn sink(config: AmqpConfig) -> Arc<AmqpSink> {
    match AmqpSink::connect(config).await {
        Ok(sink) => Arc::new(sink),
        Err(error) => panic!(
            "cannot start the AMQP sink against RabbitMQ at {}: {error}",
            outbox_tests::host_port(&amqp_url())
        ),
    }
}

fn message_id(delivery: &Delivery) -> Uuid {
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .expect("message_id is set");
    Uuid::parse_str(id.as_str()).expect("message_id is a UUID")
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_delivers_every_message_once_with_exact_properties() {
    let broker = Broker::connect().await;
    let exchange = broker.exchange().await;
    let queue = broker.queue(&exchange, "shop.#").await;
    let outbox = TestOutbox::new().await;
    let sink = sink(AmqpConfig::new(amqp_url(), &exchange)).await;

    let messages: Vec<NewMessage> = (0..300u32)
        .map(|i| {
            // Every byte value, including invalid UTF-8, and an empty payload.
            let payload: Vec<u8> = if i == 0 {
                Vec::new()
            } else {
                (0..=255u8).cycle().skip(i as usize).take(64).collect()
            };
            let mut m = NewMessage::new(
                if i % 2 == 0 {
                    "shop.orders"
                } else {
                    "shop.payments"
                },
                payload,
            );
            if i % 3 != 0 {
                m = m.key(format!("k{}", i % 7));
            }
            if i % 5 == 0 {
                m = m
                    .header("content-type", "application/x-test")
                    .header("tenant", format!("t{i}"));
            }
            if i % 4 == 0 {
                m = m.trace_context(TraceContext {
                    traceparent: format!("00-{:032x}-{:016x}-01", i + 1, i + 1),
                    tracestate: (i % 8 == 0).then(|| "v=1".to_string()),
                });
            }
            m
        })
        .collect();
    outbox.enqueue(&messages).await;
    let relay = outbox.relay("amqp-w1", sink);
    outbox.wait_until_drained(Duration::from_secs(60)).await;
    relay.stop().await;

    let got = broker.take(&queue, messages.len()).await;
    let by_id: HashMap<Uuid, &NewMessage> = messages.iter().map(|m| (m.id, m)).collect();
    let mut seen = HashSet::new();
    for delivery in &got {
        let id = message_id(delivery);
        assert!(seen.insert(id), "{id} delivered twice");
        let sent = by_id
            .get(&id)
            .unwrap_or_else(|| panic!("unknown message {id}"));
        assert_eq!(delivery.data, sent.payload, "payload of {id}");
        assert_eq!(delivery.exchange.as_str(), exchange);
        assert_eq!(delivery.routing_key.as_str(), sent.topic);
        let p = &delivery.properties;
        assert_eq!(p.delivery_mode(), &Some(2));
        assert_eq!(
            p.kind().as_ref().map(|t| t.as_str()),
            Some(sent.topic.as_str())
        );
        assert_eq!(p.app_id().as_ref().map(|t| t.as_str()), Some("outbox"));
        assert_eq!(p.timestamp(), &Some(sent.created_at.timestamp() as u64));
        let content_type = sent
            .headers
            .get("content-type")
            .map_or("application/octet-stream", String::as_str);
        assert_eq!(
            p.content_type().as_ref().map(|t| t.as_str()),
            Some(content_type)
        );
        let mut headers = FieldTable::default();
        for (name, value) in &sent.headers {
            headers.insert(name.as_str().into(), text(value));
        }
        if let Some(key) = &sent.key {
            headers.insert("outbox-key".into(), text(key));
        }
        if let Some(trace) = &sent.trace_context {
            headers.insert("traceparent".into(), text(&trace.traceparent));
            if let Some(state) = &trace.tracestate {
                headers.insert("tracestate".into(), text(state));
            }
        }
        assert_eq!(p.headers().as_ref(), Some(&headers), "headers of {id}");
    }
    assert_eq!(seen.len(), messages.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_keep_per_key_order_over_5000_messages() {
    let broker = Broker::connect().await;
    let exchange = broker.exchange().await;
    let queue = broker.queue(&exchange, "#").await;
    let outbox = TestOutbox::new().await;

    let messages: Vec<NewMessage> = (0..5_000u32)
        .map(|i| {
            NewMessage::new("ordered", i.to_be_bytes().to_vec()).key(format!("key-{}", i % 50))
        })
        .collect();
    for chunk in messages.chunks(500) {
        outbox.enqueue(chunk).await;
    }
    let one = outbox.relay("amqp-a", sink(AmqpConfig::new(amqp_url(), &exchange)).await);
    let two = outbox.relay("amqp-b", sink(AmqpConfig::new(amqp_url(), &exchange)).await);
    outbox.wait_until_drained(Duration::from_secs(120)).await;
    one.stop().await;
    two.stop().await;

    let got = broker.take(&queue, messages.len()).await;
    let mut last: HashMap<String, u32> = HashMap::new();
    let mut seen = HashSet::new();
    for delivery in &got {
        assert!(seen.insert(message_id(delivery)), "delivered twice");
        let n = u32::from_be_bytes(delivery.data[..].try_into().expect("4-byte payload"));
        let key = format!("key-{}", n % 50);
        let header = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get("outbox-key").cloned());
        assert_eq!(header, Some(text(&key)));
        if let Some(previous) = last.insert(key.clone(), n) {
            assert!(previous < n, "{key}: message {n} arrived after {previous}");
        }
    }
    assert_eq!(last.len(), 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_messages_are_dead_lettered_and_the_others_delivered() {
    let broker = Broker::connect().await;
    let exchange = broker.exchange().await;
    let queue = broker.queue(&exchange, "routed").await;
    let outbox = TestOutbox::new().await;
    let sink =
        sink(AmqpConfig::new(amqp_url(), &exchange).unroutable(Unroutable::DeadLetter)).await;

    let lost = NewMessage::new("nowhere", b"lost".to_vec());
    let messages = vec![
        NewMessage::new("routed", b"1".to_vec()),
        lost.clone(),
        NewMessage::new("routed", b"2".to_vec()),
    ];
    outbox.enqueue(&messages).await;
    let relay = outbox.relay("amqp-w1", sink);
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;

    let dead = outbox.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, lost.id);
    assert!(dead[0].1.contains("NO_ROUTE"), "{}", dead[0].1);
    let got = broker.take(&queue, 2).await;
    assert_eq!([&got[0].data[..], &got[1].data[..]], [b"1", b"2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_messages_are_retried_until_a_queue_takes_them() {
    let broker = Broker::connect().await;
    let exchange = broker.exchange().await;
    let queue = broker.queue(&exchange, "routed").await;
    let outbox = TestOutbox::new().await;
    let sink = sink(AmqpConfig::new(amqp_url(), &exchange).unroutable(Unroutable::Retry)).await;

    let waiting = NewMessage::new("later", b"waiting".to_vec()).key("k");
    let behind = NewMessage::new("routed", b"behind".to_vec()).key("k");
    let free = NewMessage::new("routed", b"free".to_vec());
    outbox
        .enqueue(&[waiting.clone(), behind.clone(), free.clone()])
        .await;
    let config = WorkerConfig {
        max_attempts: 1_000,
        ..test_worker_config("amqp-w1")
    };
    let relay = outbox.relay_with(config, sink);

    // The unkeyed message flows; the unroutable one is charged attempts and not delivered;
    // the one behind it on its key waits.
    assert_eq!(broker.take(&queue, 1).await[0].data, b"free");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let attempts = outbox.attempts().await;
        if attempts.first().is_some_and(|&a| a >= 2) {
            assert_eq!(
                attempts.len(),
                2,
                "the unroutable message and the one behind it wait"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no retries charged: {attempts:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(outbox.dead_letters().await.is_empty());

    // Once a queue takes it, it is delivered, and then the rest of its key, in order.
    broker.bind(&queue, &exchange, "later").await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;
    relay.stop().await;
    let got = broker.take(&queue, 2).await;
    assert_eq!(message_id(&got[0]), waiting.id);
    assert_eq!(message_id(&got[1]), behind.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_charges_no_attempts_and_delivery_resumes() {
    let broker = Broker::connect().await;
    let exchange = broker.exchange().await;
    let queue = broker.queue(&exchange, "#").await;
    let outbox = TestOutbox::new().await;
    let proxy = Proxy::start(&outbox_tests::host_port(&amqp_url())).await;
    let mut config = AmqpConfig::new(
        amqp_url().replacen(&outbox_tests::host_port(&amqp_url()), &proxy.addr(), 1),
        &exchange,
    );
    config.connect_timeout = Duration::from_secs(2);
    config.publish_timeout = Duration::from_secs(2);
    let relay = outbox.relay("amqp-w1", sink(config).await);

    let before: Vec<NewMessage> = (0..50u32)
        .map(|i| NewMessage::new("t", vec![1, i as u8]).key(format!("k{}", i % 5)))
        .collect();
    outbox.enqueue(&before).await;
    outbox.wait_until_drained(Duration::from_secs(30)).await;

    proxy.cut();
    let during: Vec<NewMessage> = (0..50u32)
        .map(|i| NewMessage::new("t", vec![2, i as u8]).key(format!("k{}", i % 5)))
        .collect();
    outbox.enqueue(&during).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = outbox.stats().await;
    assert_eq!(stats.pending, 50, "nothing delivered while cut: {stats:?}");
    assert_eq!(stats.dead_lettered, 0);
    let attempts = outbox.attempts().await;
    assert!(
        attempts.iter().all(|&a| a == 0),
        "attempts charged during the outage: {attempts:?}"
    );

    proxy.restore();
    outbox.wait_until_drained(Duration::from_secs(60)).await;
    relay.stop().await;
    let got = broker.take(&queue, 100).await;
    let sent: Vec<Uuid> = before.iter().chain(&during).map(|m| m.id).collect();
    let received: Vec<Uuid> = got.iter().map(message_id).collect();
    let unique: HashSet<&Uuid> = received.iter().collect();
    assert_eq!(unique.len(), 100, "every message once");
    // Per key, in enqueue order across the outage.
    for key in 0..5 {
        let order = |ids: &[Uuid]| -> Vec<Uuid> {
            ids.iter()
                .copied()
                .filter(|id| {
                    sent.iter()
                        .position(|s| s == id)
                        .is_some_and(|p| p % 50 % 5 == key)
                })
                .collect()
        };
        assert_eq!(order(&received), order(&sent), "order of k{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_in_the_middle_of_publishing_loses_nothing_and_keeps_key_order() {
    let broker = Broker::connect().await;
    let exchange = broker.exchange().await;
    let queue = broker.queue(&exchange, "#").await;
    let outbox = TestOutbox::new().await;
    let proxy = Proxy::start(&outbox_tests::host_port(&amqp_url())).await;
    let mut config = AmqpConfig::new(
        amqp_url().replacen(&outbox_tests::host_port(&amqp_url()), &proxy.addr(), 1),
        &exchange,
    );
    config.connect_timeout = Duration::from_secs(2);
    config.publish_timeout = Duration::from_secs(2);
    let sink = sink(config).await;

    let total = 3_000usize;
    let messages: Vec<NewMessage> = (0..total as u32)
        .map(|i| NewMessage::new("t", i.to_be_bytes().to_vec()).key(format!("k{}", i % 10)))
        .collect();
    outbox.enqueue(&messages).await;
    let relay = outbox.relay("amqp-w1", sink);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while outbox.stats().await.pending > (total as u64) * 3 / 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay did not start delivering"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stats = outbox.stats().await;
    assert!(
        stats.pending > 0,
        "the cut came too late to test anything: {stats:?}"
    );
    let attempts = outbox.attempts().await;
    assert!(
        attempts.iter().all(|&a| a == 0),
        "attempts charged by the cut: {attempts:?}"
    );
    proxy.restore();
    outbox.wait_until_drained(Duration::from_secs(60)).await;
    relay.stop().await;
    assert!(outbox.dead_letters().await.is_empty());

    // At least once: a message confirmed just before the cut may come again. Per key, the
    // first arrivals are in enqueue order.
    let options = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut consumer = broker
        .channel
        .basic_consume(
            queue.as_str().into(),
            "all".into(),
            options,
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let mut first_seen: HashSet<u32> = HashSet::new();
    let mut last: HashMap<u32, u32> = HashMap::new();
    let mut arrivals = 0;
    while first_seen.len() < total {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "only {} of {total} distinct messages arrived",
                    first_seen.len()
                )
            })
            .expect("consumer open")
            .expect("delivery");
        arrivals += 1;
        let n = u32::from_be_bytes(delivery.data[..].try_into().expect("4-byte payload"));
        if first_seen.insert(n)
            && let Some(previous) = last.insert(n % 10, n)
        {
            assert!(
                previous < n,
                "k{}: {n} first arrived after {previous}",
                n % 10
            );
        }
    }
    println!("{arrivals} arrivals for {total} messages across the cut");
}

/// The AMQP sink under the shared conformance suite: each destination is an exchange of its
/// own with a queue bound to the destination's topic (the routing key).
struct Harness {
    broker: Broker,
    queues: std::sync::Mutex<HashMap<String, String>>,
}

impl Harness {
    const TIMEOUT: Duration = Duration::from_secs(2);

    async fn new() -> Harness {
        Harness {
            broker: Broker::connect().await,
            queues: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn config(url: String, exchange: &str) -> AmqpConfig {
        let mut config = AmqpConfig::new(url, exchange);
        config.connect_timeout = Self::TIMEOUT;
        // The suite's 10,000-message batch took over 2 s of confirms on a loaded 2-core
        // machine; the time-out checks use connect_timeout (health), not this.
        config.publish_timeout = Duration::from_secs(10);
        config
    }
}

#[async_trait::async_trait]
impl outbox_tests::conformance::SinkHarness for Harness {
    fn timeout(&self) -> Duration {
        Self::TIMEOUT
    }

    async fn destination(&self) -> outbox_tests::conformance::Destination {
        let exchange = self.broker.exchange().await;
        let topic = unique_name("conformance");
        let queue = self.broker.queue(&exchange, &topic).await;
        self.queues
            .lock()
            .expect("queues")
            .insert(topic.clone(), queue);
        outbox_tests::conformance::Destination {
            sink: sink(Self::config(amqp_url(), &exchange)).await,
            topic,
        }
    }

    async fn read(
        &self,
        destination: &outbox_tests::conformance::Destination,
        at_least: usize,
    ) -> Vec<outbox_tests::conformance::Received> {
        use outbox_amqp::lapin::options::BasicGetOptions;
        let queue = self.queues.lock().expect("queues")[&destination.topic].clone();
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let message = self
                .broker
                .channel
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get");
            match message {
                Some(message) => got.push(received(&message.delivery)),
                None if got.len() >= at_least || tokio::time::Instant::now() >= deadline => break,
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        got
    }

    async fn sink_at(&self, addr: &str) -> Arc<dyn outbox_core::Sink> {
        let config = Self::config(format!("amqp://guest:guest@{addr}/%2f"), "amq.topic");
        Arc::new(AmqpSink::lazy(config).expect("valid configuration"))
    }

    /// A message no queue is bound for: returned by the broker (`mandatory`).
    async fn refused(
        &self,
        _destination: &outbox_tests::conformance::Destination,
    ) -> Option<outbox_core::Message> {
        Some(outbox_core::Message::from(NewMessage::new(
            unique_name("unbound"),
            "refused",
        )))
    }
}

/// A delivery as the suite sees it: payload, string headers, and the key header.
fn received(delivery: &Delivery) -> outbox_tests::conformance::Received {
    let headers: std::collections::BTreeMap<String, String> = delivery
        .properties
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .filter_map(|(name, value)| match value {
                    AMQPValue::LongString(s) => Some((name.to_string(), s.to_string())),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    outbox_tests::conformance::Received {
        payload: delivery.data.clone(),
        key: headers.get(outbox_amqp::KEY_HEADER).cloned(),
        headers,
    }
}

mod conformance {
    outbox_tests::sink_conformance_tests!(super::Harness::new().await);
}
