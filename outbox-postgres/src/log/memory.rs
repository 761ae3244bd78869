//! What a log-mode relay holds in memory of the shards it owns (rows read and not settled,
//! rows set aside, parked keys), and the pure rules over it: which rows a claim hands out
//! ([`pick`]) and where a shard's cursor stands once rows are settled
//! ([`cursor_positions`]). Nothing here touches the database.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, btree_map};
use std::iter::Peekable;

use outbox_core::{ClaimToken, Message};
use tokio::time::Instant;
use uuid::Uuid;

use super::read::ReadAhead;

/// A row's place in the log: (transaction id, seq).
pub(super) type Pos = (u64, i64);

/// Where a row read by this relay stands.
#[derive(Debug, Clone, Copy)]
pub(super) enum State {
    Ready,
    InFlight { token: Uuid, until: Instant },
    Waiting { at: Instant },
}

/// A row read and not yet settled.
pub(super) struct Entry {
    pub(super) message: Message,
    /// Read from the held rows of a draining key (before the cursor), not from the log.
    pub(super) held: bool,
    pub(super) state: State,
}

/// A shard this relay owns.
pub(super) struct Shard {
    pub(super) epoch: i64,
    /// The stored cursor: every row at or before it is settled.
    pub(super) cursor: Pos,
    /// The last row read from the log.
    pub(super) read: Pos,
    pub(super) entries: BTreeMap<Pos, Entry>,
    /// Rows delivered past the stored cursor (an older row of the shard is not settled
    /// yet): they leave the log when the shard is given up, so that its next owner, which
    /// reads from the stored cursor, does not deliver them again.
    pub(super) delivered: BTreeSet<Pos>,
    /// Keys whose rows after this position (up to `read`) were read and let go to make
    /// room (the key is stopped behind a row that is not due: see
    /// [`LogEngine::evict`](super::LogEngine::evict)): they stay in the log, unsettled, the
    /// cursor stays at or before the position, later rows of the key are let go as they are
    /// read, and the key's rows are read again from here once the key has few left in
    /// memory.
    pub(super) evicted: HashMap<String, Pos>,
    /// Above this relay's fair share: read and hand out nothing more, give it up once
    /// nothing of it is out under a live claim (so the next owner delivers nothing again).
    /// What it read and did not hand out, rows waiting to retry among them, the next owner
    /// reads again from the stored cursor.
    pub(super) leaving: bool,
}

impl Shard {
    /// Moves the cursor (in memory, once written) and forgets the deliveries it passed.
    pub(super) fn move_cursor(&mut self, to: Pos) {
        self.cursor = self.cursor.max(to);
        let cursor = self.cursor;
        self.delivered.retain(|p| *p > cursor);
    }
    /// Just before the oldest log row not settled, or the last row read.
    /// (Never past the rows of an evicted key.)
    pub(super) fn cursor_after(&self, removed: &HashSet<Pos>) -> Pos {
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
pub(super) struct Parked {
    pub(super) draining: bool,
    pub(super) generation: i64,
    /// The key's shard: what is known of the key goes with the shard when it is dropped,
    /// so that a shard taken again loads a draining key's held rows again.
    pub(super) shard: i32,
}

/// A row kept aside in the held rows while a claim still held it or it waited to retry:
/// its state carries over when the key drains, and a late settlement of that claim is
/// still accepted, as in lease mode while nobody has claimed the row since.
pub(super) struct Aside {
    pub(super) shard: i32,
    pub(super) seq: i64,
    pub(super) key: String,
    pub(super) state: State,
    pub(super) attempts: u32,
}

#[derive(Default)]
pub(super) struct Inner {
    /// By message id.
    pub(super) aside: HashMap<Uuid, Aside>,
    pub(super) shards: BTreeMap<i32, Shard>,
    /// Where each entry is.
    pub(super) ids: HashMap<Uuid, (i32, Pos)>,
    pub(super) parked: HashMap<String, Parked>,
    pub(super) last_round: Option<Instant>,
    /// Until when the last round holds the shards (this relay's clock): a claim whose lease
    /// would outlast it runs a round first, so a claim's shards stay held until its lease
    /// has run out, whatever leases claims ask for.
    pub(super) held_until: Option<Instant>,
    /// The primary's WAL position when this relay last took shards. A replica is read only
    /// once it has replayed that far: the shards' previous owner may have moved rows out
    /// of the log (held, dead-lettered) that a replica behind would still show.
    pub(super) replica_from: Option<String>,
    /// The rows for the next claim, being read while this claim's batch goes out.
    pub(super) ahead: Option<ReadAhead>,
}

impl Inner {
    /// Puts the entry at `pos` of `shard` in flight under `token` until `until`; returns
    /// it, or `None` when it is no longer in memory.
    pub(super) fn lease_entry(
        &mut self,
        shard: i32,
        pos: Pos,
        token: &ClaimToken,
        until: Instant,
    ) -> Option<&Entry> {
        let e = self.shards.get_mut(&shard)?.entries.get_mut(&pos)?;
        e.state = State::InFlight {
            token: token.0,
            until,
        };
        Some(e)
    }

    pub(super) fn drop_shard(&mut self, shard: i32) {
        self.aside.retain(|_, a| a.shard != shard);
        self.parked.retain(|_, p| p.shard != shard);
        if let Some(s) = self.shards.remove(&shard) {
            for e in s.entries.values() {
                self.ids.remove(&e.message.id);
            }
        }
    }

    /// Remembers the state of an entry moved to the held rows, unless it is simply ready.
    pub(super) fn set_aside(
        &mut self,
        shard: i32,
        pos: Pos,
        state: State,
        attempts: u32,
        token: &ClaimToken,
    ) {
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
    pub(super) fn aside_held_by(&self, id: &Uuid, token: &ClaimToken) -> bool {
        self.aside
            .get(id)
            .is_some_and(|a| matches!(a.state, State::InFlight { token: t, .. } if t == token.0))
    }

    /// Whether a live claim holds a row of `shard` (read from the log, or set aside while
    /// the claim held it): a shard being handed over waits for it to be settled.
    pub(super) fn has_live_claims(&self, shard: i32, now: Instant) -> bool {
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
    pub(super) fn held_by(&self, id: &Uuid, token: &ClaimToken) -> Option<(i32, Pos)> {
        let &(shard, pos) = self.ids.get(id)?;
        let entry = self.shards.get(&shard)?.entries.get(&pos)?;
        match entry.state {
            State::InFlight { token: t, .. } if t == token.0 => Some((shard, pos)),
            _ => None,
        }
    }
}

/// What a claim hands out: the `limit` oldest candidates of all shards, in position order.
/// The shards' entries are merged in that order and the walk stops at the `limit`-th
/// candidate, so it visits about as many entries as it hands out (a shard is a key's only
/// shard, so whether a key is stopped depends only on the earlier entries of its shard).
/// With per-key order a key gives up to `max_per_key` rows, stopping at its first row not
/// due; nothing of a parked key.
pub(super) fn pick(
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

/// The entry at `pos` of `shard`, if this relay holds it.
pub(super) fn entry(inner: &Inner, shard: i32, pos: Pos) -> Option<&Entry> {
    inner.shards.get(&shard).and_then(|s| s.entries.get(&pos))
}

/// Where the cursors of `touched` shards stand once `removed` rows are gone, in shard order
/// (one order for the row locks, whoever else writes these rows), with their epochs.
pub(super) fn cursor_positions(
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use outbox_core::NewMessage;

    use super::*;

    /// The claims' clock in these tests: far enough from the process start that times
    /// before it exist.
    fn now() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    fn shard(epoch: i64) -> Shard {
        Shard {
            epoch,
            cursor: (0, 0),
            read: (0, 0),
            entries: BTreeMap::new(),
            delivered: BTreeSet::new(),
            evicted: HashMap::new(),
            leaving: false,
        }
    }

    /// Puts a row of `key` into memory at `pos` of `shard` (a new shard at epoch 1), read
    /// from the log or (`held`) from the held rows; returns its id.
    fn put(
        inner: &mut Inner,
        shard_no: i32,
        pos: Pos,
        key: Option<&str>,
        state: State,
        held: bool,
    ) -> Uuid {
        let new = NewMessage::new("topic", b"{}".to_vec());
        let message = Message::from(match key {
            Some(key) => new.key(key),
            None => new,
        });
        let id = message.id;
        let s = inner.shards.entry(shard_no).or_insert_with(|| shard(1));
        if !held {
            s.read = s.read.max(pos);
        }
        s.entries.insert(
            pos,
            Entry {
                message,
                held,
                state,
            },
        );
        inner.ids.insert(id, (shard_no, pos));
        id
    }

    fn ready(inner: &mut Inner, shard_no: i32, pos: Pos, key: Option<&str>) -> Uuid {
        put(inner, shard_no, pos, key, State::Ready, false)
    }

    fn in_flight(token: Uuid, until: Instant) -> State {
        State::InFlight { token, until }
    }

    fn parked(inner: &mut Inner, key: &str, draining: bool, shard: i32) {
        inner.parked.insert(
            key.to_string(),
            Parked {
                draining,
                generation: 0,
                shard,
            },
        );
    }

    fn aside(inner: &mut Inner, id: Uuid, shard: i32, state: State) {
        inner.aside.insert(
            id,
            Aside {
                shard,
                seq: 1,
                key: "k".into(),
                state,
                attempts: 0,
            },
        );
    }

    fn positions(picked: &[(Pos, i32)]) -> Vec<Pos> {
        picked.iter().map(|(pos, _)| *pos).collect()
    }

    #[test]
    fn pick_gives_a_key_its_rows_in_order_up_to_max_per_key() {
        let mut inner = Inner::default();
        ready(&mut inner, 0, (10, 3), Some("a"));
        ready(&mut inner, 0, (10, 1), Some("a"));
        ready(&mut inner, 0, (11, 1), Some("b"));
        ready(&mut inner, 0, (10, 2), Some("a"));
        let picked = pick(&inner, 10, 2, true, now());
        assert_eq!(positions(&picked), [(10, 1), (10, 2), (11, 1)]);
        // Without per-key order a key is not bounded.
        let picked = pick(&inner, 10, 2, false, now());
        assert_eq!(positions(&picked), [(10, 1), (10, 2), (10, 3), (11, 1)]);
    }

    #[test]
    fn pick_merges_the_shards_in_position_order_up_to_the_limit() {
        let mut inner = Inner::default();
        ready(&mut inner, 0, (10, 1), Some("a"));
        ready(&mut inner, 0, (12, 1), None);
        ready(&mut inner, 1, (11, 1), Some("b"));
        ready(&mut inner, 1, (13, 1), None);
        let picked = pick(&inner, 3, 10, true, now());
        assert_eq!(picked, [((10, 1), 0), ((11, 1), 1), ((12, 1), 0)]);
        assert!(pick(&inner, 0, 10, true, now()).is_empty());
    }

    #[test]
    fn a_key_stops_at_its_first_row_not_due() {
        let now = now();
        let later = now + Duration::from_secs(60);
        let earlier = now - Duration::from_secs(1);
        let (token, mut inner) = (Uuid::now_v7(), Inner::default());
        // `a`: out under a live claim; `b`: waiting to retry; both hold their later rows.
        put(
            &mut inner,
            0,
            (1, 1),
            Some("a"),
            in_flight(token, later),
            false,
        );
        ready(&mut inner, 0, (1, 2), Some("a"));
        let waiting = State::Waiting { at: later };
        put(&mut inner, 0, (1, 3), Some("b"), waiting, false);
        ready(&mut inner, 0, (1, 4), Some("b"));
        // `c`: a claim whose lease ran out and a retry that is due go out again.
        put(
            &mut inner,
            0,
            (1, 5),
            Some("c"),
            in_flight(token, earlier),
            false,
        );
        let due = State::Waiting { at: earlier };
        put(&mut inner, 0, (1, 6), Some("c"), due, false);
        // Without a key a row not due is skipped, the rows after it go.
        put(&mut inner, 0, (1, 7), None, waiting, false);
        ready(&mut inner, 0, (1, 8), None);
        let picked = pick(&inner, 10, 10, true, now);
        assert_eq!(positions(&picked), [(1, 5), (1, 6), (1, 8)]);
        // Without per-key order only the rows not due themselves wait.
        let picked = pick(&inner, 10, 10, false, now);
        assert_eq!(positions(&picked), [(1, 2), (1, 4), (1, 5), (1, 6), (1, 8)]);
    }

    #[test]
    fn a_parked_key_gives_nothing_a_draining_key_its_held_rows_first() {
        let mut inner = Inner::default();
        parked(&mut inner, "parked", false, 0);
        parked(&mut inner, "draining", true, 0);
        ready(&mut inner, 0, (10, 1), Some("parked"));
        ready(&mut inner, 0, (10, 2), Some("draining"));
        // A held row of the draining key, from before the cursor: it goes first, and counts
        // towards the key's rows.
        put(&mut inner, 0, (5, 1), Some("draining"), State::Ready, true);
        ready(&mut inner, 0, (10, 3), Some("other"));
        let picked = pick(&inner, 10, 1, true, now());
        assert_eq!(positions(&picked), [(5, 1), (10, 3)]);
        let picked = pick(&inner, 10, 2, true, now());
        assert_eq!(positions(&picked), [(5, 1), (10, 2), (10, 3)]);
        // Without per-key order nothing is parked.
        let picked = pick(&inner, 10, 2, false, now());
        assert_eq!(picked.len(), 4);
    }

    #[test]
    fn a_shard_being_handed_over_hands_out_nothing() {
        let mut inner = Inner::default();
        ready(&mut inner, 0, (10, 1), Some("a"));
        ready(&mut inner, 1, (10, 2), Some("b"));
        if let Some(s) = inner.shards.get_mut(&0) {
            s.leaving = true;
        }
        assert_eq!(pick(&inner, 10, 10, true, now()), [((10, 2), 1)]);
    }

    #[test]
    fn a_cursor_stops_just_before_the_oldest_log_row_not_settled() {
        let mut inner = Inner::default();
        ready(&mut inner, 0, (10, 2), Some("a"));
        ready(&mut inner, 0, (10, 3), Some("b"));
        ready(&mut inner, 0, (12, 5), Some("c"));
        // A held row is behind the cursor already: it never holds it.
        put(&mut inner, 0, (5, 1), Some("d"), State::Ready, true);
        ready(&mut inner, 1, (20, 1), None);
        ready(&mut inner, 2, (30, 1), None);
        if let Some(s) = inner.shards.get_mut(&2) {
            s.epoch = 7;
        }
        let touched: HashSet<i32> = [2, 0, 9].into();
        let removed: HashSet<Pos> = [(10, 2)].into();
        // In shard order, with their epochs; shard 1 is not touched, 9 not owned.
        let (at, epochs) = cursor_positions(&inner, &touched, &removed);
        assert_eq!(at, [(0, (10, 2)), (2, (30, 0))]);
        assert_eq!(epochs, [1, 7]);
        // Everything removed: the last row read.
        let removed: HashSet<Pos> = [(10, 2), (10, 3), (12, 5)].into();
        let (at, _) = cursor_positions(&inner, &[0].into(), &removed);
        assert_eq!(at, [(0, (12, 5))]);
        // An evicted key holds the cursor before its rows let go.
        if let Some(s) = inner.shards.get_mut(&0) {
            s.evicted.insert("b".into(), (10, 2));
        }
        let (at, _) = cursor_positions(&inner, &[0].into(), &removed);
        assert_eq!(at, [(0, (10, 2))]);
    }

    #[test]
    fn a_cursor_never_moves_back_and_forgets_the_deliveries_it_passes() {
        let mut s = shard(1);
        s.cursor = (10, 1);
        s.delivered = [(10, 3), (10, 5)].into();
        s.move_cursor((10, 3));
        assert_eq!(s.cursor, (10, 3));
        assert_eq!(s.delivered, [(10, 5)].into());
        s.move_cursor((9, 9));
        assert_eq!(s.cursor, (10, 3));
        assert_eq!(s.delivered, [(10, 5)].into());
    }

    #[test]
    fn set_aside_keeps_the_state_of_rows_another_claim_holds_or_that_wait() {
        let now = now();
        let (mine, other) = (ClaimToken(Uuid::now_v7()), Uuid::now_v7());
        let mut inner = Inner::default();
        let ready_row = ready(&mut inner, 0, (1, 1), Some("k"));
        let my_row = ready(&mut inner, 0, (1, 2), Some("k"));
        let their_row = ready(&mut inner, 0, (1, 3), Some("k"));
        let waiting_row = ready(&mut inner, 0, (1, 4), Some("k"));
        let unkeyed = ready(&mut inner, 0, (1, 5), None);
        let until = now + Duration::from_secs(30);
        inner.set_aside(0, (1, 1), State::Ready, 0, &mine);
        inner.set_aside(0, (1, 2), in_flight(mine.0, until), 0, &mine);
        inner.set_aside(0, (1, 3), in_flight(other, until), 2, &mine);
        inner.set_aside(0, (1, 4), State::Waiting { at: until }, 3, &mine);
        inner.set_aside(0, (1, 5), State::Waiting { at: until }, 1, &mine);
        // Not in memory: nothing to keep.
        inner.set_aside(0, (9, 9), State::Waiting { at: until }, 1, &mine);
        inner.set_aside(4, (1, 1), State::Waiting { at: until }, 1, &mine);
        let mut kept: Vec<Uuid> = inner.aside.keys().copied().collect();
        kept.sort();
        let mut expected = vec![their_row, waiting_row];
        expected.sort();
        assert_eq!(kept, expected);
        for id in [ready_row, my_row, unkeyed] {
            assert!(!inner.aside.contains_key(&id));
        }
        let their = &inner.aside[&their_row];
        assert_eq!((their.shard, their.seq, their.attempts), (0, 3, 2));
        assert_eq!(their.key, "k");
        assert_eq!(inner.aside[&waiting_row].attempts, 3);
        // Held by the claim that has it in flight, by no other.
        assert!(inner.aside_held_by(&their_row, &ClaimToken(other)));
        assert!(!inner.aside_held_by(&their_row, &mine));
        assert!(!inner.aside_held_by(&waiting_row, &mine));
        assert!(!inner.aside_held_by(&waiting_row, &ClaimToken(other)));
        assert!(!inner.aside_held_by(&Uuid::now_v7(), &ClaimToken(other)));
    }

    #[test]
    fn held_by_finds_a_row_only_under_the_claim_that_has_it_in_flight() {
        let now = now();
        let (token, other) = (ClaimToken(Uuid::now_v7()), ClaimToken(Uuid::now_v7()));
        let mut inner = Inner::default();
        let until = now + Duration::from_secs(30);
        let out = put(
            &mut inner,
            3,
            (1, 1),
            Some("k"),
            in_flight(token.0, until),
            false,
        );
        let not_out = ready(&mut inner, 3, (1, 2), Some("k"));
        assert_eq!(inner.held_by(&out, &token), Some((3, (1, 1))));
        assert_eq!(inner.held_by(&out, &other), None);
        assert_eq!(inner.held_by(&not_out, &token), None);
        assert_eq!(inner.held_by(&Uuid::now_v7(), &token), None);
    }

    #[test]
    fn only_a_live_claim_of_a_shard_or_of_its_rows_aside_holds_it() {
        let now = now();
        let token = Uuid::now_v7();
        let later = now + Duration::from_secs(30);
        let earlier = now - Duration::from_secs(1);
        let mut inner = Inner::default();
        put(
            &mut inner,
            0,
            (1, 1),
            Some("a"),
            in_flight(token, earlier),
            false,
        );
        put(
            &mut inner,
            0,
            (1, 2),
            Some("b"),
            State::Waiting { at: later },
            false,
        );
        ready(&mut inner, 0, (1, 3), Some("c"));
        ready(&mut inner, 1, (1, 1), Some("d"));
        assert!(!inner.has_live_claims(0, now), "lease over, waiting, ready");
        put(
            &mut inner,
            0,
            (1, 4),
            Some("e"),
            in_flight(token, later),
            false,
        );
        assert!(inner.has_live_claims(0, now));
        assert!(!inner.has_live_claims(1, now));
        assert!(!inner.has_live_claims(5, now), "a shard not owned");
        // A row set aside while a claim held it holds its shard until the claim ends.
        aside(&mut inner, Uuid::now_v7(), 1, in_flight(token, later));
        assert!(inner.has_live_claims(1, now));
        assert!(!inner.has_live_claims(1, later + Duration::from_secs(1)));
    }

    #[test]
    fn dropping_a_shard_forgets_its_rows_its_rows_aside_and_its_parked_keys() {
        let mut inner = Inner::default();
        let gone = ready(&mut inner, 0, (1, 1), Some("a"));
        let stays = ready(&mut inner, 1, (1, 1), Some("b"));
        let (gone_aside, kept_aside) = (Uuid::now_v7(), Uuid::now_v7());
        aside(&mut inner, gone_aside, 0, State::Ready);
        aside(&mut inner, kept_aside, 1, State::Ready);
        parked(&mut inner, "a", false, 0);
        parked(&mut inner, "b", true, 1);
        inner.drop_shard(0);
        assert_eq!(inner.shards.keys().copied().collect::<Vec<_>>(), [1]);
        assert!(!inner.ids.contains_key(&gone));
        assert_eq!(inner.ids.get(&stays), Some(&(1, (1, 1))));
        assert!(!inner.aside.contains_key(&gone_aside));
        assert!(inner.aside.contains_key(&kept_aside));
        assert!(!inner.parked.contains_key("a"));
        assert!(inner.parked.contains_key("b"));
        // A shard not owned: nothing changes.
        inner.drop_shard(7);
        assert_eq!(inner.shards.len(), 1);
        assert_eq!(inner.ids.len(), 1);
    }
}
