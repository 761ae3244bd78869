//! The outbox's database, PostgreSQL (lease or log mode) or MySQL (`--storage`): the SQL the
//! run needs of it (the writers' INSERT, rows not settled, dead letters, what became of lost
//! messages, killing the relays' sessions, clean-up), spelled for each. One `AnyPool` serves
//! all.

use std::time::Duration;

use outbox_core::redact_url;
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;

use crate::{Context, Result};

/// The storage the relays use.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Store {
    /// PostgreSQL in lease mode (the default mode).
    Postgres,
    /// PostgreSQL in log mode (`mode = "log"`, docs/storage/postgres.md#log-mode): relays
    /// read past per-shard cursors; delivered rows stay in the table until cleanup.
    PostgresLog,
    /// MySQL or MariaDB.
    Mysql,
}

/// Shards of the log-mode table: more than the relays (3 by default), so shards change hands
/// when relays die and come back, and a relay owns several.
pub const LOG_SHARDS: u32 = 8;

/// The run's outbox: a schema of its own on PostgreSQL (table `outbox`), a table of its own
/// (and its companions) on MySQL, both named `name`.
#[derive(Clone)]
pub struct Database {
    pub store: Store,
    pub pool: AnyPool,
    name: String,
}

impl Database {
    pub async fn connect(store: Store, url: &str, name: &str) -> Result<Database> {
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await
            .ctx(format_args!("{store:?} at {}", redact_url(url)))?;
        Ok(Database {
            store,
            pool,
            name: name.to_string(),
        })
    }

    /// What the relay's `[storage]` table says besides `url` and the settings common to all
    /// (relays.rs): where the outbox is, its mode, and how long delivered rows are kept.
    pub fn storage_keys(&self) -> String {
        // Lease mode and MySQL keep delivered rows with the broker's receipt, so a lost
        // message shows whether and where the broker said it took it.
        let receipts = "retention = \"1h\"";
        // The test server allows prepared transactions (`cargo xtask services`); no writer
        // here prepares, so the wake-up stays on, as on a server that does not.
        let wakeup = "wakeup_with_prepared_transactions = true";
        match self.store {
            Store::Postgres => format!(
                "schema = \"{}\"\ntable = \"outbox\"\n{receipts}\n{wakeup}",
                self.name
            ),
            // Log mode keeps no receipt, and `retention` would keep every row (cleanup
            // deletes only rows older than it): without it the ranged deletes behind the
            // cursors run all along, under the faults, where a wrong one would lose rows.
            Store::PostgresLog => format!(
                "schema = \"{}\"\ntable = \"outbox\"\nmode = \"log\"\nshards = {LOG_SHARDS}\n{wakeup}",
                self.name
            ),
            Store::Mysql => format!("type = \"mysql\"\ntable = \"{}\"\n{receipts}", self.name),
        }
    }

    /// The quoted name of the outbox table, or of a companion (`_delivered`, …).
    pub fn table(&self, suffix: &str) -> String {
        match self.store {
            Store::Postgres | Store::PostgresLog => {
                format!(r#""{}"."outbox{suffix}""#, self.name)
            }
            Store::Mysql => format!("`{}{suffix}`", self.name),
        }
    }

    /// The writers' INSERT: id (text), topic, key, payload.
    pub fn insert(&self) -> String {
        let table = self.table("");
        match self.store {
            Store::Postgres | Store::PostgresLog => format!(
                "INSERT INTO {table} (id, topic, partition_key, payload) VALUES ($1::uuid, $2, $3, $4)"
            ),
            Store::Mysql => {
                format!(
                    "INSERT INTO {table} (id, topic, partition_key, payload) VALUES (?, ?, ?, ?)"
                )
            }
        }
    }

    /// Committed messages the relays have not settled yet. Lease mode and MySQL delete (or
    /// move) a row when it is settled: the rows in the table. Log mode keeps settled rows
    /// until cleanup: the rows past their shard's cursor, and the held rows of parked keys.
    pub async fn unsettled(&self) -> Result<i64> {
        let count = match self.store {
            Store::Postgres | Store::Mysql => format!("SELECT count(*) FROM {}", self.table("")),
            Store::PostgresLog => format!(
                "SELECT (SELECT count(*) FROM {outbox} o JOIN {shards} s ON s.shard = o.shard \
                         WHERE (o.xid, o.seq) > (s.cursor_xid, s.cursor_seq)) \
                      + (SELECT count(*) FROM {held})",
                outbox = self.table(""),
                shards = self.table("_shards"),
                held = self.table("_held"),
            ),
        };
        sqlx::query_scalar(&count)
            .fetch_one(&self.pool)
            .await
            .ctx("counting the messages not settled")
    }

    /// The number of dead letters and up to five of their errors.
    pub async fn dead_letters(&self) -> Result<(i64, Vec<String>)> {
        let table = self.table("_dead_letters");
        let count: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&self.pool)
            .await
            .ctx("dead letters")?;
        let line = match self.store {
            Store::Postgres | Store::PostgresLog => "partition_key || ': ' || last_error",
            Store::Mysql => "CAST(CONCAT(COALESCE(partition_key, ''), ': ', last_error) AS CHAR)",
        };
        let errors =
            sqlx::query_scalar::<_, Option<String>>(&format!("SELECT {line} FROM {table} LIMIT 5"))
                .fetch_all(&self.pool)
                .await
                .ctx("dead letters")?;
        Ok((count, errors.into_iter().flatten().collect()))
    }

    /// Every dead letter's id and key, for the operator.
    pub async fn dead_letter_keys(&self) -> Result<Vec<(uuid::Uuid, String)>> {
        let table = self.table("_dead_letters");
        let query = match self.store {
            Store::Postgres | Store::PostgresLog => {
                format!("SELECT id::text, coalesce(partition_key, '') FROM {table}")
            }
            Store::Mysql => format!(
                "SELECT CAST(id AS CHAR), CAST(COALESCE(partition_key, '') AS CHAR) FROM {table}"
            ),
        };
        let rows: Vec<(String, String)> = sqlx::query_as(&query)
            .fetch_all(&self.pool)
            .await
            .ctx("listing the dead letters")?;
        rows.into_iter()
            .map(|(id, key)| Ok((id.parse().ctx(format_args!("dead letter id {id}"))?, key)))
            .collect()
    }

    /// What the relays recorded for up to ten lost messages: the broker's receipt and when
    /// (log mode keeps none: where the row stands instead, [`Database::log_standing`]).
    pub async fn receipts(&self, lost: &[uuid::Uuid]) -> Result<Vec<String>> {
        if self.store == Store::PostgresLog {
            return self.log_standing(lost).await;
        }
        let table = self.table("_delivered");
        let query = match self.store {
            Store::Postgres | Store::PostgresLog => format!(
                "SELECT 'relayed with receipt ' || receipt || ' at ' || delivered_at::text \
                 || ' after ' || attempts || ' failed attempts' FROM {table} WHERE id = $1::uuid"
            ),
            Store::Mysql => format!(
                "SELECT CAST(CONCAT('relayed with receipt ', receipt, ' at ', delivered_at, \
                 ' after ', attempts, ' failed attempts') AS CHAR) FROM {table} WHERE id = ?"
            ),
        };
        let mut lines = Vec::new();
        for id in &lost[..lost.len().min(10)] {
            let found: Option<String> = sqlx::query_scalar(&query)
                .bind(id.to_string())
                .fetch_optional(&self.pool)
                .await
                .ctx("receipts of lost messages")?;
            lines.push(format!(
                "{id}: {}",
                found.unwrap_or_else(|| "no delivery recorded".into())
            ));
        }
        Ok(lines)
    }

    /// Log mode keeps no receipts: for up to ten lost messages, where each row stands. A
    /// dead letter or a held row (its key parked) was never delivered; its copy in the log
    /// stays behind the cursor, so these are asked first. Then the log: behind its shard's
    /// cursor, or gone (cleanup deletes only rows behind the cursors), a relay settled it as
    /// delivered; past the cursor, it was never settled.
    async fn log_standing(&self, lost: &[uuid::Uuid]) -> Result<Vec<String>> {
        let query = format!(
            "SELECT coalesce(\
               (SELECT 'dead-lettered: ' || last_error FROM {dead} WHERE id = $1::uuid LIMIT 1), \
               (SELECT 'held: its key is parked (shard ' || shard || ')' FROM {held} \
                WHERE id = $1::uuid LIMIT 1), \
               (SELECT CASE WHEN (o.xid, o.seq) <= (s.cursor_xid, s.cursor_seq) \
                       THEN 'settled as delivered (behind the cursor of shard ' \
                       ELSE 'not settled (past the cursor of shard ' END \
                       || o.shard || ', xid ' || o.xid::text || ', seq ' || o.seq \
                       || '; cursor ' || s.cursor_xid::text || '/' || s.cursor_seq || ')' \
                FROM {outbox} o JOIN {shards} s ON s.shard = o.shard WHERE o.id = $1::uuid LIMIT 1), \
               'not in the log: settled as delivered and removed by cleanup')",
            outbox = self.table(""),
            shards = self.table("_shards"),
            held = self.table("_held"),
            dead = self.table("_dead_letters"),
        );
        let mut lines = Vec::new();
        for id in &lost[..lost.len().min(10)] {
            let standing: String = sqlx::query_scalar(&query)
                .bind(id.to_string())
                .fetch_one(&self.pool)
                .await
                .ctx("where lost messages stand in the log")?;
            lines.push(format!("{id}: {standing} (log mode keeps no receipt)"));
        }
        Ok(lines)
    }

    /// Ends the database sessions whose client port is one of `ports` (the relays' side of
    /// the run's proxy: other relays on the shared server are left alone); returns how many.
    pub async fn terminate_sessions(&self, ports: &[u16]) -> Result<u64> {
        if ports.is_empty() {
            return Ok(0);
        }
        // Port numbers, not input: safe to write into the statement.
        let list = ports
            .iter()
            .map(|p| format!("'{p}'"))
            .collect::<Vec<_>>()
            .join(", ");
        match self.store {
            Store::Postgres | Store::PostgresLog => {
                let terminated: i64 = sqlx::query_scalar(&format!(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE application_name = 'outbox-relay' AND client_port::text IN ({list})"
                ))
                .fetch_one(&self.pool)
                .await
                .ctx("pg_terminate_backend")?;
                Ok(terminated as u64)
            }
            Store::Mysql => {
                let ids: Vec<i64> = sqlx::query_scalar(&format!(
                    "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST \
                     WHERE SUBSTRING_INDEX(HOST, ':', -1) IN ({list})"
                ))
                .fetch_all(&self.pool)
                .await
                .ctx("listing the relays' sessions")?;
                let mut killed = 0;
                for id in ids {
                    // A session may end by itself meanwhile: that is not a failure.
                    if sqlx::query(&format!("KILL CONNECTION {id}"))
                        .execute(&self.pool)
                        .await
                        .is_ok()
                    {
                        killed += 1;
                    }
                }
                Ok(killed)
            }
        }
    }

    /// Drops the run's schema or tables.
    pub async fn cleanup(&self) {
        let drop = match self.store {
            Store::Postgres | Store::PostgresLog => {
                format!(r#"DROP SCHEMA IF EXISTS "{}" CASCADE"#, self.name)
            }
            Store::Mysql => format!(
                "DROP TABLE IF EXISTS {}",
                outbox_mysql::TABLE_SUFFIXES
                    .map(|suffix| self.table(suffix))
                    .join(", ")
            ),
        };
        if let Err(error) = sqlx::query(&drop).execute(&self.pool).await {
            eprintln!("chaos: dropping {}: {error}", self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    //! What the checker reads of a log-mode table, against a real one in a schema of the
    //! test's own on the shared PostgreSQL: the rows a relay would leave in each state are
    //! made by hand (cursors moved, a row held, one dead-lettered, one cleaned up).

    use outbox_postgres::{PgStorage, PostgresConfig, StorageMode};
    use outbox_test_support::{Service, unique_name};
    use uuid::Uuid;

    use super::{Database, LOG_SHARDS, Store};

    /// A migrated log-mode outbox in a schema of its own; dropped by `cleanup`.
    async fn log_outbox() -> Database {
        let url = Service::Postgres.require();
        let name = unique_name("chaos_test");
        let mut config = PostgresConfig::new(&url);
        config.mode = StorageMode::Log;
        config.shards = LOG_SHARDS;
        config.schema = name.clone();
        config.table = "outbox".into();
        let storage = PgStorage::new(config).expect("valid test configuration");
        storage
            .migrate()
            .await
            .unwrap_or_else(|e| Service::Postgres.missing(e));
        Database::connect(Store::PostgresLog, &url, &name)
            .await
            .unwrap_or_else(|e| Service::Postgres.missing(e))
    }

    async fn exec(db: &Database, sql: &str) {
        sqlx::query(sql)
            .execute(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    #[tokio::test]
    async fn log_mode_counts_rows_not_settled_and_tells_where_a_lost_row_stands() {
        let db = log_outbox().await;
        // One transaction each, in this order: later ones have higher (xid, seq).
        let names = ["cleaned", "dead", "held", "settled", "pending"];
        let mut ids = Vec::new();
        for name in names {
            let id = Uuid::now_v7();
            sqlx::query(&db.insert())
                .bind(id.to_string())
                .bind("chaos")
                .bind(format!("k-{name}"))
                .bind(id.to_string().into_bytes())
                .execute(&db.pool)
                .await
                .expect("the writers' INSERT works on a log table");
            ids.push(id);
        }
        let [cleaned, dead, held, settled, pending] = ids[..] else {
            unreachable!()
        };
        assert_eq!(
            db.unsettled().await.expect("count"),
            5,
            "nothing settled yet"
        );

        // Every shard's cursor moves to its last row of the first four, as settlements do.
        let (outbox, shards) = (db.table(""), db.table("_shards"));
        let behind = [cleaned, dead, held, settled]
            .map(|id| format!("'{id}'"))
            .join(", ");
        exec(
            &db,
            &format!(
                "UPDATE {shards} s SET cursor_xid = m.xid, cursor_seq = m.seq FROM \
                 (SELECT DISTINCT ON (shard) shard, xid, seq FROM {outbox} \
                  WHERE id IN ({behind}) ORDER BY shard, xid DESC, seq DESC) m \
                 WHERE s.shard = m.shard"
            ),
        )
        .await;
        // A parked key's row is copied to the held rows, a dead letter to the dead letters
        // (both stay in the log behind the cursor); cleanup deletes a settled row.
        let columns = "seq, xid, shard, id, topic, partition_key, payload, headers, \
                       traceparent, tracestate, created_at";
        exec(
            &db,
            &format!(
                "INSERT INTO {} ({columns}) SELECT {columns} FROM {outbox} WHERE id = '{held}'",
                db.table("_held")
            ),
        )
        .await;
        exec(
            &db,
            &format!(
                "INSERT INTO {} ({columns}, attempts, last_error) \
                 SELECT {columns}, 1000, 'refused' FROM {outbox} WHERE id = '{dead}'",
                db.table("_dead_letters")
            ),
        )
        .await;
        exec(&db, &format!("DELETE FROM {outbox} WHERE id = '{cleaned}'")).await;

        assert_eq!(
            db.unsettled().await.expect("count"),
            2,
            "not settled: the row past its cursor and the held row, not the rows behind the cursors"
        );
        let dead_letters = db
            .dead_letters()
            .await
            .expect("dead letters of a log table");
        assert_eq!(dead_letters, (1, vec!["k-dead: refused".to_string()]));

        let lines = db
            .receipts(&ids)
            .await
            .expect("log mode has no _delivered table: no error");
        let expected = [
            (
                cleaned,
                "not in the log: settled as delivered and removed by cleanup",
            ),
            (dead, "dead-lettered: refused"),
            (held, "held: its key is parked"),
            (settled, "settled as delivered (behind the cursor of shard"),
            (pending, "not settled (past the cursor of shard"),
        ];
        assert_eq!(lines.len(), expected.len(), "{lines:#?}");
        for (line, (id, standing)) in lines.iter().zip(expected) {
            assert!(
                line.starts_with(&format!("{id}: {standing}"))
                    && line.ends_with("(log mode keeps no receipt)"),
                "expected {id}: {standing}…, got {line}"
            );
        }
        db.cleanup().await;
    }
}
