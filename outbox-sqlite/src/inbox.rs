//! The inbox: the message ids a consumer has processed, recorded in the consumer's own
//! transaction, so a redelivered message is recognised and skipped.

use outbox_core::{Error, Result};
use sqlx::{Connection, SqliteConnection};

use outbox_sql::migrate;

use crate::OutboxTable;
use crate::error::{Cause, cause, db_error};
use crate::table::{NOW_MS, Versions};

/// A consumer's inbox: the message ids it has processed, per consumer name, in the table
/// `table` (and its versions in `<table>_migrations`). Inside the transaction that makes a
/// message's business change, [`process`](Self::process) records the message id and says
/// whether it is new; a redelivered message is a duplicate and its handler is skipped. The
/// record commits or rolls back with the business change.
///
/// The name follows the outbox's rules ([`OutboxTable::new`]) and is validated, then quoted;
/// it is never spliced in unchecked. Nothing here needs an async runtime of its own: the
/// calls only run statements on the connection they are given.
///
/// ```no_run
/// # async fn consume(pool: outbox_sqlite::sqlx::SqlitePool, message_id: uuid::Uuid)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_sqlite::sqlx::{self, Connection};
/// use outbox_sqlite::Inbox;
///
/// let inbox = Inbox::new("inbox")?; // once, at start-up, with `inbox.migrate`
/// let mut conn = pool.acquire().await?;
/// // IMMEDIATE: the write lock from the start, so the handler may read first.
/// let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
/// if inbox.process(&mut tx, "billing", message_id).await? {
///     // The handler: the business change, in the same transaction.
///     sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 1")
///         .execute(&mut *tx)
///         .await?;
/// }
/// tx.commit().await?; // then acknowledge the delivery
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Inbox {
    table: String,
    insert: String,
    purge: String,
}

impl Inbox {
    /// The inbox table `table`. Fails if the name is not a plain identifier (the rules of
    /// [`OutboxTable::new`]; errors keyed `table`).
    pub fn new(table: &str) -> Result<Inbox> {
        OutboxTable::new(table)?;
        let inbox = format!(r#""{table}""#);
        Ok(Inbox {
            table: table.to_string(),
            insert: format!(
                "INSERT INTO {inbox} (consumer, message_id, processed_at) VALUES (?, ?, {NOW_MS}) \
                 ON CONFLICT (consumer, message_id) DO NOTHING"
            ),
            purge: format!(
                "DELETE FROM {inbox} WHERE rowid IN (
                    SELECT rowid FROM {inbox} WHERE processed_at < {NOW_MS} - ? LIMIT ?)"
            ),
        })
    }

    /// The inbox table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The quoted name of the inbox table, or of its companion when `suffix` is not empty
    /// (`"_migrations"`).
    fn quoted(&self, suffix: &str) -> String {
        format!(r#""{}{suffix}""#, self.table)
    }

    /// Creates or upgrades the inbox table. Safe to run repeatedly and from several
    /// processes at once: a migration runs in one `BEGIN IMMEDIATE` transaction, so
    /// migrators take turns on the database's write lock (one waits up to the connection's
    /// `busy_timeout` for another, then fails `Unavailable`) and none applies a version
    /// twice. Refuses a table of that name that is not an inbox (the outbox table, say).
    /// Run it on a connection of its own, not inside a transaction.
    pub async fn migrate(&self, conn: &mut SqliteConnection) -> Result<()> {
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(fail)?;
        self.refuse_other_table(&mut tx).await?;
        let render = |step: &str| self.render(step);
        let mut versions = Versions::new(&mut tx, "inbox", &self.table, &render);
        migrate::run(&mut versions, MIGRATIONS, MIGRATIONS.len()).await?;
        tx.commit().await.map_err(fail)
    }

    /// A `Config` error when a table of the inbox's name exists without the inbox's columns.
    async fn refuse_other_table(&self, conn: &mut SqliteConnection) -> Result<()> {
        let query = sqlx::query(
            "SELECT (SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1),
                    (SELECT count(*) FROM pragma_table_info(?1) WHERE name IN (?2, ?3, ?4))",
        )
        .bind(&self.table);
        outbox_sql::refuse_other_table!(conn, query, &self.table, None, fail).await
    }

    outbox_sql::inbox_calls! {
        connection: SqliteConnection,
        id: |message_id| message_id.hyphenated().to_string(),
        // ON CONFLICT DO NOTHING: a duplicate inserts no row.
        recorded: |inserted| inserted.map(|done| done.rows_affected() == 1),
        age: outbox_sql::saturating_millis,
        storage: "sqlite",
        table: |inbox| inbox.quoted(""),
        missing: |error| cause(error) == Cause::Schema,
        other: |context, error| db_error(None, context, error),
        process:
        /// SQLite has one writer at a time: from this call to its end, the transaction holds
        /// the database's write lock, and a racing transaction waits for it (up to
        /// `busy_timeout`), then sees the record if it committed. A transaction that read
        /// before its first write cannot wait that way and fails `Unavailable` (database is
        /// locked) instead: begin consumer transactions with `BEGIN IMMEDIATE`
        /// (`conn.begin_with("BEGIN IMMEDIATE")`).
        purge:
        /// Small batches keep each write-lock short.
    }

    /// Fills a migration template's placeholders with validated, quoted names.
    fn render(&self, template: &str) -> String {
        migrate::fill_names(template, &self.table, "inbox", [], |suffix| {
            self.quoted(suffix)
        })
        .replace("{now_ms}", NOW_MS)
    }
}

/// Classifies an error of a migration statement.
fn fail(error: sqlx::Error) -> Error {
    db_error(None, "inbox migration failed", error)
}

/// Inbox migrations, applied in order (version = position + 1); never change the effect of
/// one that has shipped, add another. `processed_at` is integer milliseconds since the Unix
/// epoch, as the outbox's times. `IF NOT EXISTS`, so a table created by hand from
/// docs/inbox.md is adopted.
const MIGRATIONS: &[&str] = &[r#"
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer     TEXT NOT NULL CHECK (typeof(consumer) = 'text' AND consumer <> ''),
    message_id   TEXT NOT NULL CHECK (typeof(message_id) = 'text'),
    processed_at INTEGER NOT NULL DEFAULT ({now_ms}),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "{table}_processed_at" ON {inbox} (processed_at);
"#];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_outbox_rules() {
        assert!(Inbox::new("inbox").is_ok());
        for (table, expected) in [
            ("bad name", "table `bad name`"),
            ("sqlite_x", "is not allowed"),
        ] {
            let err = Inbox::new(table).unwrap_err();
            assert_eq!(err.kind(), outbox_core::ErrorKind::Config, "{err}");
            assert!(err.to_string().contains(expected), "{err}");
        }
    }

    #[test]
    fn migrations_fill_every_placeholder() {
        let inbox = Inbox::new("inbox").unwrap();
        // No placeholder is left ({now_ms} included), and the table is the inbox's, quoted.
        for sql in MIGRATIONS.iter().map(|template| inbox.render(template)) {
            assert!(!sql.contains('{') && sql.contains(r#""inbox""#), "{sql}");
        }
    }
}
