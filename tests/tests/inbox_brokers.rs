//! The inbox against the real brokers (Redis, RabbitMQ, NATS with JetStream, Kafka/tansu on
//! their standard ports) and the real PostgreSQL: messages the relay published from the
//! outbox arrive more than once, and a consumer built on the broker's plain client processes
//! each once. The consumer reads the envelope with the sink crate's `consumer::received`,
//! and for each delivery runs one transaction: `Inbox::process` records the message id, the
//! business change (a row in `effects`) is written when the id is new, then it commits, then
//! it acknowledges.
//!
//! The duplicates are the real ones: a relay that crashed after publishing a batch (claimed
//! under a 1 s lease, published, never settled) and a relay that publishes it again once the
//! lease ran out; a consumer killed after its commit and before its acknowledgement, whose
//! deliveries the broker gives to the next consumer (Redis XAUTOCLAIM, an AMQP channel
//! closed with deliveries unacknowledged, JetStream's ack wait, Kafka's committed offset);
//! and a handler failing once, rolled back and not acknowledged, processed when redelivered.
//! `effects` has no unique constraint, so a second effect of one message would show: each
//! test checks one row per message id, for every message, with its payload.
//!
//! Each broker also has two consumers handling one message id at the same time (the
//! broker handing a delivery to a second consumer while the first still works on it): one
//! processes it, the other waits on the inbox record and skips it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use outbox_core::envelope::Received;
use outbox_core::{NewMessage, Outcome, Sink, Storage, Template, TraceContext};
use outbox_postgres::Inbox;
use outbox_test_support::{Service, unique_name};
use outbox_tests::TestOutbox;
use sqlx::PgPool;
use tokio::sync::Barrier;
use uuid::Uuid;

/// The consumer's name in the inbox.
const CONSUMER: &str = "billing";
/// The outbox topic of every message.
const TOPIC: &str = "invoices";
/// Messages per test, over [`KEYS`] keys.
const MESSAGES: usize = 40;
const KEYS: usize = 5;
/// How many messages the crashed relay claims and publishes.
const CRASHED: usize = 12;
/// Every tenth message's handler fails on its first run.
fn fails_once(index: usize) -> bool {
    index % 10 == 3
}
const FAILING: usize = MESSAGES / 10;
/// The consumer that dies is killed after its commit and before its acknowledgement of
/// every fourth delivery.
fn killed_before_ack(delivery: usize) -> bool {
    delivery % 4 == 1
}
/// How long a test waits for a delivery before it fails.
const WAIT: Duration = Duration::from_secs(10);

/// What one delivery's handling came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Handled {
    /// A new message: its effect committed with the inbox record. Acknowledge.
    Processed,
    /// A duplicate: skipped, nothing written. Acknowledge.
    Duplicate,
    /// The handler failed: the effect and the inbox record rolled back. Do not acknowledge.
    Failed,
}

/// The consumer's side in PostgreSQL, in the test outbox's schema (dropped with it): the
/// inbox and the business table `effects`.
struct Billing {
    pool: PgPool,
    inbox: Inbox,
    /// `"schema".effects`: one row per effect, no unique constraint.
    effects: String,
    /// What was sent, by id: each delivery's envelope is checked against it.
    sent: HashMap<Uuid, NewMessage>,
    /// Message ids whose handler fails on its first run.
    fail_once: Mutex<HashSet<Uuid>>,
    counts: Mutex<HashMap<Handled, usize>>,
}

impl Billing {
    /// The inbox (migrated) and the business table, next to `outbox`, for the deliveries of
    /// `messages`; the handlers of those [`fails_once`] picks fail once.
    async fn new(outbox: &TestOutbox, messages: &[NewMessage]) -> Arc<Billing> {
        let schema = outbox.table.schema();
        let inbox = Inbox::new(schema, "inbox").expect("valid inbox names");
        let mut conn = outbox.pool.acquire().await.expect("a connection");
        inbox.migrate(&mut conn).await.expect("migrate the inbox");
        let effects = format!(r#""{schema}".effects"#);
        let create = format!("CREATE TABLE {effects} (message_id uuid NOT NULL, payload bytea)");
        sqlx::query(&create)
            .execute(&outbox.pool)
            .await
            .expect("create the effects table");
        let fail_once = messages
            .iter()
            .enumerate()
            .filter(|(i, _)| fails_once(*i))
            .map(|(_, m)| m.id)
            .collect();
        Arc::new(Billing {
            pool: outbox.pool.clone(),
            inbox,
            effects,
            sent: messages.iter().map(|m| (m.id, m.clone())).collect(),
            fail_once: Mutex::new(fail_once),
            counts: Mutex::default(),
        })
    }

    /// Handles one delivery as the consumer does, in one transaction.
    async fn handle(&self, received: &Received, payload: &[u8]) -> Handled {
        self.run(received, payload, None).await
    }

    /// The transaction of one delivery. With `race`, it waits for the other racer inside
    /// its transaction before the inbox, and a winner holds its record a moment before
    /// committing, so the other's `process` runs while it is uncommitted.
    async fn run(&self, received: &Received, payload: &[u8], race: Option<&Barrier>) -> Handled {
        let id = received.id;
        let sent = self.sent.get(&id).expect("a delivery of a message sent");
        assert_eq!(received.topic, sent.topic, "topic of {id}");
        assert_eq!(received.key, sent.key, "key of {id}");
        let created = received.created_at.map(|t| t.timestamp_micros());
        assert_eq!(
            created,
            Some(sent.created_at.timestamp_micros()),
            "created at of {id}"
        );
        assert_eq!(payload, sent.payload, "payload of {id}");
        let content_type = sent.headers.get("content-type").map(String::as_str);
        assert_eq!(received.content_type.as_deref(), content_type, "{id}");
        assert_eq!(received.trace, sent.trace_context, "trace context of {id}");
        let mut tx = self.pool.begin().await.expect("begin");
        if let Some(barrier) = race {
            barrier.wait().await;
        }
        let new = self
            .inbox
            .process(&mut tx, CONSUMER, id)
            .await
            .unwrap_or_else(|e| panic!("inbox.process of {id}: {e}"));
        let handled = if new {
            sqlx::query(&format!(
                "INSERT INTO {} (message_id, payload) VALUES ($1, $2)",
                self.effects
            ))
            .bind(id)
            .bind(payload)
            .execute(&mut *tx)
            .await
            .expect("write the effect");
            let failing = self
                .fail_once
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id);
            if failing {
                Handled::Failed
            } else {
                if race.is_some() {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Handled::Processed
            }
        } else {
            Handled::Duplicate
        };
        if handled == Handled::Failed {
            tx.rollback().await.expect("rollback");
        } else {
            tx.commit().await.expect("commit");
        }
        *self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(handled)
            .or_default() += 1;
        handled
    }

    /// Two consumers handling deliveries of one message id at the same time, each in a task
    /// of its own; their outcomes, sorted.
    async fn race(
        self: &Arc<Self>,
        a: (Received, Vec<u8>),
        b: (Received, Vec<u8>),
    ) -> Vec<Handled> {
        assert_eq!(a.0.id, b.0.id, "two deliveries of one message");
        let barrier = Arc::new(Barrier::new(2));
        let tasks = [a, b].map(|(received, payload)| {
            let (billing, barrier) = (self.clone(), barrier.clone());
            tokio::spawn(async move { billing.run(&received, &payload, Some(&barrier)).await })
        });
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.expect("consumer task"));
        }
        outcomes.sort();
        outcomes
    }

    fn count(&self, handled: Handled) -> usize {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.get(&handled).copied().unwrap_or(0)
    }

    /// `effects` holds exactly one row per message of `sent`, with its payload, and nothing
    /// else.
    async fn assert_each_once(&self, sent: &[NewMessage]) {
        let rows: Vec<(Uuid, Vec<u8>)> =
            sqlx::query_as(&format!("SELECT message_id, payload FROM {}", self.effects))
                .fetch_all(&self.pool)
                .await
                .expect("read the effects");
        let mut by_id: BTreeMap<Uuid, Vec<Vec<u8>>> = BTreeMap::new();
        for (id, payload) in rows {
            by_id.entry(id).or_default().push(payload);
        }
        for message in sent {
            let effects = by_id.remove(&message.id).unwrap_or_default();
            assert_eq!(effects.len(), 1, "effects of message {}", message.id);
            assert_eq!(effects[0], message.payload, "payload of {}", message.id);
        }
        assert!(
            by_id.is_empty(),
            "effects of messages never sent: {by_id:?}"
        );
    }

    /// After the whole run of `what` (begun at `started`): each message of `sent` had its
    /// effect once ([`Billing::assert_each_once`]), every message was processed once, each
    /// failing handler failed once (and its message was processed on a redelivery), and
    /// there were duplicates to skip, at least one for each of the `crashed` published twice.
    async fn assert_run(&self, sent: &[NewMessage], crashed: usize, what: &str, started: Instant) {
        self.assert_each_once(sent).await;
        let (processed, duplicates, failed) = (
            self.count(Handled::Processed),
            self.count(Handled::Duplicate),
            self.count(Handled::Failed),
        );
        eprintln!(
            "[{what}] processed {processed}, skipped {duplicates} duplicates, {failed} handler \
             failures"
        );
        assert_eq!(processed, MESSAGES, "{what}: processed once each");
        assert_eq!(failed, FAILING, "{what}: each failing handler failed once");
        // Each message of the crashed batch came twice: at least one copy was a duplicate.
        assert!(
            duplicates >= crashed,
            "{what}: {duplicates} duplicates skipped, fewer than the {crashed} republished"
        );
        eprintln!("[{what}] {:?}", started.elapsed());
    }
}

/// [`MESSAGES`] messages of [`KEYS`] keys.
fn messages() -> Vec<NewMessage> {
    (0..MESSAGES)
        .map(|i| {
            let message = NewMessage::json(TOPIC, &serde_json::json!({ "invoice": i }))
                .expect("JSON")
                .key(format!("customer-{}", i % KEYS));
            match i % 3 {
                0 => message.trace_context(TraceContext {
                    traceparent: format!("00-{:032x}-{:016x}-01", i + 1, i + 1),
                    tracestate: Some("billing=1".into()),
                }),
                _ => message,
            }
        })
        .collect()
}

/// Enqueues [`messages`]; a relay claims [`CRASHED`] of them under a 1 s lease, publishes
/// them through `crashed` and dies before recording the delivery; a relay started next
/// publishes everything through `sink`, the crashed batch again once its lease ran out.
/// Returns the test outbox (its schema holds the consumer's tables), the messages, the ids
/// published twice and the consumer's [`Billing`] for the messages.
async fn relay_with_a_crash(
    crashed: Arc<dyn Sink>,
    sink: Arc<dyn Sink>,
) -> (TestOutbox, Vec<NewMessage>, Vec<Uuid>, Arc<Billing>) {
    let outbox = TestOutbox::new().await;
    let messages = messages();
    outbox.enqueue(&messages).await;
    let claim = outbox
        .storage
        .claim("crashed-relay", CRASHED, Duration::from_secs(1))
        .await
        .expect("claim");
    assert!(
        !claim.messages.is_empty(),
        "the crashed relay claimed nothing"
    );
    let outcomes = crashed.publish(&claim.messages).await.expect("publish");
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Delivered(_))),
        "{outcomes:?}"
    );
    drop(crashed);
    let relay = outbox.relay("inbox-relay", sink);
    outbox
        .drained_with_no_dead_letters(Duration::from_secs(20))
        .await;
    relay.stop().await;
    let twice = claim.messages.iter().map(|m| m.id).collect();
    let billing = Billing::new(&outbox, &messages).await;
    (outbox, messages, twice, billing)
}

/// One message through the relay: the test outbox (its schema holds the consumer's
/// tables), the message and the consumer's [`Billing`] for it.
async fn relay_one(sink: Arc<dyn Sink>) -> (TestOutbox, NewMessage, Arc<Billing>) {
    let outbox = TestOutbox::new().await;
    let message = NewMessage::json(TOPIC, &serde_json::json!({ "invoice": "raced" }))
        .expect("JSON")
        .key("customer-0");
    outbox.enqueue(std::slice::from_ref(&message)).await;
    let relay = outbox.relay("inbox-relay", sink);
    outbox
        .drained_with_no_dead_letters(Duration::from_secs(20))
        .await;
    relay.stop().await;
    let billing = Billing::new(&outbox, std::slice::from_ref(&message)).await;
    (outbox, message, billing)
}

/// Asserts that two consumers raced on one id: one processed it, the other skipped it.
fn assert_one_won(outcomes: &[Handled], what: &str) {
    assert_eq!(
        outcomes,
        [Handled::Processed, Handled::Duplicate],
        "{what}: two consumers at once on one message id"
    );
}

mod redis {
    use outbox_redis::consumer::{payload, received};
    use outbox_redis::redis::AsyncCommands;
    use outbox_redis::redis::aio::MultiplexedConnection;
    use outbox_redis::redis::streams::{
        StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamPendingReply,
        StreamReadOptions, StreamReadReply,
    };
    use outbox_redis::{RedisConfig, RedisSink};
    use outbox_test_support::redis::{client, delete_prefixed, url};

    use super::*;

    const GROUP: &str = "billing";

    /// A stream of the test's own (under `prefix`) with the consumer group, and a sink that
    /// appends to it.
    async fn setup(prefix: &str) -> (MultiplexedConnection, String, impl Fn() -> Arc<dyn Sink>) {
        let mut con = client().await;
        let stream = format!("{prefix}{TOPIC}");
        let () = con
            .xgroup_create_mkstream(&stream, GROUP, "0")
            .await
            .expect("XGROUP CREATE");
        let prefix = prefix.to_string();
        let sink = move || -> Arc<dyn Sink> {
            let config = RedisConfig::new(url()).stream_prefix(&prefix);
            Arc::new(RedisSink::new(config).expect("valid sink configuration"))
        };
        (con, stream, sink)
    }

    /// New entries for consumer `me` of the group (`XREADGROUP ... >`).
    async fn read_new(
        con: &mut MultiplexedConnection,
        stream: &str,
        me: &str,
        count: usize,
    ) -> Vec<StreamId> {
        let options = StreamReadOptions::default().group(GROUP, me).count(count);
        let reply: Option<StreamReadReply> = con
            .xread_options(&[stream], &[">"], &options)
            .await
            .expect("XREADGROUP");
        reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .collect()
    }

    /// What other consumers left pending, taken over by `me` (`XAUTOCLAIM`, no idle time).
    async fn take_over(con: &mut MultiplexedConnection, stream: &str, me: &str) -> Vec<StreamId> {
        let options = StreamAutoClaimOptions::default().count(1000);
        let reply: StreamAutoClaimReply = con
            .xautoclaim_options(stream, GROUP, me, 0, "0-0", options)
            .await
            .expect("XAUTOCLAIM");
        reply.claimed
    }

    async fn ack(con: &mut MultiplexedConnection, stream: &str, entry: &StreamId) {
        let acked: usize = con.xack(stream, GROUP, &[&entry.id]).await.expect("XACK");
        assert_eq!(acked, 1, "XACK of {}", entry.id);
    }

    fn delivery(entry: &StreamId) -> (Received, Vec<u8>) {
        let received = received(entry).expect("an outbox message");
        let payload = payload(entry).expect("a payload field").to_vec();
        (received, payload)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redeliveries_are_processed_once() {
        let started = Instant::now();
        let prefix = format!("{}:", unique_name("outbox_inbox"));
        let (mut con, stream, sink) = setup(&prefix).await;
        let (_outbox, messages, crashed, billing) = relay_with_a_crash(sink(), sink()).await;

        // Consumer a reads everything, handles it and dies: it acknowledged neither its
        // failed deliveries nor those it was killed before acknowledging.
        let entries = read_new(&mut con, &stream, "a", 1000).await;
        assert_eq!(
            entries.len(),
            MESSAGES + crashed.len(),
            "the crashed batch twice"
        );
        let mut unacked = 0;
        for (i, entry) in entries.iter().enumerate() {
            let (received, payload) = delivery(entry);
            let handled = billing.handle(&received, &payload).await;
            if handled == Handled::Failed || killed_before_ack(i) {
                unacked += 1;
            } else {
                ack(&mut con, &stream, entry).await;
            }
        }

        // Consumer b takes over what a left pending.
        let mut redelivered = 0;
        for _ in 0..5 {
            let entries = take_over(&mut con, &stream, "b").await;
            if entries.is_empty() {
                break;
            }
            for entry in &entries {
                redelivered += 1;
                let (received, payload) = delivery(entry);
                if billing.handle(&received, &payload).await != Handled::Failed {
                    ack(&mut con, &stream, entry).await;
                }
            }
        }
        let pending: StreamPendingReply = con.xpending(&stream, GROUP).await.expect("XPENDING");
        assert_eq!(pending.count(), 0, "every entry acknowledged");
        assert!(read_new(&mut con, &stream, "b", 10).await.is_empty());
        assert_eq!(redelivered, unacked, "b got what a left");

        billing
            .assert_run(&messages, crashed.len(), "redis", started)
            .await;
        delete_prefixed(&prefix).await;
    }

    /// Consumer a reads an entry and is still working on it when consumer b claims it
    /// (`XAUTOCLAIM`): both handle it at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_consumers_on_one_entry_at_once_make_one_effect() {
        let prefix = format!("{}:", unique_name("outbox_inbox"));
        let (mut con, stream, sink) = setup(&prefix).await;
        let (_outbox, message, billing) = relay_one(sink()).await;

        let a = read_new(&mut con, &stream, "a", 10).await;
        let b = take_over(&mut con, &stream, "b").await;
        assert_eq!((a.len(), b.len()), (1, 1), "a read it, b claimed it");
        assert_eq!(a[0].id, b[0].id, "the same entry");
        let outcomes = billing.race(delivery(&a[0]), delivery(&b[0])).await;
        assert_one_won(&outcomes, "redis");
        ack(&mut con, &stream, &b[0]).await;
        billing.assert_each_once(&[message]).await;
        delete_prefixed(&prefix).await;
    }
}

mod amqp {
    use outbox_amqp::consumer::received;
    use outbox_amqp::lapin::message::Delivery;
    use outbox_amqp::lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicQosOptions,
    };
    use outbox_amqp::lapin::types::FieldTable;
    use outbox_amqp::lapin::{Channel, ExchangeKind};
    use outbox_amqp::{AmqpConfig, AmqpSink};
    use outbox_test_support::amqp::{Broker, url};

    use super::*;

    /// The test's own connection, a topic exchange and a queue bound to all of it (both
    /// gone with the connection), and a sink publishing to the exchange.
    async fn setup() -> (Broker, String, impl AsyncFn() -> Arc<dyn Sink>) {
        let broker = Broker::connect().await;
        let (exchange, queue) = broker.exchange_and_queue(ExchangeKind::Topic, "#").await;
        let sink = async move || -> Arc<dyn Sink> {
            let template = Template::new(&exchange).expect("a valid template");
            match AmqpSink::connect(AmqpConfig::new(url(), template)).await {
                Ok(sink) => Arc::new(sink) as Arc<dyn Sink>,
                Err(e) => Service::Amqp.missing(e),
            }
        };
        (broker, queue, sink)
    }

    fn delivery(delivery: &Delivery) -> (Received, Vec<u8>) {
        let received = received(delivery).expect("an outbox message");
        (received, delivery.data.clone())
    }

    /// The next message of `queue` on `channel`, unacknowledged, waiting for it up to
    /// [`WAIT`].
    async fn get(channel: &Channel, queue: &str) -> Delivery {
        outbox_test_support::poll(WAIT, Duration::from_millis(20), || async {
            let got = channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await
                .expect("basic.get");
            got.map(|message| message.delivery)
                .ok_or_else(|| format!("nothing in {queue}"))
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redeliveries_are_processed_once() {
        let started = Instant::now();
        let (broker, queue, sink) = setup().await;
        let (_outbox, messages, crashed, billing) =
            relay_with_a_crash(sink().await, sink().await).await;

        // Consumer a: every delivery at once (prefetch), acknowledged after its commit; a
        // failed handler nacks it back into the queue, so a gets it again. Killed before
        // acknowledging some, its channel closes and RabbitMQ requeues them.
        let a = broker.open_channel().await;
        a.basic_qos(500, BasicQosOptions::default())
            .await
            .expect("basic.qos");
        let mut deliveries = a
            .basic_consume(
                queue.as_str().into(),
                "a".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("basic.consume");
        let mut unacked = 0;
        for i in 0..MESSAGES + crashed.len() + FAILING {
            let next = tokio::time::timeout(WAIT, deliveries.next()).await;
            let next = next.unwrap_or_else(|_| panic!("delivery {i} within {WAIT:?}"));
            let got = next.expect("the consumer goes on").expect("a delivery");
            let (received, payload) = delivery(&got);
            match billing.handle(&received, &payload).await {
                Handled::Failed => {
                    let requeue = BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    };
                    got.nack(requeue).await.expect("basic.nack");
                }
                _ if killed_before_ack(i) => unacked += 1,
                _ => {
                    got.ack(BasicAckOptions::default())
                        .await
                        .expect("basic.ack");
                }
            }
        }
        a.close(200, "killed".into())
            .await
            .expect("close the channel");

        // Consumer b gets what a left, one message at a time.
        let b = broker.open_channel().await;
        for _ in 0..unacked {
            let got = get(&b, &queue).await;
            assert!(got.redelivered, "a redelivery");
            let (received, payload) = delivery(&got);
            assert_eq!(
                billing.handle(&received, &payload).await,
                Handled::Duplicate
            );
            got.ack(BasicAckOptions::default())
                .await
                .expect("basic.ack");
        }
        let left = b
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .expect("basic.get");
        assert!(left.is_none(), "nothing left: {left:?}");

        billing
            .assert_run(&messages, crashed.len(), "amqp", started)
            .await;
    }

    /// Consumer a got a message and still works on it when its channel goes (a missed
    /// heartbeat, say): RabbitMQ gives it to consumer b, and both handle it at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_consumers_on_one_message_at_once_make_one_effect() {
        let (broker, queue, sink) = setup().await;
        let (_outbox, message, billing) = relay_one(sink().await).await;

        let a = broker.open_channel().await;
        let first = get(&a, &queue).await;
        a.close(200, "gone".into())
            .await
            .expect("close the channel");
        let b = broker.open_channel().await;
        let second = get(&b, &queue).await;
        assert!(second.redelivered, "a redelivery");
        let outcomes = billing.race(delivery(&first), delivery(&second)).await;
        assert_one_won(&outcomes, "amqp");
        second
            .ack(BasicAckOptions::default())
            .await
            .expect("basic.ack");
        billing.assert_each_once(&[message]).await;
    }
}

mod nats {
    use outbox_nats::async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
    use outbox_nats::async_nats::jetstream::{self, AckKind, stream};
    use outbox_nats::consumer::received;
    use outbox_nats::{NatsConfig, NatsSink};
    use outbox_test_support::nats::{connect, url};

    use super::*;

    /// How long JetStream waits for an acknowledgement before it redelivers.
    const ACK_WAIT: Duration = Duration::from_secs(2);

    /// A stream of the test's own capturing every subject under its name, a sink publishing
    /// there, and a durable pull consumer of it. The stream's de-duplication window is
    /// shorter than the crashed relay's lease: its batch published again after the lease
    /// reaches the consumer twice, as with any window once a lease outlasts it.
    async fn setup() -> (jetstream::Context, String, impl Fn() -> Arc<dyn Sink>) {
        let js = connect().await;
        let name = unique_name("inbox");
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            storage: stream::StorageType::Memory,
            max_age: Duration::from_secs(3600),
            duplicate_window: Duration::from_millis(200),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("creating JetStream stream {name} at {}: {e}", url()));
        let config = pull::Config {
            durable_name: Some(CONSUMER.into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            ..Default::default()
        };
        let stream = js.get_stream(&name).await.expect("the stream");
        stream
            .create_consumer(config)
            .await
            .expect("create the durable consumer");
        let prefix = format!("{name}.");
        let sink = move || -> Arc<dyn Sink> {
            let config = NatsConfig {
                subject_prefix: prefix.clone(),
                ..NatsConfig::new(url())
            };
            Arc::new(NatsSink::new(config).expect("valid sink configuration"))
        };
        (js, name, sink)
    }

    /// The durable consumer, on a connection of its own (a consumer process).
    async fn consumer(name: &str) -> PullConsumer {
        let js = connect().await;
        let stream = js.get_stream(name).await.expect("the stream");
        stream
            .get_consumer(CONSUMER)
            .await
            .expect("the durable consumer")
    }

    /// Up to `max` messages for `consumer`, those that come within half a second.
    async fn fetch(consumer: &PullConsumer, max: usize) -> pull::Batch {
        (consumer.fetch().max_messages(max))
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .expect("fetch")
    }

    /// The next message for `consumer`, waiting up to [`WAIT`].
    async fn next(consumer: &PullConsumer) -> jetstream::Message {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let mut batch = fetch(consumer, 1).await;
            if let Some(message) = batch.next().await {
                return message.expect("a message");
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no message within {WAIT:?}"
            );
        }
    }

    fn delivery(message: &jetstream::Message) -> (Received, Vec<u8>) {
        let received = received(message).expect("an outbox message");
        (received, message.payload.to_vec())
    }

    async fn ack(message: &jetstream::Message) {
        message.double_ack().await.expect("acknowledge");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redeliveries_are_processed_once() {
        let started = Instant::now();
        let (js, name, sink) = setup().await;
        let (_outbox, messages, crashed, billing) = relay_with_a_crash(sink(), sink()).await;

        // Consumer a: acknowledges after each commit, naks a delivery whose handler failed
        // (JetStream redelivers it at once), and dies before acknowledging some.
        let a = consumer(&name).await;
        let mut stream = a.messages().await.expect("consume");
        let mut unacked = 0;
        for i in 0..MESSAGES + crashed.len() + FAILING {
            let next = tokio::time::timeout(WAIT, stream.next()).await;
            let next = next.unwrap_or_else(|_| panic!("delivery {i} within {WAIT:?}"));
            let message = next.expect("the stream goes on").expect("a message");
            let (received, payload) = delivery(&message);
            match billing.handle(&received, &payload).await {
                Handled::Failed => message.ack_with(AckKind::Nak(None)).await.expect("nak"),
                _ if killed_before_ack(i) => unacked += 1,
                _ => ack(&message).await,
            }
        }
        drop((stream, a));

        // Consumer b, once the acknowledgement wait of a's deliveries ran out, until
        // JetStream has nothing left for the consumer.
        let mut b = consumer(&name).await;
        let mut redelivered = 0;
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let info = b.info().await.expect("consumer info");
            if (info.num_pending, info.num_ack_pending) == (0, 0) {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "left: {info:?}");
            let mut batch = fetch(&b, 100).await;
            while let Some(message) = batch.next().await {
                let message = message.expect("a message");
                if message.info().expect("JetStream metadata").delivered > 1 {
                    redelivered += 1;
                }
                let (received, payload) = delivery(&message);
                if billing.handle(&received, &payload).await != Handled::Failed {
                    ack(&message).await;
                }
            }
        }
        // As many as a left, unless a was slower than the wait and got some back itself.
        assert!(
            redelivered > 0 && unacked > 0,
            "{redelivered} redeliveries, {unacked} left unacknowledged"
        );

        billing
            .assert_run(&messages, crashed.len(), "nats", started)
            .await;
        js.delete_stream(&name).await.expect("delete the stream");
    }

    /// Consumer a still works on a message when its acknowledgement wait runs out:
    /// JetStream gives it to consumer b, and both handle it at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_consumers_on_one_message_at_once_make_one_effect() {
        let (js, name, sink) = setup().await;
        let (_outbox, message, billing) = relay_one(sink()).await;

        let first = next(&consumer(&name).await).await;
        let second = next(&consumer(&name).await).await;
        let info = second.info().expect("JetStream metadata");
        assert_eq!(info.delivered, 2, "a redelivery: {info:?}");
        let outcomes = billing.race(delivery(&first), delivery(&second)).await;
        assert_one_won(&outcomes, "nats");
        ack(&second).await;
        billing.assert_each_once(&[message]).await;
        js.delete_stream(&name).await.expect("delete the stream");
    }
}

mod kafka {
    use outbox_kafka::consumer::received;
    use outbox_kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
    use outbox_kafka::rdkafka::message::BorrowedMessage;
    use outbox_kafka::rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
    use outbox_kafka::{KafkaConfig, KafkaSink};
    use outbox_test_support::kafka::{create_topic, require_broker};

    use super::*;

    const PARTITIONS: i32 = 3;

    /// A topic of the test's own, and a sink producing to it.
    async fn setup() -> (String, String, impl Fn() -> Arc<dyn Sink>) {
        let brokers = require_broker();
        let topic = unique_name("inbox");
        create_topic(&brokers, &topic, PARTITIONS).await;
        let (at, to) = (brokers.clone(), topic.clone());
        let sink = move || -> Arc<dyn Sink> {
            // One record per batch: tansu answers a fetch from an offset inside a batch
            // with the batches after it, so a consumer resuming at a committed offset in
            // the middle of one would miss records (Kafka gives the whole batch, and the
            // client skips what is before the offset).
            let config = KafkaConfig::new(&at)
                .topic(TOPIC, &to)
                .property("batch.num.messages", "1");
            Arc::new(KafkaSink::new(config).expect("valid sink configuration"))
        };
        (brokers, topic, sink)
    }

    /// A consumer of `group` given every partition of `topic` (as after a restart or a
    /// rebalance), reading each from the group's committed offset, from the start where
    /// none is committed.
    fn consumer(brokers: &str, group: &str, topic: &str) -> StreamConsumer {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap_or_else(|e| Service::Kafka.missing(e));
        let mut assignment = TopicPartitionList::new();
        for partition in 0..PARTITIONS {
            assignment
                .add_partition_offset(topic, partition, Offset::Stored)
                .expect("assignment");
        }
        consumer.assign(&assignment).expect("assign");
        consumer
    }

    async fn next(consumer: &StreamConsumer) -> BorrowedMessage<'_> {
        let next = tokio::time::timeout(WAIT, consumer.recv()).await;
        let next = next.unwrap_or_else(|_| panic!("no record within {WAIT:?}"));
        next.expect("a record")
    }

    fn delivery(record: &BorrowedMessage<'_>) -> (Received, Vec<u8>) {
        let received = received(record).expect("an outbox message");
        (received, record.payload().unwrap_or_default().to_vec())
    }

    /// Commits the offset after `record`, waiting for the broker's answer.
    fn commit(consumer: &StreamConsumer, record: &BorrowedMessage<'_>) {
        tokio::task::block_in_place(|| consumer.commit_message(record, CommitMode::Sync))
            .expect("commit the offset");
    }

    /// Makes `record` the next one `consumer` reads of its partition.
    fn seek_back(consumer: &StreamConsumer, record: &BorrowedMessage<'_>) {
        let (topic, partition) = (record.topic(), record.partition());
        let offset = Offset::Offset(record.offset());
        tokio::task::block_in_place(|| consumer.seek(topic, partition, offset, WAIT))
            .expect("seek back to the failed record");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redeliveries_are_processed_once() {
        let started = Instant::now();
        let (brokers, topic, sink) = setup().await;
        let (_outbox, messages, crashed, billing) = relay_with_a_crash(sink(), sink()).await;
        let group = unique_name("billing");
        let total = MESSAGES + crashed.len();

        // Consumer a commits each record's offset after its transaction, until it is
        // killed: it handled the last third of what it read without committing. A record
        // whose handler failed is read again: a seeks back to it.
        let a = consumer(&brokers, &group, &topic);
        let mut committed: HashMap<i32, i64> = HashMap::new();
        for i in 0..total + FAILING {
            let record = next(&a).await;
            let (received, payload) = delivery(&record);
            match billing.handle(&received, &payload).await {
                Handled::Failed => seek_back(&a, &record),
                _ if i >= total * 2 / 3 => {}
                _ => {
                    commit(&a, &record);
                    committed.insert(record.partition(), record.offset() + 1);
                }
            }
        }
        drop(a);

        // Consumer b, of the same group: from the committed offsets to the end of each
        // partition.
        let b = consumer(&brokers, &group, &topic);
        let mut ends = HashMap::new();
        for partition in 0..PARTITIONS {
            let (_, high) = tokio::task::block_in_place(|| {
                b.fetch_watermarks(&topic, partition, Duration::from_secs(5))
            })
            .expect("watermarks");
            ends.insert(partition, high);
        }
        let mut at: HashMap<i32, i64> = (0..PARTITIONS)
            .map(|p| (p, committed.get(&p).copied().unwrap_or(0)))
            .collect();
        let mut redelivered = 0;
        while at
            .iter()
            .any(|(partition, offset)| *offset < ends[partition])
        {
            let record = next(&b).await;
            let partition = record.partition();
            assert_eq!(
                record.offset(),
                at[&partition],
                "b resumes partition {partition} at the committed offset"
            );
            let (received, payload) = delivery(&record);
            assert_eq!(
                billing.handle(&received, &payload).await,
                Handled::Duplicate
            );
            commit(&b, &record);
            at.insert(partition, record.offset() + 1);
            redelivered += 1;
        }
        assert!(redelivered > 0, "b read again what a had not committed");

        billing
            .assert_run(&messages, crashed.len(), "kafka", started)
            .await;
    }

    /// A rebalance gives the partition to consumer b while consumer a still works on its
    /// record: both read it from the group's committed offset and handle it at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_consumers_on_one_record_at_once_make_one_effect() {
        let (brokers, topic, sink) = setup().await;
        let (_outbox, message, billing) = relay_one(sink()).await;
        let group = unique_name("billing");

        let (a, b) = (
            consumer(&brokers, &group, &topic),
            consumer(&brokers, &group, &topic),
        );
        let (first, second) = (next(&a).await, next(&b).await);
        let position = |r: &BorrowedMessage<'_>| (r.partition(), r.offset());
        assert_eq!(position(&first), position(&second), "the same record");
        let outcomes = billing.race(delivery(&first), delivery(&second)).await;
        assert_one_won(&outcomes, "kafka");
        commit(&b, &second);
        billing.assert_each_once(&[message]).await;
    }
}
