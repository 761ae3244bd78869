//! The relay loop: claim a batch, publish it, record each outcome; supervised and
//! shut down gracefully.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::metrics as names;
use crate::trace;
use crate::{
    Backoff, Claim, ClaimToken, DeadLetter, Delivery, Error, ErrorKind, Message, Outcome, Result,
    Retry, Settlement, Sink, Storage,
};

/// How often the worker calls [`Storage::maintain`].
const MAINTAIN_EVERY: Duration = Duration::from_secs(10);

/// Waits between restarts of a failed run: 1 s doubling to 60 s, no jitter.
const RESTART_BACKOFF: Backoff = Backoff {
    initial: Duration::from_secs(1),
    multiplier: 2.0,
    max: Duration::from_secs(60),
    jitter: 0.0,
};

/// A run that lasted this long resets the restart wait to its first step.
const RESTART_RESET_AFTER: Duration = Duration::from_secs(60);

/// Settings of one relay worker: the `[relay]` section of the relay's file, where every key
/// has a default; `worker_id` is not read from the file (the binary names its workers).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Names this worker in claims and logs.
    #[serde(skip)]
    pub worker_id: String,
    /// The relay's name, the `relay` label of its metrics: stable across restarts and the
    /// same on every replica, so series aggregate (the binary sets the configured name;
    /// none: `worker_id`).
    #[serde(skip)]
    pub relay: Option<String>,
    /// Messages claimed at once (default 500: measured with the binary, a backlog drains about
    /// twice as fast as with 100, at the same latency under light load; BENCHMARKS.md).
    pub batch_size: usize,
    /// Wait after an under-full batch when no wake-up comes (default 1 s).
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How long a claim holds its messages before another worker may take them (default
    /// 2 min). The worker renews it while a batch is still publishing, so it bounds how long
    /// the batch of a relay that died waits for another. It must cover the worst case of a
    /// batch: the storage's rounds per batch (`max_per_key`) × the sink's publish time-out.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// Attempts before a message is dead-lettered (default 10).
    pub max_attempts: u32,
    /// Wait before retrying a failed message, and between sink health checks while it is down.
    pub backoff: Backoff,
    /// After shutdown is requested, how long the batch in flight may take before its
    /// messages are released unpublished (default 10 s).
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// How many topics the counters name in their `topic` label (default 100): the first
    /// ones a relay counts keep their own series, later ones are counted under `_other`, so
    /// an unbounded set of topics cannot grow the series without bound. 0: no topic
    /// breakdown (every count under `_all`).
    pub metric_topics: usize,
}

impl Default for WorkerConfig {
    /// The defaults, for a worker named `outbox`.
    fn default() -> Self {
        WorkerConfig::new("outbox")
    }
}

impl WorkerConfig {
    /// Defaults for a worker named `worker_id`.
    pub fn new(worker_id: impl Into<String>) -> Self {
        WorkerConfig {
            worker_id: worker_id.into(),
            relay: None,
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            lease: Duration::from_secs(120),
            max_attempts: 10,
            backoff: Backoff::default(),
            shutdown_timeout: Duration::from_secs(10),
            metric_topics: 100,
        }
    }

    /// The `relay` label of this worker's metrics: [`relay`](Self::relay), else `worker_id`.
    pub fn relay_label(&self) -> &str {
        self.relay.as_deref().unwrap_or(&self.worker_id)
    }

    /// The longest duration of any setting: one year (365.25 days, as `1y` is written).
    /// Longer means nothing to a relay, and the worker could not compute with some (a lease
    /// of `u64::MAX` seconds panicked adding it to the clock at the first claim).
    pub const MAX_DURATION: Duration = Duration::from_secs(31_557_600);

    /// Every duration setting with its key in the section (`backoff.max` for the backoff's),
    /// in the order [`validate`](Self::validate) holds them to
    /// [`MAX_DURATION`](Self::MAX_DURATION).
    pub fn durations(&self) -> [(&'static str, Duration); 5] {
        [
            ("lease", self.lease),
            ("poll_interval", self.poll_interval),
            ("shutdown_timeout", self.shutdown_timeout),
            ("backoff.initial", self.backoff.initial),
            ("backoff.max", self.backoff.max),
        ]
    }

    /// Checks every setting; the error is keyed by the bad one (place it in its section
    /// with [`Error::in_section`]).
    pub fn validate(&self) -> Result<()> {
        for (setting, duration) in self.durations() {
            if duration > Self::MAX_DURATION {
                return Err(Error::setting(
                    setting,
                    format!("is {duration:?}; it must be at most 1 year"),
                ));
            }
        }
        if self.worker_id.trim().is_empty() {
            return Err(Error::setting(
                "worker_id",
                "is empty; give each worker a name",
            ));
        }
        crate::config::check_at_least_one("batch_size", self.batch_size as u64)?;
        crate::config::check_not_zero("poll_interval", self.poll_interval)?;
        if self.lease < Duration::from_secs(1) {
            return Err(Error::setting(
                "lease",
                format!(
                    "is {:?}; it must be at least 1 s and longer than the sink's time-out",
                    self.lease
                ),
            ));
        }
        crate::config::check_at_least_one("max_attempts", self.max_attempts.into())?;
        self.backoff.validate().map_err(|e| e.in_section("backoff"))
    }
}

/// One relay worker: moves messages from a [`Storage`] to a [`Sink`].
pub struct Worker {
    config: WorkerConfig,
    storage: Arc<dyn Storage>,
    sink: Arc<dyn Sink>,
    topic_labels: TopicLabels,
    runs: RunHealth,
}

/// How a worker's runs are going, for readiness probes and consoles: how many failed in a
/// row (a claim, settlement or maintenance the storage refused or could not do) and the last
/// failure. A claim that succeeds sets the count back to 0. Clones share one state.
#[derive(Clone, Debug, Default)]
pub struct RunHealth(Arc<RunHealthState>);

#[derive(Debug, Default)]
struct RunHealthState {
    failures_in_a_row: std::sync::atomic::AtomicU32,
    last_failure: std::sync::Mutex<Option<(DateTime<Utc>, String)>>,
}

impl RunHealth {
    /// Runs that failed since the last claim that succeeded.
    pub fn failures_in_a_row(&self) -> u32 {
        self.0
            .failures_in_a_row
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The last failure of a run, and when; kept after the runs recover.
    pub fn last_failure(&self) -> Option<(DateTime<Utc>, String)> {
        self.0
            .last_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn failed(&self, error: &Error) {
        self.0
            .failures_in_a_row
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *self
            .0
            .last_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some((Utc::now(), error.to_string()));
    }

    fn claimed(&self) {
        if self.failures_in_a_row() > 0 {
            self.0
                .failures_in_a_row
                .store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The values of the counters' `topic` label: the first `limit` topics seen are their own,
/// the rest `_other` (or every one `_all` when `limit` is 0).
#[derive(Debug)]
struct TopicLabels {
    limit: usize,
    named: std::sync::Mutex<HashSet<String>>,
}

impl TopicLabels {
    fn new(limit: usize) -> Self {
        TopicLabels {
            limit,
            named: std::sync::Mutex::new(HashSet::new()),
        }
    }

    fn label(&self, topic: &str) -> String {
        if self.limit == 0 {
            return "_all".into();
        }
        let mut named = self.named.lock().unwrap_or_else(|e| e.into_inner());
        if named.contains(topic) || (named.len() < self.limit && named.insert(topic.to_string())) {
            topic.to_string()
        } else {
            "_other".into()
        }
    }
}

/// What happened to one claimed batch.
#[derive(Default)]
struct Published {
    /// What to write to the storage.
    settlement: Settlement,
    /// The sink dropped out during the batch.
    sink_unavailable: bool,
    /// The claim's lease was lost (taken over, or ran out unrenewed): the batch stopped.
    lease_lost: bool,
}

impl Published {
    /// The messages this batch already has an outcome for.
    fn recorded_ids(&self) -> HashSet<Uuid> {
        let s = &self.settlement;
        (s.delivered.iter().map(|d| d.id))
            .chain(s.retries.iter().map(|r| r.id))
            .chain(s.dead.iter().map(|d| d.id))
            .chain(s.released.iter().copied())
            .collect()
    }

    /// Adds this batch's outcomes to the per-topic counters, one increment per topic, and
    /// each delivery's latency from its creation to its acknowledgement.
    fn count(
        &self,
        worker: &str,
        topics: &HashMap<Uuid, (String, DateTime<Utc>)>,
        labels: &TopicLabels,
    ) {
        let now = Utc::now();
        let latency = metrics::histogram!(names::DELIVERY_LATENCY_SECONDS, names::RELAY => worker.to_string());
        for delivery in &self.settlement.delivered {
            if let Some((_, created_at)) = topics.get(&delivery.id) {
                // Clocks of writers and relay differ: a negative age counts as none.
                latency.record(
                    (now - *created_at).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6,
                );
            }
        }
        let mut counts: HashMap<(&'static str, String), u64> = HashMap::new();
        let s = &self.settlement;
        let ids = [
            (
                names::DELIVERED_TOTAL,
                s.delivered.iter().map(|d| d.id).collect::<Vec<_>>(),
            ),
            (
                names::RETRIED_TOTAL,
                s.retries.iter().map(|r| r.id).collect(),
            ),
            (
                names::DEAD_LETTERED_TOTAL,
                s.dead.iter().map(|d| d.id).collect(),
            ),
        ];
        for (name, ids) in &ids {
            for id in ids {
                let topic = topics.get(id).map_or("", |(topic, _)| topic.as_str());
                *counts.entry((name, labels.label(topic))).or_default() += 1;
            }
        }
        for ((name, topic), n) in counts {
            if name != names::DELIVERED_TOTAL {
                metrics::counter!(names::FAILED_TOTAL, names::RELAY => worker.to_string(), names::TOPIC => topic.clone())
                    .increment(n);
            }
            metrics::counter!(name, names::RELAY => worker.to_string(), names::TOPIC => topic)
                .increment(n);
        }
    }
}

impl Worker {
    /// A worker with validated settings. Refuses a lease shorter than the worst case of a
    /// batch: the rounds the storage may give it times the sink's publish time-out.
    pub fn new(
        config: WorkerConfig,
        storage: Arc<dyn Storage>,
        sink: Arc<dyn Sink>,
    ) -> Result<Self> {
        config.validate()?;
        if let Some(timeout) = sink.publish_timeout() {
            let capabilities = storage.capabilities();
            let key_runs = sink.capabilities().ordered_key_runs;
            // The rounds of the worst batch, why, and the setting that lowers them (if any).
            let (rounds, why, lower) = match (capabilities.per_key_order, capabilities.max_per_key)
            {
                (false, _) => (1, "one round without per-key order", None),
                (true, _) if key_runs => (
                    1,
                    "one round: the sink takes a key's messages together",
                    None,
                ),
                (true, Some(n)) => (
                    n.min(config.batch_size),
                    "the storage's max_per_key",
                    Some("the storage's max_per_key"),
                ),
                (true, None) => (config.batch_size, "batch_size", Some("batch_size")),
            };
            let worst = timeout.saturating_mul(u32::try_from(rounds).unwrap_or(u32::MAX));
            if config.lease < worst {
                return Err(Error::setting(
                    "lease",
                    format!(
                        "is {:?}, shorter than the worst case of a batch: {rounds} round(s) \
                         ({why}) × the sink's publish time-out of {timeout:?} = {worst:?}; \
                         raise lease to at least {worst:?}, or lower {}the sink's time-out",
                        config.lease,
                        lower.map_or(String::new(), |s| format!("{s} or "))
                    ),
                ));
            }
        }
        Ok(Worker {
            topic_labels: TopicLabels::new(config.metric_topics),
            config,
            storage,
            sink,
            runs: RunHealth::default(),
        })
    }

    /// Reports how the runs go to `runs` (a handle made before the worker, e.g. for a
    /// readiness probe that exists first).
    pub fn with_run_health(mut self, runs: RunHealth) -> Self {
        self.runs = runs;
        self
    }

    /// A handle on how this worker's runs are going.
    pub fn run_health(&self) -> RunHealth {
        self.runs.clone()
    }

    /// The worker's settings.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Runs until `shutdown` is cancelled. A run that fails (database down, grant missing) is
    /// logged and restarted after a wait that doubles from 1 s to 60 s, reset once a run has
    /// lasted 60 s. On the way out it calls [`Storage::stop`] (log mode gives its shards up).
    pub async fn run(&self, shutdown: CancellationToken) {
        self.supervise(&shutdown).await;
        if let Err(error) = self.storage.stop().await {
            tracing::warn!(worker = %self.config.worker_id, %error, "storage could not hand its work over on stop");
        }
    }

    /// Runs and restarts failed runs until `shutdown` is cancelled.
    async fn supervise(&self, shutdown: &CancellationToken) {
        let mut failures = 0;
        loop {
            let started = Instant::now();
            match self.run_once(shutdown).await {
                Ok(()) => return,
                Err(error) => {
                    if started.elapsed() >= RESTART_RESET_AFTER {
                        failures = 0;
                    }
                    failures += 1;
                    self.runs.failed(&error);
                    metrics::counter!(names::RUN_FAILURES_TOTAL, names::RELAY => self.config.relay_label().to_string())
                        .increment(1);
                    let wait = RESTART_BACKOFF.delay(failures);
                    tracing::error!(worker = %self.config.worker_id, %error, ?wait, "relay run failed; restarting");
                    if sleep_or_cancel(wait, shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    /// One run: relays until `shutdown` is cancelled (`Ok`) or the storage fails (`Err`).
    ///
    /// Batches are pipelined two deep: a batch's outcomes are written while the next batch
    /// is claimed and published, so the storage's commit is not on the path of every batch.
    /// The claim runs while the last batch's outcomes are being written: a storage whose
    /// rows stay claimed until then leaves out their keys (per-key order holds as between
    /// two relays; log mode, which knows the rows delivered, takes their keys' next rows);
    /// a claim that came back short meanwhile is made again at once after the write, before
    /// the worker waits for work.
    /// Anything else (maintenance, the health gate, shutdown, a sink outage, waiting for
    /// work) waits for the write first.
    pub async fn run_once(&self, shutdown: &CancellationToken) -> Result<()> {
        let mut sink_checked = false;
        let mut sink_failures = 0;
        let mut last_maintain: Option<Instant> = None;
        let mut settling: Option<Settling<'_>> = None;
        loop {
            if shutdown.is_cancelled() {
                return settled(&mut settling).await;
            }
            if last_maintain.is_none_or(|at| at.elapsed() >= MAINTAIN_EVERY) {
                settled(&mut settling).await?;
                self.storage.maintain().await?;
                last_maintain = Some(Instant::now());
            }
            // Health gate: while the sink is down, claim nothing and charge nothing.
            if !sink_checked {
                settled(&mut settling).await?;
                let health = self.sink.health().await;
                metrics::gauge!(names::SINK_UP, names::RELAY => self.config.relay_label().to_string())
                    .set(if health.is_ok() { 1.0 } else { 0.0 });
                if let Err(error) = health {
                    sink_failures += 1;
                    let wait = self.config.backoff.delay(sink_failures);
                    tracing::warn!(worker = %self.config.worker_id, %error, ?wait, "sink is down; not claiming");
                    if sleep_or_cancel(wait, shutdown).await {
                        return Ok(());
                    }
                    continue;
                }
                sink_checked = true;
            }

            let overlapped = settling.is_some();
            let next = self.claim_and_publish(shutdown);
            // The write is polled first: it takes what it needs and is on its way before
            // the claim starts.
            let (last, next) = match settling.take() {
                Some(last) => tokio::join!(last, next),
                None => (Ok(()), next.await),
            };
            last?;
            let (claimed, batch) = next?;
            if let Some(batch) = batch {
                if batch.published.sink_unavailable {
                    // The sink dropped out mid-publish: back off even if its health check
                    // still passes, so a half-broken broker is not hammered.
                    self.settle(batch).await?;
                    metrics::gauge!(names::SINK_UP, names::RELAY => self.config.relay_label().to_string())
                        .set(0.0);
                    sink_failures += 1;
                    let wait = self.config.backoff.delay(sink_failures);
                    tracing::warn!(worker = %self.config.worker_id, ?wait, "sink unavailable during publish; batch released");
                    if sleep_or_cancel(wait, shutdown).await {
                        return Ok(());
                    }
                    sink_checked = false;
                    continue;
                }
                if sink_failures > 0 {
                    tracing::info!(worker = %self.config.worker_id, "sink is back");
                }
                sink_failures = 0;
                settling = Some(Box::pin(self.settle(batch)));
            }
            // Drain until idle: a full batch means more may be waiting, so claim again now.
            if claimed < self.config.batch_size {
                settled(&mut settling).await?;
                // The keys of the batch that was settling were left out: claim again now.
                if overlapped {
                    continue;
                }
                tokio::select! {
                    _ = sleep(self.config.poll_interval) => {}
                    woken = self.storage.wait_for_work() => woken?,
                    _ = shutdown.cancelled() => return Ok(()),
                }
                // After a truly idle spell the sink may have gone away unnoticed.
                if claimed == 0 {
                    sink_checked = false;
                }
            }
        }
    }

    /// Claims a batch and publishes it. Returns how many messages were claimed and, if
    /// any, the batch with its outcomes, to [`settle`](Self::settle).
    async fn claim_and_publish(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<(usize, Option<Batch>)> {
        // The lease runs on the storage's clock from the claim statement; counting it
        // from before the call keeps this worker's view of it on the safe side.
        let asked_at = Instant::now();
        let claim_span = tracing::info_span!(
            "outbox.claim",
            relay = %self.config.relay_label(),
            limit = self.config.batch_size,
            claimed = tracing::field::Empty,
        );
        let claim = self
            .storage
            .claim(
                &self.config.worker_id,
                self.config.batch_size,
                self.config.lease,
            )
            .instrument(claim_span.clone())
            .await?;
        self.runs.claimed();
        claim_span.record("claimed", claim.messages.len());
        trace::link_messages(&claim_span, &claim.messages);
        drop(claim_span);
        let claimed = claim.messages.len();
        if claimed == 0 {
            return Ok((0, None));
        }
        // One span for the batch, linked to each message's trace; its publish rounds and
        // its settlement are spans within it.
        let span = tracing::info_span!(
            "outbox.batch",
            relay = %self.config.relay_label(),
            messages = claimed,
        );
        trace::link_messages(&span, &claim.messages);
        let batch = self
            .publish_batch(claim, asked_at, shutdown, span.clone())
            .instrument(span)
            .await;
        Ok((claimed, Some(batch)))
    }

    /// Publishes one claimed batch. Once shutdown is requested the batch gets
    /// `shutdown_timeout` to finish; after that its messages are released.
    async fn publish_batch(
        &self,
        claim: Claim,
        asked_at: Instant,
        shutdown: &CancellationToken,
        span: tracing::Span,
    ) -> Batch {
        let started = Instant::now();
        let token = claim.token;
        let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
        let topics: HashMap<Uuid, (String, DateTime<Utc>)> = claim
            .messages
            .iter()
            .map(|m| (m.id, (m.topic.clone(), m.created_at)))
            .collect();
        let mut lease = Lease {
            token,
            ids: ids.clone(),
            expires: asked_at + self.config.lease,
        };
        // The outcomes are gathered outside the publishing future, so a shutdown time-out
        // that drops it still records the rounds already published (their deliveries and
        // charged failures) and releases only what has no outcome yet.
        let mut published = Published::default();
        let timed_out = {
            let publish = self.publish(claim.messages, &mut lease, &mut published);
            tokio::pin!(publish);
            tokio::select! {
                () = &mut publish => false,
                () = async {
                    shutdown.cancelled().await;
                    sleep(self.config.shutdown_timeout).await;
                } => true,
            }
        };
        if timed_out {
            let settled = published.recorded_ids();
            let unsettled: Vec<Uuid> = ids
                .iter()
                .filter(|id| !settled.contains(id))
                .copied()
                .collect();
            tracing::warn!(worker = %self.config.worker_id, released = unsettled.len(), recorded = settled.len(), "shutdown time-out: releasing what the batch in flight has not published");
            published.settlement.released.extend(unsettled);
        }
        Batch {
            token,
            topics,
            published,
            started,
            span,
        }
    }

    /// Records a published batch's outcomes and counts them.
    async fn settle(&self, batch: Batch) -> Result<()> {
        let Batch {
            token,
            topics,
            published,
            started,
            span,
        } = batch;
        async {
            self.record(&token, &published).await?;
            published.count(self.config.relay_label(), &topics, &self.topic_labels);
            metrics::histogram!(names::BATCH_DURATION_SECONDS, names::RELAY => self.config.relay_label().to_string())
                .record(started.elapsed().as_secs_f64());
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Publishes a batch in rounds: with per-key order, each round holds at most one message
    /// per key (all of them when the sink keeps a key's run in order and stops it at its
    /// first failure), and a key whose message failed publishes nothing more in this batch.
    /// The lease is renewed while a round is out; once it is lost nothing more is published.
    async fn publish(&self, messages: Vec<Message>, lease: &mut Lease, published: &mut Published) {
        let per_key_order = self.storage.capabilities().per_key_order;
        let rounds = if per_key_order && !self.sink.capabilities().ordered_key_runs {
            split_into_rounds(messages)
        } else {
            vec![messages]
        };
        let mut stopped_keys: HashSet<String> = HashSet::new();
        for round in rounds {
            if !published.lease_lost && Instant::now() >= lease.expires {
                tracing::warn!(worker = %self.config.worker_id, "the claim's lease ran out before the batch was done; stopping it");
                published.lease_lost = true;
            }
            let (ready, held): (Vec<Message>, Vec<Message>) = round.into_iter().partition(|m| {
                !published.sink_unavailable
                    && !published.lease_lost
                    && m.key.as_ref().is_none_or(|k| !stopped_keys.contains(k))
            });
            published
                .settlement
                .released
                .extend(held.iter().map(|m| m.id));
            if ready.is_empty() {
                continue;
            }
            let started = Instant::now();
            let round = tracing::info_span!("outbox.publish", messages = ready.len());
            trace::link_messages(&round, &ready);
            let result = tokio::select! {
                result = self.sink.publish(&ready).instrument(round) => result,
                () = self.keep(lease) => {
                    // Another relay may publish these now: stop, whatever this round does.
                    published.lease_lost = true;
                    published.settlement.released.extend(ready.iter().map(|m| m.id));
                    continue;
                }
            };
            let outcomes = match result {
                Ok(outcomes) if outcomes.len() == ready.len() => outcomes,
                Ok(outcomes) => {
                    let error = Error::temporary(format!(
                        "sink broke its contract: {} outcomes for {} messages",
                        outcomes.len(),
                        ready.len()
                    ));
                    tracing::error!(worker = %self.config.worker_id, %error);
                    ready
                        .iter()
                        .map(|_| Outcome::Failed(Error::temporary(error.message())))
                        .collect()
                }
                Err(error) => {
                    let (kind, text) = (error.kind(), error.to_string());
                    ready
                        .iter()
                        .map(|_| Outcome::Failed(Error::new(kind, text.clone())))
                        .collect()
                }
            };
            let elapsed = started.elapsed();
            metrics::histogram!(names::PUBLISH_DURATION_SECONDS, names::RELAY => self.config.relay_label().to_string())
                .record(elapsed.as_secs_f64());
            tracing::debug!(worker = %self.config.worker_id, messages = ready.len(), ?elapsed, "published");
            for (message, outcome) in ready.into_iter().zip(outcomes) {
                let stopped = (message.key.as_ref()).is_some_and(|k| stopped_keys.contains(k));
                match outcome {
                    Outcome::Delivered(receipt) => {
                        if stopped {
                            tracing::error!(worker = %self.config.worker_id, id = %message.id, "sink broke its contract: a message landed after an earlier one of its key failed in the same call");
                        }
                        published.settlement.delivered.push(Delivery {
                            id: message.id,
                            receipt,
                        });
                    }
                    // Behind a failure of its key: not tried, so put back uncharged.
                    Outcome::Failed(_) if stopped => {
                        published.settlement.released.push(message.id);
                    }
                    Outcome::Failed(error) => {
                        if let Some(key) = &message.key {
                            stopped_keys.insert(key.clone());
                        }
                        self.settle_failure(&message, &error, published);
                    }
                }
            }
        }
    }

    /// Renews `lease` each time a third of it is left; resolves only once it is lost: taken
    /// over by another relay, or run out while the storage could not be reached.
    async fn keep(&self, lease: &mut Lease) {
        let length = self.config.lease;
        loop {
            sleep_until_renewal(lease.expires, length).await;
            if Instant::now() >= lease.expires {
                tracing::warn!(worker = %self.config.worker_id, "the claim's lease ran out before it could be renewed");
                return;
            }
            let asked_at = Instant::now();
            match self
                .storage
                .extend_lease(&lease.token, &lease.ids, length)
                .await
            {
                Ok(n) if n as usize == lease.ids.len() => lease.expires = asked_at + length,
                Ok(n) => {
                    tracing::warn!(worker = %self.config.worker_id, renewed = n, claimed = lease.ids.len(), "the claim was taken over; stopping the batch");
                    return;
                }
                Err(error) => {
                    tracing::warn!(worker = %self.config.worker_id, %error, "cannot renew the claim's lease; trying again");
                    sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    fn settle_failure(&self, message: &Message, error: &Error, published: &mut Published) {
        let worker = &self.config.worker_id;
        let attempt = message.attempts.saturating_add(1);
        let settlement = &mut published.settlement;
        match error.kind() {
            ErrorKind::Unavailable => {
                tracing::warn!(%worker, id = %message.id, %error, "sink unavailable; releasing without charging an attempt");
                published.sink_unavailable = true;
                settlement.released.push(message.id);
            }
            // The operator must fix the configuration or the schema: the message is not at
            // fault, so it is not charged or dead-lettered; the worker backs off as for an
            // unavailable sink until the fix.
            ErrorKind::Config | ErrorKind::Schema => {
                tracing::error!(%worker, id = %message.id, %error, "the sink reports a configuration problem; releasing without charging an attempt");
                published.sink_unavailable = true;
                settlement.released.push(message.id);
            }
            ErrorKind::Temporary if attempt < self.config.max_attempts => {
                let delay = self.config.backoff.delay(attempt);
                tracing::warn!(%worker, id = %message.id, topic = %message.topic, attempt, ?delay, %error, "publish failed; will retry");
                settlement.retries.push(Retry {
                    id: message.id,
                    delay,
                    error: error.to_string(),
                });
            }
            kind => {
                let error = if kind == ErrorKind::Temporary {
                    format!("gave up after {attempt} attempts: {error}")
                } else {
                    error.to_string()
                };
                tracing::warn!(%worker, id = %message.id, topic = %message.topic, attempt, %error, "dead-lettering message");
                settlement.dead.push(DeadLetter {
                    id: message.id,
                    error,
                });
            }
        }
    }

    /// Writes the outcomes of a batch in one atomic settlement, so no crash or error leaves
    /// a retry written without the acknowledgements and releases around it.
    async fn record(&self, token: &ClaimToken, published: &Published) -> Result<()> {
        let settlement = &published.settlement;
        if settlement.is_empty() {
            return Ok(());
        }
        let expected = settlement.len() as u64;
        let span = tracing::info_span!(
            "outbox.settle",
            delivered = settlement.delivered.len(),
            retried = settlement.retries.len(),
            dead_lettered = settlement.dead.len(),
            released = settlement.released.len(),
        );
        let applied = self
            .storage
            .settle(token, settlement)
            .instrument(span)
            .await?;
        if applied < expected {
            tracing::warn!(
                worker = %self.config.worker_id,
                refused = expected - applied,
                "claim was taken over (lease expired?); its writes were refused and another worker will deliver again"
            );
        }
        Ok(())
    }
}

/// The outcomes of a batch being written while the next batch goes out.
type Settling<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send + 'a>>;

/// Waits for the batch being settled, if any.
async fn settled(settling: &mut Option<Settling<'_>>) -> Result<()> {
    match settling.take() {
        Some(settle) => settle.await,
        None => Ok(()),
    }
}

/// A published batch: its outcomes, to record.
struct Batch {
    token: ClaimToken,
    /// Each message's topic and creation time, for the counters.
    topics: HashMap<Uuid, (String, DateTime<Utc>)>,
    published: Published,
    started: Instant,
    span: tracing::Span,
}

/// A claim's hold on its messages, as this worker counts it.
struct Lease {
    token: ClaimToken,
    ids: Vec<Uuid>,
    /// When the lease runs out, on this worker's clock (never later than the storage's).
    expires: Instant,
}

/// Sleeps until a third of a lease of `length` ending at `expires` is left.
async fn sleep_until_renewal(expires: Instant, length: Duration) {
    let renew_at = expires.checked_sub(length / 3).unwrap_or(expires);
    tokio::time::sleep_until(renew_at).await;
}

/// Splits a claimed batch so that each round holds at most one message per key, keeping
/// each key's messages in order across rounds. Messages without a key all go in the first.
fn split_into_rounds(messages: Vec<Message>) -> Vec<Vec<Message>> {
    let mut rounds: Vec<Vec<Message>> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for message in messages {
        let round = match &message.key {
            None => 0,
            Some(key) => {
                let count = seen.entry(key.clone()).or_insert(0);
                *count += 1;
                *count - 1
            }
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push(message);
    }
    rounds
}

/// Sleeps for `wait`; returns true if `shutdown` was cancelled first.
async fn sleep_or_cancel(wait: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = sleep(wait) => false,
        _ = shutdown.cancelled() => true,
    }
}

#[cfg(test)]
mod tests;
