//! Servers of a test's own: a `redis-server`, a `nats-server` with JetStream or a RabbitMQ
//! node, on a free port of its own with its data in the test's directory, which the test
//! stops (cleanly, or with SIGKILL as in a crash) and starts again on the same port and the
//! same data. The shared services on the standard ports are never touched.
//!
//! A [`Server`] runs in a process group of its own (a RabbitMQ node is a shell script, the
//! Erlang VM and its helpers); everything in the group is killed when the value is dropped.
//! Its output, over every start, goes to a log file in its directory, whose end a failure
//! message shows. A program that is not installed, or a server that does not open its port
//! in time, fails the test with a message naming it.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to open its port, unless [`Server::start_deadline`] says
/// otherwise.
const START_DEADLINE: Duration = Duration::from_secs(20);
/// How long a server may take to exit after SIGTERM before it is killed.
const STOP_DEADLINE: Duration = Duration::from_secs(30);
/// A RabbitMQ node usually opens its port 5–10 s after it starts.
const RABBITMQ_START_DEADLINE: Duration = Duration::from_secs(60);

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// A server process of the test's own: one program, its arguments and environment, the port
/// it listens on, its directory. [`start`](Server::start) runs it and waits for its port;
/// [`stop`](Server::stop) and [`kill`](Server::kill) end it; `start` again runs it with the
/// same arguments, port and data.
pub struct Server {
    program: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    dir: PathBuf,
    port: u16,
    log: PathBuf,
    start_deadline: Duration,
    /// Stop it with SIGTERM when dropped, rather than kill it (a RabbitMQ node then leaves
    /// epmd in order).
    stop_on_drop: bool,
    child: Option<Child>,
    starts: u32,
}

impl Server {
    /// `program`, not started yet, with a free port (see [`Server::port`]: the caller puts
    /// it in the arguments) and `dir` (created) for its data and its log.
    pub fn new(program: impl Into<PathBuf>, dir: &Path) -> Server {
        let program = program.into();
        std::fs::create_dir_all(dir)
            .unwrap_or_else(|e| panic!("creating the server directory {}: {e}", dir.display()));
        let name = program
            .file_name()
            .map_or_else(|| "server".into(), |n| n.to_string_lossy().into_owned());
        Server {
            log: dir.join(format!("{name}.log")),
            program,
            args: Vec::new(),
            envs: Vec::new(),
            dir: dir.to_path_buf(),
            port: free_port(),
            start_deadline: START_DEADLINE,
            stop_on_drop: false,
            child: None,
            starts: 0,
        }
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Server {
        self.args.push(arg.into());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(mut self, args: I) -> Server
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets a variable of its environment.
    pub fn env(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> Server {
        self.envs.push((name.into(), value.into()));
        self
    }

    /// How long [`start`](Server::start) waits for the port.
    pub fn start_deadline(mut self, deadline: Duration) -> Server {
        self.start_deadline = deadline;
        self
    }

    /// The port it listens on (the one it is waited for on).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:`[`port`](Server::port).
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file its output goes to.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of its output, for a failure message.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Whether its process is running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// Starts it and waits until its port accepts connections; returns how long that took.
    /// Panics, with the end of its output, when it exits first or the port stays closed past
    /// the start deadline.
    pub async fn start(&mut self) -> Duration {
        assert!(!self.is_running(), "{} is running already", self.what());
        let started = Instant::now();
        let output = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("opening {}: {e}", self.log.display()));
        self.starts += 1;
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(output.try_clone().expect("the log file"))
            .stderr(output)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {} ({e}); `cargo xtask services` installs it",
                    self.program.display()
                )
            });
        self.child = Some(child);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                break;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                panic!(
                    "{} exited ({status}) before opening port {}:\n{}",
                    self.what(),
                    self.port,
                    self.log_tail(30)
                );
            }
            if started.elapsed() > self.start_deadline {
                self.signal(libc::SIGKILL);
                let tail = self.log_tail(30);
                self.reap();
                panic!(
                    "{} did not open port {} within {:?}:\n{tail}",
                    self.what(),
                    self.port,
                    self.start_deadline
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        started.elapsed()
    }

    /// Stops it as an operator's restart does: SIGTERM, and waits for it to exit (killed
    /// after 30 s). Returns how long it took.
    pub async fn stop(&mut self) -> Duration {
        let started = Instant::now();
        self.signal_leader(libc::SIGTERM);
        while self.is_running() {
            if started.elapsed() > STOP_DEADLINE {
                self.signal(libc::SIGKILL);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // What the leader left behind, if anything.
        self.signal(libc::SIGKILL);
        self.reap();
        started.elapsed()
    }

    /// Kills it with SIGKILL, every process of its group at once, as a crash would, and
    /// waits for it to be gone.
    pub async fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        while self.is_running() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.reap();
    }

    /// `redis-server (port 41234, started 2 times)`.
    fn what(&self) -> String {
        format!(
            "{} (port {}, started {} time(s); output in {})",
            self.program.display(),
            self.port,
            self.starts,
            self.log.display()
        )
    }

    /// Sends `signal` to the whole process group.
    fn signal(&self, signal: libc::c_int) {
        if let Some(child) = &self.child {
            // SAFETY: kill(2) on the process group this launcher made; no memory involved.
            unsafe { libc::kill(-(child.id() as libc::pid_t), signal) };
        }
    }

    /// Sends `signal` to the group's leader only (a start script passes SIGTERM on to the
    /// server and waits for it).
    fn signal_leader(&self, signal: libc::c_int) {
        if let Some(child) = &self.child {
            // SAFETY: kill(2) on the process this launcher started; no memory involved.
            unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        }
    }

    /// Waits for the (signalled) leader and forgets it.
    fn reap(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_none() {
            return;
        }
        if self.stop_on_drop {
            self.signal_leader(libc::SIGTERM);
            let deadline = Instant::now() + STOP_DEADLINE;
            while self.is_running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.signal(libc::SIGKILL);
        self.reap();
    }
}

/// `redis-server` on 127.0.0.1 and a port of its own, its data in `dir`: every write is
/// appended to the AOF and synced before Redis replies (`appendonly yes`, `appendfsync
/// always`), so a kill loses nothing Redis acknowledged and a restart loads it all again;
/// no RDB snapshots. Its URL is `redis://` + [`Server::addr`].
pub fn redis(dir: &Path) -> Server {
    let server = Server::new("redis-server", dir);
    let port = server.port().to_string();
    server
        .args(["--port", port.as_str(), "--bind", "127.0.0.1"])
        .args([
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ])
        .arg("--dir")
        .arg(dir)
}

/// `nats-server` with JetStream on 127.0.0.1 and a port of its own, storing streams under
/// `dir`, so a file-backed stream and its messages survive a restart. More arguments (TLS)
/// may follow. Its URL is `nats://` + [`Server::addr`].
pub fn nats(dir: &Path) -> Server {
    let server = Server::new("nats-server", dir);
    let port = server.port().to_string();
    server
        .args(["-a", "127.0.0.1", "-p", port.as_str(), "-js", "-sd"])
        .arg(dir.join("jetstream"))
}

/// The real start script: Debian's `/usr/sbin/rabbitmq-server` re-runs it as the `rabbitmq`
/// user when called by root, which could not write the test's directory.
fn rabbitmq_server() -> PathBuf {
    let script = Path::new("/usr/lib/rabbitmq/bin/rabbitmq-server");
    if script.exists() {
        return script.into();
    }
    "rabbitmq-server".into()
}

/// A RabbitMQ node of the test's own: its own node name, distribution port, data
/// (`mnesia`: durable queues and persistent messages survive a restart), logs,
/// configuration and Erlang cookie, all in `dir`, so it shares nothing with the shared node
/// but the machine's epmd, where each registers under its own name. `listeners` gives the
/// listener lines of `rabbitmq.conf` for the node's port: `listeners.tcp.default =
/// 127.0.0.1:{port}` for plain AMQP (user `guest`, from 127.0.0.1 only, as usual), or a TLS
/// listener. It stops with SIGTERM (a clean shutdown) when dropped.
pub fn rabbitmq(dir: &Path, listeners: impl FnOnce(u16) -> String) -> Server {
    let server = Server::new(rabbitmq_server(), dir);
    let port = server.port();
    let node = format!("outbox-test-{}-{port}@localhost", std::process::id());
    let config = dir.join("rabbitmq.conf");
    std::fs::write(&config, listeners(port)).expect("write rabbitmq.conf");
    // Not /etc/rabbitmq/rabbitmq-env.conf, which names the shared node.
    let env_file = dir.join("rabbitmq-env.conf");
    std::fs::write(&env_file, "").expect("write rabbitmq-env.conf");
    let mut server = server
        // Its own Erlang cookie, made in the directory.
        .env("HOME", dir)
        .env("RABBITMQ_CONF_ENV_FILE", &env_file)
        .env("RABBITMQ_NODENAME", &node)
        .env("RABBITMQ_DIST_PORT", free_port().to_string())
        .env("RABBITMQ_CONFIG_FILE", &config)
        .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
        .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
        .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
        .env("RABBITMQ_LOG_BASE", dir.join("log"))
        .env(
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
            "-kernel inet_dist_use_interface {127,0,0,1}",
        )
        .env("ERL_EPMD_ADDRESS", "127.0.0.1")
        .start_deadline(RABBITMQ_START_DEADLINE);
    server.stop_on_drop = true;
    server
}

#[cfg(test)]
mod tests {
    use super::*;

    // The launcher's failure paths, which need no server installed. Starting, stopping and
    // restarting real servers is what tests/tests/broker_restarts.rs and the TLS tests do.

    /// A directory of the test's own, removed when dropped (also when the test panics).
    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Scratch {
            Scratch(std::env::temp_dir().join(crate::unique_name("outbox_servers")))
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[tokio::test]
    #[should_panic(expected = "exited (exit status: 1) before opening port")]
    async fn a_server_that_exits_at_once_fails_naming_it() {
        let dir = Scratch::new();
        Server::new("false", &dir.0).start().await;
    }

    #[tokio::test]
    #[should_panic(expected = "cannot run /nowhere/no-such-server")]
    async fn a_missing_program_fails_naming_it() {
        let dir = Scratch::new();
        Server::new("/nowhere/no-such-server", &dir.0).start().await;
    }
}
