//! The HTTP listener: `/metrics` (Prometheus text format), `/health/live`, `/health/ready`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox::CancellationToken;

use crate::Failure;
use crate::relay::Relay;

/// How long a health check waits for each storage and sink.
const READY_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the health checks behind `/health/ready` run: a probe reads their last result,
/// so probes cost no I/O however often they come.
const READY_INTERVAL: Duration = Duration::from_secs(5);

/// Installs the Prometheus recorder that the worker's metrics go to.
pub fn install_metrics() -> Result<PrometheusHandle, Failure> {
    const LATENCY_BUCKETS: [f64; 12] = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
    ];
    PrometheusBuilder::new()
        .set_buckets(&LATENCY_BUCKETS)
        .map_err(|e| Failure::Runtime(format!("metrics: {e}")))?
        .install_recorder()
        .map_err(|e| Failure::Runtime(format!("cannot install the metrics recorder: {e}")))
}

/// What `/health/ready` answers: the problems the last health checks found, or that the
/// relays are still being built.
#[derive(Clone)]
pub struct Readiness(Arc<std::sync::RwLock<Option<Vec<String>>>>);

impl Readiness {
    /// Not ready: the relays are being built.
    pub fn starting() -> Self {
        Readiness(Arc::new(std::sync::RwLock::new(None)))
    }

    /// Checks every relay's storage and sink now and every [`READY_INTERVAL`] until
    /// shutdown, keeping the last result for the probes.
    pub async fn watch(self, relays: Arc<Vec<Relay>>, shutdown: CancellationToken) {
        loop {
            let problems = check(&relays).await;
            *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(problems);
            tokio::select! {
                () = tokio::time::sleep(READY_INTERVAL) => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    fn answer(&self) -> (StatusCode, String) {
        match &*self.0.read().unwrap_or_else(|e| e.into_inner()) {
            None => (
                StatusCode::SERVICE_UNAVAILABLE,
                "starting: building the storages and sinks\n".into(),
            ),
            Some(problems) if problems.is_empty() => (StatusCode::OK, "ready\n".into()),
            Some(problems) => (StatusCode::SERVICE_UNAVAILABLE, problems.join("\n") + "\n"),
        }
    }
}

#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    readiness: Readiness,
}

/// Binds `addr` now (so a taken port is an error at start-up) and serves until shutdown:
/// `/health/live` answers from here on, before any storage or sink is built.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<(), Failure> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Failure::Config(format!(
            "observability.listen: cannot listen on {addr}: {e}"
        ))
    })?;
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/health/live", get(|| async { "live\n" }))
        .route("/health/ready", get(ready))
        .with_state(AppState { metrics, readiness });
    tracing::info!(%addr, "serving /metrics and /health");
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "HTTP listener failed");
        }
    });
    Ok(())
}

async fn render_metrics(State(state): State<AppState>) -> String {
    state.metrics.render()
}

/// Ready once the relays are built and the last health checks found every storage and
/// sink answering.
async fn ready(State(state): State<AppState>) -> (StatusCode, String) {
    state.readiness.answer()
}

/// The health checks of every relay's storage and sink: what is wrong with each, if any.
async fn check(relays: &[Relay]) -> Vec<String> {
    let mut problems = Vec::new();
    for relay in relays {
        match tokio::time::timeout(READY_TIMEOUT, relay.storage.health()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(format!("relay {}: storage: {e}", relay.def.name)),
            Err(_) => problems.push(format!(
                "relay {}: storage: no answer within {READY_TIMEOUT:?}",
                relay.def.name
            )),
        }
        match tokio::time::timeout(READY_TIMEOUT, relay.sink.health()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(format!("relay {}: sink: {e}", relay.def.name)),
            Err(_) => problems.push(format!(
                "relay {}: sink: no answer within {READY_TIMEOUT:?}",
                relay.def.name
            )),
        }
    }
    problems
}
