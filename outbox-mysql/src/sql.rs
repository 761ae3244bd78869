//! The SQL text of the relay and of the operator's repairs, built once per outbox table
//! from its validated names. Statements over a list of messages take the list as `IN (?, …)`
//! placeholders, made by [`list`]. The migrations and the enqueue statements are the
//! table's contract and stay with [`OutboxTable`].

use outbox_core::DeadLetterFilter;
use outbox_sql::columns::{COPY_COLUMNS, aliased};

use crate::{MySqlConfig, OutboxTable};

/// Every relay connection runs its transactions at READ COMMITTED (see `connection.rs`).
pub(crate) const READ_COMMITTED: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// The `claim_token` of a row no claim holds (the column's default since migration 3): as
/// long as a token, so the claim overwrites it in place. NULL (rows of older versions,
/// retries, releases) means the same. Never a claim's token: those are UUID v7.
pub(crate) const UNCLAIMED: &str = "00000000-0000-0000-0000-000000000000";

/// The health check.
pub(crate) const PING: &str = "SELECT 1";

/// Whether a database exists (`?` its name).
pub(crate) const SCHEMA_EXISTS: &str =
    "SELECT SCHEMA_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?";

/// The database's clock, in UTC, to the microsecond.
pub(crate) const NOW: &str = "SELECT UTC_TIMESTAMP(6)";

/// The columns of a message (from table alias `o`), in the names `rows::message` reads.
/// `headers` is read as text: MySQL's JSON type is not text to the client.
pub(crate) const MESSAGE_COLUMNS: &str = "o.seq, o.id, o.topic, o.partition_key, o.payload, \
     CAST(o.headers AS CHAR) AS headers, o.traceparent, o.tracestate, o.created_at, o.attempts";

/// `n` placeholders for an `IN` list: `?, ?, ?`.
pub(crate) fn list(n: usize) -> String {
    vec!["?"; n.max(1)].join(", ")
}

/// The SQL of one outbox table that does not depend on the length of a list.
pub(crate) struct Statements {
    pub(crate) outbox: String,
    /// The outbox table as a multi-table statement names it, forced onto the unique `id`
    /// index: on a small table the optimizer may prefer a scan, and a scan by a DELETE
    /// would wait for rows an application transaction has inserted and not committed.
    pub(crate) outbox_by_id: String,
    /// The hint that forces the outbox table onto its `(partition_key, seq)` index (written
    /// after the table's alias), for the reads of one key's first rows: with `ORDER BY seq
    /// LIMIT n` the optimizer may otherwise walk the primary key in `seq` order until it
    /// meets the key, which read up to 385,000 rows per sweep in the benchmark once
    /// deletions had changed the table's statistics.
    pub(crate) by_key: String,
    pub(crate) dead: String,
    pub(crate) parked: String,
    /// The claim lock, taken exclusively by an ordered claim; it returns the database's
    /// clock once the lock is held, so a lease counts from the claim, not from the wait.
    pub(crate) lock_for_claim: String,
    /// The key where the next ordered claim starts its sweep, shared by the relays (read
    /// and written under the claim lock).
    pub(crate) shared_cursor: String,
    /// `?` key: moves the shared cursor.
    pub(crate) move_cursor: String,
    /// The claim lock, shared, by writes that hold a key back (retries, dead letters,
    /// lease renewals, replays); returns the clock too.
    pub(crate) lock_shared: String,
    /// `?` now, `?` limit: the oldest due rows without a key (every column).
    pub(crate) unkeyed: String,
    /// `?` limit: the oldest due rows (every column), with per-key order off, skipping rows
    /// other relays' claims have locked; locked until the claim commits.
    pub(crate) unordered: String,
    /// One retry: `?` error, `?` delay (µs), `?` id, `?` token.
    pub(crate) retry: String,
    /// One dead letter copied: `?` error, `?` id, `?` token.
    pub(crate) dead_copy: String,
    /// One delivered row kept: `?` receipt, `?` id, `?` token.
    pub(crate) delivered_keep: Option<String>,
    /// `?` cut-off.
    pub(crate) purge_delivered: String,
    /// The queue figures, then the database's clock (which `rows::queue_stats` skips).
    pub(crate) stats: String,
    /// Takes this relay's turn to count the shared queue figures, if due: `?` interval (µs).
    pub(crate) stats_turn: String,
    /// `?` measured at, pending, oldest pending, in flight, dead-lettered, parked keys.
    pub(crate) stats_store: String,
    pub(crate) stats_read: String,
    pub(crate) topic_stats: String,
    pub(crate) parked_keys: String,
    /// `?` key.
    pub(crate) release_parked_key: String,
}

impl Statements {
    pub(crate) fn new(t: &OutboxTable, config: &MySqlConfig) -> Self {
        let outbox = t.qualified("");
        let dead = t.qualified("_dead_letters");
        let parked = t.qualified("_parked_keys");
        let shared = t.qualified("_stats");
        let delivered = t.qualified("_delivered");
        let lock = t.qualified("_claim_lock");
        let cursor = t.qualified("_claim_cursor");
        let from_o = aliased("o", COPY_COLUMNS);
        let pending = "(o.claim_token IS NULL OR o.available_at <= n.now)";
        let in_flight = "(o.claim_token IS NOT NULL AND o.available_at > n.now)";
        Statements {
            outbox_by_id: format!("{outbox} AS o FORCE INDEX (`{}_id`)", t.table()),
            by_key: format!("FORCE INDEX (`{}_key_seq`)", t.table()),
            lock_for_claim: format!("SELECT UTC_TIMESTAMP(6) FROM {lock} WHERE id = 1 FOR UPDATE"),
            shared_cursor: format!("SELECT partition_key FROM {cursor} WHERE id = 1"),
            move_cursor: format!("UPDATE {cursor} SET partition_key = ? WHERE id = 1"),
            lock_shared: format!(
                "SELECT UTC_TIMESTAMP(6) FROM {lock} WHERE id = 1 LOCK IN SHARE MODE"
            ),
            unkeyed: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {outbox} o FORCE INDEX (`{}_key_seq`)
                 WHERE o.partition_key IS NULL AND o.available_at <= ?
                 ORDER BY o.seq LIMIT ?",
                t.table()
            ),
            unordered: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {outbox} o WHERE o.available_at <= UTC_TIMESTAMP(6)
                 ORDER BY o.seq LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            retry: format!(
                "UPDATE {outbox} SET attempts = attempts + 1, claim_token = NULL,
                        claimed_by = NULL, last_error = ?,
                        available_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                 WHERE id = ? AND claim_token = ?"
            ),
            dead_copy: format!(
                "INSERT INTO {dead} ({COPY_COLUMNS}, attempts, last_error, dead_lettered_at)
                 SELECT {from_o}, o.attempts + 1, ?, UTC_TIMESTAMP(6) FROM {outbox} o
                 WHERE o.id = ? AND o.claim_token = ?"
            ),
            delivered_keep: config.retention.is_some().then(|| {
                format!(
                    "INSERT INTO {delivered} ({COPY_COLUMNS}, attempts, receipt, delivered_at)
                     SELECT {from_o}, o.attempts, ?, UTC_TIMESTAMP(6) FROM {outbox} o
                     WHERE o.id = ? AND o.claim_token = ?"
                )
            }),
            purge_delivered: format!(
                "DELETE FROM {delivered} WHERE delivered_at < ? ORDER BY delivered_at LIMIT 1000"
            ),
            stats: format!(
                "SELECT CAST(COALESCE(SUM({pending}), 0) AS SIGNED),
                        MIN(CASE WHEN {pending} THEN o.created_at END),
                        CAST(COALESCE(SUM({in_flight}), 0) AS SIGNED),
                        (SELECT COUNT(*) FROM {dead}),
                        (SELECT COUNT(*) FROM {parked}),
                        MIN(n.now),
                        CAST(COALESCE(SUM({pending} AND o.attempts > 0), 0) AS SIGNED)
                 FROM {outbox} o CROSS JOIN (SELECT UTC_TIMESTAMP(6) AS now) n"
            ),
            stats_turn: format!(
                "UPDATE {shared} SET refresh_after = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                 WHERE id = 1 AND refresh_after <= UTC_TIMESTAMP(6)"
            ),
            stats_store: format!(
                "UPDATE {shared} SET measured_at = ?, pending = ?, oldest_pending = ?,
                        in_flight = ?, dead_lettered = ?, parked_keys = ?, retrying = ?
                 WHERE id = 1"
            ),
            stats_read: format!(
                "SELECT pending, oldest_pending, in_flight, dead_lettered, parked_keys, measured_at,
                        retrying
                 FROM {shared} WHERE id = 1"
            ),
            topic_stats: format!(
                "WITH live AS (
                    SELECT o.topic,
                           CAST(SUM({pending}) AS SIGNED) AS pending,
                           MIN(CASE WHEN {pending} THEN o.created_at END) AS oldest,
                           CAST(SUM({in_flight}) AS SIGNED) AS in_flight,
                           CAST(SUM({pending} AND o.attempts > 0) AS SIGNED) AS retrying
                    FROM {outbox} o CROSS JOIN (SELECT UTC_TIMESTAMP(6) AS now) n
                    GROUP BY o.topic),
                 dead AS (SELECT topic, COUNT(*) AS dead FROM {dead} GROUP BY topic),
                 topics AS (SELECT topic FROM live UNION SELECT topic FROM dead)
                 SELECT t.topic AS topic, CAST(COALESCE(l.pending, 0) AS SIGNED) AS pending,
                        l.oldest AS oldest, CAST(COALESCE(l.in_flight, 0) AS SIGNED) AS in_flight,
                        CAST(COALESCE(d.dead, 0) AS SIGNED) AS dead,
                        CAST(COALESCE(l.retrying, 0) AS SIGNED) AS retrying
                 FROM topics t LEFT JOIN live l ON l.topic = t.topic
                      LEFT JOIN dead d ON d.topic = t.topic
                 ORDER BY t.topic"
            ),
            // The dead letter holding a key back: its oldest one still there (the one that
            // parked it may have been purged).
            parked_keys: format!(
                "SELECT p.partition_key,
                        COALESCE((SELECT d.id FROM {dead} d WHERE d.partition_key = p.partition_key
                                  ORDER BY d.seq LIMIT 1), p.dead_letter_id) AS dead_letter_id
                 FROM {parked} p ORDER BY p.partition_key"
            ),
            release_parked_key: format!("DELETE FROM {parked} WHERE partition_key = ?"),
            outbox,
            dead,
            parked,
        }
    }

    /// The next keys of the sweep, at most `?` of them, in key order: those after `?`
    /// (`after`) and, when `up_to` is set, not after `?` (the cursor); each with whether its
    /// first row is due at `?` (now, bound first) and whether it is parked. One index
    /// descent per key (loose index scan of `(partition_key, seq)`).
    pub(crate) fn sweep_keys(&self, after: bool, up_to: bool) -> String {
        let (outbox, by_key, parked) = (&self.outbox, &self.by_key, &self.parked);
        let after = if after {
            "o.partition_key > ?"
        } else {
            "o.partition_key IS NOT NULL"
        };
        let up_to = if up_to {
            "AND o.partition_key <= ?"
        } else {
            ""
        };
        format!(
            "SELECT k.partition_key,
                    COALESCE((SELECT h.available_at <= ? FROM {outbox} h {by_key}
                              WHERE h.partition_key = k.partition_key
                              ORDER BY h.seq LIMIT 1), 0) AS head_due,
                    EXISTS (SELECT 1 FROM {parked} p WHERE p.partition_key = k.partition_key)
                        AS parked
             FROM (SELECT DISTINCT o.partition_key FROM {outbox} o
                   WHERE {after} {up_to} ORDER BY o.partition_key LIMIT ?) k
             ORDER BY k.partition_key"
        )
    }

    /// The first `max_per_key` rows of each of `keys` keys (every column, and `due`: whether
    /// due at `?`; each part binds now, then its key).
    pub(crate) fn first_rows(&self, keys: usize, max_per_key: usize) -> String {
        let part = format!(
            "(SELECT {MESSAGE_COLUMNS}, o.available_at <= ? AS due FROM {} o {}
              WHERE o.partition_key = ? ORDER BY o.seq LIMIT {max_per_key})",
            self.outbox, self.by_key
        );
        vec![part; keys.max(1)].join(" UNION ALL ")
    }

    /// Takes `n` picked rows under a claim: `?` token, `?` lease (µs), seqs. The lease counts
    /// from this statement, on the database's clock. It writes only what keeps the row's size
    /// (the token over the `UNCLAIMED` default, the lease time), so InnoDB updates the rows
    /// in place: a claim that grew its rows (`claimed_by`, a token over NULL) split their full
    /// pages and cost 2 to 10 times as much (docs/storage/mysql.md).
    pub(crate) fn take(&self, n: usize) -> String {
        format!(
            "UPDATE {} SET claim_token = ?,
                    available_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
             WHERE seq IN ({})",
            self.outbox,
            list(n)
        )
    }

    /// The messages of `n` seqs held under a token (`?` token, seqs), in seq order.
    pub(crate) fn claimed(&self, n: usize) -> String {
        format!(
            "SELECT {MESSAGE_COLUMNS} FROM {} o WHERE o.claim_token = ? AND o.seq IN ({})
             ORDER BY o.seq",
            self.outbox,
            list(n)
        )
    }

    /// Parks the keys of `n` dead letters (`?` token, ids): the first dead letter of a key
    /// (by seq) is the one named.
    pub(crate) fn dead_park(&self, n: usize) -> String {
        format!(
            "INSERT INTO {} (partition_key, dead_letter_id, parked_at)
             SELECT o.partition_key, o.id, UTC_TIMESTAMP(6) FROM {}
             WHERE o.claim_token = ? AND o.id IN ({}) AND o.partition_key IS NOT NULL
             ORDER BY o.seq
             ON DUPLICATE KEY UPDATE partition_key = {}.partition_key",
            self.parked,
            self.outbox_by_id,
            list(n),
            self.parked
        )
    }

    /// Deletes `n` rows held under a token (`?` token, ids).
    pub(crate) fn delete_held(&self, n: usize) -> String {
        format!(
            "DELETE o FROM {} WHERE o.claim_token = ? AND o.id IN ({})",
            self.outbox_by_id,
            list(n)
        )
    }

    /// Deletes `n` rows held under a token by their seqs (`?` token, seqs): the primary key
    /// finds them without the `id` index, which made an acknowledgement of 500 rows cost
    /// three to five times the ceiling's DELETE.
    pub(crate) fn delete_held_seqs(&self, n: usize) -> String {
        format!(
            "DELETE o FROM {} AS o FORCE INDEX (PRIMARY) WHERE o.claim_token = ? AND o.seq IN ({})",
            self.outbox,
            list(n)
        )
    }

    /// Releases `n` rows held under a token (`?` token, ids).
    pub(crate) fn release(&self, n: usize) -> String {
        format!(
            "UPDATE {} SET o.claim_token = NULL, o.claimed_by = NULL,
                    o.available_at = UTC_TIMESTAMP(6)
             WHERE o.claim_token = ? AND o.id IN ({})",
            self.outbox_by_id,
            list(n)
        )
    }

    /// Lengthens the lease of `n` rows held under a token (`?` lease (µs), `?` token, ids).
    pub(crate) fn extend_lease(&self, n: usize) -> String {
        format!(
            "UPDATE {} SET o.available_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
             WHERE o.claim_token = ? AND o.id IN ({})",
            self.outbox_by_id,
            list(n)
        )
    }

    /// Dead letters matching a filter, oldest first: `?` whether to leave the payloads out,
    /// the conditions present, then `?` limit.
    pub(crate) fn find_dead_letters(&self, filter: &DeadLetterFilter) -> String {
        let mut conditions = vec!["TRUE".to_string()];
        let (ids, topic, key) = (
            filter.ids.as_ref().map(Vec::len),
            filter.topic.is_some(),
            filter.key.is_some(),
        );
        if let Some(n) = ids {
            conditions.push(format!("o.id IN ({})", list(n)));
        }
        if topic {
            conditions.push("o.topic = ?".into());
        }
        if key {
            conditions.push("o.partition_key = ?".into());
        }
        if filter.last_error.is_some() {
            conditions.push("LOCATE(LOWER(?), LOWER(o.last_error)) > 0".into());
        }
        format!(
            "SELECT o.seq, o.id, o.topic, o.partition_key,
                    IF(?, X'', o.payload) AS payload, CAST(o.headers AS CHAR) AS headers,
                    o.traceparent, o.tracestate, o.created_at, o.attempts,
                    o.last_error, o.dead_lettered_at FROM {} o
             WHERE {} ORDER BY o.seq LIMIT ?",
            self.dead,
            conditions.join(" AND ")
        )
    }

    /// Puts `n` dead letters back with their seq (ids): first in their key again.
    pub(crate) fn replay_restore(&self, n: usize) -> String {
        format!(
            "INSERT INTO {} ({COPY_COLUMNS}, attempts, available_at, last_error)
             SELECT {COPY_COLUMNS}, 0, UTC_TIMESTAMP(6), last_error FROM {}
             WHERE id IN ({}) ORDER BY seq",
            self.outbox,
            self.dead,
            list(n)
        )
    }

    /// Unparks the keys of `n` dead letters being replayed (ids, ids) once no other dead
    /// letter of the key remains.
    pub(crate) fn replay_unpark(&self, n: usize) -> String {
        let ids = list(n);
        format!(
            "DELETE FROM {parked}
             WHERE partition_key IN (SELECT d.partition_key FROM {dead} d WHERE d.id IN ({ids}))
               AND NOT EXISTS (SELECT 1 FROM {dead} x
                               WHERE x.partition_key = {parked}.partition_key
                                 AND x.id NOT IN ({ids}))",
            parked = self.parked,
            dead = self.dead,
        )
    }

    /// Deletes `n` dead letters (ids).
    pub(crate) fn delete_dead(&self, n: usize) -> String {
        format!("DELETE FROM {} WHERE id IN ({})", self.dead, list(n))
    }
}
