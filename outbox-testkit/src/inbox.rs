//! The inbox checks (`inbox_*`): what every storage's inbox (`Inbox::process` in the
//! consumer's transaction, `purge`, `migrate`) must do, through a small [`InboxHarness`]. A
//! handler's business change is one row in a table beside the inbox (no unique key), so a
//! handler that ran twice shows as two rows.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{ErrorKind, Result};
use uuid::Uuid;

/// How long a racing transaction is watched to be sure it waits for the first one.
const RACE_WAIT: Duration = Duration::from_millis(300);

/// What a storage's inbox gives the inbox checks.
#[async_trait]
pub trait InboxHarness: Send + Sync {
    /// A fresh, migrated inbox with an empty business table beside it (dropped with the
    /// fixture).
    async fn fresh(&self) -> Box<dyn InboxFixture>;
}

/// One inbox of a check, and its business table.
#[async_trait]
pub trait InboxFixture: Send + Sync {
    /// A transaction on a connection of its own.
    async fn begin(&self) -> Box<dyn InboxTransaction>;
    /// `Inbox::process` on a connection outside any transaction (which it must refuse).
    async fn process_outside_transaction(&self, consumer: &str, id: Uuid) -> Result<bool>;
    /// Committed runs of the handler for (consumer, id): rows of the business table.
    async fn effects(&self, consumer: &str, id: Uuid) -> i64;
    /// Whether the inbox holds a committed record of (consumer, id).
    async fn recorded(&self, consumer: &str, id: Uuid) -> bool;
    /// Moves the record's processing time back by `by`.
    async fn backdate(&self, consumer: &str, id: Uuid, by: Duration);
    /// `Inbox::purge` of records older than `older_than`, at most `limit`.
    async fn purge(&self, older_than: Duration, limit: u32) -> Result<u64>;
    /// Migrates another inbox table `table` (beside the fixture's) on a connection of its
    /// own; the fixture drops it with its own.
    async fn migrate(&self, table: &str) -> Result<()>;
    /// The versions recorded for the inbox table `table`.
    async fn versions(&self, table: &str) -> i64;
    /// `Inbox::process` in a committed transaction on the inbox `table`, which may not be
    /// migrated.
    async fn process_in(&self, table: &str, consumer: &str, id: Uuid) -> Result<bool>;
    /// The name of the business table, for an inbox that must refuse it.
    fn business_table(&self) -> String;
    /// The inbox's constructor's answer for the table name `table`.
    fn new_inbox(&self, table: &str) -> Result<()>;
}

/// A consumer's transaction: the inbox's record and the handler's business change commit
/// or roll back together.
#[async_trait]
pub trait InboxTransaction: Send {
    /// `Inbox::process(consumer, id)` in this transaction.
    async fn process(&mut self, consumer: &str, id: Uuid) -> Result<bool>;
    /// The handler's business change: one row in the business table.
    async fn record_effect(&mut self, consumer: &str, id: Uuid);
    /// Commits.
    async fn commit(self: Box<Self>);
    /// Rolls back.
    async fn rollback(self: Box<Self>);
}

/// A name for another inbox table, no other check's.
fn table_name() -> String {
    format!("inbox_{}", Uuid::now_v7().simple())
}

/// A new id is processed once: again in the same transaction, and in later ones after the
/// commit, it is a duplicate; another id is new.
pub async fn inbox_a_new_id_is_processed_and_a_redelivery_skipped(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    let id = Uuid::now_v7();
    let mut tx = s.begin().await;
    assert!(tx.process("billing", id).await.expect("process"));
    // Again in the same transaction: already recorded.
    assert!(!tx.process("billing", id).await.expect("process"));
    tx.commit().await;
    for _ in 0..2 {
        let mut tx = s.begin().await;
        assert!(
            !tx.process("billing", id).await.expect("process"),
            "a redelivery after the commit must be a duplicate"
        );
        tx.commit().await;
    }
    let mut tx = s.begin().await;
    assert!(
        tx.process("billing", Uuid::now_v7())
            .await
            .expect("process"),
        "another id is new"
    );
    tx.rollback().await;
}

/// A handler that fails (its transaction rolls back) leaves no record, so the redelivery
/// runs it again.
pub async fn inbox_a_failed_handler_leaves_no_record(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    let id = Uuid::now_v7();
    // The first delivery's handler fails: its transaction rolls back.
    let mut tx = s.begin().await;
    assert!(tx.process("billing", id).await.expect("process"));
    tx.record_effect("billing", id).await;
    tx.rollback().await;
    assert!(!s.recorded("billing", id).await, "a rolled-back record");
    // The next delivery runs the handler, which succeeds.
    let mut tx = s.begin().await;
    assert!(
        tx.process("billing", id).await.expect("process"),
        "the redelivery after a failed handler must run it again"
    );
    tx.record_effect("billing", id).await;
    tx.commit().await;
    assert_eq!(s.effects("billing", id).await, 1);
    assert!(s.recorded("billing", id).await);
}

/// The business change and the inbox's record are seen together at the commit, and gone
/// together at a rollback.
pub async fn inbox_the_business_change_and_the_record_commit_together(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    let (kept, dropped) = (Uuid::now_v7(), Uuid::now_v7());
    let mut tx = s.begin().await;
    assert!(tx.process("billing", kept).await.expect("process"));
    tx.record_effect("billing", kept).await;
    // Nothing is visible before the commit.
    assert_eq!(s.effects("billing", kept).await, 0);
    assert!(!s.recorded("billing", kept).await);
    tx.commit().await;
    assert_eq!(s.effects("billing", kept).await, 1);
    assert!(s.recorded("billing", kept).await);

    let mut tx = s.begin().await;
    assert!(tx.process("billing", dropped).await.expect("process"));
    tx.record_effect("billing", dropped).await;
    tx.rollback().await;
    assert_eq!(s.effects("billing", dropped).await, 0);
    assert!(!s.recorded("billing", dropped).await);
}

/// Each consumer (names compared byte for byte, up to 255 bytes) keeps its own records.
pub async fn inbox_consumers_are_independent(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    let id = Uuid::now_v7();
    for consumer in ["billing", "shipping", "Billing"] {
        let mut tx = s.begin().await;
        assert!(
            tx.process(consumer, id).await.expect("process"),
            "{consumer} has not seen the message"
        );
        tx.commit().await;
    }
    for consumer in ["billing", "shipping", "Billing"] {
        let mut tx = s.begin().await;
        assert!(!tx.process(consumer, id).await.expect("process"));
        tx.commit().await;
    }
    let longest = "c".repeat(255);
    let mut tx = s.begin().await;
    assert!(tx.process(&longest, id).await.expect("255 bytes"));
    tx.commit().await;
    assert!(s.recorded(&longest, id).await);
}

/// Two transactions on the same (consumer, id): the second waits for the first, then gets
/// `false` if the first committed, `true` if it rolled back; the handler runs once.
pub async fn inbox_racing_transactions_process_an_id_once(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    for first_commits in [true, false] {
        let id = Uuid::now_v7();
        let mut first = s.begin().await;
        assert!(first.process("billing", id).await.expect("first"));
        first.record_effect("billing", id).await;
        let mut second = s.begin().await;
        let second_done = AtomicBool::new(false);
        let second_run = async {
            let new = second.process("billing", id).await.expect("second");
            second_done.store(true, Ordering::SeqCst);
            if new {
                second.record_effect("billing", id).await;
            }
            new
        };
        let first_end = async {
            tokio::time::sleep(RACE_WAIT).await;
            assert!(
                !second_done.load(Ordering::SeqCst),
                "the second transaction must wait for the first"
            );
            if first_commits {
                first.commit().await;
            } else {
                first.rollback().await;
            }
        };
        let (second_new, ()) = tokio::join!(second_run, first_end);
        second.commit().await;
        assert_eq!(
            second_new,
            !first_commits,
            "the second transaction after the first {}",
            if first_commits {
                "committed"
            } else {
                "rolled back"
            }
        );
        assert_eq!(s.effects("billing", id).await, 1, "the handler ran once");
        assert!(s.recorded("billing", id).await);
    }
}

/// `purge` removes records older than its age in batches of at most its limit, leaves the
/// fresh ones, and a purged id is new again.
pub async fn inbox_purge_removes_old_records_in_batches(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    let old: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    let fresh: Vec<Uuid> = (0..2).map(|_| Uuid::now_v7()).collect();
    let mut tx = s.begin().await;
    for id in old.iter().chain(&fresh) {
        assert!(tx.process("billing", *id).await.expect("process"));
    }
    tx.commit().await;
    for id in &old {
        s.backdate("billing", *id, Duration::from_secs(7200)).await;
    }
    let hour = Duration::from_secs(3600);
    assert_eq!(s.purge(hour, 0).await.expect("purge"), 0, "limit 0");
    assert_eq!(s.purge(Duration::MAX, 10).await.expect("purge"), 0);
    let mut batches = Vec::new();
    loop {
        let n = s.purge(hour, 2).await.expect("purge");
        batches.push(n);
        if n < 2 {
            break;
        }
    }
    assert_eq!(batches, [2, 2, 1], "batches of at most `limit`");
    for id in &old {
        assert!(!s.recorded("billing", *id).await, "an old record survived");
    }
    for id in &fresh {
        assert!(
            s.recorded("billing", *id).await,
            "a fresh record was purged"
        );
    }
    // A purged id is new again: retention must outlast the broker's redelivery.
    let mut tx = s.begin().await;
    assert!(tx.process("billing", old[0]).await.expect("process"));
    tx.rollback().await;
    // SQLite's clock has milliseconds: let the fresh records be older than now.
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(s.purge(Duration::ZERO, 10).await.expect("purge all"), 2);
}

/// Four migrations of one new table at once succeed, each version is recorded once, and
/// the table works.
pub async fn inbox_migrations_are_repeatable_and_concurrent(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    let table = table_name();
    let results = tokio::join!(
        s.migrate(&table),
        s.migrate(&table),
        s.migrate(&table),
        s.migrate(&table)
    );
    for result in [results.0, results.1, results.2, results.3] {
        result.expect("concurrent migration");
    }
    s.migrate(&table).await.expect("migrating again");
    assert_eq!(s.versions(&table).await, 1, "each version recorded once");
    let id = Uuid::now_v7();
    assert!(s.process_in(&table, "billing", id).await.expect("process"));
}

/// Bad table names, a table that is not an inbox, an inbox not migrated, a call outside a
/// transaction and bad consumer names are refused, each with what to do.
pub async fn inbox_bad_names_and_misuse_are_refused(h: &dyn InboxHarness) {
    let s = h.fresh().await;
    for bad in ["Bad-Name", "x\"; DROP TABLE y; --", ""] {
        let err = s.new_inbox(bad).expect_err("a bad table name");
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        assert!(
            err.to_string()
                .contains(&format!("table `{bad}` is not allowed")),
            "{err}"
        );
    }
    // A table of the name that is not an inbox.
    let err = s
        .migrate(&s.business_table())
        .await
        .expect_err("an inbox on the business table");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("is not an inbox"), "{err}");
    // Not migrated: a schema error that says what to run.
    let err = s
        .process_in(&table_name(), "billing", Uuid::now_v7())
        .await
        .expect_err("an inbox that is not migrated");
    assert_eq!(err.kind(), ErrorKind::Schema, "{err}");
    assert!(err.to_string().contains("Inbox::migrate"), "{err}");
    // Outside a transaction the record would commit before the handler ran.
    let id = Uuid::now_v7();
    let err = s
        .process_outside_transaction("billing", id)
        .await
        .expect_err("process outside a transaction");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(
        err.to_string()
            .contains("inside the consumer's transaction"),
        "{err}"
    );
    assert!(!s.recorded("billing", id).await);
    for consumer in [String::new(), "c".repeat(256)] {
        let mut tx = s.begin().await;
        let err = tx
            .process(&consumer, id)
            .await
            .expect_err("a bad consumer name");
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        assert!(err.to_string().contains("1 to 255 bytes"), "{err}");
        tx.rollback().await;
    }
}
