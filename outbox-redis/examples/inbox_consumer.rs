//! A Redis Streams consumer that processes each outbox message once, however often it is
//! delivered: for each entry, one PostgreSQL transaction records the message id in an inbox
//! and, when the id is new, makes the business change; it commits, then acknowledges
//! (`XACK`). A duplicate (a relay that published a batch again, an entry this consumer read
//! before a crash) commits nothing new and is acknowledged too.
//!
//! ```sh
//! cargo run -p outbox-redis --example redis_inbox_consumer
//! ```
//!
//! Environment (defaults for the local services of `cargo xtask services` and
//! examples/redis.toml): `DATABASE_URL` (postgres://postgres@127.0.0.1:5432/test),
//! `REDIS_URL` (redis://127.0.0.1:6379), `STREAM` (orders), `GROUP` (billing),
//! `CONSUMER_NAME` (billing-1).

use std::time::Duration;

use outbox_postgres::Inbox;
use outbox_postgres::sqlx::{Connection, PgConnection};
use outbox_redis::consumer::{self, Received};
use outbox_redis::redis::streams::{StreamId, StreamReadOptions, StreamReadReply};
use outbox_redis::redis::{self, AsyncCommands, AsyncConnectionConfig};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let stream = env("STREAM", "orders");
    let group = env("GROUP", "billing");
    let me = env("CONSUMER_NAME", "billing-1");

    let mut db = PgConnection::connect(&env(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ))
    .await?;
    let inbox = Inbox::new("billing", "inbox")?;
    inbox.migrate(&mut db).await?;

    // Replies may wait for the 5 s of XREADGROUP's BLOCK: longer than the client's default.
    let patience = AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    let mut redis = redis::Client::open(env("REDIS_URL", "redis://127.0.0.1:6379"))?
        .get_multiplexed_async_connection_with_config(&patience)
        .await?;
    // The group reads the stream from its start; BUSYGROUP: it exists already.
    let created: redis::RedisResult<()> = redis.xgroup_create_mkstream(&stream, &group, "0").await;
    if let Err(e) = created
        && e.code() != Some("BUSYGROUP")
    {
        return Err(e.into());
    }

    // First the entries this consumer read and did not acknowledge before it stopped (id
    // 0), then new ones (>).
    let mut from = "0";
    loop {
        let options = StreamReadOptions::default()
            .group(&group, &me)
            .count(100)
            .block(5_000);
        let reply: Option<StreamReadReply> =
            redis.xread_options(&[&stream], &[from], &options).await?;
        let entries: Vec<StreamId> = reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .collect();
        if entries.is_empty() {
            from = ">";
            continue;
        }
        for entry in &entries {
            match consumer::received(entry) {
                // A failure returns from main before the XACK: the entry stays pending and
                // is read again (id 0) when the consumer starts again.
                Ok(received) => {
                    let payload = consumer::payload(entry).unwrap_or_default();
                    handle(&mut db, &inbox, &received, payload).await?;
                }
                // Not an outbox message, or a malformed one: no delivery will fix it.
                // Acknowledge it (after copying it to a dead-letter stream, say).
                Err(e) => eprintln!("skipping entry {}: {e}", entry.id),
            }
            let _: usize = redis.xack(&stream, &group, &[&entry.id]).await?;
        }
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
