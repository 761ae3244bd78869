//! Claims of the docs (docs/ARCHITECTURE.md, docs/guarantees.md) that no other test held the
//! code to, each as a test that fails if the claim is false. The audit behind them, with the
//! claim each one checks, is in the session notes (claims-audit).
//!
//! `core`: the worker on tokio's paused clock with `outbox_core::memory`'s storage and sink.
//! `storage`: the same checks against the real PostgreSQL, SQLite (a file) and MariaDB.
//! `log_mode`: PostgreSQL's log mode, in a database of its own.
//!
//! Two `core` tests fail against the worker as it is: the claims they check are false
//! (`a_shutdown_time_out_keeps_the_outcomes_of_rounds_already_published`,
//! `a_configuration_error_from_publish_dead_letters_nothing`); each says what it expected.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemorySink, MemoryStorage};
use outbox_core::{
    Backoff, CancellationToken, DeadLetter, Delivery, Error, Message, NewMessage, Outcome, Receipt,
    Result, Sink, SinkCapabilities, Storage, StorageAdmin, Worker, WorkerConfig,
};

fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

fn payloads(messages: &[Message]) -> Vec<String> {
    messages.iter().map(|m| text(&m.payload)).collect()
}

/// Starts a worker in the background; cancel the token to stop it.
fn start(
    config: WorkerConfig,
    storage: Arc<dyn Storage>,
    sink: Arc<dyn Sink>,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let worker = Worker::new(config, storage, sink).expect("valid worker configuration");
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    (shutdown, handle)
}

mod core {
    use super::*;
    use tokio::time::sleep;

    fn config() -> WorkerConfig {
        WorkerConfig {
            backoff: Backoff {
                jitter: 0.0,
                ..Backoff::default()
            },
            ..WorkerConfig::new("claims")
        }
    }

    /// A sink that hangs forever on the message whose payload is `hang_on`, fails the one
    /// whose payload is `fail` as `Temporary`, and delivers the rest.
    struct HangingSink {
        hang_on: &'static str,
        fail: &'static str,
        calls: Mutex<Vec<Vec<String>>>,
    }

    #[async_trait]
    impl Sink for HangingSink {
        async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
            self.calls.lock().unwrap().push(payloads(batch));
            if batch.iter().any(|m| m.payload == self.hang_on.as_bytes()) {
                std::future::pending::<()>().await;
            }
            Ok(batch
                .iter()
                .map(|m| {
                    if m.payload == self.fail.as_bytes() {
                        Outcome::Failed(Error::temporary("nack"))
                    } else {
                        Outcome::Delivered(Receipt::new("hanging-sink"))
                    }
                })
                .collect())
        }
        async fn health(&self) -> Result<()> {
            Ok(())
        }
    }

    /// docs/ARCHITECTURE.md "Shutdown": on cancellation the worker "lets the batch in flight
    /// finish and records its outcomes"; docs/guarantees.md: "exactly once when nothing
    /// crashes"; the `Temporary` row: "charges an attempt". A graceful shutdown whose last
    /// round outlives `shutdown_timeout` must still record what the earlier rounds already
    /// did: a1 is at the broker (recording it released would publish it twice), b1 was
    /// refused (releasing it uncharged loses the attempt).
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_time_out_keeps_the_outcomes_of_rounds_already_published() {
        let storage = Arc::new(MemoryStorage::new(true));
        storage.enqueue(NewMessage::new("t", "a1").key("a"));
        storage.enqueue(NewMessage::new("t", "b1").key("b"));
        storage.enqueue(NewMessage::new("t", "a2").key("a"));
        let sink = Arc::new(HangingSink {
            hang_on: "a2",
            fail: "b1",
            calls: Mutex::new(Vec::new()),
        });
        let cfg = WorkerConfig {
            shutdown_timeout: Duration::from_secs(2),
            ..config()
        };
        let (shutdown, handle) = start(cfg, storage.clone(), sink.clone());
        sleep(Duration::from_secs(1)).await;
        assert_eq!(
            *sink.calls.lock().unwrap(),
            [vec!["a1", "b1"], vec!["a2"]],
            "round 1 published, round 2 hanging"
        );
        shutdown.cancel();
        handle.await.expect("worker task");

        let delivered: Vec<String> = storage
            .delivered()
            .iter()
            .map(|(m, _)| text(&m.payload))
            .collect();
        let pending: Vec<(String, u32)> = storage
            .pending()
            .iter()
            .map(|m| (text(&m.payload), m.attempts))
            .collect();
        assert_eq!(
            (delivered, pending),
            (
                vec!["a1".to_string()],
                vec![("b1".to_string(), 1), ("a2".to_string(), 0)]
            ),
            "after the shutdown time-out: a1 (published in round 1) must be recorded delivered, \
             b1 (refused in round 1) charged one attempt, only a2 (the hung round) released"
        );
    }

    /// docs/ARCHITECTURE.md, the table of error kinds: `Config` means bad configuration, and
    /// the worker "refuses to start"; only `Permanent` dead-letters at once. A sink whose
    /// publish reports a configuration error must not dead-letter (and park) the messages.
    #[tokio::test(start_paused = true)]
    async fn a_configuration_error_from_publish_dead_letters_nothing() {
        let storage = Arc::new(MemoryStorage::new(true));
        let sink = Arc::new(MemorySink::new());
        sink.fail_when(|_| Some(Error::config("sink.url: bad configuration")));
        storage.enqueue(NewMessage::new("t", "k1").key("k"));
        storage.enqueue(NewMessage::new("t", "k2").key("k"));
        let (shutdown, handle) = start(config(), storage.clone(), sink.clone());
        sleep(Duration::from_secs(5)).await;
        shutdown.cancel();
        handle.await.expect("worker task");
        let dead: Vec<(String, String)> = storage
            .dead_letters()
            .iter()
            .map(|(m, e)| (text(&m.payload), e.clone()))
            .collect();
        assert!(
            dead.is_empty(),
            "a Config error from the sink dead-lettered {dead:?} and parked key k"
        );
        assert_eq!(storage.pending().len(), 2, "both messages still waiting");
    }

    /// Records the keys of every publish call, then hands the call to a [`MemorySink`].
    struct KeysPerCall {
        inner: MemorySink,
        calls: Mutex<Vec<Vec<Option<String>>>>,
    }

    #[async_trait]
    impl Sink for KeysPerCall {
        async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
            self.calls
                .lock()
                .unwrap()
                .push(batch.iter().map(|m| m.key.clone()).collect());
            self.inner.publish(batch).await
        }
        async fn health(&self) -> Result<()> {
            self.inner.health().await
        }
        fn capabilities(&self) -> SinkCapabilities {
            self.inner.capabilities()
        }
    }

    /// docs/ARCHITECTURE.md "The traits": "with per-key order a batch holds at most one
    /// message per key" (the sink's contract), and "Rounds": "keyless messages all go in
    /// the first". Over a backlog of 7 keys with failures and retries, no call holds two
    /// messages of a key, every message is delivered once, each key in enqueue order.
    #[tokio::test(start_paused = true)]
    async fn no_publish_call_holds_two_messages_of_one_key() {
        let storage = Arc::new(MemoryStorage::new(true));
        let sink = Arc::new(KeysPerCall {
            inner: MemorySink::new(),
            calls: Mutex::new(Vec::new()),
        });
        // Every fifth message fails its first try.
        sink.inner.fail_when(|m| {
            let n: usize = text(&m.payload)
                .rsplit('-')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            (n.is_multiple_of(5) && m.attempts == 0).then(|| Error::temporary("first try fails"))
        });
        let mut sent: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for i in 0..300 {
            let payload = format!("m-{i}");
            if i % 8 == 7 {
                storage.enqueue(NewMessage::new("t", payload.clone()));
                sent.entry(String::new()).or_default().push(payload);
            } else {
                let key = format!("k{}", i % 8);
                storage.enqueue(NewMessage::new("t", payload.clone()).key(key.clone()));
                sent.entry(key).or_default().push(payload);
            }
        }
        let cfg = WorkerConfig {
            batch_size: 50,
            lease: Duration::from_secs(60),
            max_attempts: 100,
            ..config()
        };
        let (shutdown, handle) = start(cfg, storage.clone(), sink.clone());
        sleep(Duration::from_secs(300)).await;
        shutdown.cancel();
        handle.await.expect("worker task");

        for (n, call) in sink.calls.lock().unwrap().iter().enumerate() {
            let keys: Vec<&String> = call.iter().flatten().collect();
            let unique: HashSet<&String> = keys.iter().copied().collect();
            assert_eq!(
                unique.len(),
                keys.len(),
                "publish call {n} holds two messages of one key: {call:?}"
            );
        }
        let mut got: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for m in sink.inner.published() {
            got.entry(m.key.clone().unwrap_or_default())
                .or_default()
                .push(text(&m.payload));
        }
        // Keyless messages need no order: compare them as sets.
        let keyless = |map: &mut BTreeMap<String, Vec<String>>| {
            let mut v = map.remove("").unwrap_or_default();
            v.sort();
            v
        };
        assert_eq!(keyless(&mut got), keyless(&mut sent), "keyless messages");
        assert_eq!(got, sent, "every keyed message once, in its key's order");
        assert!(storage.pending().is_empty() && storage.dead_letters().is_empty());
    }

    /// A storage whose lease renewals find the claim taken over (another relay claimed the
    /// rows after the lease ran out on the database's clock).
    struct TakenOver(MemoryStorage);

    #[async_trait]
    impl Storage for TakenOver {
        async fn claim(
            &self,
            worker: &str,
            limit: usize,
            lease: Duration,
        ) -> Result<outbox_core::Claim> {
            self.0.claim(worker, limit, lease).await
        }
        async fn settle(
            &self,
            token: &outbox_core::ClaimToken,
            settlement: &outbox_core::Settlement,
        ) -> Result<u64> {
            self.0.settle(token, settlement).await
        }
        async fn extend_lease(
            &self,
            _: &outbox_core::ClaimToken,
            _: &[uuid::Uuid],
            _: Duration,
        ) -> Result<u64> {
            Ok(0)
        }
        async fn health(&self) -> Result<()> {
            Ok(())
        }
        async fn stats(&self) -> Result<outbox_core::QueueStats> {
            self.0.stats().await
        }
        fn capabilities(&self) -> outbox_core::StorageCapabilities {
            self.0.capabilities()
        }
    }

    /// A sink whose every call takes `delay`, recording the payloads of each call.
    struct SlowSink {
        delay: Duration,
        calls: Mutex<Vec<Vec<String>>>,
    }

    #[async_trait]
    impl Sink for SlowSink {
        async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
            self.calls.lock().unwrap().push(payloads(batch));
            sleep(self.delay).await;
            Ok(batch
                .iter()
                .map(|_| Outcome::Delivered(Receipt::new("slow")))
                .collect())
        }
        async fn health(&self) -> Result<()> {
            Ok(())
        }
    }

    /// docs/ARCHITECTURE.md "Leases": "When renewal fails (taken over, or the storage
    /// cannot be reached ...) it stops the batch: the round in flight is abandoned and
    /// nothing more is published". The existing worker test covers the unreachable storage;
    /// this one the takeover, seen as a renewal that changes fewer rows than claimed.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_finds_the_claim_taken_over_stops_the_batch_at_once() {
        let storage = Arc::new(TakenOver(MemoryStorage::new(true)));
        storage.0.enqueue(NewMessage::new("t", "k1").key("k"));
        storage.0.enqueue(NewMessage::new("t", "k2").key("k"));
        let sink = Arc::new(SlowSink {
            delay: Duration::from_secs(10),
            calls: Mutex::new(Vec::new()),
        });
        let cfg = WorkerConfig {
            lease: Duration::from_secs(6),
            ..config()
        };
        let (shutdown, handle) = start(cfg, storage.clone(), sink.clone());
        // The renewal is due with a third of the 6 s lease left (at 4 s) and is refused.
        sleep(Duration::from_millis(4500)).await;
        assert_eq!(
            *sink.calls.lock().unwrap(),
            [vec!["k1"]],
            "k2 went out after the claim was taken over"
        );
        let stats = storage.stats().await.expect("stats");
        assert_eq!(
            (stats.in_flight, stats.pending),
            (0, 2),
            "the batch stopped when the renewal was refused, before its lease ran out"
        );
        shutdown.cancel();
        handle.await.expect("worker task");
        assert!(storage.0.delivered().is_empty());
        assert!(storage.0.pending().iter().all(|m| m.attempts == 0));
    }
    /// A storage that is down: claims fail at once, except the third, which hangs for
    /// 61 s before failing (a run that lasted over a minute, then lost the database).
    struct Flaky {
        calls: Mutex<Vec<Duration>>,
        start: tokio::time::Instant,
    }

    #[async_trait]
    impl Storage for Flaky {
        async fn claim(&self, _: &str, _: usize, _: Duration) -> Result<outbox_core::Claim> {
            let n = {
                let mut calls = self.calls.lock().unwrap();
                calls.push(self.start.elapsed());
                calls.len()
            };
            if n == 3 {
                sleep(Duration::from_secs(61)).await;
            }
            Err(Error::unavailable("database is down"))
        }
        async fn settle(
            &self,
            _: &outbox_core::ClaimToken,
            _: &outbox_core::Settlement,
        ) -> Result<u64> {
            unreachable!("nothing was claimed")
        }
        async fn extend_lease(
            &self,
            _: &outbox_core::ClaimToken,
            _: &[uuid::Uuid],
            _: Duration,
        ) -> Result<u64> {
            unreachable!("nothing was claimed")
        }
        async fn health(&self) -> Result<()> {
            Err(Error::unavailable("database is down"))
        }
        async fn stats(&self) -> Result<outbox_core::QueueStats> {
            Err(Error::unavailable("database is down"))
        }
        fn capabilities(&self) -> outbox_core::StorageCapabilities {
            outbox_core::StorageCapabilities::new(true)
        }
    }

    /// docs/ARCHITECTURE.md "Supervision": a failed run is restarted after 1 s, 2 s, 4 s
    /// ..., and "the wait resets after a run that lasted 60 s". The worker test checks the
    /// doubling; this one the reset: runs start at 0 s, 1 s (after 1 s) and 3 s (after 2 s);
    /// the third lasts 61 s, so the fourth starts 1 s after it ends (65 s), not 4 s (68 s).
    #[tokio::test(start_paused = true)]
    async fn the_restart_wait_resets_after_a_run_that_lasted_a_minute() {
        let storage = Arc::new(Flaky {
            calls: Mutex::new(Vec::new()),
            start: tokio::time::Instant::now(),
        });
        let (shutdown, handle) = start(config(), storage.clone(), Arc::new(MemorySink::new()));
        sleep(Duration::from_millis(66_500)).await;
        shutdown.cancel();
        handle.await.expect("worker task");
        let starts: Vec<u64> = storage
            .calls
            .lock()
            .unwrap()
            .iter()
            .map(Duration::as_secs)
            .collect();
        assert_eq!(starts, [0, 1, 3, 65], "claims of each run, in seconds");
    }
}

mod storage {
    use super::*;
    use outbox_core::DeadLetterFilter;
    use outbox_tests::{TestOutbox, test_worker_config, unique_name};

    const LEASE: Duration = Duration::from_secs(30);

    async fn claim(storage: &dyn Storage, limit: usize, lease: Duration) -> outbox_core::Claim {
        storage.claim("claims", limit, lease).await.expect("claim")
    }

    fn keyed(key: &str, payload: &str) -> NewMessage {
        NewMessage::new("t", payload.to_string()).key(key)
    }

    /// docs/ARCHITECTURE.md "Dead letters and parking": replay "unparks the key once no
    /// dead letter of it remains"; "Claims skip parked keys", new messages of the key too.
    /// Two dead letters of one key (the second after a release): replaying the first keeps
    /// the key parked; replaying the second lets all of it flow, in `seq` order.
    async fn replaying_one_of_two_dead_letters_keeps_the_key_parked(s: &dyn StorageAdmin) {
        s.enqueue(&[keyed("k", "k1"), keyed("k", "k2"), keyed("k", "k3")])
            .await
            .expect("enqueue");
        let c = claim(s, 1, LEASE).await;
        assert_eq!(payloads(&c.messages), ["k1"]);
        let first = c.messages[0].id;
        let dead = |id| DeadLetter {
            id,
            error: "poison".into(),
        };
        assert_eq!(s.dead_letter(&c.token, &[dead(first)]).await.unwrap(), 1);
        s.enqueue(&[keyed("k", "k4"), NewMessage::new("t", "free")])
            .await
            .expect("enqueue");
        let c = claim(s, 10, LEASE).await;
        assert_eq!(
            payloads(&c.messages),
            ["free"],
            "a parked key gives nothing, a message enqueued after parking included"
        );
        assert!(s.release_parked_key("k").await.unwrap(), "k was parked");
        let c = claim(s, 1, LEASE).await;
        assert_eq!(payloads(&c.messages), ["k2"]);
        let second = c.messages[0].id;
        assert_eq!(s.dead_letter(&c.token, &[dead(second)]).await.unwrap(), 1);

        assert_eq!(s.replay_dead_letters(&[first]).await.unwrap(), 1);
        let c = claim(s, 10, LEASE).await;
        assert_eq!(
            payloads(&c.messages),
            Vec::<String>::new(),
            "k2 is still a dead letter of k, so k stays parked after k1's replay"
        );
        assert_eq!(s.stats().await.unwrap().parked_keys, 1);
        assert_eq!(s.replay_dead_letters(&[second]).await.unwrap(), 1);
        let c = claim(s, 10, LEASE).await;
        assert_eq!(
            payloads(&c.messages),
            ["k1", "k2", "k3", "k4"],
            "once no dead letter of k remains, k flows in its original order"
        );
        assert_eq!(s.stats().await.unwrap().parked_keys, 0);
    }

    /// docs/ARCHITECTURE.md "The claim protocol": "A late settlement whose rows nobody
    /// claimed since is still accepted" (else a stalled relay's deliveries would be sent
    /// again), while one whose rows another claim took changes nothing.
    async fn a_late_settlement_counts_unless_the_rows_were_claimed_since(s: &dyn StorageAdmin) {
        s.enqueue(&[keyed("a", "a1"), keyed("b", "b1")])
            .await
            .expect("enqueue");
        let short = Duration::from_secs(1);
        let c = claim(s, 10, short).await;
        assert_eq!(c.messages.len(), 2);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // b1's lease ran out and another relay took it; a1's ran out and nobody came.
        let other = claim(s, 10, LEASE).await;
        let mut taken = payloads(&other.messages);
        taken.sort();
        assert_eq!(taken, ["a1", "b1"]);
        let a1 = other
            .messages
            .iter()
            .find(|m| m.payload == b"a1")
            .unwrap()
            .id;
        s.release(&other.token, &[a1]).await.expect("release");
        let deliveries: Vec<Delivery> = c
            .messages
            .iter()
            .map(|m| Delivery {
                id: m.id,
                receipt: Receipt::new("late"),
            })
            .collect();
        assert_eq!(
            s.ack(&c.token, &deliveries).await.expect("late ack"),
            0,
            "every row was claimed since (a1 then released): the late ack changes nothing"
        );
        // Now a claim that nobody follows up: its late ack is accepted.
        let c = claim(s, 10, short).await;
        assert_eq!(payloads(&c.messages), ["a1"]);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let late = [Delivery {
            id: c.messages[0].id,
            receipt: Receipt::new("late"),
        }];
        assert_eq!(
            s.ack(&c.token, &late).await.expect("late ack"),
            1,
            "a late ack whose rows nobody claimed since is accepted"
        );
        let stats = s.stats().await.unwrap();
        assert_eq!(
            (stats.pending, stats.in_flight),
            (0, 1),
            "only b1 left, held"
        );
    }

    /// docs/ARCHITECTURE.md, `Temporary`: "charges an attempt; retries after backoff;
    /// dead-letters at `max_attempts`"; docs/guarantees.md: "its key's later messages
    /// (including new ones) are parked, then delivered in order after a replay". Through a
    /// relay: exactly `max_attempts` publishes of the poison message, none of its key's later
    /// ones meanwhile, and after the replay the key in order.
    async fn retry_accounting_and_parking_through_a_relay<S>(s: Arc<S>)
    where
        S: StorageAdmin + 'static,
    {
        s.enqueue(&[keyed("p", "p1"), keyed("p", "p2"), keyed("f", "f1")])
            .await
            .expect("enqueue");
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
        let cfg = WorkerConfig {
            max_attempts: 3,
            ..test_worker_config("claims")
        };
        let (shutdown, handle) = start(cfg, s.clone(), sink.clone());
        let wait = |what: &'static str, done: Box<dyn Fn(&outbox_core::QueueStats) -> bool>| {
            let s = s.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                loop {
                    let stats = s.stats().await.expect("stats");
                    if done(&stats) {
                        return;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "{what}: {stats:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        wait("p1 dead-lettered", Box::new(|st| st.dead_lettered == 1)).await;
        s.enqueue(&[keyed("p", "p3")]).await.expect("enqueue");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(tries.load(Ordering::SeqCst), 3, "publishes of p1");
        let dead = s
            .dead_letters(&DeadLetterFilter::default(), 10)
            .await
            .expect("dead letters");
        assert_eq!(dead.len(), 1);
        assert_eq!(
            dead[0].message.attempts, 3,
            "attempts recorded on the dead letter"
        );
        assert!(
            dead[0].last_error.contains("3 attempts") && dead[0].last_error.contains("said no"),
            "{}",
            dead[0].last_error
        );
        assert_eq!(
            payloads(&sink.published()),
            ["f1"],
            "p2 and p3 stay parked behind the dead letter"
        );
        poisoned.store(false, Ordering::SeqCst);
        assert_eq!(
            s.replay_dead_letters(&[dead[0].message.id]).await.unwrap(),
            1
        );
        wait(
            "drained",
            Box::new(|st| st.pending == 0 && st.in_flight == 0),
        )
        .await;
        shutdown.cancel();
        handle.await.expect("relay task");
        assert_eq!(
            payloads(&sink.published()),
            ["f1", "p1", "p2", "p3"],
            "after the replay the key goes in order"
        );
        assert_eq!(tries.load(Ordering::SeqCst), 3);
    }

    /// docs/ARCHITECTURE.md: "One claim takes at most `max_per_key` messages of a key"; the
    /// worker's start-up check sizes the lease on it (rounds × publish time-out), so a claim
    /// that took more would let a batch outlive its lease. Checked on every SQL storage, with
    /// the cap the storage declares, and that the next claim goes on in order.
    async fn a_claim_takes_at_most_max_per_key_of_a_key(s: &dyn StorageAdmin) {
        let cap = s
            .capabilities()
            .max_per_key
            .expect("a SQL storage with per-key order declares its max_per_key");
        let many: Vec<NewMessage> = (0..cap * 2 + 3)
            .map(|i| keyed("a", &format!("a{i:03}")))
            .chain((0..2).map(|i| keyed("b", &format!("b{i:03}"))))
            .collect();
        s.enqueue(&many).await.expect("enqueue");
        let mut seen: Vec<String> = Vec::new();
        for round in 0..4 {
            let c = claim(s, 1000, LEASE).await;
            let a: Vec<String> = payloads(&c.messages)
                .into_iter()
                .filter(|p| p.starts_with('a'))
                .collect();
            assert!(
                a.len() <= cap,
                "claim {round} took {} messages of key a, over max_per_key = {cap}",
                a.len()
            );
            seen.extend(a);
            let done: Vec<Delivery> = c
                .messages
                .iter()
                .map(|m| Delivery {
                    id: m.id,
                    receipt: Receipt::new("r"),
                })
                .collect();
            s.ack(&c.token, &done).await.expect("ack");
        }
        let expected: Vec<String> = (0..cap * 2 + 3).map(|i| format!("a{i:03}")).collect();
        assert_eq!(seen, expected, "key a over successive claims, in order");
    }

    mod postgres {
        use super::*;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn replaying_one_of_two_dead_letters_keeps_the_key_parked() {
            let outbox = TestOutbox::new().await;
            super::replaying_one_of_two_dead_letters_keeps_the_key_parked(&*outbox.storage).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_claim_takes_at_most_max_per_key_of_a_key() {
            let outbox = TestOutbox::new().await;
            super::a_claim_takes_at_most_max_per_key_of_a_key(&*outbox.storage).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_late_settlement_counts_unless_the_rows_were_claimed_since() {
            let outbox = TestOutbox::new().await;
            super::a_late_settlement_counts_unless_the_rows_were_claimed_since(&*outbox.storage)
                .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retry_accounting_and_parking_through_a_relay() {
            let outbox = TestOutbox::new().await;
            super::retry_accounting_and_parking_through_a_relay(outbox.storage.clone()).await;
        }
    }

    mod sqlite {
        use super::*;
        use outbox_sqlite::{SqliteConfig, SqliteStorage};
        use std::path::PathBuf;

        /// A fresh, migrated database file in a directory of its own, removed when dropped.
        struct File {
            dir: PathBuf,
            storage: Arc<SqliteStorage>,
        }

        impl File {
            async fn new() -> File {
                let dir = std::env::temp_dir().join(unique_name("outbox-claims"));
                std::fs::create_dir_all(&dir).expect("making a temporary directory");
                let storage = SqliteStorage::open(SqliteConfig::new(dir.join("app.db")))
                    .await
                    .expect("opening the file");
                storage.migrate().await.expect("migrating");
                File {
                    dir,
                    storage: Arc::new(storage),
                }
            }
        }

        impl Drop for File {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn replaying_one_of_two_dead_letters_keeps_the_key_parked() {
            let f = File::new().await;
            super::replaying_one_of_two_dead_letters_keeps_the_key_parked(&*f.storage).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_claim_takes_at_most_max_per_key_of_a_key() {
            let f = File::new().await;
            super::a_claim_takes_at_most_max_per_key_of_a_key(&*f.storage).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_late_settlement_counts_unless_the_rows_were_claimed_since() {
            let f = File::new().await;
            super::a_late_settlement_counts_unless_the_rows_were_claimed_since(&*f.storage).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retry_accounting_and_parking_through_a_relay() {
            let f = File::new().await;
            super::retry_accounting_and_parking_through_a_relay(f.storage.clone()).await;
        }
    }

    mod mysql {
        use super::*;
        use outbox_mysql::{MySqlConfig, MySqlStorage};

        use outbox_tests::mysql_url;

        /// Tables of their own (`t_<random>`), migrated, dropped with the value.
        struct Tables(Arc<MySqlStorage>);

        impl Tables {
            async fn new() -> Tables {
                let config = MySqlConfig::new(mysql_url()).table(unique_name("t"));
                let storage = MySqlStorage::new(config).expect("valid test configuration");
                storage.migrate().await.unwrap_or_else(|e| {
                    panic!(
                        "MariaDB must be running at {} (`cargo xtask services`): {e}",
                        mysql_url()
                    )
                });
                Tables(Arc::new(storage))
            }
        }

        impl Drop for Tables {
            fn drop(&mut self) {
                outbox_tests::drop_mysql_tables(self.0.table());
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn replaying_one_of_two_dead_letters_keeps_the_key_parked() {
            let t = Tables::new().await;
            super::replaying_one_of_two_dead_letters_keeps_the_key_parked(&*t.0).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_claim_takes_at_most_max_per_key_of_a_key() {
            let t = Tables::new().await;
            super::a_claim_takes_at_most_max_per_key_of_a_key(&*t.0).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_late_settlement_counts_unless_the_rows_were_claimed_since() {
            let t = Tables::new().await;
            super::a_late_settlement_counts_unless_the_rows_were_claimed_since(&*t.0).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retry_accounting_and_parking_through_a_relay() {
            let t = Tables::new().await;
            super::retry_accounting_and_parking_through_a_relay(t.0.clone()).await;
        }
    }
}

mod log_mode {
    use super::*;
    use outbox_postgres::{PgStorage, PostgresConfig, StorageMode};
    use outbox_tests::{postgres_url, test_worker_config, unique_name};
    use sqlx::postgres::PgPoolOptions;

    /// A log-mode outbox in a database of its own (the horizon is per database), dropped
    /// with the value.
    struct LogDb {
        storage: Arc<PgStorage>,
        database: String,
    }

    impl LogDb {
        async fn new(shards: u32) -> LogDb {
            let server = postgres_url();
            let database = unique_name("outbox_claims");
            let admin = PgPoolOptions::new()
                .max_connections(1)
                .connect(&server)
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL must be running at {server}: {e}"));
            sqlx::query(&format!(r#"CREATE DATABASE "{database}""#))
                .execute(&admin)
                .await
                .expect("create the test's database");
            admin.close().await;
            let (base, _) = server.rsplit_once('/').expect("a URL with a database");
            let mut config = PostgresConfig::new(format!("{base}/{database}"));
            config.mode = StorageMode::Log;
            config.shards = shards;
            let storage = PgStorage::new(config).expect("valid test configuration");
            storage.migrate().await.expect("migrate for log mode");
            LogDb {
                storage: Arc::new(storage),
                database,
            }
        }

        /// Another relay's storage on the same table.
        fn another_relay(&self) -> Arc<PgStorage> {
            Arc::new(PgStorage::new(self.storage.config().clone()).expect("valid configuration"))
        }
    }

    impl Drop for LogDb {
        fn drop(&mut self) {
            let sql = format!(
                r#"DROP DATABASE IF EXISTS "{}" WITH (FORCE)"#,
                self.database
            );
            let url = postgres_url();
            // A runtime cannot block inside another: clean up from a thread with its own.
            let _ = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                runtime.block_on(async {
                    let pool = PgPoolOptions::new()
                        .max_connections(1)
                        .connect(&url)
                        .await
                        .ok()?;
                    sqlx::query(&sql).execute(&pool).await.ok()
                })
            })
            .join();
        }
    }

    /// A [`MemorySink`] whose every call takes 5 ms, so a backlog lasts long enough for
    /// relays to join while it drains.
    struct Paced(MemorySink);

    #[async_trait]
    impl Sink for Paced {
        async fn publish(&self, batch: &[Message]) -> Result<Vec<Outcome>> {
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.0.publish(batch).await
        }
        async fn health(&self) -> Result<()> {
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
        let db = LogDb::new(8).await;
        let (keys, total) = (80, 8000);
        for chunk in (0..total).collect::<Vec<_>>().chunks(2000) {
            let batch: Vec<NewMessage> = chunk
                .iter()
                .map(|i| {
                    NewMessage::new("t", format!("{:05}", i / keys)).key(format!("k{}", i % keys))
                })
                .collect();
            db.storage.enqueue(&batch).await.expect("enqueue");
        }
        let sink = Arc::new(Paced(MemorySink::new()));
        let config = |name: &str| WorkerConfig {
            batch_size: 100,
            lease: Duration::from_secs(2),
            ..test_worker_config(name)
        };
        let first = db.another_relay();
        let mut relays = vec![start(config("w0"), first.clone(), sink.clone())];
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
            relays.push(start(
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
        for (shutdown, handle) in relays {
            shutdown.cancel();
            handle.await.expect("relay task");
        }
        let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let published = sink.0.published();
        for m in &published {
            by_key
                .entry(m.key.clone().unwrap_or_default())
                .or_default()
                .push(text(&m.payload));
        }
        let expected: Vec<String> = (0..total / keys).map(|i| format!("{i:05}")).collect();
        for (key, got) in &by_key {
            assert_eq!(got, &expected, "key {key}: duplicates or order broken");
        }
        assert_eq!(published.len(), total, "each message exactly once");
        assert!(
            joined_at < total * 3 / 4,
            "the joining relays got their shards only after {joined_at} of {total} were \
             published: the hand-over did not happen under load"
        );
    }
}
