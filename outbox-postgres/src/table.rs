//! The outbox table as a contract: its names, its migrations, and enqueueing into it from
//! the caller's own transaction.

use outbox_core::{Error, NewMessage, Result};
use sqlx::PgConnection;

use crate::error::db_error;

/// Longest schema or table name accepted, leaving room for the suffixes of the companion
/// tables within PostgreSQL's 63-byte identifiers.
const MAX_NAME: usize = 40;

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

/// Checks that `name` is a plain lower-case identifier; `what` names the setting in errors.
fn validate_name(what: &str, name: &str) -> Result<()> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || name.len() > MAX_NAME || name.starts_with("pg_") {
        return Err(Error::config(format!(
            "{what} `{name}` is not allowed: use 1 to {MAX_NAME} lower-case letters, digits and \
             underscores, starting with a letter or underscore and not with `pg_`"
        )));
    }
    Ok(())
}

impl OutboxTable {
    /// The outbox table `schema.table`. Fails if either name is not a plain identifier.
    pub fn new(schema: &str, table: &str) -> Result<Self> {
        validate_name("storage.schema", schema)?;
        validate_name("storage.table", table)?;
        let outbox = format!(r#""{schema}"."{table}""#);
        let columns =
            "id, topic, partition_key, payload, headers, traceparent, tracestate, created_at";
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

    /// The LISTEN/NOTIFY channel of the wake-up.
    pub fn channel(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// The advisory lock key that serialises claims against settlements of this table.
    pub(crate) fn lock_key(&self) -> i64 {
        // FNV-1a: stable across processes and versions, unlike std's hasher.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in format!("outbox:{}.{}", self.schema, self.table).bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        hash as i64
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

    /// Creates or upgrades the tables. Safe to run concurrently and repeatedly.
    pub async fn migrate(&self, conn: &mut PgConnection) -> Result<()> {
        let fail = |e| db_error("migration failed", e);
        let mut tx = sqlx::Connection::begin(conn).await.map_err(fail)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(self.lock_key())
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        sqlx::raw_sql(&format!(
            r#"CREATE SCHEMA IF NOT EXISTS "{}";
               CREATE TABLE IF NOT EXISTS {} (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"#,
            self.schema,
            self.qualified("_migrations")
        ))
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
        let applied: Option<i32> = sqlx::query_scalar(&format!(
            "SELECT max(version) FROM {}",
            self.qualified("_migrations")
        ))
        .fetch_one(&mut *tx)
        .await
        .map_err(fail)?;
        for (version, template) in MIGRATIONS.iter().enumerate() {
            let version = version as i32 + 1;
            if applied.is_some_and(|a| a >= version) {
                continue;
            }
            tracing::info!(schema = %self.schema, table = %self.table, version, "applying outbox migration");
            sqlx::raw_sql(&self.render(template))
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            sqlx::query(&format!(
                "INSERT INTO {} (version) VALUES ($1)",
                self.qualified("_migrations")
            ))
            .bind(version)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        Ok(())
    }

    /// Fills a migration template's placeholders with validated, quoted names.
    fn render(&self, template: &str) -> String {
        template
            .replace("{outbox}", &self.qualified(""))
            .replace("{dead_letters}", &self.qualified("_dead_letters"))
            .replace("{parked_keys}", &self.qualified("_parked_keys"))
            .replace("{delivered}", &self.qualified("_delivered"))
            .replace("{wakeup}", &self.qualified("_wakeup"))
            .replace("{notify_fn}", &self.qualified("_notify"))
            .replace("{channel}", &self.channel())
            .replace("{table}", &self.table)
    }
}

fn check_topic(message: &NewMessage) -> Result<()> {
    if message.topic.is_empty() {
        return Err(Error::permanent(format!(
            "message {} has an empty topic; every message needs a topic",
            message.id
        )));
    }
    Ok(())
}

fn trace_columns(message: &NewMessage) -> (Option<&str>, Option<&str>) {
    match &message.trace_context {
        Some(t) => (Some(t.traceparent.as_str()), t.tracestate.as_deref()),
        None => (None, None),
    }
}

/// Schema migrations, applied in order; never edit one that has shipped, add another.
const MIGRATIONS: &[&str] = &[
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
CREATE TABLE {wakeup} (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    relay_idle boolean NOT NULL DEFAULT false
);
INSERT INTO {wakeup} DEFAULT VALUES;
CREATE FUNCTION {notify_fn}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF (SELECT relay_idle FROM {wakeup}) THEN
        PERFORM pg_notify('{channel}', '');
    END IF;
    RETURN NULL;
END
$fn$;
CREATE TRIGGER {table}_wakeup AFTER INSERT ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {notify_fn}();
"#,
    r#"
-- Claims with per-key order sweep the keys through {table}_key_seq and find the rows without
-- a key here, instead of stepping over every keyed row in `seq` order.
CREATE INDEX {table}_unkeyed_seq ON {outbox} (seq) WHERE partition_key IS NULL;
"#,
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
            assert!(err.to_string().contains("storage.schema"), "{err}");
        }
        let err = OutboxTable::new("app", "bad name").unwrap_err();
        assert!(
            err.to_string().contains("storage.table `bad name`"),
            "{err}"
        );
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
        let sql = a.render(MIGRATIONS[0]);
        for placeholder in [
            "{outbox}",
            "{dead_letters}",
            "{wakeup}",
            "{channel}",
            "{table}",
        ] {
            assert!(
                !sql.contains(placeholder),
                "{placeholder} left in the migration"
            );
        }
    }
}
