//! The operator's side of [`MemoryStorage`] ([`StorageAdmin`]), on tokio's clock.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::MemoryStorage;
use crate::{
    DeadLetter, DeadLetterFilter, NewMessage, ParkedKey, Retry, Storage, StorageAdmin, TopicStats,
};

const LEASE: Duration = Duration::from_secs(30);

/// A message of `topic` made at `secs` after a fixed instant.
fn made_at(topic: &str, payload: &str, secs: i64) -> NewMessage {
    let mut m = NewMessage::new(topic, payload);
    m.created_at = at(secs);
    m
}

fn at(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_700_000_000 + secs, 0).expect("a valid time")
}

async fn enqueue(storage: &MemoryStorage, messages: &[NewMessage]) {
    StorageAdmin::enqueue(storage, messages)
        .await
        .expect("enqueue");
}

/// Claims up to `limit` messages and dead-letters those with these payloads, in the order
/// given, each with its error; returns the claimed ids by payload.
async fn dead_letter(storage: &MemoryStorage, limit: usize, dead: &[(&str, &str)]) {
    let claim = storage.claim("w", limit, LEASE).await.expect("claim");
    let dead: Vec<DeadLetter> = dead
        .iter()
        .map(|(payload, error)| DeadLetter {
            id: claim
                .messages
                .iter()
                .find(|m| m.payload == payload.as_bytes())
                .expect("claimed")
                .id,
            error: error.to_string(),
        })
        .collect();
    let n = storage
        .dead_letter(&claim.token, &dead)
        .await
        .expect("dead letter");
    assert_eq!(n, dead.len() as u64);
}

/// Whether a claim hands out nothing.
async fn claims_nothing(storage: &MemoryStorage) -> bool {
    let claim = storage.claim("w", 10, LEASE).await.expect("claim");
    claim.messages.is_empty()
}

/// A storage that keeps per-key order or not, holding `messages` (committed).
async fn holding(per_key_order: bool, messages: &[NewMessage]) -> MemoryStorage {
    let storage = MemoryStorage::new(per_key_order);
    enqueue(&storage, messages).await;
    storage
}

fn payloads(rows: &[crate::DeadLetterRow]) -> Vec<String> {
    rows.iter()
        .map(|r| String::from_utf8_lossy(&r.message.payload).into_owned())
        .collect()
}

#[tokio::test]
async fn describes_itself_and_has_nothing_to_migrate() {
    let storage = MemoryStorage::new(true);
    assert_eq!(storage.describe(), "memory");
    storage.migrate().await.expect("migrate");
    storage.migrate().await.expect("migrate again");
    assert_eq!(storage.migration_sql().await.expect("sql"), "");
}

#[tokio::test(start_paused = true)]
async fn enqueue_commits_every_message_in_order_and_wakes_a_worker() {
    let storage = std::sync::Arc::new(MemoryStorage::new(true));
    let waiter = tokio::spawn({
        let storage = storage.clone();
        async move { storage.wait_for_work().await }
    });
    tokio::task::yield_now().await;
    let messages = [
        NewMessage::new("t", "1").key("k"),
        NewMessage::new("t", "2"),
        NewMessage::new("u", "3").key("k"),
    ];
    enqueue(&storage, &messages).await;
    tokio::time::timeout(Duration::from_secs(1), waiter)
        .await
        .expect("the waiting worker is woken")
        .expect("joined")
        .expect("woken");
    let pending = storage.pending();
    assert_eq!(
        pending.iter().map(|m| m.id).collect::<Vec<_>>(),
        messages.iter().map(|m| m.id).collect::<Vec<_>>()
    );
    assert!(pending.iter().all(|m| m.attempts == 0));
    // Committed: claimable at once.
    let claim = storage.claim("w", 10, LEASE).await.expect("claim");
    assert_eq!(claim.messages.len(), 3);
    // Nothing to enqueue is fine.
    enqueue(&storage, &[]).await;
    assert_eq!(storage.pending().len(), 3);
}

#[tokio::test]
async fn enqueue_is_all_or_none_on_a_duplicate_id() {
    let storage = MemoryStorage::new(true);
    let first = NewMessage::new("t", "1");
    enqueue(&storage, std::slice::from_ref(&first)).await;
    let error = StorageAdmin::enqueue(&storage, &[NewMessage::new("t", "2"), first.clone()])
        .await
        .expect_err("the id is taken");
    assert_eq!(error.kind(), crate::ErrorKind::Permanent);
    let twice = NewMessage::new("t", "3");
    StorageAdmin::enqueue(&storage, &[twice.clone(), twice])
        .await
        .expect_err("the same id twice");
    let pending = storage.pending();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].id, first.id);
}

#[tokio::test(start_paused = true)]
async fn topic_stats_count_pending_in_flight_retrying_and_dead_per_topic() {
    let storage = MemoryStorage::new(false);
    assert!(storage.topic_stats().await.expect("stats").is_empty());
    enqueue(
        &storage,
        &[
            made_at("a", "a1", 10),
            made_at("a", "a2", 5),
            made_at("a", "a3", 20),
            made_at("b", "b1", 1),
            made_at("z", "z1", 0),
        ],
    )
    .await;
    // Uncommitted messages are not counted.
    let open = storage.begin(vec![made_at("open", "o1", 0), made_at("a", "a4", 0)]);

    let claim = storage.claim("w", 2, LEASE).await.expect("claim");
    let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
    assert_eq!(ids.len(), 2, "a1 and a2");
    let retry = Retry {
        id: ids[1],
        delay: Duration::from_secs(5),
        error: "later".into(),
    };
    assert_eq!(
        storage.retry(&claim.token, &[retry]).await.expect("retry"),
        1
    );
    let dead = DeadLetter {
        id: ids[0],
        error: "poison".into(),
    };
    assert_eq!(
        storage
            .dead_letter(&claim.token, &[dead])
            .await
            .expect("dead"),
        1
    );
    // a3 in flight (a2 waits to retry), then b1 and z1; z1 dead-lettered.
    let claim = storage.claim("w", 3, LEASE).await.expect("claim");
    assert_eq!(claim.messages.len(), 3, "a3, b1, z1");
    let z1 = DeadLetter {
        id: claim.messages[2].id,
        error: "poison".into(),
    };
    storage
        .dead_letter(&claim.token, &[z1])
        .await
        .expect("dead");
    // b1 goes back unclaimed.
    storage
        .release(&claim.token, &[claim.messages[1].id])
        .await
        .expect("release");

    let expected = vec![
        TopicStats {
            topic: "a".into(),
            pending: 1,
            oldest_pending: Some(at(5)),
            in_flight: 1,
            retrying: 1,
            dead_lettered: 1,
        },
        TopicStats {
            topic: "b".into(),
            pending: 1,
            oldest_pending: Some(at(1)),
            in_flight: 0,
            retrying: 0,
            dead_lettered: 0,
        },
        TopicStats {
            topic: "z".into(),
            pending: 0,
            oldest_pending: None,
            in_flight: 0,
            retrying: 0,
            dead_lettered: 1,
        },
    ];
    assert_eq!(storage.topic_stats().await.expect("stats"), expected);

    // Once a3's lease runs out on the storage's clock it is pending again.
    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
    let a = &storage.topic_stats().await.expect("stats")[0];
    assert_eq!((a.pending, a.in_flight, a.retrying), (2, 0, 1));
    assert_eq!(a.oldest_pending, Some(at(5)));

    // Committed, the open transaction's messages count.
    storage.commit(open);
    let stats = storage.topic_stats().await.expect("stats");
    let topics: Vec<&str> = stats.iter().map(|s| s.topic.as_str()).collect();
    assert_eq!(topics, ["a", "b", "open", "z"]);
    assert_eq!(
        (stats[0].pending, stats[0].oldest_pending),
        (3, Some(at(0)))
    );
}

#[tokio::test(start_paused = true)]
async fn topic_stats_count_parked_messages_as_pending() {
    let storage = MemoryStorage::new(true);
    enqueue(
        &storage,
        &[
            made_at("t", "k1", 1).key("k"),
            made_at("t", "k2", 2).key("k"),
        ],
    )
    .await;
    dead_letter(&storage, 1, &[("k1", "poison")]).await;
    assert_eq!(
        storage.topic_stats().await.expect("stats"),
        vec![TopicStats {
            topic: "t".into(),
            pending: 1,
            oldest_pending: Some(at(2)),
            in_flight: 0,
            retrying: 0,
            dead_lettered: 1,
        }]
    );
    assert!(claims_nothing(&storage).await, "k2 is parked");
}

/// Three dead letters, dead-lettered newest first: `o1` (orders, key a), `o2` (orders,
/// key b), `u1` (users, key a).
async fn three_dead_letters() -> (MemoryStorage, Vec<Uuid>) {
    let messages = [
        NewMessage::new("orders", "o1").key("a").header("h", "1"),
        NewMessage::new("orders", "o2").key("b"),
        NewMessage::new("users", "u1").key("a"),
        NewMessage::new("users", "alive"),
    ];
    let storage = holding(false, &messages).await;
    dead_letter(
        &storage,
        3,
        &[
            ("u1", "HTTP 500 Internal"),
            ("o2", "ÉCHEC: timeout"),
            ("o1", "Broker said NO"),
        ],
    )
    .await;
    (storage, messages[..3].iter().map(|m| m.id).collect())
}

#[tokio::test]
async fn dead_letters_lists_every_dead_letter_oldest_first_with_when_and_why() {
    let before = Utc::now();
    let (storage, ids) = three_dead_letters().await;
    let after = Utc::now();
    let rows = StorageAdmin::dead_letters(&storage, &DeadLetterFilter::default(), 10)
        .await
        .expect("list");
    assert_eq!(rows.iter().map(|r| r.message.id).collect::<Vec<_>>(), ids);
    assert_eq!(payloads(&rows), ["o1", "o2", "u1"]);
    assert_eq!(
        rows.iter()
            .map(|r| r.last_error.as_str())
            .collect::<Vec<_>>(),
        ["Broker said NO", "ÉCHEC: timeout", "HTTP 500 Internal"]
    );
    assert!(rows.iter().all(|r| r.message.attempts == 1));
    assert!(
        rows.iter()
            .all(|r| before <= r.dead_lettered_at && r.dead_lettered_at <= after)
    );
    assert_eq!(rows[0].message.topic, "orders");
    assert_eq!(rows[0].message.key.as_deref(), Some("a"));
    assert_eq!(
        rows[0].message.headers.get("h").map(String::as_str),
        Some("1")
    );
}

#[tokio::test]
async fn dead_letters_honours_each_filter_field_and_the_limit() {
    let (storage, ids) = three_dead_letters().await;
    let list = async |filter: DeadLetterFilter, limit: usize| {
        payloads(
            &StorageAdmin::dead_letters(&storage, &filter, limit)
                .await
                .expect("list"),
        )
    };
    let by_ids = |ids: Vec<Uuid>| DeadLetterFilter {
        ids: Some(ids),
        ..DeadLetterFilter::default()
    };
    assert_eq!(list(by_ids(vec![ids[2], ids[0]]), 10).await, ["o1", "u1"]);
    assert_eq!(list(by_ids(vec![]), 10).await, Vec::<String>::new());
    assert_eq!(
        list(by_ids(vec![Uuid::now_v7()]), 10).await,
        Vec::<String>::new()
    );

    // One text field at a time (topic and key exactly, the error text in any ASCII case).
    let by = |field: &str, value: &str| {
        let mut filter = DeadLetterFilter::default();
        let slot = match field {
            "topic" => &mut filter.topic,
            "key" => &mut filter.key,
            _ => &mut filter.last_error,
        };
        *slot = Some(value.into());
        filter
    };
    let cases: [(&str, &str, &[&str]); 13] = [
        ("topic", "orders", &["o1", "o2"]),
        ("topic", "users", &["u1"]),
        ("topic", "Orders", &[]),
        ("key", "a", &["o1", "u1"]),
        ("key", "b", &["o2"]),
        ("key", "c", &[]),
        ("last_error", "broker SAID no", &["o1"]),
        ("last_error", "TIMEOUT", &["o2"]),
        ("last_error", "500", &["u1"]),
        ("last_error", "", &["o1", "o2", "u1"]),
        // Only ASCII letters ignore their case: É matches itself, not é.
        ("last_error", "échec", &[]),
        ("last_error", "ÉCHEC", &["o2"]),
        ("last_error", "Échec", &["o2"]),
    ];
    for (field, value, expected) in cases {
        let listed = list(by(field, value), 10).await;
        assert_eq!(listed, expected, "{field} {value:?}");
    }

    let every = DeadLetterFilter {
        ids: Some(ids.clone()),
        topic: Some("orders".into()),
        key: Some("a".into()),
        last_error: Some("no".into()),
        without_payloads: false,
    };
    assert_eq!(list(every.clone(), 10).await, ["o1"]);
    assert_eq!(
        list(
            DeadLetterFilter {
                key: Some("b".into()),
                ..every
            },
            10
        )
        .await,
        Vec::<String>::new()
    );

    // The limit keeps the oldest.
    assert_eq!(list(DeadLetterFilter::default(), 2).await, ["o1", "o2"]);
    assert_eq!(list(by("key", "a"), 1).await, ["o1"]);
    assert_eq!(
        list(DeadLetterFilter::default(), 0).await,
        Vec::<String>::new()
    );
}

#[tokio::test]
async fn dead_letters_without_payloads_leaves_only_the_payload_out() {
    let (storage, ids) = three_dead_letters().await;
    let filter = DeadLetterFilter {
        without_payloads: true,
        ..DeadLetterFilter::default()
    };
    let rows = StorageAdmin::dead_letters(&storage, &filter, 10)
        .await
        .expect("list");
    assert_eq!(rows.iter().map(|r| r.message.id).collect::<Vec<_>>(), ids);
    assert!(rows.iter().all(|r| r.message.payload.is_empty()));
    assert_eq!(rows[0].last_error, "Broker said NO");
    assert_eq!(rows[0].message.key.as_deref(), Some("a"));
    assert_eq!(
        rows[0].message.headers.get("h").map(String::as_str),
        Some("1")
    );
    // The stored dead letters keep theirs.
    assert!(
        storage
            .dead_letters()
            .iter()
            .all(|(m, _)| !m.payload.is_empty())
    );
}

#[tokio::test(start_paused = true)]
async fn parked_keys_name_each_key_with_its_oldest_dead_letter() {
    let messages = [
        NewMessage::new("t", "b1").key("b"),
        NewMessage::new("t", "a1").key("a"),
        NewMessage::new("t", "a2").key("a"),
        NewMessage::new("t", "free"),
        NewMessage::new("t", "a3").key("a"),
    ];
    let storage = holding(true, &messages).await;
    assert!(storage.parked_keys().await.expect("parked").is_empty());
    // a2 is dead-lettered before a1, and parks the key.
    dead_letter(
        &storage,
        4,
        &[("a2", "e"), ("a1", "e"), ("b1", "e"), ("free", "e")],
    )
    .await;
    let parked = |key: &str, i: usize| ParkedKey {
        key: key.into(),
        dead_letter: messages[i].id,
    };
    assert_eq!(
        storage.parked_keys().await.expect("parked"),
        vec![parked("a", 1), parked("b", 0)],
        "in key order, each with its oldest dead letter; no key for `free`"
    );
    // The oldest purged, the next one holds the key.
    assert_eq!(
        StorageAdmin::purge_dead_letters(&storage, &[messages[1].id])
            .await
            .expect("purge"),
        1
    );
    assert_eq!(
        storage.parked_keys().await.expect("parked"),
        vec![parked("a", 2), parked("b", 0)]
    );
    // Every dead letter of the key purged: still parked, behind the one that parked it.
    StorageAdmin::purge_dead_letters(&storage, &[messages[2].id])
        .await
        .expect("purge");
    assert_eq!(
        storage.parked_keys().await.expect("parked"),
        vec![parked("a", 2), parked("b", 0)]
    );
    assert!(claims_nothing(&storage).await, "a3 is held back");
}

#[tokio::test(start_paused = true)]
async fn without_per_key_order_a_dead_letter_parks_nothing() {
    let storage = MemoryStorage::new(false);
    enqueue(&storage, &[NewMessage::new("t", "k1").key("k")]).await;
    dead_letter(&storage, 1, &[("k1", "e")]).await;
    assert!(storage.parked_keys().await.expect("parked").is_empty());
    assert!(
        !StorageAdmin::release_parked_key(&storage, "k")
            .await
            .expect("release")
    );
}

#[tokio::test(start_paused = true)]
async fn replay_purge_and_release_do_what_the_inherent_methods_do() {
    let messages = [
        NewMessage::new("t", "k1").key("k"),
        NewMessage::new("t", "k2").key("k"),
    ];
    let storage = holding(true, &messages).await;
    dead_letter(&storage, 1, &[("k1", "poison")]).await;

    // Replay: back first in its key's order, attempts reset, key released.
    assert_eq!(
        StorageAdmin::replay_dead_letters(&storage, &[messages[0].id, Uuid::now_v7()])
            .await
            .expect("replay"),
        1
    );
    assert!(storage.parked_keys().await.expect("parked").is_empty());
    assert_eq!(
        StorageAdmin::dead_letters(&storage, &DeadLetterFilter::default(), 10)
            .await
            .expect("list")
            .len(),
        0
    );
    assert_eq!(
        StorageAdmin::replay_dead_letters(&storage, &[])
            .await
            .expect("replay"),
        0
    );
    let claim = storage.claim("w", 10, LEASE).await.expect("claim");
    assert_eq!(claim.messages[0].id, messages[0].id);
    assert_eq!(claim.messages[0].attempts, 0);
    storage
        .release(&claim.token, &[messages[0].id, messages[1].id])
        .await
        .expect("release");

    // Purge: gone, key still parked until released.
    dead_letter(&storage, 1, &[("k1", "poison")]).await;
    assert_eq!(
        StorageAdmin::purge_dead_letters(&storage, &[messages[0].id])
            .await
            .expect("purge"),
        1
    );
    assert_eq!(
        StorageAdmin::purge_dead_letters(&storage, &[messages[0].id])
            .await
            .expect("purge"),
        0
    );
    assert!(storage.dead_letters().is_empty());
    assert_eq!(storage.parked_keys().await.expect("parked").len(), 1);
    assert!(
        StorageAdmin::release_parked_key(&storage, "k")
            .await
            .expect("release")
    );
    assert!(
        !StorageAdmin::release_parked_key(&storage, "k")
            .await
            .expect("release")
    );
    assert!(storage.parked_keys().await.expect("parked").is_empty());
    let claim = storage.claim("w", 10, LEASE).await.expect("claim");
    assert_eq!(claim.messages.len(), 1);
    assert_eq!(claim.messages[0].id, messages[1].id);
}

#[tokio::test(start_paused = true)]
async fn waiting_behind_counts_the_keys_messages_still_in_the_queue() {
    let storage = MemoryStorage::new(true);
    enqueue(
        &storage,
        &[
            NewMessage::new("t", "k1").key("k"),
            NewMessage::new("t", "k2").key("k"),
            NewMessage::new("t", "k3").key("k"),
            NewMessage::new("t", "o1").key("other"),
            NewMessage::new("t", "none"),
        ],
    )
    .await;
    assert_eq!(storage.waiting_behind("k").await.expect("count"), Some(3));
    dead_letter(&storage, 1, &[("k1", "poison")]).await;
    assert_eq!(storage.parked_keys().await.expect("parked").len(), 1);
    assert_eq!(storage.waiting_behind("k").await.expect("count"), Some(2));
    assert_eq!(
        storage.waiting_behind("nokey").await.expect("count"),
        Some(0)
    );
    // Uncommitted messages do not wait; in-flight ones still count.
    let open = storage.begin(vec![NewMessage::new("t", "k4").key("k")]);
    assert_eq!(storage.waiting_behind("k").await.expect("count"), Some(2));
    let claim = storage.claim("w", 10, LEASE).await.expect("claim");
    assert_eq!(claim.messages.len(), 2, "o1 and none");
    assert_eq!(
        storage.waiting_behind("other").await.expect("count"),
        Some(1)
    );
    storage.commit(open);
    assert_eq!(storage.waiting_behind("k").await.expect("count"), Some(3));
}
