//! The inbox: the message ids a consumer has processed, recorded in the consumer's own
//! transaction, so a redelivered message is recognised and skipped.

use outbox_core::{Error, Result};
use sqlx::{Connection, Executor, PgConnection, Row};

use outbox_sql::inbox::{self, COLUMNS};
use outbox_sql::{fnv1a, migrate};

use crate::OutboxTable;
use crate::error::db_error;
use crate::table::{applied_version, create_schema_in, schema_exists};

/// A consumer's inbox: the message ids it has processed, per consumer name, in the table
/// `schema.table` (and its versions in `<table>_migrations`). Inside the transaction that
/// makes a message's business change, [`process`](Self::process) records the message id
/// and says whether it is new; a redelivered message is a duplicate and its handler is
/// skipped. The record commits or rolls back with the business change.
///
/// Names follow the outbox's rules ([`OutboxTable::new`]) and are validated, then quoted;
/// they are never spliced in unchecked. Nothing here needs an async runtime of its own: the
/// calls only run statements on the connection they are given.
///
/// ```no_run
/// # async fn consume(pool: outbox_postgres::sqlx::PgPool, message_id: uuid::Uuid)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_postgres::{Inbox, sqlx};
///
/// let inbox = Inbox::new("app", "inbox")?; // once, at start-up, with `inbox.migrate`
/// let mut tx = pool.begin().await?;
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
    schema: String,
    table: String,
    insert: String,
    purge: String,
}

impl Inbox {
    /// The inbox table `schema.table`. Fails if either name is not a plain identifier (the
    /// rules of [`OutboxTable::new`]; errors keyed `schema` and `table`).
    pub fn new(schema: &str, table: &str) -> Result<Inbox> {
        OutboxTable::new(schema, table)?;
        let inbox = format!(r#""{schema}"."{table}""#);
        Ok(Inbox {
            schema: schema.to_string(),
            table: table.to_string(),
            insert: format!(
                "INSERT INTO {inbox} (consumer, message_id) VALUES ($1, $2) \
                 ON CONFLICT (consumer, message_id) DO NOTHING"
            ),
            // SKIP LOCKED: two purgers at once share the work instead of waiting.
            purge: format!(
                "DELETE FROM {inbox} WHERE (consumer, message_id) IN (
                    SELECT consumer, message_id FROM {inbox}
                    WHERE processed_at < now() - $1 * interval '1 microsecond'
                    LIMIT $2 FOR UPDATE SKIP LOCKED)"
            ),
        })
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The inbox table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The quoted, schema-qualified name of the inbox table, or of its companion when
    /// `suffix` is not empty (`"_migrations"`).
    fn qualified(&self, suffix: &str) -> String {
        format!(r#""{}"."{}{suffix}""#, self.schema, self.table)
    }

    /// Creates or upgrades the inbox table (and the schema, if missing). Safe to run
    /// concurrently and repeatedly: migrators of one inbox take turns on an advisory lock,
    /// and each applies the versions after the one recorded in `<table>_migrations`, in one
    /// transaction. Refuses a table of that name that is not an inbox (the outbox table,
    /// say). Run it on a connection of its own, not inside a transaction.
    pub async fn migrate(&self, conn: &mut PgConnection) -> Result<()> {
        let schema_exists = schema_exists(conn, &self.schema).await.map_err(fail)?;
        let mut tx = conn.begin().await.map_err(fail)?;
        if !schema_exists {
            // The outbox's lock on the schema's name: two migrators, of an outbox or an
            // inbox, never both create it.
            create_schema_in(&mut tx, &self.schema)
                .await
                .map_err(fail)?;
        }
        // A transaction-level lock, waited for in the server: released by the commit or the
        // rollback, whatever happens to this future.
        tx.execute(sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(self.migration_key()))
            .await
            .map_err(fail)?;
        migrate::run(
            &mut Versions {
                conn: &mut tx,
                inbox: self,
            },
            MIGRATIONS,
            MIGRATIONS.len(),
        )
        .await?;
        tx.commit().await.map_err(fail)
    }

    /// A `Config` error when a table of the inbox's name exists without the inbox's columns.
    async fn refuse_other_table(&self, conn: &mut PgConnection) -> Result<()> {
        let (exists, found): (bool, i64) = conn
            .fetch_one(
                sqlx::query(
                    "SELECT to_regclass($1) IS NOT NULL, (SELECT count(*) FROM pg_attribute \
                     WHERE attrelid = to_regclass($1) AND attname::text = ANY($2) AND NOT attisdropped)",
                )
                .bind(self.qualified(""))
                .bind(&COLUMNS[..]),
            )
            .await
            .and_then(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .map_err(fail)?;
        inbox::check_table(&self.table, Some(("schema", &self.schema)), exists, found)
    }

    outbox_sql::inbox_calls! {
        connection: PgConnection,
        id: |message_id| message_id,
        // ON CONFLICT DO NOTHING: a duplicate inserts no row.
        recorded: |inserted| inserted.map(|done| done.rows_affected() == 1),
        age: outbox_sql::saturating_micros,
        storage: "postgres",
        table: |inbox| inbox.qualified(""),
        other: |context, error| db_error(context, error),
        process:
        /// Two transactions racing on the same id: the second waits (on the primary key) until
        /// the first ends, then gets `false` if it committed and `true` if it rolled back. At
        /// REPEATABLE READ or SERIALIZABLE, the second fails instead with a serialization error
        /// (`Temporary`): roll back and let the message be redelivered.
        purge:
        /// Small batches keep each statement's locks and WAL short; two purgers at once skip
        /// each other's rows.
    }

    /// The advisory lock key that serialises migrators of this inbox.
    fn migration_key(&self) -> i64 {
        fnv1a(&format!(
            "outbox-inbox-migrate:{}.{}",
            self.schema, self.table
        )) as i64
    }

    /// Fills a migration template's placeholders with validated, quoted names.
    fn render(&self, template: &str) -> String {
        migrate::fill_names(template, &self.table, "inbox", [], |suffix| {
            self.qualified(suffix)
        })
    }
}

/// Classifies an error of a migration statement.
fn fail(error: sqlx::Error) -> Error {
    db_error("inbox migration failed", error)
}

/// The versions of an inbox's migrations (`<table>_migrations`), in the migration's
/// transaction, which holds the inbox's advisory lock: the steps commit together.
struct Versions<'a> {
    conn: &'a mut PgConnection,
    inbox: &'a Inbox,
}

impl migrate::Dialect for Versions<'_> {
    type Step = &'static str;

    async fn check(&mut self) -> Result<()> {
        self.inbox.refuse_other_table(self.conn).await
    }

    async fn applied(&mut self) -> Result<i64> {
        let versions = self.inbox.qualified("_migrations");
        let applied = applied_version(self.conn, &versions).await.map_err(fail)?;
        Ok(i64::from(applied))
    }

    async fn apply(&mut self, version: i64, template: &&'static str) -> Result<()> {
        let Inbox { schema, table, .. } = self.inbox;
        tracing::info!(%schema, %table, version, "applying inbox migration");
        let version = i32::try_from(version)
            .map_err(|_| Error::permanent(format!("inbox migration {version} is out of range")))?;
        let record = format!(
            "INSERT INTO {} (version) VALUES ($1)",
            self.inbox.qualified("_migrations")
        );
        self.conn
            .execute(self.inbox.render(template).as_str())
            .await
            .map_err(fail)?;
        self.conn
            .execute(sqlx::query(&record).bind(version))
            .await
            .map_err(fail)?;
        Ok(())
    }
}

/// Inbox migrations, applied in order (version = position + 1); never change the effect of
/// one that has shipped, add another. `IF NOT EXISTS`, so a table created by hand from
/// docs/inbox.md is adopted.
const MIGRATIONS: &[&str] = &[r#"
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer     text NOT NULL CHECK (consumer <> ''),
    message_id   uuid NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {table}_processed_at ON {inbox} (processed_at);
"#];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_outbox_rules() {
        assert!(Inbox::new("app", "inbox").is_ok());
        for (schema, table, expected) in [
            ("app", "bad name", "table `bad name`"),
            ("Bad", "inbox", "schema `Bad`"),
            ("app", "x\"; DROP TABLE y; --", "is not allowed"),
        ] {
            let err = Inbox::new(schema, table).unwrap_err();
            assert_eq!(err.kind(), outbox_core::ErrorKind::Config, "{err}");
            assert!(err.to_string().contains(expected), "{err}");
        }
    }

    #[test]
    fn migrations_fill_every_placeholder() {
        let inbox = Inbox::new("app", "inbox").unwrap();
        // No placeholder is left, and the table is the inbox's, quoted.
        for sql in MIGRATIONS.iter().map(|template| inbox.render(template)) {
            assert!(
                !sql.contains('{') && sql.contains(r#""app"."inbox""#),
                "{sql}"
            );
        }
    }

    #[test]
    fn migration_locks_are_per_inbox() {
        let a = Inbox::new("app", "inbox").unwrap();
        let b = Inbox::new("app", "inbox2").unwrap();
        assert_ne!(a.migration_key(), b.migration_key());
    }
}
