//! A RabbitMQ consumer that processes each outbox message once, however often it is
//! delivered: for each delivery, one PostgreSQL transaction records the message id in an
//! inbox and, when the id is new, makes the business change; it commits, then acknowledges.
//! A duplicate (a relay that published a batch again, a delivery requeued after this
//! consumer's channel closed before its ack) commits nothing new and is acknowledged too.
//!
//! ```sh
//! cargo run -p outbox-amqp --example amqp_inbox_consumer
//! ```
//!
//! Environment (defaults for the local services of `cargo xtask services` and
//! examples/amqp.toml): `DATABASE_URL` (postgres://postgres@127.0.0.1:5432/test),
//! `AMQP_URL` (amqp://guest:guest@127.0.0.1:5672/%2f), `EXCHANGE` (outbox), `BINDING`
//! (orders: the routing key, the topic by default), `QUEUE` (billing).

use futures_util::StreamExt;
use outbox_amqp::consumer::{self, Received};
use outbox_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use outbox_amqp::lapin::types::FieldTable;
use outbox_amqp::lapin::{Connection, ConnectionProperties, ExchangeKind};
use outbox_postgres::Inbox;
use outbox_postgres::sqlx::{Connection as _, PgConnection};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let exchange = env("EXCHANGE", "outbox");
    let queue = env("QUEUE", "billing");

    let mut db = PgConnection::connect(&env(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ))
    .await?;
    let inbox = Inbox::new("billing", "inbox")?;
    inbox.migrate(&mut db).await?;

    let url = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    // The exchange as the relay declares it (examples/amqp.toml), and a durable queue.
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let (name, none) = (exchange.as_str(), FieldTable::default);
    channel
        .exchange_declare(name.into(), ExchangeKind::Topic, durable, none())
        .await?;
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.as_str().into(), options, none())
        .await?;
    let binding = env("BINDING", "orders");
    channel
        .queue_bind(
            queue.as_str().into(),
            name.into(),
            binding.as_str().into(),
            QueueBindOptions::default(),
            none(),
        )
        .await?;
    channel.basic_qos(100, BasicQosOptions::default()).await?;

    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "billing-1".into(),
            BasicConsumeOptions::default(),
            none(),
        )
        .await?;
    while let Some(delivery) = deliveries.next().await {
        let delivery = delivery?;
        match consumer::received(&delivery) {
            Ok(received) => {
                // A failure returns from main before the ack: the connection closes and
                // RabbitMQ requeues the delivery, for this consumer when it starts again or
                // for another.
                handle(&mut db, &inbox, &received, &delivery.data).await?;
                delivery.ack(BasicAckOptions::default()).await?;
            }
            // Not an outbox message, or a malformed one: no delivery will fix it. Reject
            // it without requeueing (to the queue's dead-letter exchange, if it has one).
            Err(e) => {
                eprintln!("rejecting delivery {}: {e}", delivery.delivery_tag);
                let reject = BasicRejectOptions { requeue: false };
                delivery.reject(reject).await?;
            }
        }
    }
    Ok(())
}

/// Processes one message once: the inbox records its id and, when it is new, the business
/// change is made, in one transaction.
async fn handle(
    db: &mut PgConnection,
    inbox: &Inbox,
    received: &Received,
    payload: &[u8],
) -> Result<(), Error> {
    let mut tx = db.begin().await?;
    if inbox.process(&mut tx, "billing", received.id).await? {
        // The business change goes here, on `&mut *tx`.
        println!(
            "processing {} ({}, key {:?}): {} bytes",
            received.id,
            received.topic,
            received.key,
            payload.len()
        );
    } else {
        println!("skipping {}: already processed", received.id);
    }
    tx.commit().await?;
    Ok(())
}
