//! The operator console of `outbox relay`, over plain HTTP against PostgreSQL and Redis: it
//! shows the queue, the parked key and the dead letter (escaped), replays it behind a
//! confirmation and a form token so the key drains in order, and keeps its data and actions
//! from clients without the token and from read-only mode.

use super::*;

/// The same in a real browser (headless Chromium).
#[path = "console_browser.rs"]
mod browser;

fn get(addr: &str, path: &str, extra: &[(&str, &str)]) -> Reply {
    request(addr, "GET", path, extra, "")
}

/// The overview once the relays are built (the console says "Starting" with 503 before).
async fn overview(addr: &str, extra: &[(&str, &str)]) -> Reply {
    wait_for_http(addr).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reply = get(addr, "/", extra);
        if reply.status != 503 {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "the console stayed at Starting: {}",
            reply.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The form token of the console's action forms in `page`.
fn form_token(page: &str) -> String {
    let start = page
        .find(r#"name="csrf" value=""#)
        .unwrap_or_else(|| panic!("no form token in:\n{page}"))
        + r#"name="csrf" value=""#.len();
    page[start..]
        .split('"')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The head of key `a`: a payload with markup, too large for the strict sink.
fn poison() -> String {
    format!("<script>alert('x')</script>&{}", "x".repeat(200))
}

/// A relay of [`listening_config`] with the console on a free loopback port: its address,
/// its configuration (kept while it runs), the relay and the console's first overview.
async fn console_relay(schema: &str, name: &str) -> (String, ConfigFile, RelayProcess, Reply) {
    let addr = format!("127.0.0.1:{}", free_port());
    let config = listening_config(schema, name, &addr);
    let relay = RelayProcess::start(&config.path);
    let page = overview(&addr, &[]).await;
    (addr, config, relay, page)
}

/// A relay of [`poisoned`]'s strict sink with `settings` in its `[observability]`, listening
/// on every address of a free port: the loopback address to reach it, and its configuration.
fn off_loopback(schema: &str, name: &str, settings: &str) -> (String, ConfigFile) {
    let port = free_port();
    let config = relay_config(
        schema,
        &format!(
            "{}{settings}{}",
            listen_on(&format!("0.0.0.0:{port}")),
            redis_sink(name, Some(100))
        ),
    );
    (format!("127.0.0.1:{port}"), config)
}

/// A relay of [`off_loopback`] with `settings`, its log in a file, once its console answers
/// a request with the `credentials` headers: the console's address, its configuration
/// (kept while it runs: the log is beside it), the relay and its log's path.
async fn guarded_console(
    schema: &str,
    name: &str,
    settings: &str,
    credentials: &[(&str, &str)],
) -> (String, ConfigFile, RelayProcess, PathBuf) {
    let (addr, config) = off_loopback(schema, name, settings);
    let log = config.dir.join("relay.log");
    let log_file = std::fs::File::create(&log).expect("the relay's log");
    let relay = RelayProcess(spawn_relay(&config.path, &[], Stdio::null(), log_file));
    assert_eq!(overview(&addr, credentials).await.status, 200);
    (addr, config, relay, log)
}

/// Every page of the console answers each of `refused` (extra request headers) with 401,
/// `challenge` in its `WWW-Authenticate`, and none of [`poisoned`]'s data; `missing` names
/// what the request lacks in a failure.
fn assert_every_page_refuses(
    addr: &str,
    (schema, id): (&str, &str),
    refused: &[&[(&str, &str)]],
    challenge: &str,
    missing: &str,
) {
    let detail = format!("/dead-letter?id={id}");
    for path in ["/", "/parked", "/relays", "/dead-letters", detail.as_str()] {
        for extra in refused {
            let reply = get(addr, path, extra);
            assert_eq!(reply.status, 401, "{path} {extra:?}: {}", reply.body);
            assert!(
                reply
                    .headers
                    .contains(&format!("www-authenticate: {challenge}")),
                "{}",
                reply.headers
            );
            for secret in ["data-figure", "alert", schema, id, "max_payload"] {
                assert!(
                    !reply.body.contains(secret),
                    "{path}: `{secret}` shown without {missing}"
                );
            }
        }
    }
}

/// Half a second after refused actions, [`poisoned`]'s dead letter and parked key are still
/// there; `what` names the actions in a failure.
async fn assert_nothing_acted(pool: &PgPool, schema: &str, what: &str) {
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(dead_and_parked(pool, schema).await, (1, 1), "{what} acted");
}

/// Makes key `a`'s head a dead letter (Redis refuses it as too large), with `a2` and `a3`
/// parked behind it and `b1` delivered, in a fresh schema `cli_<what>_…` with Redis streams
/// prefixed `<what>_…:`. Returns the pool, the schema, the prefix and the dead letter's id.
async fn poisoned(what: &str) -> (PgPool, String, String, String) {
    let Fresh { pool, schema, name } = Fresh::new(what).await;
    let id = poison_key_a(&pool, &schema, &name).await;
    (pool, schema, name, id)
}

/// The dead letter of [`poisoned`] in `schema`; returns its id.
async fn poison_key_a(pool: &PgPool, schema: &str, name: &str) -> String {
    let strict = relay_config(schema, &redis_sink(name, Some(100)));
    migrate(&strict);
    let lines: String = [(poison(), "a"), ("a2".into(), "a"), ("a3".into(), "a"), ("b1".into(), "b")]
        .iter()
        .map(|(payload, key)| {
            format!(
                "{}\n",
                serde_json::json!({"topic": "t", "key": key, "payload": payload, "headers": {"h<1>": "v\"&"}})
            )
        })
        .collect();
    enqueue(&strict, &lines);
    let relay = RelayProcess::start(&strict.path);
    let dead = &format!(r#"SELECT count(*) FROM "{schema}".outbox_dead_letters"#);
    until("a dead letter", Duration::from_secs(30), || async move {
        count(pool, dead).await > 0
    })
    .await;
    // b1 is delivered and a2, a3 are parked: the queue is settled.
    let settled = &format!(r#"SELECT count(*) FROM "{schema}".outbox"#);
    until("b1 delivered", Duration::from_secs(30), || async move {
        count(pool, settled).await == 2
    })
    .await;
    assert_eq!(relay.terminate().0, Some(0));
    sqlx::query_scalar(&format!(
        r#"SELECT id::text FROM "{schema}".outbox_dead_letters"#
    ))
    .fetch_one(pool)
    .await
    .expect("the dead letter's id")
}

/// After the console replayed [`poisoned`]'s dead letter and the relay stopped: Redis got
/// key `a` in order (the head first, then what was parked behind it) and `b1`; nothing is
/// dead-lettered or parked any more. Drops the schema.
async fn assert_replayed_in_key_order(pool: &PgPool, schema: &str, name: &str) {
    let keys = by_key(&redis_stream(&format!("{name}:t")).await);
    assert_eq!(
        keys["a"],
        vec![poison().into_bytes(), b"a2".to_vec(), b"a3".to_vec()],
        "key a out of order"
    );
    assert_eq!(keys["b"], vec![b"b1".to_vec()]);
    assert_eq!(dead_and_parked(pool, schema).await, (0, 0));
    drop_schema(pool, schema).await;
}

/// Dead letters and parked keys in the table: (dead letters, parked keys).
async fn dead_and_parked(pool: &PgPool, schema: &str) -> (i64, i64) {
    (
        count(
            pool,
            &format!(r#"SELECT count(*) FROM "{schema}".outbox_dead_letters"#),
        )
        .await,
        count(
            pool,
            &format!(r#"SELECT count(*) FROM "{schema}".outbox_parked_keys"#),
        )
        .await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_a_dead_letter_escaped_and_replays_it_in_key_order() {
    let (pool, schema, name, id) = poisoned("console").await;

    // The operator raised the limit; the console on loopback needs no token.
    let (addr, _config, relay, page) = console_relay(&schema, &name).await;
    assert_eq!(page.status, 200, "{}", page.body);
    for figure in [
        r#"data-figure="pending">2<"#,
        r#"data-figure="dead-lettered">1<"#,
        r#"data-figure="parked-keys">1<"#,
    ] {
        assert!(
            page.body.contains(figure),
            "{figure} not in:\n{}",
            page.body
        );
    }
    assert!(
        page.headers
            .contains("content-security-policy: default-src 'none'"),
        "{}",
        page.headers
    );
    assert!(
        page.headers.contains("x-frame-options: deny"),
        "{}",
        page.headers
    );
    // A page asked for under another host name (DNS rebinding) gets nothing.
    let rebound = get(&addr, "/", &[("Host", "evil.example")]);
    assert_eq!(rebound.status, 403);
    assert!(!rebound.body.contains("data-figure"), "{}", rebound.body);

    let parked = get(&addr, "/parked", &[]);
    assert_eq!(parked.status, 200);
    assert!(
        parked.body.contains(r#"<td class="key">a</td>"#) && parked.body.contains(&id),
        "{}",
        parked.body
    );
    let listed = get(&addr, "/dead-letters?key=a&error=max_payload", &[]);
    assert!(
        listed.body.contains(&id) && listed.body.contains("1 dead letter(s)"),
        "{}",
        listed.body
    );
    let none = get(&addr, "/dead-letters?error=no+such+error", &[]);
    assert!(
        none.body.contains("0 dead letter(s)") && !none.body.contains(&id),
        "{}",
        none.body
    );

    // The payload, the headers and the error are shown escaped, never as markup.
    let shown = get(&addr, &format!("/dead-letter?id={id}"), &[]);
    assert_eq!(shown.status, 200, "{}", shown.body);
    assert!(
        shown
            .body
            .contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;xxx"),
        "{}",
        shown.body
    );
    assert!(
        shown.body.contains("h&lt;1&gt;") && shown.body.contains("v&quot;&amp;"),
        "{}",
        shown.body
    );
    assert!(shown.body.contains("max_payload"), "{}", shown.body);
    assert!(
        !shown.body.contains("<script") && !shown.body.contains("<1>"),
        "{}",
        shown.body
    );
    let hex = get(&addr, &format!("/dead-letter?id={id}&view=hex"), &[]);
    assert!(hex.body.contains("3c 73 63 72 69 70 74 3e"), "{}", hex.body);
    assert!(!hex.body.contains("<script"), "{}", hex.body);

    let token = form_token(&shown.body);
    let replay = format!("action=replay&relay=default&id={id}&csrf={token}");
    // Without confirmation: the page that says what happens to the key's order, nothing done.
    let asked = request(&addr, "POST", "/action", &[], &replay);
    assert_eq!(asked.status, 200, "{}", asked.body);
    assert!(
        asked.body.contains("first in its key&#39;s order"),
        "{}",
        asked.body
    );
    assert!(
        asked.body.contains(r#"name="confirm" value="yes""#),
        "{}",
        asked.body
    );
    // Confirmed but without the form token, or from another origin: refused.
    let forged = request(
        &addr,
        "POST",
        "/action",
        &[],
        &format!("action=replay&relay=default&id={id}&confirm=yes"),
    );
    assert_eq!(forged.status, 403, "{}", forged.body);
    let cross = request(
        &addr,
        "POST",
        "/action",
        &[("Origin", "http://evil.example")],
        &format!("{replay}&confirm=yes"),
    );
    assert_eq!(cross.status, 403, "{}", cross.body);
    // Through a proxy on this machine (loopback socket, loopback Host, a forwarding header):
    // neither pages nor actions without credentials (issue 30, the security review's item 2).
    for header in ["X-Forwarded-For", "Forwarded", "X-Real-IP", "Via"] {
        let proxied = get(&addr, "/dead-letters", &[(header, "203.0.113.5")]);
        assert_eq!(proxied.status, 403, "{header}: {}", proxied.body);
        assert!(
            !proxied.body.contains("csrf") && proxied.body.contains("console_token"),
            "{header}: {}",
            proxied.body
        );
        let acted = request(
            &addr,
            "POST",
            "/action",
            &[(header, "203.0.113.5")],
            &format!("{replay}&confirm=yes"),
        );
        assert_eq!(acted.status, 403, "{header}: {}", acted.body);
    }
    assert_nothing_acted(&pool, &schema, "an unconfirmed, forged or proxied replay").await;

    // Confirmed, from the console's own page: replayed; the key drains in its order.
    let done = request(
        &addr,
        "POST",
        "/action",
        &[("Origin", &format!("http://{addr}"))],
        &format!("{replay}&confirm=yes"),
    );
    assert_eq!(done.status, 200, "{}", done.body);
    assert!(
        done.body.contains("Replayed 1 dead letter(s)."),
        "{}",
        done.body
    );
    wait_until_empty(&pool, &schema, Duration::from_secs(30)).await;
    assert_eq!(relay.terminate().0, Some(0));
    assert_replayed_in_key_order(&pool, &schema, &name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_token_guards_its_data_and_read_only_mode_refuses_actions() {
    let (pool, schema, name, id) = poisoned("console_auth").await;
    let token = "c0ns0le-t0ken-for-the-test-0123456789";
    let bearer = format!("Bearer {token}");
    let with_token = [("Authorization", bearer.as_str())];
    let settings =
        format!("console = true\nconsole_token = \"{token}\"\nconsole_read_only = true\n");
    let (addr, _config, relay, _) = guarded_console(&schema, &name, &settings, &with_token).await;

    // Without the token, or with a wrong one: 401 and no data, on every page.
    let refused: [&[(&str, &str)]; 3] = [
        &[],
        &[("Authorization", "Bearer wrong-token-0123456789")],
        &[("Cookie", "outbox_console=guess")],
    ];
    assert_every_page_refuses(&addr, (&schema, &id), &refused, "bearer", "the token");
    // The probes stay open.
    assert_eq!(get(&addr, "/health/live", &[]).status, 200);
    assert_eq!(get(&addr, "/metrics", &[]).status, 200);

    // With the token: the data. The login form gives an HttpOnly session cookie.
    let page = get(&addr, "/", &with_token);
    assert!(
        page.body.contains(r#"data-figure="dead-lettered">1<"#),
        "{}",
        page.body
    );
    assert!(page.body.contains("Read-only console"), "{}", page.body);
    assert_eq!(
        request(&addr, "POST", "/login", &[], "token=wrong").status,
        401
    );
    let login = request(&addr, "POST", "/login", &[], &format!("token={token}"));
    assert_eq!(login.status, 303, "{}", login.body);
    let cookie = login
        .headers
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .unwrap_or_else(|| panic!("no session cookie: {}", login.headers));
    assert!(
        cookie.contains("httponly") && cookie.contains("samesite=strict"),
        "{cookie}"
    );
    assert!(
        !cookie.contains(token),
        "the token itself is the cookie: {cookie}"
    );
    let session = cookie.split(';').next().unwrap_or_default().to_string();
    let shown = get(
        &addr,
        &format!("/dead-letter?id={id}"),
        &[("Cookie", &session)],
    );
    assert_eq!(shown.status, 200, "{}", shown.body);
    assert!(shown.body.contains("&lt;script&gt;"), "{}", shown.body);
    assert!(
        !shown.body.contains("action=\"/action\""),
        "read-only pages offer actions"
    );

    // Read-only: every action refused with 403, nothing changed.
    for form in [
        format!("action=replay&relay=default&id={id}&confirm=yes&csrf=x"),
        format!("action=purge&relay=default&id={id}&confirm=yes&csrf=x"),
        "action=release&relay=default&key=a&confirm=yes&csrf=x".to_string(),
    ] {
        let reply = request(&addr, "POST", "/action", &with_token, &form);
        assert_eq!(reply.status, 403, "{form}: {}", reply.body);
        assert!(reply.body.contains("read-only"), "{}", reply.body);
        // Without the token, the answer is 401 whatever the form.
        assert_eq!(request(&addr, "POST", "/action", &[], &form).status, 401);
    }
    assert_nothing_acted(&pool, &schema, "a refused action").await;
    assert_eq!(relay.terminate().0, Some(0));

    // Off loopback without a token the console is off: the listener serves the probes only.
    let (addr, open) = off_loopback(&schema, &name, "");
    let detail = format!("/dead-letter?id={id}");
    let relay = RelayProcess::start(&open.path);
    wait_for_http(&addr).await;
    assert_eq!(get(&addr, "/health/live", &[]).status, 200);
    for path in ["/", detail.as_str(), "/login"] {
        let reply = get(&addr, path, &[]);
        assert_eq!(reply.status, 404, "{path}: {}", reply.body);
        assert!(!reply.body.contains("alert"), "{}", reply.body);
    }
    assert_eq!(relay.terminate().0, Some(0));
    // Turned on there without a token: a configuration error at start-up.
    let (_, unguarded) = off_loopback(&schema, &name, "console = true\n");
    let out = outbox(&unguarded.path, &["relay"]);
    assert_eq!(
        out.status.code(),
        Some(EXIT_CONFIG),
        "{}",
        text(&out.stderr)
    );
    assert!(
        text(&out.stderr).contains("set observability.console_token"),
        "{}",
        text(&out.stderr)
    );
    drop_schema(&pool, &schema).await;
}

/// Basic authentication instead of a token: without it, or with a wrong password, 401 and
/// no data; with it the pages and the actions, each action logged with the user's name and
/// never the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_basic_auth_guards_its_data_and_logs_who_acted() {
    let (pool, schema, name, id) = poisoned("console_basic").await;
    let password = "pa55word-0123456";
    // `ops:pa55word-0123456` and `ops:wrong-password-0`, base64.
    let right = [("Authorization", "Basic b3BzOnBhNTV3b3JkLTAxMjM0NTY=")];
    let wrong = [("Authorization", "Basic b3BzOndyb25nLXBhc3N3b3JkLTA=")];
    let settings = format!("console_user = \"ops\"\nconsole_password = \"{password}\"\n");
    let (addr, _config, relay, log) = guarded_console(&schema, &name, &settings, &right).await;

    let refused: [&[(&str, &str)]; 3] = [
        &[],
        &wrong,
        &[("Authorization", "Bearer b3BzOnBhNTV3b3JkLTAxMjM0NTY=")],
    ];
    assert_every_page_refuses(
        &addr,
        (&schema, &id),
        &refused,
        "basic realm",
        "the password",
    );
    let detail = format!("/dead-letter?id={id}");
    let page = get(&addr, "/", &right);
    assert!(
        page.body.contains(r#"data-figure="parked-keys">1<"#),
        "{}",
        page.body
    );
    // The login form takes the user and password too.
    let login = request(
        &addr,
        "POST",
        "/login",
        &[],
        &format!("user=ops&password={password}"),
    );
    assert_eq!(login.status, 303, "{}", login.body);
    assert_eq!(
        request(&addr, "POST", "/login", &[], "user=ops&password=nope").status,
        401
    );

    // The parked key shows how many messages wait behind it (a2, a3).
    let parked = get(&addr, "/parked", &right);
    assert!(
        parked.body.contains(r#"data-figure="waiting">2<"#),
        "{}",
        parked.body
    );
    // An action with the password: done, and logged with the user's name.
    let token = form_token(&get(&addr, &detail, &right).body);
    let release = request(
        &addr,
        "POST",
        "/action",
        &right,
        &format!("action=release&relay=default&key=a&confirm=yes&csrf={token}"),
    );
    assert_eq!(release.status, 200, "{}", release.body);
    assert!(release.body.contains("Released key"), "{}", release.body);
    wait_until_empty(&pool, &schema, Duration::from_secs(30)).await;
    assert_eq!(relay.terminate().0, Some(0));
    let logged = std::fs::read_to_string(&log).expect("the relay's log");
    assert!(
        logged.lines().any(|l| l.contains("console action")
            && l.contains(r#"console user \"ops\""#)
            || l.contains("console action") && l.contains(r#"console user "ops""#)),
        "{logged}"
    );
    assert!(!logged.contains(password), "password logged: {logged}");
    assert_eq!(dead_and_parked(&pool, &schema).await, (1, 0));
    drop_schema(&pool, &schema).await;
}

/// Migrates `storage`, enqueues a message of each (topic, payload, key) and claims `batch`
/// of them for 30 s.
async fn enqueue_and_claim(
    storage: &dyn outbox::StorageAdmin,
    messages: &[(&str, &str, &str)],
    batch: usize,
) -> outbox::Claim {
    storage.migrate().await.expect("migrate");
    let messages: Vec<outbox::NewMessage> = messages
        .iter()
        .map(|&(topic, payload, key)| outbox::NewMessage::new(topic, payload).key(key))
        .collect();
    storage.enqueue(&messages).await.expect("enqueue");
    storage
        .claim("console-test", batch, Duration::from_secs(30))
        .await
        .expect("claim")
}

/// An ack, retry or dead letter of one claimed message: it must settle exactly that one.
async fn settles_one(settled: impl std::future::Future<Output = outbox::Result<u64>>, what: &str) {
    let settled = settled.await.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(settled, 1, "{what}");
}

/// `waiting_behind` of every SQL storage: after its head is dead-lettered, key `k`'s two
/// later messages wait behind it; another key's message does not count.
async fn two_wait_behind(storage: &dyn outbox::StorageAdmin, what: &str) {
    let messages = [
        ("t", "k1", "k"),
        ("t", "k2", "k"),
        ("t", "k3", "k"),
        ("t", "o1", "other"),
    ];
    let claim = enqueue_and_claim(storage, &messages, 1).await;
    assert_eq!(claim.messages.len(), 1, "{what}");
    assert_eq!(claim.messages[0].payload, b"k1", "{what}");
    let dead = outbox::DeadLetter {
        id: claim.messages[0].id,
        error: "poison".into(),
    };
    settles_one(storage.dead_letter(&claim.token, &[dead]), what).await;
    assert_eq!(
        storage.parked_keys().await.expect("parked").len(),
        1,
        "{what}"
    );
    assert_eq!(
        storage.waiting_behind("k").await.expect("count"),
        Some(2),
        "{what}"
    );
    assert_eq!(
        storage.waiting_behind("nokey").await.expect("count"),
        Some(0),
        "{what}"
    );
}

/// A fresh table in every SQL storage this build has, each named for the assertions;
/// [`SqlStorages::drop`] removes the tables.
struct SqlStorages {
    all: Vec<(String, Box<dyn outbox::StorageAdmin>)>,
    schemas: Vec<String>,
    #[cfg(feature = "mysql")]
    mysql_table: String,
    /// The SQLite file's directory, removed with it.
    _dir: ConfigFile,
}

impl SqlStorages {
    /// PostgreSQL in lease mode (and in log mode too with `log_mode`), SQLite, MySQL.
    async fn new(log_mode: bool) -> SqlStorages {
        let mut all: Vec<(String, Box<dyn outbox::StorageAdmin>)> = Vec::new();
        let mut schemas = Vec::new();
        let modes = [
            outbox::postgres::StorageMode::Lease,
            outbox::postgres::StorageMode::Log,
        ];
        for mode in &modes[..if log_mode { 2 } else { 1 }] {
            let schema = unique_name("cli_console_storages");
            let mut config =
                outbox::postgres::PostgresConfig::new(postgres_url()).table(&schema, "outbox");
            config.mode = *mode;
            let storage = outbox::postgres::PgStorage::new(config).expect("a PostgreSQL storage");
            all.push((format!("postgres, {mode:?} mode"), Box::new(storage)));
            schemas.push(schema);
        }
        let dir = ConfigFile::new("");
        #[cfg(feature = "sqlite")]
        {
            let sqlite = outbox::sqlite::SqliteStorage::open(outbox::sqlite::SqliteConfig::new(
                dir.dir.join("outbox.db"),
            ))
            .await
            .expect("a SQLite storage");
            all.push(("sqlite".into(), Box::new(sqlite)));
        }
        #[cfg(feature = "mysql")]
        let mysql_table = unique_name("console_storages");
        #[cfg(feature = "mysql")]
        {
            let config =
                outbox::mysql::MySqlConfig::new(outbox_tests::mysql_url()).table(&mysql_table);
            let mysql = outbox::mysql::MySqlStorage::new(config).expect("a MySQL storage");
            all.push(("mysql".into(), Box::new(mysql)));
        }
        SqlStorages {
            all,
            schemas,
            #[cfg(feature = "mysql")]
            mysql_table,
            _dir: dir,
        }
    }

    /// Runs `check` on a fresh table of each storage of [`SqlStorages::new`], then drops them.
    async fn check_each(log_mode: bool, check: impl AsyncFn(&dyn outbox::StorageAdmin, &str)) {
        let storages = SqlStorages::new(log_mode).await;
        for (what, storage) in &storages.all {
            check(storage.as_ref(), what).await;
        }
        storages.drop().await;
    }

    async fn drop(self) {
        let pool = pool().await;
        for schema in &self.schemas {
            drop_schema(&pool, schema).await;
        }
        #[cfg(feature = "mysql")]
        {
            use sqlx::Connection;
            let mut conn = sqlx::MySqlConnection::connect(&outbox_tests::mysql_url())
                .await
                .expect("MySQL");
            for suffix in outbox::mysql::TABLE_SUFFIXES {
                let _ = sqlx::query(&format!(
                    "DROP TABLE IF EXISTS `{}{suffix}`",
                    self.mysql_table
                ))
                .execute(&mut conn)
                .await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sql_storage_counts_the_messages_waiting_behind_a_parked_key() {
    // Log mode cannot tell (the console shows `?`).
    SqlStorages::check_each(false, two_wait_behind).await;
}

/// Topic `t`'s first message refused once (waiting an hour to retry), its second delivered,
/// topic `u`'s one pending: every SQL storage counts one retrying message, in `t`.
async fn one_retrying(storage: &dyn outbox::StorageAdmin, what: &str) {
    let messages = [("t", "t1", "a"), ("t", "t2", "b"), ("u", "u1", "c")];
    let claim = enqueue_and_claim(storage, &messages, 2).await;
    let [first, second] = claim.messages.as_slice() else {
        panic!("{what}: claimed {:?}", claim.messages);
    };
    assert_eq!(
        (&first.payload[..], &second.payload[..]),
        (&b"t1"[..], &b"t2"[..]),
        "{what}"
    );
    let refused = outbox::Retry {
        id: first.id,
        delay: Duration::from_secs(3600),
        error: "refused".into(),
    };
    settles_one(storage.retry(&claim.token, &[refused]), what).await;
    let delivered = outbox::Delivery {
        id: second.id,
        receipt: outbox::Receipt::default(),
    };
    settles_one(storage.ack(&claim.token, &[delivered]), what).await;
    let stats = storage.stats().await.expect("stats");
    assert_eq!(
        (stats.pending, stats.in_flight, stats.retrying),
        (2, 0, 1),
        "{what}: {stats:?}"
    );
    let topics: Vec<(String, u64, u64, u64)> = storage
        .topic_stats()
        .await
        .expect("topic figures")
        .into_iter()
        .map(|t| (t.topic, t.pending, t.in_flight, t.retrying))
        .collect();
    assert_eq!(
        topics,
        [("t".to_string(), 1, 0, 1), ("u".to_string(), 1, 0, 0)],
        "{what}: (topic, pending, in flight, retrying)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sql_storage_counts_the_messages_waiting_to_retry() {
    SqlStorages::check_each(true, one_retrying).await;
}

/// The overview shows a message waiting to retry, in all and in its topic, as does
/// `outbox status --json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_the_messages_waiting_to_retry() {
    let Fresh { pool, schema, name } = Fresh::new("console_retry_page").await;
    let storage = outbox::postgres::PgStorage::new(
        outbox::postgres::PostgresConfig::new(postgres_url()).table(&schema, "outbox"),
    )
    .expect("a PostgreSQL storage");
    one_retrying(&storage, "before the relay").await;

    let addr = format!("127.0.0.1:{}", free_port());
    let config = listening_config(&schema, &name, &addr);
    let relay = RelayProcess::start(&config.path);
    // The relay delivers `u1`; `t1` waits out its hour.
    let (db, left) = (&pool, &format!(r#"SELECT count(*) FROM "{schema}".outbox"#));
    until("u1 delivered", Duration::from_secs(30), || async move {
        count(db, left).await == 1
    })
    .await;
    let page = overview(&addr, &[]).await;
    assert_eq!(page.status, 200, "{}", page.body);
    for figure in [
        r#"data-figure="pending">1<"#,
        r#"data-figure="retrying">1<"#,
        r#"data-figure="retrying-t">1<"#,
    ] {
        assert!(
            page.body.contains(figure),
            "{figure} not in:\n{}",
            page.body
        );
    }
    let status = outbox(&config.path, &["status", "--output", "json"]);
    assert!(status.status.success(), "status: {}", text(&status.stderr));
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status as JSON");
    assert_eq!(
        (&json["retrying"], &json["topics"][0]["retrying"]),
        (&serde_json::json!(1), &serde_json::json!(1)),
        "{json}"
    );
    finish(relay, &pool, &schema).await;
}

/// The review's hardening notes (issue 30 item 9): each login opens a session of its own (a
/// cookie with `Max-Age`, `Secure` when the browser came over HTTPS), logging out ends that
/// one only; wrong credentials from one address are throttled: after 20, its next try waits
/// (429 with `Retry-After`, the right token included), and after the wait it logs in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_open_sessions_of_their_own_and_guessing_is_throttled() {
    let Fresh { pool, schema, name } = Fresh::new("console_sessions").await;
    let token = "s3ssion-t0ken-for-the-test-0123456789";
    let settings = format!("console = true\nconsole_token = \"{token}\"\n");
    let (addr, config) = off_loopback(&schema, &name, &settings);
    migrate(&config);
    let relay = RelayProcess::start(&config.path);
    let bearer = format!("Bearer {token}");
    assert_eq!(
        overview(&addr, &[("Authorization", bearer.as_str())])
            .await
            .status,
        200
    );
    let login = |extra: &[(&str, &str)]| {
        let reply = request(&addr, "POST", "/login", extra, &format!("token={token}"));
        assert_eq!(reply.status, 303, "{}", reply.body);
        reply
            .headers
            .lines()
            .find_map(|l| l.strip_prefix("set-cookie: "))
            .unwrap_or_else(|| panic!("no session cookie: {}", reply.headers))
            .to_string()
    };
    let (first, second) = (login(&[]), login(&[]));
    let https = login(&[("Origin", "https://console.example")]);
    for cookie in [&first, &second] {
        assert!(
            cookie.contains("httponly")
                && cookie.contains("samesite=strict")
                && cookie.contains("max-age=43200")
                && !cookie.contains("secure"),
            "{cookie}"
        );
    }
    assert!(https.contains("; secure"), "{https}");
    let session = |cookie: &str| cookie.split(';').next().unwrap_or_default().to_string();
    let (first, second) = (session(&first), session(&second));
    assert_ne!(first, second, "one session per login");
    let page = get(&addr, "/", &[("Cookie", &first)]);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(r#"action="/logout""#), "{}", page.body);
    // Logging out takes the form token; it ends the first session only.
    let refused = request(&addr, "POST", "/logout", &[("Cookie", &first)], "csrf=x");
    assert_eq!(refused.status, 403, "{}", refused.body);
    let out = request(
        &addr,
        "POST",
        "/logout",
        &[("Cookie", &first)],
        &format!("csrf={}", form_token(&page.body)),
    );
    assert_eq!(out.status, 303, "{}", out.body);
    assert!(out.headers.contains("max-age=0"), "{}", out.headers);
    assert_eq!(get(&addr, "/", &[("Cookie", &first)]).status, 401);
    assert_eq!(get(&addr, "/", &[("Cookie", &second)]).status, 200);

    // Guessing: 20 wrong tries cost nothing; from the 21st on the address waits 1 s, 2 s,
    // 4 s… before its next try is checked, and while it waits even the right token is not.
    let retry_after = |reply: &Reply| -> u64 {
        reply
            .headers
            .lines()
            .find_map(|l| l.strip_prefix("retry-after: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("429 without Retry-After: {}", reply.headers))
    };
    let (mut refused, mut tries) = (0, 0);
    let wait = loop {
        tries += 1;
        assert!(tries < 40, "never throttled");
        let wrong = if tries % 2 == 0 {
            request(&addr, "POST", "/login", &[], "token=wrong-guess")
        } else {
            get(&addr, "/", &[("Authorization", "Bearer wrong-guess-0123")])
        };
        match wrong.status {
            401 => refused += 1,
            429 if retry_after(&wrong) >= 4 => break retry_after(&wrong),
            429 => tokio::time::sleep(Duration::from_secs(retry_after(&wrong))).await,
            other => panic!("try {tries}: {other} {}", wrong.body),
        }
    };
    assert!(
        refused >= 21,
        "only {refused} wrong tries before the first wait"
    );
    let waiting = request(&addr, "POST", "/login", &[], &format!("token={token}"));
    assert_eq!(waiting.status, 429, "{}", waiting.body);
    assert_eq!(
        get(&addr, "/", &[("Authorization", bearer.as_str())]).status,
        429
    );
    assert_eq!(
        get(&addr, "/", &[("Cookie", &second)]).status,
        200,
        "an open session goes on"
    );
    tokio::time::sleep(Duration::from_secs(wait)).await;
    login(&[]);
    assert_eq!(
        get(&addr, "/", &[("Authorization", bearer.as_str())]).status,
        200,
        "a right login forgot the failures"
    );
    finish(relay, &pool, &schema).await;
}
