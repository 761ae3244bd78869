//! The sink alone against the real Redis (`$OUTBOX_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`). Each test writes under its own stream prefix.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink, Template, TraceContext};
use outbox_redis::redis::{self, AsyncCommands, Value};
use outbox_redis::{RedisConfig, RedisSink, wire};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

fn redis_url() -> String {
    std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A plain connection for the test's own checks; panics loudly when Redis is not there.
async fn client() -> redis::aio::MultiplexedConnection {
    let url = redis_url();
    let connect = async {
        redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection_with_config(
                &redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(Duration::from_secs(30))),
            )
            .await
    };
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(e)) => panic!(
            "Redis is not reachable at {url}: {e}; start redis-server (or set OUTBOX_TEST_REDIS_URL)"
        ),
        Err(_) => panic!(
            "Redis at {url} did not answer within 5 s; start redis-server (or set OUTBOX_TEST_REDIS_URL)"
        ),
    }
}

/// A stream prefix of the test's own; checks first that Redis is there.
async fn prefix() -> String {
    let _ = client().await;
    format!("outbox_test:{}:", uuid::Uuid::now_v7().simple())
}

fn config(url: &str, prefix: &str) -> RedisConfig {
    RedisConfig::new(url)
        .stream_prefix(prefix)
        .publish_timeout(Duration::from_secs(2))
}

fn template(text: &str) -> Template {
    Template::new(text).expect("a valid template")
}

fn message(topic: &str, key: &str, payload: impl Into<Vec<u8>>) -> Message {
    NewMessage::new(topic, payload).key(key).into()
}

/// One stream entry: (entry id, fields).
type Entry = (String, BTreeMap<String, Vec<u8>>);

async fn xrange(stream: &str) -> Vec<Entry> {
    let reply: Value = client().await.xrange_all(stream).await.expect("XRANGE");
    let Value::Array(entries) = reply else {
        panic!("XRANGE reply {reply:?}")
    };
    entries
        .into_iter()
        .map(|entry| {
            let Value::Array(mut parts) = entry else {
                panic!("entry {entry:?}")
            };
            let (Some(Value::Array(flat)), Some(id)) = (parts.pop(), parts.pop()) else {
                panic!("entry parts")
            };
            let id: String = redis::from_redis_value(id).expect("entry id");
            let mut map = BTreeMap::new();
            for pair in flat.chunks(2) {
                let name: String = redis::from_redis_value(pair[0].clone()).expect("field name");
                let value: Vec<u8> = redis::from_redis_value(pair[1].clone()).expect("field value");
                map.insert(name, value);
            }
            (id, map)
        })
        .collect()
}

async fn xlen(stream: &str) -> usize {
    client().await.xlen(stream).await.expect("XLEN")
}

async fn cleanup(prefix: &str) {
    let mut con = client().await;
    let keys: Vec<String> = con.keys(format!("{prefix}*")).await.expect("KEYS");
    if !keys.is_empty() {
        let _: () = con.del(keys).await.expect("DEL");
    }
}

fn delivered(outcomes: &[Outcome]) -> Vec<String> {
    outcomes
        .iter()
        .map(|o| match o {
            Outcome::Delivered(receipt) => receipt.0.clone(),
            Outcome::Failed(error) => panic!("expected delivery, got {error}"),
        })
        .collect()
}

fn text(fields: &BTreeMap<String, Vec<u8>>, name: &str) -> String {
    String::from_utf8(
        fields
            .get(name)
            .unwrap_or_else(|| panic!("no field {name}"))
            .clone(),
    )
    .expect("utf-8 field")
}

#[tokio::test]
async fn entries_hold_the_exact_message() {
    let prefix = prefix().await;
    let sink = RedisSink::new(config(&redis_url(), &prefix)).unwrap();
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
    let receipts = delivered(&sink.publish(&batch).await.unwrap());

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
    cleanup(&prefix).await;
}

#[tokio::test]
async fn keys_keep_their_order_within_a_stream() {
    let prefix = prefix().await;
    let sink =
        RedisSink::new(config(&redis_url(), &prefix).stream_template(template("events:{topic}")))
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
        delivered(&sink.publish(&batch).await.unwrap());
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
    cleanup(&prefix).await;
}

#[tokio::test]
async fn wrongtype_dead_letters_only_that_message() {
    for dedup in [false, true] {
        let prefix = prefix().await;
        let mut config = config(&redis_url(), &prefix);
        if dedup {
            config = config.dedup(Duration::from_secs(60));
        }
        let sink = RedisSink::new(config).unwrap();
        let mut con = client().await;
        let _: () = con
            .set(format!("{prefix}broken"), "not a stream")
            .await
            .unwrap();

        let batch = vec![
            message("good", "k1", "1"),
            message("broken", "k2", "2"),
            message("good", "k3", "3"),
        ];
        let outcomes = sink.publish(&batch).await.unwrap();
        assert_eq!(outcomes.len(), 3);
        assert!(
            matches!(outcomes[0], Outcome::Delivered(_)),
            "{:?}",
            outcomes[0]
        );
        assert!(
            matches!(outcomes[2], Outcome::Delivered(_)),
            "{:?}",
            outcomes[2]
        );
        let Outcome::Failed(error) = &outcomes[1] else {
            panic!("WRONGTYPE delivered?")
        };
        assert_eq!(error.kind(), ErrorKind::Permanent, "{error}");
        assert!(error.to_string().contains("WRONGTYPE"), "{error}");
        assert!(
            error.to_string().contains(&format!("{prefix}broken")),
            "names the stream: {error}"
        );
        assert_eq!(xlen(&format!("{prefix}good")).await, 2);

        // Once the key is fixed the same message goes out: the failure left no de-duplication
        // record behind.
        let _: () = con.del(format!("{prefix}broken")).await.unwrap();
        delivered(&sink.publish(&batch[1..2]).await.unwrap());
        assert_eq!(xlen(&format!("{prefix}broken")).await, 1, "dedup={dedup}");
        cleanup(&prefix).await;
    }
}

#[tokio::test]
async fn dedup_appends_a_batch_published_twice_once() {
    let prefix = prefix().await;
    let sink = RedisSink::new(
        config(&redis_url(), &prefix)
            .dedup(Duration::from_secs(60))
            .stream_template(template("s")),
    )
    .unwrap();
    assert!(sink.capabilities().deduplicates);
    let batch: Vec<Message> = (0..50)
        .map(|i| message("t", &format!("k{i}"), vec![i as u8; 3]))
        .collect();
    let first = delivered(&sink.publish(&batch).await.unwrap());
    let again = delivered(&sink.publish(&batch).await.unwrap());
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
        config(&redis_url(), &prefix)
            .dedup(Duration::from_secs(60))
            .stream_template(template("s")),
    )
    .unwrap();
    let mut mixed = batch[..10].to_vec();
    mixed.push(message("t", "new", "fresh"));
    let receipts = delivered(&restarted.publish(&mixed).await.unwrap());
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
    let plain =
        RedisSink::new(config(&redis_url(), &prefix).stream_template(template("plain"))).unwrap();
    assert!(!plain.capabilities().deduplicates);
    plain.publish(&batch).await.unwrap();
    plain.publish(&batch).await.unwrap();
    assert_eq!(xlen(&format!("{prefix}plain")).await, 100);
    cleanup(&prefix).await;
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
        config(&redis_url(), &prefix)
            .max_len(10)
            .stream_template(template("s")),
    )
    .unwrap();
    for round in 0..10 {
        let batch: Vec<Message> = (0..100)
            .map(|i| message("t", &format!("k{i}"), format!("{round}")))
            .collect();
        delivered(&sink.publish(&batch).await.unwrap());
    }
    let len = xlen(&format!("{prefix}s")).await;
    // `~` trims whole stream nodes (100 entries by default), so about, not exactly, 10.
    assert!(
        (10..=200).contains(&len),
        "1000 appended with MAXLEN ~ 10 left {len}"
    );
    cleanup(&prefix).await;
}

#[tokio::test]
async fn unmapped_topic_and_oversize_payload_are_permanent() {
    let prefix = prefix().await;
    let mut config = config(&redis_url(), &prefix).stream_map([("orders", "orders-stream")]);
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
    assert!(matches!(outcomes[0], Outcome::Delivered(_)));
    assert!(matches!(outcomes[3], Outcome::Delivered(_)));
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
    cleanup(&prefix).await;
}

#[tokio::test]
async fn one_pipelined_round_trip_per_batch() {
    let _ = client().await;
    for dedup in [false, true] {
        let prefix = prefix().await;
        let proxy = Proxy::start(&redis_addr()).await;
        let mut config =
            config(&format!("redis://{}", proxy.addr), &prefix).stream_template(template("s"));
        if dedup {
            config = config.dedup(Duration::from_secs(60));
        }
        let sink = RedisSink::new(config).unwrap();
        sink.health().await.unwrap(); // connects; the connection is kept for publishing

        for size in [1usize, 10, 200] {
            let batch: Vec<Message> = (0..size)
                .map(|i| message("t", &format!("k{i}"), format!("payload {i}")))
                .collect();
            let before = proxy.snapshot();
            let expected: Vec<&str> = if dedup {
                std::iter::once("SCRIPT")
                    .chain(std::iter::repeat_n("EVALSHA", size))
                    .collect()
            } else {
                std::iter::repeat_n("XADD", size).collect()
            };
            // Hold Redis's replies back until every command has arrived: a sink that waited
            // for a reply before sending the next command would stall at its first.
            proxy.set_mode(Mode::Hold);
            let (outcomes, held) = tokio::join!(sink.publish(&batch), async {
                let deadline = Instant::now() + Duration::from_secs(1);
                while proxy.snapshot().commands.len() < before.commands.len() + expected.len()
                    && Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let held = proxy.snapshot();
                proxy.set_mode(Mode::Pass);
                held
            });
            delivered(&outcomes.unwrap());
            let after = proxy.snapshot();
            let commands = &held.commands[before.commands.len()..];
            assert_eq!(
                commands, expected,
                "commands Redis received before any reply, for {size} messages (dedup={dedup})"
            );
            assert_eq!(
                after.commands.len(),
                held.commands.len(),
                "nothing sent after the replies"
            );
            assert_eq!(
                after.turns - before.turns,
                1,
                "round trips for {size} messages (dedup={dedup})"
            );
        }
        assert_eq!(
            proxy.snapshot().connections,
            1,
            "one connection, kept between batches"
        );
        assert_eq!(xlen(&format!("{prefix}s")).await, 211);
        cleanup(&prefix).await;
    }
}

#[tokio::test]
async fn outage_is_unavailable_then_recovers() {
    let prefix = prefix().await;
    let proxy = Proxy::start(&redis_addr()).await;
    let sink = RedisSink::new(config(&format!("redis://{}", proxy.addr), &prefix)).unwrap();
    sink.health().await.unwrap();
    delivered(&sink.publish(&[message("t", "k", "before")]).await.unwrap());

    // The kept connection closed while idle (a server `timeout`, a restart): the health
    // check gets a new one instead of calling the server down.
    proxy.drop_connections();
    sink.health().await.unwrap();
    delivered(
        &sink
            .publish(&[message("t", "k", "reconnected")])
            .await
            .unwrap(),
    );
    assert_eq!(proxy.snapshot().connections, 2);

    proxy.set_mode(Mode::Cut);
    let error = sink
        .publish(&[message("t", "k", "during")])
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let error = sink.health().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");

    proxy.set_mode(Mode::Pass);
    sink.health().await.unwrap();
    delivered(&sink.publish(&[message("t", "k", "after")]).await.unwrap());
    let payloads: Vec<Vec<u8>> = xrange(&format!("{prefix}t"))
        .await
        .into_iter()
        .map(|(_, f)| f[wire::PAYLOAD].clone())
        .collect();
    assert_eq!(payloads, [&b"before"[..], b"reconnected", b"after"]);
    cleanup(&prefix).await;
}

#[tokio::test]
async fn a_silent_server_times_out_as_unavailable() {
    let prefix = prefix().await;
    let proxy = Proxy::start(&redis_addr()).await;
    let config = config(&format!("redis://{}", proxy.addr), &prefix)
        .publish_timeout(Duration::from_millis(300));
    let sink = RedisSink::new(config).unwrap();
    sink.health().await.unwrap();

    // Established connection, no answers.
    proxy.set_mode(Mode::Hold);
    let started = Instant::now();
    let error = sink.publish(&[message("t", "k", "x")]).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(
        error.to_string().contains("within sink.publish_timeout"),
        "{error}"
    );
    // New connections accepted, never answered (the timed-out one was closed).
    let error = sink.health().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );

    proxy.set_mode(Mode::Pass);
    sink.health().await.unwrap();
    delivered(&sink.publish(&[message("t", "k", "y")]).await.unwrap());
    cleanup(&prefix).await;
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
    let tls = redis_url().replacen("redis://", "rediss://", 1);
    let sink =
        RedisSink::new(RedisConfig::new(tls).publish_timeout(Duration::from_secs(2))).unwrap();
    let error = sink.health().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");

    // A wrong password: the error says where to look and does not print it.
    let (scheme, rest) = redis_url()
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
            RedisConfig::new(redis_url()).stream_template(template("")),
            "sink.stream_template is empty",
        ),
        (
            RedisConfig::new(redis_url()).max_len(0),
            "sink.max_len is 0",
        ),
    ] {
        let error = RedisSink::new(config).unwrap_err().in_section("sink");
        assert_eq!(error.kind(), ErrorKind::Config);
        assert!(error.to_string().contains(needle), "{error}");
    }
}

// --- a TCP proxy that counts what the sink sends, and can cut or stall the link ---

fn redis_addr() -> String {
    let url = redis_url();
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(&url);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority
        .rsplit('@')
        .next()
        .unwrap_or(authority)
        .to_string()
}

#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Mode {
    Pass = 0,
    /// Drop live connections and refuse new ones.
    Cut = 1,
    /// Hold the server's replies back; accept new connections and never answer them.
    Hold = 2,
}

#[derive(Default)]
struct Counts {
    /// Names of the commands received, in order.
    commands: Vec<String>,
    /// Round trips: client data that follows a server reply (or opens a connection).
    turns: usize,
    connections: usize,
}

struct Snapshot {
    commands: Vec<String>,
    turns: usize,
    connections: usize,
}

struct Proxy {
    addr: String,
    mode: Arc<AtomicU8>,
    counts: Arc<Mutex<Counts>>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let mode = Arc::new(AtomicU8::new(Mode::Pass as u8));
        let counts = Arc::new(Mutex::new(Counts::default()));
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (target, m, c, t) = (
            target.to_string(),
            mode.clone(),
            counts.clone(),
            tasks.clone(),
        );
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                match m.load(Ordering::SeqCst) {
                    1 => drop(client),
                    2 => t.lock().unwrap().push(tokio::spawn(swallow(client))),
                    _ => {
                        let server = TcpStream::connect(&target)
                            .await
                            .expect("proxy cannot reach Redis");
                        c.lock().unwrap().connections += 1;
                        t.lock().unwrap().push(tokio::spawn(relay(
                            client,
                            server,
                            m.clone(),
                            c.clone(),
                        )));
                    }
                }
            }
        });
        Proxy {
            addr,
            mode,
            counts,
            tasks,
        }
    }

    fn set_mode(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
        if mode == Mode::Cut {
            self.drop_connections();
        }
    }

    /// Closes the live connections.
    fn drop_connections(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    fn snapshot(&self) -> Snapshot {
        let counts = self.counts.lock().unwrap();
        Snapshot {
            commands: counts.commands.clone(),
            turns: counts.turns,
            connections: counts.connections,
        }
    }
}

async fn swallow(mut client: TcpStream) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = client.read(&mut buf).await {
        if n == 0 {
            return;
        }
    }
}

/// Forwards both ways. In hold mode the server's replies are held back.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    mode: Arc<AtomicU8>,
    counts: Arc<Mutex<Counts>>,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let server_spoke = Arc::new(AtomicBool::new(true));
    let spoke = server_spoke.clone();
    let upstream = async {
        let mut parser = RespParser::default();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            {
                let mut counts = counts.lock().unwrap();
                if spoke.swap(false, Ordering::SeqCst) {
                    counts.turns += 1;
                }
                counts.commands.extend(parser.feed(&buf[..n]));
            }
            if server_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while mode.load(Ordering::SeqCst) == Mode::Hold as u8 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            server_spoke.store(true, Ordering::SeqCst);
            if client_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}

/// Splits the client's byte stream into RESP commands and yields their names.
#[derive(Default)]
struct RespParser {
    buf: Vec<u8>,
}

impl RespParser {
    fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut names = Vec::new();
        while let Some((name, used)) = parse_command(&self.buf) {
            names.push(name);
            self.buf.drain(..used);
        }
        names
    }
}

/// One complete `*N\r\n$len\r\n...` command at the start of `buf`: its name and length.
fn parse_command(buf: &[u8]) -> Option<(String, usize)> {
    fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let end = buf[at..].windows(2).position(|w| w == b"\r\n")? + at;
        Some((&buf[at..end], end + 2))
    }
    let (head, mut at) = line(buf, 0)?;
    assert_eq!(
        head.first(),
        Some(&b'*'),
        "client sent something other than a RESP array"
    );
    let count: usize = std::str::from_utf8(&head[1..]).ok()?.parse().ok()?;
    let mut name = None;
    for _ in 0..count {
        let (len_line, next) = line(buf, at)?;
        let len: usize = std::str::from_utf8(&len_line[1..]).ok()?.parse().ok()?;
        if buf.len() < next + len + 2 {
            return None;
        }
        name.get_or_insert_with(|| String::from_utf8_lossy(&buf[next..next + len]).to_uppercase());
        at = next + len + 2;
    }
    Some((name.unwrap_or_default(), at))
}
