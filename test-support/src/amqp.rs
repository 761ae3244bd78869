//! RabbitMQ: a connection of the test's own that declares exchanges and queues and reads
//! them back.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

use crate::{Service, unique_name};

/// Declares a durable exchange `exchange` of `kind` and a durable queue `queue` bound to it
/// with `binding`, on a connection of its own (closed after), saying what failed: the
/// destination of a run that outlives the connection (benchmarks, chaos runs), removed
/// again with [`remove_destination`].
pub async fn declare_destination(
    exchange: &str,
    kind: ExchangeKind,
    queue: &str,
    binding: &str,
) -> Result<(), String> {
    let what = format!("declaring {exchange} and {queue}");
    on_a_channel_of_its_own(&what, |channel| async move {
        let none = FieldTable::default;
        let declare = ExchangeDeclareOptions::default();
        channel
            .exchange_declare(exchange.into(), kind, declare, none())
            .await?;
        let declare = QueueDeclareOptions::default();
        channel.queue_declare(queue.into(), declare, none()).await?;
        let bind = QueueBindOptions::default();
        channel
            .queue_bind(queue.into(), exchange.into(), binding.into(), bind, none())
            .await
    })
    .await
}

/// Deletes the queue and the exchange of [`declare_destination`], saying what failed.
pub async fn remove_destination(exchange: &str, queue: &str) -> Result<(), String> {
    let what = format!("deleting {queue} and {exchange}");
    on_a_channel_of_its_own(&what, |channel| async move {
        channel
            .queue_delete(queue.into(), Default::default())
            .await?;
        channel
            .exchange_delete(exchange.into(), Default::default())
            .await
    })
    .await
}

/// Runs `work` on a channel of a connection of its own, then closes the connection; a
/// failure of either is prefixed with `what`.
async fn on_a_channel_of_its_own<F, Fut>(what: &str, work: F) -> Result<(), String>
where
    F: FnOnce(Channel) -> Fut,
    Fut: std::future::Future<Output = lapin::Result<()>>,
{
    let (connection, channel) = try_channel().await?;
    let failed = |e: lapin::Error| format!("{what}: {e}");
    // A clone: the channel closes when its last clone is dropped, which must not happen
    // before the connection is closed.
    work(channel.clone()).await.map_err(failed)?;
    connection.close(200, "done".into()).await.map_err(failed)
}

/// A connection to [`url`] and a channel on it, or what failed.
async fn try_channel() -> Result<(Connection, Channel), String> {
    let connection = try_connect().await?;
    match connection.create_channel().await {
        Ok(channel) => Ok((connection, channel)),
        Err(e) => Err(format!("opening a channel to RabbitMQ: {e}")),
    }
}

/// A connection to [`url`], or what failed when it does not answer within 5 s.
async fn try_connect() -> Result<Connection, String> {
    let url = url();
    let server = format!("RabbitMQ at {}", outbox_core::redact_url(&url));
    let connect = Connection::connect(&url, ConnectionProperties::default());
    tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| format!("{server}: no answer within 5 s"))?
        .map_err(|e| format!("{server}: {e}"))
}

/// How long [`Broker::take`] waits for the messages it expects.
pub const TAKE_DEADLINE: Duration = Duration::from_secs(60);
/// How long [`Broker::take`] then waits for one more, which would be one too many.
pub const EXTRA_WAIT: Duration = Duration::from_millis(500);

/// RabbitMQ for tests: `$OUTBOX_TEST_AMQP_URL`, or the local server's default vhost.
pub fn url() -> String {
    Service::Amqp.url()
}

/// The test's own connection, to declare, bind and consume.
pub struct Broker {
    connection: Connection,
    /// A channel of the connection, for what the helpers do not cover.
    pub channel: Channel,
}

impl Broker {
    /// Connects to [`url`]; panics naming the server when it does not answer within 5 s.
    pub async fn connect() -> Broker {
        let connection = try_connect()
            .await
            .unwrap_or_else(|e| Service::Amqp.missing(e));
        let channel = connection.create_channel().await.expect("open a channel");
        Broker {
            connection,
            channel,
        }
    }

    /// Another channel on the connection, for a consumer of the test's own (the queues of
    /// [`Broker::queue`] belong to the connection).
    pub async fn open_channel(&self) -> Channel {
        self.connection
            .create_channel()
            .await
            .expect("open a channel")
    }

    /// A fresh exchange, deleted by the broker once its last queue is gone.
    pub async fn exchange(&self, kind: ExchangeKind) -> String {
        let name = unique_name("outbox_test_x");
        let options = ExchangeDeclareOptions {
            auto_delete: true,
            ..Default::default()
        };
        self.channel
            .exchange_declare(name.as_str().into(), kind, options, FieldTable::default())
            .await
            .expect("declare exchange");
        name
    }

    /// A fresh queue of this connection (gone when it closes), bound to `exchange` with
    /// `binding`.
    pub async fn queue(&self, exchange: &str, binding: &str) -> String {
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

    /// A fresh [`exchange`](Broker::exchange) of `kind` and a fresh [`queue`](Broker::queue)
    /// bound to it with `binding`: the names of both.
    pub async fn exchange_and_queue(&self, kind: ExchangeKind, binding: &str) -> (String, String) {
        let exchange = self.exchange(kind).await;
        let queue = self.queue(&exchange, binding).await;
        (exchange, queue)
    }

    /// Binds `queue` to `exchange` with `binding`.
    pub async fn bind(&self, queue: &str, exchange: &str, binding: &str) {
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
    /// [`TAKE_DEADLINE`], or one more within [`EXTRA_WAIT`] after them.
    pub async fn take(&self, queue: &str, count: usize) -> Vec<Delivery> {
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
        let deadline = tokio::time::Instant::now() + TAKE_DEADLINE;
        while got.len() < count {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(delivery)) => got.push(delivery.expect("delivery")),
                Ok(None) => panic!("consumer of {queue} ended after {} of {count}", got.len()),
                Err(_) => panic!("only {} of {count} messages arrived in {queue}", got.len()),
            }
        }
        if let Ok(Some(extra)) = tokio::time::timeout(EXTRA_WAIT, consumer.next()).await {
            panic!("more messages than expected in {queue}: {extra:?}");
        }
        // Cancel at the broker, or it keeps delivering to this consumer after it is dropped
        // and a later take on the same queue misses those messages.
        self.channel
            .basic_cancel(tag.as_str().into(), Default::default())
            .await
            .expect("cancel consumer");
        got
    }

    /// Everything in `queue` once it held at least `at_least` messages (or `timeout` passed),
    /// taken one by one with `basic.get`.
    pub async fn get(&self, queue: &str, at_least: usize, timeout: Duration) -> Vec<Delivery> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let message = self
                .channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get");
            match message {
                Some(message) => got.push(message.delivery),
                None if got.len() >= at_least || tokio::time::Instant::now() >= deadline => break,
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        got
    }
}

/// A header value as the sink writes text: a long string.
pub fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// The text headers of a delivery, by name.
pub fn headers(delivery: &Delivery) -> BTreeMap<String, String> {
    delivery
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
        .unwrap_or_default()
}

/// The `message_id` property of a delivery; panics when it has none.
pub fn message_id(delivery: &Delivery) -> &str {
    delivery
        .properties
        .message_id()
        .as_ref()
        .expect("message_id is set")
        .as_str()
}
