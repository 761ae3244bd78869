//! A PostgreSQL server of a test's own, for what the shared server on 5432 must never be put
//! through (other suites run against it in parallel): a TLS-only `pg_hba.conf`, a restart,
//! a crash. [`PostgresServer::init`] runs `initdb` into a directory of the test's, with the
//! server binaries Debian's `postgresql` package installs (`/usr/lib/postgresql/<version>/bin`,
//! the newest); [`PostgresServer::start`], [`stop`](PostgresServer::stop) and
//! [`restart`](PostgresServer::restart) run `pg_ctl`. PostgreSQL refuses to run as root: as
//! root, every command runs as the `postgres` user (`runuser`), and the directory is given
//! to that user. Binaries that are not there, or a server that does not start, make the test
//! panic with what to install or the server's log; nothing is skipped.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where Debian's `postgresql` package puts the server binaries of each major version.
pub const PG_LIB: &str = "/usr/lib/postgresql";

/// The `bin` directory of the newest PostgreSQL server installed; panics, saying what to
/// install, when there is none.
pub fn server_bin() -> PathBuf {
    let newest = std::fs::read_dir(PG_LIB)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .max();
    match newest {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server binaries (initdb, pg_ctl) under {PG_LIB}/<version>/bin: \
             install the `postgresql` package (cargo xtask services installs it)"
        ),
    }
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `program`, run as the `postgres` user when this process is root (PostgreSQL refuses
/// root), else as this user.
pub fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// Runs `command`; panics with its output if it cannot run or fails.
#[track_caller]
pub fn run(command: Command, what: &str) {
    run_or_explain(command, what, String::new);
}

/// Runs `command`; panics naming `what`, with its output and then what `explain` gives (a
/// server's log, say), if it cannot run or fails.
#[track_caller]
fn run_or_explain(mut command: Command, what: &str, explain: impl FnOnce() -> String) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}): {}{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        explain()
    );
}

/// How `pg_ctl` stops the server (`-m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Waits for every session to end.
    Smart,
    /// Terminates the sessions (SQLSTATE 57P01), writes a shutdown checkpoint: a clean stop.
    Fast,
    /// Kills every server process at once, as a crash would: no checkpoint, WAL not yet
    /// written is lost (commits made with `synchronous_commit = off` among it), and the next
    /// start runs crash recovery.
    Immediate,
}

impl Stop {
    fn mode(self) -> &'static str {
        match self {
            Stop::Smart => "smart",
            Stop::Fast => "fast",
            Stop::Immediate => "immediate",
        }
    }
}

/// A PostgreSQL cluster in a directory of the test's (`data/` and `server.log` in it),
/// listening on 127.0.0.1 at a port that was free, its socket in that directory, every login
/// trusted (`initdb -A trust`), superuser `postgres`, `fsync = off`. Stopped at once and its
/// directory removed on drop.
pub struct PostgresServer {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
}

impl PostgresServer {
    /// Creates `dir` if need be (files already in it, certificates say, stay, readable by
    /// the server), and initialises a cluster in `dir/data`; not started yet: add settings
    /// with [`configure`](Self::configure) and files with
    /// [`write_config_file`](Self::write_config_file), then [`start`](Self::start).
    pub fn init(dir: &Path) -> PostgresServer {
        let bin = server_bin();
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        let port = crate::free_addr()
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse().ok())
            .expect("a free port");
        let server = PostgresServer {
            dir: dir.to_path_buf(),
            bin,
            port,
        };
        if is_root() {
            let mut chown = Command::new("chown");
            chown.args(["-R", "postgres:"]).arg(dir);
            run(chown, "give the server's directory to the postgres user");
        }
        let mut initdb = as_postgres(&server.bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(server.data())
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"])
            .args(["--locale=C"])
            .current_dir(dir);
        run(initdb, "initdb");
        server.configure(&format!(
            "listen_addresses = '127.0.0.1'\n\
             port = {port}\n\
             unix_socket_directories = '{dir}'\n\
             fsync = off\n\
             shared_buffers = 16MB\n\
             max_connections = 30\n",
            dir = dir.display(),
        ));
        server
    }

    /// Appends `settings` (lines of `postgresql.conf`) to the configuration; a setting given
    /// again overrides the one before. Takes effect at the next start.
    pub fn configure(&self, settings: &str) {
        std::fs::OpenOptions::new()
            .append(true)
            .open(self.data().join("postgresql.conf"))
            .and_then(|mut file| file.write_all(settings.as_bytes()))
            .expect("append to postgresql.conf");
    }

    /// Writes `name` (`pg_hba.conf`, `pg_ident.conf`) in the data directory.
    pub fn write_config_file(&self, name: &str, contents: &str) {
        std::fs::write(self.data().join(name), contents)
            .unwrap_or_else(|e| panic!("write {name}: {e}"));
    }

    /// Starts the server and waits until it accepts connections (at most 30 s); panics with
    /// the server's log if it does not.
    #[track_caller]
    pub fn start(&self) {
        self.pg_ctl(&["start"], "start");
    }

    /// Stops the server (`pg_ctl stop -m <mode>`) and waits until it is gone.
    #[track_caller]
    pub fn stop(&self, mode: Stop) {
        self.pg_ctl(&["-m", mode.mode(), "stop"], "stop");
    }

    /// Stops the server (`pg_ctl restart -m <mode>`) and starts it again, waiting until it
    /// accepts connections.
    #[track_caller]
    pub fn restart(&self, mode: Stop) {
        self.pg_ctl(&["-m", mode.mode(), "restart"], "restart");
    }

    #[track_caller]
    fn pg_ctl(&self, args: &[&str], what: &str) {
        let mut pg_ctl = as_postgres(&self.bin.join("pg_ctl"));
        // `-l` on every start: without it the server would write to (and hold open) the
        // output this call reads to its end.
        pg_ctl
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log_file())
            .args(["-w", "-t", "30"])
            .args(args)
            .current_dir(&self.dir);
        let what = format!("pg_ctl {what} of the test's PostgreSQL server");
        run_or_explain(pg_ctl, &what, || format!("\n{}", self.log()));
    }

    /// The data directory.
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `database` as `postgres` at `host` (`127.0.0.1`, or another name for
    /// it), with `query` (empty, or `?sslmode=…`) appended.
    pub fn url(&self, host: &str, database: &str, query: &str) -> String {
        format!("postgres://postgres@{host}:{}/{database}{query}", self.port)
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let mut pg_ctl = as_postgres(&self.bin.join("pg_ctl"));
        pg_ctl
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .current_dir(&self.dir);
        let _ = pg_ctl.output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
