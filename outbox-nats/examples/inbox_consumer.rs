//! A NATS JetStream consumer that processes each outbox message once, however often it is
//! delivered: for each message, one PostgreSQL transaction records the message id in an
//! inbox and, when the id is new, makes the business change; it commits, then acknowledges.
//! A duplicate (a relay that published a batch again after JetStream's de-duplication
//! window, a message redelivered because this consumer stopped before its ack) commits
//! nothing new and is acknowledged too.
//!
//! ```sh
//! cargo run -p outbox-nats --example nats_inbox_consumer
//! ```
//!
//! Environment (defaults for the local services of `cargo xtask services` and
//! examples/nats.toml): `DATABASE_URL` (postgres://postgres@127.0.0.1:5432/test),
//! `NATS_URL` (nats://127.0.0.1:4222), `STREAM` (outbox: made if it is not there, capturing
//! `STREAM_SUBJECTS`, outbox.>), `SUBJECT` (outbox.orders), `DURABLE` (billing).

use futures_util::StreamExt;
use outbox_nats::async_nats::jetstream::consumer::{AckPolicy, pull};
use outbox_nats::async_nats::jetstream::{self, AckKind, stream};
use outbox_nats::consumer::{self, Received};
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

    let client = outbox_nats::async_nats::connect(env("NATS_URL", "nats://127.0.0.1:4222")).await?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: env("STREAM", "outbox"),
            subjects: vec![env("STREAM_SUBJECTS", "outbox.>")],
            ..Default::default()
        })
        .await?;
    // A durable consumer: JetStream keeps its place, and redelivers what it did not
    // acknowledge within ack_wait (30 s by default).
    let durable = env("DURABLE", "billing");
    let puller = stream
        .get_or_create_consumer(
            &durable,
            pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: env("SUBJECT", "outbox.orders"),
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            },
        )
        .await?;

    let mut messages = puller.messages().await?;
    while let Some(message) = messages.next().await {
        let message = message?;
        match consumer::received(&message) {
            Ok(received) => {
                // A failure returns from main before the ack: JetStream redelivers the
                // message once ack_wait has passed.
                handle(&mut db, &inbox, &received, &message.payload).await?;
                message.ack().await?;
            }
            // Not an outbox message, or a malformed one: no delivery will fix it. Terminate
            // it, so JetStream does not redeliver it.
            Err(e) => {
                eprintln!("terminating a message on {}: {e}", message.subject);
                message.ack_with(AckKind::Term).await?;
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
