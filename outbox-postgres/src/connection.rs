//! The relay's connection pool.

use outbox_core::{Error, Result};
use sqlx::Executor;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgSslMode};

use crate::PostgresConfig;
use crate::sql::SESSION_SETTINGS;

/// The pool for `config`, whose connections run with [`SESSION_SETTINGS`]. Connects lazily,
/// so a database that is down shows up as an `Unavailable` error from the first call.
pub(crate) fn pool(config: &PostgresConfig) -> Result<PgPool> {
    pool_for(config, "url", &config.url, config.max_connections)
}

/// Log mode: the pool of `replica_url`, if one is set. It runs one relay's reads, one at a
/// time: two connections are plenty.
pub(crate) fn replica_pool(config: &PostgresConfig) -> Result<Option<PgPool>> {
    config
        .replica_url
        .as_deref()
        .map(|url| pool_for(config, "replica_url", url, 2))
        .transpose()
}

/// A pool for `url` (the setting `key`) with the TLS settings of `config`.
fn pool_for(config: &PostgresConfig, key: &str, url: &str, size: u32) -> Result<PgPool> {
    let options: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| {
        Error::config(format!(
            "storage.{key} `{}` cannot be parsed: {e}",
            outbox_core::redact_url(url)
        ))
    })?;
    let options = tls(
        options.application_name("outbox-relay"),
        config,
        crate::config::ssl_mode(url).is_none(),
    );
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(config.connect_timeout)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(SESSION_SETTINGS).await?;
                Ok(())
            })
        })
        .connect_lazy_with(options))
}

/// Applies the `tls_*` files of `config` to a URL that names no `sslmode` when `no_mode`.
/// sqlx reads them at each new connection, so renewed files are used without a restart.
fn tls(mut options: PgConnectOptions, config: &PostgresConfig, no_mode: bool) -> PgConnectOptions {
    if let Some(ca) = &config.tls_ca_file {
        options = options.ssl_root_cert(ca);
    }
    if let (Some(cert), Some(key)) = (&config.tls_cert_file, &config.tls_key_file) {
        options = options.ssl_client_cert(cert).ssl_client_key(key);
    }
    // Files for TLS mean a checked server unless the URL says otherwise (sqlx's own default,
    // `prefer`, checks nothing and may fall back to a plain connection).
    if config.has_tls_files() && no_mode {
        options = options.ssl_mode(PgSslMode::VerifyFull);
    }
    options
}
