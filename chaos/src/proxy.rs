//! A TCP proxy in front of a shared server, so the run can break links without touching the
//! server: cut them (drop every connection, refuse new ones) or stall them (keep connections
//! open but forward no byte), then restore them.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Link {
    Up,
    Down,
    Stalled,
}

/// The proxy's state. `epoch` grows on every cut, so a connection notices a cut even when
/// the link was restored before its task looked.
#[derive(Clone, Copy, Debug)]
struct Mode {
    link: Link,
    epoch: u64,
}

pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    /// Local ports of the live connections to the server (PostgreSQL reports them as
    /// `client_port`, which tells our relays' sessions from everyone else's).
    ports: Arc<Mutex<HashSet<u16>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(Mode {
            link: Link::Up,
            epoch: 0,
        });
        let ports = Arc::new(Mutex::new(HashSet::new()));
        let accept = tokio::spawn(accept_loop(
            listener,
            target.to_string(),
            mode.clone(),
            ports.clone(),
        ));
        Ok(Proxy {
            addr,
            mode,
            ports,
            accept,
        })
    }

    /// `127.0.0.1:port`, the address clients use instead of the server's.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Drops every live connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.mode.send_modify(|m| {
            m.link = Link::Down;
            m.epoch += 1;
        });
    }

    /// Keeps connections open but forwards nothing, like a peer that stopped answering.
    pub fn stall(&self) {
        self.mode.send_modify(|m| m.link = Link::Stalled);
    }

    pub fn restore(&self) {
        self.mode.send_modify(|m| m.link = Link::Up);
    }

    pub fn server_ports(&self) -> Vec<u16> {
        match self.ports.lock() {
            Ok(ports) => ports.iter().copied().collect(),
            Err(poisoned) => poisoned.into_inner().iter().copied().collect(),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: String,
    mode: watch::Sender<Mode>,
    ports: Arc<Mutex<HashSet<u16>>>,
) {
    while let Ok((inbound, _)) = listener.accept().await {
        if mode.borrow().link == Link::Down {
            continue; // refused: closed at once
        }
        let (target, mode, ports) = (target.clone(), mode.subscribe(), ports.clone());
        // Taken before connecting, so a cut during the connect is not missed.
        let epoch = mode.borrow().epoch;
        tokio::spawn(async move {
            let Ok(outbound) = TcpStream::connect(&target).await else {
                return;
            };
            let port = outbound.local_addr().map(|a| a.port()).unwrap_or(0);
            ports.lock().map(|mut p| p.insert(port)).ok();
            forward(inbound, outbound, mode, epoch).await;
            ports.lock().map(|mut p| p.remove(&port)).ok();
        });
    }
}

/// Forwards both ways until either side closes or the link is cut.
async fn forward(
    inbound: TcpStream,
    outbound: TcpStream,
    mut mode: watch::Receiver<Mode>,
    epoch: u64,
) {
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    tokio::select! {
        _ = pump(in_read, out_write, mode.clone()) => {}
        _ = pump(out_read, in_write, mode.clone()) => {}
        _ = mode.wait_for(|m| m.epoch != epoch) => {}
    }
}

/// Copies one direction; while the link is stalled, bytes are held (not lost) and delivered
/// once it is restored, as a congested network would.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut mode: watch::Receiver<Mode>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        if mode.wait_for(|m| m.link != Link::Stalled).await.is_err() {
            return;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if mode.wait_for(|m| m.link != Link::Stalled).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
