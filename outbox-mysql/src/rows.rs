//! Reading rows: messages, dead letters and figures.

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_core::{DeadLetterRow, Error, Message, QueueStats, Result, TopicStats, TraceContext};
use outbox_sql::rows::headers_from_json;
use sqlx::Row;
use sqlx::mysql::MySqlRow;
use uuid::Uuid;

use crate::error::db_error;

/// A `DATETIME(6)` column, which holds UTC.
pub(crate) fn utc(naive: NaiveDateTime) -> DateTime<Utc> {
    naive.and_utc()
}

/// Text from a column. Columns with a binary collation (`utf8mb4_bin`) and `VARBINARY` keys
/// reach the client as bytes; bytes that are not UTF-8 (a key written by hand) are
/// replaced rather than failing the whole claim.
pub(crate) fn text(row: &MySqlRow, column: &str) -> std::result::Result<String, sqlx::Error> {
    let bytes: Vec<u8> = row.try_get(column)?;
    Ok(String::from_utf8(bytes).unwrap_or_else(|e| {
        tracing::warn!(
            column,
            "mysql: a column holds bytes that are not UTF-8; replacing them"
        );
        String::from_utf8_lossy(e.as_bytes()).into_owned()
    }))
}

/// Optional text from a column (see [`text`]).
pub(crate) fn opt_text(
    row: &MySqlRow,
    column: &str,
) -> std::result::Result<Option<String>, sqlx::Error> {
    let bytes: Option<Vec<u8>> = row.try_get(column)?;
    Ok(bytes.map(|b| String::from_utf8_lossy(&b).into_owned()))
}

/// Reads a message from a row holding [`crate::sql::MESSAGE_COLUMNS`].
pub(crate) fn message(row: &MySqlRow) -> Result<Message> {
    let get = |e| db_error(None, "cannot read a message row", e);
    let id = text(row, "id").map_err(get)?;
    let id = Uuid::parse_str(&id).map_err(|e| {
        Error::permanent(format!(
            "mysql: a message row has the id `{id}`, which is not a UUID: {e}"
        ))
    })?;
    let headers = opt_text(row, "headers").map_err(get)?.unwrap_or_default();
    let traceparent = opt_text(row, "traceparent").map_err(get)?;
    let attempts: i64 = row.try_get("attempts").map_err(get)?;
    Ok(Message {
        id,
        topic: text(row, "topic").map_err(get)?,
        key: opt_text(row, "partition_key").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        headers: headers_from_json(id, &headers),
        created_at: utc(row.try_get("created_at").map_err(get)?),
        attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
        trace_context: match traceparent {
            Some(traceparent) => Some(TraceContext {
                traceparent,
                tracestate: opt_text(row, "tracestate").map_err(get)?,
            }),
            None => None,
        },
    })
}

fn count(row: &MySqlRow, index: usize, fail: impl Fn(sqlx::Error) -> Error) -> Result<u64> {
    Ok(row.try_get::<i64, _>(index).map_err(fail)?.max(0) as u64)
}

/// The row of the queue figures statement.
pub(crate) fn queue_stats(row: &MySqlRow) -> Result<QueueStats> {
    let fail = |e| db_error(None, "cannot read queue figures", e);
    Ok(QueueStats {
        pending: count(row, 0, fail)?,
        oldest_pending: row
            .try_get::<Option<NaiveDateTime>, _>(1)
            .map_err(fail)?
            .map(utc),
        in_flight: count(row, 2, fail)?,
        dead_lettered: count(row, 3, fail)?,
        parked_keys: count(row, 4, fail)?,
        // After the time of the count (index 5) in both statements that give these rows.
        retrying: count(row, 6, fail)?,
        measured_at: None,
    })
}

/// A row of the figures per topic.
pub(crate) fn topic_stats(row: &MySqlRow) -> Result<TopicStats> {
    let fail = |e| db_error(None, "cannot read topic figures", e);
    Ok(TopicStats {
        topic: text(row, "topic").map_err(fail)?,
        pending: count(row, 1, fail)?,
        oldest_pending: row
            .try_get::<Option<NaiveDateTime>, _>("oldest")
            .map_err(fail)?
            .map(utc),
        in_flight: count(row, 3, fail)?,
        retrying: count(row, 5, fail)?,
        dead_lettered: count(row, 4, fail)?,
    })
}

/// A dead letter: its message, then why and when it was dead-lettered.
pub(crate) fn dead_letter(row: &MySqlRow) -> Result<DeadLetterRow> {
    let message = message(row)?;
    let get = |e| db_error(None, "cannot read a dead letter", e);
    Ok(DeadLetterRow {
        message,
        last_error: text(row, "last_error").map_err(get)?,
        dead_lettered_at: utc(row.try_get("dead_lettered_at").map_err(get)?),
    })
}
