//! The outbox's database, PostgreSQL or MySQL (`--storage`): the SQL the run needs of it
//! (the writers' INSERT, counts, dead letters, receipts, killing the relays' sessions,
//! clean-up), spelled for each. One `AnyPool` serves both.

use std::time::Duration;

use outbox_core::redact_url;
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;

use crate::{Context, Result};

/// The storage the relays use.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Store {
    Postgres,
    Mysql,
}

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

    /// What the relay's `[storage]` table says besides `url`.
    pub fn storage_keys(&self) -> String {
        match self.store {
            Store::Postgres => format!("schema = \"{}\"\ntable = \"outbox\"", self.name),
            Store::Mysql => format!("type = \"mysql\"\ntable = \"{}\"", self.name),
        }
    }

    /// The quoted name of the outbox table, or of a companion (`_delivered`, …).
    pub fn table(&self, suffix: &str) -> String {
        match self.store {
            Store::Postgres => format!(r#""{}"."outbox{suffix}""#, self.name),
            Store::Mysql => format!("`{}{suffix}`", self.name),
        }
    }

    /// The writers' INSERT: id (text), topic, key, payload.
    pub fn insert(&self) -> String {
        let table = self.table("");
        match self.store {
            Store::Postgres => format!(
                "INSERT INTO {table} (id, topic, partition_key, payload) VALUES ($1::uuid, $2, $3, $4)"
            ),
            Store::Mysql => {
                format!(
                    "INSERT INTO {table} (id, topic, partition_key, payload) VALUES (?, ?, ?, ?)"
                )
            }
        }
    }

    /// Rows still in the outbox table.
    pub async fn outbox_rows(&self) -> Result<i64> {
        let count = format!("SELECT count(*) FROM {}", self.table(""));
        sqlx::query_scalar(&count)
            .fetch_one(&self.pool)
            .await
            .ctx("counting outbox rows")
    }

    /// The number of dead letters and up to five of their errors.
    pub async fn dead_letters(&self) -> Result<(i64, Vec<String>)> {
        let table = self.table("_dead_letters");
        let count: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&self.pool)
            .await
            .ctx("dead letters")?;
        let line = match self.store {
            Store::Postgres => "partition_key || ': ' || last_error",
            Store::Mysql => "CAST(CONCAT(COALESCE(partition_key, ''), ': ', last_error) AS CHAR)",
        };
        let errors =
            sqlx::query_scalar::<_, Option<String>>(&format!("SELECT {line} FROM {table} LIMIT 5"))
                .fetch_all(&self.pool)
                .await
                .ctx("dead letters")?;
        Ok((count, errors.into_iter().flatten().collect()))
    }

    /// What the relays recorded for up to ten lost messages: the broker's receipt and when.
    pub async fn receipts(&self, lost: &[uuid::Uuid]) -> Result<Vec<String>> {
        let table = self.table("_delivered");
        let query = match self.store {
            Store::Postgres => format!(
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
            Store::Postgres => {
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
            Store::Postgres => format!(r#"DROP SCHEMA IF EXISTS "{}" CASCADE"#, self.name),
            Store::Mysql => format!(
                "DROP TABLE IF EXISTS {}",
                [
                    "",
                    "_dead_letters",
                    "_parked_keys",
                    "_delivered",
                    "_claim_lock",
                    "_migrations"
                ]
                .map(|suffix| self.table(suffix))
                .join(", ")
            ),
        };
        if let Err(error) = sqlx::query(&drop).execute(&self.pool).await {
            eprintln!("chaos: dropping {}: {error}", self.name);
        }
    }
}
