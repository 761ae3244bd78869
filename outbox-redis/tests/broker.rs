//! The sink alone against the real Redis (`$OUTBOX_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`). Each test writes under its own stream prefix.

use std::time::Duration;

use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, Template, TraceContext};
use outbox_redis::redis::{self, AsyncCommands};
use outbox_redis::{RedisConfig, RedisSink, wire};
use outbox_test_support::redis::{client, commands, delete_prefixed, text, url, xlen, xrange};
use outbox_test_support::{Proxy, Service, Traffic, through, unique_name};
use outbox_testkit::{assert_unavailable_within, receipts};
use tokio::time::Instant;

/// A stream prefix of the test's own; checks first that Redis is there.
async fn prefix() -> String {
    let _ = client().await;
    format!("{}:", unique_name("outbox_test"))
}

fn config(url: &str, prefix: &str) -> RedisConfig {
    RedisConfig::new(url)
        .stream_prefix(prefix)
        .publish_timeout(Duration::from_secs(2))
}

/// Checks that the messages at `indexes` were delivered.
fn assert_delivered_at(outcomes: &[Outcome], indexes: &[usize]) {
    for &i in indexes {
        assert!(
            matches!(outcomes[i], Outcome::Delivered(_)),
            "message {i}: {:?}",
            outcomes[i]
        );
    }
}

/// `config`, with de-duplication for a minute when `dedup`.
fn deduplicating(config: RedisConfig, dedup: bool) -> RedisConfig {
    if dedup {
        config.dedup(Duration::from_secs(60))
    } else {
        config
    }
}

/// Makes `{prefix}broken` a plain string, which XADD refuses with WRONGTYPE; returns the
/// stream's name.
async fn break_stream(prefix: &str) -> String {
    let broken = format!("{prefix}broken");
    let _: () = client().await.set(&broken, "not a stream").await.unwrap();
    broken
}

/// A sink of a prefix of its own, de-duplicating when `dedup`, whose `{prefix}broken` stream
/// is [broken](break_stream): the prefix, the sink and that stream's name.
async fn sink_with_a_broken_stream(dedup: bool) -> (String, RedisSink, String) {
    let prefix = prefix().await;
    let sink = RedisSink::new(deduplicating(config(&url(), &prefix), dedup)).unwrap();
    let broken = break_stream(&prefix).await;
    (prefix, sink, broken)
}

/// Makes `stream` a stream again (by deleting the string [`break_stream`] put there).
async fn fix_stream(stream: &str) {
    let _: () = client().await.del(stream).await.unwrap();
}

/// Checks that `outcome` is the permanent WRONGTYPE failure of appending to `stream`,
/// naming it.
fn assert_wrongtype(outcome: &Outcome, stream: &str) {
    let Outcome::Failed(error) = outcome else {
        panic!("WRONGTYPE delivered?")
    };
    assert_eq!(error.kind(), ErrorKind::Permanent, "{error}");
    assert!(error.to_string().contains("WRONGTYPE"), "{error}");
    assert!(
        error.to_string().contains(stream),
        "names the stream: {error}"
    );
}

fn template(text: &str) -> Template {
    Template::new(text).expect("a valid template")
}

fn message(topic: &str, key: &str, payload: impl Into<Vec<u8>>) -> Message {
    NewMessage::new(topic, payload).key(key).into()
}

/// Messages of these keys and payloads to topic `good`, but the one at `broken`, which goes
/// to topic `broken` (the stream [`break_stream`] breaks).
fn good_but_one(messages: &[(&str, &str)], broken: usize) -> Vec<Message> {
    (messages.iter().enumerate())
        .map(|(i, (key, payload))| {
            let topic = if i == broken { "broken" } else { "good" };
            message(topic, key, *payload)
        })
        .collect()
}

#[tokio::test]
async fn entries_hold_the_exact_message() {
    let prefix = prefix().await;
    let sink = RedisSink::new(config(&url(), &prefix)).unwrap();
    sink.health().await.unwrap();
    let payloads: Vec<Vec<u8>> = vec![
        b"{\"order\":1}".to_vec(),
        vec![0xff, 0x00, 0xfe, b'\r', b'\n', 0x80],
        Vec::new(),
        "grüße, 世界".as_bytes().to_vec(),
    ];
    let batch: Vec<Message> = payloads
        .iter()
        .enumerate()
        .map(|(i, p)| {
            NewMessage::new("orders", p.clone())
                .key(format!("k{i}"))
                .header("content-type", "application/octet-stream")
                .header("x-tenant", format!("tenant {i}"))
                .trace_context(TraceContext {
                    traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                    tracestate: None,
                })
                .into()
        })
        .collect();
    let receipts = receipts(&sink.publish(&batch).await.unwrap());

    let entries = xrange(&format!("{prefix}orders")).await;
    assert_eq!(entries.len(), batch.len(), "every message once");
    for ((message, (entry_id, fields)), receipt) in batch.iter().zip(&entries).zip(&receipts) {
        assert_eq!(entry_id, receipt, "the receipt is the stream entry id");
        assert_eq!(
            fields[wire::PAYLOAD],
            message.payload,
            "payload bytes exact"
        );
        assert_eq!(text(fields, wire::ID), message.id.to_string());
        assert_eq!(text(fields, wire::TOPIC), "orders");
        assert_eq!(text(fields, wire::KEY), *message.key.as_ref().unwrap());
        assert_eq!(text(fields, wire::CONTENT_TYPE), "application/octet-stream");
        assert_eq!(text(fields, "header:x-tenant"), message.headers["x-tenant"]);
        assert_eq!(
            text(fields, "header:content-type"),
            "application/octet-stream"
        );
        assert_eq!(
            text(fields, wire::TRACEPARENT),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert!(!fields.contains_key(wire::TRACESTATE));
        assert_eq!(
            text(fields, wire::CREATED_AT),
            message
                .created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        );
    }
    delete_prefixed(&prefix).await;
}

#[tokio::test]
async fn keys_keep_their_order_within_a_stream() {
    let prefix = prefix().await;
    let sink = RedisSink::new(config(&url(), &prefix).stream_template(template("events:{topic}")))
        .unwrap();
    // Rounds as the worker makes them: one message per key per call.
    let mut sent: Vec<Message> = Vec::new();
    for round in 0..20 {
        let batch: Vec<Message> = (0..10)
            .map(|k| {
                message(
                    if k % 2 == 0 { "a" } else { "b" },
                    &format!("k{k}"),
                    format!("{round}"),
                )
            })
            .collect();
        receipts(&sink.publish(&batch).await.unwrap());
        sent.extend(batch);
    }
    for topic in ["a", "b"] {
        let entries = xrange(&format!("{prefix}events:{topic}")).await;
        let expected: Vec<String> = sent
            .iter()
            .filter(|m| m.topic == topic)
            .map(|m| m.id.to_string())
            .collect();
        let got: Vec<String> = entries.iter().map(|(_, f)| text(f, wire::ID)).collect();
        assert_eq!(got, expected, "stream {topic} in publish order");
    }
    delete_prefixed(&prefix).await;
}

#[tokio::test]
async fn wrongtype_dead_letters_only_that_message() {
    for dedup in [false, true] {
        let (prefix, sink, broken) = sink_with_a_broken_stream(dedup).await;

        let batch = good_but_one(&[("k1", "1"), ("k2", "2"), ("k3", "3")], 1);
        let outcomes = sink.publish(&batch).await.unwrap();
        assert_eq!(outcomes.len(), 3);
        assert_delivered_at(&outcomes, &[0, 2]);
        assert_wrongtype(&outcomes[1], &broken);
        assert_eq!(xlen(&format!("{prefix}good")).await, 2);

        // Once the key is fixed the same message goes out: the failure left no de-duplication
        // record behind.
        fix_stream(&broken).await;
        receipts(&sink.publish(&batch[1..2]).await.unwrap());
        assert_eq!(xlen(&broken).await, 1, "dedup={dedup}");
        delete_prefixed(&prefix).await;
    }
}

#[tokio::test]
async fn dedup_appends_a_batch_published_twice_once() {
    let prefix = prefix().await;
    let sink = RedisSink::new(
        config(&url(), &prefix)
            .dedup(Duration::from_secs(60))
            .stream_template(template("s")),
    )
    .unwrap();
    assert!(sink.capabilities().deduplicates);
    let batch: Vec<Message> = (0..50)
        .map(|i| message("t", &format!("k{i}"), vec![i as u8; 3]))
        .collect();
    let first = receipts(&sink.publish(&batch).await.unwrap());
    let again = receipts(&sink.publish(&batch).await.unwrap());
    assert_eq!(
        first, again,
        "a duplicate gets the receipt of its first entry"
    );
    let stream = format!("{prefix}s");
    assert_eq!(xlen(&stream).await, 50);

    // A redelivery through a new sink (a restarted relay) after the scripts were flushed.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut client().await)
        .await
        .unwrap();
    let restarted = RedisSink::new(
        config(&url(), &prefix)
            .dedup(Duration::from_secs(60))
            .stream_template(template("s")),
    )
    .unwrap();
    let mut mixed = batch[..10].to_vec();
    mixed.push(message("t", "new", "fresh"));
    let receipts = receipts(&restarted.publish(&mixed).await.unwrap());
    assert_eq!(receipts[..10], first[..10]);
    assert_eq!(xlen(&stream).await, 51);

    // The records expire.
    let ttl: i64 = client()
        .await
        .pttl(format!("outbox:dedup:{}", batch[0].id))
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= 60_000, "ttl {ttl}");

    // Without de-duplication the same batch is appended twice.
    let plain = RedisSink::new(config(&url(), &prefix).stream_template(template("plain"))).unwrap();
    assert!(!plain.capabilities().deduplicates);
    plain.publish(&batch).await.unwrap();
    plain.publish(&batch).await.unwrap();
    assert_eq!(xlen(&format!("{prefix}plain")).await, 100);
    delete_prefixed(&prefix).await;
    let mut con = client().await;
    let keys: Vec<String> = batch
        .iter()
        .chain(&mixed)
        .map(|m| format!("outbox:dedup:{}", m.id))
        .collect();
    let _: () = con.del(keys).await.unwrap();
}

#[tokio::test]
async fn max_len_trims_the_stream() {
    let prefix = prefix().await;
    let sink = RedisSink::new(
        config(&url(), &prefix)
            .max_len(10)
            .stream_template(template("s")),
    )
    .unwrap();
    for round in 0..10 {
        let batch: Vec<Message> = (0..100)
            .map(|i| message("t", &format!("k{i}"), format!("{round}")))
            .collect();
        receipts(&sink.publish(&batch).await.unwrap());
    }
    let len = xlen(&format!("{prefix}s")).await;
    // `~` trims whole stream nodes (100 entries by default), so about, not exactly, 10.
    assert!(
        (10..=200).contains(&len),
        "1000 appended with MAXLEN ~ 10 left {len}"
    );
    delete_prefixed(&prefix).await;
}

#[tokio::test]
async fn unmapped_topic_and_oversize_payload_are_permanent() {
    let prefix = prefix().await;
    let mut config = config(&url(), &prefix).stream_map([("orders", "orders-stream")]);
    config.max_payload = 16;
    let sink = RedisSink::new(config).unwrap();
    assert_eq!(sink.capabilities().max_payload, Some(16));
    let batch = vec![
        message("orders", "k1", "small"),
        message("users", "k2", "small"),
        message("orders", "k3", vec![7u8; 17]),
        message("orders", "k4", vec![7u8; 16]),
    ];
    let outcomes = sink.publish(&batch).await.unwrap();
    assert_delivered_at(&outcomes, &[0, 3]);
    for (i, needle) in [
        (1, "topic `users` has no stream"),
        (2, "larger than sink.max_payload"),
    ] {
        let Outcome::Failed(error) = &outcomes[i] else {
            panic!("message {i} delivered")
        };
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert!(error.to_string().contains(needle), "{error}");
    }
    assert_eq!(xlen(&format!("{prefix}orders-stream")).await, 2);
    // A batch of nothing sendable makes no round trip and still answers for each message.
    let outcomes = sink.publish(&batch[1..3]).await.unwrap();
    assert_eq!(outcomes.len(), 2);
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Failed(e) if e.kind() == ErrorKind::Permanent))
    );
    delete_prefixed(&prefix).await;
}

/// A proxy in front of Redis that keeps what clients send, and a configuration through it.
async fn proxied(prefix: &str) -> (Proxy, RedisConfig) {
    let proxy = Proxy::recording(&Service::Redis.addr()).await;
    let config = config(&through(&url(), &proxy.addr()), prefix);
    (proxy, config)
}

/// A fresh prefix, and a sink to streams named by `stream` (deduplicating or not) through a
/// recording [`proxied`] connection.
async fn proxied_sink(stream: &str, dedup: bool) -> (String, Proxy, RedisSink) {
    let prefix = prefix().await;
    let (proxy, config) = proxied(&prefix).await;
    let config = deduplicating(config.stream_template(template(stream)), dedup);
    (prefix, proxy, RedisSink::new(config).unwrap())
}

/// What went through `proxy` so far, and the names of the commands Redis received.
fn seen(proxy: &Proxy) -> (Traffic, Vec<String>) {
    let sent = proxy.requests().iter().flat_map(|r| commands(r)).collect();
    (proxy.traffic(), sent)
}

#[tokio::test]
async fn one_pipelined_round_trip_per_batch() {
    let _ = client().await;
    for dedup in [false, true] {
        let (prefix, proxy, sink) = proxied_sink("s", dedup).await;
        sink.health().await.unwrap(); // connects; the connection is kept for publishing

        for size in [1usize, 10, 200] {
            let batch: Vec<Message> = (0..size)
                .map(|i| message("t", &format!("k{i}"), format!("payload {i}")))
                .collect();
            let (before, sent_before) = seen(&proxy);
            let expected: Vec<&str> = if dedup {
                std::iter::once("SCRIPT")
                    .chain(std::iter::repeat_n("EVALSHA", size))
                    .collect()
            } else {
                std::iter::repeat_n("XADD", size).collect()
            };
            // Hold Redis's replies back until every command has arrived: a sink that waited
            // for a reply before sending the next command would stall at its first.
            proxy.hold();
            let (outcomes, sent_held) = tokio::join!(sink.publish(&batch), async {
                let deadline = Instant::now() + Duration::from_secs(1);
                while seen(&proxy).1.len() < sent_before.len() + expected.len()
                    && Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let (_, held) = seen(&proxy);
                proxy.restore();
                held
            });
            receipts(&outcomes.unwrap());
            let (after, sent_after) = seen(&proxy);
            assert_eq!(
                sent_held[sent_before.len()..],
                expected,
                "commands Redis received before any reply, for {size} messages (dedup={dedup})"
            );
            assert_eq!(
                sent_after.len(),
                sent_held.len(),
                "nothing sent after the replies"
            );
            assert_eq!(
                after.turns - before.turns,
                1,
                "round trips for {size} messages (dedup={dedup})"
            );
        }
        assert_eq!(
            proxy.traffic().connections,
            1,
            "one connection, kept between batches"
        );
        assert_eq!(xlen(&format!("{prefix}s")).await, 211);
        delete_prefixed(&prefix).await;
    }
}

#[tokio::test]
async fn outage_is_unavailable_then_recovers() {
    let prefix = prefix().await;
    let (proxy, config) = proxied(&prefix).await;
    let sink = RedisSink::new(config).unwrap();
    sink.health().await.unwrap();
    receipts(&sink.publish(&[message("t", "k", "before")]).await.unwrap());

    // The kept connection closed while idle (a server `timeout`, a restart): the health
    // check gets a new one instead of calling the server down.
    proxy.drop_connections();
    sink.health().await.unwrap();
    receipts(
        &sink
            .publish(&[message("t", "k", "reconnected")])
            .await
            .unwrap(),
    );
    assert_eq!(proxy.traffic().connections, 2);

    proxy.cut();
    let error = sink
        .publish(&[message("t", "k", "during")])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let error = sink.health().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");

    proxy.restore();
    sink.health().await.unwrap();
    receipts(&sink.publish(&[message("t", "k", "after")]).await.unwrap());
    let payloads: Vec<Vec<u8>> = xrange(&format!("{prefix}t"))
        .await
        .into_iter()
        .map(|(_, f)| f[wire::PAYLOAD].clone())
        .collect();
    assert_eq!(payloads, [&b"before"[..], b"reconnected", b"after"]);
    delete_prefixed(&prefix).await;
}

#[tokio::test]
async fn a_silent_server_times_out_as_unavailable() {
    let prefix = prefix().await;
    let (proxy, config) = proxied(&prefix).await;
    let config = config.publish_timeout(Duration::from_millis(300));
    let sink = RedisSink::new(config).unwrap();
    sink.health().await.unwrap();

    // Established connection, no answers.
    proxy.hold();
    let started = Instant::now();
    let error = sink.publish(&[message("t", "k", "x")]).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(
        error.to_string().contains("within sink.publish_timeout"),
        "{error}"
    );
    // New connections reach the server, their replies never come back (the timed-out one
    // was closed).
    let error = sink.health().await.unwrap_err();
    assert_unavailable_within(&error, started.elapsed(), Duration::from_secs(3));

    proxy.restore();
    sink.health().await.unwrap();
    receipts(&sink.publish(&[message("t", "k", "y")]).await.unwrap());
    delete_prefixed(&prefix).await;
}

#[tokio::test]
async fn unreachable_or_misconfigured_servers_are_unavailable() {
    let _ = client().await;
    // Nothing listens on port 1.
    let sink = RedisSink::new(RedisConfig::new("redis://127.0.0.1:1")).unwrap();
    let error = sink.health().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let error = sink.publish(&[message("t", "k", "x")]).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");

    // TLS against the plain port: the handshake fails, and nothing panics.
    let tls = url().replacen("redis://", "rediss://", 1);
    let sink =
        RedisSink::new(RedisConfig::new(tls).publish_timeout(Duration::from_secs(2))).unwrap();
    let error = sink.health().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");

    // A wrong password: the error says where to look and does not print it.
    let (scheme, rest) = url()
        .split_once("://")
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .unwrap();
    let host = rest.rsplit('@').next().unwrap().to_string();
    let sink = RedisSink::new(RedisConfig::new(format!(
        "{scheme}://:not-the-password@{host}"
    )))
    .unwrap();
    let error = sink.health().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let text = format!("{error} {:?}", std::error::Error::source(&error));
    assert!(!text.contains("not-the-password"), "{text}");
}

#[tokio::test]
async fn bad_config_is_refused_at_start_up() {
    for (config, needle) in [
        (
            RedisConfig::new("127.0.0.1:6379"),
            "sink.url `127.0.0.1:6379`",
        ),
        (
            RedisConfig::new(url()).stream_template(template("")),
            "sink.stream_template is empty",
        ),
        (RedisConfig::new(url()).max_len(0), "sink.max_len is 0"),
    ] {
        let error = RedisSink::new(config).unwrap_err().in_section("sink");
        assert_eq!(error.kind(), ErrorKind::Config);
        assert!(error.to_string().contains(needle), "{error}");
    }
}

/// The message ids in stream `stream`, in stream order.
async fn ids_in(stream: &str) -> Vec<String> {
    xrange(stream)
        .await
        .iter()
        .map(|(_, fields)| text(fields, wire::ID))
        .collect()
}

#[tokio::test]
async fn several_messages_of_a_key_in_one_call_land_in_order_in_one_round_trip() {
    let _ = client().await;
    for dedup in [false, true] {
        let (prefix, proxy, sink) = proxied_sink("events:{topic}", dedup).await;
        assert!(sink.capabilities().ordered_key_runs);
        sink.health().await.unwrap();
        // 5 keys × 4 messages, interleaved as a claim gives them, a key's messages spread
        // over two streams, plus messages without a key.
        let mut batch: Vec<Message> = Vec::new();
        for seq in 0..4 {
            for k in 0..5 {
                let topic = if (seq + k) % 2 == 0 { "a" } else { "b" };
                batch.push(message(topic, &format!("k{k}"), format!("{k}/{seq}")));
            }
            batch.push(NewMessage::new("a", format!("no key {seq}")).into());
        }
        let (before, sent_before) = seen(&proxy);
        let first = receipts(&sink.publish(&batch).await.unwrap());
        let (after, sent_after) = seen(&proxy);
        assert_eq!(
            after.turns - before.turns,
            1,
            "one round trip (dedup={dedup})"
        );
        let evals = sent_after[sent_before.len()..]
            .iter()
            .filter(|c| *c == "EVALSHA")
            .count();
        // One script per key run; the messages without a key go alone.
        assert_eq!(evals, if dedup { 5 + 4 } else { 5 }, "dedup={dedup}");
        for topic in ["a", "b"] {
            let expected: Vec<String> = (batch.iter())
                .filter(|m| m.topic == topic)
                .map(|m| m.id.to_string())
                .collect();
            let got = ids_in(&format!("{prefix}events:{topic}")).await;
            for k in 0..5 {
                let key = format!("k{k}");
                let of_key = |ids: &[String]| -> Vec<String> {
                    (ids.iter())
                        .filter(|id| {
                            batch.iter().any(|m| {
                                m.id.to_string() == **id && m.key.as_deref() == Some(key.as_str())
                            })
                        })
                        .cloned()
                        .collect()
                };
                assert_eq!(
                    of_key(&got),
                    of_key(&expected),
                    "key {key} in stream {topic}"
                );
            }
            assert_eq!(got.len(), expected.len());
        }
        // Receipts are the entries' ids.
        let mut entries = xrange(&format!("{prefix}events:a")).await;
        entries.extend(xrange(&format!("{prefix}events:b")).await);
        for (message, receipt) in batch.iter().zip(&first) {
            let (entry_id, _) = (entries.iter())
                .find(|(_, f)| text(f, wire::ID) == message.id.to_string())
                .unwrap();
            assert_eq!(entry_id, receipt);
        }
        if dedup {
            // Published again: nothing new, the same receipts.
            assert_eq!(receipts(&sink.publish(&batch).await.unwrap()), first);
            let in_a = batch.iter().filter(|m| m.topic == "a").count();
            assert_eq!(xlen(&format!("{prefix}events:a")).await, in_a);
        }
        delete_prefixed(&prefix).await;
    }
}

#[tokio::test]
async fn a_failure_in_the_middle_of_a_key_run_stops_that_key_only() {
    for dedup in [false, true] {
        let (prefix, sink, broken) = sink_with_a_broken_stream(dedup).await;
        // Key k: two good, one to the broken stream, two good again; key o around it.
        let batch = good_but_one(
            &[
                ("k", "k1"),
                ("o", "o1"),
                ("k", "k2"),
                ("k", "k3"),
                ("o", "o2"),
                ("k", "k4"),
                ("k", "k5"),
                ("o", "o3"),
            ],
            3,
        );
        let outcomes = sink.publish(&batch).await.unwrap();
        assert_eq!(outcomes.len(), batch.len());
        assert_delivered_at(&outcomes, &[0, 1, 2, 4, 7]);
        assert_wrongtype(&outcomes[3], &broken);
        for i in [5, 6] {
            let Outcome::Failed(error) = &outcomes[i] else {
                panic!("message {i} after the failure was delivered")
            };
            assert!(
                error.to_string().contains("an earlier message of key `k`"),
                "{error}"
            );
        }
        // Each key's messages in order (a key's run lands where its first message is).
        let got = ids_in(&format!("{prefix}good")).await;
        for (key, delivered) in [("k", &[0, 2][..]), ("o", &[1, 4, 7][..])] {
            let of_key: Vec<String> = (got.iter())
                .filter(|id| {
                    batch
                        .iter()
                        .any(|m| m.id.to_string() == **id && m.key.as_deref() == Some(key))
                })
                .cloned()
                .collect();
            let expected: Vec<String> =
                delivered.iter().map(|&i| batch[i].id.to_string()).collect();
            assert_eq!(of_key, expected, "key {key} (dedup={dedup})");
        }
        assert_eq!(
            got.len(),
            5,
            "nothing of k after its failure (dedup={dedup})"
        );
        if dedup {
            // The messages not appended left no de-duplication record: once the stream is
            // fixed, k's rest goes out.
            fix_stream(&broken).await;
            receipts(&sink.publish(&batch[3..7]).await.unwrap());
            assert_eq!(xlen(&format!("{prefix}good")).await, 7);
            assert_eq!(xlen(&broken).await, 1);
        }
        delete_prefixed(&prefix).await;
    }
}

#[tokio::test]
async fn a_message_refused_before_sending_stops_its_key_run() {
    let prefix = prefix().await;
    let mut config = config(&url(), &prefix);
    config.max_payload = 16;
    let sink = RedisSink::new(config).unwrap();
    let batch = vec![
        message("t", "k", "k1"),
        message("t", "k", vec![7u8; 17]),
        message("t", "o", "o1"),
        message("t", "k", "k3"),
    ];
    let outcomes = sink.publish(&batch).await.unwrap();
    assert_delivered_at(&outcomes, &[0, 2]);
    assert!(
        matches!(&outcomes[1], Outcome::Failed(e) if e.kind() == ErrorKind::Permanent),
        "{:?}",
        outcomes[1]
    );
    assert!(
        matches!(outcomes[3], Outcome::Failed(_)),
        "{:?}",
        outcomes[3]
    );
    let expected = vec![batch[0].id.to_string(), batch[2].id.to_string()];
    assert_eq!(ids_in(&format!("{prefix}t")).await, expected);
    delete_prefixed(&prefix).await;
}
