//! The storage checks.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    Claim, ClaimToken, DeadLetter, Delivery, NewMessage, Receipt, Retry, Settlement, Storage,
    StorageAdmin, TraceContext,
};
use uuid::Uuid;

/// Writes that a storage holds back until they commit: the application's transaction.
#[async_trait]
pub trait PendingWrite: Send {
    /// Commits the transaction: its messages become claimable.
    async fn commit(self: Box<Self>);
    /// Rolls the transaction back: its messages must never be claimed.
    async fn rollback(self: Box<Self>);
}

/// One fresh storage under test.
#[async_trait]
pub trait StorageFixture: Send + Sync {
    /// The storage the relay uses.
    fn storage(&self) -> Arc<dyn Storage>;

    /// Starts a transaction that writes `messages` in order; they must not be claimable
    /// until it commits. Two transactions may be open at once and commit in either order.
    async fn begin(&self, messages: &[NewMessage]) -> Box<dyn PendingWrite>;

    /// Writes `messages` in one committed transaction.
    async fn enqueue(&self, messages: &[NewMessage]) {
        self.begin(messages).await.commit().await;
    }

    /// The operator's side of the same stored queue (`outbox dead-letters …`): the checks
    /// replay, release and purge through it.
    fn admin(&self) -> Arc<dyn StorageAdmin>;

    /// The operator's replay: puts these dead letters back at their original place in their
    /// key's order and unparks each key once none of its dead letters remain. Returns how
    /// many were replayed.
    async fn replay_dead_letters(&self, ids: &[Uuid]) -> u64 {
        self.admin()
            .replay_dead_letters(ids)
            .await
            .unwrap_or_else(|e| panic!("replaying dead letters: {e}"))
    }

    /// The operator's release of a parked key: its later messages flow without its dead
    /// letter. Returns whether it was parked.
    async fn release_parked_key(&self, key: &str) -> bool {
        self.admin()
            .release_parked_key(key)
            .await
            .unwrap_or_else(|e| panic!("releasing parked key {key:?}: {e}"))
    }

    /// The operator's purge: deletes these dead letters for good (their keys stay parked).
    /// Returns how many were deleted.
    async fn purge_dead_letters(&self, ids: &[Uuid]) -> u64 {
        self.admin()
            .purge_dead_letters(ids)
            .await
            .unwrap_or_else(|e| panic!("purging dead letters: {e}"))
    }

    /// The relay stops and another starts on the same stored queue, which [`storage`]
    /// returns from now on: whatever the first kept only in memory is gone. With `stop`, it
    /// stops as at a shutdown (`Storage::stop`); without, it dies (its leases run out).
    /// Returns false for a storage that lives in one process (nothing outlives its relay):
    /// the checks of restarts are skipped for it.
    ///
    /// [`storage`]: StorageFixture::storage
    async fn restart(&self, stop: bool) -> bool {
        let _ = stop;
        false
    }

    /// Moves the storage's clock ahead by `by`, as if that much time had passed: leases
    /// and retry delays run out sooner. (For a database: shift the stored times back.)
    async fn advance(&self, by: Duration);
    /// Another relay's handle on the same storage (its own connections), for the checks of
    /// what relays share. `None` for a storage that lives in one process.
    fn replica(&self) -> Option<Arc<dyn Storage>> {
        None
    }
}

/// What a storage backend gives the suite.
///
/// ```text
/// use outbox_testkit::{PendingWrite, StorageFixture, StorageHarness};
///
/// struct PgHarness;
///
/// #[async_trait::async_trait]
/// impl StorageHarness for PgHarness {
///     async fn fresh(&self, per_key_order: bool) -> Box<dyn StorageFixture> {
///         // a new schema, migrated; the fixture drops it when dropped
///         Box::new(PgFixture(TestOutbox::with_config(|c| c.per_key_order = per_key_order).await))
///     }
/// }
/// // PgFixture::begin opens a sqlx transaction and enqueues into it; its PendingWrite
/// // commits or rolls that transaction back.
/// ```
#[async_trait]
pub trait StorageHarness: Send + Sync {
    /// A fresh, empty storage that keeps per-key order or not. A storage that cannot turn
    /// per-key order off (or on) returns one with its own setting; the suite reads
    /// `capabilities()` and checks what applies.
    async fn fresh(&self, per_key_order: bool) -> Box<dyn StorageFixture>;

    /// What the harness's writes do, for the checks that depend on it (they skip, saying
    /// why, where the harness cannot do what they need). The default suits a storage
    /// written like PostgreSQL.
    fn traits(&self) -> HarnessTraits {
        HarnessTraits::default()
    }
}

/// How a harness's writes behave ([`StorageHarness::traits`]): facts of the storage's
/// database, not of the storage under test, which the checks that model PostgreSQL's
/// writers need; and what the storage's admin listings show when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HarnessTraits {
    /// A message takes its place in its key's order when its transaction writes it, before
    /// a later transaction that commits first (PostgreSQL's sequence): true. False where
    /// it takes its place at its commit (SQLite's one writer): the late-commit check and
    /// the randomised model, which number messages when they are written, skip.
    pub positions_at_write: bool,
    /// One task can write in a transaction while another transaction it wrote in is still
    /// open, without waiting for it: true. False where such a write can wait for the open
    /// one (InnoDB's next-key lock on an id whose deleted entry is not yet purged): the
    /// randomised model, which keeps transactions open while it writes, skips.
    pub writes_beside_open_transactions: bool,
    /// A replayed dead letter's key leaves the parked keys at the replay: true. False where
    /// it is listed until its messages have drained (PostgreSQL's log mode, which learns of
    /// that at a claim): the operator's-repairs check reads the listing once it drained.
    pub replays_unpark_at_once: bool,
}

impl Default for HarnessTraits {
    fn default() -> Self {
        HarnessTraits {
            positions_at_write: true,
            writes_beside_open_transactions: true,
            replays_unpark_at_once: true,
        }
    }
}

impl HarnessTraits {
    /// Messages take their place at commit ([`positions_at_write`](Self::positions_at_write)
    /// false).
    pub fn positions_at_commit(self) -> Self {
        HarnessTraits {
            positions_at_write: false,
            ..self
        }
    }

    /// A write may wait for another open transaction
    /// ([`writes_beside_open_transactions`](Self::writes_beside_open_transactions) false).
    pub fn writes_wait_for_open_transactions(self) -> Self {
        HarnessTraits {
            writes_beside_open_transactions: false,
            ..self
        }
    }

    /// A replayed key stays listed parked until it has drained
    /// ([`replays_unpark_at_once`](Self::replays_unpark_at_once) false).
    pub fn replays_unpark_when_drained(self) -> Self {
        HarnessTraits {
            replays_unpark_at_once: false,
            ..self
        }
    }
}

const LEASE: Duration = Duration::from_secs(30);
/// A retry delay that no check waits out.
const LONG: Duration = Duration::from_secs(3600);
/// A lease or delay short enough to wait out in a test.
const SHORT: Duration = Duration::from_millis(300);
/// Comfortably longer than [`SHORT`], also on a loaded machine's clock.
const WAIT_OUT: Duration = Duration::from_millis(700);

fn msg(payload: &str) -> NewMessage {
    NewMessage::new("conformance", payload)
}

fn keyed(key: &str, payload: &str) -> NewMessage {
    NewMessage::new("conformance", payload).key(key)
}

/// Messages of key `key` with these payloads, in order.
fn of_key(key: &str, payloads: &[&str]) -> Vec<NewMessage> {
    payloads.iter().map(|p| keyed(key, p)).collect()
}

/// Writes `p1` and `p2` of key `poison` and claims one message.
async fn claim_one_of_poison(f: &dyn StorageFixture) -> Claim {
    f.enqueue(&of_key("poison", &["p1", "p2"])).await;
    claim(&*f.storage(), "w1", 1, LEASE).await
}

fn payloads(claim: &Claim) -> Vec<String> {
    claim
        .messages
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

fn ids(claim: &Claim) -> Vec<Uuid> {
    claim.messages.iter().map(|m| m.id).collect()
}

fn deliveries(claim: &Claim) -> Vec<Delivery> {
    claim
        .messages
        .iter()
        .map(|m| Delivery {
            id: m.id,
            receipt: Receipt::new(format!("r-{}", m.id)),
        })
        .collect()
}

async fn claim(storage: &dyn Storage, worker: &str, limit: usize, lease: Duration) -> Claim {
    storage
        .claim(worker, limit, lease)
        .await
        .unwrap_or_else(|e| panic!("claim by {worker}: {e}"))
}

/// Waits out the [`SHORT`] leases and delays, then claims as `worker`.
async fn claim_after_wait(storage: &dyn Storage, worker: &str) -> Claim {
    tokio::time::sleep(WAIT_OUT).await;
    claim(storage, worker, 10, LEASE).await
}

/// Claims nothing as `worker` now (else fails with `held`), and what is due once the
/// [`SHORT`] leases and delays have run out.
async fn claimed_only_after_wait(storage: &dyn Storage, worker: &str, held: &str) -> Claim {
    let now = claim(storage, worker, 10, LEASE).await;
    assert!(now.messages.is_empty(), "{held}");
    claim_after_wait(storage, worker).await
}

/// Acknowledges every message of `claim`; returns how many the storage changed.
async fn ack_all(storage: &dyn Storage, claim: &Claim) -> u64 {
    acked(storage, &claim.token, &deliveries(claim)).await
}

/// The storage's writes under a claim's token as the checks make them: each returns how many
/// messages the storage changed, and a storage error fails the check, naming the call.
macro_rules! writes {
    ($($name:ident: $call:ident($($arg:ident: $ty:ty),*);)+) => {$(
        async fn $name(storage: &dyn Storage, token: &ClaimToken, $($arg: $ty),*) -> u64 {
            let done = storage.$call(token, $($arg),*).await;
            done.unwrap_or_else(|e| panic!("{}: {e}", stringify!($call)))
        }
    )+};
}

writes! {
    acked: ack(delivered: &[Delivery]);
    retried: retry(failed: &[Retry]);
    dead_lettered: dead_letter(dead: &[DeadLetter]);
    released: release(ids: &[Uuid]);
    settled: settle(settlement: &Settlement);
    extended: extend_lease(ids: &[Uuid], lease: Duration);
}

fn dead_letter(m: &outbox_core::Message, error: &str) -> DeadLetter {
    DeadLetter {
        id: m.id,
        error: error.into(),
    }
}

/// Two claims in a row hand out nothing: a released key has drained.
async fn assert_drained(storage: &dyn Storage, check: &str) {
    for _ in 0..2 {
        let empty = claim(storage, "w1", 10, LEASE).await;
        assert_eq!(payloads(&empty), Vec::<String>::new(), "{check}: drained");
    }
}

/// Claims the head of key `k` alone (`head`) and dead-letters it; returns its id and how
/// many messages the storage changed.
async fn dead_letter_head(storage: &dyn Storage, head: &str, check: &str) -> (Uuid, u64) {
    let c = claim(storage, "w1", 1, LEASE).await;
    assert_eq!(payloads(&c), [head], "{check}: the head");
    let dead = dead_letter(&c.messages[0], "poison");
    (
        c.messages[0].id,
        dead_lettered(storage, &c.token, &[dead]).await,
    )
}

/// As an operator would: dead-letters the head of key `k` (`head`) and releases the parked
/// key; returns the dead letter's id.
async fn dead_letter_and_release(f: &dyn StorageFixture, head: &str, check: &str) -> Uuid {
    let (dead, _) = dead_letter_head(&*f.storage(), head, check).await;
    assert!(f.release_parked_key("k").await, "{check}: k was parked");
    dead
}

/// A fixture whose capabilities are checked to be what the check needs.
pub(crate) async fn fixture(
    h: &dyn StorageHarness,
    per_key_order: bool,
) -> Option<Box<dyn StorageFixture>> {
    let f = h.fresh(per_key_order).await;
    if f.storage().capabilities().per_key_order == per_key_order {
        Some(f)
    } else {
        None
    }
}

/// A fresh fixture of the harness and its storage.
async fn fresh(
    h: &dyn StorageHarness,
    per_key_order: bool,
) -> (Box<dyn StorageFixture>, Arc<dyn Storage>) {
    let f = h.fresh(per_key_order).await;
    let storage = f.storage();
    (f, storage)
}

/// A [`fixture`] and its storage, or the check returns, saying why.
macro_rules! fixture_or_skip {
    ($h:expr, $per_key_order:expr, $check:expr) => {
        match fixture($h, $per_key_order).await {
            Some(f) => {
                let storage = f.storage();
                (f, storage)
            }
            None => {
                super::note(
                    $check,
                    format!(
                        "skipped: the storage cannot set per_key_order = {}",
                        $per_key_order
                    ),
                );
                return;
            }
        }
    };
}

/// A storage made with per-key order on reports it on (and off when asked, if it can).
pub async fn storage_declares_what_was_asked(h: &dyn StorageHarness) {
    let on = h.fresh(true).await;
    let off = h.fresh(false).await;
    let (on, off) = (on.storage().capabilities(), off.storage().capabilities());
    assert!(
        on.per_key_order || !off.per_key_order,
        "capabilities: neither storage keeps per-key order; the suite runs its order checks on one that does"
    );
}

/// A committed transaction's messages are claimed; a rolled-back one's never are.
pub async fn storage_commit_delivers_rollback_does_not(h: &dyn StorageHarness) {
    let (f, storage) = fresh(h, true).await;
    f.begin(&[msg("rolled back 1"), msg("rolled back 2")])
        .await
        .rollback()
        .await;
    f.begin(&[msg("committed")]).await.commit().await;
    let c = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(payloads(&c), ["committed"], "commit and rollback");
    assert_eq!(ack_all(&*storage, &c).await, 1);
    assert!(
        claim(&*storage, "w1", 10, LEASE).await.messages.is_empty(),
        "rolled back messages must never appear"
    );
}

/// Every field of a message survives storage exactly.
pub async fn storage_fields_survive_exactly(h: &dyn StorageHarness) {
    let f = h.fresh(true).await;
    let binary: Vec<u8> = (0..=255u8).rev().collect();
    let sent = vec![
        NewMessage::new("orders.created", binary)
            .key("order-1")
            .header("content-type", "application/octet-stream")
            .header("x-ünïcode", "värde ✓ 東京")
            .trace_context(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: Some("congo=t61rcWkgMzE".into()),
            }),
        NewMessage::json("orders.created", &serde_json::json!({"id": 7})).expect("json"),
        NewMessage::new("empty", Vec::new()),
    ];
    f.enqueue(&sent).await;
    let c = claim(&*f.storage(), "w1", 10, LEASE).await;
    assert_eq!(c.messages.len(), sent.len(), "fields: claimed count");
    for (sent, got) in sent.iter().zip(&c.messages) {
        assert_eq!(got.id, sent.id, "fields: id");
        assert_eq!(got.topic, sent.topic, "fields: topic");
        assert_eq!(got.key, sent.key, "fields: key");
        assert_eq!(got.payload, sent.payload, "fields: payload");
        assert_eq!(got.headers, sent.headers, "fields: headers");
        assert_eq!(
            got.trace_context, sent.trace_context,
            "fields: trace context"
        );
        assert_eq!(got.attempts, 0, "fields: attempts of a new message");
        assert_eq!(
            got.created_at.timestamp_micros(),
            sent.created_at.timestamp_micros(),
            "fields: created_at (to the microsecond)"
        );
    }
}

/// Claims return messages without a key in enqueue order, at most `limit` at a time, each once.
pub async fn storage_claims_in_enqueue_order_up_to_the_limit(h: &dyn StorageHarness) {
    let (f, storage) = fresh(h, true).await;
    assert!(
        claim(&*storage, "w1", 10, LEASE).await.messages.is_empty(),
        "an empty storage claims nothing"
    );
    let sent: Vec<NewMessage> = (0..10).map(|i| msg(&format!("{i}"))).collect();
    f.enqueue(&sent[..5]).await;
    f.enqueue(&sent[5..]).await;
    let first = claim(&*storage, "w1", 4, LEASE).await;
    assert_eq!(payloads(&first), ["0", "1", "2", "3"], "the first claim");
    let rest = claim(&*storage, "w2", 100, LEASE).await;
    assert_eq!(
        payloads(&rest),
        ["4", "5", "6", "7", "8", "9"],
        "the second claim"
    );
    assert!(
        claim(&*storage, "w3", 100, LEASE).await.messages.is_empty(),
        "claimed messages are not claimed again"
    );
}

/// Acknowledged messages are gone; `ack` counts what it changed.
pub async fn storage_ack_removes_messages(h: &dyn StorageHarness) {
    let (f, storage) = fresh(h, true).await;
    f.enqueue(&[msg("a"), msg("b"), msg("c")]).await;
    let c = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(
        acked(&*storage, &c.token, &deliveries(&c)[..2]).await,
        2,
        "ack count"
    );
    assert_eq!(
        acked(&*storage, &c.token, &deliveries(&c)[..2]).await,
        0,
        "a second ack changes nothing"
    );
    assert_figures!(storage, pending: 0, in_flight: 1; "after acking two of three");
    assert_eq!(acked(&*storage, &c.token, &deliveries(&c)[2..]).await, 1);
    assert_figures!(storage, pending: 0, in_flight: 0, dead_lettered: 0; "all acked");
    assert!(
        claim(&*storage, "w1", 10, LEASE).await.messages.is_empty(),
        "acked messages are never claimed again"
    );
}

/// `retry` charges an attempt and makes the message due after its delay, not before.
pub async fn storage_retry_charges_an_attempt_and_waits(h: &dyn StorageHarness) {
    let (f, storage) = fresh(h, true).await;
    f.enqueue(&[msg("flaky")]).await;
    let c = claim(&*storage, "w1", 10, LEASE).await;
    let retry = Retry {
        id: c.messages[0].id,
        delay: SHORT,
        error: "broker said no".into(),
    };
    assert_eq!(
        retried(&*storage, &c.token, &[retry]).await,
        1,
        "retry count"
    );
    let held = "a retried message waits out its delay";
    let again = claimed_only_after_wait(&*storage, "w1", held).await;
    assert_eq!(
        ids(&again),
        ids(&c),
        "the retried message is due after its delay"
    );
    assert_eq!(again.messages[0].attempts, 1, "retry charges one attempt");
}

/// `release` gives messages back at once without charging an attempt.
pub async fn storage_release_charges_nothing(h: &dyn StorageHarness) {
    let (f, storage) = fresh(h, true).await;
    f.enqueue(&of_key("k", &["1", "2"])).await;
    let c = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(
        released(&*storage, &c.token, &ids(&c)).await,
        2,
        "release count"
    );
    let again = claim(&*storage, "w2", 10, LEASE).await;
    assert_eq!(
        payloads(&again),
        ["1", "2"],
        "released messages come back in order"
    );
    assert!(
        again.messages.iter().all(|m| m.attempts == 0),
        "release charges no attempt"
    );
}

/// With per-key order, a dead-lettered message parks the rest of its key; other keys go on.
pub async fn storage_dead_letter_parks_the_key_with_key_order(h: &dyn StorageHarness) {
    let check = "dead letter with key order";
    let (f, storage) = fixture_or_skip!(h, true, check);
    let c = claim_one_of_poison(&*f).await;
    assert_eq!(payloads(&c), ["p1"], "{check}: the first claim");
    f.enqueue(&[keyed("fine", "f1")]).await;
    let dead = dead_letter(&c.messages[0], "cannot be delivered");
    assert_eq!(
        dead_lettered(&*storage, &c.token, &[dead]).await,
        1,
        "{check}: count"
    );
    let next = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(
        payloads(&next),
        ["f1"],
        "{check}: the poisoned key is parked, the other key goes on"
    );
    let stats = assert_figures!(storage, dead_lettered: 1, parked_keys: 1; "{check}");
    assert_eq!(
        stats.pending, 1,
        "{check}: a parked message still counts as pending: {stats:?}"
    );
}

/// Without per-key order, a dead letter parks nothing.
pub async fn storage_dead_letter_without_key_order_parks_nothing(h: &dyn StorageHarness) {
    let check = "dead letter without key order";
    let (f, storage) = fixture_or_skip!(h, false, check);
    let c = claim_one_of_poison(&*f).await;
    let dead = dead_letter(&c.messages[0], "cannot be delivered");
    assert_eq!(
        dead_lettered(&*storage, &c.token, &[dead]).await,
        1,
        "{check}: count"
    );
    assert_eq!(
        payloads(&claim(&*storage, "w1", 10, LEASE).await),
        ["p2"],
        "{check}"
    );
    assert_figures!(storage, dead_lettered: 1, parked_keys: 0; "{check}");
}

/// Once a claim's lease expired and another worker claimed its messages, every write under
/// the old token changes nothing; the new claim's writes go through.
pub async fn storage_fences_stale_claims(h: &dyn StorageHarness) {
    let check = "fencing";
    let (f, storage) = fresh(h, true).await;
    f.enqueue(&[msg("a"), msg("b")]).await;
    let stale = claim(&*storage, "w1", 10, SHORT).await;
    let fresh = claim_after_wait(&*storage, "w2").await;
    assert_eq!(
        ids(&fresh),
        ids(&stale),
        "{check}: the expired claim's messages are claimed again"
    );
    assert_ne!(
        fresh.token, stale.token,
        "{check}: a new claim has a new token"
    );
    let retries: Vec<Retry> = stale
        .messages
        .iter()
        .map(|m| retry(m, Duration::ZERO))
        .collect();
    let dead: Vec<DeadLetter> = stale
        .messages
        .iter()
        .map(|m| dead_letter(m, "late"))
        .collect();
    assert_eq!(ack_all(&*storage, &stale).await, 0, "{check}: stale ack");
    assert_eq!(
        retried(&*storage, &stale.token, &retries).await,
        0,
        "{check}: stale retry"
    );
    assert_eq!(
        dead_lettered(&*storage, &stale.token, &dead).await,
        0,
        "{check}: stale dead letter"
    );
    assert_eq!(
        released(&*storage, &stale.token, &ids(&stale)).await,
        0,
        "{check}: stale release"
    );
    assert_figures!(storage, in_flight: 2, dead_lettered: 0;
        "{check}: the stale writes changed something");
    assert_eq!(
        ack_all(&*storage, &fresh).await,
        2,
        "{check}: the live claim's ack"
    );
}

/// A claimed message is not claimed again while its lease lasts, and is once it expires.
pub async fn storage_leases_expire(h: &dyn StorageHarness) {
    let check = "lease expiry";
    let (f, storage) = fresh(h, false).await;
    f.enqueue(&[msg("a")]).await;
    let first = claim(&*storage, "w1", 10, SHORT).await;
    assert_eq!(first.messages.len(), 1, "{check}");
    let held = format!("{check}: claimed again during its lease");
    let second = claimed_only_after_wait(&*storage, "w2", &held).await;
    assert_eq!(
        ids(&second),
        ids(&first),
        "{check}: not claimable after its lease expired"
    );
    assert_eq!(
        second.messages[0].attempts, 0,
        "{check}: an expired lease charges no attempt"
    );
}

/// With per-key order, a key's later messages wait while its head is in flight or waiting
/// to retry, and come in order after it.
pub async fn storage_holds_a_key_back_while_its_head_is_out(h: &dyn StorageHarness) {
    let check = "key order";
    let (f, storage) = fixture_or_skip!(h, true, check);
    f.enqueue(&of_key("k", &["k1", "k2"])).await;
    let head = claim(&*storage, "w1", 1, LEASE).await;
    assert_eq!(payloads(&head), ["k1"], "{check}: the first claim");
    // Which key goes first is the storage's choice; within a key it is enqueue order.
    f.enqueue(&[keyed("j", "j1"), keyed("k", "k3")]).await;
    let other = claim(&*storage, "w2", 10, LEASE).await;
    assert_eq!(
        payloads(&other),
        ["j1"],
        "{check}: k2 and k3 must wait while k1 is in flight"
    );
    // The head fails and waits to retry: the key still waits.
    let retry = Retry {
        id: head.messages[0].id,
        delay: SHORT,
        error: "nack".into(),
    };
    assert_eq!(retried(&*storage, &head.token, &[retry]).await, 1);
    let held = format!("{check}: k2 must wait while k1 waits to retry");
    let again = claimed_only_after_wait(&*storage, "w2", &held).await;
    assert_eq!(
        payloads(&again),
        ["k1", "k2", "k3"],
        "{check}: the key comes back in order, head first"
    );
}

/// Without per-key order, a key's messages do not wait for each other.
pub async fn storage_without_key_order_keys_do_not_block(h: &dyn StorageHarness) {
    let check = "no key order";
    let (f, storage) = fixture_or_skip!(h, false, check);
    f.enqueue(&of_key("k", &["k1", "k2"])).await;
    assert_eq!(
        payloads(&claim(&*storage, "w1", 1, LEASE).await),
        ["k1"],
        "{check}"
    );
    assert_eq!(
        payloads(&claim(&*storage, "w2", 1, LEASE).await),
        ["k2"],
        "{check}: k2 need not wait for k1"
    );
}

/// With per-key order, one claim takes at most the storage's declared `max_per_key`
/// messages of a key, however high its limit (the worker's start-up check sizes the lease on
/// it: rounds × publish time-out, so a claim that took more would let a batch outlive its
/// lease); the next claims go on with the key, in order.
pub async fn storage_a_claim_takes_at_most_max_per_key_of_a_key(h: &dyn StorageHarness) {
    let check = "max_per_key";
    let (f, storage) = fixture_or_skip!(h, true, check);
    let Some(cap) = storage.capabilities().max_per_key else {
        super::note(
            check,
            "skipped: the storage declares no max_per_key (a claim may take a key's messages \
             up to its limit)",
        );
        return;
    };
    let total = cap * 2 + 3;
    let many: Vec<NewMessage> = (0..total)
        .map(|i| keyed("a", &format!("a{i:03}")))
        .chain((0..2).map(|i| keyed("b", &format!("b{i:03}"))))
        .collect();
    f.enqueue(&many).await;
    // A limit that holds everything: only max_per_key may keep key a's messages out.
    let limit = many.len();
    let mut seen: Vec<String> = Vec::new();
    for round in 0..total.div_ceil(cap) + 1 {
        let c = claim(&*storage, "w1", limit, LEASE).await;
        let a: Vec<String> = payloads(&c)
            .into_iter()
            .filter(|p| p.starts_with('a'))
            .collect();
        assert!(
            a.len() <= cap,
            "{check}: claim {round} took {} messages of key a, over max_per_key = {cap}",
            a.len()
        );
        seen.extend(a);
        ack_all(&*storage, &c).await;
    }
    let expected: Vec<String> = (0..total).map(|i| format!("a{i:03}")).collect();
    assert_eq!(
        seen, expected,
        "{check}: key a over successive claims, in order"
    );
}

/// Transactions that commit in another order than they began lose nothing: a message
/// committed after later ones were claimed and acknowledged is still claimed.
pub async fn storage_out_of_order_commits_lose_nothing(h: &dyn StorageHarness) {
    let check = "out-of-order commits";
    let (f, storage) = fresh(h, true).await;
    let sent: Vec<NewMessage> = (0..12).map(|i| msg(&format!("{i}"))).collect();
    let mut open = Vec::new();
    for m in &sent {
        open.push(f.begin(std::slice::from_ref(m)).await);
    }
    // Commit newest first, claiming and acknowledging between commits.
    let mut delivered: Vec<Uuid> = Vec::new();
    while let Some(tx) = open.pop() {
        tx.commit().await;
        let c = claim(&*storage, "w1", 100, LEASE).await;
        ack_all(&*storage, &c).await;
        delivered.extend(ids(&c));
    }
    let c = claim(&*storage, "w1", 100, LEASE).await;
    delivered.extend(ids(&c));
    let unique: HashSet<Uuid> = delivered.iter().copied().collect();
    assert_eq!(
        unique.len(),
        delivered.len(),
        "{check}: a message was claimed twice"
    );
    let expected: HashSet<Uuid> = sent.iter().map(|m| m.id).collect();
    assert_eq!(unique, expected, "{check}: messages were lost");
}

/// `stats` counts pending, in-flight and dead-lettered messages and the oldest pending one.
pub async fn storage_stats_count_the_queue(h: &dyn StorageHarness) {
    let check = "stats";
    let (f, storage) = fresh(h, false).await;
    let empty =
        assert_figures!(storage, pending: 0, in_flight: 0, dead_lettered: 0; "{check}: empty");
    assert_eq!(empty.oldest_pending, None, "{check}: empty");
    let sent: Vec<NewMessage> = (0..5).map(|i| msg(&format!("{i}"))).collect();
    f.enqueue(&sent).await;
    let stats = assert_figures!(storage, pending: 5, in_flight: 0; "{check}: five enqueued");
    assert_eq!(
        stats.oldest_pending.map(|t| t.timestamp_micros()),
        Some(sent[0].created_at.timestamp_micros()),
        "{check}: the oldest pending message"
    );
    let c = claim(&*storage, "w1", 2, LEASE).await;
    let dead = dead_letter(&c.messages[1], "bad");
    dead_lettered(&*storage, &c.token, &[dead]).await;
    let stats = assert_figures!(storage, pending: 3, in_flight: 1, dead_lettered: 1;
        "{check}: after claiming two and dead-lettering one");
    assert_eq!(
        stats.oldest_pending.map(|t| t.timestamp_micros()),
        Some(sent[2].created_at.timestamp_micros()),
        "{check}: the oldest pending message, in-flight ones not counted"
    );
    assert_eq!(stats.retrying, 0, "{check}: nothing failed yet: {stats:?}");
    retried(&*storage, &c.token, &[retry(&c.messages[0], LONG)]).await;
    assert_figures!(storage, pending: 4, in_flight: 0, retrying: 1;
        "{check}: a refused message waits to retry, counted as pending and retrying");
    // Counted and stored by the first call, read back by the second where figures are shared.
    for call in ["counts", "reads"] {
        let shared = storage
            .shared_stats(Duration::from_secs(3600))
            .await
            .expect("shared_stats");
        assert_eq!(
            (shared.pending, shared.retrying),
            (4, 1),
            "{check}: shared figures, the call that {call}: {shared:?}"
        );
    }
}

/// `shared_stats`: within the interval every relay reads the figures one of them counted;
/// after it, the next caller counts again. A storage that keeps the trait's default counts
/// on every call and says nothing of when.
pub async fn storage_shared_stats_count_once_per_interval(h: &dyn StorageHarness) {
    let check = "shared stats";
    // Long enough that the second read surely falls inside it on a loaded machine.
    const INTERVAL: Duration = Duration::from_secs(2);
    let (f, storage) = fresh(h, false).await;
    let other = f.replica().unwrap_or_else(|| storage.clone());
    f.enqueue(&[msg("a"), msg("b")]).await;
    let first = storage.shared_stats(INTERVAL).await.expect("shared_stats");
    assert_eq!(
        first.pending, 2,
        "{check}: the first call counts: {first:?}"
    );
    f.enqueue(&[msg("c")]).await;
    let read = other.shared_stats(INTERVAL).await.expect("shared_stats");
    let Some(measured_at) = first.measured_at else {
        assert_eq!(
            (read.pending, read.measured_at),
            (3, None),
            "{check}: a storage that does not share counts on every call"
        );
        return;
    };
    assert_eq!(
        (read.pending, read.measured_at),
        (2, Some(measured_at)),
        "{check}: within the interval, another relay reads the stored figures"
    );
    tokio::time::sleep(INTERVAL + Duration::from_millis(200)).await;
    let later = other.shared_stats(INTERVAL).await.expect("shared_stats");
    assert_eq!(
        later.pending, 3,
        "{check}: counted again after the interval"
    );
    assert!(
        later.measured_at > Some(measured_at),
        "{check}: a later count says when: {later:?} after {measured_at}"
    );
}

fn retry(m: &outbox_core::Message, delay: Duration) -> Retry {
    Retry {
        id: m.id,
        delay,
        error: "refused".into(),
    }
}

/// One relay, no crash: writer A's message commits late, behind a message of its key that
/// waits to retry; writer C's message, written after B's committed, must not overtake B's.
pub async fn storage_a_late_commit_does_not_let_later_messages_pass_a_retry(
    h: &dyn StorageHarness,
) {
    let check = "late commit behind a retry";
    if !h.traits().positions_at_write {
        super::note(
            check,
            "skipped: the harness's messages take their place at commit",
        );
        return;
    }
    let (f, storage) = fixture_or_skip!(h, true, check);
    let a = f.begin(&[keyed("k", "a")]).await;
    f.enqueue(&[keyed("k", "b")]).await;
    if storage.capabilities().waits_for_older_transactions {
        // b waits for A, which began writing first: a late commit cannot land behind a
        // message already claimed or waiting to retry. Check that instead.
        assert!(
            claim(&*storage, "w1", 10, LEASE).await.messages.is_empty(),
            "{check}: b must wait while A, which began writing before it, is open"
        );
        a.commit().await;
        assert_eq!(
            payloads(&claim(&*storage, "w1", 10, LEASE).await),
            ["a", "b"],
            "{check}: once A has committed, its message goes first"
        );
        return;
    }
    let first = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(payloads(&first), ["b"], "{check}: A has not committed yet");
    retried(&*storage, &first.token, &[retry(&first.messages[0], SHORT)]).await;
    f.enqueue(&[keyed("k", "c")]).await;
    a.commit().await;
    let second = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(
        payloads(&second),
        ["a"],
        "{check}: the claim must stop the key at b, which waits to retry; c began after b committed"
    );
    assert!(
        claim(&*storage, "w2", 10, LEASE).await.messages.is_empty(),
        "{check}: a second relay may take nothing of the key while a is in flight and b waits"
    );
    ack_all(&*storage, &second).await;
    let third = claim_after_wait(&*storage, "w2").await;
    assert_eq!(
        payloads(&third),
        ["b", "c"],
        "{check}: after b's delay the key goes on in order"
    );
}

/// A batch settled only in part (the relay died after writing a retry) or after its lease
/// ran out: the messages behind the retry stay behind it once the lease is over.
pub async fn storage_messages_behind_a_retry_wait_after_the_lease_runs_out(h: &dyn StorageHarness) {
    let check = "rows behind a retry after the lease";
    let (f, storage) = fixture_or_skip!(h, true, check);
    let sent: Vec<NewMessage> = (1..=4).map(|i| keyed("k", &format!("m{i}"))).collect();
    f.enqueue(&sent).await;
    // The relay delivered m1 and m2 was refused; only the retry was written before it died
    // (a relay that writes a batch's outcome in several steps, or a crash between them).
    let c = claim(&*storage, "w1", 10, SHORT).await;
    assert_eq!(payloads(&c), ["m1", "m2", "m3", "m4"], "{check}: the claim");
    assert_eq!(
        retried(&*storage, &c.token, &[retry(&c.messages[1], LONG)]).await,
        1
    );
    tokio::time::sleep(WAIT_OUT).await;
    assert_eq!(
        payloads(&claim(&*storage, "w2", 10, LEASE).await),
        ["m1"],
        "{check}: once w1's lease ran out m1 goes again, but m3 and m4 must wait behind m2"
    );
    // A batch that outlived its lease and settles late, with nobody having claimed since.
    f.enqueue(&[keyed("j", "j1"), keyed("j", "j2"), keyed("j", "j3")])
        .await;
    let late = claim(&*storage, "w3", 10, SHORT).await;
    assert_eq!(
        payloads(&late),
        ["j1", "j2", "j3"],
        "{check}: the late batch"
    );
    tokio::time::sleep(WAIT_OUT).await;
    let settlement = Settlement {
        delivered: deliveries(&late)[..1].to_vec(),
        retries: vec![retry(&late.messages[1], LONG)],
        released: vec![late.messages[2].id],
        ..Settlement::default()
    };
    assert_eq!(
        settled(&*storage, &late.token, &settlement).await,
        3,
        "{check}: a late settlement is accepted while nobody claimed the rows"
    );
    assert!(
        claim(&*storage, "w2", 10, LEASE).await.messages.is_empty(),
        "{check}: j3 was released but must wait behind j2"
    );
}

/// A late settlement (its lease ran out) whose rows nobody claimed since is still accepted,
/// else a stalled relay's deliveries would be sent again; one whose rows another claim took
/// since changes nothing, also where that claim gave them back.
pub async fn storage_a_late_settlement_counts_unless_the_rows_were_claimed_since(
    h: &dyn StorageHarness,
) {
    let check = "late settlement";
    let (f, storage) = fresh(h, true).await;
    f.enqueue(&[keyed("a", "a1"), keyed("b", "b1")]).await;
    let c = claim(&*storage, "w1", 10, SHORT).await;
    assert_eq!(c.messages.len(), 2, "{check}: the first claim");
    tokio::time::sleep(WAIT_OUT).await;
    // b1's lease ran out and another relay took it; a1's ran out and nobody came.
    let other = claim(&*storage, "w2", 10, LEASE).await;
    let mut taken = payloads(&other);
    taken.sort();
    assert_eq!(
        taken,
        ["a1", "b1"],
        "{check}: claimed again after the lease"
    );
    let a1 = other
        .messages
        .iter()
        .find(|m| m.payload == b"a1")
        .expect("a1 was claimed")
        .id;
    released(&*storage, &other.token, &[a1]).await;
    assert_eq!(
        acked(&*storage, &c.token, &deliveries(&c)).await,
        0,
        "{check}: every row was claimed since (a1 then released): the late ack changes nothing"
    );
    // Now a claim that nobody follows up: its late ack is accepted.
    let c = claim(&*storage, "w1", 10, SHORT).await;
    assert_eq!(payloads(&c), ["a1"], "{check}: the released a1");
    tokio::time::sleep(WAIT_OUT).await;
    assert_eq!(
        acked(&*storage, &c.token, &deliveries(&c)).await,
        1,
        "{check}: a late ack whose rows nobody claimed since is accepted"
    );
    // The relay's own figures: what it holds in flight (log mode keeps that in its memory).
    assert_figures!(storage, pending: 0, in_flight: 1; "{check}: only b1 left, held");
}

/// An operator replays a dead letter after releasing its key: it goes first in its key, and
/// the messages behind a later retry stay behind it.
pub async fn storage_a_replayed_head_does_not_let_later_messages_pass_a_retry(
    h: &dyn StorageHarness,
) {
    let check = "replay behind a retry";
    let (f, storage) = fixture_or_skip!(h, true, check);
    f.enqueue(&of_key("k", &["m1", "m2", "m3"])).await;
    let dead = dead_letter_and_release(&*f, "m1", check).await;
    let rest = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(payloads(&rest), ["m2", "m3"], "{check}: after the release");
    let settlement = Settlement {
        retries: vec![retry(&rest.messages[0], LONG)],
        released: vec![rest.messages[1].id],
        ..Settlement::default()
    };
    settled(&*storage, &rest.token, &settlement).await;
    assert_eq!(f.replay_dead_letters(&[dead]).await, 1, "{check}: replayed");
    let next = claim(&*storage, "w2", 10, LEASE).await;
    assert_eq!(
        payloads(&next),
        ["m1"],
        "{check}: the replayed m1 goes, m3 must wait behind m2"
    );
    assert_eq!(
        next.messages[0].attempts, 0,
        "{check}: a replay resets attempts"
    );
}

/// An operator releases a parked key, the key drains, a later message of it is written, and
/// only then is the old dead letter replayed: the replay goes ahead of that later message
/// (a storage that caches which keys are parked must not miss a replay that parks its key
/// again).
pub async fn storage_a_dead_letter_replayed_after_its_key_drained_goes_first(
    h: &dyn StorageHarness,
) {
    let check = "replay after the key drained";
    let (f, storage) = fixture_or_skip!(h, true, check);
    f.enqueue(&[keyed("k", "m1")]).await;
    let dead = dead_letter_and_release(&*f, "m1", check).await;
    f.enqueue(&[keyed("k", "m2")]).await;
    let rest = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(payloads(&rest), ["m2"], "{check}: after the release");
    ack_all(&*storage, &rest).await;
    assert_drained(&*storage, check).await;
    f.enqueue(&[keyed("k", "m3")]).await;
    assert_eq!(f.replay_dead_letters(&[dead]).await, 1, "{check}: replayed");
    let next = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(
        payloads(&next).first().map(String::as_str),
        Some("m1"),
        "{check}: the replayed m1 goes ahead of m3, written before the replay: {:?}",
        payloads(&next)
    );
}

/// A dead letter replayed after its key was released (and drained) is delivered, though
/// another dead letter of the key remains: the release let the key flow without its dead
/// letters, and the replay does not park it again.
pub async fn storage_a_replayed_dead_letter_of_a_released_key_is_delivered(h: &dyn StorageHarness) {
    let check = "replay of a released key's dead letter";
    let (f, storage) = fixture_or_skip!(h, true, check);
    let mut dead = Vec::new();
    for payload in ["k1", "k2"] {
        f.enqueue(&[keyed("k", payload)]).await;
        dead.push(dead_letter_and_release(&*f, payload, check).await);
        assert_drained(&*storage, check).await;
    }
    assert_eq!(
        f.replay_dead_letters(&dead[1..]).await,
        1,
        "{check}: replayed"
    );
    assert_eq!(
        drain(&*storage, "k", check).await,
        ["k2"],
        "{check}: the replayed k2 is delivered while k1 stays a dead letter"
    );
    only_it_flows(&*f, "k3", check, "and the key flows on").await;
}

/// A key with two dead letters (the second written after a release): replaying the first
/// keeps the key parked, new messages of it included, while the second remains; replaying
/// the second unparks it, and the whole key flows in its original order.
pub async fn storage_replaying_one_of_two_dead_letters_keeps_the_key_parked(
    h: &dyn StorageHarness,
) {
    let check = "replaying one of two dead letters";
    let (f, storage) = fixture_or_skip!(h, true, check);
    f.enqueue(&of_key("k", &["k1", "k2", "k3"])).await;
    let (first, count) = dead_letter_head(&*storage, "k1", check).await;
    assert_eq!(count, 1, "{check}: k1 dead-lettered");
    f.enqueue(&[keyed("k", "k4"), msg("free")]).await;
    assert_eq!(
        payloads(&claim(&*storage, "w1", 10, LEASE).await),
        ["free"],
        "{check}: a parked key gives nothing, a message enqueued after parking included"
    );
    assert!(f.release_parked_key("k").await, "{check}: k was parked");
    let (second, count) = dead_letter_head(&*storage, "k2", check).await;
    assert_eq!(count, 1, "{check}: k2 dead-lettered");
    let admin = f.admin();
    assert_eq!(
        f.replay_dead_letters(&[first]).await,
        1,
        "{check}: k1 replayed"
    );
    assert_eq!(
        payloads(&claim(&*storage, "w1", 10, LEASE).await),
        Vec::<String>::new(),
        "{check}: k2 is still a dead letter of k, so k stays parked after k1's replay"
    );
    assert_figures!(admin, parked_keys: 1; "{check}: k still parked");
    assert_eq!(
        f.replay_dead_letters(&[second]).await,
        1,
        "{check}: k2 replayed"
    );
    let c = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(
        payloads(&c),
        ["k1", "k2", "k3", "k4"],
        "{check}: once no dead letter of k remains, k flows in its original order"
    );
    // Log mode counts a replayed key parked (draining) until its held rows are settled and
    // a claim has seen that: the figure is read once the key has drained.
    ack_all(&*storage, &c).await;
    assert_eq!(
        drain(&*storage, "k", check).await,
        Vec::<String>::new(),
        "{check}: k's messages were handed out once"
    );
    assert_figures!(admin, parked_keys: 0; "{check}: k is unparked once drained");
}

/// `settle` writes deliveries, retries, dead letters and releases of one batch in one call,
/// each only under the claim's token.
pub async fn storage_settle_writes_the_whole_outcome(h: &dyn StorageHarness) {
    let check = "settle";
    let (f, storage) = fresh(h, false).await;
    f.enqueue(&[msg("a"), msg("b"), msg("c"), msg("d")]).await;
    let c = claim(&*storage, "w1", 10, LEASE).await;
    let m = &c.messages;
    let settlement = Settlement {
        delivered: deliveries(&c)[..1].to_vec(),
        retries: vec![retry(&m[1], LONG)],
        dead: vec![dead_letter(&m[2], "bad")],
        released: vec![m[3].id],
    };
    assert_eq!(
        settled(&*storage, &c.token, &settlement).await,
        4,
        "{check}: count"
    );
    assert_figures!(storage, pending: 2, in_flight: 0, dead_lettered: 1;
        "{check}: b waits to retry, c is dead, d is back");
    assert_eq!(
        payloads(&claim(&*storage, "w1", 10, LEASE).await),
        ["d"],
        "{check}: only the released message is due"
    );
    assert_eq!(
        settled(&*storage, &c.token, &settlement).await,
        0,
        "{check}: settling again changes nothing"
    );
}

/// `extend_lease` keeps a claim's messages from other relays past the first lease, and
/// renews nothing once the claim was taken over.
pub async fn storage_extend_lease_holds_the_claim(h: &dyn StorageHarness) {
    let check = "extend lease";
    let (f, storage) = fresh(h, true).await;
    f.enqueue(&[msg("a"), keyed("k", "b")]).await;
    let c = claim(&*storage, "w1", 10, SHORT).await;
    assert_eq!(
        extended(&*storage, &c.token, &ids(&c), LEASE).await,
        2,
        "{check}: both renewed"
    );
    tokio::time::sleep(WAIT_OUT).await;
    assert!(
        claim(&*storage, "w2", 10, LEASE).await.messages.is_empty(),
        "{check}: claimed again although the lease was renewed"
    );
    let short = extended(&*storage, &c.token, &ids(&c), SHORT).await;
    assert_eq!(short, 2, "{check}: renewed for a short lease");
    let taken = claim_after_wait(&*storage, "w2").await;
    assert_eq!(ids(&taken), ids(&c), "{check}: taken over after the lease");
    assert_eq!(
        extended(&*storage, &c.token, &ids(&c), LEASE).await,
        0,
        "{check}: a taken-over claim renews nothing"
    );
}

/// Settles a claim as a relay whose sink refused `j1` for now, dead-lettered `k1` and so
/// gave back `k2` behind it: `j1` waits to retry, key `k` is parked.
async fn retry_j1_dead_k1(f: &dyn StorageFixture, check: &str) -> Uuid {
    let storage = f.storage();
    f.enqueue(&[keyed("j", "j1"), keyed("k", "k1"), keyed("k", "k2")])
        .await;
    let c = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(payloads(&c), ["j1", "k1", "k2"], "{check}: the first claim");
    let m = &c.messages;
    let settlement = Settlement {
        retries: vec![retry(&m[0], LONG)],
        dead: vec![dead_letter(&m[1], "poison")],
        released: vec![m[2].id],
        ..Settlement::default()
    };
    assert_eq!(
        settled(&*storage, &c.token, &settlement).await,
        3,
        "{check}: settled"
    );
    m[1].id
}

/// Claims until nothing is handed out, acknowledging everything; returns the payloads of
/// key `key` in the order they were handed out.
async fn drain(storage: &dyn Storage, key: &str, check: &str) -> Vec<String> {
    let mut seen = Vec::new();
    for _ in 0..20 {
        let c = claim(storage, "w1", 10, LEASE).await;
        if c.messages.is_empty() {
            return seen;
        }
        seen.extend(
            c.messages
                .iter()
                .filter(|m| m.key.as_deref() == Some(key))
                .map(|m| String::from_utf8_lossy(&m.payload).into_owned()),
        );
        ack_all(storage, &c).await;
    }
    panic!("{check}: the storage never drained");
}

/// Writes `payload` as a message of key `k` and drains the storage (see [`drain`]): of key
/// `k`, only it is delivered (else fails saying `why` it should have been alone).
async fn only_it_flows(f: &dyn StorageFixture, payload: &str, check: &str, why: &str) {
    f.enqueue(&[keyed("k", payload)]).await;
    let after = drain(&*f.storage(), "k", check).await;
    assert_eq!(after, [payload], "{check}: {why}");
}

/// A released key's dead letter stays where it is across a restart (with the relay stopping
/// and with it dying), and a purged one is gone for good: neither is delivered after the
/// restart, nor the message that was delivered after the release, while another key still
/// waits to retry.
pub async fn storage_a_released_or_purged_dead_letter_stays_out_across_restarts(
    h: &dyn StorageHarness,
) {
    let check = "released and purged across restarts";
    let (f, storage) = fixture_or_skip!(h, true, check);
    let dead = retry_j1_dead_k1(&*f, check).await;
    assert!(f.release_parked_key("k").await, "{check}: k was parked");
    let c = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(payloads(&c), ["k2"], "{check}: k2 flows after the release");
    ack_all(&*storage, &c).await;
    if !f.restart(true).await {
        super::note(check, "skipped: the storage lives in one process");
        return;
    }
    let why =
        "after a restart only k3 of key k is delivered (k1 is a dead letter, k2 was delivered)";
    only_it_flows(&*f, "k3", check, why).await;
    assert_eq!(f.purge_dead_letters(&[dead]).await, 1, "{check}: purged");
    assert!(f.restart(false).await, "{check}: restarted once");
    f.advance(2 * LONG).await;
    let why = "after a purge and a relay that died, only k4 of key k is delivered";
    only_it_flows(&*f, "k4", check, why).await;
}

/// A dead letter replayed after a restart, while its key's later messages were kept back
/// (given back by the claim that failed it, and written after), goes first; the key's
/// messages are delivered once each, in order; the key is unparked; a further restart
/// delivers none of them again.
pub async fn storage_a_replay_after_a_restart_delivers_the_key_once_in_order(
    h: &dyn StorageHarness,
) {
    let check = "replay after a restart";
    let (f, storage) = fixture_or_skip!(h, true, check);
    let dead = retry_j1_dead_k1(&*f, check).await;
    f.enqueue(&[keyed("k", "k3")]).await;
    let c = claim(&*storage, "w1", 10, LEASE).await;
    assert_eq!(payloads(&c), Vec::<String>::new(), "{check}: k is parked");
    if !f.restart(true).await {
        super::note(check, "skipped: the storage lives in one process");
        return;
    }
    let c = claim(&*f.storage(), "w1", 10, LEASE).await;
    assert!(
        !payloads(&c).iter().any(|p| p.starts_with('k')),
        "{check}: k is still parked after the restart: {:?}",
        payloads(&c)
    );
    assert_eq!(f.replay_dead_letters(&[dead]).await, 1, "{check}: replayed");
    let storage = f.storage();
    assert_eq!(
        drain(&*storage, "k", check).await,
        ["k1", "k2", "k3"],
        "{check}: the replayed k1 first, then k2 and k3, once each"
    );
    assert_figures!(storage, parked_keys: 0, dead_lettered: 0;
        "{check}: k is unparked once drained");
    assert!(f.restart(true).await, "{check}: restarted once");
    f.advance(2 * LONG).await;
    let storage = f.storage();
    assert_eq!(
        drain(&*storage, "k", check).await,
        Vec::<String>::new(),
        "{check}: nothing of k is delivered again after another restart"
    );
    assert_figures!(storage, pending: 0, parked_keys: 0; "{check}: nothing left");
}
