//! The binary on MySQL / MariaDB (`OUTBOX_TEST_MYSQL_URL`, or 127.0.0.1:3306, database
//! `test`): a relay process killed with SIGKILL in the middle of a drain loses
//! nothing and keeps per-key order, and bad `[storage]` settings exit with the
//! configuration code naming the setting.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outbox_tests::mysql_url;

use super::{ConfigFile, EXIT_CONFIG, RelayProcess, outbox, text};

const KEYS: usize = 50;
const PER_KEY: usize = 60;

/// Drops the tables of outbox table `table` when dropped.
struct Tables(String);

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

/// The delivered lines of the file sink: (key, number, id) in file order, read by the names
/// of its wire module.
fn delivered(path: &Path) -> Vec<(String, usize, String)> {
    use outbox::file::wire::{ID, KEY, PAYLOAD};
    let Ok(contents) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    contents
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .map(|m| {
            (
                m[KEY].as_str().unwrap_or_default().to_string(),
                m[PAYLOAD]
                    .as_str()
                    .unwrap_or_default()
                    .parse()
                    .unwrap_or(usize::MAX),
                m[ID].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
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
    let mut lines = String::new();
    for n in 0..PER_KEY {
        for k in 0..KEYS {
            lines.push_str(&format!(
                "{{\"topic\":\"orders\",\"key\":\"k{k}\",\"payload\":\"{n}\"}}\n"
            ));
        }
    }
    let mut writer = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .arg("--config")
        .arg(&config.path)
        .args(["enqueue", "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the writer");
    let mut stdin = writer.stdin.take().expect("stdin");
    stdin.write_all(lines.as_bytes()).expect("writer input");
    drop(stdin);
    let written = writer.wait_with_output().expect("writer");
    assert!(
        written.status.success(),
        "writer: {}",
        text(&written.stderr)
    );

    let total = KEYS * PER_KEY;
    let first = RelayProcess::start(&config.path);
    let deadline = Instant::now() + Duration::from_secs(60);
    while delivered(&sink).len() < total / 4 {
        assert!(
            Instant::now() < deadline,
            "the first relay delivered too little"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
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
    let all = loop {
        let all = delivered(&sink);
        let ids: HashSet<&str> = all.iter().map(|(_, _, id)| id.as_str()).collect();
        if ids.len() == total {
            break all;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {total} messages delivered within 60 s",
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(second.terminate().0, Some(0));
    // Per key: every delivery of a message (a redelivery after the kill included) comes
    // after a delivery of the one before it, and first deliveries are in order.
    let mut seen: HashMap<&str, Vec<usize>> = HashMap::new();
    for (key, n, _) in &all {
        let numbers = seen.entry(key.as_str()).or_default();
        assert!(
            *n == 0 || numbers.contains(&(n - 1)),
            "key {key}: message {n} delivered before message {}: {numbers:?}",
            n - 1
        );
        numbers.push(*n);
    }
    assert_eq!(seen.len(), KEYS);
    let status = outbox(&config.path, &["status"]);
    assert!(
        text(&status.stdout).contains("pending 0 "),
        "{}",
        text(&status.stdout)
    );
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
    for (storage, expected) in cases {
        let contents = format!("{storage}[sink]\ntype = \"stdout\"\n");
        let config = ConfigFile::new(&contents);
        let out = outbox(&config.path, &["check"]);
        let stderr = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(EXIT_CONFIG),
            "config:\n{contents}\nstderr: {stderr}"
        );
        assert!(
            stderr.contains(expected),
            "expected `{expected}` in: {stderr}"
        );
        assert!(!stderr.contains("hunter2"), "password printed: {stderr}");
    }
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

    let mut client = Command::new("mariadb")
        .args(client_args(&mysql_url()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the mariadb client is installed with MariaDB");
    client
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("send the script");
    let applied = client.wait_with_output().expect("mariadb");
    assert!(
        applied.status.success(),
        "mariadb: {}",
        text(&applied.stderr)
    );

    let again = text(&outbox(&config.path, &["migrate", "--print-sql"]).stdout);
    assert!(again.contains("is up to date"), "{again}");
    let migrated = outbox(&config.path, &["migrate"]);
    assert!(
        !text(&migrated.stderr).contains("applying outbox migration"),
        "migrate found work left: {}",
        text(&migrated.stderr)
    );
    let status = outbox(&config.path, &["status"]);
    assert!(
        text(&status.stdout).contains("pending 0"),
        "{}",
        text(&status.stderr)
    );
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
