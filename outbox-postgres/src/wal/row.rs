//! An outbox message from the text values of an insert, as pgoutput sends them. The server
//! writes each value with its type's output function under the reading session's settings,
//! so the reader pins those ([`SESSION`]) and this module parses that one form.

use chrono::{DateTime, Utc};
use outbox_core::{Error, ErrorKind, Message, Result, TraceContext};
use outbox_sql::rows::headers_from_value;
use uuid::Uuid;

use super::slot::Insert;

/// Run on the connection that reads the slot: timestamps in ISO form and UTC, `bytea` in
/// hex, whatever the role's or database's defaults are.
pub(crate) const SESSION: &str =
    "SET DateStyle = 'ISO, YMD'; SET TimeZone = 'UTC'; SET bytea_output = 'hex'";

/// The message an insert into the outbox table carries, with its `seq`. A value that does
/// not parse is a `Permanent` error that names the row (its `seq` when that reads) and the
/// column.
pub(crate) fn message(insert: &Insert) -> Result<(i64, Message)> {
    let row = Values(insert);
    let seq: i64 = row.parse("seq", |t| t.parse().ok())?;
    let bad = |column: &str, problem: &str| {
        Error::new(
            ErrorKind::Permanent,
            format!(
                "postgres: outbox row seq {seq} of {}.{}: column {column} {problem}",
                insert.relation.namespace, insert.relation.name
            ),
        )
    };
    let id: Uuid = row
        .parse("id", |t| t.parse().ok())
        .map_err(|_| bad("id", "is not a UUID"))?;
    let headers = row
        .parse("headers", |t| serde_json::from_str(t).ok())
        .map_err(|_| bad("headers", "is not JSON"))?;
    let traceparent = row
        .text("traceparent")
        .map_err(|_| bad("traceparent", "is not text"))?;
    let attempts: i32 = row
        .parse("attempts", |t| t.parse().ok())
        .map_err(|_| bad("attempts", "is not an integer"))?;
    let message = Message {
        id,
        topic: row
            .required("topic")
            .map_err(|_| bad("topic", "is missing"))?,
        key: row
            .text("partition_key")
            .map_err(|_| bad("partition_key", "is not text"))?,
        payload: row
            .parse("payload", bytea)
            .map_err(|_| bad("payload", "is not bytea in hex (`\\x…`)"))?,
        headers: headers_from_value(id, headers),
        created_at: row
            .parse("created_at", timestamptz)
            .map_err(|_| bad("created_at", "is not a timestamp in ISO form"))?,
        attempts: attempts.max(0) as u32,
        trace_context: match traceparent {
            Some(traceparent) => Some(TraceContext {
                traceparent,
                tracestate: row
                    .text("tracestate")
                    .map_err(|_| bad("tracestate", "is not text"))?,
            }),
            None => None,
        },
    };
    Ok((seq, message))
}

/// An insert's values, by column name.
struct Values<'a>(&'a Insert);

impl Values<'_> {
    /// The column's value as text; `None` for NULL; an error for a column the table lacks
    /// or a value that is not UTF-8.
    fn text(&self, column: &str) -> std::result::Result<Option<String>, ()> {
        let relation = &self.0.relation;
        let index = relation
            .columns
            .iter()
            .position(|c| c == column)
            .ok_or(())?;
        match self.0.values.get(index).ok_or(())? {
            None => Ok(None),
            Some(bytes) => String::from_utf8(bytes.clone()).map(Some).map_err(drop),
        }
    }

    /// The column's value, which must not be NULL.
    fn required(&self, column: &str) -> std::result::Result<String, ()> {
        self.text(column)?.ok_or(())
    }

    /// The column's value parsed with `parse`; a `Permanent` error naming the column.
    fn parse<T>(&self, column: &str, parse: impl Fn(&str) -> Option<T>) -> Result<T> {
        self.required(column)
            .ok()
            .and_then(|text| parse(&text))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Permanent,
                    format!(
                        "postgres: an outbox row of {}.{}: column {column} is missing or does \
                         not parse",
                        self.0.relation.namespace, self.0.relation.name
                    ),
                )
            })
    }
}

/// `bytea` in hex output: `\x` then two hex digits a byte.
fn bytea(text: &str) -> Option<Vec<u8>> {
    let hex = text.strip_prefix("\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// `timestamptz` in ISO form (`2026-12-04 19:30:00.123456+00`, the offset with or without
/// minutes).
fn timestamptz(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

#[cfg(test)]
mod tests;
