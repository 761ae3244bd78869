//! The inbox: the message ids a consumer has processed, recorded in the consumer's own
//! transaction, so a redelivered message is recognised and skipped.

use std::time::Duration;

use outbox_core::{Error, Result};
use sqlx::{Connection, Executor, PgConnection, Row};
use uuid::Uuid;

use crate::OutboxTable;
use crate::error::db_error;

/// Longest consumer name accepted, in bytes.
const MAX_CONSUMER: usize = 255;

/// Ages past this delete nothing: no record is that old, and the cut-off would fall outside
/// the range of a timestamp.
const MAX_AGE: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// The columns an inbox table must have; a table without them is not an inbox.
const COLUMNS: [&str; 3] = ["consumer", "message_id", "processed_at"];

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
        // An existing schema needs no lock, nor the CREATE privilege on the database.
        let schema_exists: bool = conn
            .fetch_one(
                sqlx::query("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)")
                    .bind(&self.schema),
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(fail)?;
        let mut tx = conn.begin().await.map_err(fail)?;
        if !schema_exists {
            // The outbox's lock on the schema's name (the key of `OutboxTable`'s schema
            // lock): two migrators, of an outbox or an inbox, never both create it.
            tx.execute(
                sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(schema_key(&self.schema)),
            )
            .await
            .map_err(fail)?;
            let create = format!(r#"CREATE SCHEMA IF NOT EXISTS "{}""#, self.schema);
            tx.execute(create.as_str()).await.map_err(fail)?;
        }
        // A transaction-level lock, waited for in the server: released by the commit or the
        // rollback, whatever happens to this future.
        tx.execute(sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(self.migration_key()))
            .await
            .map_err(fail)?;
        self.refuse_other_table(&mut tx).await?;
        let versions = self.qualified("_migrations");
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {versions} (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        );
        tx.execute(create.as_str()).await.map_err(fail)?;
        let applied: i32 = tx
            .fetch_one(format!("SELECT coalesce(max(version), 0) FROM {versions}").as_str())
            .await
            .and_then(|row| row.try_get(0))
            .map_err(fail)?;
        let record = format!("INSERT INTO {versions} (version) VALUES ($1)");
        for (version, template) in (1..).zip(MIGRATIONS) {
            if version <= applied {
                continue;
            }
            tracing::info!(schema = %self.schema, table = %self.table, version, "applying inbox migration");
            tx.execute(self.render(template).as_str())
                .await
                .map_err(fail)?;
            tx.execute(sqlx::query(&record).bind(version))
                .await
                .map_err(fail)?;
        }
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
        if exists && found < COLUMNS.len() as i64 {
            return Err(Error::setting(
                "table",
                format!(
                    "`{}` names an existing table in schema `{}` that is not an inbox (it lacks \
                     the columns consumer, message_id and processed_at); give the inbox a \
                     table of its own, not the outbox's or an application's",
                    self.table, self.schema
                ),
            ));
        }
        Ok(())
    }

    /// Records that `consumer` processed `message_id`, on `conn`: the consumer's open
    /// transaction (`&mut *tx`), the one that makes the message's business change. `true`:
    /// the message is new, run the handler; `false`: a duplicate (already committed by an
    /// earlier delivery, or earlier in this transaction), skip it. The record commits or
    /// rolls back with the transaction, so a handler that fails leaves none behind and the
    /// next delivery runs it again.
    ///
    /// Two transactions racing on the same id: the second waits (on the primary key) until
    /// the first ends, then gets `false` if it committed and `true` if it rolled back. At
    /// REPEATABLE READ or SERIALIZABLE, the second fails instead with a serialization error
    /// (`Temporary`): roll back and let the message be redelivered.
    ///
    /// Refused (`Config`) outside a transaction begun through sqlx, where the record would
    /// commit at once, before the handler, and an empty or over-255-byte `consumer`.
    pub async fn process(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: Uuid,
    ) -> Result<bool> {
        check_consumer(consumer)?;
        if !conn.is_in_transaction() {
            return Err(outside_transaction());
        }
        let done = conn
            .execute(sqlx::query(&self.insert).bind(consumer).bind(message_id))
            .await
            .map_err(|e| self.error("recording a message in the inbox failed", e))?;
        Ok(done.rows_affected() == 1)
    }

    /// Removes records processed more than `older_than` ago (by `processed_at`, on the
    /// database clock), at most `limit` of them; returns how many. Call it again until it
    /// returns less than `limit`: small batches keep each statement's locks and WAL short.
    /// Run it on a connection of its own (not in a consumer's transaction); two purgers at
    /// once skip each other's rows.
    pub async fn purge(
        &self,
        conn: &mut PgConnection,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64> {
        if limit == 0 || older_than > MAX_AGE {
            return Ok(0);
        }
        let micros = i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX);
        let done = conn
            .execute(sqlx::query(&self.purge).bind(micros).bind(i64::from(limit)))
            .await
            .map_err(|e| self.error("purging the inbox failed", e))?;
        Ok(done.rows_affected())
    }

    /// Classifies an error of a statement on the inbox table: a missing table or column
    /// calls for [`Inbox::migrate`] (not `outbox migrate`, which knows nothing of inboxes).
    fn error(&self, context: &str, error: sqlx::Error) -> Error {
        let missing = matches!(
            &error,
            sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("42P01" | "42703"))
        );
        if missing {
            return Error::schema(format!(
                "postgres: {context}: the inbox table {} is missing or older than this release; \
                 run Inbox::migrate",
                self.qualified("")
            ))
            .with_source(error);
        }
        db_error(context, error)
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
        template
            .replace("{inbox}", &self.qualified(""))
            .replace("{table}", &self.table)
    }
}

/// The key of the advisory lock that serialises `CREATE SCHEMA`: the same as
/// `OutboxTable`'s, so outbox and inbox migrators take turns on a new schema.
fn schema_key(schema: &str) -> i64 {
    fnv1a(&format!("outbox-schema:{schema}")) as i64
}

/// 64-bit FNV-1a: stable across processes and versions, unlike std's hasher (as in
/// `OutboxTable`, whose lock keys these must match).
fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// A `Config` error unless `consumer` is 1 to 255 bytes.
fn check_consumer(consumer: &str) -> Result<()> {
    if consumer.is_empty() || consumer.len() > MAX_CONSUMER {
        return Err(Error::config(format!(
            "inbox consumer name `{consumer}` is not allowed: use 1 to {MAX_CONSUMER} bytes \
             (one name per consumer, the same on every delivery)"
        )));
    }
    Ok(())
}

/// The error of [`Inbox::process`] outside a transaction.
fn outside_transaction() -> Error {
    Error::config(
        "inbox: process() must run inside the consumer's transaction (pass `&mut *tx` of a \
         `sqlx::Transaction`), so that the record commits or rolls back with the handler's \
         change; outside one it would commit at once, and a failing handler would lose the \
         message",
    )
}

/// Classifies an error of a migration statement.
fn fail(error: sqlx::Error) -> Error {
    db_error("inbox migration failed", error)
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
        let err = Inbox::new("app", "bad name").unwrap_err();
        assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
        assert!(err.to_string().contains("table `bad name`"), "{err}");
        let err = Inbox::new("Bad", "inbox").unwrap_err();
        assert!(err.to_string().contains("schema `Bad`"), "{err}");
        let err = Inbox::new("app", "x\"; DROP TABLE y; --").unwrap_err();
        assert!(err.to_string().contains("is not allowed"), "{err}");
    }

    #[test]
    fn consumer_names_are_checked() {
        assert!(check_consumer("billing").is_ok());
        assert!(check_consumer(&"c".repeat(255)).is_ok());
        for bad in [String::new(), "c".repeat(256), "é".repeat(128)] {
            let err = check_consumer(&bad).unwrap_err();
            assert_eq!(err.kind(), outbox_core::ErrorKind::Config, "{err}");
            assert!(err.to_string().contains("1 to 255 bytes"), "{err}");
        }
    }

    #[test]
    fn migrations_fill_every_placeholder() {
        let inbox = Inbox::new("app", "inbox").unwrap();
        for template in MIGRATIONS {
            let sql = inbox.render(template);
            assert!(
                !sql.contains("{inbox}") && !sql.contains("{table}"),
                "{sql}"
            );
            assert!(sql.contains(r#""app"."inbox""#), "{sql}");
        }
    }

    #[test]
    fn migration_locks_are_per_inbox() {
        let a = Inbox::new("app", "inbox").unwrap();
        let b = Inbox::new("app", "inbox2").unwrap();
        assert_ne!(a.migration_key(), b.migration_key());
    }

    /// Compiles only if the calls can run in a spawned task.
    #[allow(dead_code)]
    fn calls_are_spawnable(inbox: Inbox, mut conn: PgConnection) {
        drop(tokio::spawn(async move {
            inbox.migrate(&mut conn).await?;
            inbox.process(&mut conn, "c", Uuid::nil()).await?;
            inbox.purge(&mut conn, Duration::ZERO, 1).await
        }));
    }
}
