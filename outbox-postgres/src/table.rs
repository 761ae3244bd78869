//! The outbox table as a contract: its names, its migrations, and enqueueing into it from
//! the caller's own transaction.

use std::time::Duration;

use outbox_core::{Error, NewMessage, Result};
use outbox_sql::columns::{INSERT_COLUMNS, check_topic, trace_columns};
use outbox_sql::{fnv1a, migrate, names};
use sqlx::{Connection, Executor, PgConnection, Row};

use crate::StorageMode;
use crate::error::db_error;

/// PostgreSQL's longest identifier (NAMEDATALEN - 1); `pg_notify` refuses longer channels.
const MAX_IDENTIFIER: usize = 63;

/// How often a migrator retries the migration lock while another process holds it.
const MIGRATION_LOCK_POLL: Duration = Duration::from_millis(100);

/// The outbox table and its companions (`<table>_dead_letters`, `<table>_parked_keys`,
/// `<table>_delivered`, `<table>_wakeup`, `<table>_migrations`) in one schema, with the SQL
/// that uses them. Names are validated, then quoted; they are never spliced in unchecked.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    schema: String,
    table: String,
    insert_one: String,
    insert_many: String,
}

impl OutboxTable {
    /// The outbox table `schema.table`. Fails if either name is not a plain identifier.
    pub fn new(schema: &str, table: &str) -> Result<Self> {
        names::validate("schema", schema, Some("pg_"))?;
        names::validate("table", table, Some("pg_"))?;
        let outbox = format!(r#""{schema}"."{table}""#);
        let columns = INSERT_COLUMNS;
        Ok(OutboxTable {
            schema: schema.to_string(),
            table: table.to_string(),
            insert_one: format!(
                "INSERT INTO {outbox} ({columns}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
            ),
            insert_many: format!(
                "INSERT INTO {outbox} ({columns}) SELECT * FROM unnest($1::uuid[], $2::text[], \
                 $3::text[], $4::bytea[], $5::jsonb[], $6::text[], $7::text[], $8::timestamptz[])"
            ),
        })
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The outbox table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The quoted, schema-qualified name of the outbox table, or of a companion table when
    /// `suffix` is not empty (`"_dead_letters"`, ...).
    pub fn qualified(&self, suffix: &str) -> String {
        format!(r#""{}"."{}{suffix}""#, self.schema, self.table)
    }

    /// The LISTEN/NOTIFY channel of the wake-up: `schema.table`, or, when that is longer
    /// than PostgreSQL's 63-byte limit, `outbox_` and 16 hex digits of a hash of it.
    pub fn channel(&self) -> String {
        let name = format!("{}.{}", self.schema, self.table);
        if name.len() <= MAX_IDENTIFIER {
            // Existing deployments keep their channel.
            name
        } else {
            // The hash must never change: relays and the trigger of an already migrated
            // table would part ways.
            format!("outbox_{:016x}", fnv1a(&format!("outbox:{name}")))
        }
    }

    /// The advisory lock key that serialises claims against settlements of this table (as
    /// seen in `pg_locks`, `objid` and `classid` of an advisory lock).
    pub fn lock_key(&self) -> i64 {
        fnv1a(&format!("outbox:{}.{}", self.schema, self.table)) as i64
    }

    /// The advisory lock key that serialises migrators of this table. Not [`Self::lock_key`]:
    /// it is held across `CREATE INDEX CONCURRENTLY`, which must not stall claims.
    fn migration_key(&self) -> i64 {
        fnv1a(&format!("outbox-migrate:{}.{}", self.schema, self.table)) as i64
    }

    /// Enqueues `message` on `conn`, normally the caller's open transaction
    /// (`&mut *tx`), so the message commits or rolls back with the domain change.
    pub async fn enqueue(&self, conn: &mut PgConnection, message: &NewMessage) -> Result<()> {
        check_topic(message)?;
        let (traceparent, tracestate) = trace_columns(message);
        sqlx::query(&self.insert_one)
            .bind(message.id)
            .bind(&message.topic)
            .bind(&message.key)
            .bind(&message.payload)
            .bind(sqlx::types::Json(&message.headers))
            .bind(traceparent)
            .bind(tracestate)
            .bind(message.created_at)
            .execute(conn)
            .await
            .map_err(|e| db_error("enqueue failed", e))?;
        Ok(())
    }

    /// Enqueues many messages in one statement, in the order given.
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        messages: &[NewMessage],
    ) -> Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let n = messages.len();
        let (mut ids, mut topics, mut keys, mut payloads) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut headers, mut parents, mut states, mut created) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for m in messages {
            check_topic(m)?;
            let (traceparent, tracestate) = trace_columns(m);
            ids.push(m.id);
            topics.push(m.topic.as_str());
            keys.push(m.key.as_deref());
            payloads.push(m.payload.as_slice());
            headers.push(sqlx::types::Json(&m.headers));
            parents.push(traceparent);
            states.push(tracestate);
            created.push(m.created_at);
        }
        sqlx::query(&self.insert_many)
            .bind(ids)
            .bind(topics)
            .bind(keys)
            .bind(payloads)
            .bind(headers)
            .bind(parents)
            .bind(states)
            .bind(created)
            .execute(conn)
            .await
            .map_err(|e| db_error("enqueue failed", e))?;
        Ok(())
    }

    /// Creates or upgrades the tables. Safe to run concurrently and repeatedly. An upgrade
    /// that adds an index to an existing outbox table builds it with `CREATE INDEX
    /// CONCURRENTLY`, so writers are not blocked; that step runs outside a transaction.
    pub async fn migrate(&self, conn: &mut PgConnection) -> Result<()> {
        self.migrate_to(conn, MIGRATIONS.len()).await
    }

    /// Creates or upgrades the tables for log mode (`[storage] mode = "log"`), with `shards`
    /// shards if the table is new (the count of an existing table never changes). Refuses a
    /// table migrated for lease mode. Safe to run concurrently and repeatedly.
    pub async fn migrate_log(&self, conn: &mut PgConnection, shards: u32) -> Result<()> {
        self.create_schema(conn).await?;
        self.lock_migrations(conn).await?;
        let result = async {
            self.refuse_other_mode(conn, StorageMode::Log).await?;
            let steps: Vec<(i32, String)> = (LOG_FIRST_VERSION..)
                .zip(LOG_MIGRATIONS)
                .map(|(version, template)| {
                    let sql = self
                        .render(template)
                        .replace("{shard_count}", &shards.to_string());
                    (version, sql)
                })
                .collect();
            let applied = applied_version(conn, &self.qualified("_migrations"))
                .await
                .map_err(fail)?;
            let todo: Vec<(i32, String)> =
                steps.into_iter().filter(|(v, _)| *v > applied).collect();
            self.run_in_transaction(conn, &todo).await?;
            self.rebase_moved_log(conn).await
        }
        .await;
        self.unlock_migrations(conn, result).await?;
        Ok(())
    }

    /// The script that [`migrate`](Self::migrate) (lease mode) or
    /// [`migrate_log`](Self::migrate_log) would run on `conn` now, for a database
    /// administrator to review and apply: the schema, then the steps after the version the
    /// database has, each followed by the record of its version. Steps run in transactions,
    /// but an index added to an outbox table that already exists is built `CONCURRENTLY`
    /// between them (so writers are not blocked), as `migrate` does. Empty when up to date;
    /// a table migrated for the other mode is refused. Reads only.
    pub async fn migration_sql(
        &self,
        conn: &mut PgConnection,
        mode: StorageMode,
        shards: u32,
    ) -> Result<String> {
        self.refuse_other_mode(conn, mode).await?;
        let versions = self.qualified("_migrations");
        let recorded: bool = conn
            .fetch_one(sqlx::query("SELECT to_regclass($1) IS NOT NULL").bind(&versions))
            .await
            .and_then(|row| row.try_get(0))
            .map_err(fail)?;
        let applied: i32 = if recorded {
            conn.fetch_one(format!("SELECT coalesce(max(version), 0) FROM {versions}").as_str())
                .await
                .and_then(|row| row.try_get(0))
                .map_err(fail)?
        } else {
            0
        };
        // (version, SQL, whether it must run outside a transaction)
        let steps: Vec<(i32, String, bool)> = match mode {
            StorageMode::Lease => (1..)
                .zip(MIGRATIONS)
                .filter(|(version, _)| *version > applied)
                .map(|(version, step)| match step {
                    Step::Index { name, definition } if applied >= 1 => {
                        let sql = format!(
                            "CREATE INDEX CONCURRENTLY IF NOT EXISTS {} ON {} {definition}",
                            self.render(name),
                            self.qualified("")
                        );
                        (version, sql, true)
                    }
                    _ => (version, self.step_sql(step), false),
                })
                .collect(),
            StorageMode::Log => (LOG_FIRST_VERSION..)
                .zip(LOG_MIGRATIONS)
                .filter(|(version, _)| *version > applied)
                .map(|(version, template)| {
                    let sql = self
                        .render(template)
                        .replace("{shard_count}", &shards.to_string());
                    (version, sql, false)
                })
                .collect(),
        };
        if steps.is_empty() {
            return Ok(String::new());
        }
        let mut script = format!(
            "CREATE SCHEMA IF NOT EXISTS \"{}\";\nCREATE TABLE IF NOT EXISTS {versions} (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());\n",
            self.schema
        );
        let mut open = false;
        for (version, sql, concurrently) in steps {
            if concurrently && open {
                script.push_str("COMMIT;\n");
                open = false;
            }
            if !concurrently && !open {
                script.push_str("BEGIN;\n");
                open = true;
            }
            script.push_str(&format!(
                "-- outbox migration {version} of {}\n{};\nINSERT INTO {versions} (version) VALUES ({version});\n",
                self.qualified(""),
                sql.trim().trim_end_matches(';')
            ));
        }
        if open {
            script.push_str("COMMIT;\n");
        }
        Ok(script)
    }

    /// Log mode: a shard whose stored cursor, or the newest row of which, has a transaction
    /// id at or past this cluster's next one (`$1`-less; one row: shard, that id, the next
    /// id). That cannot happen in the cluster that wrote them: the table was moved from
    /// another (`pg_dump` and restore, logical replication), whose ids ran ahead of this
    /// one's. Left so, the cursors would pass every row written now and the cleanup delete
    /// it; rows from before wait until this cluster's ids catch up, then come out after
    /// newer ones.
    pub(crate) fn moved_log_sql(&self) -> String {
        format!(
            "WITH next AS (SELECT pg_snapshot_xmax(pg_current_snapshot()) AS x)
             SELECT s.shard, greatest(s.cursor_xid, m.xid)::text, next.x::text
             FROM next, {shards} s
             LEFT JOIN LATERAL (SELECT o.xid FROM {outbox} o WHERE o.shard = s.shard
                                ORDER BY o.xid DESC, o.seq DESC LIMIT 1) m ON true
             WHERE s.cursor_xid >= next.x OR m.xid >= next.x
             ORDER BY s.shard LIMIT 1",
            shards = self.qualified("_shards"),
            outbox = self.qualified(""),
        )
    }

    /// Log mode, after a move from another cluster (see [`moved_log_sql`](Self::moved_log_sql)):
    /// rebases the log onto this cluster's transaction ids, in one transaction. Every shard
    /// loses its owner and gets a new epoch (a relay still writing is fenced off); rows
    /// behind the stored cursors (delivered) are deleted; every other row, held row and dead
    /// letter takes this transaction's id, so they keep their order among themselves by
    /// `seq` (the order their INSERTs ran; for rows of overlapping transactions that may
    /// differ from the order by transaction id they had); the cursors start just before
    /// them. Returns whether it had to. Run by `migrate`, which holds the migration lock.
    async fn rebase_moved_log(&self, conn: &mut PgConnection) -> Result<bool> {
        let moved = conn
            .fetch_optional(self.moved_log_sql().as_str())
            .await
            .map_err(fail)?;
        let Some(row) = moved else {
            return Ok(false);
        };
        let shard: i32 = row.try_get(0).map_err(fail)?;
        let ahead: String = row.try_get(1).map_err(fail)?;
        let next: String = row.try_get(2).map_err(fail)?;
        tracing::warn!(schema = %self.schema, table = %self.table, shard, ahead, next,
            "the log table's transaction ids are ahead of this cluster's (it was moved from another cluster): rebasing it onto this cluster's ids");
        let rebase = self.render(
            "UPDATE {shards} SET owner = NULL, expires_at = '-infinity', epoch = epoch + 1;
             DELETE FROM {relays};
             DELETE FROM {outbox} o USING {shards} s
                 WHERE o.shard = s.shard AND (o.xid, o.seq) <= (s.cursor_xid, s.cursor_seq);
             UPDATE {outbox} SET xid = pg_current_xact_id();
             UPDATE {held} SET xid = pg_current_xact_id();
             UPDATE {dead_letters} SET xid = pg_current_xact_id();
             UPDATE {shards} SET cursor_xid = pg_current_xact_id(), cursor_seq = 0,
                 moved_at = now();",
        );
        let mut tx = conn.begin().await.map_err(fail)?;
        tx.execute(rebase.as_str()).await.map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(true)
    }

    /// The mode the outbox table was migrated for, or `None` when it does not exist yet:
    /// only a log-mode table has the `xid` column.
    pub async fn mode(&self, conn: &mut PgConnection) -> Result<Option<StorageMode>> {
        let (exists, log): (bool, bool) = conn
            .fetch_one(
                sqlx::query(
                    "SELECT to_regclass($1) IS NOT NULL, EXISTS (SELECT FROM pg_attribute \
                     WHERE attrelid = to_regclass($1) AND attname = 'xid' AND NOT attisdropped)",
                )
                .bind(self.qualified("")),
            )
            .await
            .and_then(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .map_err(|e| db_error("cannot read the outbox table's mode", e))?;
        Ok(exists.then_some(if log {
            StorageMode::Log
        } else {
            StorageMode::Lease
        }))
    }

    /// A `Config` error when the table exists and was migrated for the other mode.
    pub(crate) async fn refuse_other_mode(
        &self,
        conn: &mut PgConnection,
        wanted: StorageMode,
    ) -> Result<()> {
        match self.mode(conn).await? {
            Some(found) if found != wanted => Err(Error::setting(
                "mode",
                format!(
                    "is `{}`, but table {}.{} was migrated for `{}` mode; a table runs in one \
                     mode: set mode = \"{}\", or migrate a new table for `{}` mode (see \
                     docs/storage/postgres.md, switching modes)",
                    wanted.name(),
                    self.schema,
                    self.table,
                    found.name(),
                    found.name(),
                    wanted.name()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Applies the migrations up to version `target` only, as an older release would have:
    /// for tests of upgrades. Not part of the stable API.
    #[doc(hidden)]
    pub async fn migrate_to(&self, conn: &mut PgConnection, target: usize) -> Result<()> {
        // Statements here go through `Executor`, whose futures are boxed: sqlx's `execute`
        // and `fetch_one` on a `&mut PgConnection` would make this future unusable in
        // `tokio::spawn` ("implementation of `Executor` is not general enough").
        self.create_schema(conn).await?;
        self.lock_migrations(conn).await?;
        let result = match self.refuse_other_mode(conn, StorageMode::Lease).await {
            Ok(()) => self.apply(conn, target.min(MIGRATIONS.len())).await,
            Err(e) => Err(e),
        };
        self.unlock_migrations(conn, result).await
    }

    /// Creates the schema if it is missing. Two migrators (of different tables) creating it
    /// at once would both pass `IF NOT EXISTS`, and one would fail on a unique violation, so
    /// creation is serialised by a lock on the schema's name.
    async fn create_schema(&self, conn: &mut PgConnection) -> Result<()> {
        if schema_exists(conn, &self.schema).await.map_err(fail)? {
            return Ok(());
        }
        let mut tx = conn.begin().await.map_err(fail)?;
        create_schema_in(&mut tx, &self.schema)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)
    }

    /// Takes this table's session-level migration lock, retrying until it is free. It is
    /// polled with `pg_try_advisory_lock`, never awaited with `pg_advisory_lock`: a session
    /// blocked in a statement keeps its snapshot, and `CREATE INDEX CONCURRENTLY` in the
    /// session holding the lock waits for every older snapshot to go: a deadlock.
    async fn lock_migrations(&self, conn: &mut PgConnection) -> Result<()> {
        let mut logged = false;
        loop {
            let locked: bool = conn
                .fetch_one(
                    sqlx::query("SELECT pg_try_advisory_lock($1)").bind(self.migration_key()),
                )
                .await
                .and_then(|row| row.try_get(0))
                .map_err(fail)?;
            if locked {
                return Ok(());
            }
            if !logged {
                tracing::info!(schema = %self.schema, table = %self.table, "another process is migrating the outbox tables; waiting");
                logged = true;
            }
            tokio::time::sleep(MIGRATION_LOCK_POLL).await;
        }
    }

    /// Releases the migration lock of [`lock_migrations`](Self::lock_migrations) after a
    /// migration that ended with `result`, whose error wins over the unlock's. A session
    /// lock outlives the call: release it even after a failure, since the connection
    /// usually goes back to a pool. (If the future is dropped midway, the lock lasts until
    /// the pool closes that connection.)
    async fn unlock_migrations<T>(&self, conn: &mut PgConnection, result: Result<T>) -> Result<T> {
        let unlocked = conn
            .execute(sqlx::query("SELECT pg_advisory_unlock($1)").bind(self.migration_key()))
            .await;
        let value = result?;
        unlocked.map_err(fail)?;
        Ok(value)
    }

    /// Applies the migrations after the recorded version up to `target`, holding the
    /// migration lock. Consecutive steps share one transaction; an index on an outbox table
    /// that existed before this run is built concurrently between transactions.
    async fn apply(&self, conn: &mut PgConnection, target: usize) -> Result<()> {
        let applied = applied_version(conn, &self.qualified("_migrations"))
            .await
            .map_err(fail)?;
        // Migration 1 creates the outbox table: if it runs now, the table is new, empty and
        // invisible to writers until the commit, and a plain CREATE INDEX in the same
        // transaction is right.
        let fresh = applied < 1;
        let mut batch = Vec::new();
        for (version, step) in (1..).zip(MIGRATIONS).take(target) {
            if version <= applied {
                continue;
            }
            match step {
                Step::Index { name, definition } if !fresh => {
                    self.run_in_transaction(conn, &batch).await?;
                    batch.clear();
                    self.build_index_concurrently(conn, version, name, definition)
                        .await?;
                }
                _ => batch.push((version, self.step_sql(step))),
            }
        }
        self.run_in_transaction(conn, &batch).await
    }

    /// Runs migration steps, each recorded with its version, in one transaction.
    async fn run_in_transaction(
        &self,
        conn: &mut PgConnection,
        steps: &[(i32, String)],
    ) -> Result<()> {
        if steps.is_empty() {
            return Ok(());
        }
        let record = format!(
            "INSERT INTO {} (version) VALUES ($1)",
            self.qualified("_migrations")
        );
        let mut tx = conn.begin().await.map_err(fail)?;
        for (version, sql) in steps {
            tracing::info!(schema = %self.schema, table = %self.table, version, "applying outbox migration");
            tx.execute(sql.as_str()).await.map_err(fail)?;
            tx.execute(sqlx::query(&record).bind(version))
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)
    }

    /// Builds an index on the existing outbox table without blocking writers, then records
    /// `version`. Each statement runs on its own: `CONCURRENTLY` refuses transactions.
    async fn build_index_concurrently(
        &self,
        conn: &mut PgConnection,
        version: i32,
        name: &str,
        definition: &str,
    ) -> Result<()> {
        tracing::info!(schema = %self.schema, table = %self.table, version, "applying outbox migration (building an index concurrently)");
        let name = self.render(name);
        let index = format!(r#""{}"."{name}""#, self.schema);
        // An interrupted build leaves an invalid index behind, which IF NOT EXISTS would
        // keep; we hold the migration lock, so an invalid index is no one's build in progress.
        let valid: Option<bool> = conn
            .fetch_optional(
                sqlx::query("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)")
                    .bind(&index),
            )
            .await
            .and_then(|row| row.map(|row| row.try_get(0)).transpose())
            .map_err(fail)?;
        if valid == Some(false) {
            tracing::warn!(%index, "dropping an invalid index left by an interrupted migration");
            let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {index}");
            conn.execute(drop.as_str()).await.map_err(fail)?;
        }
        let create = format!(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {} {definition}",
            self.qualified("")
        );
        conn.execute(create.as_str()).await.map_err(fail)?;
        // ON CONFLICT: a migrator of an older release, which knows nothing of this lock, may
        // have built the index and recorded the version meanwhile.
        let record = format!(
            "INSERT INTO {} (version) VALUES ($1) ON CONFLICT DO NOTHING",
            self.qualified("_migrations")
        );
        conn.execute(sqlx::query(&record).bind(version))
            .await
            .map_err(fail)?;
        Ok(())
    }

    /// The SQL of a step run inside the migration transaction.
    fn step_sql(&self, step: &Step) -> String {
        match step {
            Step::Sql(template) => self.render(template),
            Step::Index { name, definition } => {
                self.render(&format!("CREATE INDEX {name} ON {{outbox}} {definition}"))
            }
        }
    }

    /// Fills a migration template's placeholders with validated, quoted names.
    fn render(&self, template: &str) -> String {
        let companions = migrate::OUTBOX_COMPANIONS
            .into_iter()
            .chain(["wakeup", "shards", "relays", "held", "stats"]);
        migrate::fill_names(template, &self.table, "outbox", companions, |suffix| {
            self.qualified(suffix)
        })
        .replace("{notify_fn}", &self.qualified("_notify"))
        .replace("{channel}", &self.channel())
    }
}

/// Whether `schema` exists. An existing schema needs no lock, nor the CREATE privilege on
/// the database.
pub(crate) async fn schema_exists(
    conn: &mut PgConnection,
    schema: &str,
) -> std::result::Result<bool, sqlx::Error> {
    conn.fetch_one(
        sqlx::query("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)").bind(schema),
    )
    .await
    .and_then(|row| row.try_get(0))
}

/// Creates `schema` if it is missing, in the transaction `tx`, under the transaction-level
/// advisory lock on the schema's name that every migrator (of an outbox or an inbox) takes:
/// two creating it at once would both pass `IF NOT EXISTS`, and one would fail on a unique
/// violation.
pub(crate) async fn create_schema_in(
    tx: &mut PgConnection,
    schema: &str,
) -> std::result::Result<(), sqlx::Error> {
    let key = fnv1a(&format!("outbox-schema:{schema}")) as i64;
    tx.execute(sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(key))
        .await?;
    let create = format!(r#"CREATE SCHEMA IF NOT EXISTS "{schema}""#);
    tx.execute(create.as_str()).await?;
    Ok(())
}

/// Creates the versions table `versions` (validated, quoted and qualified) if it is missing,
/// and returns the highest version it records (0 for none). The outbox's and the inbox's.
pub(crate) async fn applied_version(
    conn: &mut PgConnection,
    versions: &str,
) -> std::result::Result<i32, sqlx::Error> {
    let create = format!(
        "CREATE TABLE IF NOT EXISTS {versions} (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
    );
    conn.execute(create.as_str()).await?;
    conn.fetch_one(format!("SELECT coalesce(max(version), 0) FROM {versions}").as_str())
        .await
        .and_then(|row| row.try_get(0))
}

/// Classifies an error of a migration statement.
fn fail(error: sqlx::Error) -> Error {
    db_error("migration failed", error)
}

/// One schema migration.
enum Step {
    /// SQL run in the migration transaction.
    Sql(&'static str),
    /// `CREATE INDEX <name> ON {outbox} <definition>`: on an outbox table that existed before
    /// the run, built `CONCURRENTLY` outside the transaction so writers are not blocked.
    Index {
        name: &'static str,
        definition: &'static str,
    },
}

/// The wake-up of both modes (migration 1 and log migration 1001): writers notify only
/// while a relay has said it is idle. One text, so the two migrations cannot drift.
macro_rules! wakeup_ddl {
    () => {
        concat!(
            r#"CREATE TABLE {wakeup} (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    relay_idle boolean NOT NULL DEFAULT false
);
INSERT INTO {wakeup} DEFAULT VALUES;
CREATE FUNCTION {notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $fn$
"#,
            notify_body!(),
            r#"CREATE TRIGGER {table}_wakeup AFTER INSERT ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {notify_fn}();
"#
        )
    };
}

/// The body of the wake-up's trigger function (created by the wake-up, rendered again by
/// migration 4 for the shortened channel names).
macro_rules! notify_body {
    () => {
        r#"BEGIN
    IF (SELECT relay_idle FROM {wakeup}) THEN
        PERFORM pg_notify('{channel}', '');
    END IF;
    RETURN NULL;
END
$fn$;
"#
    };
}

/// Schema migrations, applied in order (version = position + 1); never change the effect of
/// one that has shipped, add another.
const MIGRATIONS: &[Step] = &[
    Step::Sql(concat!(
        r#"
CREATE TABLE {outbox} (
    seq           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id            uuid NOT NULL DEFAULT gen_random_uuid(),
    topic         text NOT NULL CHECK (topic <> ''),
    partition_key text,
    payload       bytea NOT NULL,
    headers       jsonb NOT NULL DEFAULT '{}'::jsonb,
    traceparent   text,
    tracestate    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    available_at  timestamptz NOT NULL DEFAULT now(),
    claim_token   uuid,
    claimed_by    text,
    last_error    text
);
CREATE UNIQUE INDEX {table}_id ON {outbox} (id);
CREATE INDEX {table}_key_seq ON {outbox} (partition_key, seq) WHERE partition_key IS NOT NULL;
-- A busy outbox turns over its whole content in seconds: vacuum after a fixed number of
-- dead rows instead of a fraction of the table, and without throttling, so dead tuples do
-- not pile up at the head of the index that every claim scans. Half-full pages leave room
-- for the claim's update of unindexed columns to stay on its page (a HOT update), which
-- spares three index insertions per claimed row: a 500-row claim took 7 ms instead of 10.
ALTER TABLE {outbox} SET (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 20000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE {dead_letters} (
    seq              bigint PRIMARY KEY,
    id               uuid NOT NULL UNIQUE,
    topic            text NOT NULL,
    partition_key    text,
    payload          bytea NOT NULL,
    headers          jsonb NOT NULL,
    traceparent      text,
    tracestate       text,
    created_at       timestamptz NOT NULL,
    attempts         integer NOT NULL,
    last_error       text NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX {table}_dead_letters_key ON {dead_letters} (partition_key, seq);

CREATE TABLE {parked_keys} (
    partition_key  text PRIMARY KEY,
    dead_letter_id uuid NOT NULL,
    parked_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {delivered} (
    seq           bigint PRIMARY KEY,
    id            uuid NOT NULL,
    topic         text NOT NULL,
    partition_key text,
    payload       bytea NOT NULL,
    headers       jsonb NOT NULL,
    traceparent   text,
    tracestate    text,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL,
    receipt       text NOT NULL,
    delivered_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX {table}_delivered_at ON {delivered} (delivered_at);

-- The wake-up: writers notify only while a relay has said it is idle, so a busy relay
-- costs writers nothing (notifying commits are serialised cluster-wide).
"#,
        wakeup_ddl!()
    )),
    // Claims with per-key order sweep the keys through {table}_key_seq and find the rows
    // without a key here, instead of stepping over every keyed row in `seq` order. Shipped as
    // a plain `CREATE INDEX {table}_unkeyed_seq ON {outbox} (seq) WHERE partition_key IS NULL`
    // in the migration transaction, which blocked writers while it scanned a large table; it
    // now runs concurrently on existing tables, with the same name and definition.
    Step::Index {
        name: "{table}_unkeyed_seq",
        definition: "(seq) WHERE partition_key IS NULL",
    },
    // Names over 63 bytes in all made a channel that pg_notify refuses, failing every insert
    // while a relay was idle; channel() now shortens it. Render the function of version 1
    // again (same body) so tables migrated before notify on the new channel.
    Step::Sql(concat!(
        r#"
CREATE OR REPLACE FUNCTION {notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $fn$
"#,
        notify_body!()
    )),
    Step::Sql(SHARED_STATS),
    Step::Sql(STATS_RETRYING),
];

/// Log mode: the `xid` column can only be the writing transaction's id (an older one would
/// put the row behind a cursor, where it is never delivered and the cleanup deletes it; a
/// later one would hold it back while later rows of its key pass it): an INSERT that writes
/// another value is refused. A check rather than a trigger that sets it: it costs writers
/// nothing measurable, where a row trigger took 10–25% of their commits. `NOT VALID`: rows
/// already there are not checked, and `pg_dump` adds it after the data (a restore loads
/// rows with the other cluster's ids; relays then refuse the table until `migrate` rebases
/// it, see `moved_log_sql`). And rows set aside before they left the log (held or
/// dead-lettered while still past the cursor) leave it now, so no later owner of their
/// shard reads them again as new.
const LOG_XID_ENFORCED: &str = r#"
ALTER TABLE {outbox} ADD CONSTRAINT {table}_xid_is_the_writers
    CHECK (xid = pg_current_xact_id()) NOT VALID;
DELETE FROM {outbox} o WHERE EXISTS (SELECT 1 FROM {held} h WHERE h.seq = o.seq)
    OR EXISTS (SELECT 1 FROM {dead_letters} d WHERE d.seq = o.seq);
"#;

/// The queue figures that relays share (`Storage::shared_stats`): the first relay past
/// `refresh_after` counts them and stores them here, the others read them, so replicas
/// cost one count per interval instead of one each. The same in both modes.
const SHARED_STATS: &str = r#"
CREATE TABLE {stats} (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    refresh_after  timestamptz NOT NULL DEFAULT '-infinity',
    measured_at    timestamptz,
    pending        bigint NOT NULL DEFAULT 0,
    oldest_pending timestamptz,
    in_flight      bigint NOT NULL DEFAULT 0,
    dead_lettered  bigint NOT NULL DEFAULT 0,
    parked_keys    bigint NOT NULL DEFAULT 0
);
INSERT INTO {stats} DEFAULT VALUES;
"#;

/// The shared figures gain the pending messages waiting to retry (`QueueStats::retrying`).
const STATS_RETRYING: &str = "ALTER TABLE {stats} ADD COLUMN retrying bigint NOT NULL DEFAULT 0;";

/// Log-mode migrations are numbered from here, so a table's versions say its mode.
const LOG_FIRST_VERSION: i32 = 1001;

/// Log-mode migrations (version = [`LOG_FIRST_VERSION`] + position); never change one that
/// has shipped, add another. `{shard_count}` is the configured number of shards.
const LOG_MIGRATIONS: &[&str] = &[
    concat!(
        r#"
-- Append-only: writers INSERT exactly as in lease mode; the defaults add what the relays
-- need. `xid` is the writing transaction's id: relays read only below the oldest running
-- transaction, in (xid, seq) order. The shard is fixed by the partition key (keyless rows
-- spread by their id); the count is part of the expression, so it never changes.
CREATE TABLE {outbox} (
    seq           bigint GENERATED ALWAYS AS IDENTITY,
    xid           xid8 NOT NULL DEFAULT pg_current_xact_id(),
    id            uuid NOT NULL DEFAULT gen_random_uuid(),
    topic         text NOT NULL CHECK (topic <> ''),
    partition_key text,
    payload       bytea NOT NULL,
    headers       jsonb NOT NULL DEFAULT '{}'::jsonb,
    traceparent   text,
    tracestate    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    shard         integer NOT NULL GENERATED ALWAYS AS (
        ((coalesce(hashtext(partition_key), uuid_hash(id)) % {shard_count}) + {shard_count}) % {shard_count}
    ) STORED,
    PRIMARY KEY (shard, xid, seq)
);
-- Rows are inserted, then deleted in ranges behind the cursors: vacuum after a fixed count.
ALTER TABLE {outbox} SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 20000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

-- One row per shard: its owner, the fencing epoch (bumped on every change of owner), the
-- owner's lease on the database clock, and the cursor: every row at or before
-- (cursor_xid, cursor_seq) is settled.
CREATE TABLE {shards} (
    shard      integer PRIMARY KEY,
    owner      text,
    epoch      bigint NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    cursor_xid xid8 NOT NULL DEFAULT '0',
    cursor_seq bigint NOT NULL DEFAULT 0,
    moved_at   timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {shards} (shard) SELECT generate_series(0, {shard_count} - 1);

-- Relays alive, for the fair share of shards each takes.
CREATE TABLE {relays} (
    relay      text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);

CREATE TABLE {dead_letters} (
    seq              bigint PRIMARY KEY,
    xid              xid8 NOT NULL,
    shard            integer NOT NULL,
    id               uuid NOT NULL,
    topic            text NOT NULL,
    partition_key    text,
    payload          bytea NOT NULL,
    headers          jsonb NOT NULL,
    traceparent      text,
    tracestate       text,
    created_at       timestamptz NOT NULL,
    attempts         integer NOT NULL,
    last_error       text NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX {table}_dead_letters_key ON {dead_letters} (partition_key, seq);

-- A parked key's messages kept aside (the cursor moves past them), with replayed dead
-- letters; delivered in (xid, seq) order once the key drains.
CREATE TABLE {held} (
    seq           bigint PRIMARY KEY,
    xid           xid8 NOT NULL,
    shard         integer NOT NULL,
    id            uuid NOT NULL,
    topic         text NOT NULL,
    partition_key text NOT NULL,
    payload       bytea NOT NULL,
    headers       jsonb NOT NULL,
    traceparent   text,
    tracestate    text,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL DEFAULT 0
);
CREATE INDEX {table}_held_key ON {held} (partition_key, xid, seq);

-- draining: released or replayed; the owner delivers the key's held rows, then unparks it.
-- generation: bumped by every replay or release, so the owner reloads the held rows.
CREATE TABLE {parked_keys} (
    partition_key  text PRIMARY KEY,
    dead_letter_id uuid NOT NULL,
    shard          integer NOT NULL,
    draining       boolean NOT NULL DEFAULT false,
    generation     bigint NOT NULL DEFAULT 0,
    parked_at      timestamptz NOT NULL DEFAULT now()
);

"#,
        wakeup_ddl!()
    ),
    SHARED_STATS,
    STATS_RETRYING,
    LOG_XID_ENFORCED,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_not_spliced() {
        assert!(OutboxTable::new("app", "outbox_2").is_ok());
        for bad in [
            "",
            "Outbox",
            "a-b",
            "x\"; DROP TABLE y; --",
            "pg_catalog",
            "1abc",
            &"a".repeat(41),
        ] {
            let err = OutboxTable::new(bad, "outbox").unwrap_err();
            assert!(err.to_string().contains("schema `"), "{err}");
        }
        let err = OutboxTable::new("app", "bad name").unwrap_err();
        assert!(err.to_string().contains("table `bad name`"), "{err}");
    }

    #[test]
    fn lock_key_is_stable_and_distinct() {
        let a = OutboxTable::new("app", "outbox").unwrap();
        let b = OutboxTable::new("app", "outbox2").unwrap();
        assert_eq!(
            a.lock_key(),
            OutboxTable::new("app", "outbox").unwrap().lock_key()
        );
        assert_ne!(a.lock_key(), b.lock_key());
        for step in MIGRATIONS {
            let sql = a.step_sql(step);
            assert_eq!(migrate::unfilled(&sql), None, "{sql}");
        }
    }

    #[test]
    fn log_migrations_fill_every_placeholder() {
        let t = OutboxTable::new("app", "outbox").unwrap();
        for template in LOG_MIGRATIONS {
            let sql = t.render(template).replace("{shard_count}", "16");
            assert_eq!(migrate::unfilled(&sql), None, "{sql}");
        }
        assert!(
            t.render(LOG_MIGRATIONS[0])
                .contains(r#""app"."outbox_shards""#)
        );
    }

    #[test]
    fn channel_fits_postgres_identifiers() {
        // Short names keep the channel existing deployments listen on.
        let short = OutboxTable::new("app", "outbox").unwrap();
        assert_eq!(short.channel(), "app.outbox");
        let (s31, t31) = ("s".repeat(31), "t".repeat(31));
        let exact = OutboxTable::new(&s31, &t31).unwrap();
        assert_eq!(exact.channel(), format!("{s31}.{t31}"));
        assert_eq!(exact.channel().len(), MAX_IDENTIFIER);
        // Longer ones get a short name that never changes (pinned).
        let longest =
            OutboxTable::new(&"s".repeat(names::MAX_NAME), &"t".repeat(names::MAX_NAME)).unwrap();
        assert!(longest.channel().len() <= MAX_IDENTIFIER);
        assert_eq!(longest.channel(), "outbox_7cb9e4cbe507af58");
        let other =
            OutboxTable::new(&"s".repeat(names::MAX_NAME), &"u".repeat(names::MAX_NAME)).unwrap();
        assert_ne!(longest.channel(), other.channel());
        let over = OutboxTable::new(&"s".repeat(32), &t31).unwrap();
        assert!(over.channel().starts_with("outbox_") && over.channel().len() == 23);
        // Migration 3 renders the notify function of migration 1 again, with the channel.
        let function = longest.step_sql(&MIGRATIONS[2]);
        let body = function.split("AS $fn$").nth(1).unwrap();
        assert!(longest.step_sql(&MIGRATIONS[0]).contains(body));
        assert!(body.contains(&format!("pg_notify('{}', '')", longest.channel())));
    }

    /// Compiles only if a migration can run in a spawned task.
    #[allow(dead_code)]
    fn migrate_is_spawnable(table: OutboxTable, mut conn: PgConnection) {
        drop(tokio::spawn(async move { table.migrate(&mut conn).await }));
    }

    #[test]
    fn index_migration_keeps_its_shipped_definition() {
        let a = OutboxTable::new("app", "outbox").unwrap();
        assert_eq!(
            a.step_sql(&MIGRATIONS[1]),
            r#"CREATE INDEX outbox_unkeyed_seq ON "app"."outbox" (seq) WHERE partition_key IS NULL"#
        );
    }
}
