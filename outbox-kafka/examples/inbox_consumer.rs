//! A Kafka consumer that processes each outbox message once, however often it is delivered:
//! for each record, one PostgreSQL transaction records the message id in an inbox and, when
//! the id is new, makes the business change; it commits, then commits the record's offset.
//! A duplicate (a relay that published a batch again, a record read again from the last
//! committed offset after a restart or a rebalance) commits nothing new.
//!
//! ```sh
//! cargo run -p outbox-kafka --example kafka_inbox_consumer
//! ```
//!
//! Environment (defaults for the local services of `cargo xtask services` and
//! examples/kafka.toml): `DATABASE_URL` (postgres://postgres@127.0.0.1:5432/test),
//! `KAFKA_BROKERS` (127.0.0.1:9092), `TOPIC` (orders), `GROUP` (billing).

use outbox_kafka::consumer::{self, Received};
use outbox_kafka::rdkafka::ClientConfig;
use outbox_kafka::rdkafka::Message;
use outbox_kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use outbox_postgres::Inbox;
use outbox_postgres::sqlx::{Connection, PgConnection};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mut db = PgConnection::connect(&env(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ))
    .await?;
    let inbox = Inbox::new("billing", "inbox")?;
    inbox.migrate(&mut db).await?;

    let kafka: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", env("KAFKA_BROKERS", "127.0.0.1:9092"))
        .set("group.id", env("GROUP", "billing"))
        // Offsets are committed by hand, after the database commit.
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    kafka.subscribe(&[&env("TOPIC", "orders")])?;

    loop {
        let record = kafka.recv().await?;
        match consumer::received(&record) {
            // A failure returns from main before the offset commit: the record is read
            // again from the committed offset, by this consumer when it starts again or by
            // the one its partition goes to.
            Ok(received) => {
                let payload = record.payload().unwrap_or_default();
                handle(&mut db, &inbox, &received, payload).await?;
            }
            // Not an outbox message, or a malformed one: no delivery will fix it. Skip it
            // (after copying it to a dead-letter topic, say).
            Err(e) => eprintln!(
                "skipping offset {} of {}[{}]: {e}",
                record.offset(),
                record.topic(),
                record.partition()
            ),
        }
        // Lost on a crash, an asynchronous commit costs only a duplicate, which the inbox
        // skips.
        kafka.commit_message(&record, CommitMode::Async)?;
    }
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
