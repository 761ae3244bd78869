//! Serving the listener's connections with bounds, so slow or idle clients cannot keep the
//! probes out (issue 30, the slowloris finding): a connection must send each request's
//! headers within [`Limits::header_timeout`], which also bounds how long a kept-alive
//! connection may sit idle; a request must be answered within [`Limits::request_timeout`];
//! and at most [`Limits::max_connections`] are open: one more closes the oldest that has no
//! request in flight (a client that never finished its headers, or an idle one), so a probe's
//! new connection is always taken and the process keeps file descriptors for its pools.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use outbox::CancellationToken;
use outbox::metrics as names;
use tokio::net::TcpListener;
use tower::ServiceExt;

/// The bounds of [`serve`].
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest wait for a request's headers, from the connection's start or the end of the
    /// previous response (so also the longest idle time of a kept-alive connection).
    pub header_timeout: Duration,
    /// Longest time from a request's headers to its response (a body sent slowly included).
    pub request_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

impl Limits {
    /// What the relay's listener uses: probes and scrapes finish in milliseconds, the console's
    /// pages in well under a second.
    pub const DEFAULT: Limits = Limits {
        header_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(30),
        max_connections: 128,
    };
}

/// One open connection: how many of its requests are being answered, and how to close it.
struct Open {
    id: u64,
    in_flight: Arc<AtomicUsize>,
    close: CancellationToken,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Connections {
    next_id: u64,
    open: VecDeque<Open>,
}

impl Connections {
    /// Registers a new connection; at the cap, first closes the oldest one with no request in
    /// flight (else the oldest).
    fn admit(&mut self, max: usize) -> (u64, Arc<AtomicUsize>, CancellationToken) {
        while self.open.len() >= max.max(1) {
            let idle = self
                .open
                .iter()
                .position(|c| c.in_flight.load(Ordering::Acquire) == 0);
            if let Some(evicted) = self.open.remove(idle.unwrap_or(0)) {
                evicted.close.cancel();
                let (name, reason) = (names::HTTP_CONNECTIONS_CLOSED_TOTAL, names::REASON);
                metrics::counter!(name, reason => "cap").increment(1);
                tracing::debug!(
                    max,
                    "HTTP listener at its connection cap: closed the oldest connection without a request in flight"
                );
            }
        }
        self.next_id += 1;
        let (in_flight, close) = (Arc::new(AtomicUsize::new(0)), CancellationToken::new());
        self.open.push_back(Open {
            id: self.next_id,
            in_flight: in_flight.clone(),
            close: close.clone(),
        });
        (self.next_id, in_flight, close)
    }

    fn forget(&mut self, id: u64) {
        if let Some(at) = self.open.iter().position(|c| c.id == id) {
            self.open.remove(at);
        }
    }
}

/// Counts a request in flight while it lives.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn start(count: &Arc<AtomicUsize>) -> InFlight {
        count.fetch_add(1, Ordering::AcqRel);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown`; then each connection lets
/// its request in flight finish (at most `request_timeout`). Handlers can read the client's
/// address with `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let connections = Arc::new(Mutex::new(Connections::default()));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors, say: the connections held close by their
                // time-outs; try again shortly rather than spin.
                tracing::warn!(%error, "HTTP listener: cannot accept a connection; retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (id, in_flight, close) = connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(limits.max_connections);
        let (router, connections, shutdown) =
            (router.clone(), connections.clone(), shutdown.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                let guard = InFlight::start(&in_flight);
                let router = router.clone();
                async move {
                    let _guard = guard;
                    let answer =
                        tokio::time::timeout(limits.request_timeout, router.oneshot(request));
                    Ok::<Response, std::convert::Infallible>(match answer.await {
                        Ok(Ok(response)) => response,
                        Ok(Err(never)) => match never {},
                        Err(_) => {
                            (StatusCode::REQUEST_TIMEOUT, "request took too long\n").into_response()
                        }
                    })
                }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(%error, %peer, "HTTP connection ended with an error");
                    }
                }
                // Closed to make room: it had no request in flight.
                () = close.cancelled() => {}
                () = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(limits.request_timeout, connection).await;
                }
            }
            connections
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .forget(id);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::Connections;
    use std::sync::atomic::Ordering;

    #[test]
    fn at_the_cap_the_oldest_connection_without_a_request_is_closed() {
        let mut connections = Connections::default();
        let (_, busy, busy_close) = connections.admit(3);
        busy.fetch_add(1, Ordering::AcqRel); // a request in flight
        let (_, _, idle_close) = connections.admit(3);
        let (_, _, newer_close) = connections.admit(3);
        let (_, _, _) = connections.admit(3);
        assert!(idle_close.is_cancelled(), "the oldest idle one goes");
        assert!(!busy_close.is_cancelled() && !newer_close.is_cancelled());
        assert_eq!(connections.open.len(), 3);
    }

    #[test]
    fn with_every_connection_busy_the_oldest_goes() {
        let mut connections = Connections::default();
        let (first, a, a_close) = connections.admit(2);
        let (_, b, _) = connections.admit(2);
        a.fetch_add(1, Ordering::AcqRel);
        b.fetch_add(1, Ordering::AcqRel);
        connections.admit(2);
        assert!(a_close.is_cancelled());
        connections.forget(first); // its task ends later: nothing left to remove
        assert_eq!(connections.open.len(), 2);
    }
}
