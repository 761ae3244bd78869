//! The `outbox` binary run as a process against the real services: brokers swapped by
//! configuration alone, configuration errors, dead-letter repair, status, and SIGTERM.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

// `free_port` serves the listener and console modules too, through `super`.
use outbox_tests::{TempDir, free_addr, free_port, postgres_url, unique_name};
use sqlx::PgPool;

const EXIT_CONFIG: i32 = 78;

#[cfg(all(feature = "mysql", feature = "sqlite", feature = "file"))]
mod access;
#[cfg(feature = "redis")]
mod clock;
#[cfg(feature = "redis")]
mod console;
#[cfg(feature = "redis")]
mod deployment;
#[cfg(all(feature = "file", any(feature = "mysql", feature = "sqlite")))]
mod drain;
#[cfg(feature = "file")]
mod listener;
#[cfg(all(feature = "mysql", feature = "file"))]
mod mysql;
#[cfg(all(feature = "otlp", feature = "sqlite", feature = "file"))]
mod otlp;
#[cfg(all(feature = "nats", feature = "redis"))]
mod secrets;
#[cfg(all(feature = "sqlite", feature = "file"))]
mod sqlite;

/// The binary with `--config config`.
fn outbox_command(config: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox"));
    command.arg("--config").arg(config);
    command
}

fn outbox(config: &Path, args: &[&str]) -> Output {
    outbox_command(config)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run the outbox binary")
}

fn outbox_with_stdin(config: &Path, args: &[&str], input: &str) -> Output {
    let mut command = outbox_command(config);
    command.args(args);
    with_stdin(command, input)
}

/// Runs `command` with `input` on its standard input; its output.
fn with_stdin(mut command: Command, input: &str) -> Output {
    use std::io::Write;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("wait for the command")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// How a run of the binary ended: its exit code, and all it printed (standard output, then
/// standard error).
fn said(out: &Output) -> (Option<i32>, String) {
    let printed = format!("{}{}", text(&out.stdout), text(&out.stderr));
    (out.status.code(), printed)
}

/// Runs `check` on each (configuration, expected text): it must exit with the configuration
/// code, say the expected text, and never print the password `hunter2`.
fn assert_config_errors(cases: &[(String, &str)]) {
    for (contents, expected) in cases {
        let config = ConfigFile::new(contents);
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

/// After the script of `migrate --print-sql` was applied by hand, as a DBA would: the
/// command prints nothing more to do, `migrate` finds no work left, and `status` reads the
/// tables. `what` names the case in a failure.
fn assert_migrated_by_hand(config: &Path, what: &str) {
    let again = text(&outbox(config, &["migrate", "--print-sql"]).stdout);
    assert!(again.contains("is up to date"), "{what}: {again}");
    let migrated = outbox(config, &["migrate"]);
    assert!(
        migrated.status.success(),
        "{what}: {}",
        text(&migrated.stderr)
    );
    assert!(
        !text(&migrated.stderr).contains("applying outbox migration"),
        "{what}: migrate found work left: {}",
        text(&migrated.stderr)
    );
    let status = outbox(config, &["status"]);
    assert!(
        text(&status.stdout).contains("pending 0"),
        "{what}: {}",
        text(&status.stderr)
    );
}

/// A configuration file in a temporary directory, removed on drop.
struct ConfigFile {
    dir: PathBuf,
    path: PathBuf,
}

impl ConfigFile {
    fn new(contents: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_name("outbox_cli"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("outbox.toml");
        std::fs::write(&path, contents).expect("write config");
        ConfigFile { dir, path }
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn storage_section(schema: &str) -> String {
    format!(
        "[storage]\nurl = \"{}\"\nschema = \"{schema}\"\n",
        postgres_url()
    )
}

const FAST_RELAY: &str = "[relay]\npoll_interval = \"100ms\"\nshutdown_timeout = \"5s\"\nbackoff = { initial = \"100ms\", max = \"1s\" }\n";

async fn pool() -> PgPool {
    PgPool::connect(&postgres_url())
        .await
        .expect("PostgreSQL must be running")
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

async fn drop_schema(pool: &PgPool, schema: &str) {
    let _ = sqlx::query(&format!(r#"DROP SCHEMA IF EXISTS "{schema}" CASCADE"#))
        .execute(pool)
        .await;
}

/// `outbox relay` with `env` set (and `RUST_LOG` unset unless `env` sets it), its output
/// going to `stdout` and `stderr`.
fn spawn_relay(
    config: &Path,
    env: &[(&str, &str)],
    stdout: impl Into<Stdio>,
    stderr: impl Into<Stdio>,
) -> std::process::Child {
    outbox_command(config)
        .arg("relay")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("start the relay")
}

/// Sends SIGTERM to `child`; the `kill` command must succeed.
fn sigterm(child: &std::process::Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -TERM {}", child.id());
}

/// Until `check` holds, polling; panics with `what` after `timeout`.
async fn until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A relay process, stopped with SIGTERM.
struct RelayProcess(std::process::Child);

impl RelayProcess {
    fn start(config: &Path) -> Self {
        RelayProcess(spawn_relay(config, &[], Stdio::null(), Stdio::inherit()))
    }

    /// Sends SIGTERM and waits; returns the exit code and how long the exit took.
    fn terminate(mut self) -> (Option<i32>, Duration) {
        let asked = Instant::now();
        sigterm(&self.0);
        let deadline = asked + Duration::from_secs(30);
        loop {
            if let Some(status) = self.0.try_wait().expect("wait") {
                return (status.code(), asked.elapsed());
            }
            assert!(
                Instant::now() < deadline,
                "relay did not exit within 30 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn wait_until_empty(pool: &PgPool, schema: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let left = count(pool, &format!(r#"SELECT count(*) FROM "{schema}".outbox"#)).await;
        if left == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{left} messages still in {schema}.outbox after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a test against PostgreSQL works in: the pool, a fresh schema `cli_<what>_…` and a
/// unique `name` (`<what>_…`) for its broker's streams and queues.
struct Fresh {
    pool: PgPool,
    schema: String,
    name: String,
}

impl Fresh {
    async fn new(what: &str) -> Fresh {
        Fresh {
            pool: pool().await,
            schema: unique_name(&format!("cli_{what}")),
            name: unique_name(what),
        }
    }
}

/// The end of a [`Fresh`] test: `relay` exits 0 on SIGTERM, then the schema is dropped.
async fn finish(relay: RelayProcess, pool: &PgPool, schema: &str) {
    assert_eq!(relay.terminate().0, Some(0), "the relay's exit on SIGTERM");
    drop_schema(pool, schema).await;
}

/// A fast-polling relay on `schema`'s outbox, with `sections` after its `[relay]`.
fn relay_config(schema: &str, sections: &str) -> ConfigFile {
    ConfigFile::new(&format!(
        "{}{FAST_RELAY}{sections}",
        storage_section(schema)
    ))
}

/// A sink to the local Redis whose streams are prefixed `name:`; with `max_payload`, it
/// refuses larger payloads.
fn redis_sink(name: &str, max_payload: Option<usize>) -> String {
    let limit = max_payload.map_or(String::new(), |max| format!("max_payload = {max}\n"));
    format!(
        "[sink]\ntype = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\nstream_prefix = \"{name}:\"\n{limit}"
    )
}

/// A fast-polling relay on `schema`'s outbox with its listener (and console) on `addr`, to
/// Redis streams prefixed `name:`.
fn listening_config(schema: &str, name: &str, addr: &str) -> ConfigFile {
    relay_config(
        schema,
        &format!("{}{}", listen_on(addr), redis_sink(name, None)),
    )
}

/// A file sink writing JSON lines to `path`.
fn file_sink(path: &Path) -> String {
    format!("[sink]\ntype = \"file\"\npath = \"{}\"\n", path.display())
}

/// The `[observability]` section of a listener on `addr`.
fn listen_on(addr: &str) -> String {
    format!("[observability]\nlisten = \"{addr}\"\n")
}

/// `outbox migrate` with `config`; it must succeed.
fn migrate(config: &ConfigFile) {
    let out = outbox(&config.path, &["migrate"]);
    assert!(out.status.success(), "migrate: {}", text(&out.stderr));
}

/// `outbox enqueue --stdin` of the JSON `lines` with `config`; it must succeed.
fn enqueue(config: &ConfigFile, lines: &str) {
    let out = outbox_with_stdin(&config.path, &["enqueue", "--stdin"], lines);
    assert!(out.status.success(), "enqueue: {}", text(&out.stderr));
}

#[test]
fn bad_configurations_exit_with_the_configuration_code_and_name_the_key() {
    let storage = storage_section("cli_bad");
    let cases: Vec<(String, &str)> = vec![
        (format!("{storage}[sink]\ntype = \"mqtt\"\n"), "sink.type `mqtt` is unknown"),
        ("[sink]\ntype = \"redis\"\n".to_string(), "storage.url is missing"),
        (format!("[storage]\nurl = \"{}\"\nschema = \"Robert'); DROP\"\n[sink]\ntype = \"redis\"\n", postgres_url()), "storage.schema"),
        (format!("{storage}[relay]\nbatch_size = 0\n[sink]\ntype = \"redis\"\n"), "relay.batch_size"),
        (format!("{storage}[sink\ntype = \"redis\"\n"), "not valid TOML"),
        (format!("{storage}[relay]\npoll_intervall = \"1s\"\n[sink]\ntype = \"redis\"\n"), "poll_intervall"),
        (format!("{storage}[sink]\ntype = \"redis\"\nurl = \"http://nope\"\n"), "sink.url"),
        ("[storage]\nurl = \"postgres://app:hunter2@127.0.0.1:1/x\"\nschema = \"Bad\"\n[sink]\ntype = \"redis\"\n".to_string(), "storage.schema"),
        // Redis takes a key's messages in one call: one round × its 5 s publish time-out.
        (format!("{storage}[relay]\nlease = \"4s\"\n[sink]\ntype = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n"), "relay.lease is 4s, shorter than the worst case of a batch: 1 round(s)"),
        // 8 rounds (storage.max_per_key) × AMQP's 15 s publish time-out do not fit a 10 s lease.
        #[cfg(feature = "amqp")]
        (format!("{storage}[relay]\nlease = \"10s\"\n[sink]\ntype = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange = \"amq.topic\"\n"), "relay.lease is 10s, shorter than the worst case of a batch: 8 round(s)"),
        #[cfg(feature = "amqp")]
        (format!("{storage}[relay]\nlease = \"10s\"\n[sink]\ntype = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange = \"amq.topic\"\n"), "or lower the storage's max_per_key or the sink's time-out"),
        (format!("{storage}[relay]\nper_key_order = false\n[sink]\ntype = \"redis\"\n"), "relay.per_key_order is a setting of the storage: move it to [storage]"),
        #[cfg(feature = "sqlite")]
        ("[storage]\ntype = \"sqlite\"\npath = \"/nonexistent/outbox/app.db\"\n[sink]\ntype = \"redis\"\n".to_string(), "storage.path"),
        #[cfg(feature = "sqlite")]
        ("[storage]\ntype = \"sqlite\"\npath = \"/etc/hostname\"\n[sink]\ntype = \"redis\"\n".to_string(), "storage.path"),
        #[cfg(feature = "file")]
        (format!("{storage}[sink]\ntype = \"file\"\npath = \"/nonexistent/outbox/out.jsonl\"\n"), "sink.path"),
    ];
    assert_config_errors(&cases);
    let missing = outbox(Path::new("/nonexistent/outbox.toml"), &["check"]);
    assert_eq!(missing.status.code(), Some(EXIT_CONFIG));
    assert!(text(&missing.stderr).contains("/nonexistent/outbox.toml"));
}

/// Tables that were never migrated are reported as such, with what to run, by every command
/// that reads them: not as a configuration error (the configuration is right).
#[test]
fn tables_never_migrated_are_reported_with_what_to_run() {
    let schema = unique_name("cli_unmigrated");
    let mut configs = vec![(
        "postgres",
        format!("{}[sink]\ntype = \"stdout\"\n", storage_section(&schema)),
    )];
    #[cfg(feature = "sqlite")]
    {
        let dir = std::env::temp_dir().join(&schema);
        std::fs::create_dir_all(&dir).expect("temp dir");
        configs.push((
            "sqlite",
            format!(
                "[storage]\ntype = \"sqlite\"\npath = \"{}\"\nmigrate = false\n[sink]\ntype = \"stdout\"\n",
                dir.join("app.db").display()
            ),
        ));
    }
    for (storage, contents) in configs {
        let config = ConfigFile::new(&contents);
        for command in [&["status"][..], &["dead-letters", "list"], &["check"]] {
            let (code, said) = said(&outbox(&config.path, command));
            assert_eq!(
                code,
                Some(1),
                "{storage} {command:?}: a runtime failure, not a configuration error: {said}"
            );
            assert!(
                said.contains("schema error") && said.contains("run `outbox migrate`"),
                "{storage} {command:?}: {said}"
            );
            assert!(
                !said.contains("configuration error"),
                "{storage} {command:?}: {said}"
            );
        }
    }
}

/// JSON lines for `outbox enqueue --stdin`: 30 messages over 3 keys, one binary payload.
fn sample_lines() -> String {
    let mut lines: Vec<String> = (0..30)
        .map(|i| {
            format!(
                r#"{{"topic":"orders","key":"k{}","payload":"m{i:02}","headers":{{"n":"{i}"}}}}"#,
                i % 3
            )
        })
        .collect();
    lines.push(r#"{"topic":"orders","key":"bin","payload_base64":"AP/+"}"#.into());
    lines.join("\n")
}

/// Per key, the payloads in arrival order.
fn by_key(
    messages: &[(Option<String>, Vec<u8>)],
) -> std::collections::BTreeMap<String, Vec<Vec<u8>>> {
    let mut keys = std::collections::BTreeMap::<String, Vec<Vec<u8>>>::new();
    for (key, payload) in messages {
        keys.entry(key.clone().unwrap_or_default())
            .or_default()
            .push(payload.clone());
    }
    keys
}

fn check_sample(arrived: &[(Option<String>, Vec<u8>)], broker: &str) {
    assert_eq!(arrived.len(), 31, "{broker}: every message once");
    let keys = by_key(arrived);
    for k in 0..3 {
        let expected: Vec<Vec<u8>> = (0..30)
            .filter(|i| i % 3 == k)
            .map(|i| format!("m{i:02}").into_bytes())
            .collect();
        assert_eq!(keys[&format!("k{k}")], expected, "{broker}: order of k{k}");
    }
    assert_eq!(
        keys["bin"],
        vec![vec![0u8, 255, 254]],
        "{broker}: binary payload"
    );
}

/// Runs the relay with `sink` until the outbox is empty, then stops it with SIGTERM.
async fn relay_once(pool: &PgPool, schema: &str, sink: &str) {
    let config = relay_config(schema, sink);
    migrate(&config);
    enqueue(&config, &sample_lines());
    let relay = RelayProcess::start(&config.path);
    wait_until_empty(pool, schema, Duration::from_secs(60)).await;
    let (code, _) = relay.terminate();
    assert_eq!(code, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_messages_go_to_each_broker_by_changing_only_the_configuration() {
    let Fresh { pool, schema, name } = Fresh::new("swap").await;

    #[cfg(feature = "redis")]
    {
        relay_once(&pool, &schema, &redis_sink(&name, None)).await;
        check_sample(&redis_stream(&format!("{name}:orders")).await, "redis");
    }
    #[cfg(feature = "amqp")]
    {
        let queue = amqp_queue(&name).await;
        let sink = format!(
            "[sink]\ntype = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange = \"\"\nrouting_key = \"{}\"\n",
            queue.queue
        );
        relay_once(&pool, &schema, &sink).await;
        check_sample(&queue.drain(31).await, "amqp");
    }
    #[cfg(feature = "kafka")]
    {
        let topic = kafka_topic(&name).await;
        let sink = format!(
            "[sink]\ntype = \"kafka\"\nbootstrap_servers = \"{}\"\ntopics = {{ orders = \"{topic}\" }}\n",
            outbox_tests::kafka::brokers()
        );
        relay_once(&pool, &schema, &sink).await;
        check_sample(&kafka_read(&topic, 31).await, "kafka");
    }
    drop_schema(&pool, &schema).await;
}

#[cfg(feature = "redis")]
async fn redis_stream(stream: &str) -> Vec<(Option<String>, Vec<u8>)> {
    use outbox::redis::redis;
    let client = redis::Client::open("redis://127.0.0.1:6379").expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis must be running at 127.0.0.1:6379");
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .expect("XRANGE");
    reply
        .ids
        .iter()
        .map(|e| {
            (
                e.get::<String>(outbox::redis::wire::KEY),
                e.get::<Vec<u8>>(outbox::redis::wire::PAYLOAD)
                    .unwrap_or_default(),
            )
        })
        .collect()
}

#[cfg(feature = "amqp")]
struct AmqpQueue {
    channel: outbox::amqp::lapin::Channel,
    queue: String,
}

/// A queue `<name>.q` of its own that the sink reaches through the broker's default
/// exchange (which routes by queue name): nothing to declare or bind besides the queue.
#[cfg(feature = "amqp")]
async fn amqp_queue(name: &str) -> AmqpQueue {
    use outbox::amqp::lapin::{
        Connection, ConnectionProperties, options::QueueDeclareOptions, types::FieldTable,
    };
    let conn = Connection::connect(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        ConnectionProperties::default(),
    )
    .await
    .expect("RabbitMQ must be running at 127.0.0.1:5672");
    let channel = conn.create_channel().await.expect("channel");
    let queue = format!("{name}.q");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue");
    std::mem::forget(conn);
    AmqpQueue { channel, queue }
}

#[cfg(feature = "amqp")]
impl AmqpQueue {
    async fn drain(&self, n: usize) -> Vec<(Option<String>, Vec<u8>)> {
        use outbox::amqp::lapin::options::BasicGetOptions;
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.len() < n && Instant::now() < deadline {
            match self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get")
            {
                Some(message) => {
                    let delivery = message.delivery;
                    let key = delivery
                        .properties
                        .headers()
                        .as_ref()
                        .and_then(|h| h.inner().get(outbox::amqp::wire::KEY).cloned())
                        .and_then(|v| match v {
                            outbox::amqp::lapin::types::AMQPValue::LongString(s) => {
                                Some(s.to_string())
                            }
                            _ => None,
                        });
                    out.push((key, delivery.data));
                }
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        out
    }
}

#[cfg(feature = "kafka")]
async fn kafka_topic(name: &str) -> String {
    let brokers = outbox_tests::kafka::require_broker();
    outbox_tests::kafka::create_topic(&brokers, name, 1).await;
    name.to_string()
}

#[cfg(feature = "kafka")]
async fn kafka_read(topic: &str, n: usize) -> Vec<(Option<String>, Vec<u8>)> {
    let brokers = outbox_tests::kafka::brokers();
    outbox_tests::kafka::consume(&brokers, topic, 1, n, Duration::from_secs(30))
        .await
        .into_iter()
        .map(|r| (r.key, r.payload))
        .collect()
}

/// Redis with a payload limit small enough to reject one message as too large: a permanent
/// failure, dead-lettered at once, parking its key.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_replay_restores_key_order_and_status_matches_the_table() {
    let Fresh { pool, schema, name } = Fresh::new("dead").await;
    let strict = relay_config(&schema, &redis_sink(&name, Some(100)));
    migrate(&strict);
    let big = "x".repeat(200);
    let lines = format!(
        "{{\"topic\":\"t\",\"key\":\"a\",\"payload\":\"{big}\"}}\n{{\"topic\":\"t\",\"key\":\"a\",\"payload\":\"a2\"}}\n{{\"topic\":\"t\",\"key\":\"a\",\"payload\":\"a3\"}}\n{{\"topic\":\"t\",\"key\":\"b\",\"payload\":\"b1\"}}\n"
    );
    enqueue(&strict, &lines);
    let relay = RelayProcess::start(&strict.path);
    let dead = format!(r#"SELECT count(*) FROM "{schema}".outbox_dead_letters"#);
    let (db, dead_sql) = (&pool, &dead);
    until("a dead letter", Duration::from_secs(30), || async move {
        count(db, dead_sql).await > 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(relay.terminate().0, Some(0));

    // status matches the table.
    let status = text(&outbox(&strict.path, &["status"]).stdout);
    let pending = count(&pool, &format!(r#"SELECT count(*) FROM "{schema}".outbox"#)).await;
    let parked = count(
        &pool,
        &format!(r#"SELECT count(*) FROM "{schema}".outbox_parked_keys"#),
    )
    .await;
    assert_eq!((pending, parked, count(&pool, &dead).await), (2, 1, 1));
    assert!(
        status.contains("pending 2 ")
            && status.contains("dead-lettered 1 ")
            && status.contains("parked keys 1"),
        "{status}"
    );
    assert!(status.contains("parked key \"a\""), "{status}");
    let listed = text(&outbox(&strict.path, &["dead-letters", "list"]).stdout);
    assert!(
        listed.contains("1 dead letter(s)") && listed.contains("larger than sink.max_payload"),
        "{listed}"
    );
    // `--error` matches the last error's text in the storage, ASCII case ignored.
    let found = |text_in_error: &str| {
        let out = outbox(
            &strict.path,
            &["dead-letters", "list", "--error", text_in_error],
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    assert!(found("MAX_PAYLOAD").contains("1 dead letter(s)"));
    assert!(found("no such error").contains("0 dead letter(s)"));
    let replay = outbox(
        &strict.path,
        &["dead-letters", "replay", "--error", "no such error"],
    );
    assert!(
        text(&replay.stdout).contains("replayed 0"),
        "{}",
        text(&replay.stderr)
    );
    assert_eq!(
        redis_stream(&format!("{name}:t")).await.len(),
        1,
        "only b1 may pass"
    );

    // The operator raises the limit and replays: the head goes first, then the parked rest.
    let relaxed = relay_config(&schema, &redis_sink(&name, Some(1_000_000)));
    let replay = outbox(&relaxed.path, &["dead-letters", "replay", "--all"]);
    assert!(
        text(&replay.stdout).contains("replayed 1"),
        "{}",
        text(&replay.stderr)
    );
    let relay = RelayProcess::start(&relaxed.path);
    wait_until_empty(&pool, &schema, Duration::from_secs(30)).await;
    assert_eq!(relay.terminate().0, Some(0));
    let keys = by_key(&redis_stream(&format!("{name}:t")).await);
    assert_eq!(
        keys["a"],
        vec![big.into_bytes(), b"a2".to_vec(), b"a3".to_vec()]
    );
    let status = text(&outbox(&relaxed.path, &["status"]).stdout);
    assert!(
        status.contains("pending 0 ")
            && status.contains("dead-lettered 0 ")
            && status.contains("parked keys 0"),
        "{status}"
    );
    drop_schema(&pool, &schema).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_busy_relay_exits_in_time_and_loses_nothing() {
    let Fresh { pool, schema, name } = Fresh::new("term").await;
    let config = relay_config(&schema, &redis_sink(&name, None));
    migrate(&config);
    let total = 50_000i64;
    sqlx::query(&format!(
        r#"INSERT INTO "{schema}".outbox (id, topic, partition_key, payload)
           SELECT gen_random_uuid(), 't', 'k' || (i % 100), convert_to('m' || i, 'UTF8') FROM generate_series(1, $1) AS i"#
    ))
    .bind(total)
    .execute(&pool)
    .await
    .unwrap();
    let relay = RelayProcess::start(&config.path);
    let left = format!(r#"SELECT count(*) FROM "{schema}".outbox"#);
    let (db, left_sql) = (&pool, &left);
    until(
        "the relay under way",
        Duration::from_secs(60),
        || async move { count(db, left_sql).await <= total - 1000 },
    )
    .await;
    let (code, took) = relay.terminate();
    assert_eq!(code, Some(0));
    assert!(
        took < Duration::from_secs(5 + 3),
        "exit took {took:?}, shutdown_timeout is 5 s"
    );
    let claimed = count(&pool, &format!(r#"SELECT count(*) FROM "{schema}".outbox WHERE claim_token IS NOT NULL AND available_at > now()"#)).await;
    assert_eq!(claimed, 0, "messages left claimed after shutdown");
    let remaining = count(&pool, &left).await;
    let delivered = redis_stream(&format!("{name}:t")).await;
    let mut seen: std::collections::HashSet<Vec<u8>> =
        delivered.into_iter().map(|(_, p)| p).collect();
    let rows: Vec<Vec<u8>> =
        sqlx::query_scalar(&format!(r#"SELECT payload FROM "{schema}".outbox"#))
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len() as i64, remaining);
    seen.extend(rows);
    assert_eq!(seen.len() as i64, total, "a message was lost");
    assert!(remaining < total, "nothing was delivered before SIGTERM");
    assert!(
        remaining > 0,
        "the relay finished before SIGTERM: the test needs a busier relay"
    );
    drop_schema(&pool, &schema).await;
}

/// An HTTP answer: status, header block (lower-cased names), body.
struct Reply {
    status: u16,
    headers: String,
    body: String,
}

/// One plain HTTP/1.1 request; `Host` is `addr` unless `extra` gives one.
fn request(addr: &str, method: &str, path: &str, extra: &[(&str, &str)], body: &str) -> Reply {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the relay's listener");
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !extra
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (name, value) in extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if method == "POST" {
        head.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("send");
    stream.write_all(body.as_bytes()).expect("send the body");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let (headers, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Reply {
        status: headers
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        headers: headers.to_ascii_lowercase(),
        body: body.to_string(),
    }
}

/// A plain HTTP/1.1 GET: (status code, body).
fn http_get(addr: &str, path: &str) -> (u16, String) {
    http_get_as(addr, path, addr)
}

/// [`http_get`] with `host` in the `Host` header.
fn http_get_as(addr: &str, path: &str, host: &str) -> (u16, String) {
    let reply = request(addr, "GET", path, &[("Host", host)], "");
    (reply.status, reply.body)
}

/// `/health/ready` once the relays are built and checked (it says `starting` before).
async fn checked_readiness(addr: &str) -> (u16, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = http_get(addr, "/health/ready");
        if !body.starts_with("starting") || Instant::now() > deadline {
            return (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of the first series in `metrics` (Prometheus text) whose line `wanted` picks.
fn metric(metrics: &str, wanted: impl Fn(&str) -> bool) -> Option<f64> {
    let line = metrics.lines().find(|l| wanted(l))?;
    line.rsplit(' ').next()?.parse().ok()
}

async fn wait_for_http(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the relay never opened {addr}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_endpoints_report_the_relay() {
    let Fresh { pool, schema, name } = Fresh::new("obs").await;
    let addr = free_addr();
    let config = relay_config(
        &schema,
        &format!(
            "{}log_format = \"json\"\n{}",
            listen_on(&addr),
            redis_sink(&name, None)
        ),
    );
    migrate(&config);
    enqueue(&config, &sample_lines());
    let relay = RelayProcess::start(&config.path);
    wait_until_empty(&pool, &schema, Duration::from_secs(30)).await;
    wait_for_http(&addr).await;
    assert_eq!(http_get(&addr, "/health/live").0, 200);
    // A loopback listener answers only a loopback Host on every route: a page that rebinds
    // its name to 127.0.0.1 reads no metrics and no error texts (issue 30, review item 7).
    // Host is parsed strictly: a port that is not a number, text after a bracketed address
    // and a second Host header are refused too.
    for path in ["/metrics", "/health/ready", "/health/live"] {
        for host in [
            "evil.example",
            "localhost:evil.example",
            "[::1]evil.example",
            // Two Host headers.
            "localhost\r\nHost: evil.example",
        ] {
            let (status, body) = http_get_as(&addr, path, host);
            assert!(
                status == 403 || status == 400,
                "{path} for Host {host:?}: {status} {body}"
            );
            assert!(!body.contains("outbox_"), "{path}: {body}");
        }
        assert_eq!(http_get_as(&addr, path, "localhost").0, 200, "{path}");
    }
    let (status, body) = checked_readiness(&addr).await;
    assert_eq!(status, 200, "{body}");
    let (status, metrics) = http_get(&addr, "/metrics");
    assert_eq!(status, 200);
    let delivered = metric(&metrics, |l| {
        l.starts_with("outbox_delivered_total{") && l.contains("topic=\"orders\"")
    })
    .unwrap_or_else(|| panic!("no delivered counter for topic orders in:\n{metrics}"));
    assert_eq!(delivered, 31.0);
    for name in [
        "outbox_publish_duration_seconds_bucket",
        "outbox_batch_duration_seconds_bucket",
        "outbox_delivery_latency_seconds_bucket",
        "outbox_sink_up",
        "outbox_pending",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    // One stable label per relay, its configured name, on every series: no host or process
    // id, so a restart or a second replica adds no new series.
    for line in metrics.lines().filter(|l| l.starts_with("outbox_")) {
        if line.starts_with("outbox_build_info") {
            assert!(
                line.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
                "{line}"
            );
        } else {
            assert!(line.contains("relay=\"default\""), "{line}");
        }
    }
    assert_eq!(relay.terminate().0, Some(0));

    // A sink that cannot be reached: live, but not ready.
    let addr = free_addr();
    let down = relay_config(
        &schema,
        &format!(
            "{}[sink]\ntype = \"redis\"\nurl = \"redis://127.0.0.1:1\"\npublish_timeout = \"300ms\"\n",
            listen_on(&addr)
        ),
    );
    let relay = RelayProcess::start(&down.path);
    wait_for_http(&addr).await;
    assert_eq!(http_get(&addr, "/health/live").0, 200);
    let (status, body) = checked_readiness(&addr).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("relay default: sink"), "{body}");
    finish(relay, &pool, &schema).await;
}

/// A database that answers the health check but refuses every claim (here: a column the
/// claim needs is renamed away) is not ready: after three failed runs in a row
/// `/health/ready` says so with the error, `outbox_run_failures_total` counts them, and once
/// claims succeed again the relay is ready and delivers (issue 30 item 3).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_every_claim_fails_and_comes_back_with_the_claims() {
    let Fresh { pool, schema, name } = Fresh::new("runs").await;
    let addr = free_addr();
    let config = listening_config(&schema, &name, &addr);
    migrate(&config);
    let relay = RelayProcess::start(&config.path);
    wait_for_http(&addr).await;
    let (status, body) = checked_readiness(&addr).await;
    assert_eq!(status, 200, "{body}");
    let rename = |from: &str, to: &str| {
        format!(r#"ALTER TABLE "{schema}".outbox RENAME COLUMN {from} TO {to}"#)
    };
    sqlx::query(&rename("attempts", "attempts_gone"))
        .execute(&pool)
        .await
        .expect("rename a column away");
    let deadline = Instant::now() + Duration::from_secs(60);
    let body = loop {
        let (status, body) = http_get(&addr, "/health/ready");
        if status == 503 && body.contains("runs failed") {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "still ready while every claim fails: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        body.contains("relay default: its last") && body.contains("attempts"),
        "the answer names the relay and the error: {body}"
    );
    let (_, metrics) = http_get(&addr, "/metrics");
    let failures = metric(&metrics, |l| l.starts_with("outbox_run_failures_total{"))
        .unwrap_or_else(|| panic!("no outbox_run_failures_total in:\n{metrics}"));
    assert!(failures >= 3.0, "{failures}");

    sqlx::query(&rename("attempts_gone", "attempts"))
        .execute(&pool)
        .await
        .expect("rename the column back");
    enqueue(&config, &sample_lines());
    wait_until_empty(&pool, &schema, Duration::from_secs(60)).await;
    let (status, body) = http_get(&addr, "/health/ready");
    assert_eq!(status, 200, "ready again once claims succeed: {body}");
    finish(relay, &pool, &schema).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_relays_run_in_one_process_each_with_its_own_table_and_sink() {
    let pool = pool().await;
    let (orders, billing) = (unique_name("cli_orders"), unique_name("cli_billing"));
    let name = unique_name("multi");
    let config = ConfigFile::new(&format!(
        r#"[storage]
url = "{url}"
migrate = true
[sink]
type = "redis"
url = "redis://127.0.0.1:6379"
[[relay]]
name = "orders"
poll_interval = "100ms"
storage = {{ schema = "{orders}" }}
sink = {{ type = "redis", url = "redis://127.0.0.1:6379", stream_prefix = "{name}:orders:" }}
[[relay]]
name = "billing"
poll_interval = "100ms"
storage = {{ schema = "{billing}", table = "events" }}
sink = {{ type = "redis", url = "redis://127.0.0.1:6379", stream_prefix = "{name}:billing:" }}
"#,
        url = postgres_url()
    ));
    let relay = RelayProcess::start(&config.path);
    for (relay_name, schema, table) in [
        ("orders", &orders, "outbox"),
        ("billing", &billing, "events"),
    ] {
        // The relay migrates at start-up; enqueue once the table is there.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = outbox(
                &config.path,
                &[
                    "enqueue", "--relay", relay_name, "--topic", "t", "--key", "k", relay_name,
                ],
            );
            if out.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "enqueue into {schema}.{table} failed: {}",
                text(&out.stderr)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for (schema, table) in [(&orders, "outbox"), (&billing, "events")] {
        let (db, left) = (
            &pool,
            &format!(r#"SELECT count(*) FROM "{schema}".{table}"#),
        );
        until(
            &format!("{schema}.{table} drained"),
            Duration::from_secs(30),
            || async move { count(db, left).await == 0 },
        )
        .await;
    }
    assert_eq!(relay.terminate().0, Some(0));
    assert_eq!(
        redis_stream(&format!("{name}:orders:t")).await,
        vec![(Some("k".into()), b"orders".to_vec())]
    );
    assert_eq!(
        redis_stream(&format!("{name}:billing:t")).await,
        vec![(Some("k".into()), b"billing".to_vec())]
    );
    let ambiguous = outbox(&config.path, &["status"]);
    assert!(
        ambiguous.status.success(),
        "status of every relay: {}",
        text(&ambiguous.stderr)
    );
    let unknown = outbox(&config.path, &["dead-letters", "list", "--relay", "nope"]);
    assert_eq!(unknown.status.code(), Some(EXIT_CONFIG));
    assert!(text(&unknown.stderr).contains("orders, billing"));
    drop_schema(&pool, &orders).await;
    drop_schema(&pool, &billing).await;
}

#[test]
fn every_example_configuration_is_valid() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut checked = 0;
    for entry in std::fs::read_dir(&examples).expect("examples/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            // `check` exits 78 on any configuration error, 1 if a service is unreachable or
            // the tables are missing, which is fine here. It runs in a directory of its own:
            // relative paths (the quick start's SQLite file) resolve there.
            let cwd = ConfigFile::new("");
            let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
                .current_dir(&cwd.dir)
                .arg("--config")
                .arg(&path)
                .arg("check")
                .output()
                .expect("run the outbox binary");
            assert_ne!(
                out.status.code(),
                Some(EXIT_CONFIG),
                "{}: {}",
                path.display(),
                text(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 5,
        "expected an example per sink and one with several relays"
    );
}

/// `enqueue --stdin` commits in transactions of 1,000: when a later one fails, the ids of
/// those that committed have been printed, and the error says how many are in the outbox.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_from_stdin_accounts_for_what_committed_when_a_later_batch_fails() {
    let Fresh { pool, schema, .. } = Fresh::new("enqueue").await;
    let config = ConfigFile::new(&format!(
        "{}[sink]\ntype = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n",
        storage_section(&schema)
    ));
    migrate(&config);
    // The database refuses one message of the second transaction.
    for statement in [
        format!(
            r#"CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"#
        ),
        format!(
            r#"CREATE TRIGGER refuse BEFORE INSERT ON "{schema}".outbox FOR EACH ROW
               WHEN (NEW.topic = 'poison') EXECUTE FUNCTION "{schema}".refuse()"#
        ),
    ] {
        sqlx::query(&statement)
            .execute(&pool)
            .await
            .expect("trigger");
    }
    let lines: String = (1..=1500)
        .map(|i| {
            let topic = if i == 1400 { "poison" } else { "t" };
            format!("{{\"topic\":\"{topic}\",\"payload\":\"{i}\"}}\n")
        })
        .collect();
    let out = outbox_with_stdin(&config.path, &["enqueue", "--stdin"], &lines);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("committed 1000 of 1500"), "{stderr}");
    assert!(
        stderr.contains("1000 of 1500 message(s) committed")
            && stderr.contains("messages 1001 to 1500 were not enqueued"),
        "{stderr}"
    );
    let printed: std::collections::BTreeSet<String> = stdout.lines().map(str::to_string).collect();
    let stored: Vec<String> =
        sqlx::query_scalar(&format!(r#"SELECT id::text FROM "{schema}".outbox"#))
            .fetch_all(&pool)
            .await
            .expect("ids");
    assert_eq!(printed.len(), 1000);
    assert_eq!(
        stored
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>(),
        printed
    );
    drop_schema(&pool, &schema).await;
}

/// `migrate --print-sql` on PostgreSQL prints the steps the database lacks without running
/// them; applied with psql, as a DBA would, they leave nothing for `migrate` to do. Three
/// cases: a new lease-mode table, an upgrade (whose new index is built concurrently,
/// outside the script's transactions), and a new log-mode table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_print_sql_gives_the_script_a_dba_applies_with_psql() {
    let pool = pool().await;
    let apply = |script: &str| {
        let file = std::env::temp_dir().join(format!("{}.sql", unique_name("outbox_dba")));
        std::fs::write(&file, script).expect("write the script");
        let out = Command::new("psql")
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-f"])
            .arg(&file)
            .arg(postgres_url())
            .output()
            .expect("psql is installed with PostgreSQL");
        let _ = std::fs::remove_file(&file);
        assert!(
            out.status.success(),
            "psql: {}\n{script}",
            text(&out.stderr)
        );
    };
    for (mode, upgrade) in [("lease", false), ("lease", true), ("log", false)] {
        let schema = unique_name("cli_dba");
        let config = ConfigFile::new(&format!(
            "{}mode = \"{mode}\"\n[sink]\ntype = \"stdout\"\n",
            storage_section(&schema)
        ));
        if upgrade {
            let table = outbox::postgres::OutboxTable::new(&schema, "outbox").expect("names");
            let mut conn = pool.acquire().await.expect("connection");
            table
                .migrate_to(&mut conn, 1)
                .await
                .expect("an older release");
        }
        let printed = outbox(&config.path, &["migrate", "--print-sql"]);
        let script = text(&printed.stdout);
        assert!(printed.status.success(), "{}", text(&printed.stderr));
        assert!(script.contains("outbox migration"), "{script}");
        if upgrade {
            assert!(
                script.contains("CREATE INDEX CONCURRENTLY")
                    && !script.contains("outbox migration 1 "),
                "{script}"
            );
        }
        // Printing changed nothing.
        let versions = format!(
            r#"SELECT count(*) FROM pg_tables WHERE schemaname = '{schema}' AND tablename = 'outbox_dead_letters'"#
        );
        assert_eq!(count(&pool, &versions).await, i64::from(upgrade), "{mode}");
        apply(&script);
        assert_migrated_by_hand(&config.path, mode);
        drop_schema(&pool, &schema).await;
    }
}

/// Two relay processes of one configuration export the same label sets: a replica or a
/// restart adds no series (Prometheus' `instance` tells the processes apart).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relay_processes_export_the_same_label_sets() {
    let Fresh { pool, schema, name } = Fresh::new("labels").await;
    let config = ConfigFile::new(&format!(
        "{}migrate = true\n{FAST_RELAY}{}",
        storage_section(&schema),
        redis_sink(&name, None)
    ));
    migrate(&config);
    let lines: String = (0..40)
        .map(|i| {
            format!(
                "{{\"topic\":\"t{}\",\"key\":\"k{i}\",\"payload\":\"{i}\"}}\n",
                i % 2
            )
        })
        .collect();
    enqueue(&config, &lines);
    let addrs = [free_addr(), free_addr()];
    let relays: Vec<RelayProcess> = addrs
        .iter()
        .map(|addr| {
            let env = [("OUTBOX_OBSERVABILITY__LISTEN", addr.as_str())];
            RelayProcess(spawn_relay(
                &config.path,
                &env,
                Stdio::null(),
                Stdio::null(),
            ))
        })
        .collect();
    wait_until_empty(&pool, &schema, Duration::from_secs(30)).await;
    // The label sets of the series every relay exports whatever it did (gauges of its
    // sink and queue): `name{labels}` without the value.
    let series = |addr: &str| -> std::collections::BTreeSet<String> {
        let (_, metrics) = http_get(addr, "/metrics");
        metrics
            .lines()
            .filter(|l| l.starts_with("outbox_sink_up") || l.starts_with("outbox_pending"))
            .filter_map(|l| l.rsplit_once(' ').map(|(series, _)| series.to_string()))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let (first, second) = loop {
        for addr in &addrs {
            wait_for_http(addr).await;
        }
        let (first, second) = (series(&addrs[0]), series(&addrs[1]));
        if first.len() >= 2 && second.len() >= 2 || Instant::now() > deadline {
            break (first, second);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(first, second, "the two processes export different series");
    assert!(
        first.contains("outbox_sink_up{relay=\"default\"}"),
        "{first:?}"
    );
    for relay in relays {
        assert_eq!(relay.terminate().0, Some(0));
    }
    drop_schema(&pool, &schema).await;
}

/// Log mode: a transaction held open holds the horizon; `outbox status` says how many
/// committed messages wait behind it and which backend holds it, and the relay exports it as
/// `outbox_horizon_waiting` / `outbox_horizon_held_seconds`; once it ends, all are delivered.
#[cfg(feature = "file")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_show_what_holds_the_log_horizon() {
    let Fresh { pool, schema, .. } = Fresh::new("horizon").await;
    let addr = free_addr();
    let dir = TempDir::new("horizon_out");
    let out = dir.file("out.jsonl");
    let config = ConfigFile::new(&format!(
        "{}mode = \"log\"\nshards = 4\n{FAST_RELAY}{}{}",
        storage_section(&schema),
        listen_on(&addr),
        file_sink(&out)
    ));
    migrate(&config);

    // An unrelated transaction takes its id before the messages are written, and stays open.
    let mut holder = pool.begin().await.expect("a transaction");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .expect("pid");
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *holder)
        .await
        .expect("take a transaction id");
    let lines = (1..=3)
        .map(|i| format!("{{\"topic\":\"t\",\"key\":\"k\",\"payload\":\"m{i}\"}}\n"))
        .collect::<String>();
    enqueue(&config, &lines);

    let status = text(&outbox(&config.path, &["status"]).stdout);
    assert!(
        status.contains(&format!(
            "horizon: 3 committed waiting behind backend pid {pid}"
        )),
        "{status}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&outbox(&config.path, &["status", "--output", "json"]).stdout)
            .expect("status as JSON");
    assert_eq!(json["horizon"]["waiting"], 3, "{json}");

    let relay = RelayProcess::start(&config.path);
    wait_for_http(&addr).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, metrics) = http_get(&addr, "/metrics");
        let waiting = metric(&metrics, |l| l.starts_with("outbox_horizon_waiting{"));
        let held = metric(&metrics, |l| l.starts_with("outbox_horizon_held_seconds{"));
        if waiting == Some(3.0) && held.is_some_and(|s| s > 0.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no horizon gauges of 3 waiting in:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let delivered = || {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .count()
    };
    assert_eq!(delivered(), 0, "delivered past an open older transaction");

    holder.rollback().await.expect("end the holder");
    let delivered = &delivered;
    until(
        "delivered after the holder ended",
        Duration::from_secs(30),
        || async move { delivered() >= 3 },
    )
    .await;
    let status = text(&outbox(&config.path, &["status"]).stdout);
    assert!(status.contains("horizon: 0 committed waiting"), "{status}");
    finish(relay, &pool, &schema).await;
}

/// `migrate = true` with the database unreachable at start-up: the relay waits, retrying,
/// instead of exiting, then migrates and delivers once the database answers.
#[cfg(feature = "file")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrating_relay_waits_for_a_database_down_at_start_up() {
    let Fresh { pool, schema, .. } = Fresh::new("dbdown").await;
    let target = postgres_url();
    let host_port = outbox_tests::host_port(&target);
    let proxy = outbox_tests::Proxy::start(&host_port).await;
    proxy.cut();
    let dir = TempDir::new("dbdown_out");
    let out = dir.file("out.jsonl");
    let storage =
        |url: &str| format!("[storage]\nurl = \"{url}\"\nschema = \"{schema}\"\nmigrate = true\n");
    let sink = file_sink(&out);
    let through = ConfigFile::new(&format!(
        "{}{FAST_RELAY}{sink}",
        storage(&target.replace(&host_port, &proxy.addr()))
    ));
    let mut relay = RelayProcess::start(&through.path);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        relay.0.try_wait().expect("wait").is_none(),
        "the relay exited while the database was unreachable"
    );
    proxy.restore();
    let tables = format!(
        "SELECT count(*) FROM pg_tables WHERE schemaname = '{schema}' AND tablename = 'outbox'"
    );
    let (db, tables) = (&pool, &tables);
    until(
        "migrated once the database answered",
        Duration::from_secs(30),
        || async move { count(db, tables).await > 0 },
    )
    .await;
    let direct = ConfigFile::new(&format!("{}{sink}", storage(&target)));
    enqueue(
        &direct,
        "{\"topic\":\"t\",\"key\":\"k\",\"payload\":\"after\"}\n",
    );
    let out = &out;
    until("delivered", Duration::from_secs(30), || async move {
        std::fs::read_to_string(out)
            .unwrap_or_default()
            .contains("after")
    })
    .await;
    finish(relay, &pool, &schema).await;
}
