//! The SQL text of the relay and of the operator's repairs, built once per outbox table from
//! its validated name. The migrations and the enqueue statements are the table's contract
//! and stay with [`OutboxTable`].
//!
//! The relay's writes find a claimed row by its `seq` (the rowid: no index to search), so
//! lists name rows by seq. Lists of seqs (and of per-message values) are bound as one JSON
//! array and read with `json_each`: SQLite has no array parameters. Every time is a parameter `now` read once per
//! call from the database's clock ([`now`]), so one call uses one instant throughout.

use outbox_sql::columns::{COPY_COLUMNS, aliased};

use crate::table::NOW_MS;
use crate::{OutboxTable, SqliteConfig};

/// Columns of a message, in the order `rows::message` reads them. The payload is read as a
/// BLOB whatever a writer stored (a TEXT payload gives its UTF-8 bytes).
pub(crate) const MESSAGE_COLUMNS: &str = "id, topic, partition_key, CAST(payload AS BLOB) AS payload, \
     headers, traceparent, tracestate, created_at, attempts";

/// The database's clock, in milliseconds since the Unix epoch.
pub(crate) fn now() -> String {
    format!("SELECT {NOW_MS}")
}

/// The health check.
pub(crate) const PING: &str = "SELECT 1";

/// The write transactions of the relay: they take the write lock at once (waiting up to
/// `busy_timeout` for it), so their reads see the latest commit and their later writes
/// cannot fail to upgrade a read lock.
pub(crate) const BEGIN_WRITE: &str = "BEGIN IMMEDIATE";

/// Durable commits for an operator's enqueue, then back to the relay's setting.
pub(crate) const DURABLE_COMMITS: &str = "PRAGMA synchronous = FULL";
pub(crate) const FAST_COMMITS: &str = "PRAGMA synchronous = NORMAL";

/// A list of ids or seqs bound as JSON (`?n`), as a subquery.
fn json_list(n: u8) -> String {
    format!("(SELECT value FROM json_each(?{n}))")
}

/// The SQL of one outbox table, built once from its validated name.
pub(crate) struct Statements {
    /// `?1` limit, `?2` now, `?3` token, `?4` worker, `?5` lease (ms), `?6` cursor (per-key
    /// order only). Returns `seq` and [`MESSAGE_COLUMNS`] of the claimed rows.
    pub(crate) claim: String,
    /// The seqs of messages named by id: `?1` JSON ids. Returns `id`, `seq`.
    pub(crate) seqs_of: String,
    /// Dead letters (`?1` JSON `[{"seq", "error"}]`, `?2` token, `?3` now): copy, park, delete.
    pub(crate) dead_copy: String,
    pub(crate) dead_park: Option<String>,
    pub(crate) dead_delete: String,
    /// One retry: `?1` seq, `?2` token, `?3` now, `?4` delay (ms), `?5` error.
    pub(crate) retry: String,
    /// Deliveries (`?1` JSON `[{"seq", "receipt"}]`, `?2` token, `?3` now): keep (with
    /// retention), delete.
    pub(crate) delivered_keep: Option<String>,
    pub(crate) delivered_delete: String,
    /// Releases: `?1` JSON seqs, `?2` token, `?3` now.
    pub(crate) release: String,
    /// `?1` JSON seqs, `?2` token, `?3` now, `?4` lease (ms).
    pub(crate) extend_lease: String,
    /// `?1` now.
    pub(crate) stats: String,
    /// `?1` now, `?2` retention (ms).
    pub(crate) purge_delivered: String,
    // The operator's repairs (`admin.rs`).
    pub(crate) find_dead_letters: String,
    pub(crate) replay_restore: String,
    pub(crate) replay_unpark: String,
    pub(crate) replay_delete: String,
    pub(crate) topic_stats: String,
    pub(crate) parked_keys: String,
    pub(crate) release_parked_key: String,
    pub(crate) purge_dead_letters: String,
}

impl Statements {
    pub(crate) fn new(t: &OutboxTable, config: &SqliteConfig) -> Self {
        let outbox = t.quoted("");
        let dead = t.quoted("_dead_letters");
        let parked = t.quoted("_parked_keys");
        let delivered = t.quoted("_delivered");
        let returning = format!("RETURNING seq, {MESSAGE_COLUMNS}");
        let set_claimed = "claim_token = ?3, claimed_by = ?4, available_at = ?2 + ?5";
        let claim = if config.per_key_order {
            Self::ordered_claim(
                &outbox,
                &parked,
                config.max_per_key,
                set_claimed,
                &returning,
            )
        } else {
            format!(
                "UPDATE {outbox} SET {set_claimed}
                 WHERE seq IN (SELECT seq FROM {outbox} WHERE available_at <= ?2
                               ORDER BY seq LIMIT ?1)
                 {returning}"
            )
        };
        // The rows of a JSON list `[{"seq": …, …}]` still held under the token.
        let held = |list: u8, token: u8| {
            format!(
                "FROM json_each(?{list}) AS j CROSS JOIN {outbox} AS o
                 WHERE o.seq = json_extract(j.value, '$.seq') AND o.claim_token = ?{token}"
            )
        };
        let held_seqs = |list: u8, token: u8| {
            format!(
                "WHERE claim_token = ?{token} AND seq IN (SELECT json_extract(value, '$.seq') FROM json_each(?{list}))"
            )
        };
        let from_o = aliased("o", COPY_COLUMNS);
        Statements {
            claim,
            seqs_of: format!("SELECT id, seq FROM {outbox} WHERE id IN {}", json_list(1)),
            dead_copy: format!(
                "INSERT INTO {dead} ({COPY_COLUMNS}, attempts, last_error, dead_lettered_at)
                 SELECT {from_o}, o.attempts + 1, json_extract(j.value, '$.error'), ?3 {}",
                held(1, 2)
            ),
            // The first dead letter of a key (by seq) is the one that parks it.
            dead_park: config.per_key_order.then(|| {
                format!(
                    "INSERT OR IGNORE INTO {parked} (partition_key, dead_letter_id, parked_at)
                     SELECT o.partition_key, o.id, ?3 {} AND o.partition_key IS NOT NULL
                     ORDER BY o.seq",
                    held(1, 2)
                )
            }),
            dead_delete: format!("DELETE FROM {outbox} {}", held_seqs(1, 2)),
            retry: format!(
                "UPDATE {outbox} SET attempts = attempts + 1, claim_token = NULL, claimed_by = NULL,
                        last_error = ?5, available_at = ?3 + ?4
                 WHERE seq = ?1 AND claim_token = ?2"
            ),
            delivered_keep: config.retention.is_some().then(|| {
                format!(
                    "INSERT INTO {delivered} ({COPY_COLUMNS}, attempts, receipt, delivered_at)
                     SELECT {from_o}, o.attempts, json_extract(j.value, '$.receipt'), ?3 {}",
                    held(1, 2)
                )
            }),
            delivered_delete: format!("DELETE FROM {outbox} {}", held_seqs(1, 2)),
            release: format!(
                "UPDATE {outbox} SET claim_token = NULL, claimed_by = NULL, available_at = ?3
                 WHERE claim_token = ?2 AND seq IN {}",
                json_list(1)
            ),
            extend_lease: format!(
                "UPDATE {outbox} SET available_at = ?3 + ?4 WHERE claim_token = ?2 AND seq IN {}",
                json_list(1)
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE claim_token IS NULL OR available_at <= ?1),
                        min(created_at) FILTER (WHERE claim_token IS NULL OR available_at <= ?1),
                        count(*) FILTER (WHERE claim_token IS NOT NULL AND available_at > ?1),
                        (SELECT count(*) FROM {dead}),
                        (SELECT count(*) FROM {parked}),
                        count(*) FILTER (WHERE attempts > 0 AND (claim_token IS NULL OR available_at <= ?1))
                 FROM {outbox}"
            ),
            purge_delivered: format!(
                "DELETE FROM {delivered} WHERE seq IN (
                    SELECT seq FROM {delivered} WHERE delivered_at < ?1 - ?2
                    ORDER BY delivered_at LIMIT 1000)"
            ),
            find_dead_letters: format!(
                "SELECT seq, id, topic, partition_key,
                        CASE WHEN ?6 THEN X'' ELSE CAST(payload AS BLOB) END AS payload,
                        headers, traceparent, tracestate, created_at, attempts,
                        last_error, dead_lettered_at FROM {dead}
                 WHERE (?2 IS NULL OR id IN {}) AND (?3 IS NULL OR topic = ?3)
                   AND (?4 IS NULL OR partition_key = ?4)
                   AND (?5 IS NULL OR instr(lower(last_error), lower(?5)) > 0)
                 ORDER BY seq LIMIT ?1",
                json_list(2)
            ),
            // A replayed dead letter goes back with its seq, so it is first in its key again;
            // AUTOINCREMENT never hands a seq out twice, so it is still free.
            replay_restore: format!(
                "INSERT INTO {outbox} ({COPY_COLUMNS}, attempts, available_at, last_error)
                 SELECT {COPY_COLUMNS}, 0, ?2, last_error FROM {dead} WHERE id IN {}
                 ORDER BY seq",
                json_list(1)
            ),
            replay_unpark: format!(
                "DELETE FROM {parked}
                 WHERE partition_key IN (SELECT partition_key FROM {dead} WHERE id IN {ids})
                   AND NOT EXISTS (SELECT 1 FROM {dead} d
                                   WHERE d.partition_key = {parked}.partition_key
                                     AND d.id NOT IN {ids})",
                ids = json_list(1)
            ),
            replay_delete: format!("DELETE FROM {dead} WHERE id IN {}", json_list(1)),
            topic_stats: format!(
                "WITH live AS (
                    SELECT topic,
                           count(*) FILTER (WHERE claim_token IS NULL OR available_at <= ?1) AS pending,
                           min(created_at) FILTER (WHERE claim_token IS NULL OR available_at <= ?1) AS oldest,
                           count(*) FILTER (WHERE claim_token IS NOT NULL AND available_at > ?1) AS in_flight,
                           count(*) FILTER (WHERE attempts > 0 AND (claim_token IS NULL OR available_at <= ?1)) AS retrying
                    FROM {outbox} GROUP BY topic),
                 dead AS (SELECT topic, count(*) AS dead FROM {dead} GROUP BY topic),
                 topics AS (SELECT topic FROM live UNION SELECT topic FROM dead)
                 SELECT t.topic AS topic, coalesce(l.pending, 0) AS pending, l.oldest AS oldest,
                        coalesce(l.in_flight, 0) AS in_flight, coalesce(d.dead, 0) AS dead,
                        coalesce(l.retrying, 0) AS retrying
                 FROM topics t LEFT JOIN live l ON l.topic = t.topic
                      LEFT JOIN dead d ON d.topic = t.topic
                 ORDER BY t.topic"
            ),
            // The dead letter holding a key back: its oldest one still there (the one that
            // parked it may have been purged).
            parked_keys: format!(
                "SELECT p.partition_key,
                        coalesce((SELECT d.id FROM {dead} d WHERE d.partition_key = p.partition_key
                                  ORDER BY d.seq LIMIT 1), p.dead_letter_id)
                 FROM {parked} p ORDER BY p.partition_key"
            ),
            release_parked_key: format!("DELETE FROM {parked} WHERE partition_key = ?1"),
            purge_dead_letters: format!("DELETE FROM {dead} WHERE id IN {}", json_list(1)),
        }
    }

    /// The claim with per-key order: a sweep over the partition keys rather than the rows,
    /// as in outbox-postgres, in one statement.
    ///
    /// A key is free when its first row is due and it is not parked. The sweep visits the
    /// keys in key order, starting after the key where this relay's last claim stopped (`?6`)
    /// and wrapping around, one descent of the `(partition_key, seq)` index per key: a key
    /// another relay holds costs one descent however many rows wait behind it, and keys
    /// take turns. It stops once the free keys it has found give `limit` rows (counted as
    /// below). Of a free key it takes its first rows, at most `max_per_key`, and stops at the
    /// first row that is not due: rows behind one that is in flight or waiting to retry
    /// never go ahead of it, whatever their own state (a released or a replayed row can be
    /// due behind one that is not).
    ///
    /// Rows without a key need no order: the oldest due ones take turns with the keyed rows,
    /// so neither kind starves the other. The statement runs in a `BEGIN IMMEDIATE`
    /// transaction: no other write can change a row between the sweep and the UPDATE.
    fn ordered_claim(
        outbox: &str,
        parked: &str,
        max_per_key: usize,
        set_claimed: &str,
        returning: &str,
    ) -> String {
        let next_key = |after: &str, bound: &str| {
            format!(
                "(SELECT o.partition_key FROM {outbox} o WHERE o.partition_key > {after} {bound}
                  ORDER BY o.partition_key LIMIT 1)"
            )
        };
        // The rows a key gives: none when parked, else its first rows up to `max_per_key`,
        // up to its first row that is not due (none when that is its first row: the key is
        // free exactly when it gives rows).
        let gives = |k: &str| {
            format!(
                "(CASE WHEN EXISTS (SELECT 1 FROM {parked} p WHERE p.partition_key = {k}) THEN 0
                  ELSE (SELECT count(*) FROM (
                           SELECT min(g.available_at <= ?2) OVER (
                                      ORDER BY g.seq ROWS UNBOUNDED PRECEDING) AS due
                           FROM (SELECT h.seq, h.available_at FROM {outbox} h
                                 WHERE h.partition_key = {k} ORDER BY h.seq LIMIT {max_per_key}) g)
                        WHERE due) END)"
            )
        };
        // Each step of a sweep is a key `k`, the rows `n` the keys before it give, and the
        // rows `g` it gives (worked out once per key); the sweep stops once `k` makes `limit`.
        let after_first = next_key("?6", "");
        let after_next = next_key("a.k", "");
        let up_to_first = format!(
            "(SELECT o.partition_key FROM {outbox} o WHERE o.partition_key <= ?6
              ORDER BY o.partition_key LIMIT 1)"
        );
        let up_to_next = next_key("u.k", "AND o.partition_key <= ?6");
        let (gives_after_first, gives_after_next) = (gives(&after_first), gives(&after_next));
        let (gives_up_to_first, gives_up_to_next) = (gives(&up_to_first), gives(&up_to_next));
        let offset = max_per_key.saturating_sub(1);
        format!(
            "WITH RECURSIVE
             after_cursor(k, n, g) AS (
                SELECT {after_first}, 0, {gives_after_first}
                UNION ALL
                SELECT {after_next}, a.n + a.g, {gives_after_next} FROM after_cursor a
                WHERE a.k IS NOT NULL AND a.n + a.g < ?1),
             up_to_cursor(k, n, g) AS (
                SELECT {up_to_first}, a.n, {gives_up_to_first}
                FROM after_cursor a WHERE a.k IS NULL AND a.n < ?1
                UNION ALL
                SELECT {up_to_next}, u.n + u.g, {gives_up_to_next} FROM up_to_cursor u
                WHERE u.k IS NOT NULL AND u.n + u.g < ?1),
             free_keys(k, phase, g) AS (
                SELECT k, 0, g FROM after_cursor WHERE k IS NOT NULL AND g > 0
                UNION ALL
                SELECT k, 1, g FROM up_to_cursor WHERE k IS NOT NULL AND g > 0),
             -- A free key's first `g` rows (all due, by the definition of `g`), read
             -- among its first `max_per_key`.
             keyed(seq, k, phase) AS (
                SELECT seq, k, phase FROM (
                    SELECT o.seq, o.partition_key AS k, f.phase, f.g,
                           row_number() OVER (PARTITION BY o.partition_key ORDER BY o.seq) AS nth
                    FROM free_keys f CROSS JOIN {outbox} o
                    ON o.partition_key = f.k AND o.seq <= coalesce(
                        (SELECT x.seq FROM {outbox} x WHERE x.partition_key = f.k
                         ORDER BY x.seq LIMIT 1 OFFSET {offset}), 9223372036854775807))
                WHERE nth <= g),
             unkeyed(seq) AS (
                SELECT seq FROM {outbox} WHERE partition_key IS NULL AND available_at <= ?2
                ORDER BY seq LIMIT ?1),
             picked(seq) AS (
                SELECT seq FROM (
                    SELECT seq, row_number() OVER (ORDER BY seq) AS turn FROM unkeyed
                    UNION ALL
                    -- Sweep order, each key's rows in order: a cut at the limit drops only
                    -- the last rows of a key, never a row ahead of one it keeps.
                    SELECT seq, row_number() OVER (ORDER BY phase, k, seq) AS turn FROM keyed)
                ORDER BY turn LIMIT ?1)
             UPDATE {outbox} SET {set_claimed} WHERE seq IN (SELECT seq FROM picked)
             {returning}"
        )
    }
}
