//! The SQL text of the relay and of the operator's repairs, built once per outbox table
//! from its validated names. The migrations and the enqueue statements are the table's
//! contract and stay with [`OutboxTable`].

use outbox_sql::columns::aliased;

use crate::{OutboxTable, PostgresConfig};

/// Columns of a message, in the order `rows::message` reads them.
pub(crate) const MESSAGE_COLUMNS: &str =
    "id, topic, partition_key, payload, headers, traceparent, tracestate, created_at, attempts";

/// Run on every new relay connection. The relay's own writes may be lost in a crash without
/// harm (a lost acknowledgement means one redelivery), so they need not wait for the WAL
/// flush. Custom plans keep the claim index-driven however small the table was when the
/// statement was first prepared. JIT compiling the claim (its estimated cost is high) took
/// 200 ms per call; the claim runs in 1-5 ms.
pub(crate) const SESSION_SETTINGS: &str =
    "SET synchronous_commit = off; SET plan_cache_mode = force_custom_plan; SET jit = off";

/// Migrations must be durable whatever the relay's session settings say.
pub(crate) const DURABLE_COMMITS: &str = "SET synchronous_commit = on";

/// Back to [`SESSION_SETTINGS`] after a migration.
pub(crate) const FAST_COMMITS: &str = "SET synchronous_commit = off";

/// Durable commits for one transaction on a relay session (an operator's enqueue).
pub(crate) const DURABLE_COMMITS_IN_TRANSACTION: &str = "SET LOCAL synchronous_commit = on";

/// The health check.
pub(crate) const PING: &str = "SELECT 1";

/// Taken in the claim's transaction with per-key order: claims are serialised (see
/// [`Statements::new`]); the key is [`OutboxTable::lock_key`].
pub(crate) const CLAIM_LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// The SQL of one outbox table, built once from validated names.
///
/// Times come from `statement_timestamp()`, never `now()`: `now()` is when the transaction
/// began, and a claim waits for the claim lock inside its transaction, so a lease counted
/// from `now()` would already be partly spent when the claim is made.
pub(crate) struct Statements {
    pub(crate) claim: String,
    /// The outcome of a batch that holds no key back (deliveries and releases only).
    pub(crate) settle: String,
    /// The outcome of a batch with retries or dead letters: under the shared claim lock.
    pub(crate) settle_holding_back: String,
    pub(crate) extend_lease: String,
    pub(crate) stats: String,
    /// Takes this relay's turn to count the shared queue figures, if they are due.
    pub(crate) stats_turn: String,
    pub(crate) stats_store: String,
    pub(crate) stats_read: String,
    pub(crate) purge_delivered: String,
    // The operator's repairs (`admin.rs`).
    pub(crate) find_dead_letters: String,
    pub(crate) replay_dead_letters: String,
    pub(crate) topic_stats: String,
    pub(crate) parked_keys: String,
    pub(crate) release_parked_key: String,
    pub(crate) purge_dead_letters: String,
}

impl Statements {
    pub(crate) fn new(t: &OutboxTable, config: &PostgresConfig) -> Self {
        let per_key_order = config.per_key_order;
        let outbox = t.qualified("");
        let delivered = t.qualified("_delivered");
        let cols = aliased("o", MESSAGE_COLUMNS);
        let claim = if per_key_order {
            Self::ordered_claim(
                &outbox,
                &t.qualified("_parked_keys"),
                &cols,
                config.max_per_key,
            )
        } else {
            // Without per-key order claims run concurrently and skip each other's rows.
            format!(
                "WITH due AS (
                    SELECT o.seq FROM {outbox} o
                    WHERE o.available_at <= statement_timestamp()
                    ORDER BY o.seq LIMIT $1 FOR UPDATE SKIP LOCKED)
                 UPDATE {outbox} o SET claim_token = $2, claimed_by = $3,
                        available_at = statement_timestamp() + $4 * interval '1 millisecond'
                 FROM due WHERE o.seq = due.seq
                 RETURNING o.seq, {cols}, NULL::text AS cursor"
            )
        };
        // With per-key order, claims hold the table's advisory lock exclusively, and the
        // writes that hold a key's first row back (retries, dead letters) or lengthen a
        // lease hold it shared: a claim then never reads the old version of a row such a
        // write is changing (its lease run out, so seemingly due) and lets the rows behind
        // it through. Deliveries and releases need no lock: a claim that misses one only
        // sees a key as busier than it is (see ARCHITECTURE.md). The key is a number we
        // computed from the validated names, so it is written inline.
        let lock = |locked: bool| {
            if per_key_order && locked {
                (
                    format!(
                        "lock AS (SELECT pg_advisory_xact_lock_shared({})),",
                        t.lock_key()
                    ),
                    "AND EXISTS (SELECT 1 FROM lock)",
                )
            } else {
                (String::new(), "")
            }
        };
        let (lock_cte, locked) = lock(true);
        let extend_lease = format!(
            "WITH {lock_cte} done AS (
                UPDATE {outbox} o
                SET available_at = statement_timestamp() + $3 * interval '1 millisecond'
                WHERE o.id = ANY($1) AND o.claim_token = $2 {locked}
                RETURNING 1)
             SELECT count(*) FROM done"
        );
        let shared = t.qualified("_stats");
        let stats = format!(
            "SELECT count(*) FILTER (WHERE claim_token IS NULL OR available_at <= now()),
                    min(created_at) FILTER (WHERE claim_token IS NULL OR available_at <= now()),
                    count(*) FILTER (WHERE claim_token IS NOT NULL AND available_at > now()),
                    (SELECT count(*) FROM {}),
                    (SELECT count(*) FROM {}),
                    count(*) FILTER (WHERE attempts > 0 AND (claim_token IS NULL OR available_at <= now()))
             FROM {outbox}",
            t.qualified("_dead_letters"),
            t.qualified("_parked_keys"),
        );
        Statements {
            claim,
            settle: Self::settle(t, config, lock(false)),
            settle_holding_back: Self::settle(t, config, lock(true)),
            extend_lease,
            stats,
            stats_turn: format!(
                "UPDATE {shared} SET refresh_after = now() + $1 * interval '1 millisecond'
                 WHERE refresh_after <= now()"
            ),
            stats_store: format!(
                "UPDATE {shared} SET measured_at = now(), pending = $1, oldest_pending = $2,
                        in_flight = $3, dead_lettered = $4, parked_keys = $5, retrying = $6
                 RETURNING measured_at"
            ),
            stats_read: format!(
                "SELECT pending, oldest_pending, in_flight, dead_lettered, parked_keys, retrying,
                        measured_at
                 FROM {shared}"
            ),
            purge_delivered: format!(
                "DELETE FROM {delivered} WHERE seq IN (
                    SELECT seq FROM {delivered} WHERE delivered_at < now() - $1 * interval '1 millisecond'
                    ORDER BY delivered_at LIMIT 1000)"
            ),
            find_dead_letters: Self::find_dead_letters(t),
            replay_dead_letters: Self::replay_dead_letters(t),
            topic_stats: Self::topic_stats(t),
            parked_keys: format!(
                "SELECT partition_key, dead_letter_id FROM {} ORDER BY parked_at",
                t.qualified("_parked_keys")
            ),
            release_parked_key: format!(
                "DELETE FROM {} WHERE partition_key = $1",
                t.qualified("_parked_keys")
            ),
            purge_dead_letters: format!(
                "DELETE FROM {} WHERE id = ANY($1)",
                t.qualified("_dead_letters")
            ),
        }
    }

    /// The outcome of a batch in one statement, so it is written whole or not at all:
    /// dead letters (moved, their keys parked), retries, deliveries (deleted, or kept with
    /// their receipt) and releases. Each row changes only while it is still held under the
    /// claim's token (`$1`). Returns how many rows changed.
    fn settle(
        t: &OutboxTable,
        config: &PostgresConfig,
        (lock_cte, locked): (String, &str),
    ) -> String {
        let outbox = t.qualified("");
        let dead = t.qualified("_dead_letters");
        let parked = t.qualified("_parked_keys");
        let delivered = t.qualified("_delivered");
        let park = if config.per_key_order {
            format!(
                "parked AS (
                    INSERT INTO {parked} (partition_key, dead_letter_id)
                    SELECT DISTINCT ON (partition_key) partition_key, id FROM moved
                    WHERE partition_key IS NOT NULL ORDER BY partition_key, seq
                    ON CONFLICT (partition_key) DO NOTHING),"
            )
        } else {
            String::new()
        };
        let (kept, acked_count) = if config.retention.is_some() {
            (
                format!(
                    "kept AS (
                        INSERT INTO {delivered} (seq, id, topic, partition_key, payload, headers,
                               traceparent, tracestate, created_at, attempts, receipt)
                        SELECT seq, id, topic, partition_key, payload, headers, traceparent,
                               tracestate, created_at, attempts, receipt FROM acked
                        RETURNING 1),"
                ),
                "kept",
            )
        } else {
            (String::new(), "acked")
        };
        format!(
            "WITH {lock_cte}
             gone AS (
                DELETE FROM {outbox} o USING unnest($2::uuid[], $3::text[]) AS r(id, error)
                WHERE o.id = r.id AND o.claim_token = $1 {locked}
                RETURNING o.*, r.error),
             moved AS (
                INSERT INTO {dead} (seq, id, topic, partition_key, payload, headers, traceparent,
                       tracestate, created_at, attempts, last_error)
                SELECT seq, id, topic, partition_key, payload, headers, traceparent, tracestate,
                       created_at, attempts + 1, error FROM gone
                RETURNING seq, id, partition_key),
             {park}
             retried AS (
                UPDATE {outbox} o SET attempts = o.attempts + 1, claim_token = NULL,
                       claimed_by = NULL, last_error = r.error,
                       available_at = statement_timestamp() + r.delay_ms * interval '1 millisecond'
                FROM unnest($4::uuid[], $5::bigint[], $6::text[]) AS r(id, delay_ms, error)
                WHERE o.id = r.id AND o.claim_token = $1 {locked}
                RETURNING 1),
             acked AS (
                DELETE FROM {outbox} o USING unnest($7::uuid[], $8::text[]) AS r(id, receipt)
                WHERE o.id = r.id AND o.claim_token = $1
                RETURNING o.*, r.receipt),
             {kept}
             released AS (
                UPDATE {outbox} o SET claim_token = NULL, claimed_by = NULL,
                       available_at = statement_timestamp()
                WHERE o.id = ANY($9) AND o.claim_token = $1
                RETURNING 1)
             SELECT (SELECT count(*) FROM moved) + (SELECT count(*) FROM retried)
                  + (SELECT count(*) FROM {acked_count}) + (SELECT count(*) FROM released)"
        )
    }

    /// The claim with per-key order: a sweep over the partition keys rather than the rows.
    ///
    /// A key is free when its first row is due and it is not parked. The sweep visits each
    /// key once, in key order, starting after the key where this relay's last claim stopped
    /// (`$5`) and wrapping around: a key another relay holds costs one index descent,
    /// however many rows it has waiting, and keys take turns. Of a free key it takes its
    /// first rows, at most `max_per_key` (the worker publishes a key's rows one round after
    /// another), and stops at the first row that is not due: rows behind one that is in
    /// flight or waiting to retry never go ahead of it, whatever their own state (a row of
    /// a late commit, a released or replayed row can be due behind one that is not). It
    /// stops once it has the batch.
    ///
    /// Rows without a key need no order: the oldest due ones take turns with the keyed rows,
    /// so neither kind starves the other. Claims are serialised by the advisory lock, so the
    /// candidates need no row locks, and the UPDATE takes every picked row without checking
    /// it again: the only writes that can change a picked row meanwhile are deliveries
    /// (the row is gone, and skipped) and releases (the row is due anyway); re-checking
    /// would drop a released row and keep the rows behind it. Every returned row carries
    /// the key the next sweep starts after, the last one taken in sweep order.
    fn ordered_claim(outbox: &str, parked: &str, cols: &str, max_per_key: usize) -> String {
        let head = format!("SELECT o.partition_key, o.seq, o.available_at FROM {outbox} o");
        format!(
            "WITH RECURSIVE
             after_cursor AS (
                ({head} WHERE o.partition_key > $5 ORDER BY o.partition_key, o.seq LIMIT 1)
                UNION ALL
                SELECT n.* FROM after_cursor a CROSS JOIN LATERAL (
                    {head} WHERE o.partition_key > a.partition_key
                    ORDER BY o.partition_key, o.seq LIMIT 1) n),
             up_to_cursor AS (
                ({head} WHERE o.partition_key <= $5 ORDER BY o.partition_key, o.seq LIMIT 1)
                UNION ALL
                SELECT n.* FROM up_to_cursor a CROSS JOIN LATERAL (
                    {head} WHERE o.partition_key > a.partition_key AND o.partition_key <= $5
                    ORDER BY o.partition_key, o.seq LIMIT 1) n),
             heads AS (
                SELECT * FROM after_cursor UNION ALL SELECT * FROM up_to_cursor),
             free_keys AS (
                SELECT h.partition_key FROM heads h
                WHERE h.available_at <= statement_timestamp()
                  AND NOT EXISTS (SELECT 1 FROM {parked} p WHERE p.partition_key = h.partition_key)),
             keyed AS (
                SELECT r.seq, r.partition_key FROM free_keys f CROSS JOIN LATERAL (
                    SELECT w.seq, w.partition_key FROM (
                        SELECT k.seq, k.partition_key,
                               bool_and(k.available_at <= statement_timestamp())
                                   OVER (ORDER BY k.seq) AS all_due_so_far
                        FROM (SELECT o.seq, o.partition_key, o.available_at FROM {outbox} o
                              WHERE o.partition_key = f.partition_key
                              ORDER BY o.seq LIMIT {max_per_key}) k) w
                    WHERE w.all_due_so_far) r
                -- Stops the sweep once it has a batch: rows come key after key in sweep
                -- order, each key's in seq order, so the cut drops only a key's last rows.
                LIMIT $1),
             unkeyed AS (
                SELECT o.seq, o.partition_key FROM {outbox} o
                WHERE o.partition_key IS NULL AND o.available_at <= statement_timestamp()
                ORDER BY o.seq LIMIT $1),
             picked AS MATERIALIZED (
                SELECT seq, partition_key FROM (
                    SELECT seq, partition_key, row_number() OVER (ORDER BY seq) AS turn FROM unkeyed
                    UNION ALL
                    -- Sweep order, each key's rows in order: a cut at the limit drops only
                    -- the last rows of a key, never a row ahead of one it keeps.
                    SELECT seq, partition_key, row_number() OVER (
                        ORDER BY partition_key <= $5, partition_key, seq) AS turn FROM keyed) t
                ORDER BY turn LIMIT $1)
             UPDATE {outbox} o SET claim_token = $2, claimed_by = $3,
                    available_at = statement_timestamp() + $4 * interval '1 millisecond'
             FROM picked WHERE o.seq = picked.seq
             RETURNING o.seq, {cols},
                (SELECT p.partition_key FROM picked p WHERE p.partition_key IS NOT NULL
                 ORDER BY p.partition_key <= $5 DESC, p.partition_key DESC LIMIT 1) AS cursor"
        )
    }

    /// Dead letters that match a filter (`$2` ids, `$3` topic, `$4` key, `$5` text in the
    /// last error; NULL matches everything), oldest first, at most `$1`; payloads empty when
    /// `$6`.
    fn find_dead_letters(t: &OutboxTable) -> String {
        format!(
            "SELECT seq, id, topic, partition_key,
                    CASE WHEN $6 THEN ''::bytea ELSE payload END AS payload,
                    headers, traceparent, tracestate, created_at, attempts,
                    last_error, dead_lettered_at FROM {}
             WHERE ($2::uuid[] IS NULL OR id = ANY($2)) AND ($3::text IS NULL OR topic = $3)
               AND ($4::text IS NULL OR partition_key = $4)
               AND ($5::text IS NULL OR strpos(lower(last_error), lower($5)) > 0)
             ORDER BY seq LIMIT $1",
            t.qualified("_dead_letters")
        )
    }

    /// Puts dead letters (`$1`) back at their original position and unparks their keys once
    /// no other dead letter of the key remains; under the shared claim lock (key `$2`).
    fn replay_dead_letters(t: &OutboxTable) -> String {
        let (outbox, dead, parked) = (
            t.qualified(""),
            t.qualified("_dead_letters"),
            t.qualified("_parked_keys"),
        );
        format!(
            "WITH lock AS (SELECT pg_advisory_xact_lock_shared($2)),
             back AS (
                DELETE FROM {dead} d WHERE d.id = ANY($1) AND EXISTS (SELECT 1 FROM lock)
                RETURNING d.*),
             restored AS (
                INSERT INTO {outbox} (seq, id, topic, partition_key, payload, headers, traceparent,
                       tracestate, created_at, attempts, available_at)
                OVERRIDING SYSTEM VALUE
                SELECT seq, id, topic, partition_key, payload, headers, traceparent, tracestate,
                       created_at, 0, now() FROM back
                RETURNING partition_key),
             unparked AS (
                DELETE FROM {parked} p WHERE p.partition_key IN (SELECT partition_key FROM restored)
                  AND NOT EXISTS (SELECT 1 FROM {dead} d WHERE d.partition_key = p.partition_key
                                  AND d.id <> ALL($1)))
             SELECT count(*) FROM restored"
        )
    }

    /// Queue figures per topic, sorted by topic.
    fn topic_stats(t: &OutboxTable) -> String {
        format!(
            "WITH live AS (
                SELECT topic,
                       count(*) FILTER (WHERE claim_token IS NULL OR available_at <= now()) AS pending,
                       min(created_at) FILTER (WHERE claim_token IS NULL OR available_at <= now()) AS oldest,
                       count(*) FILTER (WHERE claim_token IS NOT NULL AND available_at > now()) AS in_flight,
                       count(*) FILTER (WHERE attempts > 0 AND (claim_token IS NULL OR available_at <= now())) AS retrying
                FROM {outbox} GROUP BY topic),
             dead AS (SELECT topic, count(*) AS dead FROM {dead} GROUP BY topic)
             SELECT coalesce(live.topic, dead.topic) AS topic, coalesce(pending, 0) AS pending, oldest,
                    coalesce(in_flight, 0) AS in_flight, coalesce(retrying, 0) AS retrying,
                    coalesce(dead.dead, 0) AS dead
             FROM live FULL JOIN dead ON live.topic = dead.topic ORDER BY 1",
            outbox = t.qualified(""),
            dead = t.qualified("_dead_letters"),
        )
    }
}

/// The statements that tell writers whether to notify: the trigger the migrations install
/// on the outbox table reads the `<table>_wakeup` flag (see `wakeup.rs`).
pub(crate) struct WakeupStatements {
    /// Writers notify from now on (the relay is going idle).
    pub(crate) arm: String,
    /// Writers stop notifying (the relay is busy again).
    pub(crate) disarm: String,
}

impl WakeupStatements {
    pub(crate) fn new(t: &OutboxTable) -> Self {
        let wakeup = t.qualified("_wakeup");
        WakeupStatements {
            arm: format!("UPDATE {wakeup} SET relay_idle = true WHERE NOT relay_idle"),
            disarm: format!("UPDATE {wakeup} SET relay_idle = false WHERE relay_idle"),
        }
    }
}
