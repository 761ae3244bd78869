//! A [`NewMessage`] as the columns of the outbox table, and the multi-row INSERT statements
//! an enqueue runs.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
use outbox_core::{Error, NewMessage, Result};

/// The columns an application writes, in the order of the INSERTs (and of
/// [`Columns`]' fields).
pub const INSERT_COLUMNS: &str =
    "id, topic, partition_key, payload, headers, traceparent, tracestate, created_at";

/// The columns a dead letter or a delivered row copies from its outbox row: `seq`, then
/// [`INSERT_COLUMNS`] (MySQL, SQLite).
pub const COPY_COLUMNS: &str =
    "seq, id, topic, partition_key, payload, headers, traceparent, tracestate, created_at";

/// Each column of the list `columns` (`"seq, id"`) qualified by the table alias `alias`
/// (`"o.seq, o.id"`), for the SELECT of an `INSERT ... SELECT` that copies a row.
pub fn aliased(alias: &str, columns: &str) -> String {
    columns
        .split(", ")
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A `Permanent` error when `message` has an empty topic: every message needs one (the
/// tables refuse it too, with a `CHECK`).
pub fn check_topic(message: &NewMessage) -> Result<()> {
    if message.topic.is_empty() {
        return Err(Error::permanent(format!(
            "message {} has an empty topic; every message needs a topic",
            message.id
        )));
    }
    Ok(())
}

/// The trace context of `message` as its two columns (`traceparent`, `tracestate`).
pub fn trace_columns(message: &NewMessage) -> (Option<&str>, Option<&str>) {
    match &message.trace_context {
        Some(t) => (Some(t.traceparent.as_str()), t.tracestate.as_deref()),
        None => (None, None),
    }
}

/// One message as the columns of the outbox table hold it, in the order of
/// [`INSERT_COLUMNS`]. Each storage binds them, converting `created_at` to its column type.
#[derive(Debug, Clone, PartialEq)]
pub struct Columns<'a> {
    /// `id`: the UUID, lower-case and hyphenated.
    pub id: String,
    /// `topic`: never empty.
    pub topic: &'a str,
    /// `partition_key`.
    pub key: Option<&'a str>,
    /// `payload`.
    pub payload: &'a [u8],
    /// `headers`: a JSON object of strings.
    pub headers: String,
    /// `traceparent`.
    pub traceparent: Option<&'a str>,
    /// `tracestate`.
    pub tracestate: Option<&'a str>,
    /// `created_at`, in UTC.
    pub created_at: DateTime<Utc>,
}

/// Binds the [`Columns`] `$row` to the sqlx query `$query` in the order of
/// [`INSERT_COLUMNS`], with `created_at` as `$created_at` (each storage's column type): the
/// column order is written here once, beside the list it must follow.
///
/// ```text
/// query = outbox_sql::bind_columns!(query, row, row.created_at.timestamp_micros());
/// ```
#[macro_export]
macro_rules! bind_columns {
    ($query:expr, $row:expr, $created_at:expr) => {
        $query
            .bind($row.id.as_str())
            .bind($row.topic)
            .bind($row.key)
            .bind($row.payload)
            .bind($row.headers.as_str())
            .bind($row.traceparent)
            .bind($row.tracestate)
            .bind($created_at)
    };
}

/// The INSERTs of an enqueue, run on the sqlx connection `$conn` (a `&mut` connection):
/// the [`Columns`] `$rows` cut into statements by the [`Inserts`] `$inserts`, each row bound
/// by [`bind_columns!`] with `created_at` as `$created_at`, in which `$row` names the row.
/// A future of `Result<(), sqlx::Error>`: the first statement that fails stops the rest.
///
/// ```text
/// outbox_sql::insert_rows!(conn, self.inserts, &rows, |row| row.created_at.naive_utc())
///     .await
///     .map_err(|e| db_error(None, "enqueue failed", e))
/// ```
#[macro_export]
macro_rules! insert_rows {
    ($conn:expr, $inserts:expr, $rows:expr, |$row:ident| $created_at:expr) => {
        async {
            for (sql, chunk) in $inserts.chunks($rows) {
                let mut query = sqlx::query(&sql);
                for $row in chunk {
                    query = $crate::bind_columns!(query, $row, $created_at);
                }
                sqlx::Executor::execute(&mut *$conn, query).await?;
            }
            Ok::<(), sqlx::Error>(())
        }
    };
}

impl<'a> Columns<'a> {
    /// The columns of `m`. Fails (`Permanent`) on an empty topic ([`check_topic`]) or
    /// headers that cannot be written as JSON.
    pub fn of(m: &'a NewMessage) -> Result<Self> {
        check_topic(m)?;
        let headers = serde_json::to_string(&m.headers)
            .map_err(|e| Error::permanent(format!("message {}: headers: {e}", m.id)))?;
        let (traceparent, tracestate) = trace_columns(m);
        Ok(Columns {
            id: m.id.hyphenated().to_string(),
            topic: &m.topic,
            key: m.key.as_deref(),
            payload: &m.payload,
            headers,
            traceparent,
            tracestate,
            created_at: m.created_at,
        })
    }

    /// The columns of every message, in the order given; the first that fails [`of`]
    /// fails them all, so an enqueue writes all of them or none.
    ///
    /// [`of`]: Columns::of
    pub fn all(messages: &'a [NewMessage]) -> Result<Vec<Self>> {
        messages.iter().map(Columns::of).collect()
    }
}

/// The INSERTs of an enqueue with `?` placeholders (MySQL, SQLite): one message, or up to
/// `per_statement` in one statement. The two common ones are built once.
#[derive(Debug, Clone)]
pub struct Inserts {
    table: String,
    per_statement: usize,
    one: String,
    full: String,
}

impl Inserts {
    /// The INSERTs into `table` (quoted, and qualified if need be) of at most
    /// `per_statement` messages each (at least 1).
    pub fn new(table: impl Into<String>, per_statement: usize) -> Self {
        let table = table.into();
        let per_statement = per_statement.max(1);
        let one = insert(&table, 1);
        let full = insert(&table, per_statement);
        Inserts {
            table,
            per_statement,
            one,
            full,
        }
    }

    /// The most messages one statement inserts.
    pub fn per_statement(&self) -> usize {
        self.per_statement
    }

    /// The INSERT of `rows` messages (between 1 and [`per_statement`](Self::per_statement)).
    pub fn sql(&self, rows: usize) -> Cow<'_, str> {
        match rows {
            1 => Cow::Borrowed(&self.one),
            n if n == self.per_statement => Cow::Borrowed(&self.full),
            n => Cow::Owned(insert(&self.table, n)),
        }
    }

    /// `rows` cut into statements: each chunk with the INSERT that takes it, in order.
    pub fn chunks<'r, T>(&'r self, rows: &'r [T]) -> impl Iterator<Item = (Cow<'r, str>, &'r [T])> {
        rows.chunks(self.per_statement)
            .map(move |chunk| (self.sql(chunk.len()), chunk))
    }
}

/// An INSERT of `rows` messages into `table`.
fn insert(table: &str, rows: usize) -> String {
    let values = vec!["(?, ?, ?, ?, ?, ?, ?, ?)"; rows].join(", ");
    format!("INSERT INTO {table} ({INSERT_COLUMNS}) VALUES {values}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::TraceContext;

    #[test]
    fn columns_hold_the_message() {
        let mut m = NewMessage::new("orders", b"{}".to_vec()).key("o-1");
        m.headers.insert("a".into(), "b".into());
        m.trace_context = Some(TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            tracestate: Some("k=v".into()),
        });
        let c = Columns::of(&m).unwrap();
        assert_eq!(c.id, m.id.hyphenated().to_string());
        assert_eq!(
            (c.topic, c.key, c.payload),
            ("orders", Some("o-1"), &b"{}"[..])
        );
        assert_eq!(c.headers, r#"{"a":"b"}"#);
        assert_eq!(
            c.traceparent,
            Some(m.trace_context.as_ref().unwrap().traceparent.as_str())
        );
        assert_eq!(c.tracestate, Some("k=v"));
        assert_eq!(c.created_at, m.created_at);
        let bare = NewMessage::new("t", Vec::new());
        assert_eq!(trace_columns(&bare), (None, None));
    }

    #[test]
    fn an_empty_topic_fails_the_whole_batch() {
        let good = NewMessage::new("orders", Vec::new());
        let bad = NewMessage::new("", Vec::new());
        let err = Columns::all(&[good.clone(), bad.clone()]).unwrap_err();
        assert_eq!(err.kind(), outbox_core::ErrorKind::Permanent);
        assert_eq!(
            err.message(),
            format!(
                "message {} has an empty topic; every message needs a topic",
                bad.id
            )
        );
        assert!(check_topic(&good).is_ok());
        assert_eq!(Columns::all(&[good]).unwrap().len(), 1);
    }

    #[test]
    fn copied_columns_are_the_seq_and_the_inserted_ones_aliased() {
        assert_eq!(COPY_COLUMNS, format!("seq, {INSERT_COLUMNS}"));
        assert_eq!(aliased("o", "seq, id"), "o.seq, o.id");
        assert_eq!(aliased("o", "seq"), "o.seq");
    }

    #[test]
    fn inserts_have_eight_values_a_row_and_chunk() {
        let inserts = Inserts::new("`db`.`outbox`", 3);
        assert_eq!(
            inserts.sql(1),
            format!("INSERT INTO `db`.`outbox` ({INSERT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
        );
        assert_eq!(inserts.sql(3).matches('?').count(), 24);
        assert_eq!(inserts.sql(2).matches('?').count(), 16);
        let rows = [1, 2, 3, 4, 5, 6, 7];
        let chunks: Vec<(usize, Vec<i32>)> = inserts
            .chunks(&rows)
            .map(|(sql, chunk)| (sql.matches('?').count(), chunk.to_vec()))
            .collect();
        assert_eq!(
            chunks,
            vec![(24, vec![1, 2, 3]), (24, vec![4, 5, 6]), (8, vec![7])]
        );
        assert_eq!(inserts.chunks(&[] as &[i32]).count(), 0);
        assert_eq!(Inserts::new("t", 0).per_statement(), 1);
    }
}
