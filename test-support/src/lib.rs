//! What the outbox test suites share, without depending on a sink crate: where the services
//! are ([`Service`]), names no other test uses ([`unique_name`]), URL surgery for putting a
//! proxy in front of a server ([`host_port`], [`through`]), a TCP [`Proxy`] that cuts,
//! stalls, holds and counts, and the fixtures' plumbing: [`clean_up`] (async clean-up from a
//! `Drop`), [`TempDir`], [`free_port`] and [`free_addr`], and how a test reads messages back
//! ([`text`], [`payloads`], [`by_key`]) and settles them ([`deliveries`]).
//!
//! Helpers for one broker are behind a feature of its name, each bringing that broker's
//! client crate only: `redis`, `amqp`, `kafka`, `nats`. `relay` (feature `relay`, bringing
//! `outbox-postgres`) is a relay over PostgreSQL with the end-to-end scripts every sink runs
//! from its own crate's tests. [`postgres_server`] (no crate, only the server's binaries)
//! starts a PostgreSQL server of the test's own.
//!
//! Every helper talks to the real services. A server that is not there makes it panic with
//! a message naming the server, its address and how to start it; nothing is skipped.

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod envelope;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
pub mod postgres_server;
mod proxy;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "relay")]
pub mod relay;
#[cfg(feature = "servers")]
pub mod servers;
mod service;
mod temp_dir;
#[cfg(feature = "tls")]
pub mod tls;

use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

pub use proxy::{Proxy, Traffic};
pub use service::{Package, Service, Start};
pub use temp_dir::TempDir;

impl Service {
    /// The `host:port` of the server (the first broker of a Kafka list).
    pub fn addr(self) -> String {
        let url = self.url();
        host_port(url.split(',').next().unwrap_or_default().trim())
    }

    /// Panics with `error`, naming the server, its address and how to start it.
    #[track_caller]
    pub fn missing(self, error: impl Display) -> ! {
        panic!(
            "{} must be running at {} (start it with `cargo xtask services`, or set {}): {error}",
            self.name(),
            outbox_core::redact_url(&self.url()),
            self.env()
        )
    }

    /// The server's URL, once something accepts connections at its address; panics (see
    /// [`Service::missing`]) when nothing does within 3 s.
    #[track_caller]
    pub fn require(self) -> String {
        let addr = self.addr();
        let connected = std::net::ToSocketAddrs::to_socket_addrs(&addr)
            .and_then(|mut addrs| {
                addrs
                    .next()
                    .ok_or_else(|| std::io::Error::other("no address"))
            })
            .and_then(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(3)));
        if let Err(error) = connected {
            self.missing(error);
        }
        self.url()
    }
}

/// PostgreSQL for tests: `$OUTBOX_TEST_POSTGRES_URL`, or the local server's `test` database.
pub fn postgres_url() -> String {
    Service::Postgres.url()
}

/// MySQL or MariaDB for tests: `$OUTBOX_TEST_MYSQL_URL`, or the local server's `test`
/// database.
pub fn mysql_url() -> String {
    Service::MySql.url()
}

/// A name no other test uses: `prefix`, an underscore and 16 random hex digits.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{:016x}", fastrand::u64(..))
}

/// A port on 127.0.0.1 that was free a moment ago, for a server of the test's own.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// `127.0.0.1:port` with a port that was free a moment ago ([`free_port`]).
pub fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// A payload as text, lossily: the suites' payloads are text, and one that is not shows as
/// what it is in the assertion that compares it.
pub fn text(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload).into_owned()
}

/// The payloads of `messages` as text ([`text`]), in order.
pub fn payloads(messages: &[outbox_core::Message]) -> Vec<String> {
    messages.iter().map(|m| text(&m.payload)).collect()
}

/// A sink's report that it published `messages`, each with the receipt `receipt` makes of it.
pub fn deliveries(
    messages: &[outbox_core::Message],
    receipt: impl Fn(&outbox_core::Message) -> String,
) -> Vec<outbox_core::Delivery> {
    let delivery = |m: &outbox_core::Message| outbox_core::Delivery {
        id: m.id,
        receipt: outbox_core::Receipt::new(receipt(m)),
    };
    messages.iter().map(delivery).collect()
}

/// Per key (`""` for none), the payloads of `published` as text, in the order they came: what
/// a per-key order assertion reads from a sink's record.
pub fn by_key(published: &[outbox_core::Message]) -> BTreeMap<String, Vec<String>> {
    let mut keys: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in published {
        keys.entry(m.key.clone().unwrap_or_default())
            .or_default()
            .push(text(&m.payload));
    }
    keys
}

/// Calls `attempt` every `every` until it gives `Ok`, and returns what it gave; after
/// `timeout`, panics with what the last `Err` said was missing.
#[track_caller]
pub fn poll<T, F>(
    timeout: Duration,
    every: Duration,
    mut attempt: impl FnMut() -> F,
) -> impl Future<Output = T>
where
    F: Future<Output = Result<T, String>>,
{
    let caller = std::panic::Location::caller();
    async move {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let missing = match attempt().await {
                Ok(done) => return done,
                Err(missing) => missing,
            };
            assert!(
                tokio::time::Instant::now() < deadline,
                "{missing} (after {timeout:?}; polled at {caller})"
            );
            tokio::time::sleep(every).await;
        }
    }
}

/// Runs a fixture's async clean-up to its end from any context, a `Drop` inside a test's
/// runtime included: a runtime cannot block inside another, so `work` runs on a thread of its
/// own with a current-thread runtime of its own, and this waits for it. What `work` returns
/// is dropped and its errors are ignored, as in any clean-up (write it with `.ok()?` in an
/// `async { …; Some(()) }`); a clean-up that panics is ignored too.
///
/// A clean-up after a failed test may find that test's transaction still open (its rollback
/// waits for the runtime this blocks): give its statements a lock timeout (PostgreSQL
/// `SET lock_timeout = '5s'`, MySQL `SET SESSION lock_wait_timeout = 5`) so that it gives up
/// rather than waits forever; what it made then stays behind, under its unique name.
pub fn clean_up<F>(work: F)
where
    F: Future + Send + 'static,
{
    let cleanup = std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        drop(runtime.block_on(work));
    });
    let _ = cleanup.join();
}

/// A URL's parts: scheme with its `://` (or empty), user info with its `@` (or empty),
/// `host[:port]`, and the rest (path, query).
fn url_parts(url: &str) -> (&str, &str, &str, &str) {
    let (scheme, rest) = match url.find("://") {
        Some(at) => url.split_at(at + 3),
        None => ("", url),
    };
    let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    let (userinfo, host) = authority.split_at(authority.rfind('@').map_or(0, |at| at + 1));
    (scheme, userinfo, host, tail)
}

/// The `host:port` a server URL such as `amqp://user:password@host:5672/vhost` names, with
/// the scheme's usual port when it names none: where to point a [`Proxy`].
pub fn host_port(url: &str) -> String {
    let (scheme, _, host, _) = url_parts(url);
    let has_port = host
        .rsplit_once(':')
        .is_some_and(|(_, port)| !port.is_empty() && !port.contains(']'));
    let default = match scheme.trim_end_matches("://") {
        "postgres" | "postgresql" => Some(5432),
        "redis" | "rediss" => Some(6379),
        "amqp" => Some(5672),
        "amqps" => Some(5671),
        "nats" | "tls" => Some(4222),
        "mysql" | "mariadb" => Some(3306),
        _ => None,
    };
    match default {
        Some(port) if !has_port => format!("{host}:{port}"),
        _ => host.to_string(),
    }
}

/// `url` with its `host[:port]` replaced by `addr`: the same server, reached through the
/// proxy at `addr`.
pub fn through(url: &str, addr: &str) -> String {
    let (scheme, userinfo, _, tail) = url_parts(url);
    format!("{scheme}{userinfo}{addr}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_pointed_at_the_proxy() {
        let url = "postgres://u:secret@db.local/test?sslmode=disable";
        assert_eq!(
            through(url, "127.0.0.1:4000"),
            "postgres://u:secret@127.0.0.1:4000/test?sslmode=disable"
        );
        assert_eq!(host_port(url), "db.local:5432");
        assert_eq!(host_port("postgres://h:6543/x"), "h:6543");
        assert_eq!(through("postgres://h/x", "p:1"), "postgres://p:1/x");
        let amqp = "amqp://guest:guest@127.0.0.1:5672/%2f";
        assert_eq!(host_port(amqp), "127.0.0.1:5672");
        assert_eq!(
            through(amqp, "127.0.0.1:1"),
            "amqp://guest:guest@127.0.0.1:1/%2f"
        );
        assert_eq!(host_port("redis://127.0.0.1"), "127.0.0.1:6379");
        assert_eq!(host_port("nats://[::1]"), "[::1]:4222");
        assert_eq!(host_port("nats://[::1]:4333"), "[::1]:4333");
        assert_eq!(host_port("127.0.0.1:9092"), "127.0.0.1:9092");
    }

    #[test]
    fn every_service_has_a_local_default() {
        for &service in Service::ALL {
            let addr = host_port(service.default_url());
            assert_eq!(
                addr,
                format!("127.0.0.1:{}", service.local_port()),
                "{service:?}"
            );
            assert!(service.env().starts_with("OUTBOX_TEST_"), "{service:?}");
        }
        assert_eq!(Service::MySql.local_port(), 3306);
    }

    #[test]
    fn unique_names_differ() {
        let (a, b) = (unique_name("t"), unique_name("t"));
        assert_ne!(a, b);
        assert!(a.starts_with("t_") && a.len() == 18, "{a}");
    }

    /// From inside a runtime (where a `Drop` runs), the clean-up has run to its end when
    /// `clean_up` returns, and one that fails or panics is ignored.
    #[tokio::test]
    async fn a_clean_up_runs_to_its_end_inside_a_runtime() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let done = Arc::new(AtomicBool::new(false));
        clean_up({
            let done = done.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                done.store(true, Ordering::SeqCst);
            }
        });
        assert!(done.load(Ordering::SeqCst));
        clean_up(async {
            None::<()>?;
            Some(())
        });
        clean_up(async { panic!("a clean-up that panics") });
    }

    #[test]
    fn a_temporary_directory_goes_with_its_files() {
        let dir = TempDir::new("outbox-test-support");
        std::fs::write(dir.file("a.db"), b"x").expect("a file in it");
        let path = dir.path().to_path_buf();
        assert!(path.is_dir());
        drop(dir);
        assert!(!path.exists());
    }
}
