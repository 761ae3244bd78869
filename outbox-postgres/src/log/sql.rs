//! The SQL of log mode for one table ([`LogSql`]), and the horizon rule ([`HORIZON`]) that
//! every read of the log applies.

use outbox_sql::columns::aliased;

use crate::OutboxTable;
use crate::sql::MESSAGE_COLUMNS;

/// The SQL of log mode for one table.
pub(super) struct LogSql {
    pub(super) heartbeat: String,
    pub(super) renew: String,
    pub(super) counts: String,
    pub(super) acquire: String,
    pub(super) give_up: String,
    pub(super) forget_relay: String,
    pub(super) read: String,
    pub(super) parked_in: String,
    pub(super) reload: String,
    pub(super) held_of_key: String,
    pub(super) hold: String,
    pub(super) move_cursors: String,
    pub(super) dead_from_log: String,
    pub(super) dead_from_held: String,
    pub(super) park: String,
    pub(super) delete_held: String,
    pub(super) unpark: String,
    pub(super) stats: String,
    pub(super) cleanup: String,
    pub(super) forget_old_relays: String,
    pub(super) lag: String,
    pub(super) horizon: String,
    pub(super) waiting_behind: String,
    /// See [`OutboxTable::moved_log_sql`].
    pub(super) moved: String,
    // The operator's side (`replay`, `release` of the engine's `Mode`).
    pub(super) replay: String,
    pub(super) release: String,
    pub(super) topic_stats: String,
}

/// The horizon rule: a row is readable once its transaction id is below every transaction
/// of this database still running, `h`. That is `pg_snapshot_xmin(pg_current_snapshot())`
/// with the running transactions of other databases left out (they can never write this
/// table; a transaction is left out only when `pg_stat_activity` shows it in another
/// database, so one it cannot see, such as a prepared transaction, still holds the
/// horizon). With none running, the next transaction id. Every transaction below `h` has
/// ended, so its rows are all visible to this statement, and every transaction yet to
/// write gets an id at or above `h`: nothing can ever appear behind a cursor that only
/// moves through rows below it.
///
/// On a hot standby (`replica_url`) a snapshot lists no running transactions (`xip` is
/// empty there: the primary's running ids are kept as sub-transactions of the snapshot),
/// but its `xmin` is the oldest transaction id the standby knows to be running on the
/// primary, of any database: replaying a record of transaction `Y` marks every id below
/// `Y` not yet seen as running, and an id leaves that set only when its commit or abort
/// has been replayed (or a later list of running transactions shows it ended, which it
/// could only after its commit record). So every id below the standby's `xmin` has ended
/// with all its rows replayed, and any transaction still to commit has an id at or above
/// it. See docs/storage/postgres.md (read replica).
pub(super) const HORIZON: &str = "SELECT CASE WHEN pg_is_in_recovery()
        THEN pg_snapshot_xmin(pg_current_snapshot())
        ELSE coalesce(
            (SELECT min(x) FROM pg_snapshot_xip(pg_current_snapshot()) AS x
             WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                               WHERE a.backend_xid = xid(x)
                                 AND a.datname IS DISTINCT FROM current_database())),
            pg_snapshot_xmax(pg_current_snapshot())) END AS h";

impl LogSql {
    /// The statements for table `t`.
    pub(super) fn new(t: &OutboxTable) -> Self {
        let outbox = t.qualified("");
        let shards = t.qualified("_shards");
        let relays = t.qualified("_relays");
        let held = t.qualified("_held");
        let dead = t.qualified("_dead_letters");
        let parked = t.qualified("_parked_keys");
        let ms = "* interval '1 millisecond'";
        let cols = MESSAGE_COLUMNS.replace(", attempts", "");
        let row_cols = "seq, xid, shard, id, topic, partition_key, payload, headers, \
                        traceparent, tracestate, created_at";
        let o_msg = aliased("o", &cols);
        let o_cols = aliased("o", row_cols);
        LogSql {
            heartbeat: format!(
                "INSERT INTO {relays} (relay, expires_at) VALUES ($1, statement_timestamp() + $2 {ms})
                 ON CONFLICT (relay) DO UPDATE SET expires_at = excluded.expires_at"
            ),
            // The epoch fences: a shard another relay took since has a new one. A lease that
            // ran out with nobody taking the shard is renewed. A renewal never shortens a
            // lease (a round's runs a round interval longer than a claim's).
            renew: format!(
                "UPDATE {shards} s SET expires_at = greatest(s.expires_at,
                                                statement_timestamp() + $3 {ms})
                 FROM unnest($1::int[], $2::bigint[]) AS o(shard, epoch)
                 WHERE s.shard = o.shard AND s.epoch = o.epoch AND s.owner = $4
                 RETURNING s.shard"
            ),
            counts: format!(
                "SELECT (SELECT count(*) FROM {shards}),
                        (SELECT count(*) FROM {relays} WHERE expires_at > statement_timestamp())"
            ),
            // With `start = "now"` (`$5`), a shard no relay has owned yet (epoch 0) starts
            // at the horizon: `(h, 0)` is before every row of `h` and later transactions.
            acquire: format!(
                "WITH horizon AS MATERIALIZED ({HORIZON})
                 UPDATE {shards} s SET owner = $1, epoch = s.epoch + 1,
                        expires_at = statement_timestamp() + $2 {ms},
                        cursor_xid = CASE WHEN $5 AND s.epoch = 0 AND horizon.h > s.cursor_xid
                                          THEN horizon.h ELSE s.cursor_xid END,
                        cursor_seq = CASE WHEN $5 AND s.epoch = 0 AND horizon.h > s.cursor_xid
                                          THEN 0 ELSE s.cursor_seq END
                 FROM horizon, (SELECT shard FROM {shards}
                       WHERE (owner IS NULL OR expires_at <= statement_timestamp())
                         AND shard <> ALL($4)
                       ORDER BY shard LIMIT $3 FOR UPDATE SKIP LOCKED) f
                 WHERE s.shard = f.shard
                 RETURNING s.shard, s.epoch, s.cursor_xid::text, s.cursor_seq,
                           pg_current_wal_insert_lsn()::text"
            ),
            // The rows delivered past the cursors of the shards given up (`$4`-`$6`) leave
            // the log with them.
            give_up: format!(
                "WITH gone AS (
                    UPDATE {shards} s SET owner = NULL, expires_at = '-infinity'
                    FROM unnest($1::int[], $2::bigint[]) AS o(shard, epoch)
                    WHERE s.shard = o.shard AND s.epoch = o.epoch AND s.owner = $3
                    RETURNING s.shard)
                 DELETE FROM {outbox} o
                 USING unnest($4::int[], $5::text[], $6::bigint[]) AS d(shard, xid, seq)
                 WHERE d.shard IN (SELECT shard FROM gone)
                   AND o.shard = d.shard AND o.xid = d.xid::xid8 AND o.seq = d.seq"
            ),
            forget_relay: format!("DELETE FROM {relays} WHERE relay = $1"),
            read: format!(
                "WITH horizon AS MATERIALIZED ({HORIZON})
                 SELECT r.* FROM horizon,
                     unnest($1::int[], $2::text[], $3::bigint[], $4::bigint[])
                     AS p(shard, xid, seq, n)
                 CROSS JOIN LATERAL (
                    SELECT o.shard, o.xid::text AS xid_text, o.seq, {o_msg}, 0 AS attempts
                    FROM {outbox} o
                    WHERE o.shard = p.shard AND (o.xid, o.seq) > (p.xid::xid8, p.seq)
                      AND o.xid < horizon.h
                    ORDER BY o.xid, o.seq LIMIT p.n) r",
            ),
            // The rows of evicted keys, per (shard, key): after the position they were let
            // go from, up to the shard's read position, the first `n`.
            reload: format!(
                "SELECT r.* FROM unnest($1::int[], $2::text[], $3::text[], $4::bigint[],
                                        $5::text[], $6::bigint[], $7::bigint[])
                     AS p(shard, key, xid, seq, to_xid, to_seq, n)
                 CROSS JOIN LATERAL (
                    SELECT o.shard, o.xid::text AS xid_text, o.seq, {o_msg}, 0 AS attempts
                    FROM {outbox} o
                    WHERE o.shard = p.shard AND (o.xid, o.seq) > (p.xid::xid8, p.seq)
                      AND (o.xid, o.seq) <= (p.to_xid::xid8, p.to_seq)
                      AND o.partition_key = p.key
                    ORDER BY o.xid, o.seq LIMIT p.n) r",
            ),
            parked_in: format!(
                "SELECT partition_key, draining, generation, shard FROM {parked} WHERE shard = ANY($1)"
            ),
            held_of_key: format!(
                "SELECT shard, xid::text AS xid_text, seq, {MESSAGE_COLUMNS} FROM {held}
                 WHERE partition_key = $1 ORDER BY xid, seq"
            ),
            // Rows set aside leave the log: a later owner of the shard reads from the stored
            // cursor, which may be behind them, and must not read them again as new.
            hold: format!(
                "WITH moved AS (
                    DELETE FROM {outbox} o
                    USING unnest($1::int[], $2::text[], $3::bigint[], $4::int[])
                        AS u(shard, xid, seq, attempts)
                    WHERE o.shard = u.shard AND o.xid = u.xid::xid8 AND o.seq = u.seq
                    RETURNING {o_cols}, u.attempts)
                 INSERT INTO {held} ({row_cols}, attempts)
                 SELECT {row_cols}, attempts FROM moved
                 ON CONFLICT (seq) DO NOTHING"
            ),
            // Fenced by the epoch, and a cursor never moves back. The row locks taken here
            // keep the shards until the commit: a takeover waits for it.
            move_cursors: format!(
                "UPDATE {shards} s SET
                    cursor_xid = greatest(s.cursor_xid, u.xid::xid8),
                    cursor_seq = CASE WHEN (u.xid::xid8, u.seq) > (s.cursor_xid, s.cursor_seq)
                                      THEN u.seq ELSE s.cursor_seq END,
                    moved_at = CASE WHEN (u.xid::xid8, u.seq) > (s.cursor_xid, s.cursor_seq)
                                    THEN now() ELSE s.moved_at END
                 FROM unnest($1::int[], $2::text[], $3::bigint[], $4::bigint[])
                     AS u(shard, xid, seq, epoch)
                 WHERE s.shard = u.shard AND s.epoch = u.epoch AND s.owner = $5
                 RETURNING s.shard"
            ),
            dead_from_log: format!(
                "WITH moved AS (
                    DELETE FROM {outbox} o
                    USING unnest($1::int[], $2::text[], $3::bigint[], $4::int[], $5::text[])
                        AS u(shard, xid, seq, attempts, error)
                    WHERE o.shard = u.shard AND o.xid = u.xid::xid8 AND o.seq = u.seq
                    RETURNING {o_cols}, u.attempts, u.error)
                 INSERT INTO {dead} ({row_cols}, attempts, last_error)
                 SELECT {row_cols}, attempts, error FROM moved
                 ON CONFLICT (seq) DO NOTHING"
            ),
            dead_from_held: format!(
                "WITH gone AS (
                    DELETE FROM {held} h USING unnest($1::bigint[], $2::int[], $3::text[])
                        AS u(seq, attempts, error)
                    WHERE h.seq = u.seq RETURNING h.*, u.attempts AS tries, u.error)
                 INSERT INTO {dead} ({row_cols}, attempts, last_error)
                 SELECT {row_cols}, tries, error FROM gone
                 ON CONFLICT (seq) DO NOTHING"
            ),
            park: format!(
                "INSERT INTO {parked} (partition_key, dead_letter_id, shard)
                 SELECT * FROM unnest($1::text[], $2::uuid[], $3::int[])
                 ON CONFLICT (partition_key) DO UPDATE SET draining = false,
                    dead_letter_id = excluded.dead_letter_id"
            ),
            delete_held: format!("DELETE FROM {held} WHERE seq = ANY($1)"),
            unpark: format!(
                "DELETE FROM {parked} p WHERE p.partition_key = $1 AND p.draining
                   AND p.generation = $2
                   AND NOT EXISTS (SELECT 1 FROM {held} h WHERE h.partition_key = $1)"
            ),
            // Rows past each shard's position: this relay's read position for its shards
            // (what it has read is counted from memory), the stored cursor for the others.
            // Retries: held rows not read into memory (`$5`) that failed before.
            stats: format!(
                "SELECT coalesce(sum(c.n), 0)::bigint, min(c.oldest),
                        (SELECT count(*) FROM {held} WHERE seq <> ALL($4)),
                        (SELECT min(created_at) FROM {held} WHERE seq <> ALL($4)),
                        (SELECT count(*) FROM {dead}), (SELECT count(*) FROM {parked}),
                        (SELECT count(*) FROM {held} WHERE seq <> ALL($5) AND attempts > 0)
                 FROM {shards} s
                 LEFT JOIN unnest($1::int[], $2::text[], $3::bigint[]) AS p(shard, xid, seq)
                     ON p.shard = s.shard
                 CROSS JOIN LATERAL (
                    SELECT count(*) AS n, min(o.created_at) AS oldest FROM {outbox} o
                    WHERE o.shard = s.shard
                      AND (o.xid, o.seq) > (coalesce(p.xid::xid8, s.cursor_xid),
                                            coalesce(p.seq, s.cursor_seq))) c"
            ),
            // Up to `$3` rows per shard behind its stored cursor, oldest first along the
            // primary key: one short transaction each time (see `maintain`).
            cleanup: format!(
                "DELETE FROM {outbox} o USING {shards} s CROSS JOIN LATERAL (
                    SELECT x.xid, x.seq FROM {outbox} x
                    WHERE x.shard = s.shard AND (x.xid, x.seq) <= (s.cursor_xid, s.cursor_seq)
                      AND ($2::bigint IS NULL OR x.created_at < now() - $2 {ms})
                    ORDER BY x.xid, x.seq LIMIT $3) d
                 WHERE s.shard = ANY($1) AND o.shard = s.shard AND o.xid = d.xid AND o.seq = d.seq"
            ),
            forget_old_relays: format!(
                "DELETE FROM {relays} WHERE expires_at < now() - interval '1 hour'"
            ),
            // Committed rows not yet readable, and the transaction that holds the horizon
            // (a backend of this database, or a prepared transaction) with its age. `$1`: the
            // horizon as the replica sees it, when the rows are read there.
            lag: format!(
                "WITH horizon AS MATERIALIZED (
                    SELECT coalesce($1::text::xid8, x.h) AS h FROM ({HORIZON}) x)
                 SELECT (SELECT coalesce(sum(c.n), 0)::bigint FROM {shards} s CROSS JOIN LATERAL (
                            SELECT count(*) AS n FROM {outbox} o
                            WHERE o.shard = s.shard AND o.xid >= horizon.h) c),
                        (SELECT a.pid FROM pg_stat_activity a WHERE a.backend_xid = xid(horizon.h)
                         LIMIT 1),
                        (SELECT extract(epoch FROM statement_timestamp() - a.xact_start)::float8
                         FROM pg_stat_activity a WHERE a.backend_xid = xid(horizon.h) LIMIT 1),
                        (SELECT p.gid FROM pg_prepared_xacts p WHERE p.transaction = xid(horizon.h)
                         LIMIT 1)
                 FROM horizon"
            ),
            horizon: format!("SELECT x.h::text FROM ({HORIZON}) x"),
            moved: t.moved_log_sql(),
            // A key's rows waiting behind it: held aside, and past the stored cursor of the
            // key's shard (the generated column's hash). A held row has left the log.
            waiting_behind: format!(
                "WITH k AS (SELECT ((hashtext($1) % c.n) + c.n) % c.n AS shard
                            FROM (SELECT count(*)::int AS n FROM {shards}) c)
                 SELECT ((SELECT count(*) FROM {held} WHERE partition_key = $1)
                      + (SELECT count(*) FROM k JOIN {shards} s ON s.shard = k.shard
                         JOIN {outbox} o ON o.shard = k.shard
                         WHERE o.partition_key = $1
                           AND (o.xid, o.seq) > (s.cursor_xid, s.cursor_seq)))::bigint"
            ),
            // With per-key order (`$2`), a keyed dead letter goes back to the held rows at
            // its original place and its key drains (the owner delivers the held rows in
            // order, then unparks it) once no other dead letter of the key remains; a key
            // not parked (released and drained since) drains at once, as a released key's
            // rows flow without its other dead letters. Without
            // a key or key order, order does not matter: it is appended to the log again.
            replay: format!(
                "WITH back AS (DELETE FROM {dead} d WHERE d.id = ANY($1) RETURNING d.*),
                 kept AS (
                    INSERT INTO {held} ({row_cols}, attempts)
                    SELECT {row_cols}, 0 FROM back WHERE partition_key IS NOT NULL AND $2
                    ON CONFLICT (seq) DO NOTHING
                    RETURNING partition_key, id, shard),
                 logged AS (
                    INSERT INTO {outbox} (id, topic, partition_key, payload, headers,
                           traceparent, tracestate, created_at)
                    SELECT id, topic, partition_key, payload, headers, traceparent, tracestate,
                           created_at FROM back WHERE partition_key IS NULL OR NOT $2
                    RETURNING 1),
                 parks AS (
                    INSERT INTO {parked} AS p (partition_key, dead_letter_id, shard, draining)
                    SELECT DISTINCT ON (k.partition_key) k.partition_key, k.id, k.shard, true
                    FROM kept k ORDER BY k.partition_key
                    ON CONFLICT (partition_key) DO UPDATE SET generation = p.generation + 1,
                       draining = p.draining OR NOT EXISTS (
                           SELECT 1 FROM {dead} d
                           WHERE d.partition_key = p.partition_key AND d.id <> ALL($1))
                    RETURNING 1)
                 SELECT count(*) + 0 * (SELECT count(*) FROM logged) + 0 * (SELECT count(*) FROM parks)
                 FROM back"
            ),
            release: format!(
                "UPDATE {parked} SET draining = true, generation = generation + 1
                 WHERE partition_key = $1 AND NOT draining"
            ),
            topic_stats: format!(
                "WITH live AS (
                    SELECT topic, count(*) AS pending, min(created_at) AS oldest FROM (
                        SELECT o.topic, o.created_at FROM {outbox} o JOIN {shards} s ON s.shard = o.shard
                        WHERE (o.xid, o.seq) > (s.cursor_xid, s.cursor_seq)
                        UNION ALL SELECT topic, created_at FROM {held}) x
                    GROUP BY topic),
                 retrying AS (SELECT topic, count(*) AS retrying FROM {held}
                    WHERE seq <> ALL($1) AND attempts > 0 GROUP BY topic),
                 dead AS (SELECT topic, count(*) AS dead FROM {dead} GROUP BY topic)
                 SELECT coalesce(live.topic, dead.topic) AS topic, coalesce(pending, 0) AS pending,
                        oldest, 0::bigint AS in_flight, coalesce(retrying.retrying, 0) AS retrying,
                        coalesce(dead.dead, 0) AS dead
                 FROM live FULL JOIN dead ON live.topic = dead.topic
                 LEFT JOIN retrying ON retrying.topic = live.topic ORDER BY 1"
            ),
        }
    }
}
