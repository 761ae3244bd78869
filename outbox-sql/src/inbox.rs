//! The inbox's rules, the same in every SQL storage: which consumer names are allowed, that
//! a record is made inside the consumer's transaction, what a purge deletes, and the errors
//! that send the user to `Inbox::migrate`. Each storage keeps its statements.

use std::time::Duration;

use outbox_core::{Error, Result};

/// Longest consumer name accepted, in bytes.
pub const MAX_CONSUMER: usize = 255;

/// Ages past this delete nothing: no record is that old, and the cut-off would fall outside
/// the range of a timestamp or a `DATETIME`.
pub const MAX_AGE: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// The columns an inbox table must have; a table without them is not an inbox.
pub const COLUMNS: [&str; 3] = ["consumer", "message_id", "processed_at"];

/// A `Config` error unless `consumer` is 1 to [`MAX_CONSUMER`] bytes.
pub fn check_consumer(consumer: &str) -> Result<()> {
    if consumer.is_empty() || consumer.len() > MAX_CONSUMER {
        return Err(Error::config(format!(
            "inbox consumer name `{consumer}` is not allowed: use 1 to {MAX_CONSUMER} bytes \
             (one name per consumer, the same on every delivery)"
        )));
    }
    Ok(())
}

/// The checks of `Inbox::process` before it records anything: [`check_consumer`], then
/// that it runs inside a transaction (`in_transaction`), else [`outside_transaction`].
pub fn check_process(consumer: &str, in_transaction: bool) -> Result<()> {
    check_consumer(consumer)?;
    if !in_transaction {
        return Err(outside_transaction());
    }
    Ok(())
}

/// The `Config` error of `Inbox::process` outside a transaction, where the record would
/// commit at once, before the handler.
pub fn outside_transaction() -> Error {
    Error::config(
        "inbox: process() must run inside the consumer's transaction (pass `&mut *tx` of a \
         `sqlx::Transaction`), so that the record commits or rolls back with the handler's \
         change; outside one it would commit at once, and a failing handler would lose the \
         message",
    )
}

/// A `Config` error (keyed `table`) when a table named `table` exists (`exists`) but has
/// fewer than all of [`COLUMNS`] (`found` of them): it is not an inbox (the outbox table,
/// say), and migrating it would adopt it. `within` names where the table is, such as
/// `Some(("schema", "app"))`; `None` where a database has one namespace (SQLite).
pub fn check_table(
    table: &str,
    within: Option<(&str, &str)>,
    exists: bool,
    found: i64,
) -> Result<()> {
    if !exists || found >= COLUMNS.len() as i64 {
        return Ok(());
    }
    let within = within
        .map(|(kind, name)| format!(" in {kind} `{name}`"))
        .unwrap_or_default();
    Err(Error::setting(
        "table",
        format!(
            "`{table}` names an existing table{within} that is not an inbox (it lacks the \
             columns consumer, message_id and processed_at); give the inbox a table of its \
             own, not the outbox's or an application's"
        ),
    ))
}

/// The `Schema` error of a statement on an inbox table that is missing or lacks a column:
/// it calls for `Inbox::migrate` (not `outbox migrate`, which knows nothing of inboxes).
/// `storage` is the storage's name (`postgres`, `mysql`, `sqlite`), `context` what failed,
/// `quoted` the table's quoted name. The caller adds the database error as the source.
pub fn missing_table(storage: &str, context: &str, quoted: &str) -> Error {
    Error::schema(format!(
        "{storage}: {context}: the inbox table {quoted} is missing or older than this release; \
         run Inbox::migrate"
    ))
}

/// The age cut-off of `Inbox::purge(older_than, limit)`, or `None` when the purge deletes
/// nothing without asking the database: `limit` is 0, or `older_than` is past
/// [`MAX_AGE`].
pub fn purge_age(older_than: Duration, limit: u32) -> Option<Duration> {
    (limit > 0 && older_than <= MAX_AGE).then_some(older_than)
}

/// Refuses a table that is not an inbox ([`check_table`]), a future of `Result<()>`: runs
/// on the sqlx connection `$conn` the query `$query`, whose last placeholders take
/// [`COLUMNS`] one each (MySQL, SQLite) and whose row is whether a table of the inbox's
/// name `$table` exists (a count) and how many of those columns it has. `$within` is
/// [`check_table`]'s, `$fail` classifies the query's error.
///
/// ```text
/// let query = sqlx::query("SELECT (...exists...), (...columns IN (?, ?, ?)...)").bind(&self.table);
/// outbox_sql::refuse_other_table!(conn, query, &self.table, None, fail).await
/// ```
#[macro_export]
macro_rules! refuse_other_table {
    ($conn:expr, $query:expr, $table:expr, $within:expr, $fail:expr) => {
        async {
            let query = $crate::inbox::COLUMNS
                .iter()
                .fold($query, |query, column| query.bind(*column));
            let (exists, found): (i64, i64) = sqlx::Executor::fetch_one(&mut *$conn, query)
                .await
                .and_then(|row| Ok((sqlx::Row::try_get(&row, 0)?, sqlx::Row::try_get(&row, 1)?)))
                .map_err($fail)?;
            $crate::inbox::check_table($table, $within, exists > 0, found)
        }
    };
}

/// The calls of a SQL storage's `Inbox` that every storage makes the same way, written in
/// its `impl Inbox` block: `process` ([`check_process`], then the storage's INSERT) and
/// `purge` ([`purge_age`], then its DELETE), on its sqlx connection type `connection`.
///
/// The `Inbox` keeps the statements in its fields `insert` (binds the consumer, then `id`:
/// the message id as the table holds it) and `purge` (binds the age as the function `age`
/// makes it, then the limit). `recorded` tells from the INSERT's result whether the message
/// is new (an `Err` left is an error). Their errors go through the method `error` this
/// writes too: an error that `missing` says is of a missing table or column is
/// [`missing_table`] (of storage `storage` and the quoted table `table`), any other is what
/// `other` makes of it; without `missing`, the SQLSTATE tells
/// ([`missing_table_or_column`](crate::missing_table_or_column): PostgreSQL, MySQL). The
/// doc lines after `process:` and `purge:` are what each storage does its own way (how
/// racing transactions behave, what keeps a purge's batches cheap).
///
/// Under `cfg(test)` it adds `calls_are_spawnable`, which compiles only if `migrate`,
/// `process` and `purge` can run in a spawned task.
#[macro_export]
macro_rules! inbox_calls {
    (
        connection: $conn:ty,
        id: |$message_id:ident| $id:expr,
        recorded: |$inserted:ident| $recorded:expr,
        age: $age:path,
        storage: $storage:literal,
        table: |$inbox:ident| $table:expr,
        $(missing: |$missing_error:ident| $missing:expr,)?
        other: |$context:ident, $other_error:ident| $other:expr,
        process: $(#[doc = $process_doc:literal])*
        purge: $(#[doc = $purge_doc:literal])*
    ) => {
        /// Records that `consumer` processed `message_id`, on `conn`: the consumer's open
        /// transaction (`&mut *tx`), the one that makes the message's business change.
        /// `true`: the message is new, run the handler; `false`: a duplicate (already
        /// committed by an earlier delivery, or earlier in this transaction), skip it. The
        /// record commits or rolls back with the transaction, so a handler that fails leaves
        /// none behind and the next delivery runs it again.
        ///
        $(#[doc = $process_doc])*
        ///
        /// Refused (`Config`) outside a transaction begun through sqlx, where the record
        /// would commit at once, before the handler, and an empty or over-255-byte
        /// `consumer`.
        pub async fn process(
            &self,
            conn: &mut $conn,
            consumer: &str,
            $message_id: uuid::Uuid,
        ) -> outbox_core::Result<bool> {
            let in_transaction = sqlx::Connection::is_in_transaction(&*conn);
            $crate::inbox::check_process(consumer, in_transaction)?;
            let query = sqlx::query(&self.insert).bind(consumer).bind($id);
            let $inserted = sqlx::Executor::execute(&mut *conn, query).await;
            let recorded: ::std::result::Result<bool, sqlx::Error> = $recorded;
            recorded.map_err(|e| self.error("recording a message in the inbox failed", e))
        }

        /// Removes records processed more than `older_than` ago (by `processed_at`, on the
        /// database clock), at most `limit` of them; returns how many. Call it again until
        /// it returns less than `limit`, on a connection of its own, not in a consumer's
        /// transaction.
        ///
        $(#[doc = $purge_doc])*
        pub async fn purge(
            &self,
            conn: &mut $conn,
            older_than: ::std::time::Duration,
            limit: u32,
        ) -> outbox_core::Result<u64> {
            let Some(age) = $crate::inbox::purge_age(older_than, limit) else {
                return Ok(0);
            };
            let query = sqlx::query(&self.purge)
                .bind($age(age))
                .bind(i64::from(limit));
            let done = sqlx::Executor::execute(&mut *conn, query)
                .await
                .map_err(|e| self.error("purging the inbox failed", e))?;
            Ok(done.rows_affected())
        }

        /// Classifies an error of a statement on the inbox table: a missing table or column
        /// calls for `Inbox::migrate` (not `outbox migrate`, which knows nothing of inboxes).
        fn error(&self, context: &str, error: sqlx::Error) -> outbox_core::Error {
            let seen = &error;
            if $crate::__missing_table!(seen $(, |$missing_error| $missing)?) {
                let $inbox = self;
                return $crate::inbox::missing_table($storage, context, &$table).with_source(error);
            }
            let ($context, $other_error) = (context, error);
            $other
        }

        #[cfg(test)]
        #[allow(dead_code)]
        fn calls_are_spawnable(self, mut conn: $conn) {
            drop(tokio::spawn(async move {
                self.migrate(&mut conn).await?;
                self.process(&mut conn, "c", uuid::Uuid::nil()).await?;
                self.purge(&mut conn, ::std::time::Duration::ZERO, 1).await
            }));
        }
    };
}

/// Whether the sqlx error `$error` (a reference) is of a missing table or column, for
/// [`inbox_calls!`]: what the storage's `|error| ...` says, else what the SQLSTATE says.
#[doc(hidden)]
#[macro_export]
macro_rules! __missing_table {
    ($error:ident) => {
        matches!(
            $error,
            sqlx::Error::Database(db) if $crate::missing_table_or_column(db.code().as_deref())
        )
    };
    ($error:ident, |$named:ident| $missing:expr) => {{
        let $named = $error;
        $missing
    }};
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorKind;

    #[test]
    fn consumer_names_are_checked() {
        assert!(check_consumer("billing").is_ok());
        assert!(check_consumer(&"c".repeat(255)).is_ok());
        assert!(check_consumer(&"é".repeat(127)).is_ok());
        for bad in [String::new(), "c".repeat(256), "é".repeat(128)] {
            let err = check_consumer(&bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{err}");
            assert!(err.to_string().contains("1 to 255 bytes"), "{err}");
        }
    }

    #[test]
    fn outside_a_transaction_is_a_config_error() {
        let err = outside_transaction();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(
            err.message()
                .starts_with("inbox: process() must run inside")
        );
        assert!(check_process("billing", true).is_ok());
        let err = check_process("billing", false).unwrap_err();
        assert_eq!(err.message(), outside_transaction().message());
        // The name is checked first, in a transaction or not.
        let err = check_process("", false).unwrap_err();
        assert!(err.to_string().contains("1 to 255 bytes"), "{err}");
    }

    #[test]
    fn only_tables_with_the_inbox_columns_are_adopted() {
        assert!(check_table("inbox", None, false, 0).is_ok());
        assert!(check_table("inbox", None, true, 3).is_ok());
        let err = check_table("outbox", None, true, 0).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(
            err.message()
                .starts_with("table `outbox` names an existing table that is not an inbox"),
            "{err}"
        );
        let err = check_table("outbox", Some(("schema", "app")), true, 2).unwrap_err();
        assert!(
            err.message().starts_with(
                "table `outbox` names an existing table in schema `app` that is not an inbox"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_missing_table_calls_for_inbox_migrate() {
        let err = missing_table("sqlite", "purging the inbox failed", r#""inbox""#);
        assert_eq!(err.kind(), ErrorKind::Schema);
        assert_eq!(
            err.message(),
            r#"sqlite: purging the inbox failed: the inbox table "inbox" is missing or older than this release; run Inbox::migrate"#
        );
    }

    #[test]
    fn purges_past_any_record_or_of_nothing_ask_nothing() {
        let day = Duration::from_secs(86_400);
        assert_eq!(purge_age(day, 10), Some(day));
        assert_eq!(purge_age(Duration::ZERO, 1), Some(Duration::ZERO));
        assert_eq!(purge_age(MAX_AGE, 1), Some(MAX_AGE));
        assert_eq!(purge_age(day, 0), None);
        assert_eq!(purge_age(MAX_AGE + Duration::from_secs(1), 10), None);
        assert_eq!(purge_age(Duration::MAX, 10), None);
    }
}
