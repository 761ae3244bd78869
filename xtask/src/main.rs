//! `cargo xtask <task>`: the project's chores in one place.
//!
//! - `services`: make sure every server the tests need is up, starting (and, when missing,
//!   installing) each one of test-support's list (test-support/src/service.rs): PostgreSQL,
//!   MariaDB, Redis, RabbitMQ, NATS, and tansu as the Kafka broker.
//! - `test`: `services`, then the whole test suite against them.
//! - `bench [args]`: the benchmark (release build), see BENCHMARKS.md.
//! - `container-build`: the Dockerfile's `cargo build` line, run here (docs/deployment.md).
//! - `chaos [--minutes M] [--sink redis|amqp|kafka|nats] [--storage postgres|postgres-log|mysql] [--seed N]`:
//!   `services`, then the relay binary with every sink (debug build), then the chaos run
//!   against it (docs/chaos.md).
//! - `fuzz [--seconds N]`: every fuzz target of fuzz/ for N seconds each (default 30), with
//!   cargo-fuzz on the nightly toolchain (fuzz/README.md); not part of `test`.

mod browser;
mod replica;
// test-support's list of services, read here without depending on the crate; xtask uses
// only part of it.
#[allow(dead_code)]
#[path = "../../test-support/src/service.rs"]
mod service;
#[cfg(test)]
mod tidy;

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use service::{Service, Start};

type Result<T = ()> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("services") => services(),
        Some("test") => services().and_then(|()| test(&args[1..])),
        Some("bench") => services().and_then(|()| bench(&args[1..])),
        Some("chaos") => services().and_then(|()| chaos(&args[1..])),
        Some("container-build") => container_build(),
        Some("fuzz") => fuzz(&args[1..]),
        _ => Err(
            "usage: cargo xtask <services | test [cargo test args] | bench [--quick] [drain|latency|enqueue|backlog|sqlite|mysql|log|log-drain|…] | container-build | \
                  chaos [--minutes M] [--sink redis|amqp|kafka|nats] [--storage postgres|postgres-log|mysql] [--seed N] | \
                  fuzz [--seconds N]>"
                .into(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: {error}");
            ExitCode::FAILURE
        }
    }
}

/// How `services` starts each server of test-support's list (its name, URL, port, Debian
/// package, start command and start-up time are there): the row's command, or a function
/// here for the servers that take more.
fn start(service: Service) -> Result {
    match (service.start(), service) {
        (Start::Command(line), _) => run(Command::new("sh").args(["-c", line])),
        (Start::Xtask, Service::Postgres) => start_postgres(),
        (Start::Xtask, Service::MySql) => start_mariadb(),
        (Start::Xtask, Service::Kafka) => start_tansu(),
        (Start::Xtask, other) => Err(format!(
            "{} says xtask starts it, but xtask has no function for it (xtask/src/main.rs)",
            other.name()
        )),
    }
}

fn services() -> Result {
    for &service in Service::ALL {
        let port = service.local_port();
        if is_listening(port) {
            println!("xtask: {} is up on 127.0.0.1:{port}", service.name());
            continue;
        }
        println!(
            "xtask: {} is down on 127.0.0.1:{port}; starting it",
            service.name()
        );
        if let Some(package) = service.package()
            && !has_program(package.program)
        {
            println!(
                "xtask: {} is not installed; installing Debian package {}",
                service.name(),
                package.name
            );
            run(Command::new("apt-get").args([
                "install",
                "-y",
                "--no-install-recommends",
                package.name,
            ]))?;
        }
        start(service)?;
        wait_for(service)?;
    }
    prepare_postgres()?;
    allow_prepared_transactions()?;
    prepare_mariadb()?;
    ensure_faketime()?;
    replica::ensure()
}

/// tests/cli/clock.rs runs relay processes under libfaketime, their clocks hours off the
/// database's: installs Debian's `faketime` package (and with it `libfaketime`) when missing.
fn ensure_faketime() -> Result {
    if has_program("faketime") {
        return Ok(());
    }
    println!("xtask: installing Debian package faketime (tests/cli/clock.rs)");
    run(Command::new("apt-get").args(["install", "-y", "--no-install-recommends", "faketime"]))
}

/// The two-phase commit tests (a writer's `PREPARE TRANSACTION`) need
/// `max_prepared_transactions` above 0, PostgreSQL's default: set it to 16 and restart the
/// cluster (the setting takes a restart), then make the replica again (a hot standby needs
/// it at least as high as its primary).
fn allow_prepared_transactions() -> Result {
    if std::env::var_os(Service::Postgres.env()).is_some() {
        return Ok(());
    }
    if replica::psql(5432, "SHOW max_prepared_transactions")? != "0" {
        return Ok(());
    }
    println!(
        "xtask: PostgreSQL has max_prepared_transactions = 0; setting it to 16 and restarting (two-phase commit tests)"
    );
    replica::psql(5432, "ALTER SYSTEM SET max_prepared_transactions = 16")?;
    pg_ctlcluster("restart")?;
    wait_for(Service::Postgres)?;
    replica::discard()
}

/// The MySQL tests connect as `root` without a password to database `test` on 127.0.0.1
/// (`OUTBOX_TEST_MYSQL_URL` overrides it, and then nothing is prepared). A fresh MariaDB
/// has neither: as the system's root (MariaDB lets it in through the socket) this creates
/// the database and `root@127.0.0.1` with no password, which suits a test machine only.
fn prepare_mariadb() -> Result {
    if std::env::var_os(Service::MySql.env()).is_some() {
        return Ok(());
    }
    let probe = || {
        Command::new("mariadb")
            .args([
                "-h",
                "127.0.0.1",
                "-u",
                "root",
                "--connect-timeout=5",
                "-e",
                "SELECT 1",
                "test",
            ])
            .output()
            .map_err(|e| format!("cannot run mariadb: {e}"))
    };
    if probe()?.status.success() {
        return Ok(());
    }
    println!("xtask: creating MariaDB database `test` and user root@127.0.0.1 (test machine)");
    run(Command::new("mariadb").args([
        "-u",
        "root",
        "-e",
        "CREATE DATABASE IF NOT EXISTS test; \
         CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY ''; \
         GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;",
    ]))?;
    let last = probe()?;
    if last.status.success() {
        Ok(())
    } else {
        Err(format!(
            "MariaDB on 127.0.0.1:3306 still refuses root@test: {}; set OUTBOX_TEST_MYSQL_URL \
             to a database the tests may use",
            String::from_utf8_lossy(&last.stderr).trim()
        ))
    }
}

/// `psql` as role `postgres` on 127.0.0.1, on `database`.
fn psql_command(database: &str) -> Command {
    let mut command = Command::new("psql");
    command.args(["-h", "127.0.0.1", "-U", "postgres", "-d", database]);
    command
}

/// The tests connect as `postgres` without a password to database `test` on 127.0.0.1
/// (`OUTBOX_TEST_POSTGRES_URL` overrides it, and then nothing is prepared). A freshly
/// installed PostgreSQL has neither: this creates the database and lets that role in from
/// 127.0.0.1 without a password (a `trust` line for this one role and address, put first in
/// pg_hba.conf), which suits a test machine only.
fn prepare_postgres() -> Result {
    if std::env::var_os(Service::Postgres.env()).is_some() {
        return Ok(());
    }
    let probe = |database: &str| {
        psql_command(database)
            .args(["-tAc", "SELECT 1"])
            .env("PGCONNECT_TIMEOUT", "5")
            .output()
            .map_err(|e| format!("cannot run psql: {e}"))
    };
    let first = probe("test")?;
    if first.status.success() {
        return Ok(());
    }
    let why = String::from_utf8_lossy(&first.stderr).to_string();
    if why.contains("password authentication failed")
        || why.contains("no pg_hba.conf entry")
        || why.contains("no password supplied")
    {
        println!(
            "xtask: PostgreSQL refuses role postgres from 127.0.0.1 without a password; allowing it (test machine)"
        );
        allow_test_role()?;
    }
    if !probe("test")?.status.success() {
        println!("xtask: creating PostgreSQL database `test`");
        let created = psql_command("postgres")
            .args(["-c", "CREATE DATABASE test"])
            .status()
            .map_err(|e| format!("cannot run psql: {e}"))?;
        if !created.success() {
            run(Command::new("runuser").args(["-u", "postgres", "--", "createdb", "test"]))?;
        }
    }
    let last = probe("test")?;
    if last.status.success() {
        Ok(())
    } else {
        Err(format!(
            "PostgreSQL on 127.0.0.1:5432 still refuses postgres@test: {}; set \
             OUTBOX_TEST_POSTGRES_URL to a database the tests may use",
            String::from_utf8_lossy(&last.stderr).trim()
        ))
    }
}

/// Puts `host all postgres 127.0.0.1/32 trust` first in every cluster's pg_hba.conf and
/// reloads the clusters.
fn allow_test_role() -> Result {
    const LINE: &str = "host all postgres 127.0.0.1/32 trust";
    let versions = std::fs::read_dir("/etc/postgresql")
        .map_err(|e| format!("no PostgreSQL cluster under /etc/postgresql: {e}"))?;
    for version in versions.flatten() {
        let hba = version.path().join("main/pg_hba.conf");
        let text = std::fs::read_to_string(&hba)
            .map_err(|e| format!("cannot read {}: {e}", hba.display()))?;
        if !text.lines().any(|l| l.trim() == LINE) {
            std::fs::write(
                &hba,
                format!("# added by cargo xtask services (tests)\n{LINE}\n{text}"),
            )
            .map_err(|e| format!("cannot write {}: {e}", hba.display()))?;
        }
        let version = version.file_name().to_string_lossy().to_string();
        run(Command::new("pg_ctlcluster").args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            "reload",
        ]))?;
    }
    Ok(())
}

fn is_listening(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

fn wait_for(service: Service) -> Result {
    let deadline = Instant::now() + service.startup();
    while Instant::now() < deadline {
        if is_listening(service.local_port()) {
            println!("xtask: {} is up", service.name());
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Err(format!(
        "{} did not come up on 127.0.0.1:{} within {:?}",
        service.name(),
        service.local_port(),
        service.startup()
    ))
}

fn has_program(program: &str) -> bool {
    let found = |dir: &std::path::Path| dir.join(program).is_file();
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| found(&d)))
        .unwrap_or(false)
        || ["/usr/sbin", "/usr/lib/rabbitmq/bin"]
            .iter()
            .any(|d| found(std::path::Path::new(d)))
}

fn run(command: &mut Command) -> Result {
    let status = command
        .status()
        .map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{command:?} failed with {status}"))
    }
}

fn start_postgres() -> Result {
    pg_ctlcluster("start")
}

/// `pg_ctlcluster <version> main <action>` for every PostgreSQL cluster Debian set up.
fn pg_ctlcluster(action: &str) -> Result {
    let versions = std::fs::read_dir("/etc/postgresql")
        .map_err(|e| format!("no PostgreSQL cluster under /etc/postgresql: {e}"))?;
    for version in versions.flatten() {
        let version = version.file_name().to_string_lossy().to_string();
        run(Command::new("pg_ctlcluster").args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            action,
        ]))?;
    }
    Ok(())
}

/// MariaDB as Debian installs it, its data directory made on the first start.
fn start_mariadb() -> Result {
    if !std::path::Path::new("/var/lib/mysql/mysql").is_dir() {
        run(Command::new("mariadb-install-db").args(["--user=mysql", "--datadir=/var/lib/mysql"]))?;
    }
    std::fs::create_dir_all("/run/mysqld").ok();
    run(Command::new("chown").args(["mysql:mysql", "/run/mysqld"]))?;
    start_detached(
        "MariaDB",
        "mariadbd-safe".as_ref(),
        &["--bind-address=127.0.0.1", "--port=3306"],
    )
}

/// tansu, a Kafka-protocol broker from crates.io, cached in ~/.cargo/bin once built.
fn start_tansu() -> Result {
    let home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .map_err(|_| "neither CARGO_HOME nor HOME is set".to_string())?;
    let tansu = home.join("bin").join("tansu");
    if !tansu.is_file() {
        println!(
            "xtask: installing tansu 0.6.0 (about 14 minutes on the first build; cached afterwards)"
        );
        run(Command::new("cargo").args([
            "install",
            "tansu",
            "--version",
            "0.6.0",
            "--locked",
            "--no-default-features",
            "--features",
            "dynostore",
        ]))?;
    }
    start_detached(
        "tansu",
        tansu.as_os_str(),
        &[
            "broker",
            "--listener-url",
            "tcp://127.0.0.1:9092",
            "--advertised-listener-url",
            "tcp://127.0.0.1:9092",
            "--storage-engine",
            "memory://tansu/",
        ],
    )
}

/// Starts `program` with `args` in a session of its own, so it outlives xtask, its output
/// in `outbox-<what, lower case>.log` in the temporary directory; `what` names it in errors.
fn start_detached(what: &str, program: &std::ffi::OsStr, args: &[&str]) -> Result {
    let name = format!("outbox-{}.log", what.to_lowercase());
    let log = std::fs::File::create(std::env::temp_dir().join(name))
        .map_err(|e| format!("cannot create the {what} log: {e}"))?;
    Command::new("setsid")
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {what}: {e}"))?;
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// The whole suite: the workspace's tests, then the backend crate outside the workspace
/// (`examples/out-of-tree-sink`, its own lock file), which proves that `outbox-testkit`
/// works for a crate depending on `outbox-core` and the kit only. Both run even when the
/// first fails.
fn test(extra: &[String]) -> Result {
    browser::ensure()?;
    let workspace = run(cargo()
        .args(["test", "--workspace", "--all-features", "--no-fail-fast"])
        .args(extra));
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .ok_or("xtask has no parent directory")?;
    // The workspace's target directory, so the shared dependencies are built once.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let out_of_tree = run(cargo()
        .current_dir(&root)
        .args([
            "test",
            "--manifest-path",
            "examples/out-of-tree-sink/Cargo.toml",
        ])
        .arg("--target-dir")
        .arg(&target));
    workspace.and(out_of_tree)
}

/// Runs the Dockerfile's `cargo build` line as it is, here: no container engine runs on
/// these machines, so this is how that line is tried in full (tests/cli/deployment.rs
/// checks its form in CI).
fn container_build() -> Result {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .ok_or("xtask has no parent directory")?;
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile"))
        .map_err(|e| format!("cannot read the Dockerfile: {e}"))?;
    let line = dockerfile
        .lines()
        .filter_map(|line| line.trim().strip_prefix("RUN cargo build "))
        .next()
        .ok_or("the Dockerfile has no `RUN cargo build` line")?;
    run(cargo()
        .current_dir(&root)
        .arg("build")
        .args(line.split_whitespace()))
}

fn bench(extra: &[String]) -> Result {
    run(cargo()
        .args(["run", "--release", "--package", "outbox-bench", "--"])
        .args(extra))
}

/// Builds the relay binary with every sink, then runs the chaos suite against it; the
/// suite's own arguments (`--minutes`, `--sink`, `--seed`) are passed through.
fn chaos(extra: &[String]) -> Result {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .ok_or("xtask has no parent directory")?;
    // A relative CARGO_TARGET_DIR is relative to the workspace, where cargo runs here.
    let target = root.join(std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| "target".into()));
    run(cargo().current_dir(&root).args([
        "build",
        "--package",
        "outbox",
        "--bin",
        "outbox",
        "--features",
        "amqp,kafka,nats,mysql",
    ]))?;
    let outbox = target.join("debug").join("outbox");
    run(cargo()
        .current_dir(&root)
        .args([
            "run",
            "--quiet",
            "--package",
            "outbox-chaos",
            "--",
            "--outbox",
        ])
        .arg(&outbox)
        .args(extra))
}

/// Runs every fuzz target of fuzz/ for `--seconds N` each (default 30) with cargo-fuzz
/// (installed from crates.io when missing) on the nightly toolchain. The seeds committed in
/// fuzz/corpus/<target> are only read: what a run adds goes to fuzz/target/corpus/<target>,
/// and an input that fails is saved in fuzz/artifacts/<target> (fuzz/README.md).
fn fuzz(args: &[String]) -> Result {
    let seconds: u64 = match args {
        [] => 30,
        [flag, n] if flag == "--seconds" => n
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("--seconds takes a whole number above 0, not `{n}`"))?,
        _ => return Err("usage: cargo xtask fuzz [--seconds N]".into()),
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .ok_or("xtask has no parent directory")?;
    let fuzz = root.join("fuzz");
    // `cargo +nightly` needs rustup's `cargo`, not the toolchain's own that runs xtask.
    let nightly = || {
        let mut command = Command::new("cargo");
        command.current_dir(&root).arg("+nightly");
        command
    };
    let has_cargo_fuzz = nightly()
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !has_cargo_fuzz {
        println!("xtask: installing cargo-fuzz");
        run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))?;
    }
    let mut targets: Vec<String> = std::fs::read_dir(fuzz.join("fuzz_targets"))
        .map_err(|e| format!("cannot read fuzz/fuzz_targets: {e}"))?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().to_string_lossy().to_string();
            name.strip_suffix(".rs").map(str::to_string)
        })
        .collect();
    targets.sort();
    for target in &targets {
        println!("xtask: fuzzing {target} for {seconds} s");
        let grown = fuzz.join("target/corpus").join(target);
        std::fs::create_dir_all(&grown)
            .map_err(|e| format!("cannot create {}: {e}", grown.display()))?;
        run(nightly()
            .args(["fuzz", "run", "--sanitizer", "none", target])
            .arg(&grown)
            .arg(fuzz.join("corpus").join(target))
            .args([
                "--",
                &format!("-max_total_time={seconds}"),
                "-timeout=10",
                "-print_final_stats=1",
            ]))?;
    }
    println!(
        "xtask: {} fuzz targets ran {seconds} s each without a failure",
        targets.len()
    );
    Ok(())
}
