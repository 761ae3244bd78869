//! `outbox relay`: runs every configured relay until SIGTERM or SIGINT.

use std::sync::Arc;
use std::time::Duration;

use outbox::metrics as names;
use outbox::{CancellationToken, RunHealth, Sink, Storage, StorageAdmin, Worker};

use crate::Failure;
use crate::config::{Config, RelayDef};
use crate::console::watch::{Watch, WatchedSink};

/// How often the queue gauges are refreshed.
const STATS_EVERY: Duration = Duration::from_secs(5);

/// A relay ready to run: its storage and sink are built, its settings valid.
pub struct Relay {
    pub storage: Arc<dyn StorageAdmin>,
    pub sink: Arc<dyn Sink>,
    pub def: RelayDef,
    /// What the console shows of this relay's worker: its health gate, backoff, last
    /// error and deliveries, recorded by the [`WatchedSink`] the worker publishes through.
    pub watch: Arc<Watch>,
    /// How its worker's runs go: `/health/ready` fails after several failed in a row.
    pub runs: RunHealth,
}

/// Builds the storage of `def` from the registry; a bad setting is a configuration error
/// that names its key where the file has it. Storages connect lazily: nothing is reached yet.
pub async fn open_storage(def: &RelayDef) -> Result<Arc<dyn StorageAdmin>, Failure> {
    outbox::backends::storages()
        .build(&def.storage_type, def.storage.clone())
        .await
        .map_err(|error| match error.kind() {
            outbox::ErrorKind::Config => Failure::Config(format!(
                "relay `{}`: {}",
                def.name,
                error.in_section(&def.storage_key).message()
            )),
            _ => Failure::Runtime(format!(
                "relay `{}`: cannot open the storage: {error}",
                def.name
            )),
        })
}

/// Builds the storage and the sink of every relay; configuration errors come out here. With
/// `wait_for_broker`, a sink whose broker cannot be reached yet is retried with backoff (a
/// relay may start before its broker) until it answers or that token is cancelled.
pub async fn build(
    config: &Config,
    wait_for_broker: Option<&CancellationToken>,
) -> Result<Vec<Relay>, Failure> {
    let registry = outbox::backends::sinks();
    let mut relays = Vec::new();
    for def in &config.relays {
        let storage = open_storage(def).await?;
        let mut failures = 0;
        let sink = loop {
            let error = match registry.build(&def.sink_type, def.sink.clone()).await {
                Ok(sink) => break sink,
                Err(error) => error,
            };
            let retry = wait_for_broker.filter(|_| error.kind() == outbox::ErrorKind::Unavailable);
            match (error.kind(), retry) {
                (outbox::ErrorKind::Config, _) => {
                    return Err(Failure::Config(format!(
                        "relay `{}`: {}",
                        def.name,
                        error.in_section(&def.sink_key).message()
                    )));
                }
                (_, None) => {
                    return Err(Failure::Runtime(format!(
                        "relay `{}`: cannot start sink `{}`: {error}",
                        def.name, def.sink_type
                    )));
                }
                (_, Some(shutdown)) => {
                    failures += 1;
                    let wait = def.worker.backoff.delay(failures);
                    tracing::warn!(relay = %def.name, %error, ?wait, "broker unavailable at start-up; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.cancelled() => return Err(Failure::Runtime("stopped before the broker answered".into())),
                    }
                }
            }
        };
        // The worker's own checks, such as a lease that cannot cover the worst batch of this
        // storage and sink, are configuration errors of this relay.
        if let Err(error) = Worker::new(
            def.worker.clone(),
            storage.clone() as Arc<dyn Storage>,
            sink.clone(),
        ) {
            return Err(Failure::Config(format!(
                "relay `{}`: {}",
                def.name,
                error.in_section(&def.key).message()
            )));
        }
        relays.push(Relay {
            storage,
            sink,
            watch: Arc::new(Watch::new(def.worker.backoff)),
            runs: RunHealth::default(),
            def: def.clone(),
        });
    }
    Ok(relays)
}

pub async fn run(config: Config) -> Result<(), Failure> {
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            wait_for_signal().await;
            tracing::info!("shutting down: finishing the batches in flight");
            shutdown.cancel();
        }
    });
    // Listen first: a probe of liveness is answered while the sinks are built (a broker
    // that is down at start-up holds this process here, retrying).
    let metrics = crate::http::install_metrics()?;
    metrics::gauge!(names::BUILD_INFO, names::VERSION => env!("CARGO_PKG_VERSION")).set(1.0);
    let readiness = crate::http::Readiness::starting();
    if let Some(addr) = config.observability.listen {
        crate::http::serve(
            addr,
            &config.observability,
            metrics,
            readiness.clone(),
            shutdown.clone(),
        )
        .await?;
    }
    let relays = match build(&config, Some(&shutdown)).await {
        Ok(relays) => Arc::new(relays),
        // Asked to stop while a broker was still down: a stop, not a failure.
        Err(_) if shutdown.is_cancelled() => {
            tracing::info!("stopped before every broker answered");
            return Ok(());
        }
        Err(failure) => return Err(failure),
    };
    tokio::spawn(readiness.watch(relays.clone(), shutdown.clone()));
    let mut tasks = Vec::new();
    for relay in relays.iter().filter(|r| r.def.migrate) {
        if !migrate_when_reachable(relay, &shutdown).await? {
            tracing::info!("stopped before every database answered");
            return Ok(());
        }
    }
    for relay in relays.iter() {
        // The worker's sink is watched; the health checks of /health/ready use the bare
        // one, so the console's health gate is the worker's own.
        let sink = WatchedSink::new(relay.sink.clone(), relay.watch.clone());
        let worker = Worker::new(
            relay.def.worker.clone(),
            relay.storage.clone() as Arc<dyn Storage>,
            Arc::new(sink),
        )?
        .with_run_health(relay.runs.clone());
        tracing::info!(
            relay = %relay.def.name,
            storage = %relay.storage.describe(),
            sink = %relay.def.sink_type,
            "relay starting"
        );
        let token = shutdown.clone();
        tasks.push(tokio::spawn(async move { worker.run(token).await }));
        tasks.push(tokio::spawn(report_stats(
            relay.def.name.clone(),
            relay.def.worker.relay_label().to_string(),
            relay.storage.clone(),
            config.observability.summary_interval,
            shutdown.clone(),
        )));
    }
    shutdown.cancelled().await;
    for task in tasks {
        let _ = task.await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Runs a `migrate = true` relay's migrations, retrying with backoff while its database cannot
/// be reached (a relay may start before its database, as before its broker). `false`: asked
/// to stop before the database answered.
async fn migrate_when_reachable(
    relay: &Relay,
    shutdown: &CancellationToken,
) -> Result<bool, Failure> {
    let mut failures = 0;
    loop {
        let error = match relay.storage.migrate().await {
            Ok(()) => return Ok(true),
            Err(error) if error.kind() == outbox::ErrorKind::Unavailable => error,
            Err(error) => return Err(error.into()),
        };
        failures += 1;
        let wait = relay.def.worker.backoff.delay(failures);
        tracing::warn!(relay = %relay.def.name, %error, ?wait, "database unavailable at start-up; retrying the migrations");
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => return Ok(false),
        }
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Refreshes the queue gauges (labelled with the relay's name, as its worker's figures are) every
/// few seconds and logs a summary now and then. The figures are shared by every replica of
/// the storage (one of them counts per interval), so each replica exports the same values.
async fn report_stats(
    name: String,
    label: String,
    storage: Arc<dyn StorageAdmin>,
    summary_every: Duration,
    shutdown: CancellationToken,
) {
    let mut last_summary = tokio::time::Instant::now();
    loop {
        // Shared: of all the replicas on this storage, one counts per interval.
        match storage.shared_stats(STATS_EVERY).await {
            Ok(stats) => {
                let age = stats
                    .oldest_pending
                    .map(|t| (chrono_now() - t.timestamp_millis()).max(0) as f64 / 1000.0)
                    .unwrap_or(0.0);
                metrics::gauge!(names::PENDING, names::RELAY => label.clone())
                    .set(stats.pending as f64);
                metrics::gauge!(names::IN_FLIGHT, names::RELAY => label.clone())
                    .set(stats.in_flight as f64);
                metrics::gauge!(names::RETRYING, names::RELAY => label.clone())
                    .set(stats.retrying as f64);
                metrics::gauge!(names::DEAD_LETTERED, names::RELAY => label.clone())
                    .set(stats.dead_lettered as f64);
                metrics::gauge!(names::PARKED_KEYS, names::RELAY => label.clone())
                    .set(stats.parked_keys as f64);
                metrics::gauge!(names::OLDEST_PENDING_AGE_SECONDS, names::RELAY => label.clone())
                    .set(age);
                if last_summary.elapsed() >= summary_every {
                    last_summary = tokio::time::Instant::now();
                    tracing::info!(
                        relay = %name,
                        pending = stats.pending,
                        in_flight = stats.in_flight,
                        retrying = stats.retrying,
                        dead_lettered = stats.dead_lettered,
                        parked_keys = stats.parked_keys,
                        oldest_pending_age_s = age,
                        "summary"
                    );
                }
            }
            Err(error) => tracing::warn!(relay = %name, %error, "cannot read queue figures"),
        }
        // Only storages that wait for older transactions answer; the others have no horizon.
        match storage.horizon().await {
            Ok(Some(horizon)) => {
                metrics::gauge!(names::HORIZON_WAITING, names::RELAY => label.clone())
                    .set(horizon.waiting as f64);
                metrics::gauge!(names::HORIZON_HELD_SECONDS, names::RELAY => label.clone())
                    .set(horizon.held_for.map_or(0.0, |d| d.as_secs_f64()));
            }
            Ok(None) => {}
            Err(error) => tracing::warn!(relay = %name, %error, "cannot read the horizon"),
        }
        tokio::select! {
            _ = tokio::time::sleep(STATS_EVERY) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

fn chrono_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
