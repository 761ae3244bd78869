//! The wake-up: an idle relay sleeps until a writer's commit notifies it (LISTEN/NOTIFY), a
//! busy one polls again shortly. Where the server allows prepared transactions it is off
//! unless configured (a transaction that ran NOTIFY cannot be prepared). Writers notify only while a relay has said it is idle
//! (the `<table>_wakeup` flag, read by the trigger the migrations install; see `sql.rs`),
//! because notifying commits are serialised cluster-wide: a busy relay costs writers
//! nothing. Polling remains the fallback when the listener cannot run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_core::{Error, Result};
use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::{Notify, OnceCell};
use tokio::task::JoinHandle;

use crate::OutboxTable;
use crate::error::db_error;
use crate::sql::WakeupStatements;

/// How soon a relay whose last claim found messages claims again.
const BUSY_POLL: Duration = Duration::from_millis(2);

/// The wake-up state of one storage: [`Wakeup::claimed`] after every claim,
/// [`Wakeup::wait`] for `Storage::wait_for_work`.
pub(crate) struct Wakeup {
    /// `PostgresConfig::wakeup`: off, an idle relay only polls.
    enabled: bool,
    /// `PostgresConfig::wakeup_with_prepared_transactions`.
    despite_prepared: bool,
    /// The LISTEN/NOTIFY channel the table's trigger notifies on.
    channel: String,
    sql: WakeupStatements,
    /// Signalled by the listener task on each notification.
    notify: Arc<Notify>,
    /// The listener task, started on the first idle wait.
    listener: OnceCell<JoinHandle<()>>,
    /// Whether the server allows prepared transactions (two-phase commit), read on the
    /// first idle wait: then, unless `despite_prepared`, this relay never asks writers to
    /// notify (PostgreSQL refuses to prepare a transaction that ran NOTIFY) and only polls.
    two_phase: OnceCell<bool>,
    /// Whether this storage told writers to notify (its last claim found nothing).
    armed: AtomicBool,
    /// Whether the last claim found messages: then more are likely on their way, and the
    /// relay polls again shortly instead of asking writers to notify.
    busy: AtomicBool,
}

impl Wakeup {
    pub(crate) fn new(enabled: bool, despite_prepared: bool, table: &OutboxTable) -> Self {
        Wakeup {
            enabled,
            despite_prepared,
            channel: table.channel(),
            sql: WakeupStatements::new(table),
            notify: Arc::new(Notify::new()),
            listener: OnceCell::new(),
            two_phase: OnceCell::new(),
            armed: AtomicBool::new(false),
            busy: AtomicBool::new(false),
        }
    }

    /// Records whether a claim found messages. Idle to busy: writers need not notify until
    /// a claim comes back empty again. Any relay clears the flag (another relay may have set
    /// it); a no-op when already clear.
    pub(crate) async fn claimed(&self, pool: &PgPool, found: bool) -> Result<()> {
        let was_busy = self.busy.swap(found, Ordering::SeqCst);
        if found && !was_busy && self.enabled {
            self.armed.store(false, Ordering::SeqCst);
            sqlx::query(&self.sql.disarm)
                .execute(pool)
                .await
                .map_err(|e| db_error("cannot disarm the wake-up", e))?;
        }
        Ok(())
    }

    /// Resolves when new messages may be due: soon while busy; when idle, once writers have
    /// been told to notify, on a notification (never, without a listener).
    pub(crate) async fn wait(&self, pool: &PgPool) -> Result<()> {
        if self.busy.load(Ordering::SeqCst) {
            // The last claim found messages: under a steady load, look again soon rather
            // than make every writer's commit notify.
            tokio::time::sleep(BUSY_POLL).await;
            return Ok(());
        }
        if !self.enabled
            || self.writers_must_not_notify(pool).await?
            || !self.ensure_listener(pool).await
        {
            return std::future::pending().await;
        }
        if !self.armed.swap(true, Ordering::SeqCst) {
            sqlx::query(&self.sql.arm)
                .execute(pool)
                .await
                .map_err(|e| db_error("cannot arm the wake-up", e))?;
            // Rows committed before writers knew to notify: look once more before sleeping.
            return Ok(());
        }
        self.notify.notified().await;
        Ok(())
    }

    /// Whether writers must not be asked to notify: the server allows prepared
    /// transactions and the configuration does not say that no writer prepares. Then the
    /// flag is cleared once (a relay of an earlier release, or one started before the
    /// server allowed them, may have left it set) and this relay only polls.
    async fn writers_must_not_notify(&self, pool: &PgPool) -> Result<bool> {
        if self.despite_prepared {
            return Ok(false);
        }
        self.two_phase
            .get_or_try_init(|| async {
                let allowed: i32 =
                    sqlx::query_scalar("SELECT current_setting('max_prepared_transactions')::int")
                        .fetch_one(pool)
                        .await
                        .map_err(|e| db_error("cannot read max_prepared_transactions", e))?;
                if allowed > 0 {
                    sqlx::query(&self.sql.disarm)
                        .execute(pool)
                        .await
                        .map_err(|e| db_error("cannot disarm the wake-up", e))?;
                    tracing::info!(
                        max_prepared_transactions = allowed,
                        "the server allows two-phase commit, whose transactions cannot run NOTIFY: \
                         writers are not asked to wake idle relays, which poll every poll_interval \
                         (wakeup_with_prepared_transactions = true when no writer prepares)"
                    );
                }
                Ok::<_, Error>(allowed > 0)
            })
            .await
            .copied()
    }

    /// Starts the LISTEN connection once; returns false if it could not be started.
    async fn ensure_listener(&self, pool: &PgPool) -> bool {
        let started = self
            .listener
            .get_or_try_init(|| async {
                let mut listener = PgListener::connect_with(pool)
                    .await
                    .map_err(|e| db_error("wake-up listener cannot connect", e))?;
                listener
                    .listen(&self.channel)
                    .await
                    .map_err(|e| db_error("LISTEN failed", e))?;
                let notify = self.notify.clone();
                Ok::<_, Error>(tokio::spawn(async move {
                    loop {
                        match listener.recv().await {
                            Ok(_) => notify.notify_one(),
                            Err(error) => {
                                // PgListener reconnects on the next recv; polling covers the gap.
                                tracing::warn!(%error, "wake-up listener lost its connection");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                            }
                        }
                    }
                }))
            })
            .await;
        match started {
            Ok(_) => true,
            Err(error) => {
                tracing::warn!(%error, "wake-up unavailable; polling only");
                false
            }
        }
    }
}

/// The listener task would otherwise outlive the storage, holding a connection.
impl Drop for Wakeup {
    fn drop(&mut self) {
        if let Some(listener) = self.listener.get() {
            listener.abort();
        }
    }
}
