//! The operator commands: migrate, check, status, dead-letters, enqueue.

use std::io::BufRead;
use std::time::Duration;

use base64::Engine;
use clap::Args;
use std::sync::Arc;

use outbox::cli::enqueue::message_from_line;
use outbox::{DeadLetterFilter, NewMessage, StorageAdmin, printable};
use uuid::Uuid;

use crate::config::{Config, RelayDef};
use crate::{DeadLetterCommand, Failure};

/// Picks the relay named `name`, or the only one.
fn pick<'a>(config: &'a Config, name: Option<&str>) -> Result<&'a RelayDef, Failure> {
    match (name, config.relays.as_slice()) {
        (None, [only]) => Ok(only),
        (None, relays) => Err(Failure::Config(format!(
            "the configuration has {} relays; choose one with --relay ({})",
            relays.len(),
            relays
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
        (Some(name), relays) => relays.iter().find(|r| r.name == name).ok_or_else(|| {
            Failure::Config(format!(
                "--relay `{name}` is not in the configuration; it has: {}",
                relays
                    .iter()
                    .map(|r| r.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }),
    }
}

async fn storage(def: &RelayDef) -> Result<Arc<dyn StorageAdmin>, Failure> {
    crate::relay::open_storage(def).await
}

pub async fn migrate(config: &Config, print_sql: bool) -> Result<(), Failure> {
    for def in &config.relays {
        let storage = storage(def).await?;
        if print_sql {
            // For a DBA: what `migrate` would run, reviewed and applied by hand.
            let sql = storage.migration_sql().await?;
            if sql.is_empty() {
                println!(
                    "-- relay {}: {} is up to date",
                    def.name,
                    storage.describe()
                );
            } else {
                println!("-- relay {}: {}\n{sql}", def.name, storage.describe());
            }
            continue;
        }
        storage.migrate().await?;
        println!("relay {}: {} is up to date", def.name, storage.describe());
    }
    Ok(())
}

pub async fn check(config: &Config) -> Result<(), Failure> {
    let relays = crate::relay::build(config, None).await?;
    let mut failed = false;
    for relay in &relays {
        println!(
            "relay {}: storage {} ({}), sink {}",
            relay.def.name,
            relay.def.storage_type,
            relay.storage.describe(),
            relay.def.sink_type
        );
        let storage = match relay.storage.stats().await {
            Ok(stats) => format!(
                "ok ({} pending, {} dead-lettered)",
                stats.pending, stats.dead_lettered
            ),
            Err(e) => {
                failed = true;
                format!("FAILED: {e}")
            }
        };
        println!("  storage: {storage}");
        let sink = match relay.sink.health().await {
            Ok(()) => "ok".to_string(),
            Err(e) => {
                failed = true;
                format!("FAILED: {e}")
            }
        };
        println!("  sink:    {sink}");
    }
    if failed {
        Err(Failure::Runtime("check failed".into()))
    } else {
        println!("configuration valid; storage and sink answer");
        Ok(())
    }
}

/// How a command prints what it read.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Output {
    /// Aligned text, for people.
    #[default]
    Text,
    /// One JSON object per line, for programs (field names are stable; docs/configuration.md).
    Json,
}

/// Prints `value` as one JSON line.
fn print_json(value: &serde_json::Value) {
    println!("{value}");
}

/// A time as RFC 3339 text, or null.
fn time_json(t: Option<chrono::DateTime<chrono::Utc>>) -> serde_json::Value {
    t.map_or(serde_json::Value::Null, |t| t.to_rfc3339().into())
}

/// Seconds from `t` to now (never negative), or null.
fn age_seconds(t: Option<chrono::DateTime<chrono::Utc>>) -> Option<f64> {
    t.map(|t| (chrono_like_now() - t.timestamp_millis()).max(0) as f64 / 1000.0)
}

pub async fn status(
    config: &Config,
    relay: Option<&str>,
    watch: Option<Duration>,
    output: Output,
) -> Result<(), Failure> {
    let defs: Vec<&RelayDef> = match relay {
        Some(_) => vec![pick(config, relay)?],
        None => config.relays.iter().collect(),
    };
    let mut storages = Vec::new();
    for def in &defs {
        storages.push(storage(def).await?);
    }
    loop {
        for (def, storage) in defs.iter().zip(&storages) {
            match output {
                Output::Text => print_status(def, storage).await?,
                Output::Json => print_json(&status_json(def, storage).await?),
            }
        }
        match watch {
            Some(every) => tokio::select! {
                _ = tokio::time::sleep(every) => if output == Output::Text { println!() },
                _ = tokio::signal::ctrl_c() => return Ok(()),
            },
            None => return Ok(()),
        }
    }
}

async fn print_status(def: &RelayDef, storage: &Arc<dyn StorageAdmin>) -> Result<(), Failure> {
    let stats = storage.stats().await?;
    let now = chrono_like_now();
    let age = |t: Option<chrono::DateTime<chrono::Utc>>| match t {
        Some(t) => format!(
            "{:.1}s",
            (now - t.timestamp_millis()).max(0) as f64 / 1000.0
        ),
        None => "-".into(),
    };
    println!("relay {} ({})", def.name, storage.describe());
    println!(
        "  pending {}  oldest pending age {}  in flight {}  retrying {}  dead-lettered {}  parked keys {}",
        stats.pending,
        age(stats.oldest_pending),
        stats.in_flight,
        stats.retrying,
        stats.dead_lettered,
        stats.parked_keys
    );
    if let Some(horizon) = storage.horizon().await? {
        println!("  {}", horizon_line(&horizon));
    }
    let topics = storage.topic_stats().await?;
    if !topics.is_empty() {
        println!(
            "  {:<32} {:>10} {:>12} {:>10} {:>10} {:>14}",
            "topic", "pending", "oldest age", "in flight", "retrying", "dead-lettered"
        );
        for t in topics {
            println!(
                "  {:<32} {:>10} {:>12} {:>10} {:>10} {:>14}",
                printable(&t.topic),
                t.pending,
                age(t.oldest_pending),
                t.in_flight,
                t.retrying,
                t.dead_lettered
            );
        }
    }
    for parked in storage.parked_keys().await? {
        println!(
            "  parked key {:?} behind dead letter {}",
            parked.key, parked.dead_letter
        );
    }
    Ok(())
}

/// Log mode's horizon for people: how many committed messages wait behind it, and why.
fn horizon_line(horizon: &outbox::HorizonLag) -> String {
    let mut line = format!("horizon: {} committed waiting", horizon.waiting);
    if let Some(by) = &horizon.held_by {
        line.push_str(&format!(" behind {by}"));
        if let Some(age) = horizon.held_for {
            line.push_str(&format!(", open {:.1}s", age.as_secs_f64()));
        }
    }
    line
}

/// The figures of `print_status` as one JSON object.
async fn status_json(
    def: &RelayDef,
    storage: &Arc<dyn StorageAdmin>,
) -> Result<serde_json::Value, Failure> {
    let stats = storage.stats().await?;
    let topics: Vec<serde_json::Value> = (storage.topic_stats().await?.into_iter())
        .map(|t| {
            serde_json::json!({
                "topic": t.topic,
                "pending": t.pending,
                "oldest_pending": time_json(t.oldest_pending),
                "oldest_pending_age_seconds": age_seconds(t.oldest_pending),
                "in_flight": t.in_flight,
                "retrying": t.retrying,
                "dead_lettered": t.dead_lettered,
            })
        })
        .collect();
    let parked: Vec<serde_json::Value> = (storage.parked_keys().await?.into_iter())
        .map(|p| serde_json::json!({ "key": p.key, "dead_letter": p.dead_letter }))
        .collect();
    let horizon = storage.horizon().await?.map(|h| {
        serde_json::json!({
            "waiting": h.waiting,
            "held_by": h.held_by,
            "held_for_seconds": h.held_for.map(|d| d.as_secs_f64()),
        })
    });
    Ok(serde_json::json!({
        "relay": def.name,
        "storage": storage.describe(),
        "pending": stats.pending,
        "oldest_pending": time_json(stats.oldest_pending),
        "oldest_pending_age_seconds": age_seconds(stats.oldest_pending),
        "in_flight": stats.in_flight,
        "retrying": stats.retrying,
        "dead_lettered": stats.dead_lettered,
        "parked_keys": stats.parked_keys,
        "topics": topics,
        "parked": parked,
        "horizon": horizon,
    }))
}

/// A dead letter as one JSON object: the payload as `payload` when it is UTF-8 text, else as
/// `payload_base64`.
fn dead_letter_json(row: &outbox::DeadLetterRow) -> serde_json::Value {
    let m = &row.message;
    let mut value = serde_json::json!({
        "id": m.id,
        "topic": m.topic,
        "key": m.key,
        "attempts": m.attempts,
        "created_at": m.created_at.to_rfc3339(),
        "dead_lettered_at": row.dead_lettered_at.to_rfc3339(),
        "last_error": row.last_error,
        "headers": m.headers,
    });
    match std::str::from_utf8(&m.payload) {
        Ok(text) => value["payload"] = text.into(),
        Err(_) => {
            value["payload_base64"] = base64::engine::general_purpose::STANDARD
                .encode(&m.payload)
                .into()
        }
    }
    value
}

fn chrono_like_now() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Which dead letters a command applies to.
#[derive(Args, Clone, Default)]
pub struct FilterArgs {
    /// Dead letter ids.
    ids: Vec<Uuid>,
    /// Every dead letter.
    #[arg(long, conflicts_with = "ids")]
    all: bool,
    /// Only this topic.
    #[arg(long)]
    topic: Option<String>,
    /// Only this partition key.
    #[arg(long)]
    key: Option<String>,
    /// Only dead letters whose last error contains this text (case of ASCII letters ignored).
    #[arg(long)]
    error: Option<String>,
    /// Which [[relay]] block, when there are several.
    #[arg(long)]
    relay: Option<String>,
}

impl FilterArgs {
    fn filter(&self, destructive: bool) -> Result<DeadLetterFilter, Failure> {
        if destructive
            && self.ids.is_empty()
            && !self.all
            && self.topic.is_none()
            && self.key.is_none()
            && self.error.is_none()
        {
            return Err(Failure::Config(
                "say which dead letters: give ids, or --all, --topic, --key or --error".into(),
            ));
        }
        Ok(DeadLetterFilter {
            ids: (!self.ids.is_empty()).then(|| self.ids.clone()),
            topic: self.topic.clone(),
            key: self.key.clone(),
            last_error: self.error.clone(),
            without_payloads: false,
        })
    }
}

pub async fn dead_letters(config: &Config, command: DeadLetterCommand) -> Result<(), Failure> {
    match command {
        DeadLetterCommand::List {
            filter,
            limit,
            output,
        } => {
            let storage = storage(pick(config, filter.relay.as_deref())?).await?;
            let filter = DeadLetterFilter {
                // The table shows no payload; JSON lines carry it.
                without_payloads: output != Output::Json,
                ..filter.filter(false)?
            };
            let rows = storage.dead_letters(&filter, limit).await?;
            if output == Output::Json {
                rows.iter()
                    .for_each(|row| print_json(&dead_letter_json(row)));
                return Ok(());
            }
            println!(
                "{:<36}  {:<24} {:<16} {:>8}  last error",
                "id", "topic", "key", "attempts"
            );
            for row in &rows {
                let m = &row.message;
                println!(
                    "{:<36}  {:<24} {:<16} {:>8}  {}",
                    m.id,
                    printable(&m.topic),
                    printable(m.key.as_deref().unwrap_or("-")),
                    m.attempts,
                    printable(row.last_error.lines().next().unwrap_or(""))
                );
            }
            println!("{} dead letter(s)", rows.len());
        }
        DeadLetterCommand::Show { id, relay, output } => {
            let storage = storage(pick(config, relay.relay.as_deref())?).await?;
            let filter = DeadLetterFilter {
                ids: Some(vec![id]),
                ..Default::default()
            };
            let Some(row) = storage.dead_letters(&filter, 1).await?.pop() else {
                return Err(Failure::Runtime(format!("no dead letter with id {id}")));
            };
            if output == Output::Json {
                print_json(&dead_letter_json(&row));
                return Ok(());
            }
            let m = &row.message;
            println!("id:              {}", m.id);
            println!("topic:           {}", printable(&m.topic));
            println!(
                "key:             {}",
                printable(m.key.as_deref().unwrap_or("-"))
            );
            println!("created at:      {}", m.created_at);
            println!("dead-lettered:   {}", row.dead_lettered_at);
            println!("attempts:        {}", m.attempts);
            println!("last error:      {}", printable(&row.last_error));
            for (name, value) in &m.headers {
                println!("header:          {}: {}", printable(name), printable(value));
            }
            match std::str::from_utf8(&m.payload) {
                Ok(text) => println!("payload:         {}", printable(text)),
                Err(_) => println!(
                    "payload (base64): {}",
                    base64::engine::general_purpose::STANDARD.encode(&m.payload)
                ),
            }
        }
        DeadLetterCommand::Replay { filter } => {
            let storage = storage(pick(config, filter.relay.as_deref())?).await?;
            let ids = matching_ids(&storage, &filter.filter(true)?).await?;
            let n = storage.replay_dead_letters(&ids).await?;
            println!("replayed {n} dead letter(s)");
        }
        DeadLetterCommand::Purge { filter } => {
            let storage = storage(pick(config, filter.relay.as_deref())?).await?;
            let ids = matching_ids(&storage, &filter.filter(true)?).await?;
            let n = storage.purge_dead_letters(&ids).await?;
            println!("purged {n} dead letter(s)");
        }
        DeadLetterCommand::Release { key, relay } => {
            let storage = storage(pick(config, relay.relay.as_deref())?).await?;
            if storage.release_parked_key(&key).await? {
                println!("released key {key:?}");
            } else {
                println!("key {key:?} was not parked");
            }
        }
    }
    Ok(())
}

async fn matching_ids(
    storage: &Arc<dyn StorageAdmin>,
    filter: &DeadLetterFilter,
) -> Result<Vec<Uuid>, Failure> {
    let filter = DeadLetterFilter {
        without_payloads: true,
        ..filter.clone()
    };
    Ok(storage
        .dead_letters(&filter, usize::MAX)
        .await?
        .into_iter()
        .map(|d| d.message.id)
        .collect())
}

/// `outbox enqueue`: one message from the arguments, or JSON lines from standard input:
/// `{"topic": "t", "key": "k", "payload": …, "headers": {"h": "v"}, "traceparent": …}`, where a string payload
/// is sent as its UTF-8 bytes, any other JSON value as JSON (content-type application/json),
/// and `payload_base64` gives raw bytes.
#[derive(Args)]
pub struct EnqueueArgs {
    /// Topic of the message.
    #[arg(long, required_unless_present = "stdin")]
    topic: Option<String>,
    /// Partition key.
    #[arg(long)]
    key: Option<String>,
    /// Header as name=value (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Payload text.
    payload: Option<String>,
    /// Read JSON lines from standard input instead.
    #[arg(long, conflicts_with_all = ["topic", "payload"])]
    stdin: bool,
    /// Which [[relay]] block, when there are several.
    #[arg(long)]
    relay: Option<String>,
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("header `{text}` is not name=value"))
}

/// Messages `enqueue` commits in one transaction.
const ENQUEUE_CHUNK: usize = 1000;

pub async fn enqueue(config: &Config, args: EnqueueArgs) -> Result<(), Failure> {
    let def = pick(config, args.relay.as_deref())?;
    let storage = storage(def).await?;
    let messages = if args.stdin {
        let mut messages = Vec::new();
        for (i, line) in std::io::stdin().lock().lines().enumerate() {
            let line =
                line.map_err(|e| Failure::Runtime(format!("cannot read standard input: {e}")))?;
            if !line.trim().is_empty() {
                messages.push(message_from_line(i + 1, &line).map_err(Failure::Config)?);
            }
        }
        messages
    } else {
        let topic = args.topic.unwrap_or_default();
        let mut message = NewMessage::new(topic, args.payload.unwrap_or_default().into_bytes());
        message.key = args.key;
        message.headers.extend(args.headers);
        vec![message]
    };
    // Each chunk is one transaction: its ids are printed once it has committed, so a failure
    // later on leaves a true account of what is in the outbox.
    let mut committed = 0;
    for chunk in messages.chunks(ENQUEUE_CHUNK) {
        if let Err(error) = storage.enqueue(chunk).await {
            let failure = Failure::from(error);
            let why = match &failure {
                Failure::Config(why) | Failure::Runtime(why) => why.clone(),
            };
            let account = format!(
                "{why}\n{committed} of {} message(s) committed (their ids are printed above); \
                 messages {} to {} were not enqueued",
                messages.len(),
                committed + 1,
                messages.len()
            );
            return Err(match failure {
                Failure::Config(_) => Failure::Config(account),
                Failure::Runtime(_) => Failure::Runtime(account),
            });
        }
        committed += chunk.len();
        for m in chunk {
            println!("{}", m.id);
        }
        if messages.len() > ENQUEUE_CHUNK {
            eprintln!("committed {committed} of {}", messages.len());
        }
    }
    eprintln!("enqueued {} message(s)", messages.len());
    Ok(())
}
