//! Log mode of the PostgreSQL storage (`[storage] mode = "log"`) against the real PostgreSQL:
//! relays only read the outbox past a stored cursor `(xid, seq)`, below the oldest running
//! transaction. Each test has its own schema, so they run in parallel.
//!
//! Note: the readable horizon is cluster-wide, so a test that holds a transaction open
//! delays log-mode delivery in every other test for that long (never more: they wait for it).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::config::Settings;
use outbox_core::memory::MemorySink;
use outbox_core::{
    Claim, DeadLetter, Delivery, Error, NewMessage, Receipt, Settlement, Storage, StorageAdmin,
    WorkerConfig,
};
use outbox_postgres::{LogStart, PgStorage, PostgresConfig, StorageMode};
use outbox_test_support::through;
use outbox_tests::{
    LogOutbox, Proxy, Relay, assert_key_order, by_key, host_port, keyed, over_keys, poll,
    test_worker_config, text,
};

const LEASE: Duration = Duration::from_secs(30);

fn payloads(claim: &Claim) -> Vec<String> {
    claim.messages.iter().map(|m| text(&m.payload)).collect()
}

fn deliveries(claim: &Claim) -> Vec<Delivery> {
    outbox_tests::deliveries(&claim.messages, |_| "r".into())
}

async fn log_outbox(shards: u32) -> LogOutbox {
    LogOutbox::new(shards, |_| {}).await
}

/// Claims until a claim comes back with messages or `timeout` passes (the horizon moves
/// only once every older transaction in the cluster has ended, and other tests run).
async fn claim_some(storage: &PgStorage, timeout: Duration) -> Claim {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let claim = storage.claim("w", 100, LEASE).await.expect("claim");
        if !claim.messages.is_empty() || tokio::time::Instant::now() >= deadline {
            return claim;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The first test of issue 15: writer L takes its transaction id and its `seq` early and
/// commits after rows written later (by an older transaction) were delivered. A design that
/// reads `seq > cursor` skips L's row for good; log mode delivers it. A rolled-back row is
/// never delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_behind_the_cursor_is_delivered_a_rollback_never_is() {
    let outbox = log_outbox(1).await;
    // E takes a transaction id first, L second; L writes its row (seq 1) before E (seq 2).
    let mut early = outbox.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *early)
        .await
        .unwrap();
    let mut late = outbox.begin_with(&NewMessage::new("t", "late")).await;
    outbox
        .table
        .enqueue(&mut early, &NewMessage::new("t", "early"))
        .await
        .unwrap();
    early.commit().await.unwrap();
    let rolled_back = outbox
        .begin_with(&NewMessage::new("t", "rolled back"))
        .await;

    let first = claim_some(&outbox.storage, Duration::from_secs(10)).await;
    assert_eq!(
        payloads(&first),
        ["early"],
        "E's row is readable while L is open"
    );
    outbox.ack(&first).await;
    let seq_of = format!(
        "SELECT seq FROM {} WHERE convert_from(payload, 'UTF8') = $1",
        outbox.table.qualified("")
    );
    let late_seq: i64 = sqlx::query_scalar(&seq_of)
        .bind("late")
        .fetch_one(&mut *late)
        .await
        .unwrap();
    let early_seq: i64 = sqlx::query_scalar(&seq_of)
        .bind("early")
        .fetch_one(&outbox.pool)
        .await
        .unwrap();
    assert!(
        late_seq < early_seq,
        "L's row has the lower seq ({late_seq} < {early_seq}): a `seq > cursor` relay now skips it"
    );

    late.commit().await.unwrap();
    rolled_back.rollback().await.unwrap();
    let second = claim_some(&outbox.storage, Duration::from_secs(10)).await;
    assert_eq!(payloads(&second), ["late"], "the late commit is delivered");
    outbox.ack(&second).await;
    let third = claim_some(&outbox.storage, Duration::from_millis(500)).await;
    assert!(
        third.messages.is_empty(),
        "rolled back: {:?}",
        payloads(&third)
    );
    let stats = outbox.stats().await;
    assert_eq!((stats.pending, stats.in_flight), (0, 0), "{stats:?}");
}

/// A transaction held open delays delivery of everything written after it began, and loses
/// nothing: once it commits, its message and every later one are delivered, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_held_open_delays_delivery_and_loses_nothing() {
    let outbox = log_outbox(4).await;
    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay("w", sink.clone());
    outbox
        .enqueue(&[NewMessage::new("t", "before").key("k")])
        .await;
    let mut open = outbox
        .begin_with(&NewMessage::new("t", "held").key("k"))
        .await;
    for i in 0..5 {
        outbox
            .enqueue(&[NewMessage::new("t", format!("after-{i}")).key("k")])
            .await;
    }
    let hold = Duration::from_secs(3);
    let started = tokio::time::Instant::now();
    tokio::time::sleep(hold).await;
    let seen: Vec<String> = sink.published().iter().map(|m| text(&m.payload)).collect();
    assert_eq!(
        seen,
        ["before"],
        "nothing written after the open transaction began goes out"
    );
    // The delay is visible: five committed rows wait for the open transaction, named by its
    // backend and age.
    let lag = outbox.storage.horizon().await.unwrap().expect("log mode");
    assert_eq!(lag.waiting, 5, "{lag:?}");
    let blocker: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *open)
        .await
        .unwrap();
    assert_eq!(
        lag.held_by,
        Some(format!("backend pid {blocker}")),
        "{lag:?}"
    );
    assert!(lag.held_for.is_some_and(|age| age >= hold / 2), "{lag:?}");
    // The held row is not committed, so not counted; the five behind it wait, pending.
    assert_eq!(
        outbox.stats().await.pending,
        5,
        "the delayed messages count as pending"
    );
    open.commit().await.unwrap();
    outbox.wait_until_delivered(Duration::from_secs(20)).await;
    let lag = outbox.storage.horizon().await.unwrap().expect("log mode");
    // Other tests' transactions may be running in the same database: only ours must be gone.
    assert_eq!(lag.waiting, 0, "{lag:?}");
    assert_ne!(
        lag.held_by,
        Some(format!("backend pid {blocker}")),
        "{lag:?}"
    );
    relay.stop().await;
    assert!(started.elapsed() >= hold);
    assert_eq!(
        by_key(&sink.published())["k"],
        [
            "before", "held", "after-0", "after-1", "after-2", "after-3", "after-4"
        ],
        "everything delivered once, in xid order (the open transaction took its id first)"
    );
}

/// Per key, the payloads in the order of their first delivery, and how many deliveries
/// there were in all.
fn first_deliveries(sink: &MemorySink) -> (BTreeMap<String, Vec<String>>, usize) {
    let mut seen = std::collections::HashSet::new();
    let mut keys: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let published = sink.published();
    for m in &published {
        if seen.insert(m.id) {
            keys.entry(m.key.clone().unwrap_or_default())
                .or_default()
                .push(text(&m.payload));
        }
    }
    (keys, published.len())
}

/// The shards table: (shard, owner, epoch, cursor seq).
async fn shards(outbox: &LogOutbox) -> Vec<(i32, Option<String>, i64, i64)> {
    let shards = outbox.table.qualified("_shards");
    let sql = format!("SELECT shard, owner, epoch, cursor_seq FROM {shards} ORDER BY shard");
    outbox.rows(&sql).await
}

/// Four relays (each its own storage, as separate processes would be), 20,000 messages over
/// 200 keys: one relay starts alone and owns every shard, three join under load and get
/// shares; one is killed mid-run (its shards wait out the lease) and another started.
/// Nothing is lost, each key's first deliveries are in order, every shard has one owner in
/// the table at any time and no cursor or epoch ever moves back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_one_killed_one_started_lose_nothing_and_keep_key_order() {
    let outbox = log_outbox(16).await;
    let (keys, total) = (200, 20_000);
    for batch in over_keys(total, keys).chunks(2000) {
        outbox.enqueue(batch).await;
    }
    let sink = Arc::new(MemorySink::new());
    let config = |name: &str| WorkerConfig {
        batch_size: 250,
        lease: Duration::from_secs(2),
        ..test_worker_config(name)
    };
    // Cursors sampled while the relays run: never back, whoever owns the shard.
    let watcher = {
        let (pool, table) = (outbox.pool.clone(), outbox.table.qualified("_shards"));
        tokio::spawn(async move {
            let mut last: HashMap<i32, (i64, i64)> = HashMap::new();
            for _ in 0..400 {
                let rows: Vec<(i32, i64, i64)> =
                    sqlx::query_as(&format!("SELECT shard, epoch, cursor_seq FROM {table}"))
                        .fetch_all(&pool)
                        .await
                        .expect("sample the shards");
                for (shard, epoch, cursor) in rows {
                    if let Some(&(e, c)) = last.get(&shard) {
                        assert!(epoch >= e, "shard {shard}: epoch went back");
                        assert!(
                            cursor >= c,
                            "shard {shard}: cursor moved back {c} -> {cursor}"
                        );
                    }
                    last.insert(shard, (epoch, cursor));
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        })
    };
    // One relay takes every shard; three more join under load and get their share as it
    // hands shards over (it stops reading them and gives them up once settled).
    let first = outbox.another_relay();
    let mut relays: Vec<Relay> = vec![outbox.relay_on(first.clone(), config("w0"), sink.clone())];
    while sink.published().len() < total / 6 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        first.owned_shards().await.len(),
        16,
        "one relay alone owns every shard"
    );
    let late: Vec<Arc<PgStorage>> = (0..3).map(|_| outbox.another_relay()).collect();
    for (i, storage) in late.iter().enumerate() {
        relays.push(outbox.relay_on(
            storage.clone(),
            config(&format!("w{}", i + 1)),
            sink.clone(),
        ));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    for storage in &late {
        while storage.owned_shards().await.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a relay that joined got no shard"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let rebalanced_at = sink.published().len();
    // Mid-run: kill one without a shutdown, start another.
    while sink.published().len() < total / 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relays.remove(1).kill();
    let killed = late[0].relay_name().map(str::to_string);
    relays.push(outbox.relay_on(outbox.another_relay(), config("w4"), sink.clone()));
    outbox.wait_until_delivered(Duration::from_secs(90)).await;
    // The killed relay's shards go to the others once its lease has run out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while shards(&outbox).await.iter().any(|s| s.1 == killed) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the killed relay's shards were never taken over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for relay in relays {
        relay.stop().await;
    }
    watcher.await.expect("cursors never moved back");
    let (by_key, deliveries) = first_deliveries(&sink);
    let firsts: usize = by_key.values().map(Vec::len).sum();
    assert_eq!(firsts, total, "every message delivered");
    assert_key_order(&by_key, total, keys);
    // Redeliveries come only from the killed relay's unsettled batches.
    assert!(
        deliveries - total <= 16 * 1000,
        "{} redeliveries",
        deliveries - total
    );
    let owners: Vec<(i32, Option<String>, i64, i64)> = shards(&outbox).await;
    assert!(
        owners.iter().all(|(_, owner, _, _)| owner.is_none()),
        "stopped relays gave their shards up: {owners:?}"
    );
    eprintln!(
        "four relays: {deliveries} deliveries for {total} messages; shares taken by {rebalanced_at}"
    );
}

/// A settlement of deliveries moves its cursor without holding the relay's memory: a claim
/// made while that write waits (here behind a row lock on the shard) goes on, and takes the
/// next row of the delivered row's key too (it was published after that one was
/// acknowledged). The cursor moves only as each write commits. (The worker claims its next
/// batch while the last one settles.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_goes_on_while_a_settlements_cursor_write_waits() {
    // The claim under test must come before the relay's next round (250 ms): a round
    // renews the shard, so it waits for the lock too. A machine too slow for that tries again.
    for attempt in 1..=5 {
        if claim_during_a_waiting_cursor_write().await {
            return;
        }
        eprintln!("attempt {attempt}: the next round came first; trying again");
    }
    panic!("five attempts in a row took longer than a round interval");
}

/// One attempt of the test above; false when it was too slow to say anything.
async fn claim_during_a_waiting_cursor_write() -> bool {
    let outbox = log_outbox(1).await;
    outbox
        .enqueue(&[keyed("k", &["m1", "m2"]), keyed("j", &["n1"])].concat())
        .await;
    let relay = outbox.another_relay();
    // This claim runs the relay's round (taking the shard): the next is 250 ms away.
    let first = relay.claim("w", 1, LEASE).await.unwrap();
    let round_at = tokio::time::Instant::now();
    assert_eq!(payloads(&first), ["m1"]);
    let (blocker, settling) = ack_behind_a_shard_lock(&outbox, &relay, &first).await;
    // Wait until the cursor write is queued behind the lock.
    until_a_cursor_write_waits(&outbox, "pid").await;
    if round_at.elapsed() > Duration::from_millis(150) {
        blocker.rollback().await.unwrap();
        assert_eq!(settling.await.unwrap().unwrap(), 1);
        return false;
    }
    let during = tokio::time::timeout(Duration::from_secs(5), relay.claim("w", 10, LEASE))
        .await
        .expect("a claim must not wait for a settlement's cursor write")
        .unwrap();
    assert_eq!(
        payloads(&during),
        ["m2", "n1"],
        "m1 was delivered (its cursor write waits): its key goes on, and the other key"
    );
    assert!(!settling.is_finished(), "the cursor write still waits");
    blocker.rollback().await.unwrap();
    assert_eq!(
        settling.await.unwrap().unwrap(),
        1,
        "the settlement is written"
    );
    assert_eq!(
        shards(&outbox).await[0].3,
        1,
        "the cursor: just after m1 (seq 1)"
    );
    assert_eq!(
        relay
            .ack(&during.token, &deliveries(&during))
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        shards(&outbox).await[0].3,
        3,
        "the cursor: just after n1 (seq 3)"
    );
    true
}

/// Locks every shard row in a transaction of its own (returned), then acknowledges `claim`
/// on `relay` in the background: the settlement's cursor write waits behind the lock.
async fn ack_behind_a_shard_lock(
    outbox: &LogOutbox,
    relay: &Arc<PgStorage>,
    claim: &Claim,
) -> (
    sqlx::Transaction<'static, sqlx::Postgres>,
    tokio::task::JoinHandle<outbox_core::Result<u64>>,
) {
    let shards_table = outbox.table.qualified("_shards");
    let mut blocker = outbox.pool.begin().await.unwrap();
    sqlx::query(&format!("SELECT shard FROM {shards_table} FOR UPDATE"))
        .execute(&mut *blocker)
        .await
        .unwrap();
    let settling = tokio::spawn({
        let relay = relay.clone();
        let delivered = deliveries(claim);
        let token = claim.token;
        async move { relay.ack(&token, &delivered).await }
    });
    (blocker, settling)
}

/// Polls until a cursor write of `outbox` waits on a lock, selecting `what` of the waiting
/// backends (`pid`, or `pg_terminate_backend(pid)` to kill them as they are found).
async fn until_a_cursor_write_waits(outbox: &LogOutbox, what: &str) {
    let waiting = format!(
        "SELECT count(*) FROM (SELECT {what} FROM pg_stat_activity
         WHERE wait_event_type = 'Lock' AND datname = current_database()
           AND query LIKE '%cursor_xid%' AND query LIKE $1) x"
    );
    poll(
        Duration::from_secs(10),
        Duration::from_millis(5),
        || async {
            let found: i64 = sqlx::query_scalar(&waiting)
                .bind(format!("%{}%", outbox.table.schema()))
                .fetch_one(&outbox.pool)
                .await
                .unwrap();
            match found > 0 {
                true => Ok(()),
                false => Err("the settlement's cursor write never waited on the lock".to_string()),
            }
        },
    )
    .await
}

/// A settlement's cursor write that fails (its connection killed while it waits for a row
/// lock) loses nothing and hands out nothing twice: the delivered row stays delivered, the
/// stored cursor stays behind it, the key's next row goes out, and that row's cursor write
/// passes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_cursor_write_is_passed_by_the_next_one() {
    let outbox = log_outbox(1).await;
    outbox.enqueue(&keyed("k", &["m1", "m2"])).await;
    let relay = outbox.another_relay();
    let first = relay.claim("w", 1, LEASE).await.unwrap();
    assert_eq!(payloads(&first), ["m1"]);
    let (blocker, settling) = ack_behind_a_shard_lock(&outbox, &relay, &first).await;
    until_a_cursor_write_waits(&outbox, "pg_terminate_backend(pid)").await;
    let failed = settling.await.unwrap();
    assert!(failed.is_err(), "the cursor write failed: {failed:?}");
    blocker.rollback().await.unwrap();
    assert_eq!(
        shards(&outbox).await[0].3,
        0,
        "the stored cursor did not move"
    );
    let next = relay.claim("w", 10, LEASE).await.unwrap();
    assert_eq!(
        payloads(&next),
        ["m2"],
        "m1 was delivered: it is not handed out again, and its key goes on"
    );
    assert_eq!(relay.ack(&next.token, &deliveries(&next)).await.unwrap(), 1);
    assert_eq!(
        shards(&outbox).await[0].3,
        2,
        "the next cursor write passes m1 and m2"
    );
    let after = relay.claim("w", 10, LEASE).await.unwrap();
    assert!(
        after.messages.is_empty(),
        "nothing left: {:?}",
        payloads(&after)
    );
}

/// A relay stalls past its shard's lease; another takes the shard (a new epoch) and moves
/// on. Every write of the stale owner is refused: its acknowledgement changes nothing and
/// the cursor does not move back; it stops holding the shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owners_cursor_writes_are_refused() {
    let outbox = log_outbox(1).await;
    outbox
        .enqueue(
            &(0..6)
                .map(|i| NewMessage::new("t", format!("m{i}")).key("k"))
                .collect::<Vec<_>>(),
        )
        .await;
    let stale = outbox.another_relay();
    let first = claim_some(&stale, Duration::from_secs(10)).await;
    assert_eq!(first.messages.len(), 6);
    assert_eq!(stale.owned_shards().await.len(), 1);
    // The stale relay's lease (30 s in claim_some) is shortened as a stall would let it run out.
    outbox
        .execute(&format!(
            "UPDATE {} SET expires_at = now() - interval '1 second'",
            outbox.table.qualified("_shards")
        ))
        .await;
    let fresh = outbox.another_relay();
    let taken = fresh.claim("w2", 3, LEASE).await.unwrap();
    assert_eq!(
        payloads(&taken),
        ["m0", "m1", "m2"],
        "the new owner reads from the stored cursor"
    );
    assert_eq!(
        fresh.ack(&taken.token, &deliveries(&taken)).await.unwrap(),
        3
    );
    let before = shards(&outbox).await;
    assert_eq!(
        before[0].1.as_deref(),
        fresh.relay_name(),
        "one owner: the new relay"
    );
    assert_eq!(before[0].3, 3, "the cursor: just before m3 (seq 4)");

    // The stale owner acknowledges everything it had: refused, the cursor stays.
    let refused = stale.ack(&first.token, &deliveries(&first)).await.unwrap();
    assert_eq!(refused, 0, "the stale owner's cursor write must be refused");
    let after = shards(&outbox).await;
    assert_eq!(after, before, "nothing changed in the shards table");
    assert!(
        stale.owned_shards().await.is_empty(),
        "the stale relay let the shard go"
    );
    assert_eq!(
        stale
            .extend_lease(&first.token, &[first.messages[5].id], LEASE)
            .await
            .unwrap(),
        0,
        "nor can it renew"
    );
    // The new owner goes on from where it was.
    let rest = fresh.claim("w2", 100, LEASE).await.unwrap();
    assert_eq!(payloads(&rest), ["m3", "m4", "m5"]);
}

/// A claim renews no shard (one commit less per batch): the round, four times a second, holds
/// the shards for the lease plus that interval. So the shards of every claim stay this
/// relay's until its lease has run out, however long after the last round it was made; a
/// round that held them for the lease alone would let a claim made 0.2 s later outlive them,
/// and another relay could take the shard and deliver the key while this one still publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_claims_shards_stay_held_until_its_lease_has_run_out() {
    let outbox = log_outbox(4).await;
    let relay = outbox.another_relay();
    let lease = Duration::from_secs(5);
    let held_until = format!(
        "SELECT min(expires_at) FROM {} WHERE owner = $1",
        outbox.table.qualified("_shards")
    );
    let mut handed_out = 0;
    // Claims every 70 ms for about a second: some just after a round, some just before the
    // next.
    for i in 0..15 {
        outbox
            .enqueue(&[NewMessage::new("t", format!("m{i}")).key(format!("k{i}"))])
            .await;
        let asked: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&outbox.pool)
            .await
            .expect("the database clock");
        let claim = relay.claim("w", 100, lease).await.expect("claim");
        handed_out += claim.messages.len();
        let until: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(&held_until)
            .bind(relay.relay_name())
            .fetch_one(&outbox.pool)
            .await
            .expect("the shards' lease");
        assert!(
            until >= asked + lease,
            "claim {i}: its lease runs to at least {}, its shards only to {until}",
            asked + lease
        );
        tokio::time::sleep(Duration::from_millis(70)).await;
    }
    assert!(handed_out > 0, "no claim handed anything out");
}

/// A permanent failure is dead-lettered at once; releasing the key lets the rest flow, in
/// order, without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_parked_key_lets_its_kept_messages_flow_in_order() {
    let outbox = log_outbox(2).await;
    outbox.enqueue(&keyed("k", &["bad", "k-1", "k-2"])).await;
    // Nothing read yet: the key's three rows are past its shard's cursor.
    assert_eq!(
        outbox.storage.log_waiting_behind("k").await.unwrap(),
        Some(3)
    );
    let sink = Arc::new(MemorySink::new());
    sink.fail_when(|m| (m.payload == b"bad").then(|| Error::permanent("too large")));
    let relay = outbox.relay("w", sink.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while outbox.stats().await.parked_keys == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never parked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Behind the parked key: its two later rows (held aside, or still past the cursor).
    assert_eq!(
        outbox.storage.log_waiting_behind("k").await.unwrap(),
        Some(2)
    );
    assert_eq!(
        outbox.storage.log_waiting_behind("other").await.unwrap(),
        Some(0)
    );
    assert!(outbox.storage.release_parked_key("k").await.unwrap());
    outbox.wait_until_delivered(Duration::from_secs(10)).await;
    outbox.wait_until_unparked(Duration::from_secs(10)).await;
    assert_eq!(
        outbox.storage.log_waiting_behind("k").await.unwrap(),
        Some(0)
    );
    relay.stop().await;
    assert_eq!(by_key(&sink.published())["k"], ["k-1", "k-2"]);
    assert_eq!(outbox.dead_letters().await.len(), 1);
}

/// A sink outage charges no attempt and moves no cursor; everything goes out afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_outage_charges_nothing_and_moves_no_cursor() {
    let outbox = log_outbox(4).await;
    outbox.enqueue(&over_keys(50, 5)).await;
    let sink = Arc::new(MemorySink::new());
    sink.set_up(false);
    let relay = outbox.relay("w", sink.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        shards(&outbox).await.iter().all(|s| s.3 == 0),
        "no cursor moved"
    );
    assert_eq!(outbox.undelivered().await, 50);
    sink.set_up(true);
    outbox.wait_until_delivered(Duration::from_secs(10)).await;
    relay.stop().await;
    assert_eq!(sink.published().len(), 50);
    assert!(
        sink.published().iter().all(|m| m.attempts == 0),
        "no attempt charged"
    );
    assert!(outbox.dead_letters().await.is_empty());
}

/// A relay that stops gives its shards up; the next one resumes from the stored cursors,
/// delivering nothing twice. Delivered rows are removed in bulk by housekeeping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_cursor_and_housekeeping_removes_delivered_rows() {
    let outbox = log_outbox(4).await;
    let first: Vec<NewMessage> = (0..300)
        .map(|i| NewMessage::new("t", format!("{i:03}")).key(format!("k{}", i % 7)))
        .collect();
    outbox.enqueue(&first).await;
    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay("w1", sink.clone());
    outbox.wait_until_delivered(Duration::from_secs(10)).await;
    relay.stop().await;
    assert!(
        shards(&outbox).await.iter().all(|s| s.1.is_none()),
        "shards given up on stop"
    );

    let second: Vec<NewMessage> = (300..400)
        .map(|i| NewMessage::new("t", format!("{i:03}")).key(format!("k{}", i % 7)))
        .collect();
    outbox.enqueue(&second).await;
    let next = outbox.another_relay();
    let relay = outbox.relay_on(next.clone(), test_worker_config("w2"), sink.clone());
    outbox.wait_until_delivered(Duration::from_secs(10)).await;
    // Housekeeping: the rows behind every cursor go in one ranged delete per call.
    next.maintain().await.unwrap();
    relay.stop().await;
    let (by_key, deliveries) = first_deliveries(&sink);
    assert_eq!(
        deliveries, 400,
        "nothing delivered twice across the restart"
    );
    for payloads in by_key.values() {
        let mut sorted = payloads.clone();
        sorted.sort();
        assert_eq!(payloads, &sorted, "key order across the restart");
    }
    let rows = outbox.log_rows().await;
    assert_eq!(rows, 0, "delivered rows removed");
}

/// With `retention`, housekeeping keeps delivered rows until they are that old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_delivered_rows_for_that_long() {
    let outbox = LogOutbox::new(2, |c| c.retention = Some(Duration::from_secs(3600))).await;
    outbox
        .enqueue(&[NewMessage::new("t", "a"), NewMessage::new("t", "b")])
        .await;
    let claim = claim_some(&outbox.storage, Duration::from_secs(10)).await;
    outbox.ack(&claim).await;
    outbox.storage.maintain().await.unwrap();
    let rows = outbox.log_rows().await;
    assert_eq!(rows, 2, "kept for the retention");
    // Age the rows. The log is append-only: its xid check refuses every UPDATE of a row
    // (the row keeps its writer's id), so lift it for this one.
    let outbox_table = outbox.table.qualified("");
    let check = format!("{}_xid_is_the_writers", outbox.table.table());
    sqlx::raw_sql(&format!(
        "BEGIN;
         ALTER TABLE {outbox_table} DROP CONSTRAINT {check};
         UPDATE {outbox_table} SET created_at = created_at - interval '2 hours';
         ALTER TABLE {outbox_table} ADD CONSTRAINT {check}
             CHECK (xid = pg_current_xact_id()) NOT VALID;
         COMMIT;"
    ))
    .execute(&outbox.pool)
    .await
    .unwrap();
    outbox.storage.maintain().await.unwrap();
    let rows = outbox.log_rows().await;
    assert_eq!(rows, 0, "removed once older than the retention");
}

/// A table runs in one mode: a relay configured for the other refuses it, naming `mode`;
/// writers' plain INSERT works on a log-mode table as on a lease-mode one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_migrated_for_one_mode_is_refused_by_the_other_and_a_plain_insert_works() {
    let outbox = log_outbox(2).await;
    let mut lease = outbox.storage.config().clone();
    lease.mode = StorageMode::Lease;
    let lease = PgStorage::new(lease).unwrap();
    let err = lease.migrate().await.unwrap_err();
    assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
    assert!(
        err.to_string().contains("mode") && err.to_string().contains("`log` mode"),
        "{err}"
    );
    let err = lease.claim("w", 10, LEASE).await.unwrap_err();
    assert_eq!(err.kind(), outbox_core::ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("mode"), "{err}");

    // The other way round, on a lease-mode table of the same database.
    let mut config = outbox.storage.config().clone();
    config.mode = StorageMode::Lease;
    config.table = "lease_outbox".into();
    PgStorage::new(config.clone())
        .unwrap()
        .migrate()
        .await
        .unwrap();
    config.mode = StorageMode::Log;
    let log = PgStorage::new(config).unwrap();
    let err = log.migrate().await.unwrap_err();
    assert!(err.to_string().contains("`lease` mode"), "{err}");
    let err = log.claim("w", 10, LEASE).await.unwrap_err();
    assert_eq!(err.kind(), outbox_core::ErrorKind::Config, "{err}");

    // The writers' contract of docs/storage/postgres.md, unchanged.
    outbox.execute(&format!(
        "INSERT INTO {} (topic, partition_key, payload, headers) VALUES ('orders', 'o-1', '\\x7b7d', '{{\"a\": \"b\"}}')",
        outbox.table.qualified("")
    )).await;
    let claim = claim_some(&outbox.storage, Duration::from_secs(10)).await;
    assert_eq!(claim.messages.len(), 1);
    assert_eq!(claim.messages[0].payload, b"{}");
    assert_eq!(claim.messages[0].key.as_deref(), Some("o-1"));
    // Migrating again changes nothing.
    outbox.storage.migrate().await.unwrap();
}

/// The operator's side (`outbox enqueue`, `status`, `dead-letters …`) works on a log table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_work_on_a_log_table() {
    let outbox = log_outbox(2).await;
    let sent = [
        NewMessage::new("orders", "bad").key("k"),
        NewMessage::new("orders", "k-2").key("k"),
        NewMessage::new("audit", "a-1"),
    ];
    StorageAdmin::enqueue(&*outbox.storage, &sent)
        .await
        .unwrap();
    let topics = outbox.storage.topic_stats().await.unwrap();
    let figures: Vec<(String, u64)> = topics
        .iter()
        .map(|t| (t.topic.clone(), t.pending))
        .collect();
    assert_eq!(
        figures,
        [("audit".to_string(), 1), ("orders".to_string(), 2)]
    );
    let claim = claim_some(&outbox.storage, Duration::from_secs(10)).await;
    assert_eq!(claim.messages.len(), 3);
    let bad = claim
        .messages
        .iter()
        .find(|m| m.payload == b"bad")
        .unwrap()
        .id;
    let settlement = Settlement {
        dead: vec![DeadLetter {
            id: bad,
            error: "refused".into(),
        }],
        delivered: claim
            .messages
            .iter()
            .filter(|m| m.payload == b"a-1")
            .map(|m| Delivery {
                id: m.id,
                receipt: Receipt::new("r"),
            })
            .collect(),
        released: claim
            .messages
            .iter()
            .filter(|m| m.payload == b"k-2")
            .map(|m| m.id)
            .collect(),
        ..Settlement::default()
    };
    assert_eq!(
        outbox
            .storage
            .settle(&claim.token, &settlement)
            .await
            .unwrap(),
        3
    );
    let parked = outbox.storage.parked_keys().await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!((parked[0].key.as_str(), parked[0].dead_letter), ("k", bad));
    let dead = outbox
        .storage
        .dead_letters(&Default::default(), 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].message.id, dead[0].last_error.as_str()),
        (bad, "refused")
    );
    assert_eq!(dead[0].message.attempts, 1);
    let topics = outbox.storage.topic_stats().await.unwrap();
    let figures: Vec<(String, u64, u64)> = topics
        .iter()
        .map(|t| (t.topic.clone(), t.pending, t.dead_lettered))
        .collect();
    assert_eq!(
        figures,
        [("orders".to_string(), 1, 1)],
        "k-2 kept aside, the dead letter"
    );
    assert_eq!(outbox.storage.purge_dead_letters(&[bad]).await.unwrap(), 1);
    assert!(outbox.storage.release_parked_key("k").await.unwrap());
    let rest = claim_some(&outbox.storage, Duration::from_secs(10)).await;
    assert_eq!(payloads(&rest), ["k-2"], "released: the kept message flows");
    assert!(outbox.storage.describe().ends_with("(log mode)"));
}

/// Bad log-mode settings are refused with the key named.
#[test]
fn bad_mode_settings_are_refused_with_the_key_named() {
    let url = "postgres://u@127.0.0.1/db";
    let err =
        PostgresConfig::from_value(serde_json::json!({"url": url, "mode": "append"})).unwrap_err();
    assert!(err.to_string().contains("mode"), "{err}");
    let err =
        PostgresConfig::from_value(serde_json::json!({"url": url, "mode": "log", "shards": 0}))
            .unwrap_err();
    assert!(err.to_string().contains("shards"), "{err}");
    let ok =
        PostgresConfig::from_value(serde_json::json!({"url": url, "mode": "log", "shards": 8}))
            .unwrap();
    assert_eq!((ok.mode, ok.shards), (StorageMode::Log, 8));
    let default = PostgresConfig::from_value(serde_json::json!({"url": url})).unwrap();
    assert_eq!(
        default.mode,
        StorageMode::Lease,
        "lease mode stays the default"
    );
}

/// The storage conformance suite in log mode: each fixture is a fresh schema migrated for
/// log mode (4 shards), dropped with it.
mod conformance {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use async_trait::async_trait;
    use outbox_core::{NewMessage, Storage, StorageAdmin};
    use outbox_postgres::PgStorage;
    use outbox_testkit::{HarnessTraits, PendingWrite, StorageFixture, StorageHarness};
    use outbox_tests::{PgWrite, on_a_blocking_thread};

    use super::LogOutbox;

    /// `buffer_min`: a smaller read buffer per shard, so that the model's few rows fill it.
    pub struct LogHarness {
        pub buffer_min: Option<usize>,
    }

    /// The outbox, the relay's storage on it (a new one after each restart), the read
    /// buffer its relays use.
    struct LogFixture(LogOutbox, Mutex<Arc<PgStorage>>, Option<usize>);

    impl LogFixture {
        fn relay(&self) -> Arc<PgStorage> {
            self.1.lock().expect("the relay's storage").clone()
        }

        fn new_relay(&self) -> Arc<PgStorage> {
            let relay = self.0.another_relay();
            if let Some(rows) = self.2 {
                relay.set_log_buffer_min(rows);
            }
            relay
        }
    }

    #[async_trait]
    impl StorageFixture for LogFixture {
        fn storage(&self) -> Arc<dyn Storage> {
            self.relay()
        }

        fn admin(&self) -> Arc<dyn StorageAdmin> {
            self.0.storage.clone()
        }

        fn replica(&self) -> Option<Arc<dyn Storage>> {
            Some(self.new_relay())
        }

        async fn restart(&self, stop: bool) -> bool {
            if stop {
                self.relay().stop().await.expect("stop");
            }
            *self.1.lock().expect("the relay's storage") = self.new_relay();
            true
        }

        async fn begin(&self, messages: &[NewMessage]) -> Box<dyn PendingWrite> {
            PgWrite::begin(&self.0, messages).await
        }

        async fn advance(&self, by: Duration) {
            // Leases and retry delays of what the relay has read run on its clock; shard
            // ownership on the database's: move both.
            self.relay().advance_clock(by);
            for table in ["_shards", "_relays"] {
                self.0.move_times_back(table, "expires_at", by).await;
            }
        }
    }

    #[async_trait]
    impl StorageHarness for LogHarness {
        fn traits(&self) -> HarnessTraits {
            HarnessTraits::default().replays_unpark_when_drained()
        }

        async fn fresh(&self, per_key_order: bool) -> Box<dyn StorageFixture> {
            let outbox = on_a_blocking_thread(move || {
                LogOutbox::new(4, move |c| c.per_key_order = per_key_order)
            })
            .await;
            if let Some(rows) = self.buffer_min {
                outbox.storage.set_log_buffer_min(rows);
            }
            let relay = Mutex::new(outbox.storage.clone());
            Box::new(LogFixture(outbox, relay, self.buffer_min))
        }
    }

    outbox_testkit::storage_conformance_tests!(LogHarness { buffer_min: None });

    /// The randomised model with read buffers of 8 rows per shard (and 4 claims' limits):
    /// its few rows fill them, so keys stopped behind a retry have their later rows let go
    /// and read again.
    mod small_buffers {
        outbox_testkit::storage_conformance_tests!(super::LogHarness { buffer_min: Some(8) };
            storage_random_operations_keep_key_order,
        );
    }
}

/// `start = "now"`: the first relay to take a new table's shards skips the rows of
/// transactions that ended before it, and delivers those of a transaction still running
/// then (committed later) and everything after. A later relay resumes from the cursors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starting_from_now_skips_what_ended_before_and_keeps_what_was_running() {
    let outbox = LogOutbox::new(2, |c| c.start = LogStart::Now).await;
    outbox
        .enqueue(&[
            NewMessage::new("t", "old-1").key("k"),
            NewMessage::new("t", "old-2").key("j"),
        ])
        .await;
    let running = outbox
        .begin_with(&NewMessage::new("t", "running").key("k"))
        .await;
    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay("w", sink.clone());
    // Both shards taken (their cursors set) before anything else commits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while shards(&outbox).await.iter().any(|s| s.2 == 0) {
        assert!(tokio::time::Instant::now() < deadline, "shards not taken");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    outbox
        .enqueue(&[NewMessage::new("t", "new-1").key("k")])
        .await;
    running.commit().await.unwrap();
    outbox.wait_until_delivered(Duration::from_secs(20)).await;
    relay.stop().await;
    assert_eq!(
        by_key(&sink.published()),
        BTreeMap::from([("k".to_string(), vec!["running".to_string(), "new-1".into()])]),
        "rows that ended before the start are skipped; the running one is not"
    );

    // The shards have been owned: a new relay with `start = "now"` resumes from the cursors.
    outbox
        .enqueue(&[NewMessage::new("t", "later").key("j")])
        .await;
    let relay = outbox.relay_on(
        outbox.another_relay(),
        test_worker_config("w2"),
        sink.clone(),
    );
    outbox.wait_until_delivered(Duration::from_secs(20)).await;
    relay.stop().await;
    assert_eq!(by_key(&sink.published())["j"], ["later"]);
    assert_eq!(sink.published().len(), 3);
}

/// A relay that starts while the database cannot be reached retries in place, without
/// exiting, and delivers once it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_the_database_is_unreachable_waits_then_delivers() {
    let outbox = log_outbox(2).await;
    let proxy = Proxy::start(&host_port(&outbox.url)).await;
    proxy.cut();
    let config = PostgresConfig {
        url: through(&outbox.url, &proxy.addr()),
        connect_timeout: Duration::from_secs(1),
        ..outbox.storage.config().clone()
    };
    let storage = Arc::new(PgStorage::new(config).expect("valid configuration"));
    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay_on(storage, test_worker_config("w"), sink.clone());
    outbox.enqueue(&keyed("k", &["a", "b"])).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(sink.published().is_empty());
    assert!(
        !relay.is_finished(),
        "the relay stopped while the database was unreachable"
    );
    proxy.restore();
    outbox.wait_until_delivered(Duration::from_secs(30)).await;
    relay.stop().await;
    assert_eq!(by_key(&sink.published())["k"], ["a", "b"]);
}

/// The count behind a key looks in the key's own shard (the generated column's hash).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_behind_counts_a_keys_rows_in_its_shard() {
    let outbox = log_outbox(16).await;
    let keys: Vec<String> = (0..8).map(|i| format!("key-{i}")).collect();
    let messages: Vec<NewMessage> = keys
        .iter()
        .flat_map(|k| (0..3).map(move |i| NewMessage::new("t", format!("{k}-{i}")).key(k)))
        .collect();
    outbox.enqueue(&messages).await;
    for key in &keys {
        assert_eq!(
            outbox.storage.log_waiting_behind(key).await.unwrap(),
            Some(3),
            "{key}"
        );
    }
    assert_eq!(
        outbox.storage.log_waiting_behind("none").await.unwrap(),
        Some(0)
    );
}

/// The shard (of `shards`) whose rows a partition key goes to: the generated column's hash.
async fn shard_of(outbox: &LogOutbox, key: &str, shards: i32) -> i32 {
    sqlx::query_scalar("SELECT ((hashtext($1) % $2) + $2) % $2")
        .bind(key)
        .bind(shards)
        .fetch_one(&outbox.pool)
        .await
        .expect("the shard of a key")
}

/// A key of `shards` that lands in `shard`.
async fn key_in(outbox: &LogOutbox, shard: i32, shards: i32, prefix: &str) -> String {
    for i in 0.. {
        let key = format!("{prefix}{i}");
        if shard_of(outbox, &key, shards).await == shard {
            return key;
        }
    }
    unreachable!()
}

/// The log's `xid` column can only be the writing transaction's id: an INSERT that writes an
/// old one (which the cursor would pass, and the cleanup delete) or a future one (which would
/// wait while later rows of its key pass it) is refused with an error naming the check, and
/// the other rows go out in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_written_by_the_application_is_refused() {
    let outbox = log_outbox(4).await;
    let insert = format!(
        "INSERT INTO {} (xid, topic, partition_key, payload) VALUES ($1::text::xid8, 't', 'k', 'x')",
        outbox.table.qualified("")
    );
    outbox.enqueue(&[NewMessage::new("t", "a1").key("k")]).await;
    for xid in ["5", "4294967296000"] {
        let refused = sqlx::query(&insert)
            .bind(xid)
            .execute(&outbox.pool)
            .await
            .expect_err("an INSERT that writes xid must be refused");
        assert!(
            refused.to_string().contains("xid_is_the_writers"),
            "the error names the check: {refused}"
        );
    }
    outbox.enqueue(&[NewMessage::new("t", "a2").key("k")]).await;
    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay("w", sink.clone());
    outbox.wait_until_delivered(Duration::from_secs(20)).await;
    relay.stop().await;
    assert_eq!(by_key(&sink.published())["k"], ["a1", "a2"]);
    assert_eq!(outbox.log_rows().await, 2, "no row with a foreign xid");
}

/// A log table moved to a cluster whose transaction ids are behind the stored ones (here:
/// cursors and a pending row moved ahead, as `pg_dump` into a younger cluster leaves them)
/// is refused with a schema error naming `outbox migrate`; `migrate` rebases it, and then
/// the pending row and every new one are delivered, in order, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_table_from_a_cluster_further_ahead_is_refused_until_migrate_rebases_it() {
    let outbox = log_outbox(2).await;
    outbox
        .enqueue(&[NewMessage::new("t", "delivered").key("k")])
        .await;
    let c = claim_some(&outbox.storage, Duration::from_secs(20)).await;
    assert_eq!(payloads(&c), ["delivered"]);
    outbox.ack(&c).await;
    outbox.storage.stop().await.unwrap();
    outbox
        .enqueue(&[NewMessage::new("t", "pending").key("k")])
        .await;
    // What a restore into a younger cluster leaves: ids a million ahead of its counter,
    // the cursor at the delivered row, the pending row after it.
    let ahead: String = sqlx::query_scalar(
        "SELECT (pg_snapshot_xmax(pg_current_snapshot())::text::numeric + 1000000)::text",
    )
    .fetch_one(&outbox.pool)
    .await
    .unwrap();
    // As `pg_dump` restores it: the rows with their ids, then the check, `NOT VALID`.
    let outbox_table = outbox.table.qualified("");
    let check = format!("{}_xid_is_the_writers", outbox.table.table());
    sqlx::raw_sql(&format!(
        "BEGIN;
         UPDATE {shards} SET cursor_xid = '{ahead}' WHERE cursor_xid > '0';
         ALTER TABLE {outbox_table} DROP CONSTRAINT {check};
         UPDATE {outbox_table} SET xid = '{ahead}';
         ALTER TABLE {outbox_table} ADD CONSTRAINT {check}
             CHECK (xid = pg_current_xact_id()) NOT VALID;
         COMMIT;",
        shards = outbox.table.qualified("_shards"),
    ))
    .execute(&outbox.pool)
    .await
    .unwrap();
    let relay = outbox.another_relay();
    let refused = relay
        .claim("w", 100, LEASE)
        .await
        .expect_err("a moved log must be refused");
    assert_eq!(refused.kind(), outbox_core::ErrorKind::Schema, "{refused}");
    assert!(
        refused.to_string().contains("outbox migrate"),
        "the error says what to do: {refused}"
    );
    relay.migrate().await.expect("migrate rebases the log");
    outbox
        .enqueue(&[NewMessage::new("t", "new").key("k")])
        .await;
    let relay = outbox.another_relay();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while got.len() < 2 && tokio::time::Instant::now() < deadline {
        let c = claim_some(&relay, Duration::from_secs(5)).await;
        got.extend(payloads(&c));
        relay.ack(&c.token, &deliveries(&c)).await.unwrap();
    }
    assert_eq!(got, ["pending", "new"], "nothing lost, in order");
    relay.maintain().await.unwrap();
    let rows = outbox.log_rows().await;
    assert_eq!(rows, 0, "delivered rows removed, and only those");
}

/// A relay handing a shard over to a relay that joins gives it up at once when nothing of
/// it is out under a live claim, also while a row of it waits to retry (the next owner
/// reads that row again): the other keys of the shard do not wait for the retry schedule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_handed_over_with_a_retry_pending_moves_at_once() {
    let outbox = log_outbox(2).await;
    let (j, k, o) = (
        key_in(&outbox, 0, 2, "j").await,
        key_in(&outbox, 1, 2, "k").await,
        key_in(&outbox, 0, 2, "o").await,
    );
    let mut first = vec![NewMessage::new("t", "j1").key(&j)];
    first.extend((1..=5).map(|i| NewMessage::new("t", format!("k{i}")).key(&k)));
    outbox.enqueue(&first).await;
    let a = outbox.storage.clone();
    let c = claim_some(&a, Duration::from_secs(20)).await;
    // Both heads wait an hour to retry; the rest of k is given back behind its head.
    let mut settlement = Settlement::default();
    for m in &c.messages {
        let text = text(&m.payload);
        if text == "j1" || text == "k1" {
            settlement.retries.push(outbox_core::Retry {
                id: m.id,
                delay: Duration::from_secs(3600),
                error: "refused".into(),
            });
        } else {
            settlement.released.push(m.id);
        }
    }
    a.settle(&c.token, &settlement).await.unwrap();
    // Relay B joins; A's next round sees two relays and hands one shard over: shard 0,
    // the one with less read (j1 alone). Both keep claiming, as their workers would.
    let b = outbox.another_relay();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    let mut sent_o1 = false;
    while !got.contains(&"o1".to_string()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "shard 0 not handed over within 5 s of B joining (B got {got:?})"
        );
        let on_a = a.claim("a", 100, LEASE).await.unwrap();
        assert!(
            !payloads(&on_a).iter().any(|p| p == "j1" || p == "o1"),
            "A hands out nothing of shard 0 while it hands it over, nor j1 early"
        );
        a.ack(&on_a.token, &deliveries(&on_a)).await.unwrap();
        let on_b = b.claim("b", 100, LEASE).await.unwrap();
        got.extend(payloads(&on_b));
        b.ack(&on_b.token, &deliveries(&on_b)).await.unwrap();
        let owner: Option<String> = sqlx::query_scalar(&format!(
            "SELECT owner FROM {} WHERE shard = 0",
            outbox.table.qualified("_shards")
        ))
        .fetch_one(&outbox.pool)
        .await
        .unwrap();
        if !sent_o1 && owner.as_deref() == b.relay_name() {
            outbox.enqueue(&[NewMessage::new("t", "o1").key(&o)]).await;
            sent_o1 = true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        got.contains(&"j1".to_string()),
        "the next owner reads the waiting row again: {got:?}"
    );
}

/// The housekeeping deletes delivered rows in short transactions of its own: while one
/// row it must delete is locked, the rows before it are already gone (committed), so no
/// long cleanup transaction holds the readable horizon of every relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn housekeeping_deletes_in_short_transactions() {
    let outbox = log_outbox(1).await;
    let messages: Vec<NewMessage> = (0..5000)
        .map(|i| NewMessage::new("t", format!("{i}")))
        .collect();
    outbox.enqueue(&messages).await;
    let mut delivered = 0;
    while delivered < messages.len() {
        let c = claim_some(&outbox.storage, Duration::from_secs(20)).await;
        assert!(!c.messages.is_empty(), "claims stopped at {delivered}");
        delivered += c.messages.len();
        outbox.ack(&c).await;
    }
    let outbox_table = outbox.table.qualified("");
    let mut locker = outbox.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {outbox_table} WHERE payload = '4500'::bytea FOR UPDATE"
    ))
    .execute(&mut *locker)
    .await
    .unwrap();
    let storage = outbox.storage.clone();
    let cleanup = tokio::spawn(async move { storage.maintain().await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = outbox.log_rows().await;
        if left <= 1000 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{left} rows left while one row was locked: the cleanup is one long transaction"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !cleanup.is_finished(),
        "the cleanup waits for the locked row"
    );
    locker.rollback().await.unwrap();
    cleanup.await.unwrap().expect("housekeeping");
    let left = outbox.log_rows().await;
    assert_eq!(left, 0, "every delivered row removed");
}

/// Counting the queue never stops the relay: while the figures' query waits (here on a
/// lock another session holds on the dead letters), a claim and its settlement go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_count_of_the_queue_does_not_hold_claims() {
    let outbox = log_outbox(2).await;
    outbox.enqueue(&[NewMessage::new("t", "m1").key("k")]).await;
    let first = claim_some(&outbox.storage, Duration::from_secs(20)).await;
    outbox.ack(&first).await;
    // Written before the lock: the lock takes a transaction id (it is logged for
    // standbys), which holds the readable horizon until it ends.
    outbox.enqueue(&[NewMessage::new("t", "m2").key("k")]).await;
    let mut locker = outbox.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        outbox.table.qualified("_dead_letters")
    ))
    .execute(&mut *locker)
    .await
    .unwrap();
    let storage = outbox.storage.clone();
    let counting = tokio::spawn(async move { Storage::stats(&*storage).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let claimed = tokio::time::timeout(Duration::from_secs(5), async {
        let c = claim_some(&outbox.storage, Duration::from_secs(5)).await;
        outbox.ack(&c).await;
        payloads(&c)
    })
    .await
    .expect("a claim waited for the count of the queue");
    assert_eq!(claimed, ["m2"]);
    assert!(!counting.is_finished(), "the count waits for the lock");
    locker.rollback().await.unwrap();
    counting.await.unwrap().expect("queue figures");
}

/// A relay that loses a shard (taken over) and takes it back later forgets what it knew of
/// the shard's parked keys: a released key's held rows are loaded again and go ahead of the
/// key's later rows. (Found by the randomised model with a second relay process.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_taken_back_loads_its_draining_keys_held_rows_again() {
    let outbox = log_outbox(1).await;
    outbox.enqueue(&keyed("k", &["k1", "k2"])).await;
    let a = outbox.storage.clone();
    let c = claim_some(&a, Duration::from_secs(20)).await;
    assert_eq!(payloads(&c), ["k1", "k2"]);
    let settlement = Settlement {
        dead: vec![DeadLetter {
            id: c.messages[0].id,
            error: "poison".into(),
        }],
        released: vec![c.messages[1].id],
        ..Settlement::default()
    };
    a.settle(&c.token, &settlement).await.unwrap();
    assert!(a.release_parked_key("k").await.unwrap());
    // A knows k is draining; its claim hands out the held k2, which it never settles.
    let on_a = a.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(payloads(&on_a), ["k2"]);
    // A stalls past its lease; B takes the shard, gives k2 back, and stops.
    let shards_table = outbox.table.qualified("_shards");
    outbox
        .execute(&format!(
            "UPDATE {shards_table} SET expires_at = now() - interval '1 second'"
        ))
        .await;
    let b = outbox.another_relay();
    let on_b = claim_some(&b, Duration::from_secs(10)).await;
    assert_eq!(payloads(&on_b), ["k2"], "B loads the held row");
    b.release(&on_b.token, &[on_b.messages[0].id])
        .await
        .unwrap();
    b.stop().await.unwrap();
    outbox.enqueue(&[NewMessage::new("t", "k3").key("k")]).await;
    // A's next round finds the shard taken (and given up since) and takes it again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while got.len() < 2 && tokio::time::Instant::now() < deadline {
        let c = a.claim("a", 10, LEASE).await.unwrap();
        got.extend(payloads(&c));
        a.ack(&c.token, &deliveries(&c)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(got, ["k2", "k3"], "the held k2 goes ahead of k3");
}

/// One key waiting to retry with more rows behind it than a shard's read buffer holds does
/// not stop the other keys of its shard: the relay lets the key's later rows go (they stay
/// in the log, the cursor before them) and reads on; once the head is settled the key's
/// rows are read again and delivered once each, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retrying_key_with_a_long_backlog_does_not_stop_its_shard() {
    let outbox = log_outbox(1).await;
    let backlog: Vec<NewMessage> = (0..600)
        .map(|i| NewMessage::new("t", format!("k{i:03}")).key("k"))
        .collect();
    outbox.enqueue(&backlog).await;
    outbox.enqueue(&[NewMessage::new("t", "o1").key("o")]).await;
    let a = outbox.storage.clone();
    let head = claim_some(&a, Duration::from_secs(20)).await;
    assert_eq!(payloads(&head)[0], "k000");
    let settlement = Settlement {
        retries: vec![outbox_core::Retry {
            id: head.messages[0].id,
            delay: Duration::from_secs(3600),
            error: "refused".into(),
        }],
        released: head.messages[1..].iter().map(|m| m.id).collect(),
        ..Settlement::default()
    };
    a.settle(&head.token, &settlement).await.unwrap();
    // The other key goes out within a few claims of 10, not after the retry.
    let mut other = Vec::new();
    for _ in 0..10 {
        let c = a.claim("a", 10, LEASE).await.unwrap();
        assert!(
            payloads(&c).iter().all(|p| !p.starts_with('k')),
            "a row of k passed its waiting head: {:?}",
            payloads(&c)
        );
        other.extend(payloads(&c));
        a.ack(&c.token, &deliveries(&c)).await.unwrap();
        if !other.is_empty() {
            break;
        }
    }
    assert_eq!(
        other,
        ["o1"],
        "the other key was not stopped by k's backlog"
    );
    // The head's retry comes due: every row of k once, in order.
    a.advance_clock(Duration::from_secs(7200));
    let mut got = Vec::new();
    for _ in 0..400 {
        let c = a.claim("a", 10, LEASE).await.unwrap();
        if c.messages.is_empty() && got.len() == backlog.len() {
            break;
        }
        got.extend(payloads(&c));
        a.ack(&c.token, &deliveries(&c)).await.unwrap();
    }
    let expected: Vec<String> = (0..600).map(|i| format!("k{i:03}")).collect();
    assert_eq!(got, expected, "k's rows once each, in order");
    assert_eq!(
        outbox.undelivered().await,
        0,
        "the cursor passed everything"
    );
}

/// A [`MemorySink`] whose every call takes 5 ms, so a backlog lasts long enough for
/// relays to join while it drains.
struct Paced(MemorySink);

#[async_trait::async_trait]
impl outbox_core::Sink for Paced {
    async fn publish(
        &self,
        batch: &[outbox_core::Message],
    ) -> outbox_core::Result<Vec<outbox_core::Outcome>> {
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.0.publish(batch).await
    }
    async fn health(&self) -> outbox_core::Result<()> {
        self.0.health().await
    }
}

/// docs/ARCHITECTURE.md "Ownership and fencing": "When relays join, one above its share
/// stops reading the shards it hands over, forgets what it read of them and never handed
/// out, and gives each up once nothing of it is out (so the next owner redelivers
/// nothing)". The existing four-relay test kills a relay too and so allows thousands of
/// redeliveries; here nobody dies: two relays join one that owns every shard, under
/// load, and every message must arrive exactly once, each key in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_joining_under_load_take_shards_over_without_redelivering() {
    let db = log_outbox(8).await;
    let (keys, total) = (80, 8000);
    for batch in over_keys(total, keys).chunks(2000) {
        db.storage.enqueue(batch).await.expect("enqueue");
    }
    let sink = Arc::new(Paced(MemorySink::new()));
    let config = |name: &str| WorkerConfig {
        batch_size: 100,
        lease: Duration::from_secs(2),
        ..test_worker_config(name)
    };
    let first = db.another_relay();
    let mut relays = vec![Relay::start(config("w0"), first.clone(), sink.clone())];
    while sink.0.published().len() < total / 8 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        first.owned_shards().await.len(),
        8,
        "w0 alone owns every shard"
    );
    let late: Vec<Arc<PgStorage>> = (0..2).map(|_| db.another_relay()).collect();
    for (i, storage) in late.iter().enumerate() {
        relays.push(Relay::start(
            config(&format!("w{}", i + 1)),
            storage.clone(),
            sink.clone(),
        ));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut joined = false;
    let mut joined_at = 0;
    loop {
        if !joined {
            let mut all = true;
            for storage in &late {
                all &= !storage.owned_shards().await.is_empty();
            }
            joined = all;
            if joined {
                joined_at = sink.0.published().len();
            }
        }
        let published = sink.0.published().len();
        if joined && published >= total {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after 60 s: joined {joined}, {published} of {total} published"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Anything redelivered would arrive shortly after the last first delivery.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for relay in relays {
        relay.stop().await;
    }
    let published = sink.0.published();
    // A duplicate breaks a key's order too.
    assert_key_order(&by_key(&published), total, keys);
    assert_eq!(published.len(), total, "each message exactly once");
    assert!(
        joined_at < total * 3 / 4,
        "the joining relays got their shards only after {joined_at} of {total} were \
         published: the hand-over did not happen under load"
    );
}

/// docs/storage/postgres.md "Log mode", the horizon: "rows held back only by an older
/// transaction that ends without writing to the outbox are found by the next poll
/// (`poll_interval`)". No commit on the outbox follows to wake the relay; the rows must go
/// out within a poll or two of the transaction's end, whether it rolls back or commits a
/// write to another table.
mod log_mode_horizon {
    use super::*;
    use outbox_core::memory::MemorySink;
    use outbox_core::{CancellationToken, Worker};
    use outbox_tests::{LogOutbox, test_worker_config};

    const POLL: Duration = Duration::from_secs(1);

    fn published(sink: &MemorySink) -> Vec<String> {
        sink.published().iter().map(|m| text(&m.payload)).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rows_held_by_a_transaction_that_never_writes_the_outbox_go_out_at_the_next_poll() {
        // A database of its own: the horizon is per database.
        let db = LogOutbox::new(4, |_| {}).await;
        sqlx::query("CREATE TABLE other (x int)")
            .execute(&db.pool)
            .await
            .expect("another table");
        let sink = Arc::new(MemorySink::new());
        let config = outbox_core::WorkerConfig {
            poll_interval: POLL,
            ..test_worker_config("horizon")
        };
        let worker = Worker::new(config, db.storage.clone(), sink.clone()).expect("worker");
        let stop = CancellationToken::new();
        let relay = tokio::spawn({
            let stop = stop.clone();
            async move { worker.run(stop).await }
        });

        for (round, commits) in [(0, false), (1, true)] {
            // An older transaction with an id (it wrote, or asked for one) holds the horizon.
            let mut older = db.pool.begin().await.expect("begin");
            sqlx::query("INSERT INTO other VALUES (1)")
                .execute(&mut *older)
                .await
                .expect("a write to another table");
            let batch: Vec<NewMessage> = (0..3)
                .map(|i| NewMessage::new("t", format!("{round}-{i}")).key("k"))
                .collect();
            db.storage.enqueue(&batch).await.expect("enqueue");
            tokio::time::sleep(POLL * 2).await;
            assert_eq!(
                published(&sink).len(),
                round * 3,
                "round {round}: the open transaction holds the rows back"
            );
            if commits {
                older.commit().await.expect("commit");
            } else {
                older.rollback().await.expect("rollback");
            }
            let ended = tokio::time::Instant::now();
            let deadline = ended + POLL * 3 + Duration::from_secs(2);
            while published(&sink).len() < (round + 1) * 3 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "round {round} ({}): the held rows did not go out within {:?} of the \
                     transaction's end (poll_interval {POLL:?}); published {:?}",
                    if commits { "commit" } else { "rollback" },
                    deadline - ended,
                    published(&sink)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        stop.cancel();
        relay.await.expect("the relay stops");
        assert_eq!(
            published(&sink),
            ["0-0", "0-1", "0-2", "1-0", "1-1", "1-2"],
            "each once, in order"
        );
    }
}
