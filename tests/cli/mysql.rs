//! The binary on MySQL / MariaDB (`OUTBOX_TEST_MYSQL_URL`, or 127.0.0.1:3306, database
//! `test`): a relay process killed with SIGKILL in the middle of a drain loses
//! nothing and keeps per-key order, and bad `[storage]` settings exit with the
//! configuration code naming the setting.

use std::process::Command;
use std::time::{Duration, Instant};

use outbox_tests::mysql_url;

use super::drain::{delivered, delivered_in_key_order, numbered_lines, wait_for_deliveries};
use super::{
    ConfigFile, RelayProcess, assert_config_errors, assert_migrated_by_hand, outbox,
    outbox_with_stdin, text, with_stdin,
};

const KEYS: usize = 50;
const PER_KEY: usize = 60;

/// Drops the tables of outbox table `table` when dropped (errors ignored: a clean-up).
pub(super) struct Tables(pub(super) String);

impl Drop for Tables {
    fn drop(&mut self) {
        let list = outbox::mysql::TABLE_SUFFIXES
            .iter()
            .map(|suffix| format!("`{}{suffix}`", self.0))
            .collect::<Vec<_>>()
            .join(", ");
        let url = mysql_url();
        outbox_tests::clean_up(async move {
            let pool = sqlx::MySqlPool::connect(&url).await.ok()?;
            sqlx::query(&format!("DROP TABLE IF EXISTS {list}"))
                .execute(&pool)
                .await
                .ok()
        });
    }
}

#[test]
fn a_relay_killed_mid_drain_on_mysql_loses_nothing_and_keeps_key_order() {
    let table = outbox_tests::unique_name("cli_kill");
    let _tables = Tables(table.clone());
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_mysql"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sink = dir.join("delivered.jsonl");
    let config = ConfigFile::new(&format!(
        "[storage]\ntype = \"mysql\"\nurl = \"{}\"\ntable = \"{table}\"\nmax_per_key = 2\n\
         [relay]\npoll_interval = \"50ms\"\nlease = \"3s\"\nbatch_size = 100\n\
         shutdown_timeout = \"5s\"\nbackoff = {{ initial = \"100ms\", max = \"1s\" }}\n\
         [sink]\ntype = \"file\"\npath = \"{}\"\npublish_timeout = \"1s\"\n",
        mysql_url(),
        sink.display()
    ));
    let migrated = outbox(&config.path, &["migrate"]);
    assert!(
        migrated.status.success(),
        "migrate (is MariaDB running at {}? `cargo xtask services`): {}",
        mysql_url(),
        text(&migrated.stderr)
    );
    let lines = numbered_lines(KEYS, PER_KEY);
    let written = outbox_with_stdin(&config.path, &["enqueue", "--stdin"], &lines);
    assert!(
        written.status.success(),
        "writer: {}",
        text(&written.stderr)
    );

    let total = KEYS * PER_KEY;
    let first = RelayProcess::start(&config.path);
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_deliveries(&sink, total / 4, deadline);
    // Kill it while it holds a claim: rows under its lease must be taken over when the lease
    // runs out, not lost.
    let in_flight = format!(
        "SELECT COUNT(*) FROM `{table}` WHERE claim_token IS NOT NULL AND available_at > UTC_TIMESTAMP(6)"
    );
    let url = mysql_url();
    let holding = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let pool = sqlx::MySqlPool::connect(&url).await.expect("MariaDB");
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                let n: i64 = sqlx::query_scalar(&in_flight)
                    .fetch_one(&pool)
                    .await
                    .expect("rows in flight");
                if n > 0 {
                    return true;
                }
            }
            false
        })
    })
    .join()
    .expect("watcher");
    let mut first = first;
    first.0.kill().expect("kill -9 the relay");
    let _ = first.0.wait();
    let cut = delivered(&sink).len();
    assert!(
        cut < total,
        "the kill came after the drain ({cut} delivered)"
    );
    if !holding {
        eprintln!("note: the relay held no claim when it was killed");
    }
    // Its leases (3 s) run out before the second relay can take its rows.
    let second = RelayProcess::start(&config.path);
    delivered_in_key_order(second, &config.path, &sink, (KEYS, PER_KEY), deadline);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_mysql_settings_exit_with_the_configuration_code_and_name_the_setting() {
    let url = mysql_url();
    let base = url.rsplit_once('/').map_or(url.as_str(), |(base, _)| base);
    let wrong_password = url.replacen("mysql://root", "mysql://root:hunter2", 1);
    let cases = [
        (
            format!("[storage]\ntype = \"mysql\"\nurl = \"{wrong_password}\"\n"),
            "storage.url `",
        ),
        (
            format!("[storage]\ntype = \"mysql\"\nurl = \"{base}/no_such_database_here\"\n"),
            "storage.url names database `no_such_database_here`, which does not exist",
        ),
        (
            format!("[storage]\ntype = \"mysql\"\nurl = \"{url}\"\ndatabase = \"no_such_db\"\n"),
            "storage.database names database `no_such_db`, which does not exist",
        ),
        (
            format!("[storage]\ntype = \"mysql\"\nurl = \"{url}\"\ntable = \"Bad-Name\"\n"),
            "storage.table `Bad-Name` is not allowed",
        ),
    ];
    let cases = cases
        .map(|(storage, expected)| (format!("{storage}[sink]\ntype = \"stdout\"\n"), expected));
    assert_config_errors(&cases);
}

/// `migrate --print-sql` on MariaDB prints the steps the database lacks without running them;
/// applied with the `mariadb` client, as a DBA would, they leave nothing for `migrate`.
#[test]
fn migrate_print_sql_gives_the_script_a_dba_applies() {
    let table = outbox_tests::unique_name("cli_dba");
    let _tables = Tables(table.clone());
    let config = ConfigFile::new(&format!(
        "[storage]\ntype = \"mysql\"\nurl = \"{}\"\ntable = \"{table}\"\n[sink]\ntype = \"stdout\"\n",
        mysql_url()
    ));
    let printed = outbox(&config.path, &["migrate", "--print-sql"]);
    let script = text(&printed.stdout);
    assert!(printed.status.success(), "{}", text(&printed.stderr));
    assert!(script.contains("outbox migration 1 of"), "{script}");
    // Printing changed nothing.
    let status = outbox(&config.path, &["status"]);
    assert!(!status.status.success(), "{}", text(&status.stdout));

    // The client is installed with MariaDB.
    let mut client = Command::new("mariadb");
    client.args(client_args(&mysql_url()));
    let applied = with_stdin(client, &script);
    assert!(
        applied.status.success(),
        "mariadb: {}",
        text(&applied.stderr)
    );

    assert_migrated_by_hand(&config.path, "mariadb");
}

/// The `mariadb` client's arguments for the server, user, password and database of `url`
/// (`mysql://user[:password]@host[:port]/database`).
fn client_args(url: &str) -> Vec<String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let (login, rest) = rest.rsplit_once('@').unwrap_or(("root", rest));
    let (user, password) = login.split_once(':').unwrap_or((login, ""));
    let (server, database) = rest.split_once('/').unwrap_or((rest, "test"));
    let database = database.split('?').next().unwrap_or("test");
    let (host, port) = server.split_once(':').unwrap_or((server, "3306"));
    let mut args = vec![
        format!("--host={host}"),
        format!("--port={port}"),
        format!("--user={user}"),
    ];
    if !password.is_empty() {
        args.push(format!("--password={password}"));
    }
    args.push(database.to_string());
    args
}
