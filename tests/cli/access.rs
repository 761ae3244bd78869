//! The binary against logins the server refuses, grants that are missing and a SQLite file
//! on a read-only file system: each command ends at once with a message that says what was
//! wrong, where and what to do, and never the password; the exit code says whether it was
//! the configuration (78) or a check that failed (1). A relay that starts without a grant
//! it needs at run time logs the error, clearly, at every restart of its run and goes on
//! once the grant is given (the documented supervision); a relay that is to migrate and
//! may not exits 78.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use outbox_tests::{mysql_url, postgres_url, unique_name};

use super::mysql::Tables;
use super::{ConfigFile, EXIT_CONFIG, said, sigterm, spawn_relay, text};

#[path = "../tests/mounts/mod.rs"]
mod mounts;

/// How long a command that must fail may take: well within the pools' 5 s time-outs plus
/// the process's start.
const AT_ONCE: Duration = Duration::from_secs(15);

/// Runs the binary with `args`; it must exit within [`AT_ONCE`]. Returns its exit code and
/// everything it printed (standard output, then standard error).
fn exits(config: &Path, args: &[&str]) -> (Option<i32>, String) {
    let started = Instant::now();
    let mut child = super::outbox_command(config)
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the outbox binary");
    loop {
        if child.try_wait().expect("wait").is_some() {
            let (code, said) = said(&child.wait_with_output().expect("its output"));
            assert!(!said.contains("panicked"), "{args:?} panicked: {said}");
            return (code, said);
        }
        if started.elapsed() > AT_ONCE {
            let _ = child.kill();
            let out = child.wait_with_output().expect("its output");
            panic!(
                "`outbox {}` still running after {AT_ONCE:?} instead of exiting: {}",
                args.join(" "),
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `said` holds each of `parts` and not `secret`.
#[track_caller]
fn says(what: &str, said: &str, parts: &[&str], secret: Option<&str>) {
    for part in parts {
        assert!(said.contains(part), "{what}: `{part}` missing from: {said}");
    }
    if let Some(secret) = secret {
        assert!(!said.contains(secret), "{what}: the password shows: {said}");
    }
}

/// Runs the binary with `args` ([`exits`]): it must end with `code` and say each of
/// `parts` and not `secret` ([`says`]), `what` naming the case. Returns what it said.
#[track_caller]
fn ends_saying(
    config: &Path,
    args: &[&str],
    code: Option<i32>,
    what: &str,
    parts: &[&str],
    secret: Option<&str>,
) -> String {
    let (ended, said) = exits(config, args);
    assert_eq!(ended, code, "{what}: {said}");
    says(what, &said, parts, secret);
    said
}

/// [`ends_saying`] of each of `commands`, each ending with the configuration code; `what`
/// follows the command in the case's name.
#[track_caller]
fn each_ends_saying(
    config: &Path,
    commands: &[&[&str]],
    what: &str,
    parts: &[&str],
    secret: Option<&str>,
) {
    for args in commands {
        let case = format!("{args:?} {what}");
        ends_saying(
            config,
            args,
            Some(EXIT_CONFIG),
            case.trim_end(),
            parts,
            secret,
        );
    }
}

/// `url` with its user info replaced by `login`.
fn with_login(url: &str, login: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let rest = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{login}@{rest}")
}

/// Runs SQL as the administrator of PostgreSQL (`postgres`) or MariaDB (`mysql`); with
/// `check`, every statement must succeed.
fn admin(postgres: bool, statements: &[String], check: bool) {
    let statements = statements.to_vec();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            if postgres {
                let pool = sqlx::PgPool::connect(&postgres_url())
                    .await
                    .expect("PostgreSQL must be running (cargo xtask services)");
                run_each(&pool, &statements, check).await;
            } else {
                let pool = sqlx::MySqlPool::connect(&mysql_url())
                    .await
                    .expect("MariaDB must be running (cargo xtask services)");
                run_each(&pool, &statements, check).await;
            }
        })
    })
    .join()
    .expect("administrator's statements");
}

/// Runs each of `statements` on `pool`; with `check`, each must succeed.
async fn run_each<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, statements: &[String], check: bool)
where
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    DB::QueryResult: std::fmt::Debug,
{
    for sql in statements {
        let done = sqlx::query(sql).execute(pool).await;
        assert!(!check || done.is_ok(), "{sql}: {done:?}");
    }
}

/// A PostgreSQL role (LOGIN, no privileges) or MariaDB user of the test's own, and the
/// schemas or tables it made; all dropped when dropped.
struct Account {
    postgres: bool,
    name: String,
    drops: Vec<String>,
}

impl Account {
    fn role() -> Account {
        let name = unique_name("cli_role");
        admin(true, &[format!(r#"CREATE ROLE "{name}" LOGIN"#)], true);
        Account {
            postgres: true,
            drops: vec![
                format!(r#"DROP OWNED BY "{name}""#),
                format!(r#"DROP ROLE IF EXISTS "{name}""#),
            ],
            name,
        }
    }

    fn user(password: &str) -> Account {
        let name = unique_name("cli_user");
        admin(
            false,
            &[format!(
                "CREATE USER '{name}'@'%' IDENTIFIED BY '{password}'"
            )],
            true,
        );
        Account {
            postgres: false,
            drops: vec![format!("DROP USER IF EXISTS '{name}'@'%'")],
            name,
        }
    }

    fn grant(&self, sql: &str) {
        admin(self.postgres, &[sql.replace("<who>", &self.who())], true);
    }

    fn who(&self) -> String {
        match self.postgres {
            true => format!("\"{}\"", self.name),
            false => format!("'{}'@'%'", self.name),
        }
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        admin(self.postgres, &self.drops, false);
    }
}

/// Drops schemas (PostgreSQL) when dropped.
struct Schemas(Vec<String>);

impl Drop for Schemas {
    fn drop(&mut self) {
        outbox_tests::drop_schemas(&self.0);
    }
}

/// A relay process whose standard error is read line by line as it comes.
struct Logging {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Logging {
    fn start(config: &Path) -> Logging {
        let mut child = spawn_relay(config, &[], Stdio::null(), Stdio::piped());
        let stderr = child.stderr.take().expect("stderr");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        Logging {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits until `count` lines holding `pattern` were logged; panics after `limit`, or if
    /// the relay exits meanwhile.
    fn wait_for(&mut self, pattern: &str, count: usize, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        loop {
            let found: Vec<String> = self
                .seen
                .iter()
                .filter(|l| l.contains(pattern))
                .cloned()
                .collect();
            if found.len() >= count {
                return found;
            }
            if let Some(status) = self.child.try_wait().expect("wait") {
                panic!(
                    "the relay exited ({status}) instead of going on: {}",
                    self.seen.join("\n")
                );
            }
            assert!(
                Instant::now() < deadline,
                "{count} lines with `{pattern}` not logged within {limit:?}: {}",
                self.seen.join("\n")
            );
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(100)) {
                self.seen.push(line);
            }
        }
    }

    /// SIGTERM; the exit code.
    fn terminate(mut self) -> Option<i32> {
        sigterm(&self.child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            assert!(Instant::now() < deadline, "no exit within 20 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Logging {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn postgres_config(url: &str, schema: &str, extra: &str, sink: &str) -> ConfigFile {
    ConfigFile::new(&format!(
        "[storage]\nurl = \"{url}\"\nschema = \"{schema}\"\n{extra}\n{sink}\n\
         [relay]\npoll_interval = \"100ms\"\nbackoff = {{ initial = \"100ms\", max = \"1s\" }}\n"
    ))
}

/// The commands that check, start a relay and read the status.
const START_AND_READ: [&[&str]; 3] = [&["check"], &["relay"], &["status"]];

const STDOUT: &str = "[sink]\ntype = \"stdout\"\n";

#[test]
fn postgres_a_refused_login_ends_every_command_with_what_to_fix() {
    let ghost = unique_name("cli_ghost");
    let secret = "Cli-pw-never-shown-91";
    let url = with_login(&postgres_url(), &format!("{ghost}:{secret}"));
    let schema = unique_name("cli_refused");
    let config = postgres_config(&url, &schema, "", STDOUT);
    let role_missing = format!("role \"{ghost}\" does not exist");
    let parts = [
        role_missing.as_str(),
        "the server refused the login; not retryable",
        "that the role exists and has LOGIN",
    ];
    let said = ends_saying(
        &config.path,
        &["check"],
        Some(1),
        "check",
        &parts,
        Some(secret),
    );
    assert!(
        said.contains("storage: FAILED: configuration error"),
        "{said}"
    );
    let commands: [&[&str]; 3] = [
        &["migrate"],
        &["status"],
        &["enqueue", "--topic", "t", "{}"],
    ];
    each_ends_saying(&config.path, &commands, "", &parts, Some(secret));
    let migrating = postgres_config(&url, &schema, "migrate = true", STDOUT);
    ends_saying(
        &migrating.path,
        &["relay"],
        Some(EXIT_CONFIG),
        "relay",
        &parts,
        Some(secret),
    );

    let database = unique_name("cli_no_db");
    let base = postgres_url()
        .rsplit_once('/')
        .map(|(base, _)| base.to_string())
        .expect("a URL with a database");
    let config = postgres_config(&format!("{base}/{database}"), &schema, "", STDOUT);
    ends_saying(
        &config.path,
        &["migrate"],
        Some(EXIT_CONFIG),
        "migrate into a database that does not exist",
        &[
            &format!("database \"{database}\" does not exist"),
            "CREATE DATABASE",
        ],
        None,
    );
}

#[test]
fn postgres_missing_grants_end_the_commands_and_a_relay_goes_on_once_granted() {
    let schema = unique_name("cli_grants");
    let _schemas = Schemas(vec![schema.clone()]);
    let owner = postgres_config(&postgres_url(), &schema, "", STDOUT);
    let (code, said) = exits(&owner.path, &["migrate"]);
    assert_eq!(code, Some(0), "migrate as the owner: {said}");
    let role = Account::role();
    let url = with_login(&postgres_url(), &role.name);
    let dir = mounts::Mount::tmpfs(16 << 20);
    let out = dir.file("delivered.jsonl");
    let file_sink = format!("[sink]\ntype = \"file\"\npath = \"{}\"\n", out.display());
    let config = postgres_config(&url, &schema, "", &file_sink);
    let denied = format!("permission denied for schema {schema}");
    let parts = [
        denied.as_str(),
        "the role lacks a privilege on the outbox tables; not retryable",
        "GRANT USAGE ON SCHEMA <schema> TO <role>",
    ];
    ends_saying(&config.path, &["check"], Some(1), "check", &parts, None);
    let commands: [&[&str]; 2] = [&["status"], &["enqueue", "--topic", "t", "{}"]];
    each_ends_saying(&config.path, &commands, "", &parts, None);

    // A relay (no migrations) logs the refusal at each restart of its run, and goes on.
    let mut relay = Logging::start(&config.path);
    let failures = relay.wait_for("relay run failed; restarting", 2, Duration::from_secs(20));
    for failure in &failures {
        says("the relay's log", failure, &parts, None);
    }
    // Granted as the message says, it delivers without a restart of the process.
    for grant in [
        format!(r#"GRANT USAGE ON SCHEMA "{schema}" TO <who>"#),
        format!(
            r#"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO <who>"#
        ),
        format!(r#"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA "{schema}" TO <who>"#),
    ] {
        role.grant(&grant);
    }
    let (code, said) = exits(
        &config.path,
        &["enqueue", "--topic", "t", "--key", "k", "granted"],
    );
    assert_eq!(code, Some(0), "enqueue once granted: {said}");
    let deadline = Instant::now() + Duration::from_secs(40);
    while !std::fs::read_to_string(&out)
        .unwrap_or_default()
        .contains("\"granted\"")
    {
        assert!(
            Instant::now() < deadline,
            "not delivered within 40 s of the grant: {}",
            relay.seen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(relay.terminate(), Some(0));

    // A relay that is to migrate, as a role that may not: exits 78 at once.
    let fresh = unique_name("cli_nocreate");
    let _fresh = Schemas(vec![fresh.clone()]);
    let migrating = postgres_config(&url, &fresh, "migrate = true", STDOUT);
    ends_saying(
        &migrating.path,
        &["relay"],
        Some(EXIT_CONFIG),
        "relay that may not migrate",
        &[
            "permission denied for database",
            "migrations need CREATE on the database",
            "outbox migrate --print-sql",
        ],
        None,
    );
}

fn mysql_config(url: &str, table: &str, extra: &str) -> ConfigFile {
    ConfigFile::new(&format!(
        "[storage]\ntype = \"mysql\"\nurl = \"{url}\"\ntable = \"{table}\"\n{extra}\n{STDOUT}"
    ))
}

#[test]
fn mariadb_a_wrong_password_or_missing_grants_end_the_commands_with_what_to_fix() {
    let password = format!("Right-{}", unique_name("pw"));
    let user = Account::user(&password);
    let wrong = "Wrong-cli-pw-57";
    let table = unique_name("cli_t");
    let _tables = Tables(table.clone());
    let owner = mysql_config(&mysql_url(), &table, "");
    let (code, said) = exits(&owner.path, &["migrate"]);
    assert_eq!(code, Some(0), "migrate as root: {said}");

    let config = mysql_config(
        &with_login(&mysql_url(), &format!("{}:{wrong}", user.name)),
        &table,
        "",
    );
    let redacted = format!("storage.url `mysql://{}:***@", user.name);
    let parts = [
        redacted.as_str(),
        "the server refused the user or password",
        "not retryable",
    ];
    each_ends_saying(
        &config.path,
        &START_AND_READ,
        "with a wrong password",
        &parts,
        Some(wrong),
    );

    // The right password, and a grant on another table only.
    user.grant(&format!(
        "GRANT SELECT ON `test`.`{table}_migrations` TO <who>"
    ));
    let url = with_login(&mysql_url(), &format!("{}:{password}", user.name));
    let config = mysql_config(&url, &table, "");
    let parts = [
        "command denied",
        "the user lacks a privilege on the outbox tables in database `test`; not retryable",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON `test`.*",
    ];
    ends_saying(
        &config.path,
        &["check"],
        Some(1),
        "check without grants",
        &parts,
        Some(&password),
    );
    ends_saying(
        &config.path,
        &["status"],
        Some(EXIT_CONFIG),
        "status without grants",
        &parts,
        Some(&password),
    );
    let fresh = unique_name("cli_t");
    let _fresh = Tables(fresh.clone());
    let migrating = mysql_config(&url, &fresh, "migrate = true");
    ends_saying(
        &migrating.path,
        &["relay"],
        Some(EXIT_CONFIG),
        "relay that may not migrate",
        &["CREATE command denied", "migrations need CREATE and INDEX"],
        Some(&password),
    );
}

#[test]
fn sqlite_on_a_read_only_file_system_ends_every_command_naming_path() {
    let disk = mounts::Mount::tmpfs(16 << 20);
    let path = disk.file("app.db");
    let writable = ConfigFile::new(&format!(
        "[storage]\ntype = \"sqlite\"\npath = \"{}\"\n{STDOUT}",
        path.display()
    ));
    let (code, said) = exits(&writable.path, &["migrate"]);
    assert_eq!(code, Some(0), "migrate: {said}");
    let read_only = mounts::Mount::read_only_view(&disk.path);
    for (file, migrate) in [("app.db", false), ("app.db", true), ("new.db", true)] {
        let shown = read_only.file(file);
        let config = ConfigFile::new(&format!(
            "[storage]\ntype = \"sqlite\"\npath = \"{}\"\nmigrate = {migrate}\n{STDOUT}",
            shown.display()
        ));
        let key = format!(
            "storage.path `{}` is on a read-only file system",
            shown.display()
        );
        let parts = [key.as_str(), "not retryable: remount it read-write"];
        each_ends_saying(
            &config.path,
            &START_AND_READ,
            &format!("({file})"),
            &parts,
            None,
        );
    }
}
