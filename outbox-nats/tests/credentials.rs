//! Credentials files end to end, against NATS servers of the test's own (`nats-server` with
//! JetStream on a free port):
//!
//! - a server in operator (JWT) mode with a memory resolver, whose operator, account and
//!   user are made and signed here, at test time: a sink with the user's `.creds` file
//!   (`credentials_file`) publishes to a JetStream stream; a sink without credentials, or with
//!   the `.creds` file of a user the server does not know, is refused at once;
//! - a server that lists its user by NKey: a sink with the user's seed (`nkey_file`)
//!   publishes; one with another user's seed is refused.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use nkeys::KeyPair;
use outbox_core::{ErrorKind, Message, NewMessage, Outcome, Sink};
use outbox_nats::{NatsConfig, NatsSink};
use outbox_testkit::assert_unavailable_within;
use serde_json::json;

/// `nats-server -c <file>` with the given configuration (a listen address is added), stopped
/// on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(dir: &Path, config: &str) -> Server {
        let port = outbox_test_support::free_addr()
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse().ok())
            .expect("a free port");
        let file = dir.join("server.conf");
        // Its log, shown if it does not start.
        let log = dir.join("server.log");
        std::fs::write(&file, format!("listen: 127.0.0.1:{port}\n{config}")).expect("config");
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("nats-server is installed (cargo xtask services installs it)");
        let mut server = Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("nats-server exited ({status}):\n{log}\nconfiguration:\n{config}");
            }
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A NATS JWT: `header.claims.signature`, base64url without padding, the signature ed25519
/// by `issuer`'s NKey over `header.claims`.
fn jwt(issuer: &KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    let encode = |value: serde_json::Value| URL_SAFE_NO_PAD.encode(value.to_string());
    let issued = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_secs();
    let signed = format!(
        "{}.{}",
        encode(json!({ "typ": "JWT", "alg": "ed25519-nkey" })),
        encode(json!({
            "jti": outbox_test_support::unique_name("jti"),
            "iat": issued,
            "iss": issuer.public_key(),
            "sub": subject,
            "name": name,
            "nats": nats,
        }))
    );
    let signature = issuer
        .sign(signed.as_bytes())
        .expect("an issuer with a seed");
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// An account JWT with JetStream (unlimited) and no other limits.
fn account_jwt(operator: &KeyPair, account: &KeyPair, name: &str) -> String {
    let limits = json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
    });
    let nats = json!({ "type": "account", "version": 2, "limits": limits });
    jwt(operator, &account.public_key(), name, nats)
}

/// A user's `.creds` file as `nsc generate creds` writes it: the user JWT, signed by
/// `account`, and the user's seed.
fn write_creds(path: &Path, account: &KeyPair, user: &KeyPair) -> PathBuf {
    let nats = json!({
        "type": "user", "version": 2, "pub": {}, "sub": {},
        "subs": -1, "data": -1, "payload": -1,
    });
    let user_jwt = jwt(account, &user.public_key(), "outbox", nats);
    let seed = user.seed().expect("a user with a seed");
    let text = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    );
    std::fs::write(path, text).expect("the creds file");
    path.to_path_buf()
}

/// A directory of the test's own (it derefs to its path). Once the test has passed, and the
/// server in it was dropped before it, it is removed and the test says how long it took.
struct Scratch {
    dir: PathBuf,
    test: &'static str,
    started: Instant,
}

impl Scratch {
    fn new(prefix: &str, test: &'static str) -> Scratch {
        let started = Instant::now();
        let dir = std::env::temp_dir().join(outbox_test_support::unique_name(prefix));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Scratch { dir, test, started }
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
            eprintln!("{} took {:?}", self.test, self.started.elapsed());
        }
    }
}

fn sink(url: String, auth: impl FnOnce(&mut NatsConfig)) -> NatsSink {
    let mut config = NatsConfig {
        publish_timeout: Duration::from_secs(3),
        ..NatsConfig::new(url)
    };
    auth(&mut config);
    NatsSink::new(config).expect("a valid configuration")
}

/// Makes a memory stream that captures `subject.>`, through `client`.
async fn stream(
    client: async_nats::Client,
    name: &str,
    subject: &str,
) -> jetstream::stream::Stream {
    jetstream::new(client)
        .create_stream(jetstream::stream::Config {
            name: name.into(),
            subjects: vec![format!("{subject}.>")],
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("the stream")
}

/// Publishes three messages through `sink` and reads them back from `stream`.
async fn publishes_and_reads_back(
    sink: &NatsSink,
    stream: &jetstream::stream::Stream,
    subject: &str,
) {
    sink.health().await.expect("an authenticated connection");
    let batch: Vec<Message> = (0..3)
        .map(|i| {
            Message::from(
                NewMessage::new(format!("{subject}.orders"), format!("paid {i}")).key("k"),
            )
        })
        .collect();
    let outcomes = sink.publish(&batch).await.expect("publish");
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Delivered(_))),
        "{outcomes:?}"
    );
    for (i, message) in batch.iter().enumerate() {
        let stored = stream
            .get_raw_message(i as u64 + 1)
            .await
            .expect("the stored message");
        assert_eq!(stored.subject.as_str(), format!("{subject}.orders"));
        assert_eq!(stored.payload.as_ref(), message.payload.as_slice());
    }
}

/// The server at `url` [refuses](refused) a sink without credentials (its error not showing
/// our secret, `ours`) and one with the `wrong` ones (not showing theirs, `theirs`).
async fn refuses_none_and_the_wrong(
    url: String,
    wrong: impl FnOnce(&mut NatsConfig),
    ours: &str,
    theirs: &str,
) {
    refused(&sink(url.clone(), |_| {}), ours).await;
    refused(&sink(url, wrong), theirs).await;
}

/// `sink` is refused at once (not after a time-out) as `Unavailable`, the error saying what
/// to check, and without the secret `hidden`.
async fn refused(sink: &NatsSink, hidden: &str) {
    let started = Instant::now();
    let error = sink
        .health()
        .await
        .expect_err("the server must refuse the sink");
    assert_unavailable_within(&error, started.elapsed(), Duration::from_secs(2));
    let shown = format!("{error} {error:?}");
    assert!(
        shown.contains("authorization violation") && shown.contains("sink.credentials_file"),
        "{shown}"
    );
    assert!(!shown.contains(hidden), "{shown}");
    let batch = [Message::from(NewMessage::new("creds.orders", "x"))];
    let error = sink
        .publish(&batch)
        .await
        .expect_err("nothing is published");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creds_file_authenticates_to_an_operator_mode_server() {
    let dir = Scratch::new("outbox_nats_creds", "operator-mode credentials test");
    let operator = KeyPair::new_operator();
    // JetStream in operator mode needs a system account.
    let system = KeyPair::new_account();
    let account = KeyPair::new_account();
    let user = KeyPair::new_user();
    // A user signed by an account this server does not know.
    let stranger_account = KeyPair::new_account();
    let stranger = KeyPair::new_user();

    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "outbox-test",
        json!({ "type": "operator", "version": 2 }),
    );
    std::fs::write(dir.join("operator.jwt"), &operator_jwt).expect("operator jwt");
    let system_jwt = jwt(
        &operator,
        &system.public_key(),
        "SYS",
        json!({ "type": "account", "version": 2 }),
    );
    let config = format!(
        "operator: \"{}\"\nsystem_account: {}\nresolver: MEMORY\n\
         resolver_preload: {{\n  {}: \"{system_jwt}\"\n  {}: \"{}\"\n}}\n\
         jetstream: {{ store_dir: \"{}\" }}\n",
        dir.join("operator.jwt").display(),
        system.public_key(),
        system.public_key(),
        account.public_key(),
        account_jwt(&operator, &account, "app"),
        dir.join("store").display(),
    );
    let server = Server::start(&dir, &config);
    let ours = write_creds(&dir.join("ours.creds"), &account, &user);
    let theirs = write_creds(&dir.join("theirs.creds"), &stranger_account, &stranger);

    // The test's own client, with the same credentials, makes the stream.
    let client = async_nats::ConnectOptions::with_credentials_file(&ours)
        .await
        .expect("the creds file")
        .connect(server.url())
        .await
        .expect("the test's client connects with the creds file");
    let stream = stream(client, "CREDS", "creds").await;

    let with_creds = sink(server.url(), |c| c.credentials_file = Some(ours.clone()));
    let debug = format!("{with_creds:?}");
    let seed = user.seed().expect("seed");
    assert!(
        debug.contains("ours.creds") && !debug.contains(&seed),
        "{debug}"
    );
    publishes_and_reads_back(&with_creds, &stream, "creds").await;

    let stranger_seed = stranger.seed().expect("seed");
    let wrong = |c: &mut NatsConfig| c.credentials_file = Some(theirs.clone());
    refuses_none_and_the_wrong(server.url(), wrong, &seed, &stranger_seed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_seed_authenticates_to_a_server_that_lists_nkey_users() {
    let dir = Scratch::new("outbox_nats_nkey", "nkey test");
    let user = KeyPair::new_user();
    let other = KeyPair::new_user();
    let config = format!(
        "authorization: {{ users: [ {{ nkey: {} }} ] }}\n\
         jetstream: {{ store_dir: \"{}\" }}\n",
        user.public_key(),
        dir.join("store").display(),
    );
    let server = Server::start(&dir, &config);
    let seed = user.seed().expect("seed");
    let ours = dir.join("ours.nk");
    std::fs::write(&ours, format!("{seed}\n")).expect("the seed file");
    let other_seed = other.seed().expect("seed");
    let theirs = dir.join("theirs.nk");
    std::fs::write(&theirs, &other_seed).expect("the seed file");

    let client = async_nats::ConnectOptions::with_nkey(seed.clone())
        .connect(server.url())
        .await
        .expect("the test's client connects with the seed");
    let stream = stream(client, "NKEY", "nkey").await;

    let with_seed = sink(server.url(), |c| c.nkey_file = Some(ours.clone()));
    publishes_and_reads_back(&with_seed, &stream, "nkey").await;
    let wrong = |c: &mut NatsConfig| c.nkey_file = Some(theirs.clone());
    refuses_none_and_the_wrong(server.url(), wrong, &seed, &other_seed).await;
}
