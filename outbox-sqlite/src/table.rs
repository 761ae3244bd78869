//! The outbox table as a contract: its names, its migrations, and enqueueing into it from
//! the caller's own transaction.

use std::time::{Duration, Instant};

use outbox_core::{Error, NewMessage, Result};
use outbox_sql::columns::{Columns, Inserts};
use outbox_sql::{migrate, names};
use sqlx::{Connection, Executor, Row, SqliteConnection};

use crate::error::{Cause, cause, db_error};

/// Messages per INSERT of [`OutboxTable::enqueue_many`]: 8 values each stays below the 999
/// variables older SQLite builds allow per statement.
const ROWS_PER_INSERT: usize = 100;
const _: () = assert!(8 * ROWS_PER_INSERT < 999);

/// How long a migrator waits for another one (holding the write lock) before giving up.
const MIGRATION_WAIT: Duration = Duration::from_secs(60);

/// The current time in milliseconds since the Unix epoch, on the clock of whoever runs the
/// statement. `julianday('now')` rather than `unixepoch('subsec')`, so the column defaults
/// work for writers on any SQLite since 3.8 (`unixepoch` came in 3.42).
pub(crate) const NOW_MS: &str =
    "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

/// The current time in microseconds since the Unix epoch (to the millisecond: SQLite's
/// clock has no finer grain), the default of `created_at`.
const NOW_US: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER) * 1000";

/// A random UUID (version 4, lower-case, hyphenated): the default of `id` for writers that
/// do not give one.
const NEW_UUID: &str = "lower(hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' || \
     substr(hex(randomblob(2)), 2) || '-' || substr('89ab', 1 + (abs(random()) % 4), 1) || \
     substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6)))";

/// The outbox table and its companions (`<table>_dead_letters`, `<table>_parked_keys`,
/// `<table>_delivered`, `<table>_migrations`) in one SQLite database, with the SQL that
/// writes into it. The name is validated, then quoted; it is never spliced in unchecked.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    table: String,
    inserts: Inserts,
}

impl OutboxTable {
    /// The outbox table `table`. Fails if the name is not a plain identifier.
    pub fn new(table: &str) -> Result<Self> {
        // SQLite has no limit of its own; the shared one keeps names readable.
        names::validate("table", table, Some("sqlite_"))?;
        Ok(OutboxTable {
            table: table.to_string(),
            inserts: Inserts::new(format!(r#""{table}""#), ROWS_PER_INSERT),
        })
    }

    /// The outbox table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The quoted name of the outbox table, or of a companion table when `suffix` is not
    /// empty (`"_dead_letters"`, ...).
    pub fn quoted(&self, suffix: &str) -> String {
        format!(r#""{}{suffix}""#, self.table)
    }

    /// Enqueues `message` on `conn`, normally the caller's open transaction (`&mut *tx`), so
    /// the message commits or rolls back with the domain change. Its position in its key's
    /// order is the commit order: SQLite lets one transaction write at a time, and this one
    /// holds the write lock from its first write to its end.
    pub async fn enqueue(&self, conn: &mut SqliteConnection, message: &NewMessage) -> Result<()> {
        self.enqueue_many(conn, std::slice::from_ref(message)).await
    }

    /// Enqueues many messages, in the order given, in as few statements as SQLite allows
    /// (100 messages each).
    pub async fn enqueue_many(
        &self,
        conn: &mut SqliteConnection,
        messages: &[NewMessage],
    ) -> Result<()> {
        let rows = Columns::all(messages)?;
        let inserted = outbox_sql::insert_rows!(conn, self.inserts, &rows, |row| {
            row.created_at.timestamp_micros()
        });
        inserted
            .await
            .map_err(|e| db_error(None, "enqueue failed", e))
    }

    /// Creates or upgrades the tables. Safe to run repeatedly and from several processes at
    /// once: a migration runs in one `BEGIN IMMEDIATE` transaction, so migrators take turns
    /// (one waits up to a minute for another) and none applies a version twice.
    pub async fn migrate(&self, conn: &mut SqliteConnection) -> Result<()> {
        self.migrate_to(conn, MIGRATIONS.len()).await
    }

    /// Applies the migrations up to version `target` only, as an older release would have:
    /// for tests of upgrades. Not part of the stable API.
    #[doc(hidden)]
    pub async fn migrate_to(&self, conn: &mut SqliteConnection, target: usize) -> Result<()> {
        let started = Instant::now();
        let mut logged = false;
        let mut tx = loop {
            match conn.begin_with("BEGIN IMMEDIATE").await {
                Ok(tx) => break tx,
                Err(e) if cause(&e) == Cause::Busy && started.elapsed() < MIGRATION_WAIT => {
                    if !logged {
                        tracing::info!(table = %self.table, "another process holds the database's write lock; waiting to migrate");
                        logged = true;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(fail(e)),
            }
        };
        let render = |step: &str| self.render(step);
        let mut versions = Versions::new(&mut tx, "outbox", &self.table, &render);
        migrate::run(&mut versions, MIGRATIONS, target).await?;
        tx.commit().await.map_err(fail)
    }

    /// The script that [`migrate`](Self::migrate) would run on `conn` now: the steps after
    /// the version the database has (0 when it has no outbox tables), each followed by the
    /// record of its version, in one transaction. Empty when up to date. Reads only.
    pub async fn migration_sql(&self, conn: &mut SqliteConnection) -> Result<String> {
        let versions = self.quoted("_migrations");
        let exists: i64 = conn
            .fetch_one(
                sqlx::query("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?")
                    .bind(format!("{}_migrations", self.table)),
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(fail)?;
        let applied: i64 = if exists == 0 {
            0
        } else {
            conn.fetch_one(format!("SELECT coalesce(max(version), 0) FROM {versions}").as_str())
                .await
                .and_then(|row| row.try_get(0))
                .map_err(fail)?
        };
        let pending: Vec<String> = migrate::pending(applied, MIGRATIONS, MIGRATIONS.len())
            .map(|(version, step)| {
                format!(
                    "-- outbox migration {version} of table {table}\n{}\n\
                     INSERT INTO {versions} (version, applied_at) VALUES ({version}, {NOW_MS});\n",
                    self.render(step).trim(),
                    table = self.table
                )
            })
            .collect();
        if pending.is_empty() {
            return Ok(String::new());
        }
        Ok(format!(
            "BEGIN IMMEDIATE;\nCREATE TABLE IF NOT EXISTS {versions} (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL);\n{}COMMIT;\n",
            pending.join("")
        ))
    }

    /// Fills a migration template's placeholders with validated, quoted names.
    fn render(&self, template: &str) -> String {
        let companions = migrate::OUTBOX_COMPANIONS;
        migrate::fill_names(template, &self.table, "outbox", companions, |suffix| {
            self.quoted(suffix)
        })
        .replace("{uuid_glob}", &uuid_glob())
        .replace("{new_uuid}", NEW_UUID)
        .replace("{now_ms}", NOW_MS)
        .replace("{now_us}", NOW_US)
    }
}

/// Classifies an error of a migration statement.
fn fail(error: sqlx::Error) -> Error {
    db_error(None, "migration failed", error)
}

/// The versions of an outbox's or an inbox's migrations (`<table>_migrations`), on the
/// connection of a `BEGIN IMMEDIATE` transaction: the transaction is the migration lock
/// (one writer at a time), and its commit, by the caller, makes the steps visible at once.
pub(crate) struct Versions<'a> {
    conn: &'a mut SqliteConnection,
    /// `outbox` or `inbox`, for the log.
    what: &'static str,
    table: &'a str,
    versions: String,
    render: &'a (dyn Fn(&str) -> String + Sync),
}

impl<'a> Versions<'a> {
    /// The versions of `table`, whose steps `render` fills in.
    pub(crate) fn new(
        conn: &'a mut SqliteConnection,
        what: &'static str,
        table: &'a str,
        render: &'a (dyn Fn(&str) -> String + Sync),
    ) -> Self {
        Versions {
            conn,
            what,
            table,
            versions: format!(r#""{table}_migrations""#),
            render,
        }
    }

    /// Classifies an error of a migration statement.
    fn fail(&self) -> impl Fn(sqlx::Error) -> Error + use<> {
        let context = if self.what == "outbox" {
            "migration failed"
        } else {
            "inbox migration failed"
        };
        move |error| db_error(None, context, error)
    }
}

impl migrate::Dialect for Versions<'_> {
    type Step = &'static str;

    async fn applied(&mut self) -> Result<i64> {
        let versions = &self.versions;
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {versions} (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL)"
        );
        self.conn
            .execute(create.as_str())
            .await
            .map_err(self.fail())?;
        self.conn
            .fetch_one(format!("SELECT coalesce(max(version), 0) FROM {versions}").as_str())
            .await
            .and_then(|row| row.try_get(0))
            .map_err(self.fail())
    }

    async fn apply(&mut self, version: i64, step: &&'static str) -> Result<()> {
        tracing::info!(table = %self.table, version, "applying {} migration", self.what);
        let record = format!(
            "INSERT INTO {} (version, applied_at) VALUES (?, {NOW_MS})",
            self.versions
        );
        self.conn
            .execute((self.render)(step).as_str())
            .await
            .map_err(self.fail())?;
        self.conn
            .execute(sqlx::query(&record).bind(version))
            .await
            .map_err(self.fail())?;
        Ok(())
    }
}

/// A GLOB pattern that matches a lower-case hyphenated UUID and nothing else.
fn uuid_glob() -> String {
    [8, 4, 4, 4, 12]
        .iter()
        .map(|n| "[0-9a-f]".repeat(*n))
        .collect::<Vec<_>>()
        .join("-")
}

/// Schema migrations, applied in order (version = position + 1); never change the effect of
/// one that has shipped, add another.
///
/// Times the relay keeps (`available_at`, `dead_lettered_at`, `parked_at`, `delivered_at`)
/// are integer milliseconds since the Unix epoch; `created_at` is microseconds, so a
/// message's creation time survives to the microsecond. Types are checked with `CHECK`
/// rather than `STRICT`, which SQLite before 3.37 cannot read: a writer in any language on
/// any SQLite can use the table, and a row the relay could not read is refused at INSERT.
const MIGRATIONS: &[&str] = &[r#"
CREATE TABLE {outbox} (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    id            TEXT NOT NULL DEFAULT ({new_uuid})
                  CHECK (typeof(id) = 'text' AND id GLOB '{uuid_glob}'),
    topic         TEXT NOT NULL CHECK (typeof(topic) = 'text' AND topic <> ''),
    partition_key TEXT CHECK (partition_key IS NULL OR typeof(partition_key) = 'text'),
    payload       BLOB NOT NULL,
    headers       TEXT NOT NULL DEFAULT '{}' CHECK (typeof(headers) = 'text'),
    traceparent   TEXT CHECK (traceparent IS NULL OR typeof(traceparent) = 'text'),
    tracestate    TEXT CHECK (tracestate IS NULL OR typeof(tracestate) = 'text'),
    created_at    INTEGER NOT NULL DEFAULT ({now_us}) CHECK (typeof(created_at) = 'integer'),
    attempts      INTEGER NOT NULL DEFAULT 0,
    available_at  INTEGER NOT NULL DEFAULT ({now_ms}),
    claim_token   TEXT,
    claimed_by    TEXT,
    last_error    TEXT
);
CREATE UNIQUE INDEX "{table}_id" ON {outbox} (id);
-- The claim sweeps the keys through this index (one descent per key) and finds the rows
-- without a key at its start (NULL sorts first).
CREATE INDEX "{table}_key_seq" ON {outbox} (partition_key, seq);

CREATE TABLE {dead_letters} (
    seq              INTEGER PRIMARY KEY,
    id               TEXT NOT NULL UNIQUE,
    topic            TEXT NOT NULL,
    partition_key    TEXT,
    payload          BLOB NOT NULL,
    headers          TEXT NOT NULL,
    traceparent      TEXT,
    tracestate       TEXT,
    created_at       INTEGER NOT NULL,
    attempts         INTEGER NOT NULL,
    last_error       TEXT NOT NULL,
    dead_lettered_at INTEGER NOT NULL
);
CREATE INDEX "{table}_dead_letters_key" ON {dead_letters} (partition_key, seq);

CREATE TABLE {parked_keys} (
    partition_key  TEXT PRIMARY KEY,
    dead_letter_id TEXT NOT NULL,
    parked_at      INTEGER NOT NULL
);

CREATE TABLE {delivered} (
    seq           INTEGER PRIMARY KEY,
    id            TEXT NOT NULL,
    topic         TEXT NOT NULL,
    partition_key TEXT,
    payload       BLOB NOT NULL,
    headers       TEXT NOT NULL,
    traceparent   TEXT,
    tracestate    TEXT,
    created_at    INTEGER NOT NULL,
    attempts      INTEGER NOT NULL,
    receipt       TEXT NOT NULL,
    delivered_at  INTEGER NOT NULL
);
CREATE INDEX "{table}_delivered_at" ON {delivered} (delivered_at);
"#];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_not_spliced() {
        assert!(OutboxTable::new("outbox_2").is_ok());
        for bad in [
            "",
            "Outbox",
            "a-b",
            "x\"; DROP TABLE y; --",
            "sqlite_master",
            "1abc",
            &"a".repeat(41),
        ] {
            let err = OutboxTable::new(bad).unwrap_err();
            assert!(err.to_string().contains("table `"), "{err}");
        }
    }

    #[test]
    fn migrations_leave_no_placeholder() {
        let table = OutboxTable::new("events").unwrap();
        for step in MIGRATIONS {
            let sql = table.render(step);
            assert_eq!(migrate::unfilled(&sql), None, "{sql}");
            assert!(sql.contains(r#"CREATE UNIQUE INDEX "events_id" ON "events" (id)"#));
        }
        assert_eq!(uuid_glob().len(), 8 * 36 - 4 * 7);
    }

    #[test]
    fn inserts_have_eight_values_a_row() {
        let table = OutboxTable::new("outbox").unwrap();
        assert_eq!(table.inserts.sql(1).matches('?').count(), 8);
        assert_eq!(
            table.inserts.sql(ROWS_PER_INSERT).matches('?').count(),
            8 * ROWS_PER_INSERT
        );
    }

    /// Compiles only if an enqueue and a migration can run in a spawned task.
    #[allow(dead_code)]
    fn futures_are_spawnable(table: OutboxTable, mut conn: SqliteConnection, m: NewMessage) {
        let t = table.clone();
        drop(tokio::spawn(async move {
            t.enqueue(&mut conn, &m).await?;
            t.migrate(&mut conn).await
        }));
    }
}
