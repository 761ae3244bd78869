//! Settings of the MySQL / MariaDB storage.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::{Error, Result, redact_url};
use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};

pub use outbox_sql::DEFAULT_MAX_PER_KEY;
use outbox_sql::config::{check_max_connections, check_max_per_key, check_retention};

/// Settings of the MySQL / MariaDB storage: the `[storage]` section of the relay's file and
/// the Rust API alike. Every key but `url` has a default. `Debug` hides the password in the
/// URL.
#[derive(Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MySqlConfig {
    /// Connection URL, e.g. `mysql://user:password@127.0.0.1:3306/app` (`mariadb://` works
    /// too). Its `ssl-mode` parameter (`DISABLED`, `PREFERRED`, the default, `REQUIRED`,
    /// `VERIFY_CA`, `VERIFY_IDENTITY`) says whether and how TLS is used.
    pub url: String,
    /// A PEM file of the certificate authorities that sign the server's certificate, trusted
    /// besides the public roots built into the binary (default none). Any of the `tls_*`
    /// files turns on a verified connection: without `ssl-mode` in the URL the connection is
    /// `VERIFY_IDENTITY` (certificate chain and host name checked).
    pub tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate, for a user created `REQUIRE X509` (or `REQUIRE SUBJECT …`),
    /// with [`tls_key_file`](Self::tls_key_file) (default none).
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of [`tls_cert_file`](Self::tls_cert_file) (default none).
    pub tls_key_file: Option<PathBuf>,
    /// The database that holds the outbox tables; default: the one the URL names.
    pub database: Option<String>,
    /// Name of the outbox table (default `outbox`); the dead-letter and other tables are
    /// named after it.
    pub table: String,
    /// Deliver messages that share a partition key in enqueue order (default on).
    pub per_key_order: bool,
    /// With per-key order, the most messages of one key in one claim (default 8): the
    /// worker publishes a key's messages one round after another, so this bounds the rounds
    /// per batch.
    pub max_per_key: usize,
    /// Keep delivered messages, with their receipt, for this long; `None` (the default)
    /// deletes them on delivery.
    #[serde(with = "humantime_serde")]
    pub retention: Option<Duration>,
    /// Connections the relay may open (default 4).
    pub max_connections: u32,
    /// How long to wait for a connection before the storage counts as unavailable
    /// (default 5 s).
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How long a statement of the relay waits for a row lock another transaction holds
    /// (the session's `innodb_lock_wait_timeout`, whole seconds, default 10 s).
    #[serde(with = "humantime_serde")]
    pub lock_wait_timeout: Duration,
}

impl std::fmt::Debug for MySqlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlConfig")
            .field("url", &redact_url(&self.url))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("database", &self.database)
            .field("table", &self.table)
            .field("per_key_order", &self.per_key_order)
            .field("max_per_key", &self.max_per_key)
            .field("retention", &self.retention)
            .field("max_connections", &self.max_connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("lock_wait_timeout", &self.lock_wait_timeout)
            .finish()
    }
}

impl Default for MySqlConfig {
    /// The defaults, with no URL (which [`MySqlConfig::validate`] refuses).
    fn default() -> Self {
        MySqlConfig {
            url: String::new(),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            database: None,
            table: "outbox".into(),
            per_key_order: true,
            max_per_key: DEFAULT_MAX_PER_KEY,
            retention: None,
            max_connections: 4,
            connect_timeout: Duration::from_secs(5),
            lock_wait_timeout: Duration::from_secs(10),
        }
    }
}

impl Settings for MySqlConfig {
    /// Checks every setting; the error is keyed by the bad one (the caller places it in its
    /// section with [`Error::in_section`]). It does not connect.
    fn validate(&self) -> Result<()> {
        self.options()?;
        let (database, key) = self.database_name()?;
        crate::OutboxTable::new(&database, &self.table).map_err(|e| {
            if e.message().starts_with("database ") && key == "url" {
                Error::setting(
                    "url",
                    format!("names the database {}", &e.message()["database ".len()..]),
                )
            } else {
                e
            }
        })?;
        check_max_connections(self.max_connections)?;
        check_max_per_key(self.max_per_key)?;
        check_retention(self.retention)?;
        if self.connect_timeout.is_zero() {
            return Err(Error::setting("connect_timeout", "is 0; give e.g. 5s"));
        }
        if !(1..=3600).contains(&self.lock_wait_timeout.as_secs()) {
            return Err(Error::setting(
                "lock_wait_timeout",
                "must be between 1s and 1h (InnoDB counts it in whole seconds)",
            ));
        }
        Ok(())
    }
}

impl MySqlConfig {
    /// Defaults for the database at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        MySqlConfig {
            url: url.into(),
            ..Self::default()
        }
    }

    /// The parsed URL with the TLS files applied; errors keyed by the setting, the password
    /// hidden.
    pub(crate) fn options(&self) -> Result<MySqlConnectOptions> {
        if self.url.is_empty() {
            return Err(Error::setting(
                "url",
                "is missing: give the MySQL URL, e.g. mysql://user:password@127.0.0.1:3306/app",
            ));
        }
        if !(self.url.starts_with("mysql://") || self.url.starts_with("mariadb://")) {
            return Err(Error::setting(
                "url",
                format!(
                    "`{}` is not a MySQL URL; expected mysql://user:password@host:port/database",
                    redact_url(&self.url)
                ),
            ));
        }
        let options = MySqlConnectOptions::from_str(&self.url).map_err(|e| {
            Error::setting(
                "url",
                format!("`{}` cannot be parsed: {e}", redact_url(&self.url)),
            )
        })?;
        self.with_tls_files(options)
    }

    /// Applies the `tls_*` files. They ask for a verified connection, so the URL's `ssl-mode`
    /// must not let the connection go without TLS (`DISABLED`, `PREFERRED`) or without
    /// checking the CA it names (`REQUIRED`); with no `ssl-mode` it becomes
    /// `VERIFY_IDENTITY`.
    fn with_tls_files(&self, mut options: MySqlConnectOptions) -> Result<MySqlConnectOptions> {
        let files = [
            ("tls_ca_file", &self.tls_ca_file, ["ssl-ca", "sslca"]),
            (
                "tls_cert_file",
                &self.tls_cert_file,
                ["ssl-cert", "sslcert"],
            ),
            ("tls_key_file", &self.tls_key_file, ["ssl-key", "sslkey"]),
        ];
        let Some(first) = files.iter().find(|f| f.1.is_some()).map(|f| f.0) else {
            return Ok(options);
        };
        let params = query_keys(&self.url);
        for (key, file, url_keys) in files {
            if file.is_none() {
                continue;
            }
            if let Some(url_key) = url_keys.iter().find(|k| params.contains(k)) {
                return Err(Error::setting(
                    key,
                    format!(
                        "is set and the url has `{url_key}` too; give the file in one place \
                         (drop `{url_key}` from the url)"
                    ),
                ));
            }
        }
        outbox_core::config::check_tls_files(
            self.tls_ca_file.as_deref(),
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
        )?;
        let mode_given = params.iter().any(|k| *k == "ssl-mode" || *k == "sslmode");
        match options.get_ssl_mode() {
            _ if !mode_given => options = options.ssl_mode(MySqlSslMode::VerifyIdentity),
            mode @ (MySqlSslMode::Disabled | MySqlSslMode::Preferred) => {
                let name = if matches!(mode, MySqlSslMode::Disabled) {
                    "DISABLED"
                } else {
                    "PREFERRED"
                };
                return Err(Error::setting(
                    first,
                    format!(
                        "needs TLS, but the url's ssl-mode={name} lets the connection go \
                         without it; drop ssl-mode from the url (the TLS files then mean \
                         VERIFY_IDENTITY) or write ssl-mode=VERIFY_IDENTITY"
                    ),
                ));
            }
            MySqlSslMode::Required if self.tls_ca_file.is_some() => {
                return Err(Error::setting(
                    "tls_ca_file",
                    "would not be used: the url's ssl-mode=REQUIRED does not check the \
                     server's certificate; drop ssl-mode from the url or write \
                     ssl-mode=VERIFY_IDENTITY (or VERIFY_CA)",
                ));
            }
            _ => {}
        }
        if let Some(file) = &self.tls_ca_file {
            options = options.ssl_ca(file);
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert_file, &self.tls_key_file) {
            options = options.ssl_client_cert(cert).ssl_client_key(key);
        }
        Ok(options)
    }

    /// The database of the outbox tables and the setting that names it.
    pub(crate) fn database_name(&self) -> Result<(String, &'static str)> {
        if let Some(database) = &self.database {
            return Ok((database.clone(), "database"));
        }
        match self.options()?.get_database() {
            Some(database) if !database.is_empty() => Ok((database.to_string(), "url")),
            _ => Err(Error::setting(
                "database",
                "is missing: name the database in `url` (mysql://…:3306/app) or set `database`",
            )),
        }
    }
}

outbox_core::setters!(MySqlConfig {
    /// Sets the table name.
    table(table: impl Into<String>) => table = table.into();
    /// Trusts the certificate authorities in `ca_file` (PEM) and presents the client
    /// certificate `cert_file` with its key `key_file`; see [`tls_ca_file`](Self::tls_ca_file).
    tls(ca_file: impl Into<PathBuf>, cert_file: impl Into<PathBuf>, key_file: impl Into<PathBuf>)
        => tls_ca_file = Some(ca_file.into()),
        tls_cert_file = Some(cert_file.into()),
        tls_key_file = Some(key_file.into());
});

/// The names of the URL's query parameters (`ssl-mode`, `ssl-ca`, …), as written.
fn query_keys(url: &str) -> Vec<&str> {
    let Some((_, query)) = url.split_once('?') else {
        return Vec::new();
    };
    let query = query.split('#').next().unwrap_or_default();
    query
        .split('&')
        .map(|pair| pair.split('=').next().unwrap_or_default())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_keyed_errors() {
        let url = "mysql://root:secret@127.0.0.1:3306/app";
        let config = MySqlConfig::from_value(serde_json::json!({ "url": url })).unwrap();
        assert_eq!(config, MySqlConfig::new(url));
        assert_eq!(config.database_name().unwrap(), ("app".to_string(), "url"));
        assert!(!format!("{config:?}").contains("secret"));
        let config = MySqlConfig::from_value(serde_json::json!({
            "url": "mariadb://u@h/x", "database": "events_db", "table": "events",
            "per_key_order": false, "max_per_key": 2, "retention": "1h",
            "max_connections": 2, "connect_timeout": "2s", "lock_wait_timeout": "3s"
        }))
        .unwrap();
        assert_eq!(
            config.database_name().unwrap(),
            ("events_db".to_string(), "database")
        );
        assert_eq!(config.retention, Some(Duration::from_secs(3600)));
        for (value, expected) in [
            (serde_json::json!({}), "url is missing"),
            (
                serde_json::json!({ "url": "postgres://u:pw@h/db" }),
                "url `postgres://u:***@h/db` is not a MySQL URL",
            ),
            (
                serde_json::json!({ "url": "mysql://u@h" }),
                "database is missing",
            ),
            (
                serde_json::json!({ "url": "mysql://u@h/Bad-Db" }),
                "url names the database `Bad-Db`",
            ),
            (
                serde_json::json!({ "url": url, "database": "x;drop" }),
                "database `x;drop`",
            ),
            (
                serde_json::json!({ "url": url, "table": "Bad-Name" }),
                "table `Bad-Name`",
            ),
            (
                serde_json::json!({ "url": url, "max_per_key": 0 }),
                "max_per_key is 0",
            ),
            (
                serde_json::json!({ "url": url, "max_connections": 0 }),
                "max_connections is 0",
            ),
            (
                serde_json::json!({ "url": url, "retention": "0s" }),
                "retention is 0",
            ),
            (
                serde_json::json!({ "url": url, "lock_wait_timeout": "100ms" }),
                "lock_wait_timeout must be",
            ),
            (
                serde_json::json!({ "url": url, "path": "x" }),
                "path: unknown field `path`",
            ),
        ] {
            let error = MySqlConfig::from_value(value.clone())
                .unwrap_err()
                .in_section("storage");
            assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
            assert!(
                error.message().starts_with(&format!("storage.{expected}")),
                "{value}: {error}"
            );
            assert!(!error.message().contains("secret"));
        }
    }

    #[test]
    fn tls_files_ask_for_a_verified_connection() {
        let readable = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let url = "mysql://app:secret@db:3306/app";
        let tls = |url: &str| MySqlConfig::new(url).tls(readable, readable, readable);
        // Without ssl-mode, TLS files mean VERIFY_IDENTITY; an explicit verifying mode stays.
        let mode = |config: MySqlConfig| config.options().unwrap().get_ssl_mode();
        assert!(matches!(mode(tls(url)), MySqlSslMode::VerifyIdentity));
        assert!(matches!(
            mode(tls(&format!("{url}?ssl-mode=VERIFY_CA"))),
            MySqlSslMode::VerifyCa
        ));
        let client_only = MySqlConfig {
            tls_cert_file: Some(readable.into()),
            tls_key_file: Some(readable.into()),
            ..MySqlConfig::new(format!("{url}?ssl-mode=required"))
        };
        assert!(matches!(mode(client_only), MySqlSslMode::Required));
        // No TLS files: the URL decides alone, as before.
        assert!(matches!(
            mode(MySqlConfig::new(url)),
            MySqlSslMode::Preferred
        ));
        for (config, expected) in [
            (
                tls(&format!("{url}?ssl-mode=DISABLED")),
                "tls_ca_file needs TLS, but the url's ssl-mode=DISABLED",
            ),
            (
                MySqlConfig {
                    tls_cert_file: Some(readable.into()),
                    tls_key_file: Some(readable.into()),
                    ..MySqlConfig::new(format!("{url}?sslmode=preferred"))
                },
                "tls_cert_file needs TLS, but the url's ssl-mode=PREFERRED",
            ),
            (
                tls(&format!("{url}?ssl-mode=REQUIRED")),
                "tls_ca_file would not be used: the url's ssl-mode=REQUIRED",
            ),
            (
                tls(&format!("{url}?ssl-mode=VERIFY_CA&ssl-ca=/etc/ca.pem")),
                "tls_ca_file is set and the url has `ssl-ca` too",
            ),
            (
                MySqlConfig {
                    tls_key_file: None,
                    ..tls(url)
                },
                "tls_cert_file and tls_key_file go together",
            ),
            (
                MySqlConfig {
                    tls_ca_file: Some("/nowhere/ca.pem".into()),
                    ..MySqlConfig::new(url)
                },
                "tls_ca_file `/nowhere/ca.pem` cannot be read",
            ),
        ] {
            let error = config.validate().unwrap_err().in_section("storage");
            assert_eq!(error.kind(), outbox_core::ErrorKind::Config);
            assert!(
                error.message().starts_with(&format!("storage.{expected}")),
                "{error}"
            );
            assert!(!error.message().contains("secret"), "{error}");
        }
        // The keys read from the relay's file.
        let config = MySqlConfig::from_value(serde_json::json!({
            "url": url, "tls_ca_file": readable, "tls_cert_file": readable,
            "tls_key_file": readable
        }))
        .unwrap();
        assert_eq!(config, tls(url));
    }
}
