//! A TCP proxy in front of a real server, so that a test (or the chaos run) can break the
//! link without touching the shared server, and see what went over it.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Link {
    Up,
    /// Live connections dropped, new ones closed at once.
    Down,
    /// Nothing forwarded either way.
    Stalled,
    /// What clients send is forwarded; the server's replies are held back.
    Held,
}

impl Link {
    /// Whether bytes going this way wait.
    fn blocks(self, to_server: bool) -> bool {
        match self {
            Link::Stalled => true,
            Link::Held => !to_server,
            Link::Up | Link::Down => false,
        }
    }
}

/// The proxy's state. `epoch` grows whenever live connections are dropped, so a connection
/// notices even when the link was restored before its task looked.
#[derive(Clone, Copy, Debug)]
struct Mode {
    link: Link,
    epoch: u64,
}

/// What went through a [`Proxy`] since it started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Connections forwarded to the server.
    pub connections: usize,
    /// Round trips: data from a client that follows a reply of the server, or opens the
    /// connection. A client that pipelines its requests makes one turn of many.
    pub turns: usize,
    /// Bytes forwarded from clients to the server.
    pub to_server: u64,
    /// Bytes forwarded from the server to clients.
    pub to_client: u64,
}

#[derive(Default)]
struct Shared {
    traffic: Traffic,
    /// Local ports of the live connections to the server.
    ports: HashSet<u16>,
    /// What clients sent, per connection in the order they were made, when recording.
    requests: Option<Vec<Vec<u8>>>,
}

/// A TCP proxy on a free port of 127.0.0.1 in front of a real server. It can cut the link
/// (drop every connection, refuse new ones), stall it (forward nothing), hold the server's
/// replies back, and restore it; it counts connections, round trips and bytes, and can keep
/// what clients sent.
pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    shared: Arc<Mutex<Shared>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> Proxy {
        Self::try_start(target)
            .await
            .unwrap_or_else(|e| panic!("cannot start a proxy to {target}: {e}"))
    }

    /// Like [`Proxy::start`], and keeps everything clients send (see [`Proxy::requests`]).
    pub async fn recording(target: &str) -> Proxy {
        let proxy = Self::start(target).await;
        proxy.shared().requests = Some(Vec::new());
        proxy
    }

    /// Like [`Proxy::start`], returning the error instead of panicking.
    pub async fn try_start(target: &str) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(Mode {
            link: Link::Up,
            epoch: 0,
        });
        let shared = Arc::new(Mutex::new(Shared::default()));
        let accept = tokio::spawn(accept_loop(
            listener,
            target.to_string(),
            mode.clone(),
            shared.clone(),
        ));
        Ok(Proxy {
            addr,
            mode,
            shared,
            accept,
        })
    }

    /// `127.0.0.1:port`, the address clients use instead of the server's.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Drops every live connection and closes new ones at once, until [`Proxy::restore`].
    pub fn cut(&self) {
        self.mode.send_modify(|m| {
            m.link = Link::Down;
            m.epoch += 1;
        });
    }

    /// Drops every live connection, as a server restart would; new ones go through.
    pub fn drop_connections(&self) {
        self.mode.send_modify(|m| m.epoch += 1);
    }

    /// Keeps connections open (and accepts new ones) but forwards nothing either way, like a
    /// peer that stopped answering. Bytes are held, not lost: they go on after
    /// [`Proxy::restore`], as over a congested network.
    pub fn stall(&self) {
        self.mode.send_modify(|m| m.link = Link::Stalled);
    }

    /// Forwards what clients send but holds the server's replies back (until
    /// [`Proxy::restore`]): a server that takes requests and never answers.
    pub fn hold(&self) {
        self.mode.send_modify(|m| m.link = Link::Held);
    }

    /// Forwards everything again.
    pub fn restore(&self) {
        self.mode.send_modify(|m| m.link = Link::Up);
    }

    /// What went through so far.
    pub fn traffic(&self) -> Traffic {
        self.shared().traffic.clone()
    }

    /// The local ports of the live connections to the server (PostgreSQL reports them as
    /// `client_port`, which tells the sessions that came through this proxy from others).
    pub fn server_ports(&self) -> Vec<u16> {
        self.shared().ports.iter().copied().collect()
    }

    /// What clients sent, one byte string per connection in the order they were made; empty
    /// unless the proxy was started with [`Proxy::recording`].
    pub fn requests(&self) -> Vec<Vec<u8>> {
        self.shared().requests.clone().unwrap_or_default()
    }

    fn shared(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop(
    listener: TcpListener,
    target: String,
    mode: watch::Sender<Mode>,
    shared: Arc<Mutex<Shared>>,
) {
    while let Ok((inbound, _)) = listener.accept().await {
        if mode.borrow().link == Link::Down {
            continue; // refused: closed at once
        }
        let (target, mode, shared) = (target.clone(), mode.subscribe(), shared.clone());
        // Taken before connecting, so that a cut during the connect is not missed.
        let epoch = mode.borrow().epoch;
        tokio::spawn(async move {
            let Ok(outbound) = TcpStream::connect(&target).await else {
                return; // the client sees its connection closed
            };
            let port = outbound.local_addr().map_or(0, |a| a.port());
            let connection = {
                let mut shared = lock(&shared);
                shared.traffic.connections += 1;
                shared.ports.insert(port);
                shared.requests.as_mut().map(|requests| {
                    requests.push(Vec::new());
                    requests.len() - 1
                })
            };
            let tap = Tap {
                shared: shared.clone(),
                connection,
                server_spoke: AtomicBool::new(true),
            };
            forward(inbound, outbound, mode, epoch, &tap).await;
            lock(&shared).ports.remove(&port);
        });
    }
}

/// Counts (and records) what one connection carries.
struct Tap {
    shared: Arc<Mutex<Shared>>,
    /// The connection's place among the recorded requests, when recording.
    connection: Option<usize>,
    /// Whether the server sent something since the client last did.
    server_spoke: AtomicBool,
}

impl Tap {
    fn carried(&self, to_server: bool, bytes: &[u8]) {
        let mut shared = lock(&self.shared);
        if to_server {
            if self.server_spoke.swap(false, Ordering::SeqCst) {
                shared.traffic.turns += 1;
            }
            shared.traffic.to_server += bytes.len() as u64;
            if let (Some(requests), Some(at)) = (shared.requests.as_mut(), self.connection) {
                requests[at].extend_from_slice(bytes);
            }
        } else {
            self.server_spoke.store(true, Ordering::SeqCst);
            shared.traffic.to_client += bytes.len() as u64;
        }
    }
}

/// Forwards both ways until either side closes or the live connections are dropped.
async fn forward(
    inbound: TcpStream,
    outbound: TcpStream,
    mut mode: watch::Receiver<Mode>,
    epoch: u64,
    tap: &Tap,
) {
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    tokio::select! {
        _ = pump(in_read, out_write, true, mode.clone(), tap) => {}
        _ = pump(out_read, in_write, false, mode.clone(), tap) => {}
        _ = mode.wait_for(|m| m.epoch != epoch) => {}
    }
}

/// Copies one way; while the link blocks this way, bytes wait.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    to_server: bool,
    mut mode: watch::Receiver<Mode>,
    tap: &Tap,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        if mode.wait_for(|m| !m.link.blocks(to_server)).await.is_err() {
            return;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if mode.wait_for(|m| !m.link.blocks(to_server)).await.is_err() {
            return;
        }
        tap.carried(to_server, &buffer[..n]);
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A server that answers every read with what it read, upper-cased.
    async fn echo() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buffer = [0u8; 1024];
                    while let Ok(n @ 1..) = socket.read(&mut buffer).await {
                        let reply = buffer[..n].to_ascii_uppercase();
                        if socket.write_all(&reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    /// A proxy in front of [`echo`] and a connection through it that went through once.
    async fn connected() -> (Proxy, TcpStream) {
        let proxy = Proxy::start(&echo().await).await;
        let mut socket = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(ask(&mut socket, "a").await.unwrap(), "A");
        (proxy, socket)
    }

    async fn ask(socket: &mut TcpStream, text: &str) -> std::io::Result<String> {
        socket.write_all(text.as_bytes()).await?;
        let mut buffer = vec![0u8; text.len()];
        socket.read_exact(&mut buffer).await?;
        Ok(String::from_utf8(buffer).unwrap())
    }

    async fn closed(socket: &mut TcpStream) -> bool {
        let mut buffer = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), socket.read(&mut buffer));
        matches!(read.await, Ok(Ok(0) | Err(_)))
    }

    async fn silent(socket: &mut TcpStream) -> bool {
        let mut buffer = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_millis(300), socket.read(&mut buffer));
        read.await.is_err()
    }

    #[tokio::test]
    async fn forwards_counts_and_records() {
        let proxy = Proxy::recording(&echo().await).await;
        let mut socket = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(ask(&mut socket, "ping").await.unwrap(), "PING");
        assert_eq!(ask(&mut socket, "pong").await.unwrap(), "PONG");
        let traffic = proxy.traffic();
        assert_eq!(
            traffic,
            Traffic {
                connections: 1,
                turns: 2,
                to_server: 8,
                to_client: 8
            }
        );
        assert_eq!(proxy.requests(), [b"pingpong".to_vec()]);
        assert_eq!(proxy.server_ports().len(), 1);
    }

    #[tokio::test]
    async fn a_cut_drops_connections_and_refuses_new_ones_until_restored() {
        let (proxy, mut socket) = connected().await;
        proxy.cut();
        assert!(closed(&mut socket).await, "live connection dropped");
        let mut refused = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(closed(&mut refused).await, "new connection closed at once");
        proxy.restore();
        let mut socket = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(ask(&mut socket, "b").await.unwrap(), "B");
        assert_eq!(proxy.traffic().connections, 2);
    }

    #[tokio::test]
    async fn dropped_connections_come_back_at_once() {
        let (proxy, mut socket) = connected().await;
        proxy.drop_connections();
        assert!(closed(&mut socket).await);
        let mut socket = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(ask(&mut socket, "b").await.unwrap(), "B");
    }

    #[tokio::test]
    async fn a_stall_forwards_nothing_until_restored() {
        let (proxy, mut socket) = connected().await;
        proxy.stall();
        socket.write_all(b"b").await.unwrap();
        assert!(silent(&mut socket).await);
        assert_eq!(proxy.traffic().to_server, 1, "nothing reached the server");
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        new.write_all(b"c").await.unwrap();
        assert!(silent(&mut new).await, "new connections are stalled too");
        proxy.restore();
        let mut reply = [0u8; 1];
        socket.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"B", "held, not lost");
        new.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"C");
    }

    #[tokio::test]
    async fn a_hold_lets_requests_through_and_keeps_the_replies() {
        let (proxy, mut socket) = connected().await;
        proxy.hold();
        socket.write_all(b"b").await.unwrap();
        socket.write_all(b"c").await.unwrap();
        assert!(silent(&mut socket).await);
        assert_eq!(proxy.traffic().to_server, 3, "requests reached the server");
        assert_eq!(proxy.traffic().turns, 2, "b and c in one turn");
        proxy.restore();
        let mut reply = [0u8; 2];
        socket.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"BC");
    }

    #[tokio::test]
    async fn dropping_the_proxy_drops_its_connections() {
        let (proxy, mut socket) = connected().await;
        drop(proxy);
        assert!(closed(&mut socket).await);
    }
}
