//! The binary on SQLite, with nothing else installed: the README's quick start exactly as
//! written, and a relay process and a writer process sharing one SQLite file through a
//! kill -9 of the relay.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::drain::{delivered_in_key_order, numbered_lines, wait_for_deliveries};
use super::{ConfigFile, RelayProcess, outbox, text};

/// The commands of the README's quick start: the `sh` block under its first heading that
/// names `quickstart.toml`, one command per line, with `cargo run --release --` standing
/// for the binary.
fn readme_quick_start() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let block = readme
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .find(|block| block.contains("examples/quickstart.toml"))
        .expect("README.md has a ```sh block with the quick start on examples/quickstart.toml");
    block
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.trim_start().starts_with('#'))
        .map(|line| {
            let command = line
                .split(" #")
                .next()
                .unwrap_or(line)
                .trim()
                .strip_prefix("cargo run --release -- ")
                .unwrap_or_else(|| {
                    panic!("README command is not `cargo run --release -- …`: {line}")
                });
            shell_words(command)
        })
        .collect()
}

/// Splits a command line on spaces, keeping single-quoted words whole.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '\'' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

/// Runs the binary in `dir` (relative paths in the configuration resolve there).
fn outbox_in(dir: &Path, args: &[String]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox"));
    command.current_dir(dir).args(args).env_remove("RUST_LOG");
    command
}

/// A fresh directory holding a copy of the repository's `examples/`.
fn work_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_quickstart"));
    let examples = dir.join("examples");
    std::fs::create_dir_all(&examples).expect("temp dir");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    for entry in std::fs::read_dir(source).expect("examples/") {
        let path = entry.expect("entry").path();
        // The example configurations; not the example crates in folders of their own.
        if let Some(name) = path.file_name().filter(|_| path.is_file()) {
            std::fs::copy(&path, examples.join(name)).expect("copy example");
        }
    }
    dir
}

#[test]
fn the_readme_quick_start_runs_as_written() {
    let commands = readme_quick_start();
    assert!(
        commands.iter().any(|c| c.contains(&"relay".to_string())),
        "the quick start starts a relay: {commands:?}"
    );
    let dir = work_dir();
    let mut relayed = false;
    for args in &commands {
        if args.last().map(String::as_str) != Some("relay") {
            let out = outbox_in(&dir, args).output().expect("run outbox");
            assert!(
                out.status.success(),
                "`outbox {}` failed: {}",
                args.join(" "),
                text(&out.stderr)
            );
            continue;
        }
        // The relay runs until stopped: read its standard output until the message the
        // quick start enqueued shows up, then stop it as a user would.
        let mut relay = outbox_in(&dir, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the relay");
        let stdout = relay.stdout.take().expect("stdout");
        let (lines, seen) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let line = seen
            .recv_timeout(Duration::from_secs(30))
            .expect("the relay printed the enqueued message within 30 s");
        let message: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
        assert_eq!(message["outbox-topic"], "orders", "{line}");
        assert_eq!(message["outbox-key"], "o-1", "{line}");
        assert_eq!(message["payload"], r#"{"paid":true}"#, "{line}");
        stop(relay);
        relayed = true;
    }
    assert!(relayed);
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM, then the exit code must be 0.
fn stop(mut child: Child) {
    super::sigterm(&child);
    let exit = child.wait().expect("wait");
    assert_eq!(exit.code(), Some(0), "relay exit after SIGTERM");
}

const KEYS: usize = 100;
const PER_KEY: usize = 100;

#[test]
fn a_relay_and_a_writer_share_one_sqlite_file_through_a_kill() {
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_sqlite"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sink = dir.join("delivered.jsonl");
    let config = ConfigFile::new(&format!(
        "[storage]\ntype = \"sqlite\"\npath = \"{}\"\n[relay]\npoll_interval = \"50ms\"\n\
         lease = \"10s\"\nbatch_size = 200\nshutdown_timeout = \"5s\"\n\
         backoff = {{ initial = \"100ms\", max = \"1s\" }}\n\
         [sink]\ntype = \"file\"\npath = \"{}\"\npublish_timeout = \"1s\"\n",
        dir.join("app.db").display(),
        sink.display()
    ));
    let migrated = outbox(&config.path, &["migrate"]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));

    let first = RelayProcess::start(&config.path);
    let mut writer = super::outbox_command(&config.path)
        .args(["enqueue", "--stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the writer");
    let input = numbered_lines(KEYS, PER_KEY);
    let mut stdin = writer.stdin.take().expect("stdin");
    let feeding = std::thread::spawn(move || stdin.write_all(input.as_bytes()));

    // Kill the relay without warning once it is well into the drain.
    let deadline = Instant::now() + Duration::from_secs(120);
    wait_for_deliveries(&sink, KEYS * PER_KEY / 5, deadline);
    let mut first = first;
    first.0.kill().expect("kill -9 the relay");
    let _ = first.0.wait();
    let second = RelayProcess::start(&config.path);

    feeding
        .join()
        .expect("feeding thread")
        .expect("write the writer's input");
    let written = writer.wait_with_output().expect("writer");
    assert!(
        written.status.success(),
        "writer: {}",
        text(&written.stderr)
    );

    delivered_in_key_order(second, &config.path, &sink, (KEYS, PER_KEY), deadline);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits up to 30 s until `status` on `config` says `wanted`.
async fn wait_for_status(config: &Path, wanted: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let said = text(&outbox(config, &["status"]).stdout);
        if said.contains(wanted) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "`status` never said `{wanted}`: {said}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The id of the first dead letter `dead-letters list` printed (the line after the header).
fn first_listed_id(listed: &str) -> String {
    listed
        .lines()
        .nth(1)
        .and_then(|line| line.split_whitespace().next())
        .expect("a dead letter's id")
        .to_string()
}

/// The operator's commands on SQLite, read through `status` alone: a message too large for
/// the sink is dead-lettered and parks its key; list, show, replay put it back first in its
/// key's order; release and purge work on a second dead letter.
#[tokio::test]
async fn dead_letter_commands_work_on_sqlite() {
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_sqlite_dead"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let name = outbox_tests::unique_name("sqlite_dead");
    let config = |max: usize| {
        ConfigFile::new(&format!(
            "[storage]\ntype = \"sqlite\"\npath = \"{}\"\n{}\
             [sink]\ntype = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n\
             stream_prefix = \"{name}:\"\nmax_payload = {max}\n",
            dir.join("app.db").display(),
            super::FAST_RELAY
        ))
    };
    let status = |config: &ConfigFile| text(&outbox(&config.path, &["status"]).stdout);
    let strict = config(100);
    assert!(outbox(&strict.path, &["migrate"]).status.success());
    let big = "x".repeat(200);
    let lines = format!(
        "{{\"topic\":\"t\",\"key\":\"a\",\"payload\":\"{big}\"}}\n\
         {{\"topic\":\"t\",\"key\":\"a\",\"payload\":\"a2\"}}\n\
         {{\"topic\":\"t\",\"key\":\"b\",\"payload\":\"{big}\"}}\n\
         {{\"topic\":\"t\",\"key\":\"b\",\"payload\":\"b2\"}}\n\
         {{\"topic\":\"t\",\"key\":\"c\",\"payload\":\"c1\"}}\n"
    );
    let enqueued = super::outbox_with_stdin(&strict.path, &["enqueue", "--stdin"], &lines);
    assert!(enqueued.status.success(), "{}", text(&enqueued.stderr));
    let relay = RelayProcess::start(&strict.path);
    wait_for_status(&strict.path, "dead-lettered 2 ").await;
    assert_eq!(relay.terminate().0, Some(0));
    let now = status(&strict);
    assert!(
        now.contains("pending 2 ")
            && now.contains("parked keys 2")
            && now.contains("parked key \"a\""),
        "{now}"
    );
    let listed = text(&outbox(&strict.path, &["dead-letters", "list", "--key", "a"]).stdout);
    assert!(listed.contains("1 dead letter(s)"), "{listed}");
    let id = first_listed_id(&listed);
    let shown = text(&outbox(&strict.path, &["dead-letters", "show", &id]).stdout);
    assert!(
        shown.contains("key:             a") && shown.contains("max_payload"),
        "{shown}"
    );
    // The same, for programs: one JSON object per line, fields by their documented names.
    let json = |args: &[&str]| -> Vec<serde_json::Value> {
        let out = outbox(&strict.path, args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        (text(&out.stdout).lines())
            .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
            .collect()
    };
    let listed = json(&["dead-letters", "list", "--output", "json"]);
    assert_eq!(listed.len(), 2, "{listed:?}");
    let a = listed
        .iter()
        .find(|d| d["key"] == "a")
        .expect("key a's dead letter");
    assert_eq!(a["id"], id.as_str());
    assert_eq!(
        (a["topic"].as_str(), a["attempts"].as_u64()),
        (Some("t"), Some(1))
    );
    assert_eq!(a["payload"], big.as_str());
    assert!(
        a["last_error"]
            .as_str()
            .unwrap_or("")
            .contains("max_payload"),
        "{a}"
    );
    let shown = json(&["dead-letters", "show", &id, "--output", "json"]);
    assert_eq!(shown.as_slice(), std::slice::from_ref(a));
    let figures = json(&["status", "--output", "json"]);
    assert_eq!(figures.len(), 1, "{figures:?}");
    let figures = &figures[0];
    assert_eq!(
        (figures["relay"].as_str(), figures["pending"].as_u64()),
        (Some("default"), Some(2))
    );
    assert_eq!(
        (
            figures["dead_lettered"].as_u64(),
            figures["parked_keys"].as_u64()
        ),
        (Some(2), Some(2))
    );
    assert_eq!(figures["topics"][0]["topic"], "t");
    assert!(
        figures["oldest_pending_age_seconds"].as_f64().is_some(),
        "{figures}"
    );
    let parked: Vec<&str> = (figures["parked"].as_array().expect("parked keys").iter())
        .filter_map(|p| p["key"].as_str())
        .collect();
    assert_eq!(parked, ["a", "b"]);

    // Key b: purge its dead letter, release the key; its next message flows.
    let purged = outbox(&strict.path, &["dead-letters", "purge", "--key", "b"]);
    assert!(
        text(&purged.stdout).contains("purged 1"),
        "{}",
        text(&purged.stderr)
    );
    let released = outbox(&strict.path, &["dead-letters", "release", "b"]);
    assert!(
        text(&released.stdout).contains("released key \"b\""),
        "{}",
        text(&released.stderr)
    );

    // Key a: raise the limit and replay: the head goes first, then the parked rest.
    let relaxed = config(1_000_000);
    let replayed = outbox(&relaxed.path, &["dead-letters", "replay", "--key", "a"]);
    assert!(
        text(&replayed.stdout).contains("replayed 1"),
        "{}",
        text(&replayed.stderr)
    );
    let relay = RelayProcess::start(&relaxed.path);
    wait_for_status(&relaxed.path, "pending 0 ").await;
    assert_eq!(relay.terminate().0, Some(0));
    let keys = super::by_key(&super::redis_stream(&format!("{name}:t")).await);
    assert_eq!(keys["a"], vec![big.into_bytes(), b"a2".to_vec()]);
    assert_eq!(keys["b"], vec![b"b2".to_vec()]);
    assert_eq!(keys["c"], vec![b"c1".to_vec()]);
    let now = status(&relaxed);
    assert!(
        now.contains("dead-lettered 0 ") && now.contains("parked keys 0"),
        "{now}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Environment overrides as a platform sets them: variables that name no section (a
/// Kubernetes Service's, a test's) are ignored with one warning; an override is typed by the
/// setting it sets; a bad one stops start-up naming the key, saying "configuration error"
/// once.
#[test]
fn environment_overrides_cannot_break_start_up() {
    let dir = work_dir();
    let run = |vars: &[(&str, &str)]| {
        let mut command = outbox_in(
            &dir,
            &["--config", "examples/quickstart.toml", "migrate"].map(String::from),
        );
        command.envs(vars.iter().copied());
        command.output().expect("run the outbox binary")
    };
    let ok = run(&[
        ("OUTBOX_SERVICE_HOST", "10.0.0.1"),
        ("OUTBOX_PORT_9090_TCP_ADDR", "10.0.0.1"),
        ("OUTBOX_TEST_POSTGRES_URL", "postgres://nowhere/db"),
        ("OUTBOX_STORAGE__PATH", "other.db"),
        ("OUTBOX_RELAY__BATCH_SIZE", "250"),
    ]);
    let stderr = text(&ok.stderr);
    assert!(ok.status.success(), "{stderr}{}", text(&ok.stdout));
    assert!(
        stderr.contains("OUTBOX_PORT_9090_TCP_ADDR, OUTBOX_SERVICE_HOST, OUTBOX_TEST_POSTGRES_URL"),
        "one warning lists the ignored variables: {stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "colour codes in a log that is not a terminal: {stderr:?}"
    );
    assert!(
        dir.join("other.db").exists(),
        "OUTBOX_STORAGE__PATH was not applied"
    );
    assert!(!dir.join("quickstart.db").exists());

    let bad = run(&[("OUTBOX_RELAY__BATCH_SIZE", "many")]);
    let stderr = text(&bad.stderr);
    assert_eq!(bad.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("relay.batch_size"), "{stderr}");
    assert_eq!(stderr.matches("configuration error").count(), 1, "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The HTTP listener comes up before the sinks are built: a relay whose broker is down at
/// start-up (the AMQP sink connects when it is built, and the relay retries) is live and
/// says it is starting, and a SIGTERM then stops it cleanly.
#[cfg(feature = "amqp")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_broker_is_down_at_start_up_is_live_but_not_ready() {
    let dir = work_dir();
    let addr = format!("127.0.0.1:{}", super::free_port());
    let config = ConfigFile::new(&format!(
        "[storage]\ntype = \"sqlite\"\npath = \"{}\"\nmigrate = true\n\
         [observability]\nlisten = \"{addr}\"\n\
         [sink]\ntype = \"amqp\"\nuri = \"amqp://guest:guest@127.0.0.1:1/%2f\"\nexchange = \"\"\n",
        dir.join("down.db").display()
    ));
    let relay = RelayProcess::start(&config.path);
    super::wait_for_http(&addr).await;
    assert_eq!(super::http_get(&addr, "/health/live").0, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, body) = super::http_get(&addr, "/health/ready");
    assert_eq!(status, 503, "{body}");
    assert!(body.starts_with("starting"), "{body}");
    let (code, took) = relay.terminate();
    assert_eq!(code, Some(0), "a stop during start-up is not a failure");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `migrate --print-sql` reads the database and prints what `migrate` would run; applied by
/// hand (as a DBA would), it leaves the tables `migrate` would have made.
#[tokio::test]
async fn migrate_print_sql_gives_the_script_a_dba_applies() {
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_sqlite_dba"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("app.db");
    let config = ConfigFile::new(&format!(
        "[storage]\ntype = \"sqlite\"\npath = \"{}\"\n[sink]\ntype = \"stdout\"\n",
        path.display()
    ));
    let printed = outbox(&config.path, &["migrate", "--print-sql"]);
    let script = text(&printed.stdout);
    assert!(printed.status.success(), "{}", text(&printed.stderr));
    assert!(
        script.contains("CREATE TABLE \"outbox\"") && script.contains("outbox migration 1"),
        "{script}"
    );
    // Printing changed nothing: the tables are still missing.
    let status = outbox(&config.path, &["status"]);
    assert!(!status.status.success(), "{}", text(&status.stdout));

    let storage = outbox::sqlite::SqliteStorage::open(outbox::sqlite::SqliteConfig::new(&path))
        .await
        .expect("open the file");
    sqlx::raw_sql(&script)
        .execute(storage.pool())
        .await
        .expect("the printed script applies as it is");
    super::assert_migrated_by_hand(&config.path, "sqlite");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The security review's log forging and terminal injection (issue 30, items 4 and 8): a
/// message whose topic holds a newline and a forged log line, whose key and payload hold
/// terminal escapes and a right-to-left override, is dead-lettered; neither the relay's text
/// log nor `status`, `dead-letters list` or `show` prints a control character of it.
#[tokio::test]
async fn message_text_cannot_forge_log_lines_or_drive_the_terminal() {
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_sqlite_forge"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let name = outbox_tests::unique_name("sqlite_forge");
    let config = ConfigFile::new(&format!(
        "[storage]\ntype = \"sqlite\"\npath = \"{}\"\n{}\
         [sink]\ntype = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n\
         stream_prefix = \"{name}:\"\nmax_payload = 100\n\
         [observability]\nlog_format = \"text\"\n",
        dir.join("app.db").display(),
        super::FAST_RELAY
    ));
    assert!(outbox(&config.path, &["migrate"]).status.success());
    let forged = "2026-12-02T07:40:00.000000Z  INFO outbox::console: console action who=loopback";
    let payload = format!("\\u001b[2J{}", "x".repeat(200));
    let line = format!(
        "{{\"topic\":\"forge\\n{forged}\\u001b[31m\",\"key\":\"esc\\u001b]0;PWNED\\u0007\\u202egnp\",\"payload\":\"{payload}\"}}\n"
    );
    let enqueued = super::outbox_with_stdin(&config.path, &["enqueue", "--stdin"], &line);
    assert!(enqueued.status.success(), "{}", text(&enqueued.stderr));

    let no_color = [("NO_COLOR", "1")];
    let relay = super::spawn_relay(&config.path, &no_color, Stdio::null(), Stdio::piped());
    let status = || text(&outbox(&config.path, &["status"]).stdout);
    wait_for_status(&config.path, "dead-lettered 1 ").await;
    super::sigterm(&relay);
    let log = text(&relay.wait_with_output().expect("relay output").stderr);
    assert!(
        log.contains("forge\\n2026-12-02T07:40:00"),
        "the topic, escaped, in: {log}"
    );

    let listed = text(&outbox(&config.path, &["dead-letters", "list"]).stdout);
    let id = first_listed_id(&listed);
    let shown = text(&outbox(&config.path, &["dead-letters", "show", &id]).stdout);
    for (what, printed) in [
        ("the relay's log", &log),
        ("status", &status()),
        ("dead-letters list", &listed),
        ("dead-letters show", &shown),
    ] {
        assert!(
            !printed.contains(['\u{1b}', '\u{7}', '\u{202e}']),
            "{what} printed a terminal control: {printed:?}"
        );
        assert!(
            !printed.lines().any(|line| line.starts_with(forged)),
            "{what} printed a forged line: {printed}"
        );
    }
    assert!(
        shown.contains("esc\\u{1b}]0;PWNED\\u{7}\\u{202e}gnp"),
        "{shown}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
