//! The operator console, served by the relay's HTTP listener at `/`: queue figures with
//! charts of deliveries and latency (inline SVG, from [`watch`]), parked keys with the
//! messages waiting behind them, dead letters (search, detail, payload as text, JSON or hex)
//! and the relays of this process with their worker's state, with the repairs of `outbox dead-letters` (replay, release, purge) behind a
//! confirmation. Server-rendered HTML without scripts; everything comes from the binary.
//!
//! Access: without `console_token` or `console_user`/`console_password` only loopback
//! clients reach it (the listener is on loopback, and the `Host` header must name loopback,
//! against DNS rebinding). With a token every request needs it, as `Authorization: Bearer`;
//! with a user and password, as `Authorization: Basic`; either also through the login form,
//! which opens a session of its own (an HttpOnly cookie, ended by logging out, after an hour
//! idle or twelve hours). Wrong credentials are throttled per client address ([`access`]).
//! Actions are POSTs that carry a per-process form token and a same-origin `Origin`, so
//! another site cannot make a browser act; read-only mode refuses them. Each action is logged
//! with who did it. See docs/console.md.

mod access;
mod page;
pub mod watch;

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use access::{Login, Sessions, Throttle};
use axum::Router;
use axum::extract::{ConnectInfo, FromRequest, FromRequestParts, RawQuery, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use outbox::DeadLetterFilter;
use uuid::Uuid;

use crate::config::Observability;
use crate::http::{Readiness, loopback_host};
use crate::relay::Relay;
use page::{esc, url};

/// Message text (a topic, a key) as a page shows it: control characters, bidirectional-text
/// controls and invisible characters escaped (`\u{202e}`), so a key cannot pass for another
/// on screen; then HTML-escaped.
fn shown(text: &str) -> String {
    esc(&outbox::printable(text))
}

/// A key as a form carries it: hex of its bytes, since a browser turns NUL into U+FFFD and
/// line breaks into CR LF when it parses and submits a form.
fn key_field(key: &str) -> String {
    let hex = key.bytes().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    });
    format!(r#"<input type="hidden" name="key_hex" value="{hex}">"#)
}

/// The key a form names: `key_hex` (the console's own forms), else `key` (as typed by hand,
/// e.g. with curl). `Err` when `key_hex` is not the hex of UTF-8 text.
fn form_key(form: &[(String, String)]) -> Result<Option<String>, &'static str> {
    let Some(hex) = page::value(form, "key_hex") else {
        return Ok(page::value(form, "key").map(str::to_string));
    };
    let bytes: Option<Vec<u8>> = (hex.len() % 2 == 0)
        .then(|| {
            (0..hex.len())
                .step_by(2)
                .map(|i| {
                    hex.get(i..i + 2)
                        .and_then(|b| u8::from_str_radix(b, 16).ok())
                })
                .collect()
        })
        .flatten();
    bytes
        .and_then(|b| String::from_utf8(b).ok())
        .map(Some)
        .ok_or("The key field is not hex of UTF-8 text.")
}

/// How long a page waits for a storage before it shows the storage's error instead.
const STORAGE_TIMEOUT: Duration = Duration::from_secs(5);
/// Dead letters listed when the search gives no limit, and the most it may ask for.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;
/// The session cookie set by the login form.
const COOKIE: &str = "outbox_console";
/// The `Set-Cookie` value that makes a browser drop the session cookie.
const CLEAR_COOKIE: &str = "outbox_console=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0";

/// The console's routes, with the settings of `observability`, or none when it is off.
pub fn router(readiness: Readiness, observability: &Observability) -> Option<Router> {
    if !observability.console_on() {
        return None;
    }
    let console = Console {
        readiness,
        token: (observability.console_token.as_ref()).map(|t| Arc::from(t.0.as_str())),
        basic: observability
            .console_user
            .as_ref()
            .zip(observability.console_password.as_ref())
            .map(|(user, password)| (Arc::from(user.as_str()), Arc::from(password.0.as_str()))),
        read_only: observability.console_read_only,
        sessions: Sessions::default(),
        throttle: Throttle::default(),
        form_token: Arc::from(random_hex()?),
    };
    Some(
        Router::new()
            .route("/", get(overview))
            .route("/parked", get(parked))
            .route("/dead-letters", get(dead_letters))
            .route("/dead-letter", get(dead_letter))
            .route("/relays", get(relays))
            .route("/action", axum::routing::post(action))
            .route("/login", get(login_form).post(login))
            .route("/logout", axum::routing::post(logout))
            .route("/console.css", get(css))
            .with_state(console),
    )
}

/// 32 random bytes as hex, from the operating system; none (and no console) if it has none.
fn random_hex() -> Option<String> {
    let mut bytes = [0u8; 32];
    if let Err(error) = getrandom::fill(&mut bytes) {
        tracing::error!(%error, "no randomness for the console's tokens: console off");
        return None;
    }
    Some(bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}

/// What every page needs: the relays (through the readiness checks) and the access settings.
#[derive(Clone)]
struct Console {
    readiness: Readiness,
    /// `observability.console_token`: none on a loopback-only console.
    token: Option<Arc<str>>,
    /// `observability.console_user` and `console_password`, for basic authentication.
    basic: Option<(Arc<str>, Arc<str>)>,
    read_only: bool,
    /// The sessions the login form opened, by their cookie's random value.
    sessions: Sessions,
    /// Wrong credentials per client address.
    throttle: Throttle,
    /// The token every action form carries: random per process, only on the console's pages.
    form_token: Arc<str>,
}

/// Who made a request, for the log of actions: the token is shared, so the client's address
/// tells operators apart.
enum Who {
    Loopback(SocketAddr),
    Token(SocketAddr),
    User(Arc<str>, SocketAddr),
    /// A session the login form opened, and what it was opened with.
    Session(Login, SocketAddr),
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Who::Loopback(peer) => write!(f, "loopback client {peer}"),
            Who::Token(peer) => write!(f, "console token holder at {peer}"),
            Who::User(user, peer) => write!(f, "console user {user:?} at {peer}"),
            Who::Session(Login::Token, peer) => {
                write!(f, "console token holder (logged-in session) at {peer}")
            }
            Who::Session(Login::User(user), peer) => {
                write!(f, "console user {user:?} (logged-in session) at {peer}")
            }
        }
    }
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(given: &str, expected: &str) -> bool {
    let (given, expected) = (given.as_bytes(), expected.as_bytes());
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

/// The credentials of an `Authorization` value of `scheme`, whose name is matched ignoring
/// case (RFC 9110).
fn scheme<'a>(value: &'a str, scheme: &str) -> Option<&'a str> {
    let (name, credentials) = value.split_once(' ')?;
    name.eq_ignore_ascii_case(scheme).then_some(credentials)
}

/// The value of cookie `name` in the request, if any.
fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

/// Headers a proxy adds to what it forwards: a request carrying one came from elsewhere,
/// whatever its socket says.
const FORWARDING_HEADERS: [&str; 6] = [
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-real-ip",
    "via",
];

/// The first forwarding header `headers` carry, if any.
fn forwarded_by(headers: &HeaderMap) -> Option<&'static str> {
    FORWARDING_HEADERS
        .into_iter()
        .find(|name| headers.contains_key(*name))
}

impl Console {
    /// Who is asking, or the answer that turns them away (401 with the login form, or 403).
    fn authorize(&self, headers: &HeaderMap, peer: SocketAddr) -> Result<Who, Refused> {
        if self.token.is_none() && self.basic.is_none() {
            // A proxy on this machine connects from loopback and may send a loopback Host:
            // trusting it would hand every remote client of the proxy the console.
            if let Some(header) = forwarded_by(headers) {
                let text = format!(
                    "<p>This request came through a proxy (it carries <code>{header}</code>). \
                     Without credentials the console answers clients on this machine only; \
                     behind a proxy set <code>observability.console_token</code> or \
                     <code>console_user</code> and <code>console_password</code> \
                     (docs/console.md).</p>"
                );
                return Err(self.page(StatusCode::FORBIDDEN, "Forbidden", &text).into());
            }
            if peer.ip().is_loopback() && loopback_host(headers) {
                return Ok(Who::Loopback(peer));
            }
            return Err(self
                .page(
                    StatusCode::FORBIDDEN,
                    "Forbidden",
                    "<p>Without a console token the console answers loopback clients only.</p>",
                )
                .into());
        }
        if let Some(id) = cookie(headers, COOKIE)
            && let Some(login) = self.sessions.find(id, Instant::now())
        {
            return Ok(Who::Session(login, peer));
        }
        let Some(authorization) = headers.get(header::AUTHORIZATION) else {
            return Err(self
                .login_page(StatusCode::UNAUTHORIZED, "", headers)
                .into());
        };
        self.throttled(peer)?;
        let authorization = authorization.to_str().ok();
        if let Some(token) = &self.token
            && authorization
                .and_then(|v| scheme(v, "Bearer"))
                .is_some_and(|given| same_secret(given.trim(), token))
        {
            self.throttle.succeeded(peer.ip());
            return Ok(Who::Token(peer));
        }
        if let Some((user, password)) = &self.basic
            && authorization
                .and_then(|v| scheme(v, "Basic"))
                .and_then(|given| {
                    use base64::Engine;
                    base64::engine::general_purpose::STANDARD
                        .decode(given.trim())
                        .ok()
                })
                .and_then(|decoded| String::from_utf8(decoded).ok())
                .is_some_and(|given| self.basic_matches(&given, user, password))
        {
            self.throttle.succeeded(peer.ip());
            return Ok(Who::User(user.clone(), peer));
        }
        // Neither the credentials nor the header are logged, only that they were wrong.
        tracing::warn!(%peer, "console: a request with wrong credentials");
        self.throttle.failed(peer.ip(), Instant::now());
        Err(self
            .login_page(StatusCode::UNAUTHORIZED, "", headers)
            .into())
    }

    /// 429 while `peer`'s address must wait after too many wrong credentials: nothing it
    /// sends is checked until then.
    fn throttled(&self, peer: SocketAddr) -> Result<(), Refused> {
        let Err(wait) = self.throttle.check(peer.ip(), Instant::now()) else {
            return Ok(());
        };
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let text = format!(
            "<p>Too many wrong tokens or passwords from {}: try again in {seconds} s.</p>",
            peer.ip()
        );
        let mut response = self.page(StatusCode::TOO_MANY_REQUESTS, "Wait", &text);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        Err(response.into())
    }

    /// Whether `user:password` (the decoded basic credentials) are the configured ones:
    /// both compared whole, in time that does not depend on where they differ.
    fn basic_matches(&self, given: &str, user: &str, password: &str) -> bool {
        let (given_user, given_password) = given.split_once(':').unwrap_or((given, ""));
        let user_ok = same_secret(given_user, user);
        let password_ok = same_secret(given_password, password);
        user_ok & password_ok
    }

    /// Refuses a POST another site could have made a browser send: its `Origin`, when the
    /// browser gives one, must be this host, and the form must carry this process's form
    /// token (which only the console's own pages hold).
    fn same_origin(&self, headers: &HeaderMap, form: &[(String, String)]) -> Result<(), Refused> {
        let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
        let origin_ok = match headers.get(header::ORIGIN).map(|o| o.to_str()) {
            None => true,
            Some(Ok(origin)) => host.is_some_and(|host| {
                origin == format!("http://{host}") || origin == format!("https://{host}")
            }),
            Some(Err(_)) => false,
        };
        let token_ok =
            page::value(form, "csrf").is_some_and(|given| same_secret(given, &self.form_token));
        if origin_ok && token_ok {
            Ok(())
        } else {
            Err(self
                .page(
                    StatusCode::FORBIDDEN,
                    "Refused",
                    "<p>This form did not come from this console (its origin or form token does \
                 not match). Reload the page and try again.</p>",
                )
                .into())
        }
    }

    /// An HTML answer with the console's security headers.
    fn page(&self, status: StatusCode, title: &str, body: &str) -> Response {
        let logout = (self.token.is_some() || self.basic.is_some()).then_some(&*self.form_token);
        html(status, page::frame(title, self.read_only, logout, body))
    }

    /// The login form. A session cookie the request carried is no longer live (this is
    /// where it ends up), so the answer clears it.
    fn login_page(&self, status: StatusCode, message: &str, request: &HeaderMap) -> Response {
        let mut fields = String::new();
        if self.token.is_some() {
            fields.push_str(r#"<p><label>Token <input type="password" name="token" autocomplete="current-password"></label></p>"#);
        }
        if self.basic.is_some() {
            if self.token.is_some() {
                fields.push_str("<p>or</p>");
            }
            fields.push_str(r#"<p><label>User <input name="user" autocomplete="username"></label> <label>Password <input type="password" name="password" autocomplete="current-password"></label></p>"#);
        }
        let needs = match (self.token.is_some(), self.basic.is_some()) {
            (true, true) => "its token (observability.console_token) or its user and password",
            (true, false) => "its token (observability.console_token)",
            _ => "its user and password (observability.console_user, console_password)",
        };
        let body = format!(
            r#"{message}<p>This console needs {needs}.</p>
<form method="post" action="/login">{fields}<button>Log in</button></form>"#
        );
        let mut response = html(status, page::frame("Log in", false, None, &body));
        if cookie(request, COOKIE).is_some() {
            response
                .headers_mut()
                .insert(header::SET_COOKIE, HeaderValue::from_static(CLEAR_COOKIE));
        }
        if status == StatusCode::UNAUTHORIZED {
            let headers = response.headers_mut();
            if self.token.is_some() {
                headers.append(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"outbox console\""),
                );
            }
            if self.basic.is_some() {
                headers.append(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Basic realm=\"outbox console\", charset=\"UTF-8\""),
                );
            }
        }
        response
    }

    /// The relays, or the page that says they are still being built.
    fn relays(&self) -> Result<Arc<Vec<Relay>>, Refused> {
        self.readiness.relays().ok_or_else(|| {
            self.page(
                StatusCode::SERVICE_UNAVAILABLE,
                "Starting",
                "<p>The relays are being built (a broker may not answer yet). Reload in a moment.</p>",
            )
            .into()
        })
    }

    /// A hidden field with the form token, for every action form.
    fn form_token_field(&self) -> String {
        format!(
            r#"<input type="hidden" name="csrf" value="{}">"#,
            esc(&self.form_token)
        )
    }
}

/// `body` as an HTML answer that no other site may frame, sniff or cache.
fn html(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// Waits for a storage call, at most [`STORAGE_TIMEOUT`]; the error is text for the page.
async fn ask<T>(call: impl Future<Output = outbox::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(STORAGE_TIMEOUT, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err(format!(
            "the storage did not answer within {STORAGE_TIMEOUT:?}"
        )),
    }
}

fn error_box(what: &str, error: &str) -> String {
    format!(r#"<p class="error">{}: {}</p>"#, esc(what), esc(error))
}

fn age_of(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map_or_else(
        || "-".into(),
        |t| page::age((chrono::Utc::now() - t).num_milliseconds() as f64 / 1000.0),
    )
}

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string()
}

/// A request the console let in: who made it, with the console and the request's headers.
/// Taking one runs [`Console::authorize`] before the handler, so no page can forget to.
struct Authorized {
    console: Console,
    who: Who,
    headers: HeaderMap,
}

impl FromRequestParts<Console> for Authorized {
    type Rejection = Refused;

    async fn from_request_parts(parts: &mut Parts, console: &Console) -> Result<Self, Refused> {
        let ConnectInfo(peer) = ConnectInfo::<SocketAddr>::from_request_parts(parts, console)
            .await
            .map_err(|missing| Refused::from(missing.into_response()))?;
        let who = console.authorize(&parts.headers, peer)?;
        Ok(Authorized {
            console: console.clone(),
            who,
            headers: parts.headers.clone(),
        })
    }
}

/// A form POST of the login and logout forms, before any login: who sent it, the request's
/// headers and the form's fields.
struct Posted(SocketAddr, HeaderMap, Vec<(String, String)>);

impl FromRequest<Console> for Posted {
    type Rejection = Response;

    async fn from_request(request: Request, console: &Console) -> Result<Self, Response> {
        let (mut parts, body) = request.into_parts();
        let ConnectInfo(peer) = ConnectInfo::<SocketAddr>::from_request_parts(&mut parts, console)
            .await
            .map_err(IntoResponse::into_response)?;
        let headers = parts.headers.clone();
        let body = String::from_request(Request::from_parts(parts, body), console)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Posted(peer, headers, page::pairs(&body)))
    }
}

type Page = Result<Response, Refused>;

/// A page that turns a request away (401, 403, 404, …), boxed: it is the rare path.
struct Refused(Box<Response>);

impl From<Response> for Refused {
    fn from(response: Response) -> Self {
        Refused(Box::new(response))
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        *self.0
    }
}

async fn css() -> Response {
    let mut response = page::CSS.into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/css"));
    response
}

async fn overview(Authorized { console: c, .. }: Authorized) -> Page {
    let relays = c.relays()?;
    let mut body = String::new();
    for relay in relays.iter() {
        let _ = write!(
            body,
            "<section><h2>Relay {}</h2><p>{}</p>",
            esc(&relay.def.name),
            esc(&relay.storage.describe())
        );
        match ask(relay.storage.stats()).await {
            Ok(s) => {
                let _ = write!(
                    body,
                    r#"<table><tr><th>pending</th><th>oldest pending age</th><th>in flight</th><th>retrying</th><th>dead-lettered</th><th>parked keys</th></tr>
<tr><td class="n" data-figure="pending">{}</td><td class="n" data-figure="oldest-pending-age">{}</td><td class="n" data-figure="in-flight">{}</td><td class="n" data-figure="retrying">{}</td><td class="n" data-figure="dead-lettered">{}</td><td class="n" data-figure="parked-keys">{}</td></tr></table>"#,
                    s.pending,
                    age_of(s.oldest_pending),
                    s.in_flight,
                    s.retrying,
                    s.dead_lettered,
                    s.parked_keys
                );
            }
            Err(e) => body.push_str(&error_box("queue figures", &e)),
        }
        match ask(relay.storage.topic_stats()).await {
            Ok(topics) if topics.is_empty() => body.push_str("<p>No messages in any topic.</p>"),
            Ok(topics) => {
                body.push_str("<table><tr><th>topic</th><th>pending</th><th>oldest pending age</th><th>in flight</th><th>retrying</th><th>dead-lettered</th></tr>");
                for t in topics {
                    let _ = write!(
                        body,
                        r#"<tr><td><a href="/dead-letters?relay={}&amp;topic={}">{}</a></td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n" data-figure="retrying-{}">{}</td><td class="n">{}</td></tr>"#,
                        esc(&url(&relay.def.name)),
                        esc(&url(&t.topic)),
                        shown(&t.topic),
                        t.pending,
                        age_of(t.oldest_pending),
                        t.in_flight,
                        esc(&t.topic),
                        t.retrying,
                        t.dead_lettered
                    );
                }
                body.push_str("</table>");
            }
            Err(e) => body.push_str(&error_box("figures per topic", &e)),
        }
        body.push_str(&charts(relay));
        body.push_str("</section>");
    }
    Ok(c.page(StatusCode::OK, "Overview", &body))
}

/// The relay's deliveries per topic over the last minutes, as small SVG charts.
fn charts(relay: &Relay) -> String {
    let series = relay.watch.series(chrono::Utc::now());
    let minutes = watch::BUCKETS as i64 * watch::BUCKET_SECS / 60;
    if series.is_empty() {
        return format!("<p>No deliveries in the last {minutes} minutes (by this process).</p>");
    }
    let mut out = format!(
        r#"<table class="charts"><tr><th>topic</th><th>delivered per second, last {minutes} min</th><th>mean latency, last {minutes} min</th></tr>"#
    );
    for (topic, buckets) in series {
        let rates: Vec<f64> = buckets.iter().map(watch::Bucket::rate).collect();
        let latencies: Vec<Option<f64>> = buckets.iter().map(watch::Bucket::mean_latency).collect();
        let peak_rate = rates.iter().copied().fold(0.0, f64::max);
        let peak_latency = latencies.iter().flatten().copied().fold(0.0, f64::max);
        let last_latency = latencies.iter().rev().flatten().next().copied();
        let _ = write!(
            out,
            r#"<tr><td>{}</td><td>{} <span class="peak">peak {peak_rate:.1}/s</span></td><td>{} <span class="peak">peak {}, last {}</span></td></tr>"#,
            shown(&topic),
            page::chart(
                &rates.iter().map(|r| Some(*r)).collect::<Vec<_>>(),
                "delivered per second"
            ),
            page::chart(&latencies, "mean latency in seconds"),
            page::seconds(peak_latency),
            last_latency.map_or_else(|| "-".to_string(), page::seconds),
        );
    }
    out.push_str("</table>");
    out
}

async fn relays(Authorized { console: c, .. }: Authorized) -> Page {
    let relays = c.relays()?;
    let checks = c.readiness.checks().unwrap_or_default();
    let mut body = String::from(
        "<table><tr><th>relay</th><th>storage</th><th>sink</th><th>health</th><th>checked at</th><th>health gate</th><th>backoff</th><th>last error</th><th>delivered</th></tr>",
    );
    for relay in relays.iter() {
        let check = checks.iter().find(|h| h.relay == relay.def.name);
        let (health, at) = match check {
            None => ("not checked yet".to_string(), "-".to_string()),
            Some(h) => {
                let mut problems = Vec::new();
                if let Some(e) = &h.storage {
                    problems.push(format!("storage: {e}"));
                }
                if let Some(e) = &h.sink {
                    problems.push(format!("sink: {e}"));
                }
                let health = if problems.is_empty() {
                    r#"<span class="ok">ready</span>"#.to_string()
                } else {
                    format!(r#"<span class="bad">{}</span>"#, esc(&problems.join("; ")))
                };
                (health, time(h.checked_at))
            }
        };
        let w = relay.watch.snapshot();
        let gate = match &w.gate {
            None => "not checked yet".to_string(),
            Some((at, None)) => format!(r#"<span class="ok">open</span> ({})"#, time(*at)),
            Some((at, Some(_))) => format!(
                r#"<span class="bad">closed: sink down</span> ({})"#,
                time(*at)
            ),
        };
        let backoff = match w.backoff {
            None => "none".to_string(),
            Some((wait, until)) => format!(
                r#"<span class="bad">up to {wait:?} after {} failure(s), until {}</span>"#,
                w.failures,
                time(until)
            ),
        };
        let last_error = match &w.last_error {
            None => "none".to_string(),
            Some((at, error)) => format!(
                r#"<pre class="last-error">{}</pre>{}"#,
                esc(error),
                time(*at)
            ),
        };
        let _ = write!(
            body,
            r#"<tr><td>{}</td><td>{} ({})</td><td>{}</td><td>{health}</td><td>{at}</td><td data-state="gate">{gate}</td><td data-state="backoff">{backoff}</td><td data-state="last-error">{last_error}</td><td class="n" data-state="delivered">{}</td></tr>"#,
            esc(&relay.def.name),
            esc(&relay.def.storage_type),
            esc(&relay.storage.describe()),
            esc(&relay.def.sink_type),
            w.delivered,
        );
    }
    body.push_str("</table>");
    body.push_str(
        "<p>Health: the last check behind <code>/health/ready</code>. Health gate, backoff, \
         last error and delivered: what this relay's worker saw of its sink since this \
         process started (the worker checks the sink before it claims and backs off while \
         it is down; the backoff shown is before jitter).</p>",
    );
    Ok(c.page(StatusCode::OK, "Relays", &body))
}

async fn parked(Authorized { console: c, .. }: Authorized) -> Page {
    let relays = c.relays()?;
    let mut body = String::from(
        "<p>A parked key's messages wait behind its dead letter, so the key keeps its order. \
         Replay the dead letter to deliver it first and then the rest; release the key to let \
         the rest flow without it.</p>",
    );
    for relay in relays.iter() {
        let _ = write!(body, "<h2>Relay {}</h2>", esc(&relay.def.name));
        match ask(relay.storage.parked_keys()).await {
            Ok(keys) if keys.is_empty() => body.push_str("<p>No parked keys.</p>"),
            Ok(keys) => {
                body.push_str("<table><tr><th>key</th><th>held by dead letter</th><th>waiting behind it</th><th></th></tr>");
                for k in keys {
                    let waiting = match ask(relay.storage.waiting_behind(&k.key)).await {
                        Ok(Some(n)) => n.to_string(),
                        Ok(None) => "?".to_string(),
                        Err(e) => format!(r#"<span class="bad">{}</span>"#, esc(&e)),
                    };
                    let _ = write!(
                        body,
                        r#"<tr><td class="key">{key}</td><td><a href="/dead-letter?relay={relay}&amp;id={id}">{id}</a></td><td class="n" data-figure="waiting">{waiting}</td><td>{release}</td></tr>"#,
                        key = shown(&k.key),
                        relay = esc(&url(&relay.def.name)),
                        id = k.dead_letter,
                        release = action_form(
                            &c,
                            "release",
                            &relay.def.name,
                            &[],
                            Some(&k.key),
                            "Release…"
                        ),
                    );
                }
                body.push_str("</table>");
            }
            Err(e) => body.push_str(&error_box("parked keys", &e)),
        }
    }
    Ok(c.page(StatusCode::OK, "Parked keys", &body))
}

/// A button that asks for the confirmation of an action (a POST without `confirm`).
fn action_form(
    c: &Console,
    action: &str,
    relay: &str,
    ids: &[Uuid],
    key: Option<&str>,
    label: &str,
) -> String {
    if c.read_only {
        return String::new();
    }
    let mut form = format!(
        r#"<form class="inline" method="post" action="/action"><input type="hidden" name="action" value="{}"><input type="hidden" name="relay" value="{}">{}"#,
        esc(action),
        esc(relay),
        c.form_token_field()
    );
    for id in ids {
        let _ = write!(form, r#"<input type="hidden" name="id" value="{id}">"#);
    }
    if let Some(key) = key {
        form.push_str(&key_field(key));
    }
    let _ = write!(form, "<button>{}</button></form>", esc(label));
    form
}

/// The relay named by `relay=` in `query`, or the first one.
fn chosen<'a>(relays: &'a [Relay], query: &[(String, String)]) -> Option<&'a Relay> {
    match page::value(query, "relay") {
        Some(name) => relays.iter().find(|r| r.def.name == name),
        None => relays.first(),
    }
}

async fn dead_letters(
    Authorized { console: c, .. }: Authorized,
    RawQuery(query): RawQuery,
) -> Page {
    let relays = c.relays()?;
    let query = page::pairs(query.as_deref().unwrap_or(""));
    let Some(relay) = chosen(&relays, &query) else {
        return Err(c
            .page(
                StatusCode::NOT_FOUND,
                "Dead letters",
                "<p>No such relay.</p>",
            )
            .into());
    };
    let field = |name| page::value(&query, name).map(str::to_string);
    let (topic, key, error) = (field("topic"), field("key"), field("error"));
    let limit = page::value(&query, "limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(DEFAULT_LIMIT)
        .clamp(1, MAX_LIMIT);
    let mut body = String::from(r#"<form method="get" action="/dead-letters">"#);
    if relays.len() > 1 {
        body.push_str(r#"<label>Relay <select name="relay">"#);
        for r in relays.iter() {
            let selected = if r.def.name == relay.def.name {
                " selected"
            } else {
                ""
            };
            let _ = write!(body, r#"<option{selected}>{}</option>"#, esc(&r.def.name));
        }
        body.push_str("</select></label>");
    }
    let input = |name: &str, value: &Option<String>| {
        format!(
            r#"<label>{name} <input name="{name}" value="{}"></label>"#,
            esc(value.as_deref().unwrap_or(""))
        )
    };
    body.push_str(&input("topic", &topic));
    body.push_str(&input("key", &key));
    body.push_str(&input("error", &error));
    let _ = write!(
        body,
        r#"<label>limit <input name="limit" value="{limit}" size="5"></label> <button>Search</button></form>"#
    );
    let filter = DeadLetterFilter {
        ids: None,
        topic: topic.clone(),
        key: key.clone(),
        last_error: error.clone(),
        without_payloads: true,
    };
    let rows = match ask(relay.storage.dead_letters(&filter, limit)).await {
        Ok(rows) => rows,
        Err(e) => {
            body.push_str(&error_box("dead letters", &e));
            return Ok(c.page(StatusCode::OK, "Dead letters", &body));
        }
    };
    let _ = write!(
        body,
        "<p>{} dead letter(s) of relay {}, oldest first.</p>",
        rows.len(),
        esc(&relay.def.name)
    );
    if rows.is_empty() {
        return Ok(c.page(StatusCode::OK, "Dead letters", &body));
    }
    body.push_str("<table><tr><th>id</th><th>topic</th><th>key</th><th>attempts</th><th>dead-lettered at</th><th>last error</th></tr>");
    for row in &rows {
        let m = &row.message;
        let first_line: String = row
            .last_error
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(200)
            .collect();
        let _ = write!(
            body,
            r#"<tr><td><a href="/dead-letter?relay={}&amp;id={id}">{id}</a></td><td>{}</td><td class="key">{}</td><td class="n">{}</td><td>{}</td><td>{}</td></tr>"#,
            esc(&url(&relay.def.name)),
            shown(&m.topic),
            shown(m.key.as_deref().unwrap_or("-")),
            m.attempts,
            time(row.dead_lettered_at),
            esc(&first_line),
            id = m.id,
        );
    }
    body.push_str("</table>");
    let ids: Vec<Uuid> = rows.iter().map(|r| r.message.id).collect();
    body.push_str(&action_form(
        &c,
        "replay",
        &relay.def.name,
        &ids,
        None,
        &format!("Replay these {}…", ids.len()),
    ));
    body.push(' ');
    body.push_str(&action_form(
        &c,
        "purge",
        &relay.def.name,
        &ids,
        None,
        &format!("Purge these {}…", ids.len()),
    ));
    Ok(c.page(StatusCode::OK, "Dead letters", &body))
}

/// How a payload is shown.
#[derive(Clone, Copy, PartialEq, Eq)]
enum View {
    Text,
    Json,
    Hex,
}

/// The payload as text, and as JSON, where it reads so. JSON only up to
/// [`page::PAYLOAD_SHOWN`]: pretty-printing cannot be cut short, and a page must stay small
/// (a larger JSON payload is shown as its first bytes of text).
fn readings(payload: &[u8]) -> (Option<&str>, Option<serde_json::Value>) {
    let text = std::str::from_utf8(payload).ok();
    let json = text
        .filter(|_| payload.len() <= page::PAYLOAD_SHOWN)
        .and_then(|t| serde_json::from_str(t).ok());
    (text, json)
}

/// The view asked for (`&view=`) where the payload has it; else JSON, text, hex, the first
/// the payload has.
fn chosen_view(asked: Option<&str>, text: bool, json: bool) -> View {
    match asked {
        Some("hex") => View::Hex,
        Some("text") if text => View::Text,
        Some("json") if json => View::Json,
        _ if json => View::Json,
        _ if text => View::Text,
        _ => View::Hex,
    }
}

async fn dead_letter(Authorized { console: c, .. }: Authorized, RawQuery(query): RawQuery) -> Page {
    let relays = c.relays()?;
    let query = page::pairs(query.as_deref().unwrap_or(""));
    let not_found = |why: &str| {
        c.page(
            StatusCode::NOT_FOUND,
            "Dead letter",
            &format!("<p>{}</p>", esc(why)),
        )
    };
    let relay = chosen(&relays, &query).ok_or_else(|| not_found("No such relay."))?;
    let id: Uuid = page::value(&query, "id")
        .and_then(|id| id.parse().ok())
        .ok_or_else(|| not_found("Give the id of a dead letter."))?;
    let filter = DeadLetterFilter {
        ids: Some(vec![id]),
        ..Default::default()
    };
    let row = match ask(relay.storage.dead_letters(&filter, 1)).await {
        Ok(mut rows) => rows
            .pop()
            .ok_or_else(|| not_found("No dead letter with this id (replayed or purged?)."))?,
        Err(e) => return Ok(c.page(StatusCode::OK, "Dead letter", &error_box("dead letter", &e))),
    };
    let m = &row.message;
    let (text, json) = readings(&m.payload);
    let view = chosen_view(page::value(&query, "view"), text.is_some(), json.is_some());
    let mut body = format!(
        r#"<table>
<tr><th>id</th><td>{id}</td></tr>
<tr><th>relay</th><td>{relay}</td></tr>
<tr><th>topic</th><td>{topic}</td></tr>
<tr><th>key</th><td class="key">{key}</td></tr>
<tr><th>attempts</th><td>{attempts}</td></tr>
<tr><th>created at</th><td>{created}</td></tr>
<tr><th>dead-lettered at</th><td>{dead}</td></tr>
<tr><th>last error</th><td><pre class="last-error">{error}</pre></td></tr>
</table>"#,
        id = m.id,
        relay = esc(&relay.def.name),
        topic = shown(&m.topic),
        key = shown(m.key.as_deref().unwrap_or("-")),
        attempts = m.attempts,
        created = time(m.created_at),
        dead = time(row.dead_lettered_at),
        error = esc(&row.last_error),
    );
    if !m.headers.is_empty() {
        body.push_str("<h2>Headers</h2><table><tr><th>name</th><th>value</th></tr>");
        for (name, value) in &m.headers {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td></tr>",
                esc(name),
                esc(value)
            );
        }
        body.push_str("</table>");
    }
    let _ = write!(body, "<h2>Payload ({} bytes)</h2><p>", m.payload.len());
    for (v, name, available) in [
        (View::Text, "text", text.is_some()),
        (View::Json, "json", json.is_some()),
        (View::Hex, "hex", true),
    ] {
        if v == view {
            let _ = write!(body, "<strong>{name}</strong> ");
        } else if available {
            let _ = write!(
                body,
                r#"<a href="/dead-letter?relay={}&amp;id={}&amp;view={name}">{name}</a> "#,
                esc(&url(&relay.def.name)),
                m.id
            );
        }
    }
    body.push_str("</p>");
    let shown = &m.payload[..m.payload.len().min(page::PAYLOAD_SHOWN)];
    let rendered = match (view, text, &json) {
        (View::Json, _, Some(value)) => {
            esc(&serde_json::to_string_pretty(value).unwrap_or_default())
        }
        (View::Text, Some(_), _) => esc(&String::from_utf8_lossy(shown)),
        _ => page::hex(shown),
    };
    let _ = write!(body, r#"<pre class="payload">{rendered}</pre>"#);
    if m.payload.len() > page::PAYLOAD_SHOWN && view != View::Json {
        let _ = write!(body, "<p>First {} bytes shown.</p>", page::PAYLOAD_SHOWN);
    }
    if !c.read_only {
        body.push_str("<h2>Repair</h2><p>");
        body.push_str(&action_form(
            &c,
            "replay",
            &relay.def.name,
            &[m.id],
            None,
            "Replay…",
        ));
        body.push(' ');
        body.push_str(&action_form(
            &c,
            "purge",
            &relay.def.name,
            &[m.id],
            None,
            "Purge…",
        ));
        if let Some(key) = &m.key {
            body.push(' ');
            body.push_str(&action_form(
                &c,
                "release",
                &relay.def.name,
                &[],
                Some(key),
                "Release its key…",
            ));
        }
        body.push_str("</p>");
    }
    Ok(c.page(StatusCode::OK, "Dead letter", &body))
}

/// What an action does to the order of each key, said on its confirmation page.
fn consequence(action: &str) -> &'static str {
    match action {
        "replay" => {
            "Replay puts each dead letter back in the outbox at its original place: first in its key's order, ahead of the messages of its key that wait behind it, with its attempts reset. Once no dead letter of a key is left, the key is released and its messages flow again, in order."
        }
        "purge" => {
            "Purge deletes these dead letters for good: they cannot be replayed. Their keys stay parked until you release them; then the key's later messages flow without them."
        }
        _ => {
            "Release lets the messages that wait behind this key's dead letter flow now, without it: they are delivered although the dead letter was not. The dead letter stays in the dead letters; replaying it later delivers it after them, out of its original order."
        }
    }
}

async fn action(
    Authorized {
        console: c,
        who,
        headers,
    }: Authorized,
    body: String,
) -> Page {
    if c.read_only {
        return Err(c.page(
            StatusCode::FORBIDDEN,
            "Read-only",
            "<p>This console is read-only (observability.console_read_only): it takes no actions.</p>",
        ).into());
    }
    let form = page::pairs(&body);
    c.same_origin(&headers, &form)?;
    let bad = |why: &str| {
        c.page(
            StatusCode::BAD_REQUEST,
            "Bad request",
            &format!("<p>{}</p>", esc(why)),
        )
    };
    let action = match page::value(&form, "action") {
        Some(a @ ("replay" | "purge" | "release")) => a,
        _ => return Err(bad("action must be replay, purge or release.").into()),
    };
    let relays = c.relays()?;
    let relay = page::value(&form, "relay")
        .and_then(|name| relays.iter().find(|r| r.def.name == name))
        .ok_or_else(|| bad("No such relay."))?;
    let mut ids = Vec::new();
    for (_, id) in form.iter().filter(|(n, _)| n == "id") {
        ids.push(
            id.parse::<Uuid>()
                .map_err(|_| bad("A dead letter id is not a UUID."))?,
        );
    }
    let key = form_key(&form).map_err(bad)?;
    let key = key.as_deref();
    match (action, ids.is_empty(), key) {
        ("release", _, None) => return Err(bad("Say which key to release.").into()),
        ("replay" | "purge", true, _) => return Err(bad("Say which dead letters (id).").into()),
        _ => {}
    }
    if page::value(&form, "confirm") != Some("yes") {
        return Ok(confirmation(&c, action, relay, &ids, key).await);
    }
    let storage = &relay.storage;
    let done = match action {
        "replay" => ask(storage.replay_dead_letters(&ids))
            .await
            .map(|n| format!("Replayed {n} dead letter(s).")),
        "purge" => ask(storage.purge_dead_letters(&ids))
            .await
            .map(|n| format!("Purged {n} dead letter(s).")),
        _ => {
            let key = key.unwrap_or_default();
            ask(storage.release_parked_key(key))
                .await
                .map(|released| match released {
                    true => format!("Released key {key:?}."),
                    false => format!("Key {key:?} was not parked."),
                })
        }
    };
    match done {
        Ok(done) => {
            tracing::info!(%who, relay = %relay.def.name, action, ids = ?ids, key, outcome = %done, "console action");
            let body = format!(
                r#"<p class="done">{}</p><p><a href="/dead-letters?relay={}">Dead letters</a> · <a href="/parked">Parked keys</a></p>"#,
                esc(&done),
                esc(&url(&relay.def.name))
            );
            Ok(c.page(StatusCode::OK, "Done", &body))
        }
        Err(error) => {
            tracing::warn!(%who, relay = %relay.def.name, action, ids = ?ids, key, %error, "console action failed");
            Ok(c.page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Failed",
                &error_box(action, &error),
            ))
        }
    }
}

/// The page that says what an action will do, with the button that does it.
async fn confirmation(
    c: &Console,
    action: &str,
    relay: &Relay,
    ids: &[Uuid],
    key: Option<&str>,
) -> Response {
    let mut body = format!("<p>{}</p>", esc(consequence(action)));
    if action == "release" {
        let _ = write!(
            body,
            r#"<p>Key: <strong class="key">{}</strong></p>"#,
            shown(key.unwrap_or_default())
        );
    } else {
        let filter = DeadLetterFilter {
            ids: Some(ids.to_vec()),
            without_payloads: true,
            ..Default::default()
        };
        match ask(relay.storage.dead_letters(&filter, ids.len())).await {
            Ok(rows) => {
                let _ = write!(
                    body,
                    "<p>{} dead letter(s) of relay {}:</p><table><tr><th>id</th><th>topic</th><th>key</th></tr>",
                    rows.len(),
                    esc(&relay.def.name)
                );
                for row in rows {
                    let _ = write!(
                        body,
                        r#"<tr><td>{}</td><td>{}</td><td class="key">{}</td></tr>"#,
                        row.message.id,
                        shown(&row.message.topic),
                        shown(row.message.key.as_deref().unwrap_or("-"))
                    );
                }
                body.push_str("</table>");
            }
            Err(e) => body.push_str(&error_box("dead letters", &e)),
        }
    }
    let mut form = format!(
        r#"<form method="post" action="/action"><input type="hidden" name="action" value="{}"><input type="hidden" name="relay" value="{}"><input type="hidden" name="confirm" value="yes">{}"#,
        esc(action),
        esc(&relay.def.name),
        c.form_token_field()
    );
    for id in ids {
        let _ = write!(form, r#"<input type="hidden" name="id" value="{id}">"#);
    }
    if let Some(key) = key {
        form.push_str(&key_field(key));
    }
    let _ = write!(
        form,
        r#"<button class="danger">Yes, {}</button> <a href="/">Cancel</a></form>"#,
        esc(action)
    );
    body.push_str(&form);
    let title = match action {
        "replay" => "Replay dead letters?",
        "purge" => "Purge dead letters?",
        _ => "Release the key?",
    };
    c.page(StatusCode::OK, title, &body)
}

async fn login_form(State(c): State<Console>, headers: HeaderMap) -> Response {
    match c.token.is_some() || c.basic.is_some() {
        true => c.login_page(StatusCode::OK, "", &headers),
        false => c.page(
            StatusCode::OK,
            "Log in",
            "<p>This console needs no token.</p><p><a href=\"/\">Overview</a></p>",
        ),
    }
}

/// The login form's POST: with the right token, or user and password, opens a session (its
/// cookie `Secure` when the browser came over HTTPS) and goes to the overview.
async fn login(State(c): State<Console>, Posted(peer, headers, form): Posted) -> Response {
    if c.token.is_none() && c.basic.is_none() {
        return c.page(
            StatusCode::OK,
            "Log in",
            "<p>This console needs no token.</p>",
        );
    }
    if let Err(refused) = c.throttled(peer) {
        return refused.into_response();
    }
    let by_token = c.token.as_ref().is_some_and(|token| {
        page::value(&form, "token").is_some_and(|given| same_secret(given, token))
    });
    let by_password = c.basic.as_ref().is_some_and(|(user, password)| {
        let given = format!(
            "{}:{}",
            page::value(&form, "user").unwrap_or(""),
            page::value(&form, "password").unwrap_or("")
        );
        c.basic_matches(&given, user, password)
    });
    let login = match (by_token, by_password, &c.basic) {
        (false, true, Some((user, _))) => Login::User(user.clone()),
        (true, _, _) => Login::Token,
        _ => {
            // Neither the token nor the password is logged, only that they were wrong.
            tracing::warn!(%peer, "console: a login with wrong credentials");
            c.throttle.failed(peer.ip(), Instant::now());
            return c.login_page(
                StatusCode::UNAUTHORIZED,
                r#"<p class="error">Wrong token, user or password.</p>"#,
                &headers,
            );
        }
    };
    c.throttle.succeeded(peer.ip());
    let Some(id) = random_hex() else {
        return c.page(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Log in",
            "<p>No randomness for a session: log in with the Authorization header instead.</p>",
        );
    };
    tracing::info!(who = %Who::Session(login.clone(), peer), "console: logged in");
    c.sessions.open(id.clone(), login, Instant::now());
    let mut response = (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
    let secure = if came_over_https(&headers) {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{secure}",
        access::SESSION_LIFETIME.as_secs()
    );
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// Whether the browser reached the console over HTTPS (through a proxy that ends TLS): its
/// form's `Origin`, or the proxy's `X-Forwarded-Proto`, says so. A `Secure` cookie would not
/// be sent back over plain HTTP, so it is set only then.
fn came_over_https(headers: &HeaderMap) -> bool {
    let says_https = |name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().to_ascii_lowercase().starts_with("https"))
    };
    says_https(header::ORIGIN) || says_https(header::HeaderName::from_static("x-forwarded-proto"))
}

/// Logging out: ends this session (others stay open) and clears its cookie.
async fn logout(State(c): State<Console>, Posted(peer, headers, form): Posted) -> Response {
    if let Err(refused) = c.same_origin(&headers, &form) {
        return refused.into_response();
    }
    if let Some(id) = cookie(&headers, COOKIE)
        && c.sessions.close(id)
    {
        tracing::info!(%peer, "console: logged out");
    }
    let mut response = (StatusCode::SEE_OTHER, [(header::LOCATION, "/login")]).into_response();
    response
        .headers_mut()
        .insert(header::SET_COOKIE, HeaderValue::from_static(CLEAR_COOKIE));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys a browser would change (NUL, line breaks) go through the forms as hex, and pages
    /// show control, bidirectional and invisible characters escaped (review item 9).
    #[test]
    fn keys_survive_forms_and_cannot_pass_for_others() {
        for key in [
            "a",
            "nul\0key",
            "line\r\nbreak",
            "\u{202e}evil",
            "zero\u{200b}width",
            "é",
        ] {
            let field = key_field(key);
            let hex = field
                .split("value=\"")
                .nth(1)
                .and_then(|v| v.split('"').next())
                .unwrap_or_default();
            let form = vec![("key_hex".to_string(), hex.to_string())];
            assert_eq!(form_key(&form), Ok(Some(key.to_string())), "{field}");
        }
        let typed = vec![("key".to_string(), "k".to_string())];
        assert_eq!(form_key(&typed), Ok(Some("k".to_string())));
        for bad in ["f", "zz", "ff"] {
            let form = vec![("key_hex".to_string(), bad.to_string())];
            assert!(form_key(&form).is_err(), "{bad}");
        }
        assert_eq!(shown("\u{202e}x<y"), "\\u{202e}x&lt;y");
        assert_eq!(shown("a\u{200b}b"), "a\\u{200b}b");
        assert_eq!(shown("nul\0"), "nul\\u{0}");
    }

    #[test]
    fn authorization_schemes_ignore_case() {
        assert_eq!(scheme("Bearer t0k", "Bearer"), Some("t0k"));
        assert_eq!(scheme("bearer t0k", "Bearer"), Some("t0k"));
        assert_eq!(scheme("BASIC b64", "Basic"), Some("b64"));
        assert_eq!(scheme("Bearer t0k", "Basic"), None);
        assert_eq!(scheme("Bearert0k", "Bearer"), None);
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abd", "abc"));
        assert!(!same_secret("ab", "abc"));
        assert!(!same_secret("", "abc"));
    }

    #[test]
    fn a_json_payload_larger_than_a_page_shows_as_its_first_bytes_of_text() {
        // The security review's 8 MB JSON payload gave an 8 MB page (issue 30, item 6).
        let big = format!("[{}1]", "1,".repeat(page::PAYLOAD_SHOWN));
        let (text, json) = readings(big.as_bytes());
        assert!(text.is_some() && json.is_none());
        assert!(chosen_view(Some("json"), true, json.is_some()) == View::Text);
        let (_, small) = readings(br#"{"a": 1}"#);
        assert!(small.is_some());
        assert!(chosen_view(None, true, true) == View::Json);
        assert!(chosen_view(Some("text"), false, false) == View::Hex);
    }

    #[test]
    fn only_loopback_host_names_pass() {
        let host = |h: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::HOST, HeaderValue::from_str(h).unwrap());
            loopback_host(&headers)
        };
        assert!(
            host("127.0.0.1:9187")
                && host("localhost:9187")
                && host("[::1]:9187")
                && host("LOCALHOST")
        );
        assert!(
            !host("evil.example:9187") && !host("10.0.0.1:9187") && !host("127.0.0.1.evil.example")
        );
        assert!(!loopback_host(&HeaderMap::new()));
    }

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; outbox_console=s3ss; b=2"),
        );
        assert_eq!(cookie(&headers, COOKIE), Some("s3ss"));
        assert_eq!(cookie(&headers, "c"), None);
    }
}
