//! The HTTP listener against slow clients (issue 30, the security review's slowloris
//! finding): with a file-descriptor limit that half-open connections would exhaust, the
//! liveness probe still answers at once, and a connection that never finishes its headers is
//! closed after the header time-out (10 s).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{ConfigFile, drop_schema, free_port, outbox, pool, storage_section};
use outbox_tests::unique_name;

/// Connections that send part of a request's headers and then nothing.
const SLOW_CLIENTS: usize = 300;

fn slow_client(addr: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect to the listener");
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
        .expect("send half the headers");
    stream
}

/// `GET /health/live` with a short time-out: the status, or why there was none.
fn probe(addr: &str) -> Result<u16, String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET /health/live HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("no answer within 2 s: {e}"))?;
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not an HTTP response: {response:?}"))
}

// Blocking sockets on the test's own thread: nothing else runs on its runtime meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probes_answer_while_slow_clients_hold_connections() {
    let pool = pool().await;
    let schema = unique_name("cli_slowloris");
    let addr = format!("127.0.0.1:{}", free_port());
    let dir = std::env::temp_dir().join(&schema);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = ConfigFile::new(&format!(
        "{}[observability]\nlisten = \"{addr}\"\n[sink]\ntype = \"file\"\npath = \"{}\"\n",
        storage_section(&schema),
        dir.join("out.jsonl").display()
    ));
    assert!(outbox(&config.path, &["migrate"]).status.success());
    // 256 descriptors: fewer than the slow clients, as a container's limit is fewer than an
    // attacker's sockets.
    let mut relay = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -n 256 && exec {} --config {} relay",
            env!("CARGO_BIN_EXE_outbox"),
            config.path.display()
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the relay");
    let deadline = Instant::now() + Duration::from_secs(20);
    while probe(&addr) != Ok(200) {
        assert!(
            Instant::now() < deadline,
            "the relay never answered on {addr}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let held: Vec<TcpStream> = (0..SLOW_CLIENTS).map(|_| slow_client(&addr)).collect();
    std::thread::sleep(Duration::from_millis(500));
    for attempt in 0..3 {
        assert_eq!(
            probe(&addr),
            Ok(200),
            "probe {attempt} while {SLOW_CLIENTS} slow clients hold connections"
        );
    }
    drop(held);

    // One slow client alone (no cap reached): closed by the header time-out, not before.
    let mut slow = slow_client(&addr);
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read time-out");
    let started = Instant::now();
    let mut byte = [0u8; 1];
    let read = slow.read(&mut byte);
    let waited = started.elapsed();
    assert!(
        matches!(read, Ok(0))
            || read
                .as_ref()
                .is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut),
        "the server did not close a connection whose headers never came: {read:?} after {waited:?}"
    );
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_secs(15),
        "closed after {waited:?}; the header time-out is 10 s"
    );
    super::sigterm(&relay);
    let _ = relay.wait();
    let _ = std::fs::remove_dir_all(&dir);
    drop_schema(&pool, &schema).await;
}
