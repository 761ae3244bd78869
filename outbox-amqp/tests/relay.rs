//! The AMQP sink behind the relay, against the real PostgreSQL and the real RabbitMQ
//! (`$OUTBOX_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`): the
//! end-to-end scripts, what only AMQP has (unroutable messages, a cut while publishing) and
//! the conformance suite. Each test uses exchanges and queues of its own. Tests of the sink
//! alone are in outbox-amqp/tests/rabbitmq.rs.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use outbox_amqp::lapin::ExchangeKind;
use outbox_amqp::lapin::message::Delivery;
use outbox_amqp::lapin::options::BasicConsumeOptions;
use outbox_amqp::lapin::types::FieldTable;
use outbox_amqp::{AmqpConfig, AmqpSink, Unroutable, wire};
use outbox_core::{Message, NewMessage, Sink, Template, WorkerConfig};
use outbox_test_support::amqp::{Broker, headers, text, url};
use outbox_test_support::envelope::{assert_envelope, publish_full_and_bare};
use outbox_test_support::relay::end_to_end::{self, Arrived, Fixture, trace_context};
use outbox_test_support::relay::{TestOutbox, test_worker_config};
use outbox_test_support::{Proxy, Service, host_port, through, unique_name};
use outbox_testkit::{Destination, Received, SinkHarness};
use uuid::Uuid;

fn template(text: &str) -> Template {
    Template::new(text).expect("a valid template")
}

async fn sink(config: AmqpConfig) -> Arc<AmqpSink> {
    match AmqpSink::connect(config).await {
        Ok(sink) => Arc::new(sink),
        Err(error) => panic!(
            "cannot start the AMQP sink against RabbitMQ at {}: {error}",
            Service::Amqp.addr()
        ),
    }
}

/// A sink publishing to `exchange` through the proxy at `proxy`, with 2 s time-outs.
async fn proxied_sink(proxy: &str, exchange: &str) -> Arc<AmqpSink> {
    let mut config = AmqpConfig::new(through(&url(), proxy), template(exchange));
    config.connect_timeout = Duration::from_secs(2);
    config.publish_timeout = Duration::from_secs(2);
    sink(config).await
}

fn message_id(delivery: &Delivery) -> Uuid {
    let id = outbox_test_support::amqp::message_id(delivery);
    Uuid::parse_str(id).expect("message_id is a UUID")
}

/// The sink under the end-to-end scripts: each destination is a topic exchange of its own
/// with one queue bound to everything.
struct Amqp {
    broker: Broker,
}

impl Amqp {
    async fn new() -> Amqp {
        Amqp {
            broker: Broker::connect().await,
        }
    }
}

struct Exchange {
    exchange: String,
    queue: String,
}

#[async_trait]
impl Fixture for Amqp {
    type Native = Delivery;
    type Destination = Exchange;

    const SERVICE: Service = Service::Amqp;

    async fn destination(&self, _topics: &[&str], _via: Option<&str>) -> Exchange {
        let exchange = self.broker.exchange(ExchangeKind::Topic).await;
        let queue = self.broker.queue(&exchange, "#").await;
        Exchange { exchange, queue }
    }

    async fn sink(&self, destination: &Exchange, via: Option<&str>) -> Arc<dyn Sink> {
        match via {
            Some(proxy) => proxied_sink(proxy, &destination.exchange).await,
            None => sink(AmqpConfig::new(url(), template(&destination.exchange))).await,
        }
    }

    async fn read(&self, destination: &Exchange, count: usize) -> Vec<Arrived<Delivery>> {
        let got = self.broker.take(&destination.queue, count).await;
        got.into_iter()
            .map(|delivery| {
                let headers = headers(&delivery);
                Arrived {
                    id: message_id(&delivery),
                    topic: delivery.routing_key.to_string(),
                    key: headers.get(wire::KEY).cloned(),
                    payload: delivery.data.clone(),
                    trace_context: trace_context(
                        headers.get(wire::TRACEPARENT).cloned(),
                        headers.get(wire::TRACESTATE).cloned(),
                    ),
                    headers,
                    // The receipt is the exchange and routing key.
                    receipt: Some(format!("{}/{}", delivery.exchange, delivery.routing_key)),
                    native: delivery,
                }
            })
            .collect()
    }
}

/// Through PostgreSQL and the relay: the envelope read back from the headers table by its
/// documented names with plain lapin, the native properties filled as well (`message_id`,
/// `content_type`, `timestamp`, `type`), and the message's own headers beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_delivers_every_message_once_with_exact_properties() {
    for (sent, got) in end_to_end::round_trip(&Amqp::new().await).await {
        let (id, p) = (sent.id, &got.native.properties);
        let sent = Message::from(sent);
        assert_envelope(&sent, "delivery", |name| got.headers.get(name).cloned());
        assert_eq!(p.delivery_mode(), &Some(2));
        assert_eq!(
            p.kind().as_ref().map(|t| t.as_str()),
            Some(sent.topic.as_str())
        );
        assert_eq!(p.app_id().as_ref().map(|t| t.as_str()), Some("outbox"));
        assert_eq!(p.timestamp(), &Some(sent.created_at.timestamp() as u64));
        assert_eq!(
            outbox_test_support::amqp::message_id(&got.native),
            got.headers["outbox-id"],
            "message_id is the envelope's id"
        );
        assert_eq!(
            p.content_type().as_ref().map(|t| t.as_str()),
            got.headers.get("content-type").map(String::as_str),
            "content_type is the envelope's"
        );
        let mut headers = FieldTable::default();
        for (name, value) in &sent.headers {
            headers.insert(name.as_str().into(), text(value));
        }
        for name in outbox_test_support::envelope::NAMES {
            if let Some(value) = got.headers.get(name) {
                headers.insert(name.into(), text(value));
            }
        }
        assert_eq!(p.headers().as_ref(), Some(&headers), "headers of {id}");
    }
}

/// The sink alone, read with plain lapin: every envelope field of a full message and of a
/// bare one by its documented name, with the native properties; an application header
/// named like an envelope field does not change it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envelope_fields_are_read_by_their_documented_names() {
    let broker = Broker::connect().await;
    let (exchange, queue) = broker.exchange_and_queue(ExchangeKind::Topic, "#").await;
    let sink = sink(AmqpConfig::new(url(), template(&exchange))).await;
    let [full, bare] = publish_full_and_bare(&*sink, "orders").await;
    let got = broker.take(&queue, 2).await;
    for (sent, delivery) in [&full, &bare].into_iter().zip(&got) {
        let headers = headers(delivery);
        assert_envelope(sent, "delivery", |name| headers.get(name).cloned());
        let p = &delivery.properties;
        assert_eq!(
            p.message_id().as_ref().map(|t| t.to_string()),
            Some(sent.id.to_string())
        );
        assert_eq!(
            p.content_type().as_ref().map(|t| t.to_string()),
            headers.get("content-type").cloned()
        );
        assert_eq!(p.timestamp(), &Some(sent.created_at.timestamp() as u64));
    }
    let first = headers(&got[0]);
    assert_eq!(first["x-tenant"], "acme");
    assert_eq!(first["outbox-id"], full.id.to_string(), "the envelope wins");
    assert_eq!(
        headers(&got[1]).len(),
        5,
        "a bare message has the five fields that are always there"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_keep_per_key_order_over_5000_messages() {
    end_to_end::per_key_order_with_two_relays(&Amqp::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_charges_no_attempts_and_delivery_resumes() {
    end_to_end::outage(&Amqp::new().await).await;
}

/// A topic exchange and a queue of it that takes topic `routed` only (their names), an
/// outbox, and a sink to the exchange that handles an unroutable message as `setting` says.
async fn routed_only(setting: Unroutable) -> (Broker, String, String, TestOutbox, Arc<AmqpSink>) {
    let broker = Broker::connect().await;
    let (exchange, queue) = broker
        .exchange_and_queue(ExchangeKind::Topic, "routed")
        .await;
    let outbox = TestOutbox::new().await;
    let sink = sink(AmqpConfig::new(url(), template(&exchange)).unroutable(setting)).await;
    (broker, exchange, queue, outbox, sink)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_messages_are_dead_lettered_and_the_others_delivered() {
    let (broker, _, queue, outbox, sink) = routed_only(Unroutable::DeadLetter).await;

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
    let (broker, exchange, queue, outbox, sink) = routed_only(Unroutable::Retry).await;

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
async fn a_cut_in_the_middle_of_publishing_loses_nothing_and_keeps_key_order() {
    let broker = Broker::connect().await;
    let (exchange, queue) = broker.exchange_and_queue(ExchangeKind::Topic, "#").await;
    let outbox = TestOutbox::new().await;
    let proxy = Proxy::start(&host_port(&url())).await;
    let sink = proxied_sink(&proxy.addr(), &exchange).await;

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
        let mut config = AmqpConfig::new(url, template(exchange));
        config.connect_timeout = Self::TIMEOUT;
        // The suite's 10,000-message batch took over 2 s of confirms on a loaded 2-core
        // machine; the time-out checks use connect_timeout (health), not this.
        config.publish_timeout = Duration::from_secs(10);
        config
    }
}

#[async_trait]
impl SinkHarness for Harness {
    fn timeout(&self) -> Duration {
        Self::TIMEOUT
    }

    async fn destination(&self) -> Destination {
        let exchange = self.broker.exchange(ExchangeKind::Topic).await;
        let topic = unique_name("conformance");
        let queue = self.broker.queue(&exchange, &topic).await;
        self.queues
            .lock()
            .expect("queues")
            .insert(topic.clone(), queue);
        Destination {
            sink: sink(Self::config(url(), &exchange)).await,
            topic,
        }
    }

    async fn read(&self, destination: &Destination, at_least: usize) -> Vec<Received> {
        let queue = self.queues.lock().expect("queues")[&destination.topic].clone();
        let got = self
            .broker
            .get(&queue, at_least, Duration::from_secs(10))
            .await;
        got.iter()
            .map(|delivery| {
                let headers = headers(delivery);
                Received {
                    payload: delivery.data.clone(),
                    key: headers.get(wire::KEY).cloned(),
                    headers,
                }
            })
            .collect()
    }

    async fn sink_at(&self, addr: &str) -> Option<Arc<dyn Sink>> {
        let config = Self::config(through(&url(), addr), "amq.topic");
        Some(Arc::new(
            AmqpSink::lazy(config).expect("valid configuration"),
        ))
    }

    /// A message no queue is bound for: returned by the broker (`mandatory`).
    async fn refused(&self, _destination: &Destination) -> Option<Message> {
        Some(Message::from(NewMessage::new(
            unique_name("unbound"),
            "refused",
        )))
    }
}

mod conformance {
    outbox_testkit::sink_conformance_tests!(super::Harness::new().await);
}
