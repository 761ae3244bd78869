//! Log mode (`[storage] mode = "log"`): the outbox is an append-only log that relays only
//! read. Each row belongs to one of S shards; a relay owns some shards (a lease on the
//! database clock, fenced by an epoch bumped at every change of owner) and reads each past
//! its cursor `(xid, seq)`, only rows whose transaction id is below the oldest transaction
//! of the database still running ([`HORIZON`]), in `(xid, seq)` order. What it has read
//! but not settled is kept here, in memory: in flight under a claim token, waiting to retry,
//! or ready. The stored cursor moves to just before the oldest row not settled. A parked
//! key's rows move to `<table>_held`, and dead letters to `<table>_dead_letters`: both
//! leave the log, so the cursor can pass them and no later reader of the shard (after a
//! restart or a hand-over) sees them again as new. See docs/ARCHITECTURE.md
//! (log mode) for why the horizon rule loses nothing.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, btree_map};
use std::iter::Peekable;
use std::time::Duration;

use outbox_core::{Claim, ClaimToken, Error, Message, QueueStats, Result, Settlement, TopicStats};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgRow};
use tokio::time::Instant;
use uuid::Uuid;

use crate::error::db_error;
use crate::sql::MESSAGE_COLUMNS;
use crate::{OutboxTable, PostgresConfig, rows};

/// How far log mode's readable horizon trails the log ([`crate::PgStorage::horizon_lag`]):
/// committed rows that wait for an older transaction to end, and that transaction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HorizonLag {
    /// Committed rows at or above the horizon: not readable until it moves.
    pub waiting_rows: u64,
    /// The backend (`pg_stat_activity.pid`) whose open transaction holds the horizon, if
    /// one does.
    pub blocker_pid: Option<i32>,
    /// How long that transaction has been open.
    pub blocker_age: Option<Duration>,
    /// Or the prepared transaction (two-phase commit) that holds it, by its `gid`.
    pub blocker_prepared: Option<String>,
}

impl HorizonLag {
    /// What holds the horizon, for people: `backend pid 4242` or `prepared transaction
    /// 'gid'`; `None` when nothing identifiable does (or a replica has not replayed yet).
    pub fn held_by(&self) -> Option<String> {
        match (&self.blocker_pid, &self.blocker_prepared) {
            (Some(pid), _) => Some(format!("backend pid {pid}")),
            (None, Some(gid)) => Some(format!("prepared transaction '{gid}'")),
            (None, None) => None,
        }
    }
}

/// A row's place in the log: (transaction id, seq).
type Pos = (u64, i64);

/// How often a claiming relay renews its shards, counts the relays and rebalances (more
/// often with a lease under 3 s: three times per lease). A round holds the shards for the
/// lease plus this interval, so every claim made before the next round ends (its lease
/// counted from the claim) before its shards' lease does; renewing a claim (`extend_lease`)
/// renews its shards. Four times a second, so that relays joining or leaving see their
/// shares within a quarter of a second (a round is one short transaction).
const ROUND_EVERY: Duration = Duration::from_millis(250);

/// A relay handing a shard over gives it up at its first claim after the shard has nothing
/// out, at most this often, rather than at its next round.
const HAND_OVER_EVERY: Duration = Duration::from_millis(20);

/// The most rows a relay keeps read but unsettled per shard: this many claims' limits, and
/// at least [`BUFFER_MIN`]. Rows behind a shard's full buffer wait unread.
const BUFFER_CLAIMS: usize = 4;
const BUFFER_MIN: usize = 256;

/// The most delivered rows one cleanup statement deletes (split over the owned shards), so
/// that each is a short transaction.
pub(crate) const CLEANUP_CHUNK: usize = 2_000;

/// Where a row read by this relay stands.
#[derive(Debug, Clone, Copy)]
enum State {
    Ready,
    InFlight { token: Uuid, until: Instant },
    Waiting { at: Instant },
}

/// A row read and not yet settled.
struct Entry {
    message: Message,
    /// Read from the held rows of a draining key (before the cursor), not from the log.
    held: bool,
    state: State,
}

/// A shard this relay owns.
struct Shard {
    epoch: i64,
    /// The stored cursor: every row at or before it is settled.
    cursor: Pos,
    /// The last row read from the log.
    read: Pos,
    entries: BTreeMap<Pos, Entry>,
    /// Rows delivered past the stored cursor (an older row of the shard is not settled
    /// yet): they leave the log when the shard is given up, so that its next owner, which
    /// reads from the stored cursor, does not deliver them again.
    delivered: BTreeSet<Pos>,
    /// Keys whose rows after this position (up to `read`) were read and let go to make
    /// room (the key is stopped behind a row that is not due: see [`LogEngine::evict`]):
    /// they stay in the log, unsettled, the cursor stays at or before the position, later
    /// rows of the key are let go as they are read, and the key's rows are read again
    /// from here once the key has few left in memory.
    evicted: HashMap<String, Pos>,
    /// Above this relay's fair share: read and hand out nothing more, give it up once
    /// nothing of it is out under a live claim (so the next owner delivers nothing again).
    /// What it read and did not hand out, rows waiting to retry among them, the next owner
    /// reads again from the stored cursor.
    leaving: bool,
}

impl Shard {
    /// Moves the cursor (in memory, once written) and forgets the deliveries it passed.
    fn move_cursor(&mut self, to: Pos) {
        self.cursor = self.cursor.max(to);
        let cursor = self.cursor;
        self.delivered.retain(|p| *p > cursor);
    }
    /// Just before the oldest log row not settled, or the last row read.
    /// (Never past the rows of an evicted key.)
    fn cursor_after(&self, removed: &HashSet<Pos>) -> Pos {
        let in_memory = self
            .entries
            .iter()
            .find(|(pos, e)| !e.held && !removed.contains(pos))
            .map(|(&(xid, seq), _)| (xid, seq - 1))
            .unwrap_or(self.read);
        self.evicted.values().copied().fold(in_memory, Pos::min)
    }
}

/// A parked key of a shard this relay owns.
#[derive(Debug, Clone, Copy)]
struct Parked {
    draining: bool,
    generation: i64,
    /// The key's shard: what is known of the key goes with the shard when it is dropped,
    /// so that a shard taken again loads a draining key's held rows again.
    shard: i32,
}

/// A row kept aside in the held rows while a claim still held it or it waited to retry:
/// its state carries over when the key drains, and a late settlement of that claim is
/// still accepted, as in lease mode while nobody has claimed the row since.
struct Aside {
    shard: i32,
    seq: i64,
    key: String,
    state: State,
    attempts: u32,
}

/// A read of the log for the next claim, running in the background (see
/// [`LogEngine::start_read`]).
struct ReadAhead {
    /// Each shard's epoch and read position when the read started.
    from: HashMap<i32, (i64, Pos)>,
    task: tokio::task::JoinHandle<Result<Vec<ReadRow>>>,
}

/// A row read from the log: its shard, its place, the message.
type ReadRow = (i32, Pos, Message);

/// What [`read_rows`] reads: per shard, after which place and how many rows.
struct ReadPlan {
    shards: Vec<i32>,
    xids: Vec<String>,
    seqs: Vec<i64>,
    room: Vec<i64>,
    from: HashMap<i32, (i64, Pos)>,
}

#[derive(Default)]
struct Inner {
    /// By message id.
    aside: HashMap<Uuid, Aside>,
    shards: BTreeMap<i32, Shard>,
    /// Where each entry is.
    ids: HashMap<Uuid, (i32, Pos)>,
    parked: HashMap<String, Parked>,
    last_round: Option<Instant>,
    /// Until when the last round holds the shards (this relay's clock): a claim whose lease
    /// would outlast it runs a round first, so a claim's shards stay held until its lease
    /// has run out, whatever leases claims ask for.
    held_until: Option<Instant>,
    /// The primary's WAL position when this relay last took shards. A replica is read only
    /// once it has replayed that far: the shards' previous owner may have moved rows out
    /// of the log (held, dead-lettered) that a replica behind would still show.
    replica_from: Option<String>,
    /// The rows for the next claim, being read while this claim's batch goes out.
    ahead: Option<ReadAhead>,
}

impl Inner {
    fn drop_shard(&mut self, shard: i32) {
        self.aside.retain(|_, a| a.shard != shard);
        self.parked.retain(|_, p| p.shard != shard);
        if let Some(s) = self.shards.remove(&shard) {
            for e in s.entries.values() {
                self.ids.remove(&e.message.id);
            }
        }
    }

    /// Remembers the state of an entry moved to the held rows, unless it is simply ready.
    fn set_aside(&mut self, shard: i32, pos: Pos, state: State, attempts: u32, token: &ClaimToken) {
        let Some(e) = self.shards.get(&shard).and_then(|s| s.entries.get(&pos)) else {
            return;
        };
        let Some(key) = e.message.key.clone() else {
            return;
        };
        let keep = match state {
            State::Ready => false,
            State::InFlight { token: t, .. } => t != token.0,
            State::Waiting { .. } => true,
        };
        if keep {
            self.aside.insert(
                e.message.id,
                Aside {
                    shard,
                    seq: pos.1,
                    key,
                    state,
                    attempts,
                },
            );
        }
    }

    /// The aside row `id` if it is in flight under `token`.
    fn aside_held_by(&self, id: &Uuid, token: &ClaimToken) -> bool {
        self.aside
            .get(id)
            .is_some_and(|a| matches!(a.state, State::InFlight { token: t, .. } if t == token.0))
    }

    /// Whether a live claim holds a row of `shard` (read from the log, or set aside while
    /// the claim held it): a shard being handed over waits for it to be settled.
    fn has_live_claims(&self, shard: i32, now: Instant) -> bool {
        let live = |state: &State| matches!(state, State::InFlight { until, .. } if *until > now);
        self.shards
            .get(&shard)
            .is_some_and(|s| s.entries.values().any(|e| live(&e.state)))
            || self
                .aside
                .values()
                .any(|a| a.shard == shard && live(&a.state))
    }

    /// The entry `id` if it is in flight under `token`.
    fn held_by(&self, id: &Uuid, token: &ClaimToken) -> Option<(i32, Pos)> {
        let &(shard, pos) = self.ids.get(id)?;
        let entry = self.shards.get(&shard)?.entries.get(&pos)?;
        match entry.state {
            State::InFlight { token: t, .. } if t == token.0 => Some((shard, pos)),
            _ => None,
        }
    }
}

/// The SQL of log mode for one table.
pub(crate) struct LogSql {
    heartbeat: String,
    renew: String,
    counts: String,
    acquire: String,
    give_up: String,
    forget_relay: String,
    read: String,
    parked_in: String,
    reload: String,
    held_of_key: String,
    hold: String,
    move_cursors: String,
    dead_from_log: String,
    dead_from_held: String,
    park: String,
    delete_held: String,
    unpark: String,
    stats: String,
    cleanup: String,
    forget_old_relays: String,
    lag: String,
    horizon: String,
    waiting_behind: String,
    /// See [`OutboxTable::moved_log_sql`].
    moved: String,
    // The operator's side (`admin.rs`).
    pub(crate) replay: String,
    pub(crate) release: String,
    topic_stats: String,
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
const HORIZON: &str = "SELECT CASE WHEN pg_is_in_recovery()
        THEN pg_snapshot_xmin(pg_current_snapshot())
        ELSE coalesce(
            (SELECT min(x) FROM pg_snapshot_xip(pg_current_snapshot()) AS x
             WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                               WHERE a.backend_xid = xid(x)
                                 AND a.datname IS DISTINCT FROM current_database())),
            pg_snapshot_xmax(pg_current_snapshot())) END AS h";

/// Binds of a set of positions: shards, transaction ids (as text: sqlx has no `xid8`), seqs.
fn split(positions: &[(i32, Pos)]) -> (Vec<i32>, Vec<String>, Vec<i64>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for &(shard, (xid, seq)) in positions {
        out.0.push(shard);
        out.1.push(xid.to_string());
        out.2.push(seq);
    }
    out
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn parse_xid(text: &str) -> Result<u64> {
    text.parse()
        .map_err(|_| Error::temporary(format!("postgres: `{text}` is not a transaction id")))
}

impl LogSql {
    fn new(t: &OutboxTable) -> Self {
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
        let o_msg = cols
            .split(", ")
            .map(|c| format!("o.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let o_cols = row_cols
            .split(", ")
            .map(|c| format!("o.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
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

/// The log-mode engine of one [`crate::PgStorage`]: one relay's shards and what it has read.
pub(crate) struct LogEngine {
    /// This relay's name in the shards table: unique per storage instance.
    owner: String,
    pub(crate) sql: LogSql,
    /// `start = "now"`: a shard never owned before starts at the horizon.
    start_now: bool,
    inner: tokio::sync::Mutex<Inner>,
    /// Held by every write to the shards table, taken after `inner` when both are: a
    /// settlement of deliveries moves its cursors without holding `inner` (so the worker's
    /// next claim goes on meanwhile), and this relay's writes still never overlap: no
    /// lock-order deadlock between its own statements, and no give-up passes a cursor write.
    writes: tokio::sync::Mutex<()>,
    /// Added to the clock of in-memory times (leases, retry delays): for tests only.
    offset: std::sync::Mutex<Duration>,
    /// [`BUFFER_MIN`], lowered by tests so that small queues fill a buffer.
    buffer_min: std::sync::atomic::AtomicUsize,
}

impl LogEngine {
    pub(crate) fn new(table: &OutboxTable, start_now: bool) -> Self {
        LogEngine {
            owner: format!("relay-{}", Uuid::now_v7()),
            sql: LogSql::new(table),
            start_now,
            inner: tokio::sync::Mutex::new(Inner::default()),
            writes: tokio::sync::Mutex::new(()),
            offset: std::sync::Mutex::new(Duration::ZERO),
            buffer_min: std::sync::atomic::AtomicUsize::new(BUFFER_MIN),
        }
    }

    /// This relay's name in the shards table.
    pub(crate) fn owner(&self) -> &str {
        &self.owner
    }

    fn now(&self) -> Instant {
        Instant::now() + *self.offset.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most rows a shard keeps read but unsettled, for claims of `limit`.
    fn buffer_cap(&self, limit: usize) -> usize {
        let min = self.buffer_min.load(std::sync::atomic::Ordering::Relaxed);
        limit.saturating_mul(BUFFER_CLAIMS).max(min)
    }

    /// Tests only: a smaller [`BUFFER_MIN`].
    pub(crate) fn set_buffer_min(&self, rows: usize) {
        self.buffer_min
            .store(rows.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Moves the in-memory clock ahead (tests: the conformance suite's `advance`).
    pub(crate) fn advance(&self, by: Duration) {
        *self.offset.lock().unwrap_or_else(|e| e.into_inner()) += by;
    }

    /// The shards this relay owns, with their epochs.
    pub(crate) async fn owned(&self) -> Vec<(i32, i64)> {
        let inner = self.inner.lock().await;
        inner.shards.iter().map(|(s, sh)| (*s, sh.epoch)).collect()
    }

    /// Renews owned shards (dropping those another relay took), records this relay as
    /// alive, and takes free or expired shards up to a fair share (shards ÷ live relays,
    /// rounded up), giving up idle ones above it.
    async fn round(&self, pool: &PgPool, inner: &mut Inner, lease: Duration) -> Result<()> {
        let fail = |e| db_error("cannot renew or take shards", e);
        if inner.last_round.is_none() {
            self.refuse_a_moved_log(pool).await?;
        }
        let _writing = self.writes.lock().await;
        let ms = millis(lease);
        let asked_at = self.now();
        let mut tx = pool.begin().await.map_err(fail)?;
        sqlx::query(&self.sql.heartbeat)
            .bind(&self.owner)
            .bind(ms)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
        let (owned, epochs): (Vec<i32>, Vec<i64>) =
            inner.shards.iter().map(|(s, sh)| (*s, sh.epoch)).unzip();
        let kept: Vec<i32> = sqlx::query_scalar(&self.sql.renew)
            .bind(&owned)
            .bind(&epochs)
            .bind(ms)
            .bind(&self.owner)
            .fetch_all(&mut *tx)
            .await
            .map_err(fail)?;
        let (total, live): (i64, i64) = sqlx::query_as(&self.sql.counts)
            .fetch_one(&mut *tx)
            .await
            .map_err(fail)?;
        let live = live.max(1);
        let fair = usize::try_from((total + live - 1) / live).unwrap_or(0);
        let mut acquired: Vec<(i32, i64, String, i64, String)> = Vec::new();
        let mut given_up: Vec<i32> = Vec::new();
        let mut leaving: HashSet<i32> = HashSet::new();
        if kept.len() < fair {
            acquired = sqlx::query_as(&self.sql.acquire)
                .bind(&self.owner)
                .bind(ms)
                .bind(i64::try_from(fair - kept.len()).unwrap_or(0))
                .bind(&kept)
                .bind(self.start_now)
                .fetch_all(&mut *tx)
                .await
                .map_err(fail)?;
        } else if kept.len() > fair {
            // Hand over the shards already leaving, then those with the least read: they
            // stop reading and handing out now, and are given up once no live claim holds
            // a row of theirs (a row waiting to retry does not keep them: it is read again
            // from the stored cursor).
            let mut by_load: Vec<(bool, usize, i32)> = kept
                .iter()
                .filter_map(|s| {
                    let sh = inner.shards.get(s)?;
                    Some((!sh.leaving, sh.entries.len(), *s))
                })
                .collect();
            by_load.sort_unstable();
            leaving = by_load
                .iter()
                .take(kept.len() - fair)
                .map(|(_, _, s)| *s)
                .collect();
            given_up = leaving
                .iter()
                .copied()
                .filter(|s| !inner.has_live_claims(*s, asked_at))
                .collect();
            self.give_up_in(&mut tx, inner, &given_up).await?;
        }
        tx.commit().await.map_err(fail)?;
        let kept: HashSet<i32> = kept.into_iter().collect();
        for shard in owned {
            if !kept.contains(&shard) {
                tracing::warn!(relay = %self.owner, shard, "another relay took this shard over; dropping what was read of it");
                inner.drop_shard(shard);
            }
        }
        for shard in given_up {
            tracing::debug!(relay = %self.owner, shard, "gave a shard up (more relays are alive)");
            inner.drop_shard(shard);
        }
        for (shard, s) in inner.shards.iter_mut() {
            s.leaving = leaving.contains(shard);
        }
        for (shard, epoch, xid, seq, lsn) in acquired {
            let cursor = (parse_xid(&xid)?, seq);
            inner.replica_from = Some(lsn);
            tracing::debug!(relay = %self.owner, shard, epoch, "took a shard");
            inner.shards.insert(
                shard,
                Shard {
                    epoch,
                    cursor,
                    read: cursor,
                    entries: BTreeMap::new(),
                    delivered: BTreeSet::new(),
                    evicted: HashMap::new(),
                    leaving: false,
                },
            );
        }
        inner.last_round = Some(asked_at);
        inner.held_until = Some(asked_at + lease);
        Ok(())
    }

    /// Refuses to read a log whose transaction ids are ahead of this cluster's (moved from
    /// another cluster): the cursors would pass every new row (see
    /// [`OutboxTable::moved_log_sql`]). A schema error, so the relay waits, retrying, until
    /// `outbox migrate` rebases it.
    async fn refuse_a_moved_log(&self, pool: &PgPool) -> Result<()> {
        let moved: Option<(i32, String, String)> = sqlx::query_as(&self.sql.moved)
            .fetch_optional(pool)
            .await
            .map_err(|e| db_error("cannot check the log's transaction ids", e))?;
        match moved {
            None => Ok(()),
            Some((shard, ahead, next)) => Err(Error::schema(format!(
                "postgres: the log table's shard {shard} is at transaction id {ahead}, ahead of \
                 this cluster's next id {next}: the table was moved from another cluster \
                 (pg_dump and restore, logical replication). Reading it would pass every new \
                 message. Stop the relays and run `outbox migrate`, which rebases the log onto \
                 this cluster's ids (docs/storage/postgres.md, moving a log table)"
            ))),
        }
    }

    /// Reads which keys of the owned shards are parked; loads the held rows of keys that
    /// became draining (released or replayed) or were replayed again; unparks draining keys
    /// whose held rows are all settled.
    async fn refresh_parked(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        rows: Vec<(String, bool, i64, i32)>,
    ) -> Result<()> {
        let fail = |e| db_error("cannot read parked keys", e);
        let mut seen = HashSet::new();
        for (key, draining, generation, shard) in rows {
            let before = inner.parked.get(&key).copied();
            let load = draining && before.is_none_or(|p| !p.draining || p.generation != generation);
            if load {
                let held = sqlx::query(&self.sql.held_of_key)
                    .bind(&key)
                    .fetch_all(pool)
                    .await
                    .map_err(fail)?;
                for row in &held {
                    let (shard, pos) = position(row)?;
                    let mut message = rows::message(row)?;
                    if let Some(s) = inner.shards.get_mut(&shard)
                        && let std::collections::btree_map::Entry::Vacant(slot) =
                            s.entries.entry(pos)
                    {
                        let mut state = State::Ready;
                        if let Some(a) = inner.aside.remove(&message.id) {
                            state = a.state;
                            message.attempts = a.attempts;
                        }
                        inner.ids.insert(message.id, (shard, pos));
                        slot.insert(Entry {
                            message,
                            held: true,
                            state,
                        });
                    }
                }
            }
            seen.insert(key.clone());
            inner.parked.insert(
                key,
                Parked {
                    draining,
                    generation,
                    shard,
                },
            );
        }
        inner.parked.retain(|k, _| seen.contains(k));
        // A draining key with nothing held left in memory is unparked (the statement checks
        // the table too, and that no replay came meanwhile).
        let done: Vec<(String, i64)> = inner
            .parked
            .iter()
            .filter(|(key, p)| {
                p.draining
                    && !inner.shards.values().any(|s| {
                        s.entries
                            .values()
                            .any(|e| e.held && e.message.key.as_deref() == Some(key.as_str()))
                    })
            })
            .map(|(k, p)| (k.clone(), p.generation))
            .collect();
        for (key, generation) in done {
            let gone = sqlx::query(&self.sql.unpark)
                .bind(&key)
                .bind(generation)
                .execute(pool)
                .await
                .map_err(fail)?;
            if gone.rows_affected() > 0 {
                inner.parked.remove(&key);
            }
        }
        Ok(())
    }

    /// Whether `replica` has replayed the primary's WAL up to where this relay last took
    /// shards (see `Inner::replica_from`); forgets that position once it has.
    async fn replica_caught_up(&self, replica: &PgPool, inner: &mut Inner) -> Result<bool> {
        let Some(lsn) = &inner.replica_from else {
            return Ok(true);
        };
        // NULL on a server that is not a standby: it has everything.
        let caught_up: bool = sqlx::query_scalar(
            "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, true)",
        )
        .bind(lsn)
        .fetch_one(replica)
        .await
        .map_err(|e| db_error("cannot read the replica's replay position", e))?;
        if caught_up {
            inner.replica_from = None;
        }
        Ok(caught_up)
    }

    /// The parked keys of the owned shards, as stored on the primary.
    async fn parked_rows(
        &self,
        pool: &PgPool,
        inner: &Inner,
    ) -> Result<Vec<(String, bool, i64, i32)>> {
        let owned: Vec<i32> = inner.shards.keys().copied().collect();
        sqlx::query_as(&self.sql.parked_in)
            .bind(&owned)
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot read parked keys", e))
    }

    /// What to read next: each shard's read position, as many rows as fill its buffer once
    /// `leaving` of its rows (per shard: the batch going out) are gone. `None` when every
    /// buffer is full.
    fn plan_read(
        &self,
        inner: &Inner,
        limit: usize,
        leaving: &HashMap<i32, usize>,
    ) -> Option<ReadPlan> {
        let cap = self.buffer_cap(limit);
        let mut want: Vec<(i32, Pos)> = Vec::new();
        let mut room: Vec<i64> = Vec::new();
        let mut from = HashMap::new();
        for (&shard, s) in &inner.shards {
            let staying = s
                .entries
                .len()
                .saturating_sub(leaving.get(&shard).copied().unwrap_or(0));
            if staying < cap && !s.leaving {
                want.push((shard, s.read));
                room.push(i64::try_from(cap - staying).unwrap_or(i64::MAX));
                from.insert(shard, (s.epoch, s.read));
            }
        }
        if want.is_empty() {
            return None;
        }
        let (shards, xids, seqs) = split(&want);
        Some(ReadPlan {
            shards,
            xids,
            seqs,
            room,
            from,
        })
    }

    /// Starts reading the rows for the next claim in the background, while this claim's
    /// batch goes out: the next claim only puts them in memory.
    fn start_read(
        &self,
        source: &PgPool,
        inner: &mut Inner,
        limit: usize,
        leaving: &HashMap<i32, usize>,
    ) {
        let Some(plan) = self.plan_read(inner, limit, leaving) else {
            return;
        };
        let (source, sql) = (source.clone(), self.sql.read.clone());
        let from = plan.from.clone();
        let task = tokio::spawn(async move { read_rows(&source, &sql, &plan).await });
        inner.ahead = Some(ReadAhead { from, task });
    }

    /// Puts rows read (see [`plan_read`](Self::plan_read)) into memory; rows of parked keys
    /// are kept aside in the held rows at once (fenced, on the primary `pool`), before the
    /// cursor can move past them. Which keys are parked comes from memory, refreshed from
    /// the primary. Only the rows of shards still at the epoch and read position they were
    /// read from (`from`) are taken: a shard taken over, or handed over and read back from
    /// an earlier position, since, is read again.
    async fn take(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        rows: Vec<ReadRow>,
        from: &HashMap<i32, (i64, Pos)>,
    ) -> Result<()> {
        let fail = |e| db_error("cannot read the outbox log", e);
        let current: HashSet<i32> = from
            .iter()
            .filter(|(shard, at)| {
                inner
                    .shards
                    .get(shard)
                    .is_some_and(|s| (s.epoch, s.read) == **at)
            })
            .map(|(shard, _)| *shard)
            .collect();
        // Write the held rows first, then change memory: a failure on the way must leave
        // no row behind the read position that is neither in memory nor kept aside.
        let read: Vec<(i32, Pos, Message, bool)> = rows
            .into_iter()
            .filter(|r| current.contains(&r.0))
            .map(|(shard, pos, message)| {
                let parked = message
                    .key
                    .as_ref()
                    .and_then(|k| inner.parked.get(k))
                    .is_some_and(|p| !p.draining);
                (shard, pos, message, parked)
            })
            .collect();
        let hold: Vec<(i32, Pos)> = read.iter().filter(|r| r.3).map(|r| (r.0, r.1)).collect();
        let touched: HashSet<i32> = hold.iter().map(|(s, _)| *s).collect();
        let mut kept = HashSet::new();
        if !hold.is_empty() {
            let _writing = self.writes.lock().await;
            let mut tx = pool.begin().await.map_err(fail)?;
            kept = self
                .fence(&mut tx, inner, &touched, &HashSet::new())
                .await?;
            let hold: Vec<(i32, Pos)> =
                hold.into_iter().filter(|(s, _)| kept.contains(s)).collect();
            let (shards, xids, seqs) = split(&hold);
            sqlx::query(&self.sql.hold)
                .bind(&shards)
                .bind(&xids)
                .bind(&seqs)
                .bind(vec![0_i32; hold.len()])
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
        }
        for (shard, pos, message, parked) in read {
            if touched.contains(&shard) && !kept.contains(&shard) {
                continue;
            }
            let Some(s) = inner.shards.get_mut(&shard) else {
                continue;
            };
            s.read = s.read.max(pos);
            if parked
                || message
                    .key
                    .as_ref()
                    .is_some_and(|k| s.evicted.contains_key(k))
            {
                continue;
            }
            inner.ids.insert(message.id, (shard, pos));
            s.entries.insert(
                pos,
                Entry {
                    message,
                    held: false,
                    state: State::Ready,
                },
            );
        }
        self.forget_lost(inner, &touched, &kept);
        Ok(())
    }

    /// Makes room in full buffers: in a shard holding as many rows as it may
    /// ([`BUFFER_CLAIMS`] claims' limits), a key stopped behind a row that is not due (waiting
    /// to retry, or out under a live claim) keeps its first `max_per_key` rows in memory
    /// and lets the rest go (rows read and never handed out, ready, without attempts): the
    /// shard reads on, so the other keys go on whatever one key's backlog. The cursor stays
    /// before the rows let go; [`reload_evicted`](Self::reload_evicted) reads them again.
    fn evict(&self, inner: &mut Inner, limit: usize, max_per_key: usize) {
        let cap = self.buffer_cap(limit);
        let now = self.now();
        let keep = max_per_key.max(1);
        for s in inner.shards.values_mut() {
            if s.entries.len() < cap {
                continue;
            }
            // Per key: whether it is stopped (its first row here is not due), its rows.
            let mut keys: HashMap<&str, (bool, Vec<Pos>)> = HashMap::new();
            for (&pos, e) in &s.entries {
                let Some(key) = e.message.key.as_deref() else {
                    continue;
                };
                let due = match e.state {
                    State::Ready => true,
                    State::InFlight { until, .. } => until <= now,
                    State::Waiting { at } => at <= now,
                };
                let k = keys.entry(key).or_insert((!due, Vec::new()));
                k.1.push(pos);
            }
            let mut gone: Vec<(String, Pos, Vec<Pos>)> = Vec::new();
            for (key, (stopped, positions)) in keys {
                if !stopped || positions.len() <= keep {
                    continue;
                }
                // The tail after the first `keep`, from its first row that may go: only
                // rows read from the log, ready and never tried, are let go.
                let tail: Vec<Pos> = positions[keep..]
                    .iter()
                    .copied()
                    .skip_while(|p| {
                        s.entries.get(p).is_some_and(|e| {
                            e.held || !matches!(e.state, State::Ready) || e.message.attempts > 0
                        })
                    })
                    .collect();
                let Some(&first) = tail.first() else { continue };
                let free = tail.iter().all(|p| {
                    s.entries.get(p).is_some_and(|e| {
                        !e.held && matches!(e.state, State::Ready) && e.message.attempts == 0
                    })
                });
                if free {
                    gone.push((key.to_string(), (first.0, first.1 - 1), tail));
                }
            }
            for (key, from, tail) in gone {
                for pos in tail {
                    if let Some(e) = s.entries.remove(&pos) {
                        inner.ids.remove(&e.message.id);
                    }
                }
                tracing::debug!(relay = %self.owner, key, "buffer full: let a stopped key's later rows go, to read them again");
                let at = s.evicted.entry(key).or_insert(from);
                *at = (*at).min(from);
            }
        }
    }

    /// Reads again the rows let go of evicted keys that have fewer than `max_per_key` rows
    /// left in memory, up to `max_per_key` each and at most up to the shard's read
    /// position; a key whose rows are all back is no longer evicted. On the primary: a
    /// replica may not have replayed yet every row this relay read there.
    async fn reload_evicted(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        max_per_key: usize,
    ) -> Result<()> {
        let want = max_per_key.max(1);
        let mut plan: Vec<(i32, String, Pos, Pos)> = Vec::new();
        for (&shard, s) in &inner.shards {
            for (key, &from) in &s.evicted {
                let left = s
                    .entries
                    .values()
                    .filter(|e| e.message.key.as_deref() == Some(key.as_str()))
                    .count();
                if left < want {
                    plan.push((shard, key.clone(), from, s.read));
                }
            }
        }
        if plan.is_empty() {
            return Ok(());
        }
        // One more than wanted: fewer back means the key has no rows left out.
        let n = i64::try_from(want + 1).unwrap_or(i64::MAX);
        let rows = sqlx::query(&self.sql.reload)
            .bind(plan.iter().map(|p| p.0).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.1.as_str()).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.2.0.to_string()).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.2.1).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.3.0.to_string()).collect::<Vec<_>>())
            .bind(plan.iter().map(|p| p.3.1).collect::<Vec<_>>())
            .bind(vec![n; plan.len()])
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot read the outbox log", e))?;
        let mut loaded: HashMap<(i32, String), (usize, Pos)> = HashMap::new();
        for row in &rows {
            let (shard, pos) = position(row)?;
            let message = rows::message(row)?;
            let Some(key) = message.key.clone() else {
                continue;
            };
            let Some(s) = inner.shards.get_mut(&shard) else {
                continue;
            };
            let l = loaded.entry((shard, key)).or_insert((0, pos));
            l.0 += 1;
            l.1 = l.1.max(pos);
            if let btree_map::Entry::Vacant(slot) = s.entries.entry(pos) {
                inner.ids.insert(message.id, (shard, pos));
                slot.insert(Entry {
                    message,
                    held: false,
                    state: State::Ready,
                });
            }
        }
        for (shard, key, _, _) in plan {
            let Some(s) = inner.shards.get_mut(&shard) else {
                continue;
            };
            match loaded.get(&(shard, key.clone())) {
                Some(&(count, last)) if count > want => {
                    s.evicted.insert(key, last);
                }
                _ => {
                    s.evicted.remove(&key);
                }
            }
        }
        Ok(())
    }

    /// Keeps aside the rows in memory of parked keys that no live claim holds (a claim whose
    /// lease ran out, rows read just before the key was parked), so that the cursor can move.
    async fn hold_parked(&self, pool: &PgPool, inner: &mut Inner) -> Result<()> {
        // Without a parked key in memory there is nothing to keep aside: skip the walk over
        // every entry read.
        if !inner.parked.values().any(|p| !p.draining) {
            return Ok(());
        }
        let now = self.now();
        let mut hold: Vec<(i32, Pos, i32)> = Vec::new();
        let mut drop: HashSet<Pos> = HashSet::new();
        for (&shard, s) in &inner.shards {
            for (&pos, e) in &s.entries {
                let parked = e
                    .message
                    .key
                    .as_ref()
                    .and_then(|k| inner.parked.get(k))
                    .is_some_and(|p| !p.draining);
                let live = matches!(e.state, State::InFlight { until, .. } if until > now);
                if parked && !live {
                    drop.insert(pos);
                    if !e.held {
                        hold.push((shard, pos, e.message.attempts as i32));
                    }
                }
            }
        }
        if drop.is_empty() {
            return Ok(());
        }
        let fail = |e| db_error("cannot keep a parked key's rows aside", e);
        let touched: HashSet<i32> = hold.iter().map(|(s, _, _)| *s).collect();
        let mut kept = HashSet::new();
        if !hold.is_empty() {
            let _writing = self.writes.lock().await;
            let mut tx = pool.begin().await.map_err(fail)?;
            kept = self.fence(&mut tx, inner, &touched, &drop).await?;
            let hold: Vec<&(i32, Pos, i32)> =
                hold.iter().filter(|(s, _, _)| kept.contains(s)).collect();
            let positions: Vec<(i32, Pos)> = hold.iter().map(|h| (h.0, h.1)).collect();
            let (shards, xids, seqs) = split(&positions);
            sqlx::query(&self.sql.hold)
                .bind(&shards)
                .bind(&xids)
                .bind(&seqs)
                .bind(hold.iter().map(|h| h.2).collect::<Vec<_>>())
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
            tx.commit().await.map_err(fail)?;
        }
        for (&shard, s) in inner.shards.iter_mut() {
            if touched.contains(&shard) && !kept.contains(&shard) {
                continue;
            }
            if kept.contains(&shard) {
                let to = s.cursor_after(&drop);
                s.move_cursor(to);
            }
            let gone: Vec<Pos> = s
                .entries
                .keys()
                .filter(|p| drop.contains(p))
                .copied()
                .collect();
            for pos in gone {
                if let Some(e) = s.entries.remove(&pos) {
                    inner.ids.remove(&e.message.id);
                    if let (Some(key), State::InFlight { .. } | State::Waiting { .. }) =
                        (e.message.key.clone(), e.state)
                    {
                        inner.aside.insert(
                            e.message.id,
                            Aside {
                                shard,
                                seq: pos.1,
                                key,
                                state: e.state,
                                attempts: e.message.attempts,
                            },
                        );
                    }
                }
            }
        }
        self.forget_lost(inner, &touched, &kept);
        Ok(())
    }

    /// Gives `shards` up (those still this relay's, by their epoch), with the rows
    /// delivered past their cursors, in `conn`.
    async fn give_up_in(
        &self,
        conn: &mut sqlx::PgConnection,
        inner: &Inner,
        shards: &[i32],
    ) -> Result<()> {
        let mut epochs = Vec::new();
        let mut delivered: Vec<(i32, Pos)> = Vec::new();
        for shard in shards {
            if let Some(s) = inner.shards.get(shard) {
                epochs.push(s.epoch);
                delivered.extend(s.delivered.iter().map(|p| (*shard, *p)));
            }
        }
        let (d_shards, d_xids, d_seqs) = split(&delivered);
        sqlx::query(&self.sql.give_up)
            .bind(shards)
            .bind(&epochs)
            .bind(&self.owner)
            .bind(&d_shards)
            .bind(&d_xids)
            .bind(&d_seqs)
            .execute(conn)
            .await
            .map_err(|e| db_error("cannot give shards up", e))?;
        Ok(())
    }

    /// Moves the cursors of `touched` shards (to where they stand once `removed` are gone)
    /// under the epoch fence, in `tx`; returns the shards still owned.
    async fn fence(
        &self,
        tx: &mut sqlx::PgConnection,
        inner: &Inner,
        touched: &HashSet<i32>,
        removed: &HashSet<Pos>,
    ) -> Result<HashSet<i32>> {
        let (positions, epochs) = cursor_positions(inner, touched, removed);
        move_cursors(tx, &self.sql.move_cursors, &self.owner, &positions, &epochs).await
    }

    /// Renews the lease of `shards` (those still this relay's, by their epoch) for `lease`
    /// from now on the database clock; drops the others. Returns the shards renewed.
    async fn renew(
        &self,
        pool: &PgPool,
        inner: &mut Inner,
        shards: &HashSet<i32>,
        lease: Duration,
    ) -> Result<HashSet<i32>> {
        let (list, epochs): (Vec<i32>, Vec<i64>) = shards
            .iter()
            .filter_map(|s| inner.shards.get(s).map(|sh| (*s, sh.epoch)))
            .unzip();
        let kept: Vec<i32> = sqlx::query_scalar(&self.sql.renew)
            .bind(&list)
            .bind(&epochs)
            .bind(millis(lease))
            .bind(&self.owner)
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot renew shards", e))?;
        let kept: HashSet<i32> = kept.into_iter().collect();
        self.forget_lost(inner, shards, &kept);
        Ok(kept)
    }

    /// Drops the shards of `touched` that the fence found taken over.
    fn forget_lost(&self, inner: &mut Inner, touched: &HashSet<i32>, kept: &HashSet<i32>) {
        for shard in touched {
            if !kept.contains(shard) && inner.shards.contains_key(shard) {
                tracing::warn!(relay = %self.owner, shard, "shard taken over by another relay: its writes were refused");
                inner.drop_shard(*shard);
            }
        }
    }

    /// A claim: shards renewed and taken on the primary `pool`, rows read from `replica`
    /// when there is one.
    pub(crate) async fn claim(
        &self,
        pool: &PgPool,
        replica: Option<&PgPool>,
        config: &PostgresConfig,
        limit: usize,
        lease: Duration,
    ) -> Result<Claim> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        let now = self.now();
        let every = ROUND_EVERY.min(lease / 3);
        let handing_over = inner
            .shards
            .iter()
            .any(|(shard, s)| s.leaving && !inner.has_live_claims(*shard, now));
        let round_due = inner.last_round.is_none_or(|at| {
            let since = now.saturating_duration_since(at);
            since >= every || (handing_over && since >= HAND_OVER_EVERY)
        }) || inner.held_until.is_none_or(|until| now + lease > until);
        if round_due {
            // Shards are held for a round interval beyond the lease: every claim until the
            // next round then ends, lease and all, before its shards' lease does, so a claim
            // needs no renewal of its own (the worker renews at two thirds of its lease,
            // which renews the shards too, see `extend_lease`).
            self.round(pool, inner, lease + every).await?;
        }
        let token = ClaimToken(Uuid::now_v7());
        if inner.shards.is_empty() {
            return Ok(Claim {
                token,
                messages: Vec::new(),
            });
        }
        // Which keys are parked (from the primary) and the new rows are read at once, on
        // two connections; the parked keys are applied first, so the rows of a parked key
        // go to the held rows. The parked keys are read by every claim: an operator's
        // replay can park a key this relay does not hold parked (its key was released and
        // drained since), and the next claim must put the replayed row ahead of the key's
        // later rows. The rows come from the read started by the last claim when there is
        // one (it ran while that claim's batch went out), else from a read now.
        // A replica is read only once it has replayed what the shards' previous owners
        // wrote (rows they moved out of the log): until then the claim reads nothing, as
        // when the replica lags.
        let source = match replica {
            Some(replica) if !self.replica_caught_up(replica, inner).await? => {
                return Ok(Claim {
                    token,
                    messages: Vec::new(),
                });
            }
            Some(replica) => replica,
            None => pool,
        };
        let read_parked = config.per_key_order;
        let mut ahead = inner.ahead.take();
        let (parked, (rows, from)) = {
            let shared: &Inner = inner;
            tokio::try_join!(
                async {
                    match read_parked {
                        true => self.parked_rows(pool, shared).await.map(Some),
                        false => Ok(None),
                    }
                },
                async {
                    if let Some(ahead) = ahead.as_mut() {
                        let rows = (&mut ahead.task).await.map_err(|e| {
                            Error::temporary(format!("postgres: reading the log stopped: {e}"))
                        })??;
                        return Ok((rows, std::mem::take(&mut ahead.from)));
                    }
                    match self.plan_read(shared, limit, &HashMap::new()) {
                        Some(plan) => {
                            Ok((read_rows(source, &self.sql.read, &plan).await?, plan.from))
                        }
                        None => Ok((Vec::new(), HashMap::new())),
                    }
                },
            )?
        };
        if let Some(parked) = parked {
            self.refresh_parked(pool, inner, parked).await?;
        }
        self.take(pool, inner, rows, &from).await?;
        let max_per_key = if config.per_key_order {
            config.max_per_key
        } else {
            usize::MAX
        };
        if config.per_key_order {
            self.reload_evicted(pool, inner, max_per_key).await?;
            self.hold_parked(pool, inner).await?;
            self.evict(inner, limit, max_per_key);
        }

        let mut picked = pick(inner, limit, max_per_key, config.per_key_order, self.now());
        // The read ahead began before this claim: a claim it does not fill reads again, so
        // that it hands out every row committed before it.
        if ahead.is_some()
            && picked.len() < limit
            && let Some(plan) = self.plan_read(inner, limit, &HashMap::new())
        {
            let rows = read_rows(source, &self.sql.read, &plan).await?;
            self.take(pool, inner, rows, &plan.from).await?;
            if config.per_key_order {
                self.hold_parked(pool, inner).await?;
            }
            picked = pick(inner, limit, max_per_key, config.per_key_order, self.now());
        }
        let now = self.now();
        let until = now + lease;
        let mut messages = Vec::with_capacity(picked.len());
        let mut leaving: HashMap<i32, usize> = HashMap::new();
        for (pos, shard) in picked {
            *leaving.entry(shard).or_default() += 1;
            if let Some(e) = inner
                .shards
                .get_mut(&shard)
                .and_then(|s| s.entries.get_mut(&pos))
            {
                e.state = State::InFlight {
                    token: token.0,
                    until,
                };
                messages.push(e.message.clone());
            }
        }
        // A full batch: more is likely waiting, so read it while this batch goes out.
        if messages.len() == limit {
            self.start_read(source, inner, limit, &leaving);
        }
        Ok(Claim { token, messages })
    }

    pub(crate) async fn settle(
        &self,
        pool: &PgPool,
        config: &PostgresConfig,
        token: &ClaimToken,
        s: &Settlement,
    ) -> Result<u64> {
        let fail = |e| db_error("settling a batch failed", e);
        let mut guard = self.inner.lock().await;
        let mut inner: &mut Inner = &mut guard;
        let now = self.now();
        let find = |inner: &Inner, id: &Uuid| inner.held_by(id, token);
        let delivered: Vec<(i32, Pos)> = s
            .delivered
            .iter()
            .filter_map(|d| find(inner, &d.id))
            .collect();
        let dead: Vec<(i32, Pos, &str)> = s
            .dead
            .iter()
            .filter_map(|d| find(inner, &d.id).map(|(sh, p)| (sh, p, d.error.as_str())))
            .collect();
        let retries: Vec<(i32, Pos, Duration, &str)> = s
            .retries
            .iter()
            .filter_map(|r| find(inner, &r.id).map(|(sh, p)| (sh, p, r.delay, r.error.as_str())))
            .collect();
        let released: Vec<(i32, Pos)> =
            s.released.iter().filter_map(|id| find(inner, id)).collect();
        // Late settlements of rows set aside while this claim held them.
        let aside_delivered: Vec<Uuid> = s
            .delivered
            .iter()
            .map(|d| d.id)
            .filter(|id| inner.aside_held_by(id, token))
            .collect();
        let aside_dead: Vec<(Uuid, &str)> = s
            .dead
            .iter()
            .filter(|d| inner.aside_held_by(&d.id, token))
            .map(|d| (d.id, d.error.as_str()))
            .collect();
        let aside_retries: Vec<(Uuid, Duration)> = s
            .retries
            .iter()
            .filter(|r| inner.aside_held_by(&r.id, token))
            .map(|r| (r.id, r.delay))
            .collect();
        let aside_released: Vec<Uuid> = s
            .released
            .iter()
            .copied()
            .filter(|id| inner.aside_held_by(id, token))
            .collect();
        let count = (delivered.len()
            + dead.len()
            + retries.len()
            + released.len()
            + aside_delivered.len()
            + aside_dead.len()
            + aside_retries.len()
            + aside_released.len()) as u64;

        // What leaves memory: deliveries, dead letters, and (with per-key order) every other
        // row of a dead letter's key, which is kept aside in the held rows.
        // `removed_at`: the same, with each row's shard.
        let mut removed: HashSet<Pos> = HashSet::new();
        let mut removed_at: Vec<(i32, Pos)> = Vec::new();
        for (shard, pos) in delivered
            .iter()
            .copied()
            .chain(dead.iter().map(|(s, p, _)| (*s, *p)))
        {
            if removed.insert(pos) {
                removed_at.push((shard, pos));
            }
        }
        let mut parks: Vec<(String, Uuid, i32)> = Vec::new();
        let mut hold: Vec<(i32, Pos, i32)> = Vec::new();
        if config.per_key_order {
            let mut keys = HashSet::new();
            for &(shard, pos, _) in &dead {
                let Some(e) = inner.shards.get(&shard).and_then(|s| s.entries.get(&pos)) else {
                    continue;
                };
                if let Some(key) = &e.message.key
                    && keys.insert(key.clone())
                {
                    parks.push((key.clone(), e.message.id, shard));
                }
            }
            // Rows of this settlement given back (retried, released) whose key is parked.
            for (shard, pos) in retries
                .iter()
                .map(|(s, p, _, _)| (*s, *p))
                .chain(released.iter().copied())
            {
                if let Some(key) = entry(inner, shard, pos).and_then(|e| e.message.key.as_ref())
                    && inner.parked.get(key).is_some_and(|p| !p.draining)
                {
                    keys.insert(key.clone());
                }
            }
            if !keys.is_empty() {
                for (&shard, sh) in &inner.shards {
                    for (&pos, e) in &sh.entries {
                        let Some(key) = &e.message.key else { continue };
                        if !keys.contains(key) || removed.contains(&pos) {
                            continue;
                        }
                        // Another claim's live row of the key stays until it is settled.
                        let other = matches!(e.state,
                            State::InFlight { token: t, until } if t != token.0 && until > now);
                        if other {
                            continue;
                        }
                        removed.insert(pos);
                        removed_at.push((shard, pos));
                        if !e.held {
                            hold.push((shard, pos, e.message.attempts as i32));
                        }
                    }
                }
            }
        }
        let mut touched: HashSet<i32> = delivered.iter().map(|(s, _)| *s).collect();
        touched.extend(dead.iter().map(|(s, _, _)| *s));
        touched.extend(hold.iter().map(|(s, _, _)| *s));
        let aside_shard = |id: &Uuid| inner.aside.get(id).map(|a| a.shard);
        touched.extend(aside_delivered.iter().filter_map(aside_shard));
        touched.extend(aside_dead.iter().filter_map(|(id, _)| aside_shard(id)));

        let mut held_delivered: Vec<i64> = delivered
            .iter()
            .filter(|(sh, p)| entry(inner, *sh, *p).is_some_and(|e| e.held))
            .map(|(_, p)| p.1)
            .collect();
        held_delivered.extend(
            aside_delivered
                .iter()
                .filter_map(|id| inner.aside.get(id).map(|a| a.seq)),
        );
        for (id, _) in &aside_dead {
            if let Some(a) = inner.aside.get(id) {
                parks.push((a.key.clone(), *id, a.shard));
            }
        }
        if !touched.is_empty() {
            let needs_tx = !dead.is_empty()
                || !hold.is_empty()
                || !held_delivered.is_empty()
                || !aside_dead.is_empty();
            let deliveries_only = !needs_tx
                && retries.is_empty()
                && released.is_empty()
                && aside_retries.is_empty()
                && aside_released.is_empty();
            let writing = self.writes.lock().await;
            let mut tx = if needs_tx {
                Some(pool.begin().await.map_err(fail)?)
            } else {
                None
            };
            let kept = match tx.as_mut() {
                Some(tx) => self.fence(tx, inner, &touched, &removed).await?,
                // The common case: the cursors move without the lock on memory, so the
                // worker's next claim goes on while they commit (about one WAL flush). The
                // rows are delivered, so they leave memory first: that claim may take the
                // next rows of their keys, published after these were acknowledged. A
                // write that fails or is refused leaves the stored cursor behind them: the
                // shard's next cursor write passes them, or its next owner (or this relay
                // after a restart) delivers them again, in order.
                None if deliveries_only => {
                    let (positions, epochs) = cursor_positions(inner, &touched, &removed);
                    for &(shard, pos) in &removed_at {
                        if let Some(s) = inner.shards.get_mut(&shard)
                            && let Some(e) = s.entries.remove(&pos)
                        {
                            s.delivered.insert(pos);
                            inner.ids.remove(&e.message.id);
                        }
                    }
                    drop(guard);
                    let moved = async {
                        let mut conn = pool.acquire().await.map_err(fail)?;
                        let sql = &self.sql.move_cursors;
                        move_cursors(&mut conn, sql, &self.owner, &positions, &epochs).await
                    }
                    .await;
                    drop(writing);
                    guard = self.inner.lock().await;
                    inner = &mut guard;
                    // A shard taken over and back meanwhile is not the one written.
                    let written: HashMap<i32, i64> =
                        positions.iter().map(|(s, _)| *s).zip(epochs).collect();
                    let mut kept = moved?;
                    kept.retain(|shard| {
                        inner.shards.get(shard).map(|s| s.epoch) == written.get(shard).copied()
                    });
                    kept
                }
                None => {
                    let mut conn = pool.acquire().await.map_err(fail)?;
                    self.fence(&mut conn, inner, &touched, &removed).await?
                }
            };
            if let Some(tx) = tx.as_mut() {
                let live = |sh: &i32| kept.contains(sh);
                // Dead letters first: a held row of the key must not be in the held rows and
                // the dead letters at once.
                let (log_dead, held_dead): (Vec<_>, Vec<_>) = dead
                    .iter()
                    .filter(|(sh, _, _)| live(sh))
                    .partition(|(sh, p, _)| entry(inner, *sh, *p).is_some_and(|e| !e.held));
                if !log_dead.is_empty() {
                    let positions: Vec<(i32, Pos)> =
                        log_dead.iter().map(|(s, p, _)| (*s, *p)).collect();
                    let (shards, xids, seqs) = split(&positions);
                    let attempts: Vec<i32> = log_dead
                        .iter()
                        .map(|(s, p, _)| attempts_after_failure(entry(inner, *s, *p)))
                        .collect();
                    let errors: Vec<&str> = log_dead.iter().map(|(_, _, e)| *e).collect();
                    sqlx::query(&self.sql.dead_from_log)
                        .bind(&shards)
                        .bind(&xids)
                        .bind(&seqs)
                        .bind(&attempts)
                        .bind(&errors)
                        .execute(&mut **tx)
                        .await
                        .map_err(fail)?;
                }
                let aside_dead: Vec<(&Aside, &str)> = aside_dead
                    .iter()
                    .filter_map(|(id, e)| inner.aside.get(id).map(|a| (a, *e)))
                    .filter(|(a, _)| live(&a.shard))
                    .collect();
                if !held_dead.is_empty() || !aside_dead.is_empty() {
                    let mut seqs: Vec<i64> = held_dead.iter().map(|(_, p, _)| p.1).collect();
                    let mut attempts: Vec<i32> = held_dead
                        .iter()
                        .map(|(s, p, _)| attempts_after_failure(entry(inner, *s, *p)))
                        .collect();
                    let mut errors: Vec<&str> = held_dead.iter().map(|(_, _, e)| *e).collect();
                    for (a, error) in &aside_dead {
                        seqs.push(a.seq);
                        attempts.push(a.attempts.saturating_add(1) as i32);
                        errors.push(error);
                    }
                    sqlx::query(&self.sql.dead_from_held)
                        .bind(&seqs)
                        .bind(&attempts)
                        .bind(&errors)
                        .execute(&mut **tx)
                        .await
                        .map_err(fail)?;
                }
                let mut parks: Vec<&(String, Uuid, i32)> =
                    parks.iter().filter(|(_, _, sh)| live(sh)).collect();
                // One order for the key locks of every writer of parked keys.
                parks.sort();
                if !parks.is_empty() {
                    sqlx::query(&self.sql.park)
                        .bind(parks.iter().map(|p| p.0.as_str()).collect::<Vec<_>>())
                        .bind(parks.iter().map(|p| p.1).collect::<Vec<_>>())
                        .bind(parks.iter().map(|p| p.2).collect::<Vec<_>>())
                        .execute(&mut **tx)
                        .await
                        .map_err(fail)?;
                }
                let hold: Vec<&(i32, Pos, i32)> =
                    hold.iter().filter(|(sh, _, _)| live(sh)).collect();
                if !hold.is_empty() {
                    let positions: Vec<(i32, Pos)> = hold.iter().map(|h| (h.0, h.1)).collect();
                    let (shards, xids, seqs) = split(&positions);
                    sqlx::query(&self.sql.hold)
                        .bind(&shards)
                        .bind(&xids)
                        .bind(&seqs)
                        .bind(hold.iter().map(|h| h.2).collect::<Vec<_>>())
                        .execute(&mut **tx)
                        .await
                        .map_err(fail)?;
                }
                if !held_delivered.is_empty() {
                    sqlx::query(&self.sql.delete_held)
                        .bind(&held_delivered)
                        .execute(&mut **tx)
                        .await
                        .map_err(fail)?;
                }
            }
            if let Some(tx) = tx {
                tx.commit().await.map_err(fail)?;
            }
            // Written: now change memory to match.
            for (key, _, shard) in &parks {
                if kept.contains(shard) {
                    inner.parked.insert(
                        key.clone(),
                        Parked {
                            draining: false,
                            generation: -1,
                            shard: *shard,
                        },
                    );
                }
            }
            let delivered_at: HashSet<Pos> = delivered.iter().map(|(_, p)| *p).collect();
            let settled: HashSet<Pos> = delivered_at
                .iter()
                .copied()
                .chain(dead.iter().map(|(_, p, _)| *p))
                .collect();
            let retried: HashMap<Pos, Duration> =
                retries.iter().map(|(_, p, d, _)| (*p, *d)).collect();
            let given_back: HashSet<Pos> = released.iter().map(|(_, p)| *p).collect();
            for &(shard, pos) in &removed_at {
                if !kept.contains(&shard) {
                    continue;
                }
                // A row moved aside keeps its state (after this settlement) for later.
                if !settled.contains(&pos)
                    && let Some(e) = entry(inner, shard, pos)
                {
                    let (state, attempts) = if let Some(delay) = retried.get(&pos) {
                        (State::Waiting { at: now + *delay }, e.message.attempts + 1)
                    } else if given_back.contains(&pos) {
                        (State::Ready, e.message.attempts)
                    } else {
                        (e.state, e.message.attempts)
                    };
                    inner.set_aside(shard, pos, state, attempts, token);
                }
                if let Some(s) = inner.shards.get_mut(&shard)
                    && let Some(e) = s.entries.remove(&pos)
                {
                    if !e.held && delivered_at.contains(&pos) {
                        s.delivered.insert(pos);
                    }
                    inner.ids.remove(&e.message.id);
                }
            }
            for &shard in &touched {
                if let Some(s) = inner.shards.get_mut(&shard)
                    && kept.contains(&shard)
                {
                    let to = s.cursor_after(&removed);
                    s.move_cursor(to);
                }
            }
            let lost = touched.iter().any(|s| !kept.contains(s));
            self.forget_lost(inner, &touched, &kept);
            if lost {
                // Count only what was written for shards still owned.
                let written = |sh: &i32| kept.contains(sh);
                let n = delivered.iter().filter(|(s, _)| written(s)).count()
                    + dead.iter().filter(|(s, _, _)| written(s)).count()
                    + retries
                        .iter()
                        .filter(|(s, _, _, _)| written(s) || !touched.contains(s))
                        .count()
                    + released
                        .iter()
                        .filter(|(s, _)| written(s) || !touched.contains(s))
                        .count();
                self.apply_waits(inner, &retries, &released, now);
                return Ok(n as u64);
            }
        }
        self.apply_waits(inner, &retries, &released, now);
        for id in aside_delivered
            .iter()
            .chain(aside_dead.iter().map(|(id, _)| id))
        {
            inner.aside.remove(id);
        }
        for id in &aside_released {
            inner.aside.remove(id);
        }
        for (id, delay) in &aside_retries {
            if let Some(a) = inner.aside.get_mut(id) {
                a.state = State::Waiting { at: now + *delay };
                a.attempts = a.attempts.saturating_add(1);
            }
        }
        Ok(count)
    }

    /// Retries wait out their delay with one more attempt; releases are ready at once.
    fn apply_waits(
        &self,
        inner: &mut Inner,
        retries: &[(i32, Pos, Duration, &str)],
        released: &[(i32, Pos)],
        now: Instant,
    ) {
        for &(shard, pos, delay, _) in retries {
            if let Some(e) = inner
                .shards
                .get_mut(&shard)
                .and_then(|s| s.entries.get_mut(&pos))
            {
                e.message.attempts = e.message.attempts.saturating_add(1);
                e.state = State::Waiting { at: now + delay };
            }
        }
        for &(shard, pos) in released {
            if let Some(e) = inner
                .shards
                .get_mut(&shard)
                .and_then(|s| s.entries.get_mut(&pos))
            {
                e.state = State::Ready;
            }
        }
    }

    pub(crate) async fn extend_lease(
        &self,
        pool: &PgPool,
        token: &ClaimToken,
        ids: &[Uuid],
        lease: Duration,
    ) -> Result<u64> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        let asked_at = self.now();
        // Rows set aside under this claim: the lease of a parked key's row is only memory.
        let mut aside = 0;
        for id in ids {
            if inner.aside_held_by(id, token)
                && let Some(a) = inner.aside.get_mut(id)
            {
                a.state = State::InFlight {
                    token: token.0,
                    until: asked_at + lease,
                };
                aside += 1;
            }
        }
        let found: Vec<(i32, Pos)> = ids
            .iter()
            .filter_map(|id| inner.held_by(id, token))
            .collect();
        if found.is_empty() {
            return Ok(aside);
        }
        let touched: HashSet<i32> = found.iter().map(|(s, _)| *s).collect();
        let _writing = self.writes.lock().await;
        let kept = self.renew(pool, inner, &touched, lease).await?;
        let mut n = 0;
        for (shard, pos) in found {
            if !kept.contains(&shard) {
                continue;
            }
            if let Some(e) = inner
                .shards
                .get_mut(&shard)
                .and_then(|s| s.entries.get_mut(&pos))
            {
                e.state = State::InFlight {
                    token: token.0,
                    until: asked_at + lease,
                };
                n += 1;
            }
        }
        Ok(n + aside)
    }

    pub(crate) async fn stats(&self, pool: &PgPool) -> Result<QueueStats> {
        let fail = |e| db_error("cannot read queue figures", e);
        let inner = self.inner.lock().await;
        let now = self.now();
        let positions: Vec<(i32, Pos)> = inner.shards.iter().map(|(s, sh)| (*s, sh.read)).collect();
        let (shards, xids, seqs) = split(&positions);
        let mut in_flight = 0_u64;
        // Held entries in flight are left out of the held rows' count by their seq.
        let mut held_in_flight: Vec<i64> = Vec::new();
        // Held rows read into memory: their attempts are counted here, not from the table.
        let mut held_read: Vec<i64> = Vec::new();
        let mut pending = 0_u64;
        let mut retrying = 0_u64;
        let mut oldest = None;
        for s in inner.shards.values() {
            for (pos, e) in &s.entries {
                let flying = matches!(e.state, State::InFlight { until, .. } if until > now);
                if e.held {
                    held_read.push(pos.1);
                }
                if flying {
                    in_flight += 1;
                    if e.held {
                        held_in_flight.push(pos.1);
                    }
                    continue;
                }
                if e.message.attempts > 0 {
                    retrying += 1;
                }
                if !e.held {
                    pending += 1;
                    oldest = min_time(oldest, Some(e.message.created_at));
                }
            }
        }
        // Counting the backlog can take seconds: claims, settlements and renewals must not
        // wait for it.
        drop(inner);
        let row = sqlx::query(&self.sql.stats)
            .bind(&shards)
            .bind(&xids)
            .bind(&seqs)
            .bind(&held_in_flight)
            .bind(&held_read)
            .fetch_one(pool)
            .await
            .map_err(fail)?;
        let count =
            |i: usize| -> Result<u64> { Ok(row.try_get::<i64, _>(i).map_err(fail)?.max(0) as u64) };
        Ok(QueueStats {
            pending: pending + count(0)? + count(2)?,
            oldest_pending: min_time(
                oldest,
                min_time(row.try_get(1).map_err(fail)?, row.try_get(3).map_err(fail)?),
            ),
            in_flight,
            retrying: retrying + count(6)?,
            dead_lettered: count(4)?,
            parked_keys: count(5)?,
            measured_at: None,
        })
    }

    /// The figures per topic: rows past the stored cursors and held rows from the table,
    /// what this relay has in flight or waiting to retry from its memory (`$1`: the held
    /// rows read into memory, whose attempts are counted there).
    pub(crate) async fn topic_stats(&self, pool: &PgPool) -> Result<Vec<TopicStats>> {
        let inner = self.inner.lock().await;
        let now = self.now();
        let mut held_read: Vec<i64> = Vec::new();
        // By topic: (in flight, retrying).
        let mut mine: HashMap<String, (u64, u64)> = HashMap::new();
        for s in inner.shards.values() {
            for (pos, e) in &s.entries {
                if e.held {
                    held_read.push(pos.1);
                }
                let counts = mine.entry(e.message.topic.clone()).or_default();
                if matches!(e.state, State::InFlight { until, .. } if until > now) {
                    counts.0 += 1;
                } else if e.message.attempts > 0 {
                    counts.1 += 1;
                }
            }
        }
        // Not while holding memory: see `stats`.
        drop(inner);
        let rows = sqlx::query(&self.sql.topic_stats)
            .bind(&held_read)
            .fetch_all(pool)
            .await
            .map_err(|e| db_error("cannot read topic figures", e))?;
        rows.iter()
            .map(|row| {
                let mut t = rows::topic_stats(row)?;
                if let Some(&(in_flight, retrying)) = mine.get(t.topic.as_str()) {
                    // The rows past the cursors include those in flight: pending is the rest.
                    t.pending = t.pending.saturating_sub(in_flight);
                    t.in_flight = in_flight;
                    t.retrying += retrying;
                }
                Ok(t)
            })
            .collect()
    }

    /// Removes delivered rows behind the cursors of the owned shards (or only those older
    /// than `retention`), along the primary key, in deletes of at most [`CLEANUP_CHUNK`]
    /// rows. Each is a transaction of its own and a short one: a transaction that runs
    /// holds the readable horizon of every relay on the database, its own too.
    pub(crate) async fn maintain(&self, pool: &PgPool, retention: Option<Duration>) -> Result<()> {
        let owned: Vec<i32> = self.owned().await.into_iter().map(|(s, _)| s).collect();
        if owned.is_empty() {
            return Ok(());
        }
        let per_shard = CLEANUP_CHUNK.div_ceil(owned.len()) as i64;
        let mut removed = 0;
        loop {
            let done = sqlx::query(&self.sql.cleanup)
                .bind(&owned)
                .bind(retention.map(millis))
                .bind(per_shard)
                .execute(pool)
                .await
                .map_err(|e| db_error("cannot remove delivered rows", e))?;
            removed += done.rows_affected();
            // Below one shard's share: no shard had a full chunk, so nothing is left.
            if done.rows_affected() < per_shard as u64 {
                break;
            }
        }
        if removed > 0 {
            tracing::debug!(rows = removed, "removed delivered rows behind the cursors");
        }
        sqlx::query(&self.sql.forget_old_relays)
            .execute(pool)
            .await
            .map_err(|e| db_error("cannot remove old relays", e))?;
        Ok(())
    }

    /// How far the readable horizon trails the log, and why. With a `replica`, its horizon
    /// (what the relay reads below), against the primary's rows: rows the replica has not
    /// replayed yet count as waiting.
    pub(crate) async fn horizon_lag(
        &self,
        pool: &PgPool,
        replica: Option<&PgPool>,
    ) -> Result<HorizonLag> {
        let fail = |e| db_error("cannot read the horizon", e);
        let horizon: Option<String> = match replica {
            Some(replica) => Some(
                sqlx::query_scalar(&self.sql.horizon)
                    .fetch_one(replica)
                    .await
                    .map_err(|e| db_error("cannot read the horizon from the replica", e))?,
            ),
            None => None,
        };
        let row = sqlx::query(&self.sql.lag)
            .bind(horizon)
            .fetch_one(pool)
            .await
            .map_err(fail)?;
        let waiting: i64 = row.try_get(0).map_err(fail)?;
        let age: Option<f64> = row.try_get(2).map_err(fail)?;
        Ok(HorizonLag {
            waiting_rows: waiting.max(0) as u64,
            blocker_pid: row.try_get(1).map_err(fail)?,
            blocker_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
            blocker_prepared: row.try_get(3).map_err(fail)?,
        })
    }

    /// The rows of `key` waiting behind it: held aside (a parked or draining key), and past
    /// the stored cursor of its shard.
    pub(crate) async fn waiting_behind(&self, pool: &PgPool, key: &str) -> Result<u64> {
        let n: i64 = sqlx::query_scalar(&self.sql.waiting_behind)
            .bind(key)
            .fetch_one(pool)
            .await
            .map_err(|e| db_error("cannot count the messages behind a parked key", e))?;
        Ok(n.max(0) as u64)
    }

    /// Gives every owned shard up at once (their cursors are stored), so other relays take
    /// them without waiting for the lease; what was read and not settled is read again by
    /// the next owner.
    pub(crate) async fn give_up(&self, pool: &PgPool) -> Result<()> {
        let mut inner = self.inner.lock().await;
        // After the last cursor write, or the next owner delivers its batch again.
        let _writing = self.writes.lock().await;
        let shards: Vec<i32> = inner.shards.keys().copied().collect();
        let fail = |e| db_error("cannot give shards up", e);
        let mut conn = pool.acquire().await.map_err(fail)?;
        self.give_up_in(&mut conn, &inner, &shards).await?;
        sqlx::query(&self.sql.forget_relay)
            .bind(&self.owner)
            .execute(pool)
            .await
            .map_err(fail)?;
        *inner = Inner::default();
        Ok(())
    }
}

/// What a claim hands out: the `limit` oldest candidates of all shards, in position order.
/// The shards' entries are merged in that order and the walk stops at the `limit`-th
/// candidate, so it visits about as many entries as it hands out (a shard is a key's only
/// shard, so whether a key is stopped depends only on the earlier entries of its shard).
/// With per-key order a key gives up to `max_per_key` rows, stopping at its first row not
/// due; nothing of a parked key.
fn pick(
    inner: &Inner,
    limit: usize,
    max_per_key: usize,
    per_key_order: bool,
    now: Instant,
) -> Vec<(Pos, i32)> {
    // A shard being handed over hands out nothing more: its next owner reads it again.
    let mut walks: Vec<(i32, Peekable<btree_map::Iter<'_, Pos, Entry>>)> = inner
        .shards
        .iter()
        .filter(|(_, s)| !s.leaving)
        .map(|(&shard, s)| (shard, s.entries.iter().peekable()))
        .collect();
    let mut heads: BinaryHeap<Reverse<(Pos, usize)>> = walks
        .iter_mut()
        .enumerate()
        .filter_map(|(i, (_, walk))| walk.peek().map(|&(&pos, _)| Reverse((pos, i))))
        .collect();
    // Per shard and key: taken so far, and whether the key is stopped.
    let mut keys: HashMap<(i32, &str), (usize, bool)> = HashMap::new();
    let mut picked: Vec<(Pos, i32)> = Vec::new();
    while picked.len() < limit {
        let Some(Reverse((_, i))) = heads.pop() else {
            break;
        };
        let (shard, walk) = &mut walks[i];
        let shard = *shard;
        let Some((&pos, e)) = walk.next() else {
            continue;
        };
        if let Some(&(&next, _)) = walk.peek() {
            heads.push(Reverse((next, i)));
        }
        let ready = match e.state {
            State::Ready => true,
            State::InFlight { until, .. } => until <= now,
            State::Waiting { at } => at <= now,
        };
        match e.message.key.as_deref() {
            Some(key) if per_key_order => {
                let parked = inner.parked.get(key).is_some_and(|p| !p.draining);
                let k = keys.entry((shard, key)).or_insert((0, parked));
                if k.1 {
                    continue;
                }
                if !ready || k.0 >= max_per_key {
                    k.1 = true;
                    continue;
                }
                k.0 += 1;
                picked.push((pos, shard));
            }
            _ if ready => picked.push((pos, shard)),
            _ => {}
        }
    }
    picked
}

fn entry(inner: &Inner, shard: i32, pos: Pos) -> Option<&Entry> {
    inner.shards.get(&shard).and_then(|s| s.entries.get(&pos))
}

fn attempts_after_failure(entry: Option<&Entry>) -> i32 {
    entry.map_or(1, |e| e.message.attempts.saturating_add(1) as i32)
}

fn min_time<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Reads new rows below the horizon from `source` (the primary or a replica: either way
/// every row below its horizon is there, see `HORIZON`) as `plan` says, and decodes them.
/// Changes nothing: [`LogEngine::take`] puts the rows in memory.
///
/// The read runs in a transaction whose first statement takes this session's picture of
/// `pg_stat_activity`, before the read's snapshot: the horizon rule leaves out a running
/// transaction of another database only when that picture shows it, and one that ended
/// between a snapshot and a later picture would count as running, holding the horizon
/// below rows committed before the claim (a claim would hand out nothing it could). With
/// the picture first, a transaction it does not show is either over before the snapshot
/// or newer than everything committed before the read began.
async fn read_rows(source: &PgPool, sql: &str, plan: &ReadPlan) -> Result<Vec<ReadRow>> {
    let fail = |e| db_error("cannot read the outbox log", e);
    // Read committed whatever the database's default: each statement its own snapshot.
    let mut tx = source
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .map_err(fail)?;
    sqlx::query("SELECT count(*) FROM pg_stat_activity")
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let rows = sqlx::query(sql)
        .bind(&plan.shards)
        .bind(&plan.xids)
        .bind(&plan.seqs)
        .bind(&plan.room)
        .fetch_all(&mut *tx)
        .await
        .map_err(fail)?;
    tx.commit().await.map_err(fail)?;
    rows.iter()
        .map(|row| {
            let (shard, pos) = position(row)?;
            Ok((shard, pos, rows::message(row)?))
        })
        .collect()
}

/// Where the cursors of `touched` shards stand once `removed` rows are gone, in shard order
/// (one order for the row locks, whoever else writes these rows), with their epochs.
fn cursor_positions(
    inner: &Inner,
    touched: &HashSet<i32>,
    removed: &HashSet<Pos>,
) -> (Vec<(i32, Pos)>, Vec<i64>) {
    let mut touched: Vec<i32> = touched.iter().copied().collect();
    touched.sort_unstable();
    touched
        .into_iter()
        .filter_map(|shard| {
            let s = inner.shards.get(&shard)?;
            Some(((shard, s.cursor_after(removed)), s.epoch))
        })
        .unzip()
}

/// Moves the cursors of shards to `positions` under the epoch fence (`epochs`, `owner`);
/// returns the shards still owned.
async fn move_cursors(
    conn: &mut sqlx::PgConnection,
    sql: &str,
    owner: &str,
    positions: &[(i32, Pos)],
    epochs: &[i64],
) -> Result<HashSet<i32>> {
    let (shards, xids, seqs) = split(positions);
    let kept: Vec<i32> = sqlx::query_scalar(sql)
        .bind(&shards)
        .bind(&xids)
        .bind(&seqs)
        .bind(epochs)
        .bind(owner)
        .fetch_all(conn)
        .await
        .map_err(|e| db_error("cannot move the cursor", e))?;
    Ok(kept.into_iter().collect())
}

/// The shard and place of a row that has `shard`, `xid_text` and `seq`.
fn position(row: &PgRow) -> Result<(i32, Pos)> {
    let fail = |e| db_error("cannot read the outbox log", e);
    let shard: i32 = row.try_get("shard").map_err(fail)?;
    let xid: String = row.try_get("xid_text").map_err(fail)?;
    let seq: i64 = row.try_get("seq").map_err(fail)?;
    Ok((shard, (parse_xid(&xid)?, seq)))
}
