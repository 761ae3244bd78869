//! The checks that need more than one call of the storage: a relay (the worker) running over
//! it (`relay_*`), and the operator's side read the way the CLI and the console read it
//! (`admin_*`). They take a [`StorageHarness`] like the storage checks, and every storage
//! harness runs them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use outbox_core::memory::MemorySink;
use outbox_core::{
    Backoff, CancellationToken, DeadLetter, DeadLetterFilter, DeadLetterRow, Delivery, Error,
    Message, NewMessage, ParkedKey, QueueStats, Receipt, Settlement, StorageAdmin, Worker,
    WorkerConfig,
};

use uuid::Uuid;

use crate::storage::fixture;
use crate::{StorageFixture, StorageHarness, note};

const LEASE: Duration = Duration::from_secs(30);

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

fn payloads(messages: &[Message]) -> Vec<String> {
    messages.iter().map(|m| text(&m.payload)).collect()
}

fn keyed(key: &str, payload: &str) -> NewMessage {
    NewMessage::new("conformance", payload).key(key)
}

/// A fixture keeping per-key order, or `None` (the check notes why) for a storage that
/// cannot.
async fn ordered(h: &dyn StorageHarness, check: &str) -> Option<Box<dyn StorageFixture>> {
    let f = fixture(h, true).await;
    if f.is_none() {
        note(check, "skipped: the storage cannot keep per-key order");
    }
    f
}

/// Worker settings for a check: fast polls and short backoff.
fn worker_config(max_attempts: u32) -> WorkerConfig {
    WorkerConfig {
        poll_interval: Duration::from_millis(50),
        backoff: Backoff {
            initial: Duration::from_millis(50),
            multiplier: 2.0,
            max: Duration::from_millis(500),
            jitter: 0.2,
        },
        max_attempts,
        shutdown_timeout: Duration::from_secs(5),
        ..WorkerConfig::new("conformance-relay")
    }
}

/// Polls the queue figures until `done` holds; panics with `what` and the figures after
/// 20 s.
async fn wait_for(admin: &dyn StorageAdmin, what: &str, done: impl Fn(&QueueStats) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stats = admin.stats().await.unwrap_or_else(|e| panic!("stats: {e}"));
        if done(&stats) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} within 20 s: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A relay over `f`'s storage with `sink`, in the background: stop it with
/// [`RelayTask::stop`].
struct RelayTask {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RelayTask {
    fn start(
        check: &str,
        f: &dyn StorageFixture,
        sink: Arc<MemorySink>,
        max_attempts: u32,
    ) -> RelayTask {
        let worker = Worker::new(worker_config(max_attempts), f.storage(), sink)
            .unwrap_or_else(|e| panic!("{check}: worker configuration: {e}"));
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { worker.run(shutdown).await }
        });
        RelayTask { shutdown, task }
    }

    async fn stop(self, check: &str) {
        self.shutdown.cancel();
        self.task
            .await
            .unwrap_or_else(|e| panic!("{check}: the relay task: {e}"));
    }
}

/// The queue figures; panics naming the check when they cannot be read.
async fn stats_of(check: &str, admin: &dyn StorageAdmin) -> QueueStats {
    admin
        .stats()
        .await
        .unwrap_or_else(|e| panic!("{check}: stats: {e}"))
}

/// The one dead letter there is; panics naming the check when the dead letters cannot be
/// read or there is not exactly one.
async fn the_dead_letter(check: &str, admin: &dyn StorageAdmin) -> DeadLetterRow {
    let mut dead = admin
        .dead_letters(&DeadLetterFilter::default(), 10)
        .await
        .unwrap_or_else(|e| panic!("{check}: dead letters: {e}"));
    assert_eq!(dead.len(), 1, "{check}: {dead:?}");
    dead.remove(0)
}

/// The payloads the sink published for `key`, in order.
fn published_of(sink: &MemorySink, key: &str) -> Vec<String> {
    sink.published()
        .iter()
        .filter(|m| m.key.as_deref() == Some(key))
        .map(|m| text(&m.payload))
        .collect()
}

/// docs/ARCHITECTURE.md, `Temporary`: "charges an attempt; retries after backoff;
/// dead-letters at `max_attempts`"; docs/guarantees.md: "other keys keep flowing; its key's
/// later messages (including new ones) are parked, then delivered in order after a replay".
/// Through a relay: exactly `max_attempts` publishes of the poison message, another key's
/// ten messages meanwhile and none of its own key's, the attempts and the reason on the dead
/// letter, the queue figures, and after the replay the key in order.
pub async fn relay_retries_then_dead_letters_and_parks_the_key(h: &dyn StorageHarness) {
    const CHECK: &str = "relay_retries_then_dead_letters_and_parks_the_key";
    let Some(f) = ordered(h, CHECK).await else {
        return;
    };
    let mut messages = vec![keyed("p", "p1"), keyed("p", "p2")];
    messages.extend((0..10).map(|i| keyed("f", &format!("f{i}"))));
    f.enqueue(&messages).await;
    let sink = Arc::new(MemorySink::new());
    let tries = Arc::new(AtomicUsize::new(0));
    let poisoned = Arc::new(AtomicBool::new(true));
    sink.fail_when({
        let (tries, poisoned) = (tries.clone(), poisoned.clone());
        move |m| {
            (m.payload == b"p1" && poisoned.load(Ordering::SeqCst)).then(|| {
                tries.fetch_add(1, Ordering::SeqCst);
                Error::temporary("broker said no")
            })
        }
    });
    let relay = RelayTask::start(CHECK, &*f, sink.clone(), 3);
    let admin = f.admin();
    wait_for(&*admin, "p1 dead-lettered", |s| s.dead_lettered == 1).await;
    f.enqueue(&[keyed("p", "p3")]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(tries.load(Ordering::SeqCst), 3, "{CHECK}: publishes of p1");
    let dead = the_dead_letter(CHECK, &*admin).await;
    assert_eq!(
        dead.message.attempts, 3,
        "{CHECK}: attempts recorded on the dead letter"
    );
    assert!(
        dead.last_error.contains("gave up after 3 attempts") && dead.last_error.contains("said no"),
        "{CHECK}: the reason says how many attempts and why: {}",
        dead.last_error
    );
    assert_eq!(
        published_of(&sink, "f").len(),
        10,
        "{CHECK}: the other key flows"
    );
    assert_eq!(
        published_of(&sink, "p"),
        Vec::<String>::new(),
        "{CHECK}: p2 and p3 stay parked behind the dead letter"
    );
    let stats = stats_of(CHECK, &*admin).await;
    assert_eq!(
        (stats.parked_keys, stats.pending, stats.dead_lettered),
        (1, 2, 1),
        "{CHECK}: one key parked, p2 and p3 pending, p1 dead: {stats:?}"
    );
    poisoned.store(false, Ordering::SeqCst);
    assert_eq!(f.replay_dead_letters(&[dead.message.id]).await, 1);
    wait_for(&*admin, "drained after the replay", |s| {
        s.pending == 0 && s.in_flight == 0 && s.parked_keys == 0 && s.dead_lettered == 0
    })
    .await;
    relay.stop(CHECK).await;
    assert_eq!(
        published_of(&sink, "p"),
        ["p1", "p2", "p3"],
        "{CHECK}: after the replay the key goes in order"
    );
    assert_eq!(tries.load(Ordering::SeqCst), 3, "{CHECK}: no publish more");
}

/// docs/ARCHITECTURE.md, `Permanent`: "dead-letters at once (parks the key)"; releasing the
/// parked key lets its later messages flow without the dead letter, which stays until it is
/// purged.
pub async fn relay_a_permanent_failure_is_dead_lettered_at_once_and_release_lets_the_rest_flow(
    h: &dyn StorageHarness,
) {
    const CHECK: &str =
        "relay_a_permanent_failure_is_dead_lettered_at_once_and_release_lets_the_rest_flow";
    let Some(f) = ordered(h, CHECK).await else {
        return;
    };
    let messages = [keyed("k", "too big"), keyed("k", "next")];
    f.enqueue(&messages).await;
    let sink = Arc::new(MemorySink::new());
    sink.fail_when(|m| (m.payload == b"too big").then(|| Error::permanent("message too large")));
    let relay = RelayTask::start(CHECK, &*f, sink.clone(), 5);
    let admin = f.admin();
    wait_for(&*admin, "the key parked", |s| s.parked_keys == 1).await;
    let dead = the_dead_letter(CHECK, &*admin).await;
    assert_eq!(dead.message.attempts, 1, "{CHECK}: one attempt, no retry");
    assert_eq!(
        dead.last_error,
        Error::permanent("message too large").to_string(),
        "{CHECK}: the reason is the sink's"
    );
    assert!(f.release_parked_key("k").await, "{CHECK}: `k` was parked");
    wait_for(&*admin, "drained after the release", |s| {
        s.pending == 0 && s.in_flight == 0 && s.parked_keys == 0
    })
    .await;
    relay.stop(CHECK).await;
    assert_eq!(
        published_of(&sink, "k"),
        ["next"],
        "{CHECK}: the rest flowed"
    );
    let stats = stats_of(CHECK, &*admin).await;
    assert_eq!(stats.dead_lettered, 1, "{CHECK}: the dead letter stays");
    assert_eq!(f.purge_dead_letters(&[messages[0].id]).await, 1);
}

/// docs/guarantees.md: "A sink outage charges no attempt and dead-letters nothing;
/// everything is delivered once it is back": with the sink down for two seconds nothing is
/// claimed or charged, and once it is up every message goes out on its first attempt.
pub async fn relay_a_sink_outage_charges_no_attempt_and_everything_arrives_later(
    h: &dyn StorageHarness,
) {
    const CHECK: &str = "relay_a_sink_outage_charges_no_attempt_and_everything_arrives_later";
    let f = h.fresh(true).await;
    let messages: Vec<NewMessage> = (0..50)
        .map(|i| keyed(&format!("k{}", i % 5), &format!("m{i}")))
        .collect();
    f.enqueue(&messages).await;
    let sink = Arc::new(MemorySink::new());
    sink.set_up(false);
    let relay = RelayTask::start(CHECK, &*f, sink.clone(), 3);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let admin = f.admin();
    let stats = stats_of(CHECK, &*admin).await;
    assert_eq!(
        (
            stats.pending,
            stats.in_flight,
            stats.dead_lettered,
            stats.retrying
        ),
        (50, 0, 0, 0),
        "{CHECK}: nothing claimed, charged or dead-lettered while the sink is down: {stats:?}"
    );
    sink.set_up(true);
    wait_for(&*admin, "drained once the sink is up", |s| {
        s.pending == 0 && s.in_flight == 0
    })
    .await;
    relay.stop(CHECK).await;
    let published = sink.published();
    assert_eq!(published.len(), 50, "{CHECK}: everything once");
    assert!(
        published.iter().all(|m| m.attempts == 0),
        "{CHECK}: every message went out on its first attempt"
    );
    let stats = stats_of(CHECK, &*admin).await;
    assert_eq!(stats.dead_lettered, 0, "{CHECK}: {stats:?}");
}

/// docs/storage/mysql.md: "keys compare byte for byte, so no collation folds `A` into `a` or
/// drops trailing spaces", and so in every storage: `A`, `a`, `a ` and both spellings of `é`
/// are five keys, in claims, in parking and in the operator's release.
pub async fn admin_keys_that_differ_in_any_byte_are_different_keys(h: &dyn StorageHarness) {
    const CHECK: &str = "admin_keys_that_differ_in_any_byte_are_different_keys";
    const KEYS: [&str; 5] = ["A", "a", "a ", "\u{e9}", "e\u{301}"];
    let Some(f) = ordered(h, CHECK).await else {
        return;
    };
    let (storage, admin) = (f.storage(), f.admin());
    let nth = |n: usize| -> Vec<NewMessage> {
        KEYS.iter()
            .enumerate()
            .map(|(i, k)| NewMessage::new("conformance", format!("{i}-{n}")).key(*k))
            .collect()
    };
    f.enqueue(&nth(1)).await;
    f.enqueue(&nth(2)).await;
    let claim = |limit: usize| {
        let storage = storage.clone();
        async move {
            storage
                .claim("keys", limit, LEASE)
                .await
                .unwrap_or_else(|e| panic!("{CHECK}: claim: {e}"))
        }
    };

    // One message per claim, nothing settled: each claim holds its key, so the next finds a
    // key of its own only if the keys are told apart.
    let mut held = Vec::new();
    for _ in 0..KEYS.len() {
        let c = claim(1).await;
        held.extend(c.messages.into_iter().map(|m| (c.token, m)));
    }
    let mut got: Vec<String> = held.iter().map(|(_, m)| text(&m.payload)).collect();
    got.sort();
    let firsts: Vec<String> = (0..KEYS.len()).map(|i| format!("{i}-1")).collect();
    assert_eq!(
        got, firsts,
        "{CHECK}: each of {KEYS:?} is a key of its own: its first message is free while the \
         others' are held"
    );
    for (token, m) in &held {
        let settled = if m.key.as_deref() == Some("A") {
            let dead = [DeadLetter {
                id: m.id,
                error: "poison".into(),
            }];
            storage.dead_letter(token, &dead).await
        } else {
            let delivered = [Delivery {
                id: m.id,
                receipt: Receipt::new("r"),
            }];
            storage.ack(token, &delivered).await
        };
        let settled = settled.unwrap_or_else(|e| panic!("{CHECK}: settling {}: {e}", m.id));
        assert_eq!(settled, 1, "{CHECK}: settled {}", m.id);
    }
    let mut got = payloads(&claim(100).await.messages);
    got.sort();
    assert_eq!(
        got,
        ["1-2", "2-2", "3-2", "4-2"],
        "{CHECK}: only A is parked; a, `a `, and both spellings of é flow"
    );
    let stats = stats_of(CHECK, &*admin).await;
    assert_eq!(stats.parked_keys, 1, "{CHECK}: {stats:?}");
    for other in ["a", "A "] {
        assert!(
            !f.release_parked_key(other).await,
            "{CHECK}: releasing {other:?} found a parked key, though only `A` is parked"
        );
    }
    assert!(f.release_parked_key("A").await, "{CHECK}: `A` was parked");
    assert_eq!(
        payloads(&claim(100).await.messages),
        ["0-2"],
        "{CHECK}: A flows once released"
    );
}

/// docs/console.md and `outbox dead-letters list --error`: the storage matches the text of
/// the last error (ASCII case ignored, `%` and `_` taken as themselves), counts only matches
/// against the limit, and leaves payloads out when asked, so a search or a listing reads no
/// more than it shows.
pub async fn admin_dead_letter_search_matches_error_text_without_payloads(h: &dyn StorageHarness) {
    const CHECK: &str = "admin_dead_letter_search_matches_error_text_without_payloads";
    let f = h.fresh(true).await;
    let (storage, admin) = (f.storage(), f.admin());
    let errors = [
        "HTTP 503 Service Unavailable",
        "broker said: TIMEOUT after 5 s",
        "poison",
    ];
    let messages: Vec<NewMessage> = (0..errors.len())
        .map(|i| NewMessage::new(format!("t{}", i % 2), vec![b'x'; 1000]).key(format!("k{i}")))
        .collect();
    f.enqueue(&messages).await;
    let c = storage
        .claim("search", 10, LEASE)
        .await
        .unwrap_or_else(|e| panic!("{CHECK}: claim: {e}"));
    assert_eq!(c.messages.len(), errors.len(), "{CHECK}: claimed");
    let dead: Vec<DeadLetter> = c
        .messages
        .iter()
        .zip(errors)
        .map(|(m, error)| DeadLetter {
            id: m.id,
            error: error.into(),
        })
        .collect();
    let settled = storage
        .dead_letter(&c.token, &dead)
        .await
        .unwrap_or_else(|e| panic!("{CHECK}: dead letter: {e}"));
    assert_eq!(settled, 3, "{CHECK}: dead-lettered");
    let list = |filter: DeadLetterFilter, limit: usize| {
        let admin = admin.clone();
        async move {
            admin
                .dead_letters(&filter, limit)
                .await
                .unwrap_or_else(|e| panic!("{CHECK}: listing {filter:?}: {e}"))
        }
    };
    let search = |text: &str, topic: Option<&str>| DeadLetterFilter {
        last_error: Some(text.into()),
        topic: topic.map(Into::into),
        ..DeadLetterFilter::default()
    };
    let found = |rows: Vec<DeadLetterRow>| -> Vec<String> {
        rows.into_iter().map(|r| r.last_error).collect()
    };
    for (filter, expected) in [
        (search("timeout", None), vec![errors[1]]),
        (search("Unavailable", Some("t0")), vec![errors[0]]),
        (search("unavailable", Some("t1")), vec![]),
        (search(" ", None), vec![errors[0], errors[1]]),
        (search("%", None), vec![]),
        (search("_", None), vec![]),
    ] {
        let described = format!("{filter:?}");
        assert_eq!(
            found(list(filter, 10).await),
            expected,
            "{CHECK}: {described}"
        );
    }
    assert_eq!(
        found(list(search("s", None), 1).await),
        [errors[0]],
        "{CHECK}: the limit counts matches only"
    );

    let listed = list(
        DeadLetterFilter {
            without_payloads: true,
            ..DeadLetterFilter::default()
        },
        10,
    )
    .await;
    assert_eq!(listed.len(), 3, "{CHECK}: listed");
    for (row, m) in listed.iter().zip(&c.messages) {
        assert!(
            row.message.payload.is_empty(),
            "{CHECK}: payload left out: {row:?}"
        );
        assert_eq!(
            (&row.message.id, &row.message.topic, &row.message.key),
            (&m.id, &m.topic, &m.key),
            "{CHECK}: everything else is there"
        );
        assert_eq!(row.message.headers, m.headers, "{CHECK}: headers");
    }
    let whole = list(DeadLetterFilter::default(), 10).await;
    assert!(
        whole.iter().all(|r| r.message.payload.len() == 1000),
        "{CHECK}: without the flag the payloads are there"
    );
}

/// The operator's repairs (`StorageAdmin`, what every CLI command uses), one after the
/// other: enqueue, figures per topic, dead letters listed by filter, replayed first in their
/// key, dead again and purged; the parked key listed and released.
pub async fn admin_the_operators_repairs(h: &dyn StorageHarness) {
    const CHECK: &str = "admin_the_operators_repairs";
    let Some(f) = ordered(h, CHECK).await else {
        return;
    };
    let (storage, admin) = (f.storage(), f.admin());
    let claim = || async {
        storage
            .claim("w", 10, LEASE)
            .await
            .unwrap_or_else(|e| panic!("{CHECK}: claim: {e}"))
    };
    let settle = |c: outbox_core::Claim, settlement: Settlement| {
        let storage = storage.clone();
        async move {
            storage
                .settle(&c.token, &settlement)
                .await
                .unwrap_or_else(|e| panic!("{CHECK}: settle: {e}"))
        }
    };
    let parked = || async {
        admin
            .parked_keys()
            .await
            .unwrap_or_else(|e| panic!("{CHECK}: parked keys: {e}"))
    };
    let topic_figures = || async {
        admin
            .topic_stats()
            .await
            .unwrap_or_else(|e| panic!("{CHECK}: topic figures: {e}"))
    };
    admin
        .enqueue(&[
            NewMessage::new("orders", "a1").key("k"),
            NewMessage::new("orders", "a2").key("k"),
            NewMessage::new("audit", "b1").key("j"),
        ])
        .await
        .unwrap_or_else(|e| panic!("{CHECK}: enqueue: {e}"));
    let pending: Vec<_> = topic_figures()
        .await
        .into_iter()
        .map(|t| (t.topic, t.pending))
        .collect();
    assert_eq!(
        pending,
        [("audit".to_string(), 1), ("orders".to_string(), 2)],
        "{CHECK}: pending per topic"
    );
    let c = claim().await;
    assert_eq!(
        payloads(&c.messages),
        ["a1", "a2", "b1"],
        "{CHECK}: claimed"
    );
    let written = c.messages[0].created_at;
    let (a1, a2, b1) = (c.messages[0].id, c.messages[1].id, c.messages[2].id);
    let settlement = Settlement {
        dead: vec![DeadLetter {
            id: a1,
            error: "poison".into(),
        }],
        released: vec![a2],
        delivered: vec![Delivery {
            id: b1,
            receipt: Receipt::new("r"),
        }],
        ..Settlement::default()
    };
    assert_eq!(settle(c, settlement).await, 3, "{CHECK}: settled");
    assert_eq!(
        parked().await,
        [ParkedKey {
            key: "k".into(),
            dead_letter: a1
        }],
        "{CHECK}: k is parked by a1"
    );
    assert_figures!(storage, pending: 1, dead_lettered: 1, parked_keys: 1; "{CHECK}");
    let topics = topic_figures().await;
    assert_eq!(topics.len(), 1, "{CHECK}: audit is gone: {topics:?}");
    assert_eq!(
        (topics[0].pending, topics[0].dead_lettered),
        (1, 1),
        "{CHECK}: {topics:?}"
    );

    let dead_letters = |filter: DeadLetterFilter| {
        let admin = admin.clone();
        async move {
            admin
                .dead_letters(&filter, 10)
                .await
                .unwrap_or_else(|e| panic!("{CHECK}: dead letters: {e}"))
        }
    };
    let dead = dead_letters(DeadLetterFilter::default()).await;
    assert_eq!(dead.len(), 1, "{CHECK}: one dead letter");
    assert_eq!(
        (
            dead[0].message.id,
            dead[0].last_error.as_str(),
            dead[0].message.attempts
        ),
        (a1, "poison", 1),
        "{CHECK}: the dead letter"
    );
    let after = dead[0].dead_lettered_at - written;
    assert!(
        after.num_seconds().abs() < 60,
        "{CHECK}: dead-lettered {after} after it was written"
    );
    let filter =
        |ids: Option<Vec<Uuid>>, topic: Option<&str>, key: Option<&str>| DeadLetterFilter {
            ids,
            topic: topic.map(Into::into),
            key: key.map(Into::into),
            ..DeadLetterFilter::default()
        };
    for (filter, expected) in [
        (filter(Some(vec![a1]), Some("orders"), Some("k")), 1),
        (filter(None, None, Some("j")), 0),
        (filter(None, Some("audit"), None), 0),
        (filter(Some(vec![b1]), None, None), 0),
    ] {
        let described = format!("{filter:?}");
        assert_eq!(
            dead_letters(filter).await.len(),
            expected,
            "{CHECK}: {described}"
        );
    }

    assert!(claim().await.messages.is_empty(), "{CHECK}: k is parked");
    assert_eq!(
        admin.replay_dead_letters(&[a1]).await.expect("replay"),
        1,
        "{CHECK}: replayed"
    );
    if h.traits().replays_unpark_at_once {
        assert!(parked().await.is_empty(), "{CHECK}: a replay unparks");
    } else {
        note(
            CHECK,
            "the replayed key is read unparked once it drained, at the end",
        );
    }
    let again = claim().await;
    assert_eq!(
        payloads(&again.messages),
        ["a1", "a2"],
        "{CHECK}: the replayed head goes first"
    );
    assert_eq!(
        again.messages[0].attempts, 0,
        "{CHECK}: a replay resets attempts"
    );

    // Dead again, then purged: the key stays parked until it is released.
    let settlement = Settlement {
        dead: vec![DeadLetter {
            id: a1,
            error: "still poison".into(),
        }],
        released: vec![a2],
        ..Settlement::default()
    };
    assert_eq!(settle(again, settlement).await, 2, "{CHECK}: settled again");
    assert_eq!(
        admin.purge_dead_letters(&[a1]).await.expect("purge"),
        1,
        "{CHECK}: purged"
    );
    let stats = storage.stats().await.expect("stats");
    assert_eq!(stats.dead_lettered, 0, "{CHECK}: {stats:?}");
    assert_eq!(parked().await.len(), 1, "{CHECK}: k stays parked");
    assert!(claim().await.messages.is_empty(), "{CHECK}: k is parked");
    assert!(
        admin.release_parked_key("k").await.expect("release"),
        "{CHECK}: released"
    );
    assert!(
        !admin.release_parked_key("k").await.expect("release again"),
        "{CHECK}: nothing left to release"
    );
    let last = claim().await;
    assert_eq!(
        payloads(&last.messages),
        ["a2"],
        "{CHECK}: the key flows on"
    );
    let delivered = Settlement {
        delivered: vec![Delivery {
            id: a2,
            receipt: Receipt::new("r"),
        }],
        ..Settlement::default()
    };
    assert_eq!(settle(last, delivered).await, 1, "{CHECK}: delivered");
    assert!(claim().await.messages.is_empty(), "{CHECK}: drained");
    assert!(
        parked().await.is_empty(),
        "{CHECK}: nothing parked once drained"
    );
}
