//! What the console shows of a relay's worker, seen from its sink: the health gate (the
//! worker checks the sink before it claims, and backs off while it is down), the backoff,
//! the last error, and a small ring of delivery samples per topic for the overview's charts.
//! The worker gets a [`WatchedSink`] around its sink; nothing here does I/O of its own.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};
use outbox::{Backoff, ErrorKind, Message, Outcome, Sink, SinkCapabilities};

/// Width of one sample in seconds, and how many are kept (10 minutes).
pub const BUCKET_SECS: i64 = 10;
pub const BUCKETS: usize = 60;
/// Topics charted one by one; the others are summed as `_other` (the ring stays small).
const MAX_TOPICS: usize = 20;
/// The longest error text kept.
const MAX_ERROR: usize = 2000;

/// Deliveries in one [`BUCKET_SECS`] interval of one topic.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Bucket {
    /// Messages the sink took.
    pub delivered: u64,
    /// Sum of their latencies (creation to the sink's acknowledgement), in seconds.
    pub latency_sum: f64,
}

impl Bucket {
    /// Deliveries per second over the interval.
    pub fn rate(&self) -> f64 {
        self.delivered as f64 / BUCKET_SECS as f64
    }

    /// The mean latency in seconds, if anything was delivered.
    pub fn mean_latency(&self) -> Option<f64> {
        (self.delivered > 0).then(|| self.latency_sum / self.delivered as f64)
    }
}

/// The state of one relay's worker as the console shows it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The last health gate: when, and the sink's error if it was down.
    pub gate: Option<(DateTime<Utc>, Option<String>)>,
    /// Consecutive failures of the sink (health gate or publish), 0 when it answers.
    pub failures: u32,
    /// While backing off: the wait (before jitter, so at most this) and when it ends.
    pub backoff: Option<(Duration, DateTime<Utc>)>,
    /// The last error of the sink (a failed health check, publish, or message), and when.
    pub last_error: Option<(DateTime<Utc>, String)>,
    /// Messages the sink took since this process started.
    pub delivered: u64,
}

#[derive(Default)]
struct State {
    snapshot: Snapshot,
    /// Per topic: (bucket number, deliveries), oldest first, at most [`BUCKETS`].
    topics: BTreeMap<String, VecDeque<(i64, Bucket)>>,
}

/// The watched state of one relay, shared by its [`WatchedSink`] and the console.
pub struct Watch {
    backoff: Backoff,
    state: Mutex<State>,
}

impl Watch {
    /// A watch for a relay whose worker backs off with `backoff`.
    pub fn new(backoff: Backoff) -> Self {
        Watch {
            backoff,
            state: Mutex::new(State::default()),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The relay's state now.
    pub fn snapshot(&self) -> Snapshot {
        self.with(|s| {
            let mut snapshot = s.snapshot.clone();
            // A backoff that ended is over.
            if snapshot
                .backoff
                .is_some_and(|(_, until)| until <= Utc::now())
            {
                snapshot.backoff = None;
            }
            snapshot
        })
    }

    /// The deliveries of the last [`BUCKETS`] intervals per topic, oldest first, ending with
    /// the current (partial) one; topics without a delivery in them are left out.
    pub fn series(&self, now: DateTime<Utc>) -> Vec<(String, Vec<Bucket>)> {
        let last = bucket_of(now);
        let first = last - BUCKETS as i64 + 1;
        self.with(|s| {
            s.topics
                .iter()
                .filter(|(_, ring)| ring.back().is_some_and(|(n, _)| *n >= first))
                .map(|(topic, ring)| {
                    let mut series = vec![Bucket::default(); BUCKETS];
                    for (n, bucket) in ring.iter().filter(|(n, _)| (first..=last).contains(n)) {
                        series[(n - first) as usize] = *bucket;
                    }
                    (topic.clone(), series)
                })
                .collect()
        })
    }

    fn failed(&self, what: &str, error: &outbox::Error, backs_off: bool) {
        let now = Utc::now();
        let mut text = format!("{what}: {error}");
        if text.len() > MAX_ERROR {
            let mut end = MAX_ERROR;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        self.with(|s| {
            let snap = &mut s.snapshot;
            snap.last_error = Some((now, text.clone()));
            if backs_off {
                snap.failures = snap.failures.saturating_add(1);
                let wait = self.backoff.base_delay(snap.failures);
                let until =
                    now + chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::zero());
                snap.backoff = Some((wait, until));
            }
            if what == "health check" {
                snap.gate = Some((now, Some(text)));
            }
        });
    }

    fn healthy(&self) {
        self.with(|s| {
            s.snapshot.gate = Some((Utc::now(), None));
            s.snapshot.failures = 0;
            s.snapshot.backoff = None;
        });
    }

    /// Records a batch's outcomes: its deliveries in the ring, its first failure as the last
    /// error (an unavailable sink makes the worker back off), a clean batch ends a backoff.
    fn published(&self, batch: &[Message], outcomes: &[Outcome]) {
        self.delivered(batch, outcomes);
        let failed = outcomes.iter().find_map(|o| match o {
            Outcome::Failed(error) => Some(error),
            Outcome::Delivered(_) => None,
        });
        match failed {
            Some(error) => self.failed(
                "message not delivered",
                error,
                error.kind() == ErrorKind::Unavailable,
            ),
            None if !outcomes.is_empty() => self.with(|s| {
                s.snapshot.failures = 0;
                s.snapshot.backoff = None;
            }),
            None => {}
        }
    }

    /// Records the deliveries among `outcomes` of `batch` in the ring.
    fn delivered(&self, batch: &[Message], outcomes: &[Outcome]) {
        let now = Utc::now();
        let n = bucket_of(now);
        self.with(|s| {
            for (message, outcome) in batch.iter().zip(outcomes) {
                if !matches!(outcome, Outcome::Delivered(_)) {
                    continue;
                }
                s.snapshot.delivered += 1;
                let topic = if s.topics.contains_key(&message.topic) || s.topics.len() < MAX_TOPICS
                {
                    message.topic.clone()
                } else {
                    "_other".to_string()
                };
                let ring = s.topics.entry(topic).or_default();
                if ring.back().is_none_or(|(last, _)| *last != n) {
                    ring.push_back((n, Bucket::default()));
                }
                while ring.len() > BUCKETS {
                    ring.pop_front();
                }
                if let Some((_, bucket)) = ring.back_mut() {
                    bucket.delivered += 1;
                    // Clocks of writers and relay differ: a negative age counts as none.
                    bucket.latency_sum +=
                        ((now - message.created_at).num_milliseconds().max(0) as f64) / 1000.0;
                }
            }
        });
    }
}

fn bucket_of(t: DateTime<Utc>) -> i64 {
    t.timestamp().div_euclid(BUCKET_SECS)
}

/// The worker's sink, watched: forwards every call and records what the console shows.
pub struct WatchedSink {
    inner: Arc<dyn Sink>,
    watch: Arc<Watch>,
}

impl WatchedSink {
    /// `inner`, recording into `watch`.
    pub fn new(inner: Arc<dyn Sink>, watch: Arc<Watch>) -> Self {
        WatchedSink { inner, watch }
    }
}

/// The future a [`Sink`] method returns (the form `async_trait` gives the trait; the
/// binary does not depend on that macro).
type Answer<'a, T> = Pin<Box<dyn Future<Output = outbox::Result<T>> + Send + 'a>>;

impl Sink for WatchedSink {
    fn publish<'s, 'b, 'a>(&'s self, batch: &'b [Message]) -> Answer<'a, Vec<Outcome>>
    where
        's: 'a,
        'b: 'a,
        Self: 'a,
    {
        Box::pin(async move {
            let result = self.inner.publish(batch).await;
            match &result {
                // The worker backs off when the sink drops out during a batch, as after a
                // failed health check.
                Err(error) => self.watch.failed("publish", error, true),
                Ok(outcomes) => self.watch.published(batch, outcomes),
            }
            result
        })
    }

    fn health<'s, 'a>(&'s self) -> Answer<'a, ()>
    where
        's: 'a,
        Self: 'a,
    {
        Box::pin(async move {
            let result = self.inner.health().await;
            match &result {
                Ok(()) => self.watch.healthy(),
                Err(error) => self.watch.failed("health check", error, true),
            }
            result
        })
    }

    fn capabilities(&self) -> SinkCapabilities {
        self.inner.capabilities()
    }

    fn publish_timeout(&self) -> Option<Duration> {
        self.inner.publish_timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(topic: &str, age_ms: i64) -> Message {
        Message {
            id: uuid::Uuid::now_v7(),
            topic: topic.into(),
            key: None,
            payload: Vec::new(),
            headers: Default::default(),
            created_at: Utc::now() - chrono::Duration::milliseconds(age_ms),
            attempts: 0,
            trace_context: None,
        }
    }

    #[test]
    fn deliveries_fill_the_current_bucket_per_topic() {
        let watch = Watch::new(Backoff::default());
        let batch = [message("a", 1000), message("a", 3000), message("b", 0)];
        let outcomes = [
            Outcome::Delivered(outbox::Receipt::new("1")),
            Outcome::Delivered(outbox::Receipt::new("2")),
            Outcome::Failed(outbox::Error::permanent("no")),
        ];
        watch.delivered(&batch, &outcomes);
        let series = watch.series(Utc::now());
        assert_eq!(series.len(), 1, "b delivered nothing");
        let (topic, buckets) = &series[0];
        assert_eq!(topic, "a");
        assert_eq!(buckets.len(), BUCKETS);
        let last = buckets[BUCKETS - 1];
        assert_eq!(last.delivered, 2);
        let mean = last.mean_latency().unwrap();
        assert!((1.9..3.0).contains(&mean), "{mean}");
        assert_eq!(watch.snapshot().delivered, 2);
        // Ten minutes later the samples are gone.
        assert!(
            watch
                .series(Utc::now() + chrono::Duration::minutes(11))
                .is_empty()
        );
    }

    #[test]
    fn failures_back_off_and_a_healthy_gate_clears_them() {
        let watch = Watch::new(Backoff::default());
        let error = outbox::Error::unavailable("connection refused");
        watch.failed("health check", &error, true);
        watch.failed("health check", &error, true);
        let snap = watch.snapshot();
        assert_eq!(snap.failures, 2);
        assert!(snap.backoff.is_some(), "{snap:?}");
        assert!(
            snap.gate
                .as_ref()
                .and_then(|(_, e)| e.as_deref())
                .is_some_and(|e| e.contains("connection refused")),
            "{snap:?}"
        );
        watch.healthy();
        let snap = watch.snapshot();
        assert_eq!(snap.failures, 0);
        assert!(snap.backoff.is_none() && snap.gate.is_some_and(|(_, e)| e.is_none()));
        assert!(
            snap.last_error
                .is_some_and(|(_, e)| e.contains("connection refused")),
            "the last error stays"
        );
    }
}
