//! The relay's connection pool.

use outbox_core::{Error, Result};
use sqlx::Executor;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

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
    let options = options.application_name("outbox-relay");
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
