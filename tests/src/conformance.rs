//! The conformance suite: one behaviour suite that every sink and every storage runs, the way
//! OpenDAL runs one suite over all its services.
//!
//! Each check is a plain public async function, so a backend crate outside this workspace can
//! call them from its own tests. A backend plugs in through a small harness trait:
//!
//! - sinks: [`SinkHarness`] gives a sink for a fresh destination on the real broker, reads back
//!   what the broker holds there, and builds a sink pointed at a given address (the suite
//!   points it at a closed port and at a server that never answers);
//! - storages: [`StorageHarness`] gives a fresh, empty storage and a way to write messages in
//!   a transaction that is later committed or rolled back.
//!
//! The suite reads [`Sink::capabilities`](outbox_core::Sink::capabilities) and
//! [`Storage::capabilities`](outbox_core::Storage::capabilities) and runs what applies: the
//! per-key order checks only for a sink that `keeps_order`, the de-duplication check only for
//! one that `deduplicates`, the size check only for one that knows its `max_payload`.
//!
//! Wire it in with the macros, which make one `#[tokio::test]` per check (so a failure names
//! the check and the checks run in parallel); the test crate needs `tokio` with the
//! `macros` and `rt-multi-thread` features:
//!
//! ```text
//! struct MyHarness;                    // implements SinkHarness
//! outbox_tests::sink_conformance_tests!(MyHarness::new().await);
//!
//! struct MyStorageHarness;             // implements StorageHarness
//! outbox_tests::storage_conformance_tests!(MyStorageHarness);
//! ```
//!
//! or call [`run_sink_suite`] / [`run_storage_suite`], which run every check in turn.
//! Every check panics with a message saying what broke; none is skipped silently: a check
//! that does not apply prints why on stderr.

mod model;
mod sink;
mod storage;

pub use model::*;
pub use sink::*;
pub use storage::*;

/// Prints a line of the suite's findings (figures, skipped checks) on stderr.
pub(crate) fn note(check: &str, text: impl std::fmt::Display) {
    eprintln!("[conformance] {check}: {text}");
}

/// Makes one `#[tokio::test]` per sink check, each building the harness with `$harness`
/// (an expression, may use `.await`). See [`SinkHarness`]. With a list after a `;`, makes
/// tests of the listed checks only: `sink_conformance_tests!(MyHarness; sink_large_batch)`.
#[macro_export]
macro_rules! sink_conformance_tests {
    ($harness:expr; $($check:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let harness = $harness;
                $crate::conformance::$check(&harness).await;
            }
        )+
    };
    ($harness:expr) => {
        $crate::sink_conformance_tests!($harness;
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
        );
    };
}

/// Makes one `#[tokio::test]` per storage check, each building the harness with `$harness`
/// (an expression, may use `.await`). See [`StorageHarness`]. With a list after a `;`, makes
/// tests of the listed checks only.
#[macro_export]
macro_rules! storage_conformance_tests {
    ($harness:expr; $($check:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let harness = $harness;
                $crate::conformance::$check(&harness).await;
            }
        )+
    };
    ($harness:expr) => {
        $crate::storage_conformance_tests!($harness;
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
            storage_out_of_order_commits_lose_nothing,
            storage_stats_count_the_queue,
            storage_shared_stats_count_once_per_interval,
            storage_a_late_commit_does_not_let_later_messages_pass_a_retry,
            storage_messages_behind_a_retry_wait_after_the_lease_runs_out,
            storage_a_replayed_head_does_not_let_later_messages_pass_a_retry,
            storage_a_dead_letter_replayed_after_its_key_drained_goes_first,
            storage_a_released_or_purged_dead_letter_stays_out_across_restarts,
            storage_a_replay_after_a_restart_delivers_the_key_once_in_order,
            storage_a_replayed_dead_letter_of_a_released_key_is_delivered,
            storage_settle_writes_the_whole_outcome,
            storage_extend_lease_holds_the_claim,
            storage_random_operations_keep_key_order,
        );
    };
}
