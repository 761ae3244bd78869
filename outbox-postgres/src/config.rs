//! Settings of the PostgreSQL storage.

use std::time::Duration;

use outbox_core::{Error, Result, redact_url};

/// The default of [`PostgresConfig::max_per_key`].
pub const DEFAULT_MAX_PER_KEY: usize = 8;

/// The largest [`PostgresConfig::max_per_key`] accepted.
const MAX_MAX_PER_KEY: usize = 10_000;

/// The default of [`PostgresConfig::shards`].
pub const DEFAULT_SHARDS: u32 = 16;

/// The largest [`PostgresConfig::shards`] accepted.
const MAX_SHARDS: u32 = 1024;

/// How the relay runs an outbox table: `[storage] mode`. A table is migrated for one mode;
/// a relay configured for the other refuses it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageMode {
    /// Claims under fenced leases: an UPDATE per claimed row, then a DELETE (the default).
    #[default]
    Lease,
    /// An append-only log: relays own shards and only read past a stored cursor
    /// `(xid, seq)`, below the oldest running transaction; delivered rows are removed in
    /// bulk by housekeeping.
    Log,
}

impl StorageMode {
    /// The name used in configuration and errors.
    pub fn name(self) -> &'static str {
        match self {
            StorageMode::Lease => "lease",
            StorageMode::Log => "log",
        }
    }
}

/// Settings of the PostgreSQL storage: the `[storage]` section of the relay's file and the
/// Rust API alike. Every key but `url` has a default. `Debug` hides the password in the URL.
#[derive(Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresConfig {
    /// Connection URL, e.g. `postgres://user:password@127.0.0.1:5432/app`.
    pub url: String,
    /// How the table is run (default `lease`); see [`StorageMode`].
    pub mode: StorageMode,
    /// Log mode: the number of shards a new table is made with (default 16, 1 to 1024).
    /// Fixed when the table is created: a relay reads the count from the table.
    pub shards: u32,
    /// Schema of the outbox tables (default `outbox`).
    pub schema: String,
    /// Name of the outbox table (default `outbox`); the dead-letter and other tables are
    /// named after it.
    pub table: String,
    /// Deliver messages that share a partition key in enqueue order (default on).
    pub per_key_order: bool,
    /// With per-key order, the most messages of one key in one claim (default 8). The
    /// worker publishes a key's messages one round after another, so this bounds the rounds
    /// per batch: lower it (2–4) for brokers whose round trip takes milliseconds (Kafka);
    /// each claim then spreads over more keys, which costs the database more.
    pub max_per_key: usize,
    /// Wake the relay with LISTEN/NOTIFY when it is idle (default on); polling remains
    /// the fallback.
    pub wakeup: bool,
    /// Keep delivered messages, with their receipt, for this long; `None` (the default)
    /// deletes them on delivery.
    #[serde(with = "humantime_serde")]
    pub retention: Option<Duration>,
    /// Connections the relay may open (default 4; one is the listener when `wakeup` is on).
    pub max_connections: u32,
    /// How long to wait for a connection before the storage counts as unavailable
    /// (default 5 s).
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(&self.url))
            .field("mode", &self.mode)
            .field("shards", &self.shards)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("per_key_order", &self.per_key_order)
            .field("max_per_key", &self.max_per_key)
            .field("wakeup", &self.wakeup)
            .field("retention", &self.retention)
            .field("max_connections", &self.max_connections)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl Default for PostgresConfig {
    /// The defaults, with no URL (which [`PostgresConfig::validate`] refuses).
    fn default() -> Self {
        PostgresConfig {
            url: String::new(),
            mode: StorageMode::Lease,
            shards: DEFAULT_SHARDS,
            schema: "outbox".into(),
            table: "outbox".into(),
            per_key_order: true,
            max_per_key: DEFAULT_MAX_PER_KEY,
            wakeup: true,
            retention: None,
            max_connections: 4,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl PostgresConfig {
    /// Defaults for the database at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        PostgresConfig {
            url: url.into(),
            ..Self::default()
        }
    }

    /// Reads the settings from a configuration section (the relay's `[storage]` table
    /// without `type`, as JSON) and validates them; errors are keyed by the setting.
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        let config: Self = outbox_core::config::from_value(value)?;
        config.validate()?;
        Ok(config)
    }

    /// Sets the schema and table names.
    pub fn table(mut self, schema: impl Into<String>, table: impl Into<String>) -> Self {
        self.schema = schema.into();
        self.table = table.into();
        self
    }

    /// Checks every setting; the error is keyed by the bad one (the caller places it in its
    /// section with [`Error::in_section`]).
    pub fn validate(&self) -> Result<()> {
        if self.url.is_empty() {
            return Err(Error::setting(
                "url",
                "is missing: give the PostgreSQL URL, e.g. postgres://user@127.0.0.1:5432/app",
            ));
        }
        if !(self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")) {
            return Err(Error::setting(
                "url",
                format!(
                    "`{}` is not a PostgreSQL URL; expected postgres://user:password@host:port/database",
                    redact_url(&self.url)
                ),
            ));
        }
        crate::OutboxTable::new(&self.schema, &self.table)?;
        let min = if self.wakeup { 2 } else { 1 };
        if self.max_connections < min {
            return Err(Error::setting(
                "max_connections",
                format!(
                    "is {}; it must be at least {min} (the wake-up listener holds one)",
                    self.max_connections
                ),
            ));
        }
        if !(1..=MAX_MAX_PER_KEY).contains(&self.max_per_key) {
            return Err(Error::setting(
                "max_per_key",
                format!(
                    "is {}; it must be between 1 and {MAX_MAX_PER_KEY}",
                    self.max_per_key
                ),
            ));
        }
        if !(1..=MAX_SHARDS).contains(&self.shards) {
            return Err(Error::setting(
                "shards",
                format!("is {}; it must be between 1 and {MAX_SHARDS}", self.shards),
            ));
        }
        if self.retention.is_some_and(|r| r.is_zero()) {
            return Err(Error::setting(
                "retention",
                "is 0; leave it unset to delete delivered rows, or give a duration",
            ));
        }
        Ok(())
    }
}
