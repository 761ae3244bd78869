//! The inbox: the message ids a consumer has processed, recorded in the consumer's own
//! transaction, so a redelivered message is recognised and skipped.

use outbox_core::{Error, Result};
use sqlx::MySqlConnection;
use sqlx::mysql::MySqlDatabaseError;

use outbox_sql::migrate;

use crate::OutboxTable;
use crate::error::db_error;
use crate::table::Versions;

/// ER_DUP_ENTRY: the (consumer, message_id) key is taken.
const DUPLICATE_KEY: u16 = 1062;

/// A consumer's inbox: the message ids it has processed, per consumer name, in the table
/// `database.table` (and its versions in `<table>_migrations`). Inside the transaction that
/// makes a message's business change, [`process`](Self::process) records the message id
/// and says whether it is new; a redelivered message is a duplicate and its handler is
/// skipped. The record commits or rolls back with the business change.
///
/// Names follow the outbox's rules ([`OutboxTable::new`]) and are validated, then quoted
/// with backticks; they are never spliced in unchecked. Nothing here needs an async runtime
/// of its own: the calls only run statements on the connection they are given.
///
/// ```no_run
/// # async fn consume(pool: outbox_mysql::sqlx::MySqlPool, message_id: uuid::Uuid)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_mysql::{Inbox, sqlx};
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
    database: String,
    table: String,
    insert: String,
    purge: String,
}

impl Inbox {
    /// The inbox table `table` in database `database`. Fails if a name is not a plain
    /// identifier (the rules of [`OutboxTable::new`]; errors keyed `database` and `table`).
    pub fn new(database: &str, table: &str) -> Result<Inbox> {
        OutboxTable::new(database, table)?;
        let inbox = format!("`{database}`.`{table}`");
        Ok(Inbox {
            database: database.to_string(),
            table: table.to_string(),
            // A plain INSERT whose duplicate-key error is the answer: INSERT IGNORE would
            // also turn other errors (truncation, bad values) into warnings, and ON DUPLICATE
            // KEY UPDATE counts a found row as affected under CLIENT_FOUND_ROWS, which sqlx
            // sets. MySQL rolls back only the failed statement, not the transaction.
            insert: format!(
                "INSERT INTO {inbox} (consumer, message_id, processed_at) \
                 VALUES (?, ?, UTC_TIMESTAMP(6))"
            ),
            purge: format!(
                "DELETE FROM {inbox} WHERE processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                 ORDER BY processed_at LIMIT ?"
            ),
        })
    }

    /// The database name.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// The inbox table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The quoted, qualified name of the inbox table, or of its companion when `suffix` is
    /// not empty (`"_migrations"`).
    fn qualified(&self, suffix: &str) -> String {
        format!("`{}`.`{}{suffix}`", self.database, self.table)
    }

    /// Creates or upgrades the inbox table. Safe to run repeatedly and from several
    /// processes at once: migrators take turns on a named lock (`GET_LOCK`, one waits up to
    /// a minute for another), and versions are recorded in `<table>_migrations` and never
    /// run twice. Refuses a table of that name that is not an inbox (the outbox table,
    /// say). MySQL commits each DDL statement at once, and with it any open transaction:
    /// run it on a connection of its own.
    pub async fn migrate(&self, conn: &mut MySqlConnection) -> Result<()> {
        let render = |step: &str| self.render(step);
        let qualified = |suffix: &str| self.qualified(suffix);
        let mut versions = Versions::new(conn, qualified, self.lock_name(), &render, Some(self));
        migrate::run(&mut versions, MIGRATIONS, MIGRATIONS.len()).await
    }

    /// A `Config` error when a table of the inbox's name exists without the inbox's columns.
    pub(crate) async fn refuse_other_table(&self, conn: &mut MySqlConnection) -> Result<()> {
        let query = sqlx::query(
            "SELECT (SELECT COUNT(*) FROM information_schema.tables \
                     WHERE table_schema = ? AND table_name = ?),
                    (SELECT COUNT(*) FROM information_schema.columns \
                     WHERE table_schema = ? AND table_name = ? \
                     AND column_name IN (?, ?, ?))",
        )
        .bind(&self.database)
        .bind(&self.table)
        .bind(&self.database)
        .bind(&self.table);
        let within = Some(("database", self.database.as_str()));
        outbox_sql::refuse_other_table!(conn, query, &self.table, within, fail).await
    }

    outbox_sql::inbox_calls! {
        connection: MySqlConnection,
        id: |message_id| message_id.hyphenated().to_string(),
        // A taken (consumer, message_id) key is the answer: a duplicate.
        recorded: |inserted| match inserted {
            Ok(_) => Ok(true),
            Err(e) if is_duplicate(&e) => Ok(false),
            Err(e) => Err(e),
        },
        age: outbox_sql::saturating_micros,
        storage: "mysql",
        table: |inbox| inbox.qualified(""),
        other: |context, error| db_error(None, context, error),
        process:
        /// Two transactions racing on the same id: the second waits (on the primary key's row
        /// lock, up to `innodb_lock_wait_timeout`) until the first ends, then gets `false` if it
        /// committed and `true` if it rolled back, at any isolation level. Three or more racing
        /// with a rollback can deadlock; InnoDB then rolls one back (`Temporary`): let the
        /// message be redelivered.
        purge:
        /// Oldest first, in small batches that keep each statement's locks short; on a
        /// connection in autocommit.
    }

    /// The name of the migration lock: `GET_LOCK` names are server-wide and at most 64
    /// characters, so a hash of the qualified table stands for it.
    fn lock_name(&self) -> String {
        outbox_sql::lock_name(
            "outbox_inbox_migrate",
            &format!("{}.{}", self.database, self.table),
        )
    }

    /// Fills a migration template's placeholders with validated, quoted names.
    fn render(&self, template: &str) -> String {
        migrate::fill_names(template, &self.table, "inbox", [], |suffix| {
            self.qualified(suffix)
        })
    }
}

/// Whether `error` is the duplicate-key error of the inbox's primary key.
fn is_duplicate(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|e| e.number() == DUPLICATE_KEY),
        _ => false,
    }
}

/// Classifies an error of a migration statement.
fn fail(error: sqlx::Error) -> Error {
    db_error(None, "inbox migration failed", error)
}

/// Inbox migrations, applied in order (version = position + 1), each a list of statements;
/// never change the effect of one that has shipped, add another. Times are `DATETIME(6)` in
/// UTC, as the outbox's. `consumer` compares byte for byte (`utf8mb4_bin`): two names that
/// differ only in case are two consumers. The key is 1,164 bytes at most, within InnoDB's
/// 3,072 (DYNAMIC rows, the default since MySQL 5.7 and MariaDB 10.2).
const MIGRATIONS: &[&[&str]] = &[&[r"CREATE TABLE IF NOT EXISTS {inbox} (
    consumer     VARCHAR(255) NOT NULL,
    message_id   CHAR(36) NOT NULL,
    processed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, message_id),
    KEY `{table}_processed_at` (processed_at),
    CONSTRAINT `{table}_consumer_not_empty` CHECK (consumer <> '')
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"]];

#[cfg(test)]
mod tests {
    use super::*;

    // That an inbox's names follow the outbox's rules is checked with those rules, in
    // `table.rs`.

    #[test]
    fn migrations_fill_every_placeholder_and_the_lock_name_fits() {
        let inbox = Inbox::new("app", "inbox").unwrap();
        // No placeholder is left, and the table is the inbox's, quoted.
        let sql: Vec<String> = MIGRATIONS
            .iter()
            .flat_map(|steps| steps.iter().map(|step| inbox.render(step)))
            .collect();
        assert!(sql.iter().all(|sql| !sql.contains('{')), "{sql:?}");
        assert!(sql[0].contains("`app`.`inbox`"), "{sql:?}");
        assert!(inbox.lock_name().len() <= 64);
        assert_ne!(
            inbox.lock_name(),
            Inbox::new("app", "inbox2").unwrap().lock_name()
        );
    }
}
