//! The conformance suites of the outbox engine: one behaviour suite that every sink and
//! every storage runs, the way OpenDAL runs one suite over all its services. A backend crate
//! depends on `outbox-core` and this crate only, in or out of the outbox repository.
//!
//! Each check is a plain public async function, listed once in [`SINK_CHECKS`] or
//! [`STORAGE_CHECKS`]; the macros and the `run_*` functions read those tables, so no list
//! of checks is kept anywhere else. A backend plugs in through a small harness trait:
//!
//! - sinks: [`SinkHarness`] gives a sink for a fresh destination on the real broker, reads back
//!   what the broker holds there, and builds a sink pointed at a given address (the suite
//!   points it at a closed port and at a server that never answers), or says it has none;
//! - storages: [`StorageHarness`] gives a fresh, empty storage and a way to write messages in
//!   a transaction that is later committed or rolled back, and says how its writes behave
//!   ([`HarnessTraits`]); its table has the `storage_*`, `relay_*` and `admin_*` checks;
//! - inboxes: [`InboxHarness`] gives a fresh, migrated inbox with a business table beside it
//!   and the consumer's transactions on it ([`INBOX_CHECKS`]).
//!
//! The suite reads [`Sink::capabilities`](outbox_core::Sink::capabilities),
//! [`Storage::capabilities`](outbox_core::Storage::capabilities) and the harness's traits and
//! runs what applies: the per-key order checks only for a sink that `keeps_order`, the
//! de-duplication check only for one that `deduplicates`, the size check only for one that
//! knows its `max_payload`, the network checks only for a sink with an address. A check that
//! does not apply says why on stderr (`[conformance] <check>: skipped: …`); none is left out
//! silently.
//!
//! Wire it in with the macros, which make one `#[tokio::test]` per check (so a failure names
//! the check and the checks run in parallel); the test crate needs `tokio` with the
//! `macros` and `rt-multi-thread` features:
//!
//! ```text
//! struct MyHarness;                    // implements SinkHarness
//! outbox_testkit::sink_conformance_tests!(MyHarness::new().await);
//!
//! struct MyStorageHarness;             // implements StorageHarness
//! outbox_testkit::storage_conformance_tests!(MyStorageHarness);
//! ```
//!
//! or call [`run_sink_suite`] / [`run_storage_suite`], which run every check of the table in
//! turn. Every check panics with a message saying what broke.
#![deny(missing_docs)]

use std::future::Future;
use std::pin::Pin;

/// Reads a storage's figures (`stats()` of a `Storage` or a `StorageAdmin`) and asserts the
/// named ones, showing them all on a failure:
/// `assert_figures!(storage, pending: 0, in_flight: 1; "{check}: held")`.
macro_rules! assert_figures {
    ($storage:expr, $($field:ident: $want:expr),+; $($message:tt)+) => {{
        let stats = $storage.stats().await.unwrap_or_else(|e| panic!("stats: {e}"));
        assert_eq!(
            ($(stats.$field,)+),
            ($($want,)+),
            "{}: {stats:?}",
            format_args!($($message)+)
        );
        stats
    }};
}

mod inbox;
mod model;
mod relay;
mod sink;
mod storage;

pub use inbox::*;
pub use model::*;
pub use relay::*;
pub use sink::*;
pub use storage::*;

/// Prints a line of the suite's findings (figures, skipped checks) on stderr.
pub(crate) fn note(check: &str, text: impl std::fmt::Display) {
    eprintln!("[conformance] {check}: {text}");
}

/// A check's run over a harness of type `H`, boxed so that checks fit in one table.
pub type CheckRun<H> = for<'a> fn(&'a H) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

/// One check of a suite: its function's name and a way to run it.
pub struct Check<H: ?Sized> {
    /// The name of the check's public function (and of the test the macros make for it).
    pub name: &'static str,
    /// Runs the check.
    pub run: CheckRun<H>,
}

/// The one list of sink checks. Its callback form (`$crate::__sink_checks!(mode args)`)
/// feeds [`SINK_CHECKS`] and [`sink_conformance_tests!`], so they cannot drift apart.
#[doc(hidden)]
#[macro_export]
macro_rules! __sink_checks {
    ($mode:ident $($args:tt)*) => {
        $crate::__checks! { $mode [$($args)*] $crate::SinkHarness;
            sink_health_is_ok_when_the_broker_is_up,
            sink_fields_survive_exactly,
            sink_binary_and_non_utf8_payloads_survive,
            sink_unicode_header_values_survive,
            sink_one_outcome_per_message,
            sink_empty_batch_publishes_nothing,
            sink_keeps_key_order_within_and_across_batches,
            sink_large_batch,
            sink_health_is_down_on_a_closed_port,
            sink_health_times_out_on_a_silent_server,
            sink_refused_message_is_a_message_failure,
            sink_ordered_key_runs_stop_a_key_at_its_failure,
            sink_too_large_payload_is_permanent,
            sink_deduplicates_a_redelivered_message,
        }
    };
}

/// The one list of storage checks (see [`__sink_checks!`]), in three families over the same
/// harness: `storage_*` (the `Storage` trait's calls), `relay_*` (a worker running over the
/// storage) and `admin_*` (the operator's side, as the CLI and the console use it).
#[doc(hidden)]
#[macro_export]
macro_rules! __storage_checks {
    ($mode:ident $($args:tt)*) => {
        $crate::__checks! { $mode [$($args)*] $crate::StorageHarness;
            storage_declares_what_was_asked,
            storage_commit_delivers_rollback_does_not,
            storage_fields_survive_exactly,
            storage_claims_in_enqueue_order_up_to_the_limit,
            storage_ack_removes_messages,
            storage_retry_charges_an_attempt_and_waits,
            storage_release_charges_nothing,
            storage_dead_letter_parks_the_key_with_key_order,
            storage_dead_letter_without_key_order_parks_nothing,
            storage_fences_stale_claims,
            storage_leases_expire,
            storage_holds_a_key_back_while_its_head_is_out,
            storage_without_key_order_keys_do_not_block,
            storage_a_claim_takes_at_most_max_per_key_of_a_key,
            storage_out_of_order_commits_lose_nothing,
            storage_stats_count_the_queue,
            storage_shared_stats_count_once_per_interval,
            storage_a_late_commit_does_not_let_later_messages_pass_a_retry,
            storage_messages_behind_a_retry_wait_after_the_lease_runs_out,
            storage_a_late_settlement_counts_unless_the_rows_were_claimed_since,
            storage_a_replayed_head_does_not_let_later_messages_pass_a_retry,
            storage_a_dead_letter_replayed_after_its_key_drained_goes_first,
            storage_a_released_or_purged_dead_letter_stays_out_across_restarts,
            storage_a_replay_after_a_restart_delivers_the_key_once_in_order,
            storage_a_replayed_dead_letter_of_a_released_key_is_delivered,
            storage_replaying_one_of_two_dead_letters_keeps_the_key_parked,
            storage_settle_writes_the_whole_outcome,
            storage_extend_lease_holds_the_claim,
            storage_random_operations_keep_key_order,
            relay_retries_then_dead_letters_and_parks_the_key,
            relay_a_permanent_failure_is_dead_lettered_at_once_and_release_lets_the_rest_flow,
            relay_a_sink_outage_charges_no_attempt_and_everything_arrives_later,
            admin_keys_that_differ_in_any_byte_are_different_keys,
            admin_dead_letter_search_matches_error_text_without_payloads,
            admin_the_operators_repairs,
        }
    };
}

/// The one list of inbox checks (see [`__sink_checks!`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __inbox_checks {
    ($mode:ident $($args:tt)*) => {
        $crate::__checks! { $mode [$($args)*] $crate::InboxHarness;
            inbox_a_new_id_is_processed_and_a_redelivery_skipped,
            inbox_a_failed_handler_leaves_no_record,
            inbox_the_business_change_and_the_record_commit_together,
            inbox_consumers_are_independent,
            inbox_racing_transactions_process_an_id_once,
            inbox_purge_removes_old_records_in_batches,
            inbox_migrations_are_repeatable_and_concurrent,
            inbox_bad_names_and_misuse_are_refused,
        }
    };
}

/// What a list of checks expands to: `table` (a `&[Check]`) or `tests` (one
/// `#[tokio::test]` per check, each building the harness with the expression given).
#[doc(hidden)]
#[macro_export]
macro_rules! __checks {
    (table [] $harness:path; $($check:ident),+ $(,)?) => {
        &[$(
            $crate::Check::<dyn $harness> {
                name: stringify!($check),
                run: |h| ::std::boxed::Box::pin($crate::$check(h)),
            },
        )+]
    };
    (tests [$make:expr] $harness:path; $($check:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let harness = $make;
                $crate::$check(&harness).await;
            }
        )+
    };
}

/// Every sink check, in the order [`run_sink_suite`] runs them.
pub const SINK_CHECKS: &[Check<dyn SinkHarness>] = __sink_checks!(table);

/// Every storage check, in the order [`run_storage_suite`] runs them.
pub const STORAGE_CHECKS: &[Check<dyn StorageHarness>] = __storage_checks!(table);

/// Every inbox check, in the order [`run_inbox_suite`] runs them.
pub const INBOX_CHECKS: &[Check<dyn InboxHarness>] = __inbox_checks!(table);

/// Runs every check of `checks` over `h` in turn.
async fn run_suite<H: ?Sized>(checks: &[Check<H>], h: &H) {
    for check in checks {
        (check.run)(h).await;
    }
}

/// Runs every sink check of [`SINK_CHECKS`] in turn.
pub async fn run_sink_suite(h: &(dyn SinkHarness + 'static)) {
    run_suite(SINK_CHECKS, h).await
}

/// Runs every storage check of [`STORAGE_CHECKS`] in turn.
pub async fn run_storage_suite(h: &(dyn StorageHarness + 'static)) {
    run_suite(STORAGE_CHECKS, h).await
}

/// Runs every inbox check of [`INBOX_CHECKS`] in turn.
pub async fn run_inbox_suite(h: &(dyn InboxHarness + 'static)) {
    run_suite(INBOX_CHECKS, h).await
}

/// Makes one `#[tokio::test]` per sink check of [`SINK_CHECKS`], each building the harness
/// with `$harness` (an expression, may use `.await`). See [`SinkHarness`]. With a list after
/// a `;`, makes tests of the listed checks only (to run one check while working on it):
/// `sink_conformance_tests!(MyHarness; sink_large_batch)`.
#[macro_export]
macro_rules! sink_conformance_tests {
    ($($args:tt)*) => {
        $crate::__conformance_tests!(__sink_checks $crate::SinkHarness; $($args)*);
    };
}

/// Makes one `#[tokio::test]` per storage check of [`STORAGE_CHECKS`], each building the
/// harness with `$harness` (an expression, may use `.await`). See [`StorageHarness`]. With a
/// list after a `;`, makes tests of the listed checks only.
#[macro_export]
macro_rules! storage_conformance_tests {
    ($($args:tt)*) => {
        $crate::__conformance_tests!(__storage_checks $crate::StorageHarness; $($args)*);
    };
}

/// Makes one `#[tokio::test]` per inbox check of [`INBOX_CHECKS`], each building the
/// harness with `$harness` (an expression, may use `.await`). See [`InboxHarness`].
#[macro_export]
macro_rules! inbox_conformance_tests {
    ($($args:tt)*) => {
        $crate::__conformance_tests!(__inbox_checks $crate::InboxHarness; $($args)*);
    };
}

/// What the `*_conformance_tests!` macros expand to, given their list's macro and harness
/// trait: tests of the listed checks (after a `;`) or of every check of the list.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($list:ident $trait:path; $harness:expr; $($check:ident),+ $(,)?) => {
        $crate::__checks!(tests [$harness] $trait; $($check),+);
    };
    ($list:ident $trait:path; $harness:expr) => {
        $crate::$list!(tests $harness);
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every public check function of the sources is in its table, once: a check added
    /// without a line in the list fails here, not silently in every backend's suite.
    #[test]
    fn every_check_is_in_its_table_once() {
        let sources = [
            include_str!("sink.rs"),
            include_str!("storage.rs"),
            include_str!("model.rs"),
            include_str!("relay.rs"),
            include_str!("inbox.rs"),
        ];
        let mut defined: Vec<&str> = sources
            .iter()
            .flat_map(|s| s.lines())
            .filter_map(|l| l.trim().strip_prefix("pub async fn "))
            .map(|l| l.split('(').next().unwrap_or(l))
            .filter(|name| {
                ["sink_", "storage_", "relay_", "admin_", "inbox_"]
                    .iter()
                    .any(|family| name.starts_with(family))
            })
            .collect();
        defined.sort_unstable();
        let mut listed: Vec<&str> = SINK_CHECKS
            .iter()
            .map(|c| c.name)
            .chain(STORAGE_CHECKS.iter().map(|c| c.name))
            .chain(INBOX_CHECKS.iter().map(|c| c.name))
            .collect();
        listed.sort_unstable();
        assert!(defined.len() > 30, "found the check functions: {defined:?}");
        assert_eq!(listed, defined);
    }
}
