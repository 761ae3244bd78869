//! The console in a real browser: headless Chromium (Debian's `chromium`) driven through
//! chromedriver (`chromium-driver`) by a WebDriver client. It opens the console of a relay
//! whose key `a` is parked behind a poison message, sees the parked key and what waits
//! behind it, reads the dead letter's payload as text (escaped, never run), replays it by
//! clicking through the confirmation, and sees the key drain in order. A screenshot of each
//! page goes to `target/console-screenshots/`. `cargo xtask test` installs both packages;
//! without them this test fails, it does not skip.

use fantoccini::{Client, ClientBuilder, Locator};

use super::*;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// chromedriver, killed when dropped.
struct Driver(std::process::Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts chromedriver and a headless Chromium session in a window big enough for a page.
async fn browser() -> (Driver, Client) {
    for program in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            Path::new(program).is_file(),
            "{program} is missing: the console's browser test needs Debian's chromium and \
             chromium-driver (`cargo xtask test` installs them, or `apt-get install -y \
             --no-install-recommends chromium chromium-driver`)"
        );
    }
    let port = free_port();
    let driver = Driver(
        Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver"),
    );
    wait_for_http(&format!("127.0.0.1:{port}")).await;
    let mut capabilities = fantoccini::wd::Capabilities::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": CHROMIUM,
            // Root in a container: no sandbox; /dev/shm may be small.
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1000"],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = ClientBuilder::new(connector)
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a Chromium session through chromedriver");
    (driver, client)
}

/// Saves a screenshot of the page shown as `name`.png among the test's artefacts.
async fn screenshot(client: &Client, name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots");
    std::fs::create_dir_all(&dir).expect("the screenshot directory");
    let png = client.screenshot().await.expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG"), "{name}: not a PNG");
    std::fs::write(dir.join(format!("{name}.png")), png).expect("write the screenshot");
}

/// The text of the first element that matches `css`.
async fn text_of(client: &Client, css: &str) -> String {
    let found = client.find(Locator::Css(css)).await;
    let Ok(element) = found else {
        let url = client.current_url().await;
        panic!("no `{css}` on {url:?}: {found:?}");
    };
    element.text().await.expect("its text")
}

/// How many elements match `css`.
async fn count_of(client: &Client, css: &str) -> usize {
    let found = client.find_all(Locator::Css(css)).await;
    found
        .unwrap_or_else(|e| panic!("finding `{css}`: {e}"))
        .len()
}

/// Waits until the page's title (`h1`) is `title`: a click's navigation may still be under
/// way when the click returns.
async fn expect_page(client: &Client, title: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let shown = match client.find(Locator::Css("h1")).await {
            Ok(h1) => h1.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if shown == title {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected the page `{title}`, the browser shows `{shown}` at {:?}",
            client.current_url().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn click(client: &Client, locator: Locator<'_>) {
    client
        .find(locator)
        .await
        .unwrap_or_else(|e| panic!("nothing to click ({e})"))
        .click()
        .await
        .expect("click");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_an_operator_finds_the_parked_key_reads_the_poison_and_replays_it() {
    let (pool, schema, name, id) = poisoned("console_browser").await;
    let (addr, _config, relay, page) = console_relay(&schema, &name).await;
    // Past "Starting": the relays are built.
    assert_eq!(page.status, 200);
    let (_driver, client) = browser().await;
    let base = format!("http://{addr}");

    // The parked key, the dead letter that holds it and the two messages behind it.
    client
        .goto(&format!("{base}/"))
        .await
        .expect("the overview");
    expect_page(&client, "Overview").await;
    assert_eq!(
        text_of(&client, r#"[data-figure="parked-keys"]"#).await,
        "1"
    );
    click(&client, Locator::LinkText("Parked keys")).await;
    expect_page(&client, "Parked keys").await;
    assert_eq!(text_of(&client, "td.key").await, "a");
    assert_eq!(text_of(&client, r#"[data-figure="waiting"]"#).await, "2");
    screenshot(&client, "parked-keys").await;

    click(&client, Locator::LinkText("Dead letters")).await;
    expect_page(&client, "Dead letters").await;
    assert!(
        text_of(&client, "main").await.contains("1 dead letter(s)"),
        "the dead letters page"
    );
    screenshot(&client, "dead-letters").await;

    // The payload as text: the markup shows as characters, nothing of it runs.
    click(&client, Locator::LinkText(&id)).await;
    expect_page(&client, "Dead letter").await;
    let payload = text_of(&client, "pre.payload").await;
    assert!(
        payload.starts_with("<script>alert('x')</script>&xxx"),
        "{payload}"
    );
    assert_eq!(
        count_of(&client, "main script").await,
        0,
        "the payload became a script element"
    );
    assert!(
        text_of(&client, "pre.last-error")
            .await
            .contains("max_payload")
    );
    screenshot(&client, "dead-letter").await;

    // Replay: the confirmation says what happens to the key's order; its button acts.
    click(&client, Locator::XPath("//button[text()='Replay…']")).await;
    expect_page(&client, "Replay dead letters?").await;
    assert!(
        text_of(&client, "main")
            .await
            .contains("first in its key's order"),
        "the confirmation"
    );
    screenshot(&client, "replay-confirmation").await;
    click(&client, Locator::XPath("//button[text()='Yes, replay']")).await;
    expect_page(&client, "Done").await;
    assert_eq!(
        text_of(&client, "p.done").await,
        "Replayed 1 dead letter(s)."
    );
    wait_until_empty(&pool, &schema, Duration::from_secs(30)).await;

    // Drained: nothing parked, and the relay's state and deliveries show.
    client
        .goto(&format!("{base}/parked"))
        .await
        .expect("parked");
    assert!(
        text_of(&client, "main").await.contains("No parked keys."),
        "key a still parked"
    );
    client
        .goto(&format!("{base}/relays"))
        .await
        .expect("relays");
    assert_eq!(
        text_of(&client, r#"[data-state="delivered"]"#).await,
        "3",
        "a, a2 and a3 went through this process's sink"
    );
    assert!(
        text_of(&client, r#"[data-state="gate"]"#)
            .await
            .starts_with("open"),
        "the health gate"
    );
    screenshot(&client, "relays").await;
    client
        .goto(&format!("{base}/"))
        .await
        .expect("the overview");
    assert_eq!(text_of(&client, r#"[data-figure="pending"]"#).await, "0");
    let charts = text_of(&client, "table.charts").await;
    assert!(charts.contains("t") && charts.contains("peak"), "{charts}");
    assert_eq!(
        count_of(&client, "table.charts svg.chart").await,
        2,
        "a rate and a latency chart for topic t"
    );
    screenshot(&client, "overview").await;
    client.close().await.expect("close the browser");

    assert_eq!(relay.terminate().0, Some(0));
    assert_replayed_in_key_order(&pool, &schema, &name).await;
}
