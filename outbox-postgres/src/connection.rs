//! The relay's connection pool.

use outbox_core::{Error, Result};
use sqlx::Executor;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgSslMode};

use crate::PostgresConfig;
use crate::sql::SESSION_SETTINGS;

/// The pool for `config`, whose connections run with [`SESSION_SETTINGS`]. Connects lazily,
/// so a database that is down shows up as an `Unavailable` error from the first call.
pub(crate) fn pool(config: &PostgresConfig) -> Result<PgPool> {
    let options: PgConnectOptions = config.url.parse().map_err(|e: sqlx::Error| {
        Error::config(format!(
            "storage.url `{}` cannot be parsed: {e}",
            outbox_core::redact_url(&config.url)
        ))
    })?;
    let options = tls(options.application_name("outbox-relay"), config);
    Ok(PgPoolOptions::new()
        .max_connections(config.max_connections)
        .acquire_timeout(config.connect_timeout)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(SESSION_SETTINGS).await?;
                Ok(())
            })
        })
        .connect_lazy_with(options))
}

/// Applies the `tls_*` files of `config`. sqlx reads them at each new connection, so renewed
/// files are used without a restart.
fn tls(mut options: PgConnectOptions, config: &PostgresConfig) -> PgConnectOptions {
    if let Some(ca) = &config.tls_ca_file {
        options = options.ssl_root_cert(ca);
    }
    if let (Some(cert), Some(key)) = (&config.tls_cert_file, &config.tls_key_file) {
        options = options.ssl_client_cert(cert).ssl_client_key(key);
    }
    // Files for TLS mean a checked server unless the URL says otherwise (sqlx's own default,
    // `prefer`, checks nothing and may fall back to a plain connection).
    if config.has_tls_files() && config.url_ssl_mode().is_none() {
        options = options.ssl_mode(PgSslMode::VerifyFull);
    }
    options
}
