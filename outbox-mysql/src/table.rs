//! The outbox table as a contract: its names, its migrations, and enqueueing into it from
//! the caller's own transaction.

use std::time::{Duration, Instant};

use outbox_core::{Error, NewMessage, Result};
use outbox_sql::columns::{Columns, Inserts};
use outbox_sql::{migrate, names};
use sqlx::{Executor, MySqlConnection, Row};

use crate::error::db_error;

/// Messages per INSERT of [`OutboxTable::enqueue_many`] (8 placeholders each, far below the
/// 65,535 a prepared statement may have).
const ROWS_PER_INSERT: usize = 500;

/// How long a migrator waits for another one before giving up, in seconds.
const MIGRATION_WAIT_SECS: u64 = 60;

/// The suffixes of an outbox's tables: the outbox itself (`""`) and its companions, named
/// `<table><suffix>`. Every table the migrations create is listed here.
pub const TABLE_SUFFIXES: [&str; 8] = [
    "",
    "_dead_letters",
    "_parked_keys",
    "_delivered",
    "_claim_lock",
    "_claim_cursor",
    "_stats",
    "_migrations",
];

/// The outbox table and its companions (`<table>_dead_letters`, `<table>_parked_keys`,
/// `<table>_delivered`, `<table>_claim_lock`, `<table>_claim_cursor`, `<table>_stats`,
/// `<table>_migrations`) in one MySQL or MariaDB database, with the SQL that writes into it. The names are validated, then quoted with
/// backticks and qualified with the database; they are never spliced in unchecked.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    database: String,
    table: String,
    inserts: Inserts,
}

impl OutboxTable {
    /// The outbox table `table` in database `database`. Fails if a name is not a plain
    /// identifier (errors keyed `database` and `table`).
    pub fn new(database: &str, table: &str) -> Result<Self> {
        // MySQL allows 64; the companions add up to 14.
        names::validate("database", database, None)?;
        names::validate("table", table, None)?;
        Ok(OutboxTable {
            database: database.to_string(),
            table: table.to_string(),
            inserts: Inserts::new(format!("`{database}`.`{table}`"), ROWS_PER_INSERT),
        })
    }

    /// The database name.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// The outbox table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// `DROP TABLE IF EXISTS` of the outbox table and every companion
    /// ([`TABLE_SUFFIXES`]): what removes an outbox for good (tests, benchmarks, operators).
    pub fn drop_sql(&self) -> String {
        let tables: Vec<String> = TABLE_SUFFIXES.iter().map(|s| self.qualified(s)).collect();
        format!("DROP TABLE IF EXISTS {}", tables.join(", "))
    }

    /// The quoted, qualified name of the outbox table (`` `db`.`outbox` ``), or of a
    /// companion table when `suffix` is not empty (`"_dead_letters"`, ...).
    pub fn qualified(&self, suffix: &str) -> String {
        format!("`{}`.`{}{suffix}`", self.database, self.table)
    }

    /// Enqueues `message` on `conn`, normally the caller's open transaction (`&mut *tx`), so
    /// the message commits or rolls back with the domain change.
    pub async fn enqueue(&self, conn: &mut MySqlConnection, message: &NewMessage) -> Result<()> {
        self.enqueue_many(conn, std::slice::from_ref(message)).await
    }

    /// Enqueues many messages, in the order given, 500 per statement.
    pub async fn enqueue_many(
        &self,
        conn: &mut MySqlConnection,
        messages: &[NewMessage],
    ) -> Result<()> {
        let rows = Columns::all(messages)?;
        // DATETIME holds no zone: the table's times are UTC.
        outbox_sql::insert_rows!(conn, self.inserts, &rows, |row| row.created_at.naive_utc())
            .await
            .map_err(|e| db_error(None, "enqueue failed", e))
    }

    /// Creates or upgrades the tables. Safe to run repeatedly and from several processes at
    /// once: migrators take turns on a named lock (`GET_LOCK`, one waits up to a minute for
    /// another), versions are recorded in `<table>_migrations` and never run twice. MySQL
    /// commits DDL at once, so a version is not atomic; every step of one can run again.
    pub async fn migrate(&self, conn: &mut MySqlConnection) -> Result<()> {
        let render = |step: &str| self.render(step);
        let qualified = |suffix: &str| self.qualified(suffix);
        let mut versions = Versions::new(conn, qualified, self.lock_name(), &render, None);
        migrate::run(&mut versions, MIGRATIONS, MIGRATIONS.len()).await
    }

    /// The script that [`migrate`](Self::migrate) would run on `conn` now, for a database
    /// administrator to review and apply: the steps after the version the database has
    /// (0 when it has no outbox tables), each followed by the record of its version. MySQL
    /// commits each DDL statement on its own, as `migrate` does. Empty when up to date.
    /// Reads only.
    pub async fn migration_sql(&self, conn: &mut MySqlConnection) -> Result<String> {
        let versions = self.qualified("_migrations");
        let recorded: i64 = conn
            .fetch_one(
                sqlx::query(
                    "SELECT COUNT(*) FROM information_schema.tables \
                     WHERE table_schema = ? AND table_name = ?",
                )
                .bind(&self.database)
                .bind(format!("{}_migrations", self.table)),
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(fail)?;
        let applied: i64 = if recorded == 0 {
            0
        } else {
            conn.fetch_one(
                format!("SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM {versions}")
                    .as_str(),
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(fail)?
        };
        let pending: Vec<String> = migrate::pending(applied, MIGRATIONS, MIGRATIONS.len())
            .map(|(version, steps)| {
                let statements: String = steps
                    .iter()
                    .map(|step| format!("{};\n", self.render(step).trim().trim_end_matches(';')))
                    .collect();
                format!(
                    "-- outbox migration {version} of {}\n{statements}\
                     INSERT INTO {versions} (version, applied_at) VALUES ({version}, UTC_TIMESTAMP(6));\n",
                    self.qualified("")
                )
            })
            .collect();
        if pending.is_empty() {
            return Ok(String::new());
        }
        Ok(format!(
            "CREATE TABLE IF NOT EXISTS {versions} (version INT NOT NULL PRIMARY KEY, \
             applied_at DATETIME(6) NOT NULL) ENGINE=InnoDB;\n{}",
            pending.concat()
        ))
    }

    /// The name of the migration lock: `GET_LOCK` names are server-wide and at most 64
    /// characters, so a hash of the qualified table stands for it.
    fn lock_name(&self) -> String {
        outbox_sql::lock_name(
            "outbox_migrate",
            &format!("{}.{}", self.database, self.table),
        )
    }

    /// Fills a migration template's placeholders with validated, quoted names.
    fn render(&self, template: &str) -> String {
        let companions =
            migrate::OUTBOX_COMPANIONS
                .into_iter()
                .chain(["claim_lock", "claim_cursor", "stats"]);
        migrate::fill_names(template, &self.table, "outbox", companions, |suffix| {
            self.qualified(suffix)
        })
        .replace("{unclaimed}", crate::sql::UNCLAIMED)
    }
}

/// Classifies an error of a migration statement.
fn fail(error: sqlx::Error) -> Error {
    db_error(None, "migration failed", error)
}

/// The versions of an outbox's or an inbox's migrations (`<table>_migrations`), under a
/// named lock (`GET_LOCK`, server-wide): migrators take turns, one waits up to a minute for
/// another. MySQL commits each DDL statement at once, so a version is not atomic; every
/// step of one can run again.
pub(crate) struct Versions<'a> {
    conn: &'a mut MySqlConnection,
    /// `outbox` or `inbox`, for the log.
    what: &'static str,
    /// The quoted, qualified table, for the log and errors.
    qualified: String,
    /// The quoted, qualified `<table>_migrations`.
    versions: String,
    /// The name of the `GET_LOCK` lock.
    lock: String,
    render: &'a (dyn Fn(&str) -> String + Sync),
    /// The inbox being migrated, which refuses a table that is not one.
    inbox: Option<&'a crate::Inbox>,
}

impl<'a> Versions<'a> {
    /// The versions of the inbox `inbox`, or of the outbox when `None`, whose table (and
    /// its companions, by suffix) `qualified` names, under the lock named `lock`; `render`
    /// fills a step's placeholders.
    pub(crate) fn new(
        conn: &'a mut MySqlConnection,
        qualified: impl Fn(&str) -> String,
        lock: String,
        render: &'a (dyn Fn(&str) -> String + Sync),
        inbox: Option<&'a crate::Inbox>,
    ) -> Self {
        Versions {
            conn,
            what: if inbox.is_some() { "inbox" } else { "outbox" },
            qualified: qualified(""),
            versions: qualified("_migrations"),
            lock,
            render,
            inbox,
        }
    }

    /// Classifies an error of a migration statement.
    fn fail(&self) -> impl Fn(sqlx::Error) -> Error + use<> {
        let context = if self.inbox.is_some() {
            "inbox migration failed"
        } else {
            "migration failed"
        };
        move |error| db_error(None, context, error)
    }
}

impl migrate::Dialect for Versions<'_> {
    type Step = &'static [&'static str];

    async fn lock(&mut self) -> Result<()> {
        let started = Instant::now();
        let got: Option<i64> = self
            .conn
            .fetch_one(
                sqlx::query("SELECT GET_LOCK(?, ?)")
                    .bind(&self.lock)
                    .bind(MIGRATION_WAIT_SECS as i64),
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(self.fail())?;
        if got == Some(1) {
            return Ok(());
        }
        let name = &self.lock;
        Err(Error::unavailable(if self.inbox.is_some() {
            format!(
                "mysql: migration of the inbox {} waited {MIGRATION_WAIT_SECS} s for another \
                 migrator (lock `{name}`)",
                self.qualified
            )
        } else {
            format!(
                "mysql: migration of {} waited {:?} for another migrator (lock `{name}`)",
                self.qualified,
                started
                    .elapsed()
                    .min(Duration::from_secs(MIGRATION_WAIT_SECS))
            )
        }))
    }

    async fn check(&mut self) -> Result<()> {
        match self.inbox {
            Some(inbox) => inbox.refuse_other_table(self.conn).await,
            None => Ok(()),
        }
    }

    async fn applied(&mut self) -> Result<i64> {
        let versions = &self.versions;
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {versions} (version INT NOT NULL PRIMARY KEY, \
             applied_at DATETIME(6) NOT NULL) ENGINE=InnoDB"
        );
        self.conn
            .execute(create.as_str())
            .await
            .map_err(self.fail())?;
        self.conn
            .fetch_one(
                format!("SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM {versions}")
                    .as_str(),
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(self.fail())
    }

    async fn apply(&mut self, version: i64, steps: &&'static [&'static str]) -> Result<()> {
        tracing::info!(table = %self.qualified, version, "applying {} migration", self.what);
        for step in *steps {
            match self.conn.execute((self.render)(step).as_str()).await {
                Ok(_) => {}
                // DDL is not transactional here: an `ADD COLUMN` that ran before a crash
                // (its version unrecorded) is done, not an error.
                Err(e) if duplicate_column(&e) => {}
                Err(e) => return Err(self.fail()(e)),
            }
        }
        let record = format!(
            "INSERT INTO {} (version, applied_at) VALUES (?, UTC_TIMESTAMP(6))",
            self.versions
        );
        self.conn
            .execute(sqlx::query(&record).bind(version))
            .await
            .map_err(self.fail())?;
        Ok(())
    }

    async fn unlock(&mut self) -> Result<()> {
        let released = self
            .conn
            .execute(sqlx::query("SELECT RELEASE_LOCK(?)").bind(&self.lock))
            .await;
        match released {
            Ok(_) => Ok(()),
            // The outbox's migration only warns: the lock goes with the session.
            Err(e) if self.inbox.is_none() => {
                tracing::warn!(error = %e, "mysql: releasing the migration lock failed");
                Ok(())
            }
            Err(e) => Err(self.fail()(e)),
        }
    }
}

/// `ADD COLUMN` of a column that is there (SQLSTATE 42S21, error 1060).
fn duplicate_column(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("42S21"))
}

/// Schema migrations, applied in order (version = position + 1), each a list of
/// statements; never change the effect of one that has shipped, add another.
///
/// Times are `DATETIME(6)` in UTC (microseconds, no time zone conversion on read or write).
/// `partition_key` is `VARBINARY`: keys compare byte for byte (no collation folds case or
/// trailing spaces), which per-key order needs. Text columns use `utf8mb4_bin` for the same
/// reason. The defaults are expressions (MySQL 8.0.13+, MariaDB 10.2+), so a plain INSERT
/// gets an id, `{}` headers and the current UTC time.
const MIGRATIONS: &[&[&str]] = &[
    &[
        r"CREATE TABLE IF NOT EXISTS {outbox} (
    seq           BIGINT NOT NULL AUTO_INCREMENT,
    id            CHAR(36) NOT NULL DEFAULT (uuid()),
    topic         VARCHAR(255) NOT NULL,
    partition_key VARBINARY(255) NULL,
    payload       LONGBLOB NOT NULL,
    headers       JSON NOT NULL DEFAULT ('{}'),
    traceparent   VARCHAR(255) NULL,
    tracestate    TEXT NULL,
    created_at    DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    attempts      INT NOT NULL DEFAULT 0,
    available_at  DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    claim_token   CHAR(36) NULL,
    claimed_by    VARCHAR(255) NULL,
    last_error    TEXT NULL,
    PRIMARY KEY (seq),
    UNIQUE KEY `{table}_id` (id),
    KEY `{table}_key_seq` (partition_key, seq),
    CONSTRAINT `{table}_topic_not_empty` CHECK (topic <> ''),
    CONSTRAINT `{table}_id_is_uuid`
        CHECK (id REGEXP '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$')
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        r"CREATE TABLE IF NOT EXISTS {dead_letters} (
    seq              BIGINT NOT NULL,
    id               CHAR(36) NOT NULL,
    topic            VARCHAR(255) NOT NULL,
    partition_key    VARBINARY(255) NULL,
    payload          LONGBLOB NOT NULL,
    headers          JSON NOT NULL,
    traceparent      VARCHAR(255) NULL,
    tracestate       TEXT NULL,
    created_at       DATETIME(6) NOT NULL,
    attempts         INT NOT NULL,
    last_error       TEXT NOT NULL,
    dead_lettered_at DATETIME(6) NOT NULL,
    PRIMARY KEY (seq),
    UNIQUE KEY `{table}_dead_letters_id` (id),
    KEY `{table}_dead_letters_key` (partition_key, seq)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        r"CREATE TABLE IF NOT EXISTS {parked_keys} (
    partition_key  VARBINARY(255) NOT NULL PRIMARY KEY,
    dead_letter_id CHAR(36) NOT NULL,
    parked_at      DATETIME(6) NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        r"CREATE TABLE IF NOT EXISTS {delivered} (
    seq           BIGINT NOT NULL PRIMARY KEY,
    id            CHAR(36) NOT NULL,
    topic         VARCHAR(255) NOT NULL,
    partition_key VARBINARY(255) NULL,
    payload       LONGBLOB NOT NULL,
    headers       JSON NOT NULL,
    traceparent   VARCHAR(255) NULL,
    tracestate    TEXT NULL,
    created_at    DATETIME(6) NOT NULL,
    attempts      INT NOT NULL,
    receipt       TEXT NOT NULL,
    delivered_at  DATETIME(6) NOT NULL,
    KEY `{table}_delivered_at` (delivered_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        // One row: ordered claims lock it exclusively, writes that hold a key back share it.
        r"CREATE TABLE IF NOT EXISTS {claim_lock} (id TINYINT NOT NULL PRIMARY KEY) ENGINE=InnoDB",
        r"INSERT IGNORE INTO {claim_lock} (id) VALUES (1)",
    ],
    &[
        // The queue figures that relays share (`Storage::shared_stats`): the first relay past
        // `refresh_after` counts them and stores them here, the others read them.
        r"CREATE TABLE IF NOT EXISTS {stats} (
    id             TINYINT NOT NULL PRIMARY KEY,
    refresh_after  DATETIME(6) NOT NULL DEFAULT '1970-01-01 00:00:00',
    measured_at    DATETIME(6) NULL,
    pending        BIGINT NOT NULL DEFAULT 0,
    oldest_pending DATETIME(6) NULL,
    in_flight      BIGINT NOT NULL DEFAULT 0,
    dead_lettered  BIGINT NOT NULL DEFAULT 0,
    parked_keys    BIGINT NOT NULL DEFAULT 0
) ENGINE=InnoDB",
        r"INSERT IGNORE INTO {stats} (id) VALUES (1)",
    ],
    &[
        // A row no claim holds carries a token-sized placeholder (`sql::UNCLAIMED`), so the
        // claim overwrites it in place instead of growing the row and splitting its page.
        // Only the default changes (no table rebuild); older rows keep NULL, which means
        // the same.
        r"ALTER TABLE {outbox}
    ALTER COLUMN claim_token SET DEFAULT '{unclaimed}'",
        // One row: the key the last ordered claim ended on, where the next one (of any
        // relay) starts its sweep; read and written under the claim lock.
        r"CREATE TABLE IF NOT EXISTS {claim_cursor} (
    id            TINYINT NOT NULL PRIMARY KEY,
    partition_key VARBINARY(255) NOT NULL
) ENGINE=InnoDB",
        r"INSERT IGNORE INTO {claim_cursor} (id, partition_key) VALUES (1, '')",
    ],
    &[
        // The shared figures gain the pending messages waiting to retry
        // (`QueueStats::retrying`). Run again after a crash before the version was recorded,
        // it fails with a duplicate column, which `migrate` takes as done.
        r"ALTER TABLE {stats} ADD COLUMN retrying BIGINT NOT NULL DEFAULT 0",
    ],
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_not_spliced() {
        let table = OutboxTable::new("app", "outbox_2").unwrap();
        assert_eq!(
            table.qualified("_dead_letters"),
            "`app`.`outbox_2_dead_letters`"
        );
        assert!(crate::Inbox::new("app", "inbox").is_ok());
        for bad in [
            "",
            "Outbox",
            "Bad",
            "a-b",
            "bad name",
            "x`; DROP TABLE y; --",
            "1abc",
            &"a".repeat(41),
        ] {
            let err = OutboxTable::new("app", bad).unwrap_err();
            assert!(err.message().starts_with("table `"), "{err}");
            let err = OutboxTable::new(bad, "outbox").unwrap_err();
            assert!(err.message().starts_with("database `"), "{err}");
            // An inbox's names follow the same rules: the same Config error, naming the name.
            for (database, table, key) in [("app", bad, "table"), (bad, "inbox", "database")] {
                let err = crate::Inbox::new(database, table).unwrap_err();
                assert_eq!(err.kind(), outbox_core::ErrorKind::Config, "{err}");
                let expected = format!("{key} `{bad}` is not allowed");
                assert!(err.to_string().contains(&expected), "{err}");
            }
        }
    }

    #[test]
    fn migrations_leave_no_placeholder_and_lock_names_fit() {
        let table = OutboxTable::new("shop", "events").unwrap();
        for steps in MIGRATIONS {
            for step in *steps {
                let sql = table.render(step);
                assert_eq!(migrate::unfilled(&sql), None, "{sql}");
            }
        }
        let long = OutboxTable::new(&"d".repeat(40), &"t".repeat(40)).unwrap();
        assert!(long.lock_name().len() <= 64);
        assert_ne!(long.lock_name(), table.lock_name());
    }
}
