//! The PostgreSQL storage and the relay against the real PostgreSQL: each delivery guarantee
//! of docs/guarantees.md has a test here that fails if it breaks.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::memory::MemorySink;
use outbox_core::{
    Claim, Delivery, Error, ErrorKind, NewMessage, Receipt, Retry, Storage, TraceContext,
    WorkerConfig,
};
use outbox_postgres::{DEFAULT_MAX_PER_KEY as MAX_PER_KEY, OutboxTable, PgStorage, PostgresConfig};
use outbox_tests::{
    TestOutbox, by_key, deliveries, four_relays_deliver_once_in_key_order, keyed, numbered,
    postgres_url, test_worker_config, text,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_messages_are_never_delivered_committed_ones_are() {
    let outbox = TestOutbox::new().await;
    let tx = outbox
        .begin_with(&NewMessage::new("orders", "rolled back"))
        .await;
    tx.rollback().await.unwrap();
    let tx = outbox
        .begin_with(&NewMessage::new("orders", "committed"))
        .await;
    tx.commit().await.unwrap();

    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay("w1", sink.clone());
    outbox.wait_until_drained(Duration::from_secs(10)).await;
    relay.stop().await;
    let payloads: Vec<String> = sink.published().iter().map(|m| text(&m.payload)).collect();
    assert_eq!(payloads, ["committed"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_fields_survive_storage_exactly() {
    let outbox = TestOutbox::new().await;
    let binary: Vec<u8> = (0..=255u8).rev().collect();
    let messages = vec![
        NewMessage::new("orders.created", binary.clone())
            .key("order-1")
            .header("content-type", "application/octet-stream")
            .header("x-ünïcode", "värde ✓")
            .trace_context(TraceContext {
                traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                tracestate: Some("congo=t61rcWkgMzE".into()),
            }),
        NewMessage::json("orders.created", &serde_like()).unwrap(),
        NewMessage::new("empty", Vec::new()),
    ];
    outbox.enqueue(&messages).await;
    let claim = outbox.claim("w", 10, Duration::from_secs(30)).await;
    assert_eq!(claim.messages.len(), 3);
    for (sent, got) in messages.iter().zip(&claim.messages) {
        assert_eq!(got.id, sent.id);
        assert_eq!(got.topic, sent.topic);
        assert_eq!(got.key, sent.key);
        assert_eq!(got.payload, sent.payload);
        assert_eq!(got.headers, sent.headers);
        assert_eq!(got.trace_context, sent.trace_context);
        assert_eq!(got.attempts, 0);
        assert_eq!(
            got.created_at.timestamp_micros(),
            sent.created_at.timestamp_micros()
        );
    }
}

fn serde_like() -> BTreeMap<&'static str, u32> {
    BTreeMap::from([("id", 42)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_deliver_every_message_once_in_key_order() {
    let outbox = TestOutbox::new().await;
    let enqueue = async |batch: &[NewMessage]| outbox.enqueue(batch).await;
    four_relays_deliver_once_in_key_order(outbox.storage.clone(), enqueue, 1000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_without_key_order_deliver_everything_once() {
    let outbox = TestOutbox::with_config(|c| c.per_key_order = false).await;
    let messages: Vec<NewMessage> = (0..3000)
        .map(|i| NewMessage::new("t", i.to_string()).key("same"))
        .collect();
    outbox.enqueue(&messages).await;
    let sink = Arc::new(MemorySink::new());
    let a = outbox.relay("a", sink.clone());
    let b = outbox.relay("b", sink.clone());
    outbox.wait_until_drained(Duration::from_secs(60)).await;
    a.stop().await;
    b.stop().await;
    let mut ids: Vec<_> = sink.published().iter().map(|m| m.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3000);
    assert_eq!(sink.published().len(), 3000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_committing_out_of_order_lose_nothing() {
    let outbox = TestOutbox::new().await;
    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay("w", sink.clone());
    // The first writer takes the lower sequence number but commits last.
    let early = outbox.begin_with(&NewMessage::new("t", "early-seq")).await;
    let late = outbox.begin_with(&NewMessage::new("t", "late-seq")).await;
    late.commit().await.unwrap();
    outbox.wait_until_drained(Duration::from_secs(10)).await;
    assert_eq!(sink.published().len(), 1);
    early.commit().await.unwrap();
    // And many concurrent writers with random commit delays.
    let mut writers = Vec::new();
    for i in 0..40 {
        let (pool, table) = (outbox.pool.clone(), outbox.table.clone());
        writers.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            table
                .enqueue(&mut tx, &NewMessage::new("t", format!("w{i}")))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..200))).await;
            tx.commit().await.unwrap();
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    outbox.wait_until_drained(Duration::from_secs(10)).await;
    relay.stop().await;
    assert_eq!(sink.published().len(), 42);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_relays_late_writes_are_refused() {
    let outbox = TestOutbox::new().await;
    let messages: Vec<NewMessage> = (0..5)
        .map(|i| NewMessage::new("t", format!("m{i}")).key(format!("k{i}")))
        .collect();
    outbox.enqueue(&messages).await;
    // A relay claims, then stalls (or dies) past its lease without acknowledging.
    let stale = outbox.claim("stalled", 10, Duration::from_secs(1)).await;
    assert_eq!(stale.messages.len(), 5);
    let sink = Arc::new(MemorySink::new());
    let relay = outbox.relay("healthy", sink.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        sink.published().is_empty(),
        "claimed messages were taken before the lease ran out"
    );
    outbox.wait_until_drained(Duration::from_secs(10)).await;
    relay.stop().await;
    assert_eq!(sink.published().len(), 5);

    // The stalled relay wakes up: none of its writes may touch the rows any more.
    let deliveries = deliveries(&stale.messages, |_| "late".into());
    assert_eq!(
        outbox.storage.ack(&stale.token, &deliveries).await.unwrap(),
        0
    );
    let retries: Vec<Retry> = stale
        .messages
        .iter()
        .map(|m| Retry {
            id: m.id,
            delay: Duration::ZERO,
            error: "late".into(),
        })
        .collect();
    assert_eq!(
        outbox.storage.retry(&stale.token, &retries).await.unwrap(),
        0
    );

    // While a newer claim holds a row, the stale token cannot complete it either.
    outbox.enqueue(&[NewMessage::new("t", "again")]).await;
    let first = outbox.claim("a", 10, Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = outbox.claim("b", 10, Duration::from_secs(30)).await;
    assert_eq!(second.messages.len(), 1);
    let late_ack = [Delivery {
        id: first.messages[0].id,
        receipt: Receipt::new("x"),
    }];
    assert_eq!(
        outbox.storage.ack(&first.token, &late_ack).await.unwrap(),
        0,
        "stale ack accepted"
    );
    assert_eq!(
        outbox
            .storage
            .release(&first.token, &[first.messages[0].id])
            .await
            .unwrap(),
        0
    );
    assert_eq!(outbox.stats().await.in_flight, 1);
    assert_eq!(
        outbox.storage.ack(&second.token, &late_ack).await.unwrap(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_key_blocks_its_later_messages_for_other_relays() {
    let outbox = TestOutbox::new().await;
    outbox.enqueue(&keyed("k", &["k1", "k2"])).await;
    let first = outbox.claim("a", 1, Duration::from_secs(30)).await;
    assert_eq!(text(&first.messages[0].payload), "k1");
    outbox.enqueue(&[NewMessage::new("t", "free")]).await;
    let second = outbox.claim("b", 10, Duration::from_secs(30)).await;
    let got: Vec<String> = second.messages.iter().map(|m| text(&m.payload)).collect();
    assert_eq!(got, ["free"], "k2 must wait while k1 is in flight");
    // After a retry is scheduled, k2 still waits for k1.
    let retry = [Retry {
        id: first.messages[0].id,
        delay: Duration::from_secs(60),
        error: "nack".into(),
    }];
    assert_eq!(outbox.storage.retry(&first.token, &retry).await.unwrap(), 1);
    let third = outbox.claim("c", 10, Duration::from_secs(30)).await;
    assert!(
        third.messages.is_empty(),
        "k2 overtook a message waiting to retry"
    );
}

fn payloads(claim: &Claim) -> Vec<String> {
    claim.messages.iter().map(|m| text(&m.payload)).collect()
}

const LEASE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_key_does_not_hold_other_keys_back() {
    let outbox = TestOutbox::new().await;
    let hot: Vec<NewMessage> = (0..100)
        .map(|i| NewMessage::new("t", format!("hot-{i}")).key("hot"))
        .collect();
    outbox.enqueue(&hot).await;
    outbox
        .enqueue(&[NewMessage::new("t", "cold-0").key("cold")])
        .await;
    let claim = outbox.claim("w", 20, LEASE).await;
    let got = payloads(&claim);
    assert!(
        got.contains(&"cold-0".to_string()),
        "the key behind a busy key goes in the same claim: {got:?}"
    );
    let hot: Vec<&String> = got.iter().filter(|p| p.starts_with("hot-")).collect();
    let first: Vec<String> = (0..MAX_PER_KEY).map(|i| format!("hot-{i}")).collect();
    assert_eq!(
        hot,
        first.iter().collect::<Vec<_>>(),
        "at most {MAX_PER_KEY} messages of one key per claim, its first ones in order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_take_turns_across_claims() {
    let outbox = TestOutbox::new().await;
    let messages: Vec<NewMessage> = (0..16)
        .flat_map(|i| ["a", "b", "c"].map(|k| NewMessage::new("t", format!("{k}-{i}")).key(k)))
        .collect();
    outbox.enqueue(&messages).await;
    let mut turns = Vec::new();
    for _ in 0..(48 / MAX_PER_KEY) {
        let claim = outbox.claim("w", MAX_PER_KEY, LEASE).await;
        let got = payloads(&claim);
        let key = got[0].split('-').next().unwrap().to_string();
        assert!(
            got.iter().all(|p| p.starts_with(&format!("{key}-"))),
            "one key fills a claim of {MAX_PER_KEY}: {got:?}"
        );
        let deliveries = deliveries(&claim.messages, |_| "r".into());
        outbox.storage.ack(&claim.token, &deliveries).await.unwrap();
        turns.push((key, got[0].clone()));
    }
    for (i, (key, _)) in turns.iter().enumerate() {
        assert_eq!(
            key,
            ["a", "b", "c"][i % 3],
            "each key gets a turn before any key gets another: {turns:?}"
        );
    }
    assert_eq!(
        turns[3].1,
        format!("a-{MAX_PER_KEY}"),
        "a key's second turn starts where its first ended"
    );
    assert_eq!(outbox.stats().await.pending, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_without_a_key_take_turns_with_keyed_ones() {
    let outbox = TestOutbox::new().await;
    let unkeyed: Vec<NewMessage> = (0..10)
        .map(|i| NewMessage::new("t", format!("u-{i}")))
        .collect();
    let keyed: Vec<NewMessage> = (0..10)
        .map(|i| NewMessage::new("t", format!("k-{i}")).key(format!("k{i}")))
        .collect();
    outbox.enqueue(&unkeyed).await;
    outbox.enqueue(&keyed).await;
    let claim = outbox.claim("w", 10, LEASE).await;
    let got = payloads(&claim);
    assert_eq!(
        got.iter().filter(|p| p.starts_with("u-")).count(),
        5,
        "half the claim for messages without a key: {got:?}"
    );
    assert_eq!(
        got.iter()
            .filter(|p| p.starts_with("u-"))
            .collect::<Vec<_>>(),
        ["u-0", "u-1", "u-2", "u-3", "u-4"],
        "messages without a key go oldest first"
    );
    let rest = outbox.claim("w", 100, LEASE).await;
    assert_eq!(rest.messages.len(), 10, "the rest in the next claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wake_up_delivers_well_before_the_poll_interval() {
    // The test server allows prepared transactions (for the two-phase commit tests).
    let outbox = TestOutbox::with_config(|c| c.wakeup_with_prepared_transactions = true).await;
    let sink = Arc::new(MemorySink::new());
    let config = WorkerConfig {
        poll_interval: Duration::from_secs(30),
        ..test_worker_config("w")
    };
    let relay = outbox.relay_with(config, sink.clone());
    let idle = format!(
        "SELECT relay_idle FROM {}",
        outbox.table.qualified("_wakeup")
    );
    for round in 0..3 {
        // Writers notify only once the relay has said it is idle (and listens): wait for
        // that, however slow the machine, rather than for a fixed time.
        let arming = tokio::time::Instant::now();
        while !sqlx::query_scalar::<_, bool>(&idle)
            .fetch_one(&outbox.pool)
            .await
            .unwrap()
        {
            assert!(
                arming.elapsed() < Duration::from_secs(10),
                "the relay never went idle"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let started = tokio::time::Instant::now();
        outbox
            .enqueue(&[NewMessage::new("t", format!("r{round}"))])
            .await;
        while sink.published().len() <= round {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "no wake-up: waited for the poll interval"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_do_not_notify_while_the_relay_is_busy() {
    // The test server allows prepared transactions (for the two-phase commit tests).
    let outbox = TestOutbox::with_config(|c| c.wakeup_with_prepared_transactions = true).await;
    let idle = || async {
        sqlx::query_scalar::<_, bool>(&format!(
            "SELECT relay_idle FROM {}",
            outbox.table.qualified("_wakeup")
        ))
        .fetch_one(&outbox.pool)
        .await
        .unwrap()
    };
    assert!(!idle().await);
    let sink = Arc::new(MemorySink::new());
    let config = WorkerConfig {
        batch_size: 10,
        ..test_worker_config("w")
    };
    let relay = outbox.relay_with(config, sink.clone());
    // An idle relay asks writers to notify (as soon as its first claim finds nothing; a
    // loaded machine may take a while to get there: a CI run under full load once took more
    // than 10 s, in 0.5 s otherwise).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !idle().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "an idle relay asks writers to notify"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A full batch means the relay is busy: it tells writers to stop notifying.
    outbox.enqueue(&numbered(500)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut saw_busy = false;
    while sink.published().len() < 500 {
        saw_busy |= !idle().await;
        assert!(tokio::time::Instant::now() < deadline);
    }
    assert!(
        saw_busy,
        "writers were asked to notify throughout a busy drain"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_rows_can_be_kept_with_their_receipt_then_purged() {
    let outbox = TestOutbox::with_config(|c| c.retention = Some(Duration::from_millis(500))).await;
    outbox
        .enqueue(&[
            NewMessage::new("t", "a").key("k"),
            NewMessage::new("t", "b"),
        ])
        .await;
    let claim = outbox.claim("w", 10, Duration::from_secs(30)).await;
    let deliveries = deliveries(&claim.messages, |m| format!("1-{}", text(&m.payload)));
    assert_eq!(
        outbox.storage.ack(&claim.token, &deliveries).await.unwrap(),
        2
    );
    let delivered = outbox.table.qualified("_delivered");
    let receipts: Vec<String> =
        sqlx::query_scalar(&format!("SELECT receipt FROM {delivered} ORDER BY seq"))
            .fetch_all(&outbox.pool)
            .await
            .unwrap();
    assert_eq!(receipts, ["1-a", "1-b"]);
    assert_eq!(outbox.stats().await.pending, 0);
    tokio::time::sleep(Duration::from_millis(600)).await;
    outbox.storage.maintain().await.unwrap();
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {delivered}"))
        .fetch_one(&outbox.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_figures_match_the_table() {
    let outbox = TestOutbox::new().await;
    outbox.enqueue(&numbered(7)).await;
    let claim = outbox.claim("w", 3, Duration::from_secs(30)).await;
    assert_eq!(claim.messages.len(), 3);
    let stats = outbox.stats().await;
    assert_eq!((stats.pending, stats.in_flight), (4, 3));
    assert!(stats.oldest_pending.is_some());
    outbox
        .storage
        .release(&claim.token, &[claim.messages[0].id])
        .await
        .unwrap();
    let stats = outbox.stats().await;
    assert_eq!((stats.pending, stats.in_flight), (5, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_sessions_plan_every_claim_for_the_real_table() {
    let outbox = TestOutbox::new().await;
    let mode: String = sqlx::query_scalar("SHOW plan_cache_mode")
        .fetch_one(outbox.storage.pool())
        .await
        .unwrap();
    assert_eq!(mode, "force_custom_plan");
    let commit: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(outbox.storage.pool())
        .await
        .unwrap();
    assert_eq!(commit, "off");
    let options: Vec<String> =
        sqlx::query_scalar("SELECT unnest(reloptions) FROM pg_class WHERE oid = $1::regclass")
            .bind(outbox.table.qualified(""))
            .fetch_all(&outbox.pool)
            .await
            .unwrap();
    assert!(
        options.contains(&"autovacuum_vacuum_scale_factor=0".to_string()),
        "{options:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_idempotent_and_a_plain_insert_is_enough_to_enqueue() {
    let outbox = TestOutbox::new().await;
    outbox.storage.migrate().await.unwrap();
    // Another language enqueues with plain SQL: only topic and payload are required.
    outbox.execute(&format!("INSERT INTO {} (topic, payload, partition_key, headers) VALUES ('t', 'hi', 'k', '{{\"n\": 1}}')", outbox.table.qualified(""))).await;
    let claim = outbox.claim("w", 10, Duration::from_secs(30)).await;
    assert_eq!(claim.messages[0].payload, b"hi");
    assert_eq!(claim.messages[0].headers["n"], "1");
}

#[tokio::test]
async fn bad_configuration_is_refused_with_the_key_named() {
    // Errors name the key; the relay puts its section in front, as here.
    let refused = |config: PostgresConfig| {
        let error = PgStorage::new(config).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Config);
        error.in_section("storage").to_string()
    };
    let bad_schema =
        refused(PostgresConfig::new(postgres_url()).table("Robert'); DROP TABLE x;--", "outbox"));
    assert!(bad_schema.contains("storage.schema"), "{bad_schema}");
    let bad_url = refused(PostgresConfig::new("mysql://root:hunter2@db/x"));
    assert!(
        bad_url.contains("storage.url") && !bad_url.contains("hunter2"),
        "{bad_url}"
    );
    let config = PostgresConfig {
        max_connections: 1,
        ..PostgresConfig::new(postgres_url())
    };
    assert!(refused(config).contains("storage.max_connections"));
    for max_per_key in [0, 10_001] {
        let config = PostgresConfig {
            max_per_key,
            ..PostgresConfig::new(postgres_url())
        };
        let error = refused(config);
        assert!(error.contains("storage.max_per_key"), "{error}");
    }
    assert!(OutboxTable::new("ok", "").is_err());
    let debug = format!("{:?}", PostgresConfig::new("postgres://app:hunter2@db/x"));
    assert!(!debug.contains("hunter2"), "{debug}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_is_down_is_unavailable_not_a_crash() {
    let config = PostgresConfig {
        connect_timeout: Duration::from_secs(1),
        ..PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")
    };
    let storage = PgStorage::new(config).unwrap();
    let err = storage.health().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let err = storage
        .claim("w", 10, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(err.is_retryable());
}

/// The issue's first case end to end: writer A's message commits late, behind B's, which the
/// broker refuses once; C's, written after B committed, must reach the sink after B's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_and_one_refusal_keep_key_order_through_a_relay() {
    let outbox = TestOutbox::new().await;
    let sink = Arc::new(MemorySink::new());
    let refused = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = refused.clone();
    sink.fail_when(move |m| {
        (m.payload == b"b" && !seen.swap(true, std::sync::atomic::Ordering::SeqCst))
            .then(|| Error::temporary("queue full"))
    });
    let a = outbox.begin_with(&NewMessage::new("t", "a").key("k")).await;
    outbox.enqueue(&[NewMessage::new("t", "b").key("k")]).await;
    let mut config = test_worker_config("late-commit");
    config.backoff.initial = Duration::from_millis(800);
    config.backoff.max = Duration::from_secs(2);
    config.backoff.jitter = 0.0;
    let relay = outbox.relay_with(config, sink.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !refused.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b was never published"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    outbox.enqueue(&[NewMessage::new("t", "c").key("k")]).await;
    a.commit().await.unwrap();
    outbox.wait_until_drained(Duration::from_secs(20)).await;
    relay.stop().await;
    let order = by_key(&sink.published()).remove("k").unwrap_or_default();
    let at = |p: &str| order.iter().position(|x| x == p);
    assert!(
        at("b").is_some() && at("b") < at("c") && at("a").is_some(),
        "c began after b committed and must follow it: {order:?}"
    );
}

/// A settlement is one transaction: when part of it cannot be written, none of it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_is_written_whole_or_not_at_all() {
    let outbox = TestOutbox::new().await;
    outbox.enqueue(&keyed("k", &["m1", "m2", "m3"])).await;
    let storage = &outbox.storage;
    let c = outbox.claim("w1", 10, Duration::from_secs(30)).await;
    assert_eq!(c.messages.len(), 3);
    let settlement = outbox_core::Settlement {
        delivered: vec![Delivery {
            id: c.messages[0].id,
            receipt: Receipt::new("r1"),
        }],
        // PostgreSQL text cannot hold NUL: this part of the statement fails.
        retries: vec![Retry {
            id: c.messages[1].id,
            delay: Duration::from_secs(60),
            error: "bad\0error".into(),
        }],
        released: vec![c.messages[2].id],
        ..Default::default()
    };
    storage
        .settle(&c.token, &settlement)
        .await
        .expect_err("a NUL byte cannot be stored");
    let stats = outbox.stats().await;
    assert_eq!(
        (stats.in_flight, stats.pending),
        (3, 0),
        "half a settlement was written: {stats:?}"
    );
}

/// A lease runs from the claim statement, not from the start of its transaction: a claim
/// that waited for the claim lock still holds its messages for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_runs_from_the_claim_not_from_the_wait_for_the_lock() {
    let outbox = TestOutbox::new().await;
    outbox.enqueue(&[NewMessage::new("t", "m").key("k")]).await;
    // Another session holds the claim lock for a while, as a slow claim would.
    let mut holder = outbox.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(outbox.table.lock_key())
        .execute(&mut *holder)
        .await
        .unwrap();
    let storage = outbox.storage.clone();
    let claim = tokio::spawn(async move { storage.claim("w1", 10, Duration::from_secs(3)).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    holder.commit().await.unwrap();
    let claim = claim.await.unwrap().unwrap();
    assert_eq!(claim.messages.len(), 1, "the claim took the message");
    let left_ms: f64 = sqlx::query_scalar(&format!(
        "SELECT extract(epoch FROM available_at - clock_timestamp())::float8 * 1000 FROM {}",
        outbox.table.qualified("")
    ))
    .fetch_one(&outbox.pool)
    .await
    .unwrap();
    assert!(
        left_ms > 2000.0,
        "a 3 s lease had only {left_ms:.0} ms left right after the claim: it was counted from before the wait"
    );
}

#[tokio::test]
async fn tables_never_migrated_are_a_schema_error_that_says_what_to_run() {
    let config = PostgresConfig::new(postgres_url())
        .table(outbox_tests::unique_name("never_migrated"), "outbox");
    let storage = PgStorage::new(config).expect("valid configuration");
    let claim = storage
        .claim("w", 10, Duration::from_secs(5))
        .await
        .unwrap_err();
    let stats = storage.stats().await.unwrap_err();
    for error in [claim, stats] {
        assert_eq!(error.kind(), ErrorKind::Schema, "{error}");
        assert!(!error.is_retryable(), "{error}");
        assert!(
            error.to_string().contains("run `outbox migrate`"),
            "{error}"
        );
    }
}

/// A table that an older release migrated (no `<table>_stats` yet, until a DBA applies the
/// new step): each relay counts its queue figures itself, as before.
#[tokio::test]
async fn shared_stats_without_the_stats_table_count_here() {
    let outbox = TestOutbox::new().await;
    outbox.enqueue(&[NewMessage::new("t", b"x".to_vec())]).await;
    outbox
        .execute(&format!("DROP TABLE {}", outbox.table.qualified("_stats")))
        .await;
    let stats = outbox
        .storage
        .shared_stats(Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!((stats.pending, stats.measured_at), (1, None), "{stats:?}");
}

/// A table at the version before `retrying` was shared (`<table>_stats` without the column):
/// the relay whose turn it is, and one that would read the stored row, both count the figures
/// themselves rather than fail.
#[tokio::test]
async fn shared_stats_without_the_retrying_column_count_here() {
    let outbox = TestOutbox::new().await;
    outbox.enqueue(&[NewMessage::new("t", b"x".to_vec())]).await;
    let stats = outbox.table.qualified("_stats");
    outbox
        .execute(&format!("ALTER TABLE {stats} DROP COLUMN retrying"))
        .await;
    for turn in ["its turn to count", "another relay counted"] {
        let figures = outbox
            .storage
            .shared_stats(Duration::from_secs(3600))
            .await
            .unwrap();
        assert_eq!(
            (figures.pending, figures.measured_at),
            (1, None),
            "{turn}: {figures:?}"
        );
    }
}

/// docs/storage/postgres.md: "bad data (SQLSTATE 22, 23) → `Permanent`": a refused enqueue
/// writes nothing, and the next good one goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_data_is_refused_as_permanent_and_writes_nothing() {
    use outbox_tests::{assert_a_good_enqueue_goes_through, assert_refused_as_permanent};
    let outbox = TestOutbox::new().await;
    let s = &*outbox.storage;
    let nul_header = NewMessage::new("t", "x").header("h", "v\0");
    assert_refused_as_permanent(s, "a NUL in the topic", NewMessage::new("a\0b", "x")).await;
    assert_refused_as_permanent(s, "a NUL in the key", NewMessage::new("t", "x").key("k\0")).await;
    assert_refused_as_permanent(s, "a NUL in a header value", nul_header).await;
    assert_a_good_enqueue_goes_through(s).await;
}
