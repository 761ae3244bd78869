//! TLS end to end: a MariaDB server of the test's own (`mariadbd` on a fresh data directory,
//! `require_secure_transport=ON`, a user created `REQUIRE X509`), certificates made at test
//! time, a storage that trusts the test's CA through `tls_ca_file` and presents a client
//! certificate. A storage that trusts another CA, one without a client certificate and one
//! without TLS are refused.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_core::{ErrorKind, NewMessage, Storage, StorageAdmin};
use outbox_mysql::{MySqlConfig, MySqlStorage};
use outbox_test_support::postgres_server::run;
use outbox_test_support::tls::{Pki, two_authorities};
use outbox_test_support::{deliveries, free_port};

/// `mariadbd` on a data directory of its own under `dir`, listening on 127.0.0.1 with TLS
/// required, and on a Unix socket for the setup; killed on drop.
struct TlsMariaDb {
    child: Child,
    port: u16,
    socket: PathBuf,
    log: PathBuf,
}

impl TlsMariaDb {
    fn start(dir: &Path, pki: &Pki) -> TlsMariaDb {
        let data = dir.join("data");
        let mut install = Command::new("mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args([
                "--auth-root-authentication-method=normal",
                "--user=root",
                "--skip-test-db",
            ]);
        run(
            install,
            "mariadb-install-db (cargo xtask services installs MariaDB)",
        );
        let port = free_port();
        let socket = dir.join("mariadb.sock");
        let log = dir.join("error.log");
        let path = |option: &str, file: &Path| format!("--{option}={}", file.display());
        let mut child = Command::new("mariadbd")
            .arg("--no-defaults")
            .arg(path("datadir", &data))
            .arg(path("socket", &socket))
            .arg(path("pid-file", &dir.join("mariadb.pid")))
            .arg(path("log-error", &log))
            .arg(format!("--port={port}"))
            .args([
                "--bind-address=127.0.0.1",
                "--user=root",
                "--skip-name-resolve",
                "--skip-log-bin",
                "--innodb-buffer-pool-size=16M",
                "--require-secure-transport=ON",
            ])
            .arg(path("ssl-ca", &pki.ca))
            .arg(path("ssl-cert", &pki.server_cert))
            .arg(path("ssl-key", &pki.server_key))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mariadbd is installed (cargo xtask services installs MariaDB)");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(socket.exists() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()) {
            let exited = child.try_wait().expect("the server's status");
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "mariadbd with TLS did not start ({exited:?}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let server = TlsMariaDb {
            child,
            port,
            socket,
            log,
        };
        // The Unix socket counts as secure, so root sets up over it without TLS. `plain`
        // needs no client certificate, so only `require_secure_transport` refuses it plain.
        server.sql(
            "CREATE DATABASE app; \
             CREATE USER 'relay'@'%' REQUIRE X509; \
             GRANT ALL ON app.* TO 'relay'@'%'; \
             CREATE USER 'plain'@'%'; \
             GRANT ALL ON app.* TO 'plain'@'%';",
        );
        server
    }

    /// Runs `statements` as root over the Unix socket.
    fn sql(&self, statements: &str) {
        let output = Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", self.socket.display()))
            .args(["--user=root", "--execute", statements])
            .output()
            .expect("the mariadb client is installed");
        assert!(
            output.status.success(),
            "mariadb -e {statements:?} failed: {}\nserver log: {}",
            String::from_utf8_lossy(&output.stderr),
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// The URL of `user` and the database `app`, with a query such as `?ssl-mode=…`.
    fn url(&self, user: &str, query: &str) -> String {
        format!("mysql://{user}@127.0.0.1:{}/app{query}", self.port)
    }
}

impl Drop for TlsMariaDb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(url: String) -> MySqlConfig {
    MySqlConfig {
        connect_timeout: Duration::from_secs(3),
        ..MySqlConfig::new(url)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_go_over_verified_tls_and_anything_less_is_refused() {
    let (dir, ours, theirs) = two_authorities("outbox_mysql_tls");
    let started = Instant::now();
    let server = TlsMariaDb::start(&dir, &ours);
    eprintln!("private MariaDB with TLS ready in {:?}", started.elapsed());

    // No ssl-mode in the URL: the TLS files make it VERIFY_IDENTITY.
    let tls = config(server.url("relay", "")).tls(&ours.ca, &ours.client_cert, &ours.client_key);
    let storage = MySqlStorage::connect(tls)
        .await
        .expect("a verified TLS connection with a client certificate");
    storage.migrate().await.expect("migrate over TLS");
    let (cipher, user): (Option<String>, String) = sqlx_row(&storage).await;
    assert!(
        cipher.is_some_and(|c| !c.is_empty()),
        "the session is not encrypted"
    );
    assert_eq!(user, "relay@%");

    let messages = [
        NewMessage::new("tls.orders", "paid").key("k"),
        NewMessage::new("tls.orders", "shipped").key("k"),
    ];
    storage.enqueue(&messages).await.expect("enqueue over TLS");
    let claim = storage
        .claim("tls-relay", 10, Duration::from_secs(30))
        .await
        .expect("claim over TLS");
    let payloads: Vec<&[u8]> = claim.messages.iter().map(|m| &m.payload[..]).collect();
    assert_eq!(payloads, [&b"paid"[..], &b"shipped"[..]]);
    let delivered = deliveries(&claim.messages, |_| "r".into());
    let acked = storage.ack(&claim.token, &delivered).await.expect("settle");
    assert_eq!(acked, 2);
    let stats = storage.stats().await.expect("stats over TLS");
    assert_eq!((stats.pending, stats.in_flight), (0, 0), "{stats:?}");

    // A storage that trusts another CA does not accept the server's certificate.
    let wrong_ca =
        config(server.url("relay", "")).tls(&theirs.ca, &ours.client_cert, &ours.client_key);
    let error = MySqlStorage::new(wrong_ca)
        .expect("valid settings")
        .health()
        .await
        .expect_err("the server's certificate must be refused");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.to_string().contains("UnknownIssuer"), "{error}");

    // The server refuses a verified connection without a client certificate (REQUIRE X509).
    let no_client_cert = MySqlConfig {
        tls_ca_file: Some(ours.ca.clone()),
        ..config(server.url("relay", ""))
    };
    let error = MySqlStorage::connect(no_client_cert)
        .await
        .expect_err("a user that requires X509 is refused without a client certificate");
    assert_eq!(error.kind(), ErrorKind::Config, "{error}");
    assert!(error.to_string().contains("Access denied"), "{error}");

    // Without TLS: refused, both for the user that needs a certificate and for one that
    // does not (`require_secure_transport`; MariaDB 10.11 answers "access denied", MySQL 8
    // and later MariaDBs a TLS error of their own, both a configuration error).
    for user in ["relay", "plain"] {
        let error = MySqlStorage::connect(config(server.url(user, "?ssl-mode=DISABLED")))
            .await
            .expect_err("a connection without TLS is refused");
        assert_eq!(error.kind(), ErrorKind::Config, "{error}");
        assert!(
            error
                .message()
                .starts_with(&format!("url `mysql://{user}@127.0.0.1:"))
                && error.to_string().contains("TLS"),
            "{error}"
        );
    }

    drop(storage);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("whole test: {:?}", started.elapsed());
}

/// The session's cipher and user, read over the storage's own pool.
async fn sqlx_row(storage: &MySqlStorage) -> (Option<String>, String) {
    use outbox_mysql::sqlx::{self, Row};
    let cipher = sqlx::query("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_optional(storage.pool())
        .await
        .expect("Ssl_cipher")
        .map(|row| row.get::<String, _>(1));
    let user: String = sqlx::query_scalar("SELECT CURRENT_USER()")
        .fetch_one(storage.pool())
        .await
        .expect("CURRENT_USER()");
    (cipher, user)
}
