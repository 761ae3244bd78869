//! Claims of the backend and operator docs (docs/storage/{postgres,mysql}.md,
//! docs/sinks/{redis,amqp,kafka}.md, docs/configuration.md, …) that no other test held the
//! code to, each as a test that fails if the claim is false. The audit behind them is in the
//! session notes (claims-audit-2).
//!
//! `secrets`: "Passwords in URLs never appear in errors or `Debug` output" for every backend
//! that takes a URL, with passwords as people write them (raw `#`, `/`, `?`, `@`) and as query
//! parameters; no server is needed (closed ports). These four FAIL against the code as it is:
//! `outbox_core::redact_url` cuts the authority at the first `/`, `?` or `#` before looking for
//! the `@`, so a raw password holding one of them is printed; each failure lists every leak.
//! `keys`: MySQL's "keys compare byte for byte, so no collation folds `A` into `a` or drops
//! trailing spaces", on MariaDB, PostgreSQL and SQLite.
//! `mysql_open_transaction`: "a claim never waits for an open application transaction", nor
//! do settlements, on MariaDB.
//! `amqp_reserved_exchanges`: "`amq.*` exchanges are only ever checked", even under `declare`.
//! `log_mode_horizon`: rows held back only by a transaction that never writes the outbox go
//! out at the next poll.
//! `bad_input`: bad data is a `Permanent` error that writes nothing, never a panic.
//! `mysql_migrations`: concurrent migrators run each migration once.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{
    DeadLetter, Delivery, Message, NewMessage, Receipt, Retry, Storage, StorageAdmin,
};
use outbox_tests::unique_name;

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

fn payloads(messages: &[Message]) -> Vec<String> {
    messages.iter().map(|m| text(&m.payload)).collect()
}

use outbox_tests::mysql_url;

/// MariaDB tables of their own (`t_<random>`), migrated, dropped with the value.
struct MySqlTables(Arc<outbox_mysql::MySqlStorage>);

impl MySqlTables {
    async fn new() -> MySqlTables {
        use outbox_mysql::{MySqlConfig, MySqlStorage};
        let config = MySqlConfig::new(mysql_url()).table(unique_name("t"));
        let storage = MySqlStorage::new(config).expect("valid test configuration");
        storage.migrate().await.unwrap_or_else(|e| {
            panic!(
                "MariaDB must be running at {} (`cargo xtask services`): {e}",
                mysql_url()
            )
        });
        MySqlTables(Arc::new(storage))
    }
}

impl Drop for MySqlTables {
    fn drop(&mut self) {
        outbox_tests::drop_mysql_tables(self.0.table());
    }
}

/// Tests `mysql`, `postgres` and `sqlite` that run `check` (an async fn taking a
/// `&dyn StorageAdmin`) against a fresh, migrated outbox of each SQL storage.
macro_rules! on_every_sql_storage {
    ($check:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn mysql() {
            let t = MySqlTables::new().await;
            $check(&*t.0).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn postgres() {
            let outbox = outbox_tests::TestOutbox::new().await;
            $check(&*outbox.storage).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn sqlite() {
            use outbox_sqlite::{SqliteConfig, SqliteStorage};
            let dir = outbox_tests::TempDir::new("outbox-claims");
            let storage = SqliteStorage::open(SqliteConfig::new(dir.file("app.db")))
                .await
                .expect("opening the file");
            storage.migrate().await.expect("migrating");
            $check(&storage).await;
            // The storage closes its file before the directory goes.
            drop(storage);
        }
    };
}

mod secrets {
    use super::*;
    use outbox_core::{Sink, Template};

    /// The secret every URL below carries; it must never be printed.
    const SECRET: &str = "Zq8uSecretPw";

    /// Passwords as they end up in URLs: plain, and raw with a character that ends a URL's
    /// authority (`#`, `/`, `?`) or is its own delimiter (`@`), as people paste them.
    fn passwords() -> Vec<String> {
        ["", "x#", "x/", "x?", "x@"]
            .iter()
            .map(|prefix| format!("{prefix}{SECRET}"))
            .collect()
    }

    /// Notes where the secret showed, if it did.
    fn assert_hidden(leaks: &mut Vec<String>, url: &str, what: &str, printed: &str) {
        if printed.contains(SECRET) {
            leaks.push(format!("{url}\n    {what}: {printed}"));
        }
    }

    /// Fails listing every leak found.
    fn report(leaks: Vec<String>, backend: &str) {
        assert!(
            leaks.is_empty(),
            "{backend}: the password showed in {} place(s):\n{}",
            leaks.len(),
            leaks.join("\n")
        );
    }

    /// At most this long for a call against a closed port ("never blocks forever").
    const CALL: Duration = Duration::from_secs(30);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_passwords_never_appear_in_errors_or_debug() {
        use outbox_postgres::{PgStorage, PostgresConfig};
        let mut urls: Vec<String> = passwords()
            .iter()
            .map(|p| format!("postgres://app:{p}@127.0.0.1:1/test"))
            .collect();
        urls.push(format!("postgres://app@127.0.0.1:1/test?password={SECRET}"));
        urls.push(format!(
            "postgres://app@127.0.0.1:1/test?sslmode=disable&password={SECRET}"
        ));
        let mut leaks = Vec::new();
        for url in &urls {
            let config = PostgresConfig::new(url).table(unique_name("t"), "outbox");
            assert_hidden(
                &mut leaks,
                url,
                "Debug of the config",
                &format!("{config:?}"),
            );
            let error = match PgStorage::new(config) {
                Err(e) => e,
                Ok(storage) => match tokio::time::timeout(CALL, storage.health()).await {
                    Err(_) => panic!("{url}: health did not return within {CALL:?}"),
                    Ok(Ok(())) => panic!("{url}: a closed port answered"),
                    Ok(Err(e)) => e,
                },
            };
            assert_hidden(&mut leaks, url, "the error", &error.to_string());
            assert_hidden(&mut leaks, url, "Debug of the error", &format!("{error:?}"));
        }
        report(leaks, "PostgreSQL");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_passwords_never_appear_in_errors_or_debug() {
        use outbox_mysql::{MySqlConfig, MySqlStorage};
        let urls: Vec<String> = passwords()
            .iter()
            .map(|p| format!("mysql://root:{p}@127.0.0.1:1/test"))
            .collect();
        // docs/storage/mysql.md: "`MySqlStorage::new` only validates and connects lazily".
        MySqlStorage::new(MySqlConfig::new(&urls[0]))
            .expect("a valid URL of a closed port is accepted: connecting is lazy");
        let mut leaks = Vec::new();
        for url in &urls {
            let config = MySqlConfig::new(url).table(unique_name("t"));
            assert_hidden(
                &mut leaks,
                url,
                "Debug of the config",
                &format!("{config:?}"),
            );
            let error = match MySqlStorage::new(config) {
                Err(e) => e,
                Ok(storage) => match tokio::time::timeout(CALL, storage.health()).await {
                    Err(_) => panic!("{url}: health did not return within {CALL:?}"),
                    Ok(Ok(())) => panic!("{url}: a closed port answered"),
                    Ok(Err(e)) => e,
                },
            };
            assert_hidden(&mut leaks, url, "the error", &error.to_string());
            assert_hidden(&mut leaks, url, "Debug of the error", &format!("{error:?}"));
        }
        report(leaks, "MySQL");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_passwords_never_appear_in_errors_or_debug() {
        use outbox_redis::{RedisConfig, RedisSink};
        let urls: Vec<String> = passwords()
            .iter()
            .flat_map(|p| {
                [
                    format!("redis://:{p}@127.0.0.1:1"),
                    format!("redis://user:{p}@127.0.0.1:1/0"),
                ]
            })
            .collect();
        let mut leaks = Vec::new();
        let batch: Vec<Message> = vec![NewMessage::new("t", "m").key("k").into()];
        for url in &urls {
            let config = RedisConfig::new(url).publish_timeout(Duration::from_secs(2));
            assert_hidden(
                &mut leaks,
                url,
                "Debug of the config",
                &format!("{config:?}"),
            );
            match RedisSink::new(config) {
                Err(e) => {
                    assert_hidden(&mut leaks, url, "the error", &e.to_string());
                    assert_hidden(&mut leaks, url, "Debug of the error", &format!("{e:?}"));
                }
                Ok(sink) => {
                    let health = tokio::time::timeout(CALL, sink.health())
                        .await
                        .unwrap_or_else(|_| panic!("{url}: health did not return"));
                    let e = health.expect_err("a closed port answered");
                    assert_hidden(&mut leaks, url, "the health error", &e.to_string());
                    let published = tokio::time::timeout(CALL, sink.publish(&batch))
                        .await
                        .unwrap_or_else(|_| panic!("{url}: publish did not return"));
                    assert_hidden(
                        &mut leaks,
                        url,
                        "the publish result",
                        &format!("{published:?}"),
                    );
                }
            }
        }
        report(leaks, "Redis");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn amqp_passwords_never_appear_in_errors_or_debug() {
        use outbox_amqp::{AmqpConfig, AmqpSink};
        let urls: Vec<String> = passwords()
            .iter()
            .map(|p| format!("amqp://guest:{p}@127.0.0.1:1/%2f"))
            .collect();
        let mut leaks = Vec::new();
        for url in &urls {
            let exchange = Template::new("events").expect("a template");
            let config = AmqpConfig::new(url, exchange).publish_timeout(Duration::from_secs(2));
            assert_hidden(
                &mut leaks,
                url,
                "Debug of the config",
                &format!("{config:?}"),
            );
            let error = match AmqpSink::lazy(config) {
                Err(e) => e,
                Ok(sink) => match tokio::time::timeout(CALL, sink.health()).await {
                    Err(_) => panic!("{url}: health did not return within {CALL:?}"),
                    Ok(Ok(())) => panic!("{url}: a closed port answered"),
                    Ok(Err(e)) => e,
                },
            };
            assert_hidden(&mut leaks, url, "the error", &error.to_string());
            assert_hidden(&mut leaks, url, "Debug of the error", &format!("{error:?}"));
        }
        report(leaks, "AMQP");
    }
}

/// docs/storage/mysql.md: "keys are `VARBINARY(255)`: compared byte for byte, so no collation
/// folds `A` into `a` or drops trailing spaces (which would merge two keys' orders)". The same
/// must hold on PostgreSQL and SQLite: keys that differ in case, a trailing space or Unicode
/// normalisation are different keys, for holding back, parking and releasing.
mod keys {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);
    const KEYS: [&str; 5] = ["A", "a", "a ", "\u{e9}", "e\u{301}"];

    async fn keys_that_differ_in_any_byte_are_different_keys(s: &dyn StorageAdmin) {
        let firsts: Vec<NewMessage> = KEYS
            .iter()
            .enumerate()
            .map(|(i, k)| NewMessage::new("t", format!("{i}-1")).key(*k))
            .collect();
        let seconds: Vec<NewMessage> = KEYS
            .iter()
            .enumerate()
            .map(|(i, k)| NewMessage::new("t", format!("{i}-2")).key(*k))
            .collect();
        s.enqueue(&firsts).await.expect("enqueue");
        s.enqueue(&seconds).await.expect("enqueue");

        // One message per claim, nothing settled: each claim holds its key, so the next
        // finds a key of its own only if the keys are told apart.
        let mut held = Vec::new();
        for _ in 0..KEYS.len() {
            let c = s.claim("keys", 1, LEASE).await.expect("claim");
            held.extend(c.messages.into_iter().map(|m| (c.token, m)));
        }
        let mut got: Vec<String> = held.iter().map(|(_, m)| text(&m.payload)).collect();
        got.sort();
        let expected: Vec<String> = (0..KEYS.len()).map(|i| format!("{i}-1")).collect();
        assert_eq!(
            got, expected,
            "each of {KEYS:?} is a key of its own: its first message is free while the \
             others' are held"
        );
        for (token, m) in &held {
            let key = m.key.clone().unwrap_or_default();
            if key == "A" {
                let dead = [DeadLetter {
                    id: m.id,
                    error: "poison".into(),
                }];
                assert_eq!(s.dead_letter(token, &dead).await.expect("dead letter"), 1);
            } else {
                let delivered = [Delivery {
                    id: m.id,
                    receipt: Receipt::new("r"),
                }];
                assert_eq!(s.ack(token, &delivered).await.expect("ack"), 1);
            }
        }
        // Parking `A` parks `A` alone.
        let c = s.claim("keys", 100, LEASE).await.expect("claim");
        let mut got = payloads(&c.messages);
        got.sort();
        assert_eq!(
            got,
            ["1-2", "2-2", "3-2", "4-2"],
            "only A is parked; a, `a `, and both spellings of é flow"
        );
        assert_eq!(s.stats().await.expect("stats").parked_keys, 1);
        assert!(
            !s.release_parked_key("a").await.expect("release"),
            "releasing `a` found a parked key: `A` and `a` are one key to the parked keys"
        );
        assert!(
            !s.release_parked_key("A ").await.expect("release"),
            "releasing `A ` found a parked key: trailing spaces are dropped"
        );
        assert!(s.release_parked_key("A").await.expect("release"));
        let c = s.claim("keys", 100, LEASE).await.expect("claim");
        assert_eq!(payloads(&c.messages), ["0-2"], "A flows once released");
    }

    on_every_sql_storage!(keys_that_differ_in_any_byte_are_different_keys);
}

/// docs/console.md and `outbox dead-letters list --error`: the storage matches the text of
/// the last error (ASCII case ignored) and leaves payloads out when asked, so a search or a
/// listing reads no more than it shows (it read up to 10,000 dead letters with their payloads
/// and filtered them in the relay).
mod dead_letter_search {
    use super::*;
    use outbox_core::DeadLetterFilter;

    const LEASE: Duration = Duration::from_secs(30);

    async fn the_storage_filters_by_error_text_and_leaves_payloads_out(s: &dyn StorageAdmin) {
        let errors = [
            "HTTP 503 Service Unavailable",
            "broker said: TIMEOUT after 5 s",
            "poison",
        ];
        let messages: Vec<NewMessage> = (0..errors.len())
            .map(|i| NewMessage::new(format!("t{}", i % 2), vec![b'x'; 1000]).key(format!("k{i}")))
            .collect();
        s.enqueue(&messages).await.expect("enqueue");
        let c = s.claim("search", 10, LEASE).await.expect("claim");
        assert_eq!(c.messages.len(), errors.len());
        let dead: Vec<DeadLetter> = c
            .messages
            .iter()
            .zip(errors)
            .map(|(m, error)| DeadLetter {
                id: m.id,
                error: error.into(),
            })
            .collect();
        assert_eq!(
            s.dead_letter(&c.token, &dead).await.expect("dead letter"),
            3
        );
        let search = |text: &str, topic: Option<&str>| DeadLetterFilter {
            last_error: Some(text.into()),
            topic: topic.map(Into::into),
            ..DeadLetterFilter::default()
        };
        let found = |rows: Vec<outbox_core::DeadLetterRow>| -> Vec<String> {
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
            assert_eq!(
                found(s.dead_letters(&filter, 10).await.expect("search")),
                expected,
                "{filter:?}"
            );
        }
        let limited = s.dead_letters(&search("s", None), 1).await.expect("search");
        assert_eq!(found(limited), [errors[0]], "the limit counts matches only");

        let listed = s
            .dead_letters(
                &DeadLetterFilter {
                    without_payloads: true,
                    ..DeadLetterFilter::default()
                },
                10,
            )
            .await
            .expect("list");
        assert_eq!(listed.len(), 3);
        for (row, m) in listed.iter().zip(&c.messages) {
            assert!(row.message.payload.is_empty(), "payload left out: {row:?}");
            assert_eq!(
                (&row.message.id, &row.message.topic, &row.message.key),
                (&m.id, &m.topic, &m.key),
                "everything else is there"
            );
            assert_eq!(row.message.headers, m.headers);
        }
        let whole = s
            .dead_letters(&DeadLetterFilter::default(), 10)
            .await
            .expect("list");
        assert!(whole.iter().all(|r| r.message.payload.len() == 1000));
    }

    on_every_sql_storage!(the_storage_filters_by_error_text_and_leaves_payloads_out);
}

/// docs/storage/mysql.md "How locks and gap locks behave under the claim": "a claim never
/// waits for an open application transaction"; acknowledgements look rows up by primary key
/// or the forced `id` index ("a DELETE that scans waits for rows an open transaction
/// inserted"); "rows of open transactions are invisible to the relay and hold nothing back".
/// Every claim and settlement below runs while an application transaction that inserted rows
/// of the same keys (and a keyless one) is open, and must finish at once, not after
/// `lock_wait_timeout`.
mod mysql_open_transaction {
    use super::*;
    use outbox_mysql::{MySqlConfig, MySqlStorage};

    /// Far below `lock_wait_timeout` (10 s): a statement that waited for the open
    /// transaction would take that long and then fail.
    const QUICK: Duration = Duration::from_secs(3);
    const LEASE: Duration = Duration::from_secs(60);

    async fn quick<T>(
        what: &str,
        f: impl std::future::Future<Output = outbox_core::Result<T>>,
    ) -> T {
        match tokio::time::timeout(QUICK, f).await {
            Err(_) => panic!("{what} waited {QUICK:?} for the open application transaction"),
            Ok(Err(e)) => panic!("{what} failed while an application transaction is open: {e}"),
            Ok(Ok(v)) => v,
        }
    }

    fn keyed(key: &str, payload: &str) -> NewMessage {
        NewMessage::new("t", payload.to_string()).key(key)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_and_settlements_never_wait_for_an_open_application_transaction() {
        let t = MySqlTables::new().await;
        let s = &t.0;
        // Another relay instance on the same tables: its acks go through the `id` index.
        let other =
            MySqlStorage::new(MySqlConfig::new(mysql_url()).table(s.table().table().to_string()))
                .expect("config");
        s.enqueue(&[
            keyed("a", "a1"),
            keyed("b", "b1"),
            keyed("c", "c1"),
            keyed("d", "d1"),
            keyed("e", "e1"),
            NewMessage::new("t", "free1"),
        ])
        .await
        .expect("enqueue");

        let pool = outbox_mysql::sqlx::MySqlPool::connect(&mysql_url())
            .await
            .expect("connect");
        let mut app = pool.begin().await.expect("begin");
        s.table()
            .enqueue_many(
                &mut app,
                &[
                    keyed("a", "a2"),
                    keyed("b", "b2"),
                    keyed("z", "z1"),
                    NewMessage::new("t", "free2"),
                ],
            )
            .await
            .expect("the application's insert");

        let c = quick("a claim", s.claim("w", 100, LEASE)).await;
        let mut got = payloads(&c.messages);
        got.sort();
        assert_eq!(
            got,
            ["a1", "b1", "c1", "d1", "e1", "free1"],
            "the claim takes the committed rows, nothing of the open transaction"
        );
        let by = |p: &str| {
            c.messages
                .iter()
                .find(|m| m.payload == p.as_bytes())
                .expect("claimed")
                .id
        };
        let delivery = |id| Delivery {
            id,
            receipt: Receipt::new("r"),
        };
        let renewed = quick(
            "a lease renewal",
            s.extend_lease(&c.token, &[by("e1")], LEASE),
        )
        .await;
        assert_eq!(renewed, 1);
        let acked = quick(
            "an acknowledgement by another instance (by id)",
            other.ack(&c.token, &[delivery(by("a1"))]),
        )
        .await;
        assert_eq!(acked, 1);
        let retried = quick(
            "a retry",
            s.retry(
                &c.token,
                &[Retry {
                    id: by("b1"),
                    delay: Duration::from_secs(3600),
                    error: "later".into(),
                }],
            ),
        )
        .await;
        assert_eq!(retried, 1);
        let dead = quick(
            "a dead letter",
            s.dead_letter(
                &c.token,
                &[DeadLetter {
                    id: by("c1"),
                    error: "poison".into(),
                }],
            ),
        )
        .await;
        assert_eq!(dead, 1);
        let released = quick("a release", s.release(&c.token, &[by("d1")])).await;
        assert_eq!(released, 1);
        let acked = quick(
            "an acknowledgement by the claiming instance (by seq)",
            s.ack(&c.token, &[delivery(by("e1")), delivery(by("free1"))]),
        )
        .await;
        assert_eq!(acked, 2);
        let c = quick("a second claim", s.claim("w", 100, LEASE)).await;
        assert_eq!(
            payloads(&c.messages),
            ["d1"],
            "d1 released, b waits, c parked"
        );
        quick("a release", s.release(&c.token, &[c.messages[0].id])).await;

        app.commit().await.expect("the application commits");
        let c = quick("a claim after the commit", s.claim("w", 100, LEASE)).await;
        let mut got = payloads(&c.messages);
        got.sort();
        assert_eq!(
            got,
            ["a2", "d1", "free2", "z1"],
            "the committed rows flow; b2 waits behind b1's retry"
        );
    }
}

/// docs/sinks/amqp.md, `exchange_setup`: "`amq.*` exchanges are only ever checked". The broker
/// refuses to declare a name starting `amq.` (ACCESS_REFUSED), and `amq.direct` is not of the
/// kind `topic` configured: a sink that declared it, fixed or named after a topic, would not
/// start or would fail the message.
mod amqp_reserved_exchanges {
    use super::*;
    use outbox_amqp::lapin::ExchangeKind;
    use outbox_amqp::{AmqpConfig, AmqpSink, ExchangeSetup};
    use outbox_core::{Outcome, Sink, Template};
    use outbox_test_support::amqp::{Broker, url};

    fn template(text: &str) -> Template {
        Template::new(text).expect("a template")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn amq_exchanges_are_only_checked_even_under_declare() {
        let broker = Broker::connect().await;
        let key = unique_name("amq_key");
        let queue = broker.queue("amq.direct", &key).await;
        for exchange in ["amq.direct", "amq.{topic}"] {
            let config = AmqpConfig::new(url(), template(exchange))
                .routing_key(template("{key}"))
                .exchange_setup(ExchangeSetup::Declare)
                .exchange_kind(ExchangeKind::Topic);
            let sink = match tokio::time::timeout(
                Duration::from_secs(20),
                AmqpSink::connect(config),
            )
            .await
            {
                Ok(Ok(sink)) => sink,
                Ok(Err(e)) => panic!("exchange `{exchange}` under declare: start-up refused: {e}"),
                Err(_) => panic!("exchange `{exchange}`: start-up did not return"),
            };
            let message: Message = NewMessage::new("direct", exchange).key(&key).into();
            let outcomes = sink.publish(&[message]).await.expect("publish");
            match &outcomes[0] {
                Outcome::Delivered(_) => {}
                Outcome::Failed(e) => panic!("exchange `{exchange}` under declare: {e}"),
            }
            let got = broker.take(&queue, 1).await;
            assert_eq!(got[0].data, exchange.as_bytes());
        }
    }
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

/// Bad input to the storages is a clear error, never a panic: docs/storage/postgres.md
/// "bad data (SQLSTATE 22, 23) → `Permanent`"; docs/storage/mysql.md "Keys up to 255 bytes,
/// topics up to 255 characters ... an enqueue of a larger one fails as `Permanent`". A
/// refused enqueue writes nothing, and the next good one goes through.
mod bad_input {
    use super::*;
    use outbox_core::ErrorKind;

    async fn refused(s: &dyn StorageAdmin, what: &str, message: NewMessage) {
        let good = NewMessage::new("t", "good").key("k");
        let result = s.enqueue(&[good, message]).await;
        let error = match result {
            Ok(()) => panic!("{what}: enqueued"),
            Err(e) => e,
        };
        assert_eq!(error.kind(), ErrorKind::Permanent, "{what}: {error}");
        assert!(!error.message().is_empty(), "{what}: an empty message");
        let stats = s.stats().await.expect("stats");
        assert_eq!(
            stats.pending, 0,
            "{what}: the refused enqueue wrote part of its batch"
        );
    }

    async fn nothing_after(s: &dyn StorageAdmin) {
        s.enqueue(&[NewMessage::new("t", "after").key("k")])
            .await
            .expect("a good enqueue after the refused ones");
        let c = s
            .claim("bad", 10, Duration::from_secs(30))
            .await
            .expect("claim");
        assert_eq!(payloads(&c.messages), ["after"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_refuses_bad_data_as_permanent() {
        let outbox = outbox_tests::TestOutbox::new().await;
        let s = &*outbox.storage;
        refused(s, "a NUL in the topic", NewMessage::new("a\0b", "x")).await;
        refused(s, "a NUL in the key", NewMessage::new("t", "x").key("k\0")).await;
        refused(
            s,
            "a NUL in a header value",
            NewMessage::new("t", "x").header("h", "v\0"),
        )
        .await;
        nothing_after(s).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_refuses_keys_and_topics_over_their_limits_as_permanent() {
        let t = MySqlTables::new().await;
        let s = &*t.0;
        refused(
            s,
            "a 256-byte key",
            NewMessage::new("t", "x").key("k".repeat(256)),
        )
        .await;
        refused(
            s,
            "a 256-character topic",
            NewMessage::new("é".repeat(256), "x"),
        )
        .await;
        // At the limits: accepted.
        s.enqueue(&[NewMessage::new("é".repeat(255), "x").key("k".repeat(255))])
            .await
            .expect("a 255-byte key and a 255-character topic");
        let c = s
            .claim("bad", 10, Duration::from_secs(30))
            .await
            .expect("claim");
        assert_eq!(c.messages[0].key.as_deref(), Some("k".repeat(255).as_str()));
        assert_eq!(c.messages[0].topic, "é".repeat(255));
        s.ack(
            &c.token,
            &[Delivery {
                id: c.messages[0].id,
                receipt: Receipt::new("r"),
            }],
        )
        .await
        .expect("ack");
        nothing_after(s).await;
    }
}

/// docs/storage/mysql.md: migrations are recorded in `<table>_migrations` "and never runs one
/// twice"; migrators take turns (`GET_LOCK`). Four relays migrating one new table at once must
/// all succeed (a second run of a step would fail: `CREATE TABLE` of an existing table, or the
/// version's primary key), each version recorded once, and the tables work.
mod mysql_migrations {
    use super::*;
    use outbox_mysql::{MySqlConfig, MySqlStorage};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_migrators_at_once_run_each_migration_once() {
        let config = MySqlConfig::new(mysql_url()).table(unique_name("t"));
        let migrators: Vec<MySqlStorage> = (0..4)
            .map(|_| MySqlStorage::new(config.clone()).expect("config"))
            .collect();
        // Dropped at the end whatever happens.
        let tables = MySqlTables(Arc::new(MySqlStorage::new(config).expect("config")));
        let results = futures_util::future::join_all(migrators.iter().map(|m| m.migrate())).await;
        for (i, result) in results.iter().enumerate() {
            if let Err(e) = result {
                panic!("migrator {i} of 4 failed: {e}");
            }
        }
        let pool = outbox_mysql::sqlx::MySqlPool::connect(&mysql_url())
            .await
            .expect("connect");
        let (count, max): (i64, i64) = outbox_mysql::sqlx::query_as(&format!(
            "SELECT CAST(COUNT(*) AS SIGNED), CAST(MAX(version) AS SIGNED) FROM {}",
            tables.0.table().qualified("_migrations")
        ))
        .fetch_one(&pool)
        .await
        .expect("the migrations table");
        assert!(max >= 1);
        assert_eq!(count, max, "each version recorded once, none skipped");
        tables
            .0
            .migrate()
            .await
            .expect("migrating again is a no-op");
        tables
            .0
            .enqueue(&[NewMessage::new("t", "x")])
            .await
            .expect("the migrated tables take messages");
    }
}
