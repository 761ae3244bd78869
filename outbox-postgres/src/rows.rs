//! Decoding rows into the engine's types. The statements that select them are in `sql.rs`.

use outbox_core::{Message, QueueStats, Result, TraceContext};
use outbox_sql::rows::headers_from_value as headers_from_json;
use sqlx::Row;
use sqlx::postgres::PgRow;
use uuid::Uuid;

use crate::error::db_error;
use outbox_core::{DeadLetterRow, TopicStats};

/// Reads a message from a row holding [`crate::sql::MESSAGE_COLUMNS`].
pub(crate) fn message(row: &PgRow) -> Result<Message> {
    let get = |e| db_error("cannot read message row", e);
    let id: Uuid = row.try_get("id").map_err(get)?;
    let headers: serde_json::Value = row.try_get("headers").map_err(get)?;
    let traceparent: Option<String> = row.try_get("traceparent").map_err(get)?;
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    Ok(Message {
        id,
        topic: row.try_get("topic").map_err(get)?,
        key: row.try_get("partition_key").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        headers: headers_from_json(id, headers),
        created_at: row.try_get("created_at").map_err(get)?,
        attempts: attempts.max(0) as u32,
        trace_context: match traceparent {
            Some(traceparent) => Some(TraceContext {
                traceparent,
                tracestate: row.try_get("tracestate").map_err(get)?,
            }),
            None => None,
        },
    })
}

/// The rows of a claim: its messages in `seq` order (the statement returns them in no
/// particular order), and the partition key the next ordered claim starts its sweep after,
/// if this one took a keyed row.
pub(crate) fn claimed(rows: &[PgRow]) -> Result<(Vec<Message>, Option<String>)> {
    let fail = |e| db_error("claim failed", e);
    let mut numbered = rows
        .iter()
        .map(|row| Ok((row.try_get::<i64, _>("seq").map_err(fail)?, message(row)?)))
        .collect::<Result<Vec<_>>>()?;
    numbered.sort_unstable_by_key(|(seq, _)| *seq);
    let cursor = match rows.first() {
        Some(row) => row.try_get::<Option<String>, _>("cursor").map_err(fail)?,
        None => None,
    };
    Ok((numbered.into_iter().map(|(_, m)| m).collect(), cursor))
}

/// The row of the queue figures statement.
pub(crate) fn queue_stats(row: &PgRow) -> Result<QueueStats> {
    let fail = |e| db_error("cannot read queue figures", e);
    let count =
        |i: usize| -> Result<u64> { Ok(row.try_get::<i64, _>(i).map_err(fail)?.max(0) as u64) };
    Ok(QueueStats {
        pending: count(0)?,
        oldest_pending: row.try_get(1).map_err(fail)?,
        in_flight: count(2)?,
        dead_lettered: count(3)?,
        parked_keys: count(4)?,
        retrying: count(5)?,
        measured_at: None,
    })
}

/// A row of the figures per topic.
pub(crate) fn topic_stats(row: &PgRow) -> Result<TopicStats> {
    let fail = |e| db_error("cannot read topic figures", e);
    let count = |name: &str| -> Result<u64> {
        Ok(row.try_get::<i64, _>(name).map_err(fail)?.max(0) as u64)
    };
    Ok(TopicStats {
        topic: row.try_get("topic").map_err(fail)?,
        pending: count("pending")?,
        oldest_pending: row.try_get("oldest").map_err(fail)?,
        in_flight: count("in_flight")?,
        retrying: count("retrying")?,
        dead_lettered: count("dead")?,
    })
}

/// A dead letter: its message, then why and when it was dead-lettered.
pub(crate) fn dead_letter(row: &PgRow) -> Result<DeadLetterRow> {
    let message = message(row)?;
    let get = |e| db_error("cannot read dead letter", e);
    Ok(DeadLetterRow {
        message,
        last_error: row.try_get("last_error").map_err(get)?,
        dead_lettered_at: row.try_get("dead_lettered_at").map_err(get)?,
    })
}
