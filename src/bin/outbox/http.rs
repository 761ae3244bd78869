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

/// How long a readiness probe waits for each storage and sink.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

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

#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    relays: Arc<Vec<Relay>>,
}

/// Binds `addr` now (so a taken port is an error at start-up) and serves until shutdown.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    relays: Arc<Vec<Relay>>,
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
        .with_state(AppState { metrics, relays });
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

/// Ready only when every relay's storage and sink answer.
async fn ready(State(state): State<AppState>) -> (StatusCode, String) {
    let mut problems = Vec::new();
    for relay in state.relays.iter() {
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
    if problems.is_empty() {
        (StatusCode::OK, "ready\n".into())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, problems.join("\n") + "\n")
    }
}
