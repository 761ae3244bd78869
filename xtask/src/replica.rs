//! A streaming read replica of the local PostgreSQL for the log-mode replica tests
//! (`tests/tests/postgres_log_replica.rs`): a second cluster on 127.0.0.1:5433, made with
//! `pg_basebackup -R` from the one on 5432 and kept up to date through a physical
//! replication slot. Nothing is done when 5433 already listens, or when
//! `OUTBOX_TEST_POSTGRES_URL` points the tests at a database of their own (give
//! `OUTBOX_TEST_POSTGRES_REPLICA_URL` then).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{Result, is_listening, run};

const PORT: u16 = 5433;
/// The replica's data directory; its log is next to it.
const DATA: &str = "/var/lib/postgresql/outbox-replica";
const LOG: &str = "/var/lib/postgresql/outbox-replica.log";
/// The primary's physical replication slot: WAL the replica has not received yet is kept.
const SLOT: &str = "outbox_replica";
/// Lets the base backup and the replica's WAL receiver in from 127.0.0.1 without a password.
const HBA_LINE: &str = "host replication all 127.0.0.1/32 trust";
/// Settings a hot standby must have at least as high as its primary.
const COPIED: [&str; 5] = [
    "max_connections",
    "max_prepared_transactions",
    "max_locks_per_transaction",
    "max_worker_processes",
    "max_wal_senders",
];

/// Makes sure the replica is up: on 127.0.0.1:5433, hot standby, streaming from 5432.
pub fn ensure() -> Result {
    if std::env::var_os(crate::Service::Postgres.env()).is_some() {
        return Ok(());
    }
    if is_listening(PORT) {
        println!("xtask: PostgreSQL replica is up on 127.0.0.1:{PORT}");
        return Ok(());
    }
    println!("xtask: PostgreSQL replica is down on 127.0.0.1:{PORT}; starting it");
    let bin = pg_bin()?;
    allow_replication()?;
    let data = Path::new(DATA);
    if !data.join("standby.signal").is_file() {
        make(&bin, data)?;
    }
    if start(&bin, data).is_err() {
        // A replica that cannot start (a copy half made, or from another primary): again.
        println!("xtask: the replica in {DATA} does not start (see {LOG}); making it again");
        make(&bin, data)?;
        start(&bin, data)?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if is_listening(PORT) && psql(PORT, "SELECT pg_is_in_recovery()")? == "t" {
            println!("xtask: PostgreSQL replica is up");
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Err(format!(
        "the PostgreSQL replica did not accept connections on 127.0.0.1:{PORT} within 60 s; see {LOG}"
    ))
}

/// The binaries of the newest PostgreSQL installed (`/usr/lib/postgresql/<version>/bin`).
fn pg_bin() -> Result<PathBuf> {
    let versions = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("no PostgreSQL under /usr/lib/postgresql: {e}"))?;
    versions
        .flatten()
        .filter_map(|v| {
            let version: u32 = v.file_name().to_str()?.parse().ok()?;
            Some((version, v.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("pg_basebackup").is_file())
        .max()
        .map(|(_, bin)| bin)
        .ok_or_else(|| "no pg_basebackup under /usr/lib/postgresql/<version>/bin".into())
}

/// A command run as the `postgres` OS user (when this is root; else as this user).
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// One value from `sql` run as `postgres` on 127.0.0.1:`port`, database `postgres`.
pub(crate) fn psql(port: u16, sql: &str) -> Result<String> {
    let output = Command::new("psql")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args(["-d", "postgres", "-tAc", sql])
        .env("PGCONNECT_TIMEOUT", "5")
        .output()
        .map_err(|e| format!("cannot run psql: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    } else {
        Err(format!(
            "psql on 127.0.0.1:{port} failed on `{sql}`: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Puts [`HBA_LINE`] first in every cluster's pg_hba.conf (reloading it), and checks that
/// the primary writes enough WAL for a standby.
fn allow_replication() -> Result {
    let wal_level = psql(5432, "SHOW wal_level")?;
    if wal_level == "minimal" {
        return Err(
            "the PostgreSQL on 5432 has wal_level = minimal: a replica needs `replica` (the \
             default); change it in postgresql.conf and restart the cluster"
                .into(),
        );
    }
    let hba = psql(5432, "SHOW hba_file")?;
    let text = std::fs::read_to_string(&hba).map_err(|e| format!("cannot read {hba}: {e}"))?;
    if !text.lines().any(|l| l.trim() == HBA_LINE) {
        println!("xtask: allowing replication connections from 127.0.0.1 (test machine)");
        std::fs::write(
            &hba,
            format!("# added by cargo xtask services (replica tests)\n{HBA_LINE}\n{text}"),
        )
        .map_err(|e| format!("cannot write {hba}: {e}"))?;
        psql(5432, "SELECT pg_reload_conf()")?;
    }
    Ok(())
}

/// A fresh copy of the primary in `data`, set up as a hot standby on [`PORT`] that streams
/// through [`SLOT`].
fn make(bin: &Path, data: &Path) -> Result {
    println!("xtask: making the PostgreSQL replica in {DATA} (pg_basebackup from 127.0.0.1:5432)");
    if data.exists() {
        std::fs::remove_dir_all(data)
            .map_err(|e| format!("cannot remove {}: {e}", data.display()))?;
    }
    // A new slot: the old one keeps WAL from where the old copy stopped.
    psql(
        5432,
        &format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{SLOT}'"
        ),
    )?;
    psql(
        5432,
        &format!("SELECT pg_create_physical_replication_slot('{SLOT}', true)"),
    )?;
    run(as_postgres(&bin.join("pg_basebackup"))
        .args(["-h", "127.0.0.1", "-p", "5432", "-U", "postgres"])
        .arg("-D")
        .arg(data)
        .args(["-R", "-X", "stream", "-c", "fast", "-S", SLOT]))?;
    let mut conf = format!(
        "# written by cargo xtask services: a hot standby of 127.0.0.1:5432 for the tests\n\
         port = {PORT}\n\
         listen_addresses = '127.0.0.1'\n\
         unix_socket_directories = '/var/run/postgresql'\n\
         hot_standby = on\n\
         hot_standby_feedback = on\n\
         wal_receiver_status_interval = 1s\n"
    );
    for name in COPIED {
        conf.push_str(&format!(
            "{name} = {}\n",
            psql(5432, &format!("SHOW {name}"))?
        ));
    }
    let write = |file: &str, text: &str| {
        let path = data.join(file);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    write("postgresql.conf", &conf)?;
    write(
        "pg_hba.conf",
        "local all all trust\nhost all all 127.0.0.1/32 trust\n",
    )?;
    write("pg_ident.conf", "")?;
    if is_root() {
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(data))?;
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Starts the replica in `data` and waits until it accepts connections.
/// Stops the replica, if it runs, and removes it: [`ensure`] makes it again, with the
/// primary's settings of now.
pub(crate) fn discard() -> Result {
    let data = Path::new(DATA);
    if !data.exists() {
        return Ok(());
    }
    println!("xtask: removing the PostgreSQL replica in {DATA} (the primary's settings changed)");
    if is_listening(PORT) {
        run(as_postgres(&pg_bin()?.join("pg_ctl"))
            .arg("-D")
            .arg(data)
            .args(["-m", "fast", "-w", "stop"]))?;
    }
    std::fs::remove_dir_all(data).map_err(|e| format!("cannot remove {DATA}: {e}"))
}

fn start(bin: &Path, data: &Path) -> Result {
    std::fs::create_dir_all("/var/run/postgresql").ok();
    run(as_postgres(&bin.join("pg_ctl"))
        .arg("-D")
        .arg(data)
        .args(["-l", LOG, "-w", "-t", "60", "start"]))
}
