//! Settings of the PostgreSQL storage.

use std::path::PathBuf;
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Error, Result, redact_url};

pub use outbox_sql::DEFAULT_MAX_PER_KEY;
use outbox_sql::config::{check_max_per_key, check_retention};

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

/// Log mode: where the cursors of a shard start when a relay first takes it (`[storage]
/// start`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogStart {
    /// From the oldest row in the table (the default): nothing written is skipped.
    #[default]
    Oldest,
    /// From now: the first relay to take a shard no relay has owned before sets its cursor
    /// to the horizon of that moment, skipping the rows of every transaction below it
    /// (ended before the oldest transaction then still running began). Rows of transactions
    /// running then, or begun later, are delivered.
    Now,
}

/// Settings of the PostgreSQL storage: the `[storage]` section of the relay's file and the
/// Rust API alike. Every key but `url` has a default. `Debug` hides the password in the URL.
#[derive(Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresConfig {
    /// Connection URL, e.g. `postgres://user:password@127.0.0.1:5432/app`. Its `sslmode`
    /// parameter chooses TLS (`disable`, `allow`, `prefer`, `require`, `verify-ca`,
    /// `verify-full`); without one, `verify-full` when a `tls_*` file is given, else
    /// `PGSSLMODE` from the environment, else sqlx's default `prefer` (TLS when the server
    /// offers it, certificate unchecked).
    pub url: String,
    /// A PEM file of the certificate authorities that sign the server's certificate, trusted
    /// besides the roots built into sqlx (default none). Without `sslmode` in the URL, the
    /// connection is then `verify-full`: the certificate must name the URL's host.
    pub tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate for servers that ask for one (`clientcert` or `cert` in
    /// `pg_hba.conf`), with [`tls_key_file`](Self::tls_key_file) (default none).
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of [`tls_cert_file`](Self::tls_cert_file) (default none).
    pub tls_key_file: Option<PathBuf>,
    /// How the table is run (default `lease`); see [`StorageMode`].
    pub mode: StorageMode,
    /// Log mode: a read replica (a hot standby streaming from the primary of `url`) to read
    /// the rows and the horizon from, e.g. `postgres://relay@replica:5432/app` (default
    /// none: read from `url`). Ownership, cursors, held rows, dead letters and parked keys
    /// stay on the primary; a lagging replica only delays delivery. TLS as for `url`: its
    /// own `sslmode`, the same `tls_*` files.
    pub replica_url: Option<String>,
    /// Log mode: where a shard's cursor starts when a relay first takes it (default
    /// `oldest`); see [`LogStart`].
    pub start: LogStart,
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
    /// Use the wake-up also where the server allows prepared transactions
    /// (`max_prepared_transactions` above 0; default off). PostgreSQL refuses to prepare a
    /// transaction that ran NOTIFY, so by default a relay on such a server never asks
    /// writers to notify, and polls every `poll_interval` while idle: a writer that uses
    /// two-phase commit (XA, a transaction manager) works. Turn it on only when no writer
    /// of this table prepares its transactions.
    pub wakeup_with_prepared_transactions: bool,
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
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("mode", &self.mode)
            .field("replica_url", &self.replica_url.as_deref().map(redact_url))
            .field("start", &self.start)
            .field("shards", &self.shards)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("per_key_order", &self.per_key_order)
            .field("max_per_key", &self.max_per_key)
            .field("wakeup", &self.wakeup)
            .field(
                "wakeup_with_prepared_transactions",
                &self.wakeup_with_prepared_transactions,
            )
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
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            mode: StorageMode::Lease,
            replica_url: None,
            start: LogStart::Oldest,
            shards: DEFAULT_SHARDS,
            schema: "outbox".into(),
            table: "outbox".into(),
            per_key_order: true,
            max_per_key: DEFAULT_MAX_PER_KEY,
            wakeup: true,
            wakeup_with_prepared_transactions: false,
            retention: None,
            max_connections: 4,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl Settings for PostgresConfig {
    /// Checks every setting; the error is keyed by the bad one (the caller places it in its
    /// section with [`Error::in_section`]).
    fn validate(&self) -> Result<()> {
        check_url("url", &self.url)?;
        self.validate_tls("url", &self.url)?;
        if let Some(replica) = &self.replica_url {
            check_url("replica_url", replica)?;
            self.validate_tls("replica_url", replica)?;
        }
        if self.mode != StorageMode::Log {
            let log_only = if self.replica_url.is_some() {
                Some("replica_url")
            } else if self.start != LogStart::Oldest {
                Some("start")
            } else {
                None
            };
            if let Some(key) = log_only {
                return Err(Error::setting(
                    key,
                    "applies to log mode only: add mode = \"log\" (for a new table) or remove it",
                ));
            }
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
        check_max_per_key(self.max_per_key)?;
        if !(1..=MAX_SHARDS).contains(&self.shards) {
            return Err(Error::setting(
                "shards",
                format!("is {}; it must be between 1 and {MAX_SHARDS}", self.shards),
            ));
        }
        check_retention(self.retention)
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

    /// Whether any of the `tls_*` files is given.
    pub(crate) fn has_tls_files(&self) -> bool {
        self.tls_ca_file.is_some() || self.tls_cert_file.is_some() || self.tls_key_file.is_some()
    }

    /// The `sslmode` of `url` (the setting `key`) and the `tls_*` files: files that exist, a
    /// certificate with its key, each given once, and a mode that uses them.
    fn validate_tls(&self, key: &str, url: &str) -> Result<()> {
        let mode = ssl_mode(url);
        if let Some(mode) = &mode
            && !SSL_MODES.contains(&mode.as_str())
        {
            return Err(Error::setting(
                key,
                format!(
                    "has sslmode={mode}; expected one of {}",
                    SSL_MODES.join(", ")
                ),
            ));
        }
        // The names sqlx reads from the URL for the same files.
        let files = [
            (
                "tls_ca_file",
                &self.tls_ca_file,
                &["sslrootcert", "ssl-root-cert", "ssl-ca"][..],
            ),
            (
                "tls_cert_file",
                &self.tls_cert_file,
                &["sslcert", "ssl-cert"],
            ),
            ("tls_key_file", &self.tls_key_file, &["sslkey", "ssl-key"]),
        ];
        for (file_key, file, url_names) in files {
            if file.is_none() {
                continue;
            }
            if let Some(name) = url_names
                .iter()
                .find(|name| url_param(url, &[name]).is_some())
            {
                return Err(Error::setting(
                    file_key,
                    format!("is also given in the {key} as {name}; keep one of them"),
                ));
            }
        }
        outbox_core::config::check_tls_files(
            self.tls_ca_file.as_deref(),
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
        )?;
        let Some((file_key, _, _)) = files.iter().find(|(_, file, _)| file.is_some()) else {
            return Ok(());
        };
        match mode.as_deref() {
            None | Some("verify-full" | "verify-ca") => Ok(()),
            // A client certificate over TLS whose server is not checked is the URL's choice.
            Some("require") if self.tls_ca_file.is_none() => Ok(()),
            // sqlx checks no certificate with `require`: the CA file would be ignored.
            Some("require") => Err(Error::setting(
                "tls_ca_file",
                format!(
                    "is not used with sslmode=require, which checks no certificate: write \
                     sslmode=verify-full (or verify-ca) in the {key}, or leave sslmode out for \
                     verify-full"
                ),
            )),
            Some(mode) => Err(Error::setting(
                file_key,
                format!(
                    "needs TLS, but the {key} says sslmode={mode}, which does not insist on it: \
                     leave sslmode out (TLS files then mean verify-full) or write sslmode=verify-full"
                ),
            )),
        }
    }
}

outbox_core::setters!(PostgresConfig {
    /// Sets the schema and table names.
    table(schema: impl Into<String>, table: impl Into<String>) => schema = schema.into(),
        table = table.into();
});

/// A PostgreSQL URL is given in `key`.
fn check_url(key: &str, url: &str) -> Result<()> {
    if url.is_empty() {
        return Err(Error::setting(
            key,
            "is missing: give the PostgreSQL URL, e.g. postgres://user@127.0.0.1:5432/app",
        ));
    }
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(Error::setting(
            key,
            format!(
                "`{}` is not a PostgreSQL URL; expected postgres://user:password@host:port/database",
                redact_url(url)
            ),
        ));
    }
    Ok(())
}

/// The `sslmode` that `url` names, lower-cased, if it names one.
pub(crate) fn ssl_mode(url: &str) -> Option<String> {
    url_param(url, &["sslmode", "ssl-mode"]).map(|mode| mode.to_ascii_lowercase())
}

/// The `sslmode` values sqlx accepts.
const SSL_MODES: [&str; 6] = [
    "disable",
    "allow",
    "prefer",
    "require",
    "verify-ca",
    "verify-full",
];

/// The value of the last query parameter of `url` named one of `names` (the last one wins,
/// as in sqlx), not percent-decoded.
fn url_param<'a>(url: &'a str, names: &[&str]) -> Option<&'a str> {
    let (_, query) = url.split_once('?')?;
    let query = query.split('#').next().unwrap_or(query);
    query.split('&').rev().find_map(|pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        names.contains(&name).then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that exists wherever the tests run.
    const FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");

    fn with_ca(url: &str) -> PostgresConfig {
        PostgresConfig {
            tls_ca_file: Some(FILE.into()),
            ..PostgresConfig::new(url)
        }
    }

    fn with_client_cert(url: &str) -> PostgresConfig {
        PostgresConfig {
            tls_cert_file: Some(FILE.into()),
            tls_key_file: Some(FILE.into()),
            ..PostgresConfig::new(url)
        }
    }

    fn refused(config: PostgresConfig) -> String {
        let error = config.validate().expect_err("refused");
        assert_eq!(error.kind(), outbox_core::ErrorKind::Config, "{error}");
        error.in_section("storage").to_string()
    }

    #[test]
    fn tls_files_are_read_from_the_section() {
        let config = PostgresConfig::from_value(serde_json::json!({
            "url": "postgres://app@db.example.com/app",
            "tls_ca_file": FILE,
            "tls_cert_file": FILE,
            "tls_key_file": FILE,
        }))
        .unwrap();
        assert_eq!(config.tls_ca_file, Some(PathBuf::from(FILE)));
        assert!(config.has_tls_files());
        assert_eq!(ssl_mode(&config.url), None);
        assert!(!PostgresConfig::new("postgres://app@db/app").has_tls_files());
    }

    #[test]
    fn tls_files_go_with_the_modes_that_use_them() {
        for mode in ["", "?sslmode=verify-full", "?sslmode=VERIFY-CA"] {
            with_ca(&format!("postgres://app@db/app{mode}"))
                .validate()
                .unwrap();
            with_client_cert(&format!("postgres://app@db/app{mode}"))
                .validate()
                .unwrap();
        }
        // A client certificate to a server the URL chooses not to check.
        with_client_cert("postgres://app@db/app?sslmode=require")
            .validate()
            .unwrap();
        let error = refused(with_ca("postgres://app@db/app?sslmode=require"));
        assert!(
            error.contains("storage.tls_ca_file") && error.contains("sslmode=require"),
            "{error}"
        );
        for mode in ["disable", "allow", "prefer"] {
            let error = refused(with_client_cert(&format!(
                "postgres://app@db/app?application_name=x&sslmode={mode}"
            )));
            assert!(
                error.contains("storage.tls_cert_file needs TLS")
                    && error.contains(&format!("sslmode={mode}"))
                    && error.contains("verify-full"),
                "{error}"
            );
        }
        // Without TLS files any mode is the URL's business.
        PostgresConfig::new("postgres://app@db/app?sslmode=disable")
            .validate()
            .unwrap();
    }

    #[test]
    fn an_unknown_sslmode_is_refused() {
        let error = refused(PostgresConfig::new(
            "postgres://app:hunter2@db/app?sslmode=verify",
        ));
        assert!(
            error.contains("storage.url has sslmode=verify") && error.contains("verify-full"),
            "{error}"
        );
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn a_certificate_needs_its_key() {
        let config = PostgresConfig {
            tls_cert_file: Some(FILE.into()),
            ..PostgresConfig::new("postgres://app@db/app")
        };
        let error = refused(config);
        assert!(
            error.contains("storage.tls_cert_file and tls_key_file go together"),
            "{error}"
        );
        let config = PostgresConfig {
            tls_key_file: Some(FILE.into()),
            ..PostgresConfig::new("postgres://app@db/app")
        };
        assert!(refused(config).contains("tls_key_file"));
    }

    #[test]
    fn a_missing_file_is_named() {
        let config = PostgresConfig {
            tls_ca_file: Some("/nowhere/ca.pem".into()),
            ..PostgresConfig::new("postgres://app@db/app")
        };
        let error = refused(config);
        assert!(
            error.contains("storage.tls_ca_file `/nowhere/ca.pem` cannot be read"),
            "{error}"
        );
    }

    #[test]
    fn a_file_given_in_the_url_too_is_refused() {
        let error = refused(with_ca(
            "postgres://app@db/app?sslmode=verify-full&sslrootcert=/etc/ca.pem",
        ));
        assert!(
            error.contains("storage.tls_ca_file is also given in the url as sslrootcert"),
            "{error}"
        );
        let error = refused(with_client_cert("postgres://app@db/app?ssl-key=/k.pem"));
        assert!(
            error.contains("storage.tls_key_file is also given in the url as ssl-key"),
            "{error}"
        );
    }

    #[test]
    fn debug_names_the_files_and_hides_the_password() {
        let text = format!("{:?}", with_ca("postgres://app:hunter2@db/app"));
        assert!(!text.contains("hunter2"), "{text}");
        assert!(
            text.contains("tls_ca_file") && text.contains(FILE),
            "{text}"
        );
    }

    #[test]
    fn the_replica_url_is_checked_like_the_url() {
        let log = |replica: &str| PostgresConfig {
            mode: StorageMode::Log,
            replica_url: Some(replica.into()),
            ..PostgresConfig::new("postgres://app@db/app")
        };
        log("postgres://app@replica/app").validate().unwrap();
        let error = refused(log("mysql://app:hunter2@replica/app"));
        assert!(
            error.contains(
                "storage.replica_url `mysql://app:***@replica/app` is not a PostgreSQL URL"
            ) || (error.contains("storage.replica_url") && error.contains("not a PostgreSQL URL")),
            "{error}"
        );
        assert!(!error.contains("hunter2"), "{error}");
        let error = refused(log("postgres://app@replica/app?sslmode=verify"));
        assert!(
            error.contains("storage.replica_url has sslmode=verify"),
            "{error}"
        );
        // The TLS files serve both connections: the replica's URL must insist on TLS too.
        let config = PostgresConfig {
            tls_ca_file: Some(FILE.into()),
            ..log("postgres://app@replica/app?sslmode=prefer")
        };
        let error = refused(config);
        assert!(
            error
                .contains("storage.tls_ca_file needs TLS, but the replica_url says sslmode=prefer"),
            "{error}"
        );
        let text = format!("{:?}", log("postgres://app:hunter2@replica/app"));
        assert!(
            !text.contains("hunter2") && text.contains("replica"),
            "{text}"
        );
    }

    #[test]
    fn log_settings_are_refused_in_lease_mode() {
        let config = PostgresConfig {
            replica_url: Some("postgres://app@replica/app".into()),
            ..PostgresConfig::new("postgres://app@db/app")
        };
        assert!(refused(config).contains("storage.replica_url applies to log mode only"));
        let config = PostgresConfig::from_value(serde_json::json!({
            "url": "postgres://app@db/app", "start": "now",
        }));
        let error = config
            .expect_err("refused")
            .in_section("storage")
            .to_string();
        assert!(
            error.contains("storage.start applies to log mode only"),
            "{error}"
        );
        let config = PostgresConfig::from_value(serde_json::json!({
            "url": "postgres://app@db/app", "mode": "log", "start": "now",
        }))
        .unwrap();
        assert_eq!(config.start, LogStart::Now);
        let error = PostgresConfig::from_value(serde_json::json!({
            "url": "postgres://app@db/app", "mode": "log", "start": "newest",
        }))
        .expect_err("refused")
        .to_string();
        assert!(error.contains("start"), "{error}");
    }

    #[test]
    fn url_params_are_found_by_name() {
        let url = "postgres://u@h/d?a=1&sslmode=require&b&sslmode=verify-ca#frag";
        assert_eq!(url_param(url, &["sslmode"]), Some("verify-ca"));
        assert_eq!(url_param(url, &["b"]), Some(""));
        assert_eq!(url_param(url, &["c"]), None);
        assert_eq!(url_param("postgres://u@h/d", &["sslmode"]), None);
    }
}
