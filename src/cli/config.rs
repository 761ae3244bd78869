//! The relay's configuration file (TOML), environment overrides and start-up validation.
//!
//! The `outbox` binary reads its file with [`load`], giving it the storages and sinks it was
//! built with ([`Backends`]); the steps are public for its fuzz target (fuzz/) and tests:
//! [`table_from_str`], [`apply_env`], [`parse`].
//!
//! Single relay:
//!
//! ```toml
//! [storage]        # url, schema, table, max_connections, connect_timeout
//! [relay]          # batch_size, poll_interval, lease, max_attempts, backoff, per_key_order, ...
//! [sink]           # type = "redis" | "amqp" | "kafka" | ..., and that sink's options
//! [observability]  # listen, log_format, log_level, summary_interval, console, ...
//! ```
//!
//! Several relays: `[[relay]]` blocks, each with `name`, the relay settings, and its own
//! `[relay.storage]` and `[relay.sink]`; top-level `[storage]` and `[sink]` give defaults.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use crate::WorkerConfig;
use serde::Deserialize;
use toml::{Table, Value};

/// A configuration error: names the key and what is allowed (never a secret's value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err(message: impl Into<String>) -> ConfigError {
    ConfigError(message.into())
}

/// What the build has that the configuration refers to: the storage type a `[storage]`
/// without `type` means, and the sink types to name when `[sink]` is missing.
#[derive(Debug, Clone)]
pub struct Backends {
    /// The storage type when `[storage]` names none.
    pub default_storage: String,
    /// The sink types this build has, for the error that asks for one.
    pub sink_types: Vec<String>,
}

/// Everything the relay needs, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Each relay, in the order of the file (one, named `default`, without `[[relay]]`).
    pub relays: Vec<RelayDef>,
    /// The `[observability]` section.
    pub observability: Observability,
    /// `OUTBOX_*` environment variables that are not overrides (no section named), left
    /// alone: the caller warns about them once logging is up.
    pub ignored_env: Vec<String>,
}

/// One relay: its storage, its worker settings and its sink.
#[derive(Debug, Clone, PartialEq)]
pub struct RelayDef {
    /// Its name: a `[[relay]]` block's `name`, else `default`.
    pub name: String,
    /// Where its settings sit in the file, for errors found later (`relay`, `relay[orders]`).
    pub key: String,
    /// Where its sink's settings sit (`sink`, `relay[orders].sink`).
    pub sink_key: String,
    /// Where its storage's settings sit (`storage`, `relay[orders].storage`).
    pub storage_key: String,
    /// Create or upgrade the tables when the relay starts.
    pub migrate: bool,
    /// The storage's `type` (the build's default when the file names none).
    pub storage_type: String,
    /// The storage's options (the `[storage]` table without `type` and `migrate`), for the
    /// registry.
    pub storage: serde_json::Value,
    /// The worker's settings (the relay section), validated.
    pub worker: WorkerConfig,
    /// The sink's `type`.
    pub sink_type: String,
    /// The sink's options (the `[sink]` table without `type`), for the registry.
    pub sink: serde_json::Value,
}

/// The `[observability]` section: the HTTP listener, logs, traces and the console.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Observability {
    /// Address of the HTTP listener for /metrics, /health and the console (none: no listener).
    pub listen: Option<SocketAddr>,
    /// Text or JSON log lines.
    #[serde(default)]
    pub log_format: LogFormat,
    /// The log filter when `RUST_LOG` is not set (default `info`).
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// How often a queue summary is logged (default 60 s).
    #[serde(default = "default_summary", with = "humantime_serde")]
    pub summary_interval: Duration,
    /// The OpenTelemetry collector's OTLP/HTTP base URL; spans are exported when set (needs
    /// the `otlp` cargo feature).
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// The operator console at `/` of the listener. Unset: on when `listen` is a loopback
    /// address or `console_token` is set, off otherwise (see [`Observability::console_on`]).
    #[serde(default)]
    pub console: Option<bool>,
    /// The token the console asks for (`Authorization: Bearer`, or its login form); required
    /// to serve the console on an address other than loopback.
    #[serde(default)]
    pub console_token: Option<Secret>,
    /// The console shows but refuses every action (replay, release, purge) with 403.
    #[serde(default)]
    pub console_read_only: bool,
    /// The user name of the console's basic authentication, an alternative to the token
    /// (with `console_password`).
    #[serde(default)]
    pub console_user: Option<String>,
    /// The password of `console_user`.
    #[serde(default)]
    pub console_password: Option<Secret>,
}

/// A secret setting: its `Debug` hides the value, so printing the configuration leaks nothing.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(
    /// The value itself.
    pub String,
);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Why a console secret of the required length is still not one (never its value): blank
/// ends (a token is trimmed when sent, so it could never match), or a single character
/// repeated.
fn weak_secret(secret: &str) -> Option<&'static str> {
    if secret.trim() != secret || secret.trim().is_empty() {
        return Some("begins or ends with white space (or is all white space)");
    }
    let mut chars = secret.chars();
    let first = chars.next()?;
    chars
        .all(|c| c == first)
        .then_some("is one character repeated")
}

/// The shortest console token accepted: long enough that guessing it is hopeless.
const MIN_CONSOLE_TOKEN: usize = 16;
/// The shortest console password accepted.
const MIN_CONSOLE_PASSWORD: usize = 12;

impl Observability {
    /// Whether the listener serves the console: as set, or by default when it listens on
    /// loopback only or a token guards it.
    pub fn console_on(&self) -> bool {
        self.console.unwrap_or_else(|| {
            self.console_guarded() || self.listen.is_some_and(|a| a.ip().is_loopback())
        })
    }

    /// Whether the console asks for credentials: a token, or a user and password.
    pub fn console_guarded(&self) -> bool {
        self.console_token.is_some() || self.console_password.is_some()
    }

    /// The console's settings fit together: off loopback it needs a token, and the token
    /// is long enough.
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(token) = &self.console_token
            && token.0.chars().count() < MIN_CONSOLE_TOKEN
        {
            return Err(err(format!(
                "observability.console_token is shorter than {MIN_CONSOLE_TOKEN} characters; \
                 use a long random one, e.g. the output of `openssl rand -hex 32`"
            )));
        }
        // Length alone let `aaaaaaaaaaaaaaaa` and twelve spaces through (issue 30, item 9).
        if let Some(token) = &self.console_token
            && let Some(why) = weak_secret(&token.0)
        {
            return Err(err(format!(
                "observability.console_token {why}; use a random one, e.g. the output of \
                 `openssl rand -hex 32`"
            )));
        }
        if let Some(password) = &self.console_password
            && let Some(why) = weak_secret(&password.0)
        {
            return Err(err(format!(
                "observability.console_password {why}; use a random one, e.g. the output of \
                 `openssl rand -hex 16`"
            )));
        }
        match (&self.console_user, &self.console_password) {
            (Some(_), None) | (None, Some(_)) => {
                return Err(err(
                    "observability.console_user and observability.console_password go \
                     together: set both for basic authentication, or neither"
                        .to_string(),
                ));
            }
            (Some(user), Some(_)) if user.is_empty() || user.contains(':') => {
                return Err(err(
                    "observability.console_user is empty or holds a `:`, which basic \
                     authentication cannot carry; choose another name"
                        .to_string(),
                ));
            }
            (Some(_), Some(password)) if password.0.chars().count() < MIN_CONSOLE_PASSWORD => {
                return Err(err(format!(
                    "observability.console_password is shorter than {MIN_CONSOLE_PASSWORD} \
                     characters; use a long random one, e.g. the output of `openssl rand -hex 16`"
                )));
            }
            _ => {}
        }
        if let Some(addr) = self.listen
            && self.console == Some(true)
            && !addr.ip().is_loopback()
            && !self.console_guarded()
        {
            return Err(err(format!(
                "observability.console is on and observability.listen `{addr}` is not a \
                 loopback address: set observability.console_token (for example \
                 console_token = {{ file = \"/run/secrets/console_token\" }}) or \
                 console_user and console_password so that only operators get in, listen \
                 on 127.0.0.1, or set console = false"
            )));
        }
        Ok(())
    }
}

impl Default for Observability {
    fn default() -> Self {
        Observability {
            listen: None,
            log_format: LogFormat::Text,
            log_level: default_log_level(),
            summary_interval: default_summary(),
            otlp_endpoint: None,
            console: None,
            console_token: None,
            console_read_only: false,
            console_user: None,
            console_password: None,
        }
    }
}

fn default_log_level() -> String {
    "info".into()
}

fn default_summary() -> Duration {
    Duration::from_secs(60)
}

/// How log lines are written.
#[derive(Debug, Default, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// For people.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Keys that used to sit in `[relay]` and are settings of the storage now.
const MOVED_TO_STORAGE: [&str; 4] = ["per_key_order", "max_per_key", "wakeup", "retention"];

/// Reads, overrides from the environment and validates the configuration in `path`.
pub fn load(path: &std::path::Path, backends: &Backends) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        err(format!(
            "cannot read configuration file {}: {e}",
            path.display()
        ))
    })?;
    let mut table = table_from_str(&text, &path.display().to_string())?;
    let ignored_env = apply_env(&mut table, std::env::vars())?;
    read_secret_files(&mut table, "")?;
    let mut config = parse(table, backends)?;
    config.ignored_env = ignored_env;
    Ok(config)
}

/// The TOML table of a configuration file's `text`; `origin` names the file in the error.
///
/// The error gives the line, the column and what is wrong, but not the line itself, which
/// the TOML parser's own message quotes: that line may hold a secret (a password whose
/// string is not closed), and start-up errors go to logs (found by the fuzz target).
pub fn table_from_str(text: &str, origin: &str) -> Result<Table, ConfigError> {
    text.parse().map_err(|e: toml::de::Error| {
        let at = e
            .span()
            .and_then(|span| text.get(..span.start))
            .map(|before| {
                let line = before.matches('\n').count() + 1;
                let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
                format!(" at line {line}, column {column}")
            })
            .unwrap_or_default();
        let why = without_value(e.message().trim()).replace('\n', "; ");
        err(format!("{origin} is not valid TOML{at}: {why}"))
    })
}

/// A parser message without the value it quotes, as `outbox::config::from_value` does for
/// settings: serde's `invalid type: integer `98765432109876543210` as i128, expected …` (an
/// unquoted number past 64 bits, such as a numeric password) becomes `invalid type: integer,
/// expected …` (found by the fuzz target).
fn without_value(message: &str) -> String {
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = message.strip_prefix(prefix)
            && let Some((found, expected)) = rest.split_once(", expected ")
        {
            let kind = found.split(['`', '"']).next().unwrap_or(found).trim_end();
            return format!("{prefix}{kind}, expected {expected}");
        }
    }
    message.to_string()
}

/// The sections of the file, which are also the first level of an environment override.
const SECTIONS: [&str; 4] = ["storage", "relay", "sink", "observability"];

/// The most names an override may have (`OUTBOX_RELAY__0__SINK__PROPERTIES__X__FILE` has
/// six). A name of thousands (an environment variable may be 128 KiB long) nested the table
/// so deep that reading it overflowed the stack (found by the fuzz target).
const MAX_OVERRIDE_NAMES: usize = 16;

/// Applies `OUTBOX_<SECTION>__<KEY>[__<KEY>…]=value` overrides, e.g.
/// `OUTBOX_STORAGE__URL`, `OUTBOX_RELAY__BATCH_SIZE=500`, `OUTBOX_RELAY__BACKOFF__MAX=30s`,
/// `OUTBOX_RELAY__0__SINK__URL` (a `[[relay]]` block by index). Every value is text, typed
/// by the setting it sets (`outbox::config::from_value`), so a numeric password stays text.
/// Under a `properties` table (Kafka's) an `_` in the last name is a `.`, which shells
/// cannot put in a variable name: `OUTBOX_SINK__PROPERTIES__LINGER_MS` sets `linger.ms`.
///
/// Other `OUTBOX_*` variables (`OUTBOX_SERVICE_HOST` from a Kubernetes Service named
/// `outbox`, a test's `OUTBOX_TEST_POSTGRES_URL`) are not overrides: they are returned, for
/// one warning, and change nothing.
pub fn apply_env(
    table: &mut Table,
    vars: impl Iterator<Item = (String, String)>,
) -> Result<Vec<String>, ConfigError> {
    let mut ignored = Vec::new();
    for (name, raw) in vars {
        let Some(path) = name.strip_prefix("OUTBOX_") else {
            continue;
        };
        if name == "OUTBOX_CONFIG" {
            continue;
        }
        let mut keys: Vec<String> = path.split("__").map(|k| k.to_ascii_lowercase()).collect();
        if keys.len() < 2
            || !SECTIONS.contains(&keys[0].as_str())
            || keys.iter().any(|k| k.is_empty())
        {
            ignored.push(name);
            continue;
        }
        if keys.len() > MAX_OVERRIDE_NAMES {
            let shown: String = name.chars().take(64).collect();
            return Err(err(format!(
                "environment variable {shown}…: {} names (separated by `__`); an override \
                 has at most {MAX_OVERRIDE_NAMES}",
                keys.len()
            )));
        }
        // `…__URL__FILE=/run/secrets/db` gives `url = { file = "/run/secrets/db" }`,
        // whatever the file said for `url`.
        let value = if keys.len() >= 3 && keys.last().is_some_and(|k| k == "file") {
            keys.pop();
            Value::Table(Table::from_iter([("file".to_string(), Value::String(raw))]))
        } else {
            Value::String(raw)
        };
        if let [.., parent, last] = keys.as_mut_slice()
            && parent == "properties"
        {
            *last = last.replace('_', ".");
        }
        set_path(table, &keys, value)
            .map_err(|why| err(format!("environment variable {name}: {why}")))?;
    }
    ignored.sort();
    Ok(ignored)
}

/// Replaces every `{ file = "/path" }` value with the text of that file (without its final
/// line break): any setting can come from a secret file that Docker, Kubernetes or systemd
/// mounts (`url = { file = "/run/secrets/db_url" }`), so secrets need not sit in the
/// configuration or the environment. `at` is the key path of `table`, for errors.
fn read_secret_files(table: &mut Table, at: &str) -> Result<(), ConfigError> {
    for (key, value) in table.iter_mut() {
        let here = if at.is_empty() {
            key.clone()
        } else {
            format!("{at}.{key}")
        };
        match value {
            Value::Table(inner) if inner.len() == 1 && inner.contains_key("file") => {
                // Settings ending in `_file` take a path and read the file themselves; the
                // text of a key or credentials file in their place would be printed by the
                // "cannot read" error of the setting.
                if key.ends_with("_file") {
                    return Err(err(format!(
                        "{here} takes the path of its file, not `{{ file = … }}` (which reads \
                         the file in): write {here} = \"/path/to/file\""
                    )));
                }
                let Some(Value::String(path)) = inner.get("file") else {
                    return Err(err(format!(
                        "{here}.file must be the path of a file, as a string"
                    )));
                };
                let text = std::fs::read_to_string(path).map_err(|e| {
                    err(format!(
                        "{here}: cannot read the secret file `{path}`: {e}; give a readable file or the value itself"
                    ))
                })?;
                let text = text.strip_suffix('\n').unwrap_or(&text);
                *value = Value::String(text.strip_suffix('\r').unwrap_or(text).to_string());
            }
            Value::Table(inner) => read_secret_files(inner, &here)?,
            Value::Array(items) => {
                for (i, item) in items.iter_mut().enumerate() {
                    if let Value::Table(inner) = item {
                        read_secret_files(inner, &format!("{here}[{i}]"))?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn set_path(table: &mut Table, keys: &[String], value: Value) -> Result<(), String> {
    let (first, rest) = keys.split_first().ok_or("empty key")?;
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return Ok(());
    }
    let entry = table
        .entry(first.clone())
        .or_insert_with(|| Value::Table(Table::new()));
    match entry {
        Value::Table(inner) => set_path(inner, rest, value),
        Value::Array(blocks) => {
            let index: usize = rest[0]
                .parse()
                .map_err(|_| format!("`{first}` is a list: give an index after it"))?;
            match blocks.get_mut(index) {
                Some(Value::Table(inner)) if rest.len() > 1 => set_path(inner, &rest[1..], value),
                _ => Err(format!("`{first}` has no block {index}")),
            }
        }
        _ => Err(format!("`{first}` is not a table")),
    }
}

/// Builds the validated configuration from a parsed TOML table.
pub fn parse(mut table: Table, backends: &Backends) -> Result<Config, ConfigError> {
    if let Some(unknown) = table.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
        return Err(err(format!(
            "unknown section `{unknown}`; the sections are: {}",
            SECTIONS.join(", ")
        )));
    }
    let observability: Observability = match table.remove("observability") {
        Some(Value::Table(v)) => crate::config::from_value(json(v)?)
            .map_err(|e| err(e.in_section("observability").message()))?,
        Some(other) => {
            return Err(err(format!(
                "observability must be a table, not a {}",
                other.type_str()
            )));
        }
        None => Observability::default(),
    };
    observability.validate()?;
    let storage_defaults = table
        .remove("storage")
        .unwrap_or_else(|| Value::Table(Table::new()));
    let sink_default = table.remove("sink");
    let blocks: Vec<(String, Value)> = match table.remove("relay") {
        None => vec![("default".into(), Value::Table(Table::new()))],
        Some(Value::Table(settings)) => vec![("default".into(), Value::Table(settings))],
        Some(Value::Array(blocks)) => {
            let mut named = Vec::new();
            for (i, block) in blocks.into_iter().enumerate() {
                let Value::Table(mut block) = block else {
                    return Err(err(format!("relay[{i}] must be a table ([[relay]] block)")));
                };
                let name = match block.remove("name") {
                    Some(Value::String(name)) if !name.trim().is_empty() => name,
                    _ => {
                        return Err(err(format!(
                            "relay[{i}].name is missing: give each [[relay]] block a name"
                        )));
                    }
                };
                named.push((name, Value::Table(block)));
            }
            if named.is_empty() {
                return Err(err("relay: no [[relay]] blocks"));
            }
            named
        }
        Some(other) => {
            return Err(err(format!(
                "relay must be a table or [[relay]] blocks, not {}",
                other.type_str()
            )));
        }
    };
    let mut names = BTreeSet::new();
    let mut relays = Vec::new();
    for (name, block) in blocks {
        if !names.insert(name.clone()) {
            return Err(err(format!(
                "relay name `{name}` is used twice; names must be unique"
            )));
        }
        let key = if name == "default" {
            "relay".to_string()
        } else {
            format!("relay[{name}]")
        };
        let Value::Table(mut block) = block else {
            unreachable!("blocks are tables")
        };
        let (storage_key, sink_key) = if name == "default" {
            ("storage".to_string(), "sink".to_string())
        } else {
            (format!("{key}.storage"), format!("{key}.sink"))
        };
        let storage = merge(storage_defaults.clone(), block.remove("storage"));
        let sink = inherit_sink(sink_default.clone(), block.remove("sink"));
        relays.push(relay_def(
            &name,
            Section {
                relay: key,
                storage: storage_key,
                sink: sink_key,
            },
            block,
            storage,
            sink,
            backends,
        )?);
    }
    Ok(Config {
        relays,
        observability,
        ignored_env: Vec::new(),
    })
}

/// Overlays `over` on `base`, key by key.
fn merge(base: Value, over: Option<Value>) -> Value {
    match (base, over) {
        (Value::Table(mut base), Some(Value::Table(over))) => {
            base.extend(over);
            Value::Table(base)
        }
        (base, None) => base,
        (_, Some(over)) => over,
    }
}

/// A `[[relay]]` block's sink: its own `sink` table overlays the top-level `[sink]` key by
/// key when it names no type or the same type (so `OUTBOX_RELAY__0__SINK__URL` changes only
/// the URL), and replaces it when it names another type.
fn inherit_sink(default: Option<Value>, own: Option<Value>) -> Option<Value> {
    let type_of = |sink: &Value| sink.get("type").and_then(Value::as_str).map(str::to_owned);
    match (default, own) {
        (Some(default), Some(own)) => {
            let overlays = type_of(&own).is_none_or(|t| type_of(&default) == Some(t));
            Some(if overlays {
                merge(default, Some(own))
            } else {
                own
            })
        }
        (default, own) => own.or(default),
    }
}

/// Where one relay's sections sit in the file, for naming keys in errors.
struct Section {
    relay: String,
    storage: String,
    sink: String,
}

/// A library configuration error, placed in `section` of the file.
fn placed(section: &str) -> impl Fn(crate::Error) -> ConfigError + '_ {
    move |error| err(error.in_section(section).message())
}

/// The TOML table as the JSON value the libraries deserialise from.
fn json(table: Table) -> Result<serde_json::Value, ConfigError> {
    serde_json::to_value(Value::Table(table)).map_err(|e| err(format!("cannot convert: {e}")))
}

fn relay_def(
    name: &str,
    section: Section,
    settings: Table,
    storage: Value,
    sink: Option<Value>,
    backends: &Backends,
) -> Result<RelayDef, ConfigError> {
    if let Some(moved) = MOVED_TO_STORAGE.iter().find(|k| settings.contains_key(**k)) {
        return Err(err(format!(
            "{}.{moved} is a setting of the storage: move it to [{}] (`{}.{moved}`)",
            section.relay, section.storage, section.storage
        )));
    }
    let Value::Table(mut storage) = storage else {
        return Err(err(format!("{} must be a table", section.storage)));
    };
    let migrate = match storage.remove("migrate") {
        None => false,
        Some(Value::Boolean(migrate)) => migrate,
        Some(Value::String(text)) if text.parse::<bool>().is_ok() => text == "true",
        Some(other) => {
            return Err(err(format!(
                "{}.migrate must be true or false, not a {}",
                section.storage,
                other.type_str()
            )));
        }
    };
    let storage_type = match storage.remove("type") {
        None => backends.default_storage.clone(),
        Some(Value::String(t)) => t,
        Some(other) => {
            return Err(err(format!(
                "{}.type must be a string such as \"postgres\", not a {}",
                section.storage,
                other.type_str()
            )));
        }
    };

    let mut worker: WorkerConfig =
        crate::config::from_value(json(settings)?).map_err(placed(&section.relay))?;
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "relay".into());
    // Claims and logs name the process; metrics name the relay, the same on every replica.
    worker.worker_id = format!("{name}@{host}:{}", std::process::id());
    worker.relay = Some(name.to_string());
    // Refuses, among others, a duration over a year (WorkerConfig::MAX_DURATION: a lease of
    // u64::MAX seconds once panicked at the first claim), keyed as the file writes it.
    worker.validate().map_err(placed(&section.relay))?;

    let types = backends.sink_types.join("\", \"");
    let Some(Value::Table(mut sink)) = sink else {
        return Err(err(format!(
            "{}: the sink section is missing; add [sink] with type = \"{types}\"",
            section.sink
        )));
    };
    let sink_type = match sink.remove("type") {
        Some(Value::String(t)) => t,
        _ => {
            return Err(err(format!(
                "{}.type is missing: set it to one of \"{types}\"",
                section.sink
            )));
        }
    };
    Ok(RelayDef {
        name: name.to_string(),
        key: section.relay,
        storage_key: section.storage,
        sink_key: section.sink,
        migrate,
        storage_type,
        storage: json(storage)?,
        worker,
        sink_type,
        sink: json(sink)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backends of a default build.
    pub(crate) fn backends() -> Backends {
        Backends {
            default_storage: "postgres".into(),
            sink_types: vec!["file".into(), "redis".into(), "stdout".into()],
        }
    }

    fn parse_str(text: &str) -> Result<Config, ConfigError> {
        parse(text.parse().unwrap(), &backends())
    }

    const MINIMAL: &str =
        "[storage]\nurl = \"postgres://u:secret@h/db\"\n[sink]\ntype = \"redis\"\n";

    #[test]
    fn minimal_configuration_gets_the_defaults() {
        let config = parse_str(MINIMAL).unwrap();
        assert_eq!(config.relays.len(), 1);
        let relay = &config.relays[0];
        assert_eq!(relay.worker.batch_size, 500);
        assert_eq!(relay.storage_type, "postgres");
        assert_eq!(relay.storage["url"], "postgres://u:secret@h/db");
        assert_eq!(relay.sink_type, "redis");
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            (
                format!("{MINIMAL}[relay]\nbatch_size = 0\n"),
                "relay.batch_size",
            ),
            (
                format!("{MINIMAL}[relay]\nbatchsize = 5\n"),
                "unknown field `batchsize`",
            ),
            (
                format!("{MINIMAL}[relay]\npoll_interval = \"soon\"\n"),
                "relay.poll_interval",
            ),
            (
                "[storage]\nurl = \"postgres://h/db\"\n".to_string(),
                "sink section is missing",
            ),
            (
                format!("{MINIMAL}[observability]\nlog_format = \"xml\"\n"),
                "observability.log_format",
            ),
            (format!("{MINIMAL}[extra]\n"), "unknown section `extra`"),
            (
                format!("{MINIMAL}[relay]\nbackoff = {{ initial = \"2s\", max = \"1s\" }}\n"),
                "relay.backoff.max must be at least initial",
            ),
            (
                format!("{MINIMAL}[relay]\nbackoff = {{ maximum = \"1s\" }}\n"),
                "relay.backoff.maximum: unknown field",
            ),
            (
                format!("{MINIMAL}[relay]\nretention = \"1h\"\n"),
                "relay.retention is a setting of the storage: move it to [storage] (`storage.retention`)",
            ),
            (
                MINIMAL.replace("[sink]", "migrate = \"yes\"\n[sink]"),
                "storage.migrate must be true or false",
            ),
            (
                MINIMAL.replace("[sink]", "type = 5\n[sink]"),
                "storage.type must be a string",
            ),
        ];
        for (text, expected) in cases {
            let error = parse_str(&text).unwrap_err().0;
            assert!(
                error.contains(expected),
                "expected `{expected}` in: {error}"
            );
            assert!(!error.contains("secret"), "password leaked: {error}");
        }
    }

    /// The TOML parser's own message quotes the bad line; a password on it was printed
    /// (found by the fuzz target, seed fuzz/corpus/config/err-found-syntax-error-shows-line.toml).
    #[test]
    fn a_toml_syntax_error_names_the_place_but_never_shows_the_line() {
        for (text, place) in [
            (
                "[observability]\nconsole_user = \"ops\"\nconsole_password = \"Zq9-S3cret-42\n",
                "at line 3, column 34",
            ),
            (
                "[storage]\nurl = \"postgres://app:Zq9-S3cret-42@db/app\" extra\n",
                "at line 2, column",
            ),
            (
                "#\u{0}\u{0} PASSWORD=Zq9-S3cret-42\n",
                "at line 1, column 2",
            ),
            (
                "[sink\ntype = \"redis\" # Zq9-S3cret-42\n",
                "at line 1, column",
            ),
        ] {
            let error = table_from_str(text, "outbox.toml").unwrap_err().0;
            assert!(
                error.starts_with(&format!("outbox.toml is not valid TOML {place}")),
                "{error}"
            );
            assert!(!error.contains("Zq9-S3cret"), "secret shown: {error}");
            assert!(!error.contains('\n'), "{error}");
        }
        // The parser's message quoted a number past 64 bits: a numeric password.
        for text in [
            "[observability]\nconsole_password = 97530877530864219753\n",
            "[observability]\nconsole_password = -97530877530864219753\n",
        ] {
            let error = table_from_str(text, "outbox.toml").unwrap_err().0;
            assert_eq!(
                error,
                "outbox.toml is not valid TOML at line 2, column 20: invalid type: integer, \
                 expected any valid TOML value"
            );
        }
    }

    /// A duration the worker cannot add to the clock was accepted; its first claim (or
    /// retry) panicked.
    #[test]
    fn relay_durations_are_at_most_a_year() {
        assert_eq!(
            humantime::parse_duration("1y").unwrap(),
            WorkerConfig::MAX_DURATION
        );
        for (setting, text) in [
            ("lease", "lease = \"18446744073709551615s\""),
            ("poll_interval", "poll_interval = \"366d\""),
            (
                "shutdown_timeout",
                "shutdown_timeout = \"500000000000years\"",
            ),
            (
                "backoff.initial",
                "backoff = { initial = \"18446744073709551615s\", max = \"18446744073709551615s\" }",
            ),
            ("backoff.max", "backoff = { max = \"1000years\" }"),
        ] {
            let error = parse_str(&format!("{MINIMAL}[relay]\n{text}\n"))
                .unwrap_err()
                .0;
            assert!(
                error.starts_with(&format!("relay.{setting} is "))
                    && error.ends_with("; it must be at most 1 year"),
                "{error}"
            );
        }
        let year = parse_str(&format!(
            "{MINIMAL}[relay]\nlease = \"1y\"\nbackoff = {{ max = \"365d 6h\" }}\n"
        ));
        assert_eq!(
            year.unwrap().relays[0].worker.lease,
            WorkerConfig::MAX_DURATION
        );
    }

    #[test]
    fn several_relays_share_defaults_and_override_them() {
        let text = r#"
            [storage]
            url = "postgres://h/db"
            [sink]
            type = "redis"
            [[relay]]
            name = "orders"
            batch_size = 500
            storage = { schema = "orders" }
            [[relay]]
            name = "billing"
            storage = { schema = "billing", table = "events" }
            sink = { type = "amqp", uri = "amqp://h" }
        "#;
        let config = parse_str(text).unwrap();
        let [orders, billing] = &config.relays[..] else {
            panic!("two relays")
        };
        assert_eq!(
            (
                orders.storage["schema"].as_str().unwrap_or_default(),
                orders.worker.batch_size,
                orders.sink_type.as_str()
            ),
            ("orders", 500, "redis")
        );
        assert_eq!(
            (
                billing.storage["table"].as_str().unwrap_or_default(),
                billing.sink_type.as_str()
            ),
            ("events", "amqp")
        );
        assert_eq!(billing.sink["uri"], "amqp://h");
        let dup = text.replace("\"billing\"", "\"orders\"");
        assert!(parse_str(&dup).unwrap_err().0.contains("used twice"));
    }

    #[test]
    fn environment_overrides_keys() {
        let mut table: Table = MINIMAL.parse().unwrap();
        let vars = [
            ("OUTBOX_RELAY__BATCH_SIZE", "250"),
            ("OUTBOX_STORAGE__URL", "postgres://other/db"),
            ("OUTBOX_RELAY__BACKOFF__MAX", "30s"),
            ("PATH", "/bin"),
        ];
        apply_env(
            &mut table,
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
        .unwrap();
        let config = parse(table, &backends()).unwrap();
        assert_eq!(config.relays[0].worker.batch_size, 250);
        assert_eq!(config.relays[0].storage["url"], "postgres://other/db");
        assert_eq!(config.relays[0].worker.backoff.max, Duration::from_secs(30));
    }

    /// An override of thousands of names overflowed the stack (found by the fuzz target).
    #[test]
    fn an_override_of_too_many_names_is_refused() {
        let deep = format!("OUTBOX_STORAGE{}", "__A".repeat(40_000));
        let mut table: Table = MINIMAL.parse().unwrap();
        let error = apply_env(&mut table, [(deep, "x".to_string())].into_iter())
            .unwrap_err()
            .0;
        assert!(
            error.starts_with("environment variable OUTBOX_STORAGE__A__A")
                && error
                    .ends_with("…: 40001 names (separated by `__`); an override has at most 16"),
            "{error}"
        );
        assert!(error.len() < 200, "{error}");
        let sixteen = format!("OUTBOX_STORAGE{}", "__A".repeat(15));
        apply_env(&mut table, [(sixteen, "x".to_string())].into_iter()).unwrap();
    }

    /// `text` as a table with the secrets it names in files read in, or the error's text.
    fn secrets_read(text: &str) -> Result<Table, String> {
        let mut table: Table = text.parse().expect("TOML");
        read_secret_files(&mut table, "").map_err(|e| e.0)?;
        Ok(table)
    }

    fn with_env(text: &str, vars: &[(&str, &str)]) -> (Result<Config, ConfigError>, Vec<String>) {
        let mut table: Table = text.parse().unwrap();
        let ignored = apply_env(
            &mut table,
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
        .unwrap();
        (parse(table, &backends()), ignored)
    }

    #[test]
    fn variables_that_are_not_overrides_change_nothing_and_are_listed() {
        // A Kubernetes Service named `outbox`, a test's own variable, a bare section.
        let (config, ignored) = with_env(
            MINIMAL,
            &[
                ("OUTBOX_SERVICE_HOST", "10.0.0.1"),
                ("OUTBOX_PORT_9090_TCP", "tcp://10.0.0.1:9090"),
                ("OUTBOX_TEST_POSTGRES_URL", "postgres://x/y"),
                ("OUTBOX_STORAGE", "x"),
                ("OUTBOX_CONFIG", "outbox.toml"),
            ],
        );
        let config = config.unwrap();
        assert_eq!(config.relays[0].storage["url"], "postgres://u:secret@h/db");
        assert_eq!(
            ignored,
            [
                "OUTBOX_PORT_9090_TCP",
                "OUTBOX_SERVICE_HOST",
                "OUTBOX_STORAGE",
                "OUTBOX_TEST_POSTGRES_URL"
            ]
        );
    }

    #[test]
    fn overrides_are_typed_by_the_setting_they_set() {
        let (config, _) = with_env(
            MINIMAL,
            &[
                ("OUTBOX_SINK__PASSWORD", "12345"),
                ("OUTBOX_SINK__PROPERTIES__LINGER_MS", "5"),
                ("OUTBOX_STORAGE__PER_KEY_ORDER", "false"),
                ("OUTBOX_STORAGE__MIGRATE", "true"),
                ("OUTBOX_RELAY__MAX_ATTEMPTS", "7"),
                ("OUTBOX_OBSERVABILITY__LISTEN", "127.0.0.1:9090"),
            ],
        );
        let config = config.unwrap();
        let relay = &config.relays[0];
        // Text stays text until a setting asks for a number (the sink's own config does).
        assert_eq!(relay.sink["password"], "12345");
        assert_eq!(relay.sink["properties"]["linger.ms"], "5");
        assert!(relay.migrate);
        assert_eq!(relay.worker.max_attempts, 7);
        assert_eq!(
            config.observability.listen,
            Some("127.0.0.1:9090".parse().unwrap())
        );
        let (config, _) = with_env(MINIMAL, &[("OUTBOX_RELAY__MAX_ATTEMPTS", "seven")]);
        let error = config.unwrap_err().0;
        assert!(error.contains("relay.max_attempts"), "{error}");
    }

    #[test]
    fn secrets_come_from_files_named_in_the_file_or_the_environment() {
        let dir = std::env::temp_dir().join(format!("outbox_secrets_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = dir.join("db_url");
        std::fs::write(&url, "postgres://app:s3cr3t@db/x\n").unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "t0ken").unwrap();
        let text = format!(
            "[storage]\nurl = {{ file = \"{}\" }}\n[sink]\ntype = \"redis\"\n",
            url.display()
        );
        let mut table: Table = text.parse().unwrap();
        let vars = [(
            "OUTBOX_SINK__PROPERTIES__SASL_PASSWORD__FILE".to_string(),
            token.display().to_string(),
        )];
        apply_env(&mut table, vars.into_iter()).unwrap();
        read_secret_files(&mut table, "").unwrap();
        let config = parse(table, &backends()).unwrap();
        assert_eq!(
            config.relays[0].storage["url"],
            "postgres://app:s3cr3t@db/x"
        );
        assert_eq!(
            config.relays[0].sink["properties"]["sasl.password"],
            "t0ken"
        );

        let error = secrets_read("[storage]\nurl = { file = \"/nowhere/db_url\" }\n").unwrap_err();
        assert!(
            error.starts_with("storage.url: cannot read the secret file `/nowhere/db_url`"),
            "{error}"
        );

        // A setting that names a file takes its path: reading a key file in would put the
        // key where a path belongs, and the setting's errors print paths.
        let key = dir.join("client.key");
        std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nsecret\n").unwrap();
        let error = secrets_read(&format!(
            "[storage]\nurl = \"postgres://h/db\"\ntls_key_file = {{ file = \"{}\" }}\n",
            key.display()
        ))
        .unwrap_err();
        assert!(
            error.starts_with("storage.tls_key_file takes the path of its file"),
            "{error}"
        );
        assert!(!error.contains("secret"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_relay_block_sink_override_keeps_the_inherited_type() {
        let text = "[storage]\nurl = \"postgres://h/db\"\n[sink]\ntype = \"redis\"\nurl = \"redis://a\"\n\
                    [[relay]]\nname = \"orders\"\n[relay.sink]\nstream = \"s\"\n\
                    [[relay]]\nname = \"billing\"\n[relay.sink]\ntype = \"amqp\"\nuri = \"amqp://h\"\n";
        let (config, _) = with_env(text, &[("OUTBOX_RELAY__0__SINK__URL", "redis://b")]);
        let config = config.unwrap();
        let (orders, billing) = (&config.relays[0], &config.relays[1]);
        assert_eq!(orders.sink_type, "redis");
        assert_eq!(orders.sink["url"], "redis://b");
        assert_eq!(orders.sink["stream"], "s");
        // A block naming another type replaces the inherited sink whole.
        assert_eq!(billing.sink_type, "amqp");
        assert!(billing.sink.get("url").is_none(), "{:?}", billing.sink);
    }

    #[test]
    fn the_console_is_on_by_default_on_loopback_only_and_needs_a_token_elsewhere() {
        let with =
            |observability: &str| parse_str(&format!("{MINIMAL}[observability]\n{observability}"));
        let token = "console_token = \"0123456789abcdef0123\"\n";
        let on = |text: &str| with(text).unwrap().observability.console_on();
        assert!(on("listen = \"127.0.0.1:9187\"\n"));
        assert!(on("listen = \"[::1]:9187\"\n"));
        // Existing deployments listening everywhere keep working: no console, no error.
        assert!(!on("listen = \"0.0.0.0:9187\"\n"));
        assert!(on(&format!("listen = \"0.0.0.0:9187\"\n{token}")));
        assert!(!on("listen = \"127.0.0.1:9187\"\nconsole = false\n"));
        let config = with(&format!(
            "listen = \"0.0.0.0:9187\"\nconsole = true\nconsole_read_only = true\n{token}"
        ))
        .unwrap();
        assert!(config.observability.console_read_only);
        assert!(
            !format!("{config:?}").contains("0123456789abcdef"),
            "token printed"
        );

        let cases = [
            (
                "listen = \"0.0.0.0:9187\"\nconsole = true\n",
                "observability.console is on and observability.listen `0.0.0.0:9187` is not a loopback address: set observability.console_token",
            ),
            (
                "listen = \"127.0.0.1:9187\"\nconsole_token = \"short\"\n",
                "observability.console_token is shorter than 16 characters",
            ),
            ("console = \"maybe\"\n", "observability.console"),
            (
                "console_readonly = true\n",
                "unknown field `console_readonly`",
            ),
        ];
        for (text, expected) in cases {
            let error = with(text).unwrap_err().0;
            assert!(
                error.contains(expected),
                "expected `{expected}` in: {error}"
            );
            assert!(!error.contains("short\""), "token printed: {error}");
        }

        // A secret like any other: from a file.
        let file =
            std::env::temp_dir().join(format!("outbox_console_token_{}", std::process::id()));
        std::fs::write(&file, "from-a-file-0123456789\n").unwrap();
        let table = secrets_read(&format!(
            "{MINIMAL}[observability]\nlisten = \"0.0.0.0:9187\"\nconsole_token = {{ file = \"{}\" }}\n",
            file.display()
        ))
        .unwrap();
        let observability = parse(table, &backends()).unwrap().observability;
        assert_eq!(
            observability.console_token,
            Some(Secret("from-a-file-0123456789".into()))
        );
        assert!(observability.console_on());
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn console_basic_auth_takes_a_user_and_a_password_and_guards_like_a_token() {
        let with =
            |observability: &str| parse_str(&format!("{MINIMAL}[observability]\n{observability}"));
        let basic = "console_user = \"ops\"\nconsole_password = \"pa55word-0123456\"\n";
        let config = with(&format!(
            "listen = \"0.0.0.0:9187\"\nconsole = true\n{basic}"
        ))
        .unwrap();
        assert!(config.observability.console_on() && config.observability.console_guarded());
        assert!(
            !format!("{config:?}").contains("pa55word"),
            "password printed"
        );
        // On by default off loopback once guarded, as with a token.
        assert!(
            with(&format!("listen = \"0.0.0.0:9187\"\n{basic}"))
                .unwrap()
                .observability
                .console_on()
        );
        for (text, expected) in [
            (
                "console_user = \"ops\"\n",
                "console_user and observability.console_password go together",
            ),
            (
                "console_password = \"pa55word-0123456\"\n",
                "console_user and observability.console_password go together",
            ),
            (
                "console_user = \"o:ps\"\nconsole_password = \"pa55word-0123456\"\n",
                "holds a `:`",
            ),
            (
                "console_user = \"ops\"\nconsole_password = \"pa55\"\n",
                "console_password is shorter than 12 characters",
            ),
            // The security review's weak secrets of the right length (issue 30, item 9).
            (
                "console_user = \"ops\"\nconsole_password = \"            \"\n",
                "console_password begins or ends with white space",
            ),
            (
                "console_user = \"ops\"\nconsole_password = \" pa55word-0123456\"\n",
                "console_password begins or ends with white space",
            ),
            (
                "console_token = \"aaaaaaaaaaaaaaaa\"\n",
                "console_token is one character repeated",
            ),
            (
                "console_token = \"                \"\n",
                "console_token begins or ends with white space",
            ),
        ] {
            let error = with(text).unwrap_err().0;
            assert!(
                error.contains(expected),
                "expected `{expected}` in: {error}"
            );
            assert!(!error.contains("pa55"), "password printed: {error}");
        }
    }
}
