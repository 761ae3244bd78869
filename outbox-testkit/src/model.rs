//! The randomised storage check: random sequences of application transactions (committing
//! late or rolling back), claims by several relays, settlements, relays that die, leases and
//! retry delays running out, dead letters, replays, releases and purges, restarts of the
//! relay (stopping or dying) and a second relay's process joining and leaving (handing the
//! stored queue's parts over, where a storage splits it between relays), driven against a
//! storage and checked after every step against a reference model of what the contract
//! allows: no message of a key before an earlier one still stored, nothing purged or
//! delivered ever handed out again, and everything committed delivered in the end.
//!
//! `OUTBOX_MODEL_SEED` replays one seed; `OUTBOX_MODEL_RUNS` and `OUTBOX_MODEL_STEPS` set how
//! many sequences and how long (default 6 × 120). A failure prints the seed;
//! `OUTBOX_MODEL_TRACE=1` prints the model before every step.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use std::sync::Arc;

use outbox_core::{
    Claim, ClaimToken, DeadLetter, Delivery, NewMessage, Receipt, Retry, Settlement, Storage,
};
use uuid::Uuid;

use super::storage::{PendingWrite, StorageHarness};

/// Leases and delays are hours long, so the seconds a run takes never expire one: time
/// moves only when the model says so, by [`ADVANCE`].
const HOUR: Duration = Duration::from_secs(3600);
/// Runs out one-hour leases and delays but not three-hour ones.
const ADVANCE: Duration = Duration::from_secs(2 * 3600);
const KEYS: [Option<&str>; 4] = [Some("a"), Some("b"), Some("c"), None];
const RELAYS: usize = 3;

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Where a message is, as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Written by a transaction that is still open: invisible.
    Open,
    RolledBack,
    /// Waiting; due once the model clock reaches `at`.
    Waiting {
        at: Duration,
    },
    /// Claimed under `token` until `until` on the model clock.
    Held {
        token: ClaimToken,
        until: Duration,
    },
    Delivered,
    Dead,
    /// A dead letter the operator deleted for good: never to be handed out.
    Purged,
}

#[derive(Debug)]
struct Msg {
    id: Uuid,
    key: Option<String>,
    state: State,
    /// The transaction that wrote it, numbered in the order they began.
    tx: usize,
}

/// The reference: every message in write (sequence) order, the parked keys and the clock.
#[derive(Default)]
struct Model {
    msgs: Vec<Msg>,
    index: HashMap<Uuid, usize>,
    parked: HashSet<String>,
    now: Duration,
    /// The storage `waits_for_older_transactions`: a message is claimable only once every
    /// transaction that began before its own has ended.
    horizon: bool,
    /// Transactions still open, by number.
    open_txs: HashSet<usize>,
    /// A second relay process runs beside the first: what a claim hands out depends on
    /// which parts of the queue its relay holds, so the claim rule's "nothing due left out"
    /// is not checked, and a message waiting to retry may come back early (a relay handing
    /// a part over forgets its retry delays: the next holder reads it again).
    two_processes: bool,
    /// A relay process died, or a second one joined after time passed (it may take over
    /// what the first held, as from a relay that stalled): a storage may deliver again what
    /// it delivered (at least once), in key order; a purged message still never.
    redelivery: bool,
}

impl Model {
    /// In the storage: committed and not yet delivered or dead-lettered.
    fn stored(&self, m: &Msg) -> bool {
        matches!(m.state, State::Waiting { .. } | State::Held { .. })
    }

    fn due(&self, m: &Msg) -> bool {
        if self.horizon && self.open_txs.iter().any(|&t| t < m.tx) {
            return false;
        }
        match m.state {
            State::Waiting { at } => self.two_processes || at <= self.now,
            State::Held { until, .. } => until <= self.now,
            _ => false,
        }
    }

    fn held_by(&self, i: usize, token: &ClaimToken) -> bool {
        matches!(self.msgs[i].state, State::Held { token: t, .. } if t == *token)
    }

    /// Checks a claim against the claim rule; returns what is wrong, if anything.
    fn check_claim(&self, claim: &Claim, limit: usize) -> Result<(), String> {
        if claim.messages.len() > limit {
            return Err(format!(
                "{} messages claimed with limit {limit}",
                claim.messages.len()
            ));
        }
        let mut taken: Vec<usize> = Vec::new();
        for message in &claim.messages {
            let Some(&i) = self.index.get(&message.id) else {
                return Err(format!("claimed an unknown message {}", message.id));
            };
            let m = &self.msgs[i];
            let again = self.redelivery && m.state == State::Delivered;
            if !again && !self.due(m) {
                return Err(format!(
                    "claimed message #{i} ({:?}) that is not due",
                    m.state
                ));
            }
            if let Some(key) = &m.key {
                if self.parked.contains(key) {
                    return Err(format!("claimed message #{i} of parked key {key}"));
                }
                // Every earlier message of its key still in the storage comes in this claim,
                // ahead of it.
                for (j, earlier) in self.msgs[..i].iter().enumerate() {
                    if earlier.key.as_deref() == Some(key)
                        && self.stored(earlier)
                        && !taken.contains(&j)
                    {
                        return Err(format!(
                            "claimed #{i} of key {key} while earlier #{j} is {:?} and not ahead of it in the claim",
                            earlier.state
                        ));
                    }
                }
            }
            taken.push(i);
        }
        // With room for everything, no key with a due first message is left out.
        let visible = self.msgs.iter().filter(|m| self.stored(m)).count();
        // (Not when messages may be delivered again: they take room in the claim too.)
        if limit >= visible && !self.two_processes && !self.redelivery {
            let mut firsts: HashSet<&str> = HashSet::new();
            for (i, m) in self.msgs.iter().enumerate() {
                if !self.stored(m) {
                    continue;
                }
                let first_of_key = match &m.key {
                    Some(k) => firsts.insert(k.as_str()),
                    None => true,
                };
                let free = m.key.as_ref().is_none_or(|k| !self.parked.contains(k));
                if first_of_key && free && self.due(m) && !taken.contains(&i) {
                    return Err(format!(
                        "a claim with room for everything left out #{i} (key {:?}), which is due and first of its key",
                        m.key
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Prints the seed when the sequence it drives panics.
struct SeedGuard(u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "[conformance] random operations failed with seed {0}; replay it with OUTBOX_MODEL_SEED={0}",
                self.0
            );
        }
    }
}

/// Random sequences of operations keep the claim rule, per-key order and the settlement
/// counts of the reference model, and everything committed is delivered in the end.
pub async fn storage_random_operations_keep_key_order(h: &dyn StorageHarness) {
    let traits = h.traits();
    if !traits.positions_at_write || !traits.writes_beside_open_transactions {
        super::note(
            "random operations",
            format!(
                "skipped: the model needs writes that take their place when written, beside open transactions ({traits:?})"
            ),
        );
        return;
    }
    let (seed, runs) = match env_number("OUTBOX_MODEL_SEED") {
        Some(seed) => (seed, 1),
        None => (
            fastrand::u64(..),
            env_number("OUTBOX_MODEL_RUNS").unwrap_or(6),
        ),
    };
    let steps = env_number("OUTBOX_MODEL_STEPS").unwrap_or(120) as usize;
    for run in 0..runs {
        run_sequence(h, seed.wrapping_add(run), steps).await;
    }
    super::note(
        "random operations",
        format!("{runs} sequences of {steps} steps from seed {seed}"),
    );
}

async fn run_sequence(h: &dyn StorageHarness, seed: u64, steps: usize) {
    let _guard = SeedGuard(seed);
    let mut rng = fastrand::Rng::with_seed(seed);
    let Some(f) = super::storage::fixture(h, true).await else {
        super::note(
            "random operations",
            "skipped: the storage cannot keep per-key order",
        );
        return;
    };
    let mut storage = f.storage();
    // The second relay process, while it runs: relay 2 claims through it.
    let mut second: Option<Arc<dyn Storage>> = None;
    let mut model = Model {
        horizon: storage.capabilities().waits_for_older_transactions,
        ..Model::default()
    };
    let mut next_tx = 0usize;
    let mut open: Vec<(Vec<usize>, Box<dyn PendingWrite>)> = Vec::new();
    let mut claims: Vec<Option<Claim>> = (0..RELAYS).map(|_| None).collect();
    let mut written = 0usize;
    let trace = std::env::var_os("OUTBOX_MODEL_TRACE").is_some();

    for step in 0..steps {
        let what = rng.u8(..100);
        let context = |op: &str| format!("seed {seed}, step {step}, {op}");
        if trace {
            let states: Vec<String> = model
                .msgs
                .iter()
                .enumerate()
                .map(|(i, m)| format!("#{i}{}:{:?}", m.key.as_deref().unwrap_or("-"), m.state))
                .collect();
            eprintln!(
                "[model] step {step} op {what} now {:?} parked {:?}\n  {}",
                model.now,
                model.parked,
                states.join(" ")
            );
        }
        match what {
            // An application transaction writes one to three messages.
            0..=17 if open.len() < 3 => {
                let mut batch = Vec::new();
                let mut idx = Vec::new();
                let tx = next_tx;
                next_tx += 1;
                model.open_txs.insert(tx);
                for _ in 0..rng.usize(1..=3) {
                    let key = KEYS[rng.usize(..KEYS.len())];
                    let mut message = NewMessage::new("model", format!("m{written}"));
                    written += 1;
                    if let Some(k) = key {
                        message = message.key(k);
                    }
                    model.index.insert(message.id, model.msgs.len());
                    idx.push(model.msgs.len());
                    model.msgs.push(Msg {
                        id: message.id,
                        key: key.map(str::to_string),
                        state: State::Open,
                        tx,
                    });
                    batch.push(message);
                }
                open.push((idx, f.begin(&batch).await));
            }
            // One open transaction commits (or, now and then, rolls back).
            18..=35 if !open.is_empty() => {
                let (idx, tx) = open.remove(rng.usize(..open.len()));
                if let Some(&i) = idx.first() {
                    model.open_txs.remove(&model.msgs[i].tx);
                }
                let commit = rng.u8(..10) < 8;
                if commit {
                    tx.commit().await;
                } else {
                    tx.rollback().await;
                }
                for i in idx {
                    model.msgs[i].state = if commit {
                        State::Waiting { at: model.now }
                    } else {
                        State::RolledBack
                    };
                }
            }
            // A relay without a batch claims one.
            36..=59 => {
                let r = rng.usize(..RELAYS);
                if claims[r].is_some() {
                    continue;
                }
                let limit = if rng.bool() { rng.usize(1..=4) } else { 100 };
                let lease = if rng.u8(..4) == 0 { 3 * HOUR } else { HOUR };
                let claim = relay_storage(&storage, &second, r)
                    .claim(&format!("relay-{r}"), limit, lease)
                    .await
                    .unwrap_or_else(|e| panic!("{}: {e}", context("claim")));
                if let Err(why) = model.check_claim(&claim, limit) {
                    panic!("{}: {why}", context("claim"));
                }
                for message in &claim.messages {
                    let i = model.index[&message.id];
                    model.msgs[i].state = State::Held {
                        token: claim.token,
                        until: model.now + lease,
                    };
                }
                if trace {
                    let got: Vec<usize> =
                        claim.messages.iter().map(|m| model.index[&m.id]).collect();
                    eprintln!(
                        "[model]   relay {r} (process {}) claims {got:?} under {:?}",
                        if second.is_some() && r == 2 { 2 } else { 1 },
                        claim.token
                    );
                }
                claims[r] = Some(claim);
            }
            // A relay publishes its batch as the worker does and settles it in one call.
            60..=79 => {
                let r = rng.usize(..RELAYS);
                let Some(claim) = claims[r].take() else {
                    continue;
                };
                let settlement = publish_like_the_worker(&claim, &mut rng);
                let expected = settlement_count(&model, &claim.token, &settlement);
                let applied = relay_storage(&storage, &second, r)
                    .settle(&claim.token, &settlement)
                    .await
                    .unwrap_or_else(|e| panic!("{}: {e}", context("settle")));
                assert_eq!(
                    applied,
                    expected,
                    "{}: the settlement changed another number of messages than the model",
                    context("settle")
                );
                if trace {
                    let of =
                        |ids: Vec<Uuid>| ids.iter().map(|id| model.index[id]).collect::<Vec<_>>();
                    eprintln!(
                        "[model]   relay {r} settles {:?}: delivered {:?} retried {:?} dead {:?} released {:?}",
                        claim.token,
                        of(settlement.delivered.iter().map(|d| d.id).collect()),
                        of(settlement.retries.iter().map(|d| d.id).collect()),
                        of(settlement.dead.iter().map(|d| d.id).collect()),
                        of(settlement.released.clone())
                    );
                }
                apply_settlement(&mut model, &claim.token, &settlement);
            }
            // A relay dies with its batch: nothing is written, the lease runs out later.
            80..=82 => claims[rng.usize(..RELAYS)] = None,
            // The relay process restarts, stopping or dying: its batches are gone, and
            // every lease and delay runs out before the next one claims (a storage may keep
            // them only in memory).
            83..=84 => {
                if let Some(s) = second.take() {
                    s.stop()
                        .await
                        .unwrap_or_else(|e| panic!("{}: {e}", context("stop")));
                }
                let stop = rng.bool();
                if !f.restart(stop).await {
                    continue;
                }
                model.redelivery |= !stop;
                storage = f.storage();
                claims.iter_mut().for_each(|c| *c = None);
                model.two_processes = false;
                f.advance(4 * HOUR).await;
                model.now += 4 * HOUR;
            }
            // A second relay process joins (relay 2 claims through it), or leaves, stopping
            // (then, as at a restart, every lease and delay runs out).
            85..=86 => match second.take() {
                None => {
                    let Some(s) = f.replica() else { continue };
                    claims[2] = None;
                    // Batches whose lease ran out are given up: their parts of the queue
                    // may now change hands, and a late settlement of them may count less
                    // than a storage that keeps one queue would (their rows go out again).
                    for claim in claims.iter_mut() {
                        let expired = claim.as_ref().is_some_and(|c| {
                            c.messages.iter().any(|m| {
                                matches!(model.msgs[model.index[&m.id]].state,
                                    State::Held { until, .. } if until <= model.now)
                            })
                        });
                        if expired {
                            *claim = None;
                        }
                    }
                    second = Some(s);
                    model.two_processes = true;
                    // Time may have passed since the first process last renewed what it
                    // holds: the second may take that over, as from a relay that stalled,
                    // and deliver again what the first delivered (at least once).
                    model.redelivery = true;
                }
                Some(s) => {
                    s.stop()
                        .await
                        .unwrap_or_else(|e| panic!("{}: {e}", context("stop")));
                    claims[2] = None;
                    model.two_processes = false;
                    f.advance(4 * HOUR).await;
                    model.now += 4 * HOUR;
                }
            },
            // Time passes: one-hour leases and delays run out (not while a second process
            // runs: its clock would not follow).
            87..=91 if second.is_none() => {
                f.advance(ADVANCE).await;
                model.now += ADVANCE;
            }
            // The operator purges a dead letter: it is gone for good, its key stays parked.
            92..=93 => {
                let Some(i) = a_dead_letter(&model, &mut rng) else {
                    continue;
                };
                let n = f.purge_dead_letters(&[model.msgs[i].id]).await;
                assert_eq!(n, 1, "{}: purge count", context("purge"));
                model.msgs[i].state = State::Purged;
            }
            // The operator replays a dead letter.
            94..=95 => {
                let Some(i) = a_dead_letter(&model, &mut rng) else {
                    continue;
                };
                let n = f.replay_dead_letters(&[model.msgs[i].id]).await;
                assert_eq!(n, 1, "{}: replay count", context("replay"));
                replay(&mut model, i);
                if model.horizon && model.msgs[i].key.is_none() {
                    // Without a key, order does not matter: such a storage appends the
                    // message again, written by a transaction that begins (and ends) now.
                    model.msgs[i].tx = next_tx;
                    next_tx += 1;
                }
            }
            // The operator releases a parked key.
            96..=99 => {
                let Some(key) = model.parked.iter().next().cloned() else {
                    continue;
                };
                assert!(
                    f.release_parked_key(&key).await,
                    "{}: key {key} was parked",
                    context("release key")
                );
                model.parked.remove(&key);
            }
            _ => {}
        }
    }

    // The end: the second process leaves, open transactions commit, time passes, dead
    // letters are replayed, and the relay drains everything; every committed message is
    // delivered.
    if let Some(s) = second.take() {
        s.stop().await.expect("stop");
        model.two_processes = false;
    }
    model.open_txs.clear();
    for (idx, tx) in open.drain(..) {
        tx.commit().await;
        for i in idx {
            model.msgs[i].state = State::Waiting { at: model.now };
        }
    }
    f.advance(4 * HOUR).await;
    model.now += 4 * HOUR;
    let dead: Vec<usize> = (0..model.msgs.len())
        .filter(|&i| model.msgs[i].state == State::Dead)
        .collect();
    for &i in &dead {
        assert_eq!(f.replay_dead_letters(&[model.msgs[i].id]).await, 1);
        replay(&mut model, i);
    }
    for key in std::mem::take(&mut model.parked) {
        f.release_parked_key(&key).await;
    }
    for round in 0.. {
        assert!(round < 200, "seed {seed}: the storage never drained");
        let claim = storage
            .claim("drain", 100, HOUR)
            .await
            .expect("drain claim");
        if claim.messages.is_empty() {
            break;
        }
        if let Err(why) = model.check_claim(&claim, 100) {
            panic!("seed {seed}, draining: {why}");
        }
        let settlement = Settlement {
            delivered: claim
                .messages
                .iter()
                .map(|m| Delivery {
                    id: m.id,
                    receipt: Receipt::new("drained"),
                })
                .collect(),
            ..Settlement::default()
        };
        for message in &claim.messages {
            let i = model.index[&message.id];
            model.msgs[i].state = State::Held {
                token: claim.token,
                until: model.now + HOUR,
            };
        }
        storage
            .settle(&claim.token, &settlement)
            .await
            .expect("drain settle");
        apply_settlement(&mut model, &claim.token, &settlement);
    }
    let left: Vec<(usize, State)> = model
        .msgs
        .iter()
        .enumerate()
        .filter(|(_, m)| {
            !matches!(
                m.state,
                State::Delivered | State::RolledBack | State::Purged
            )
        })
        .map(|(i, m)| (i, m.state))
        .collect();
    assert!(left.is_empty(), "seed {seed}: never delivered: {left:?}");
}

/// A dead letter of the model, at random.
fn a_dead_letter(model: &Model, rng: &mut fastrand::Rng) -> Option<usize> {
    let dead: Vec<usize> = (0..model.msgs.len())
        .filter(|&i| model.msgs[i].state == State::Dead)
        .collect();
    (!dead.is_empty()).then(|| dead[rng.usize(..dead.len())])
}

/// The storage relay `r` claims through: the second process's for relay 2 while it runs.
fn relay_storage<'a>(
    first: &'a Arc<dyn Storage>,
    second: &'a Option<Arc<dyn Storage>>,
    r: usize,
) -> &'a Arc<dyn Storage> {
    match second {
        Some(s) if r == 2 => s,
        _ => first,
    }
}

/// The worker's rules: a key's messages go in order, and at a key's first failure the rest
/// of the key in the batch is released. Outcomes are drawn at random.
fn publish_like_the_worker(claim: &Claim, rng: &mut fastrand::Rng) -> Settlement {
    let mut settlement = Settlement::default();
    let mut stopped: HashSet<&str> = HashSet::new();
    for m in &claim.messages {
        if m.key.as_deref().is_some_and(|k| stopped.contains(k)) {
            settlement.released.push(m.id);
            continue;
        }
        match rng.u8(..100) {
            0..=64 => {
                settlement.delivered.push(Delivery {
                    id: m.id,
                    receipt: Receipt::new("model"),
                });
                continue;
            }
            65..=79 => settlement.retries.push(Retry {
                id: m.id,
                delay: if rng.bool() { Duration::ZERO } else { HOUR },
                error: "refused".into(),
            }),
            80..=86 => settlement.dead.push(DeadLetter {
                id: m.id,
                error: "poison".into(),
            }),
            _ => settlement.released.push(m.id),
        }
        if let Some(k) = m.key.as_deref() {
            stopped.insert(k);
        }
    }
    settlement
}

/// How many messages of `settlement` the storage must change: those still held under
/// `token`.
fn settlement_count(model: &Model, token: &ClaimToken, s: &Settlement) -> u64 {
    let ids = s
        .delivered
        .iter()
        .map(|d| d.id)
        .chain(s.retries.iter().map(|r| r.id))
        .chain(s.dead.iter().map(|d| d.id))
        .chain(s.released.iter().copied());
    ids.filter(|id| model.held_by(model.index[id], token))
        .count() as u64
}

fn apply_settlement(model: &mut Model, token: &ClaimToken, s: &Settlement) {
    let now = model.now;
    let set = |model: &mut Model, id: &Uuid, state: State| {
        let i = model.index[id];
        if model.held_by(i, token) {
            model.msgs[i].state = state;
            true
        } else {
            false
        }
    };
    for d in &s.dead {
        if set(model, &d.id, State::Dead)
            && let Some(key) = model.msgs[model.index[&d.id]].key.clone()
        {
            model.parked.insert(key);
        }
    }
    for r in &s.retries {
        set(model, &r.id, State::Waiting { at: now + r.delay });
    }
    for d in &s.delivered {
        set(model, &d.id, State::Delivered);
    }
    for id in &s.released {
        set(model, id, State::Waiting { at: now });
    }
}

fn replay(model: &mut Model, i: usize) {
    model.msgs[i].state = State::Waiting { at: model.now };
    if let Some(key) = model.msgs[i].key.clone()
        && !model
            .msgs
            .iter()
            .any(|m| m.state == State::Dead && m.key.as_ref() == Some(&key))
    {
        model.parked.remove(&key);
    }
}
