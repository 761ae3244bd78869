//! Secrets stay out of everything the binary prints: each secret given (a database password
//! read from a secret file, a NATS token, a Redis password the server refuses) is looked for
//! in the output of every command and of a relay logging at debug level.

use std::process::Stdio;
use std::time::Duration;

use super::{ConfigFile, drop_schema, pool, said, sigterm, spawn_relay, text};
use outbox_tests::unique_name;

const DB_PASSWORD: &str = "pg-s3cret-from-a-file";
const NATS_TOKEN: &str = "nats-t0ken-in-the-url";
const REDIS_PASSWORD: &str = "r3dis-pw-refused";

/// Runs `outbox <args>` with debug logs; returns what it printed, both streams.
fn printed(config: &ConfigFile, args: &[&str]) -> String {
    let out = super::outbox_command(&config.path)
        .args(args)
        .env("RUST_LOG", "debug")
        .output()
        .expect("run the outbox binary");
    said(&out).1
}

/// Runs the relay for a while with debug logs, stops it, returns what it printed.
fn relay_printed(config: &ConfigFile, run_for: Duration) -> String {
    let debug = [("RUST_LOG", "debug")];
    let child = spawn_relay(&config.path, &debug, Stdio::piped(), Stdio::piped());
    std::thread::sleep(run_for);
    sigterm(&child);
    said(&child.wait_with_output().expect("relay output")).1
}

fn assert_no_secret(what: &str, printed: &str) {
    for secret in [DB_PASSWORD, NATS_TOKEN, REDIS_PASSWORD] {
        assert!(
            !printed.contains(secret),
            "{what} printed the secret `{secret}`:\n{printed}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_the_output() {
    let pool = pool().await;
    let schema = unique_name("cli_secrets");
    // PostgreSQL here trusts local connections, so any password is taken: the URL with one
    // goes through every code path that could print it.
    let secrets = ConfigFile::new("");
    let url_file = secrets.path.with_file_name("db_url");
    std::fs::write(
        &url_file,
        format!("postgres://postgres:{DB_PASSWORD}@127.0.0.1:5432/test\n"),
    )
    .expect("write the secret file");
    let storage = format!(
        "[storage]\nurl = {{ file = \"{}\" }}\nschema = \"{schema}\"\nmigrate = true\n\
         [relay]\npoll_interval = \"50ms\"\n",
        url_file.display()
    );
    let nats = ConfigFile::new(&format!(
        "{storage}[sink]\ntype = \"nats\"\nurl = \"nats://{NATS_TOKEN}@127.0.0.1:4222\"\n\
         subject_prefix = \"{}.\"\npublish_timeout = \"1s\"\n",
        unique_name("secrets")
    ));
    assert_no_secret("migrate", &printed(&nats, &["migrate"]));
    let enqueued = printed(&nats, &["enqueue", "--topic", "orders", "--key", "k", "{}"]);
    assert!(
        enqueued.contains("enqueued 1 message"),
        "the secret file was not used: {enqueued}"
    );
    assert_no_secret("enqueue", &enqueued);
    let status = printed(&nats, &["status"]);
    assert!(status.contains("pending 1"), "{status}");
    assert_no_secret("status", &status);
    assert_no_secret("check", &printed(&nats, &["check"]));
    let relayed = relay_printed(&nats, Duration::from_secs(2));
    assert!(relayed.contains("relay starting"), "{relayed}");
    assert_no_secret("relay to NATS", &relayed);

    // A password the server refuses: the errors name the URL, without it.
    let redis = ConfigFile::new(&format!(
        "{storage}[sink]\ntype = \"redis\"\nurl = \"redis://:{REDIS_PASSWORD}@127.0.0.1:6379\"\n"
    ));
    let checked = printed(&redis, &["check"]);
    assert!(checked.contains("127.0.0.1:6379"), "{checked}");
    assert_no_secret("check against a refusing Redis", &checked);
    assert_no_secret(
        "relay to a refusing Redis",
        &relay_printed(&redis, Duration::from_secs(2)),
    );

    drop_schema(&pool, &schema).await;
}

/// The security review's cases (issue 30, item 5): a secret of the wrong shape is refused
/// with a configuration error that names the key, and the secret is not in it.
#[test]
fn a_secret_of_the_wrong_shape_is_not_echoed_in_the_configuration_error() {
    let storage = super::storage_section("cli_secret_shapes");
    let redis = "[sink]\ntype = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\n";
    let cases = [
        (
            format!(
                "{storage}{redis}[observability]\nconsole_user = \"ops\"\nconsole_password = 987654321012345\n"
            ),
            "987654321012345",
            "observability.console_password",
        ),
        (
            format!("{storage}{redis}[observability]\nconsole_token = 12345678901234567\n"),
            "12345678901234567",
            "observability.console_token",
        ),
        (
            format!(
                "[storage]\nurl = \"host=127.0.0.1 user=postgres password=TopSECRET1 dbname=test\"\n{redis}"
            ),
            "TopSECRET1",
            "storage.url",
        ),
        (
            format!(
                "{storage}[sink]\ntype = \"redis\"\nurl = \"redis//:TopSECRET2@127.0.0.1:6379/0\"\n"
            ),
            "TopSECRET2",
            "sink.url",
        ),
    ];
    for (contents, secret, key) in cases {
        let config = ConfigFile::new(&contents);
        let out = super::outbox(&config.path, &["check"]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(super::EXIT_CONFIG), "{stderr}");
        assert!(stderr.contains(key), "expected `{key}` in: {stderr}");
        assert!(
            !stderr.contains(secret),
            "printed the secret `{secret}`: {stderr}"
        );
    }
}
