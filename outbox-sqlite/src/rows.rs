//! Decoding rows into the engine's types. The statements that select them are in `sql.rs`.

use chrono::{DateTime, Utc};
use outbox_core::{DeadLetterRow, Error, Message, QueueStats, Result, TopicStats, TraceContext};
use outbox_sql::rows::headers_from_json;
use sqlx::Row;
use sqlx::sqlite::SqliteRow;
use uuid::Uuid;

use crate::error::db_error;

/// Microseconds since the Unix epoch as a time (clamped to what `DateTime` holds).
pub(crate) fn from_micros(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or(if us < 0 {
        DateTime::<Utc>::MIN_UTC
    } else {
        DateTime::<Utc>::MAX_UTC
    })
}

/// Milliseconds since the Unix epoch as a time (clamped to what `DateTime` holds).
pub(crate) fn from_millis(ms: i64) -> DateTime<Utc> {
    from_micros(ms.saturating_mul(1000))
}

/// The `id` column of a row, as a UUID.
fn id(row: &SqliteRow) -> Result<Uuid> {
    let id = required(row, "id", Text::Strict)?;
    Uuid::parse_str(&id).map_err(|e| {
        Error::permanent(format!(
            "sqlite: a message row has the id `{id}`, which is not a UUID: {e}"
        ))
    })
}

/// A row of `id` and `seq`.
pub(crate) fn id_and_seq(row: &SqliteRow) -> Result<(Uuid, i64)> {
    let seq = row
        .try_get("seq")
        .map_err(|e| db_error(None, "cannot read a message row", e))?;
    Ok((id(row)?, seq))
}

/// How [`message_as`] reads a TEXT column that is not valid UTF-8 (SQLite stores what a
/// writer gives; C bindings can write such text).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Text {
    /// Refuse the row: a message to deliver must not change its topic or key.
    Strict,
    /// Replace the bad bytes with U+FFFD: a dead letter to show must be shown.
    Lossy,
}

/// The text of column `column` (NULL as `None`), read as bytes so that text that is not
/// valid UTF-8 is told apart from a database failure.
fn text(row: &SqliteRow, column: &str, how: Text) -> Result<Option<String>> {
    let bytes: Option<Vec<u8>> = row
        .try_get(column)
        .map_err(|e| db_error(None, "cannot read a message row", e))?;
    let Some(bytes) = bytes else { return Ok(None) };
    match String::from_utf8(bytes) {
        Ok(text) => Ok(Some(text)),
        Err(bad) if how == Text::Lossy => {
            Ok(Some(String::from_utf8_lossy(bad.as_bytes()).into_owned()))
        }
        Err(bad) => {
            let bytes = bad.as_bytes();
            let shown: String = bytes.iter().take(16).map(|b| format!("{b:02x}")).collect();
            Err(Error::permanent(format!(
                "sqlite: column `{column}` is not valid UTF-8 ({}: {shown}{}); a writer stored \
                 bytes that are not text",
                bad.utf8_error(),
                if bytes.len() > 16 { "…" } else { "" }
            )))
        }
    }
}

/// [`text`] of a NOT NULL column.
fn required(row: &SqliteRow, column: &str, how: Text) -> Result<String> {
    Ok(text(row, column, how)?.unwrap_or_default())
}

/// Reads a message from a row holding [`crate::sql::MESSAGE_COLUMNS`].
pub(crate) fn message(row: &SqliteRow) -> Result<Message> {
    message_as(row, Text::Strict)
}

fn message_as(row: &SqliteRow, how: Text) -> Result<Message> {
    let get = |e| db_error(None, "cannot read a message row", e);
    let id = id(row)?;
    let headers = required(row, "headers", how)?;
    let traceparent = text(row, "traceparent", how)?;
    let attempts: i64 = row.try_get("attempts").map_err(get)?;
    Ok(Message {
        id,
        topic: required(row, "topic", how)?,
        key: text(row, "partition_key", how)?,
        payload: row.try_get("payload").map_err(get)?,
        headers: headers_from_json(id, &headers),
        created_at: from_micros(row.try_get("created_at").map_err(get)?),
        attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
        trace_context: match traceparent {
            Some(traceparent) => Some(TraceContext {
                traceparent,
                tracestate: text(row, "tracestate", how)?,
            }),
            None => None,
        },
    })
}

/// Messages with their `seq`.
pub(crate) type Numbered = Vec<(i64, Message)>;
/// Rows that cannot be read as messages: each `seq` with why.
pub(crate) type Unreadable = Vec<(i64, Error)>;

/// The rows of a claim, in `seq` order (RETURNING gives them in no particular order): each
/// message with its `seq`, and apart the `seq` of each row that cannot be read as a message
/// with why (a permanent error: it will never read better).
pub(crate) fn claimed(rows: &[SqliteRow]) -> Result<(Numbered, Unreadable)> {
    let fail = |e| db_error(None, "claim failed", e);
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for row in rows {
        let seq = row.try_get::<i64, _>("seq").map_err(fail)?;
        match message(row) {
            Ok(message) => good.push((seq, message)),
            Err(error) if !error.is_retryable() => bad.push((seq, error)),
            Err(error) => return Err(error),
        }
    }
    good.sort_unstable_by_key(|(seq, _)| *seq);
    bad.sort_unstable_by_key(|(seq, _)| *seq);
    Ok((good, bad))
}

fn count(row: &SqliteRow, index: usize, fail: impl Fn(sqlx::Error) -> Error) -> Result<u64> {
    Ok(row.try_get::<i64, _>(index).map_err(fail)?.max(0) as u64)
}

/// The row of the queue figures statement.
pub(crate) fn queue_stats(row: &SqliteRow) -> Result<QueueStats> {
    let fail = |e| db_error(None, "cannot read queue figures", e);
    Ok(QueueStats {
        pending: count(row, 0, fail)?,
        oldest_pending: row
            .try_get::<Option<i64>, _>(1)
            .map_err(fail)?
            .map(from_micros),
        in_flight: count(row, 2, fail)?,
        dead_lettered: count(row, 3, fail)?,
        parked_keys: count(row, 4, fail)?,
        retrying: count(row, 5, fail)?,
        measured_at: None,
    })
}

/// A row of the figures per topic.
pub(crate) fn topic_stats(row: &SqliteRow) -> Result<TopicStats> {
    let fail = |e| db_error(None, "cannot read topic figures", e);
    Ok(TopicStats {
        topic: required(row, "topic", Text::Lossy)?,
        pending: count(row, 1, fail)?,
        oldest_pending: row
            .try_get::<Option<i64>, _>("oldest")
            .map_err(fail)?
            .map(from_micros),
        in_flight: count(row, 3, fail)?,
        retrying: count(row, 5, fail)?,
        dead_lettered: count(row, 4, fail)?,
    })
}

/// A dead letter: its message, then why and when it was dead-lettered.
pub(crate) fn dead_letter(row: &SqliteRow) -> Result<DeadLetterRow> {
    let message = message_as(row, Text::Lossy)?;
    let get = |e| db_error(None, "cannot read a dead letter", e);
    Ok(DeadLetterRow {
        message,
        last_error: required(row, "last_error", Text::Lossy)?,
        dead_lettered_at: from_millis(row.try_get("dead_lettered_at").map_err(get)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_and_clamp() {
        let now = Utc::now();
        assert_eq!(
            from_micros(now.timestamp_micros()).timestamp_micros(),
            now.timestamp_micros()
        );
        assert_eq!(from_millis(1_500).timestamp_millis(), 1_500);
        assert_eq!(from_micros(i64::MAX), DateTime::<Utc>::MAX_UTC);
    }
}
