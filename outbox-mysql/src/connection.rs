//! The relay's connection pool.

use std::time::Duration;

use outbox_core::Result;
use sqlx::Executor;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

use crate::MySqlConfig;
use crate::sql::READ_COMMITTED;

/// The pool for `config`. Connects lazily. Every connection runs its transactions at READ
/// COMMITTED (each statement reads the latest commits, and searches take no gap locks, so a
/// claim never blocks an application's INSERT), and waits for a row lock at most
/// `lock_wait_timeout`. sqlx sets the session's `time_zone` to UTC, which the DATETIME
/// columns assume.
pub(crate) fn pool(config: &MySqlConfig) -> Result<MySqlPool> {
    let options = config.options()?;
    let lock_wait = config.lock_wait_timeout.as_secs().max(1);
    Ok(MySqlPoolOptions::new()
        .max_connections(config.max_connections)
        .acquire_timeout(config.connect_timeout)
        .idle_timeout(Some(Duration::from_secs(600)))
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(READ_COMMITTED).await?;
                conn.execute(
                    format!("SET SESSION innodb_lock_wait_timeout = {lock_wait}").as_str(),
                )
                .await?;
                Ok(())
            })
        })
        .connect_lazy_with(options))
}
