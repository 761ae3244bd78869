//! The properties the fuzz targets (fuzz/, see fuzz/README.md) check: each function takes the
//! fuzzer's bytes, runs a parser that reads untrusted input, and panics when a property
//! fails. A parser that panics on its own fails the same way. The unit tests below run every
//! seed committed in fuzz/corpus/ through the same function, so CI checks the seeds and the
//! properties on a stable toolchain, without the fuzzer. Not an API.

use std::collections::BTreeMap;

use chrono::{DateTime, Datelike, Timelike, Utc};
use uuid::Uuid;

use crate::envelope::{self, Envelope, Received};
use crate::{ErrorKind, Message, TraceContext};

/// What a parser made of an input, for the seeds' names (`ok-…` are accepted, `err-…`
/// refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The input was read.
    Accepted,
    /// The input was refused with an error.
    Refused,
}

/// A 64-bit FNV-1a hash of `data`: the fuzz input's own choices (case, order, times) for the
/// round trips, so one input always takes the same ones.
fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The longest error the envelope reader may give: its text plus at most 64 bytes of a
/// value (shown lossily, so up to three bytes each, and `…`).
const MAX_ENVELOPE_ERROR: usize = 512;

/// The envelope reader, [`Received::from_headers`]. The input is a broker's headers, one
/// `name: value` per line (the value is raw bytes, not always UTF-8).
///
/// Properties: the reader never panics; what it reads is the last value of each envelope
/// name, ignoring ASCII case; every error is permanent and quotes at most 64 bytes of a
/// value. An envelope it reads, written again by the writer side ([`Envelope::of`] and
/// [`envelope::application_headers`], as the sinks send them) in any order and letter case
/// a broker may hand it back, reads back equal; so does one with another created time,
/// unless that time has no RFC 3339 form (before year 0 or after 9999), which is refused
/// with an error naming `outbox-created-at`.
pub fn envelope(data: &[u8]) -> Verdict {
    let headers = header_lines(data);
    let read = Received::from_headers(headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())));
    check_read(&headers, &read);
    match read {
        Ok(received) => {
            envelope_round_trip(&received, &headers, hash(data));
            Verdict::Accepted
        }
        Err(_) => Verdict::Refused,
    }
}

/// `name: value` lines; a line without `:` is left out (a comment in a seed).
fn header_lines(data: &[u8]) -> Vec<(String, Vec<u8>)> {
    data.split(|b| *b == b'\n')
        .filter_map(|line| {
            let colon = line.iter().position(|b| *b == b':')?;
            let value = &line[colon + 1..];
            let value = value.strip_prefix(b" ").unwrap_or(value);
            Some((
                String::from_utf8_lossy(&line[..colon]).into_owned(),
                value.to_vec(),
            ))
        })
        .collect()
}

/// The last value of envelope name `name` among `headers`, ignoring ASCII case.
fn last<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .rev()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice())
}

fn check_read(headers: &[(String, Vec<u8>)], read: &crate::Result<Received>) {
    let text = |name| last(headers, name).map(|v| std::str::from_utf8(v).expect("read as text"));
    match read {
        Ok(received) => {
            let id = text(envelope::ID).expect("an envelope read has an id");
            assert_eq!(Uuid::parse_str(id).ok(), Some(received.id), "id");
            assert_eq!(text(envelope::TOPIC), Some(received.topic.as_str()));
            assert_eq!(text(envelope::KEY), received.key.as_deref());
            assert_eq!(
                text(envelope::CONTENT_TYPE),
                received.content_type.as_deref()
            );
            assert!(matches!(
                text(envelope::VERSION),
                None | Some(envelope::VERSION_VALUE)
            ));
            let created = text(envelope::CREATED_AT).map(|t| {
                DateTime::parse_from_rfc3339(t)
                    .expect("a created time read is RFC 3339")
                    .with_timezone(&Utc)
            });
            assert_eq!(created, received.created_at, "created time");
            let trace = text(envelope::TRACEPARENT)
                .filter(|p| !p.is_empty())
                .map(|parent| TraceContext {
                    traceparent: parent.to_string(),
                    tracestate: text(envelope::TRACESTATE)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string),
                });
            assert_eq!(trace, received.trace, "trace context");
        }
        Err(error) => {
            assert_eq!(error.kind(), ErrorKind::Permanent, "{error}");
            assert!(!error.is_retryable(), "{error}");
            let message = error.message();
            assert!(
                message.starts_with("not an outbox message: ")
                    || message.starts_with("outbox message "),
                "{message}"
            );
            assert!(
                message.len() <= MAX_ENVELOPE_ERROR,
                "an error of {} bytes: {message}",
                message.len()
            );
            // The values the reader looks at: none may be quoted (`value`) past its first 64
            // bytes. Checked where those 65 bytes are whole characters without U+FFFD (what a
            // cut character is shown as), so the cut is clear, and with the opening quote, so
            // a value of quotes is not its own delimiter.
            for name in envelope::NAMES {
                if let Some(start) = last(headers, name)
                    .and_then(|value| value.get(..65))
                    .and_then(|start| std::str::from_utf8(start).ok())
                    .filter(|start| !start.contains(char::REPLACEMENT_CHARACTER))
                {
                    assert!(
                        !message.contains(&format!("`{start}")),
                        "the error quotes more than 64 bytes of {name}: {message}"
                    );
                }
            }
        }
    }
}

/// Writes `received` back as a sink would and reads it again.
fn envelope_round_trip(received: &Received, headers: &[(String, Vec<u8>)], choice: u64) {
    // The application's own headers: the delivery's other names, as text.
    let mut own: BTreeMap<String, String> = headers
        .iter()
        .filter(|(name, _)| !envelope::is_envelope_name(name))
        .filter_map(|(name, value)| Some((name.clone(), String::from_utf8(value.clone()).ok()?)))
        .collect();
    if let Some(content_type) = &received.content_type {
        own.insert(envelope::CONTENT_TYPE.into(), content_type.clone());
    }
    let mut message = Message {
        id: received.id,
        topic: received.topic.clone(),
        key: received.key.clone(),
        payload: Vec::new(),
        headers: own,
        created_at: received.created_at.unwrap_or_else(Utc::now),
        attempts: 0,
        trace_context: None,
    };
    // A trace context as the message's own, or as headers set by hand.
    match (&received.trace, choice & 1) {
        (Some(trace), 0) => message.trace_context = Some(trace.clone()),
        (Some(trace), _) => {
            message
                .headers
                .insert(envelope::TRACEPARENT.into(), trace.traceparent.clone());
            if let Some(state) = &trace.tracestate {
                message
                    .headers
                    .insert(envelope::TRACESTATE.into(), state.clone());
            }
        }
        (None, _) => {}
    }
    let expected = Received {
        id: received.id,
        topic: received.topic.clone(),
        key: received.key.clone(),
        created_at: Some(to_micros(message.created_at)),
        content_type: Some(
            (received.content_type.as_deref())
                .unwrap_or(envelope::DEFAULT_CONTENT_TYPE)
                .to_string(),
        ),
        trace: received.trace.clone(),
    };
    check_reread(&message, choice, &expected);

    // Any created time the storage may hold: the whole range of `DateTime` (or, for half
    // the inputs, years 0 to 9999), to the nanosecond.
    let micros = (choice >> 8) as i64;
    let in_range = micros.rem_euclid(253_402_300_800_000_000 + 62_167_219_200_000_000)
        - 62_167_219_200_000_000;
    let micros = if choice & 2 == 0 { in_range } else { micros };
    let Some(created_at) = DateTime::from_timestamp_micros(micros) else {
        return;
    };
    message.created_at = created_at + chrono::Duration::nanoseconds((choice % 1000) as i64);
    let expected = Received {
        created_at: Some(to_micros(message.created_at)),
        ..expected
    };
    check_reread(&message, choice.rotate_left(17), &expected);
}

/// `message` written and read back gives `expected`; one created before year 0 or after
/// 9999, which RFC 3339 cannot write, is refused with an error that says so.
fn check_reread(message: &Message, choice: u64, expected: &Received) {
    match write_and_read(message, choice) {
        Ok(reread) => assert_eq!(&reread, expected, "read back"),
        Err(error) => {
            assert!(
                !(0..=9999).contains(&message.created_at.year()),
                "a written envelope is refused: {error}"
            );
            assert!(error.message().contains(envelope::CREATED_AT), "{error}");
        }
    }
}

/// `time` cut to the microsecond, as the envelope carries it (a leap second stays one).
fn to_micros(time: DateTime<Utc>) -> DateTime<Utc> {
    time.with_nanosecond(time.nanosecond() / 1000 * 1000)
        .expect("fewer nanoseconds")
}

/// The envelope and the application headers of `message` as a broker hands them back: in an
/// order and a letter case chosen by `choice`.
fn write_and_read(message: &Message, choice: u64) -> crate::Result<Received> {
    let envelope = Envelope::of(message);
    let mut wire: Vec<(String, Vec<u8>)> = envelope
        .fields()
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
        .collect();
    let own = envelope::application_headers(message)
        .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()));
    if choice & 4 == 0 {
        wire.extend(own);
    } else {
        wire.splice(0..0, own);
    }
    if choice & 8 != 0 {
        wire.reverse();
    }
    for (name, _) in &mut wire {
        *name = match (choice >> 4) & 3 {
            0 => name.clone(),
            1 => name.to_ascii_uppercase(),
            2 => name
                .split('-')
                .map(|part| {
                    let mut part = part.to_ascii_lowercase();
                    if let Some(first) = part.get_mut(..1) {
                        first.make_ascii_uppercase();
                    }
                    part
                })
                .collect::<Vec<_>>()
                .join("-"),
            _ => name.to_ascii_lowercase(),
        };
    }
    let mut seen = std::collections::BTreeSet::new();
    for (name, _) in &wire {
        if envelope::is_envelope_name(name) {
            assert!(
                seen.insert(name.to_ascii_lowercase()),
                "envelope name {name} sent twice"
            );
        }
    }
    Received::from_headers(wire.iter().map(|(n, v)| (n.as_str(), v.as_slice())))
}

pub use cli_checks::{config, enqueue_line};

/// The parsers of the binary.
mod cli_checks {
    use std::time::{Duration, Instant};

    use base64::Engine;
    use toml::{Table, Value};

    use super::Verdict;
    use crate::cli::config::{self, Backends, Config, ConfigError};
    use crate::cli::enqueue::message_from_line;

    /// The sink types of a build with every sink.
    fn backends() -> Backends {
        Backends {
            default_storage: "postgres".into(),
            sink_types: ["amqp", "file", "kafka", "nats", "redis", "stdout"]
                .map(String::from)
                .to_vec(),
        }
    }

    /// The file name errors give.
    const ORIGIN: &str = "outbox.toml";

    /// The configuration loader: the TOML text ([`config::table_from_str`]), environment
    /// overrides ([`config::apply_env`]; in the input, a comment line
    /// `#env OUTBOX_…=value` is one variable) and validation ([`config::parse`]). Secret
    /// files (`{ file = … }`) are not read.
    ///
    /// Properties: nothing panics. An error never shows a secret given in the input: the
    /// value of a key whose name holds `pass`, `pwd`, `token` or `secret`, or the password of
    /// a URL, in the file or in a variable. An override that is applied is where its name
    /// says. A configuration that is accepted: its relays are named and keyed as documented;
    /// each worker can run (its durations fit a clock, its backoff computes every delay); a
    /// console served off loopback asks for credentials; written back as TOML it reads back
    /// equal, and writing that again gives the same text.
    pub fn config(data: &[u8]) -> Verdict {
        let text = String::from_utf8_lossy(data);
        let env = env_lines(&text);
        let result = read(&text, &env, true);
        match result {
            Ok(config) => {
                check_accepted(&config);
                Verdict::Accepted
            }
            Err(error) => {
                check_no_secret(&text, &env, &error);
                Verdict::Refused
            }
        }
    }

    /// `#env NAME=VALUE` comment lines.
    fn env_lines(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter_map(|line| line.strip_prefix("#env "))
            .filter_map(|var| var.split_once('='))
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect()
    }

    fn read(text: &str, env: &[(String, String)], check: bool) -> Result<Config, ConfigError> {
        let mut table = config::table_from_str(text, ORIGIN)?;
        let ignored = config::apply_env(&mut table, env.iter().cloned())?;
        if check {
            check_env(&table, env, &ignored);
        }
        let mut config = config::parse(table, &backends())?;
        config.ignored_env = ignored;
        Ok(config)
    }

    /// The sections of the file, which are also the first name of an override.
    const SECTIONS: [&str; 4] = ["storage", "relay", "sink", "observability"];

    /// Where override `name` puts its value, and that value; `None`: not an override.
    fn override_path(name: &str, raw: &str) -> Option<(Vec<String>, Value)> {
        let path = name.strip_prefix("OUTBOX_")?;
        if name == "OUTBOX_CONFIG" {
            return None;
        }
        let mut keys: Vec<String> = path.split("__").map(|k| k.to_ascii_lowercase()).collect();
        if keys.len() < 2
            || !SECTIONS.contains(&keys[0].as_str())
            || keys.iter().any(String::is_empty)
        {
            return None;
        }
        let value = if keys.len() >= 3 && keys.last().is_some_and(|k| k == "file") {
            keys.pop();
            Value::Table(Table::from_iter([(
                "file".to_string(),
                Value::String(raw.to_string()),
            )]))
        } else {
            Value::String(raw.to_string())
        };
        if let [.., parent, last] = keys.as_mut_slice()
            && parent == "properties"
        {
            *last = last.replace('_', ".");
        }
        Some((keys, value))
    }

    fn get_path<'a>(table: &'a Table, keys: &[String]) -> Option<&'a Value> {
        let (first, rest) = keys.split_first()?;
        let value = table.get(first)?;
        if rest.is_empty() {
            return Some(value);
        }
        match value {
            Value::Table(inner) => get_path(inner, rest),
            Value::Array(blocks) => match blocks.get(rest[0].parse::<usize>().ok()?)? {
                Value::Table(inner) => get_path(inner, &rest[1..]),
                _ => None,
            },
            _ => None,
        }
    }

    /// The variables that are not overrides are the ones returned, sorted; the last
    /// override is where its name says.
    fn check_env(table: &Table, env: &[(String, String)], ignored: &[String]) {
        let mut expected: Vec<String> = env
            .iter()
            .filter(|(name, raw)| {
                name.starts_with("OUTBOX_")
                    && name != "OUTBOX_CONFIG"
                    && override_path(name, raw).is_none()
            })
            .map(|(name, _)| name.clone())
            .collect();
        expected.sort();
        assert_eq!(ignored, expected, "ignored variables");
        if let Some((name, (keys, value))) = env
            .iter()
            .rev()
            .find_map(|(name, raw)| Some((name, override_path(name, raw)?)))
        {
            assert_eq!(get_path(table, &keys), Some(&value), "override {name}");
        }
    }

    fn check_accepted(config: &Config) {
        let mut names = std::collections::BTreeSet::new();
        for relay in &config.relays {
            assert!(names.insert(&relay.name), "relay {} twice", relay.name);
            assert!(!relay.name.trim().is_empty());
            let (key, storage, sink) = if relay.name == "default" {
                ("relay".to_string(), "storage".into(), "sink".into())
            } else {
                let key = format!("relay[{}]", relay.name);
                (key.clone(), format!("{key}.storage"), format!("{key}.sink"))
            };
            assert_eq!(
                (&relay.key, &relay.storage_key, &relay.sink_key),
                (&key, &storage, &sink)
            );
            let worker = &relay.worker;
            assert_eq!(worker.relay.as_deref(), Some(relay.name.as_str()));
            worker.validate().expect("an accepted worker is valid");
            let now = Instant::now();
            for (setting, duration) in worker.durations() {
                assert!(
                    now.checked_add(duration).is_some(),
                    "{}.{setting} = {duration:?} was accepted: the worker cannot add it to \
                     a clock's time",
                    relay.key
                );
            }
            for failures in [1, 2, 10, 64, 65, u32::MAX] {
                let base = worker.backoff.base_delay(failures);
                assert!(base <= worker.backoff.max);
                assert!(worker.backoff.delay(failures) <= base);
            }
        }
        let observability = &config.observability;
        if let Some(listen) = observability.listen
            && !listen.ip().is_loopback()
            && observability.console_on()
        {
            assert!(
                observability.console_guarded(),
                "a console on {listen} without credentials"
            );
        }

        // Written back and read again: the same configuration, and the same text again.
        let written = write(config);
        let again = read(&written, &[], false)
            .unwrap_or_else(|e| panic!("a configuration written back is refused: {e}\n{written}"));
        let mut expected = config.clone();
        expected.ignored_env.clear();
        assert_eq!(again, expected, "written back as:\n{written}");
        assert_eq!(write(&again), written, "written twice");
    }

    /// `config` as a TOML file.
    fn write(config: &Config) -> String {
        let mut top = Table::new();
        let mut blocks: Vec<Table> = config
            .relays
            .iter()
            .map(|relay| {
                let mut storage = table_of(&relay.storage, &relay.storage_key);
                storage.insert("type".into(), Value::String(relay.storage_type.clone()));
                storage.insert("migrate".into(), Value::Boolean(relay.migrate));
                let mut sink = table_of(&relay.sink, &relay.sink_key);
                sink.insert("type".into(), Value::String(relay.sink_type.clone()));
                let mut block = worker_table(&relay.worker);
                block.insert("name".into(), Value::String(relay.name.clone()));
                block.insert("storage".into(), Value::Table(storage));
                block.insert("sink".into(), Value::Table(sink));
                block
            })
            .collect();
        if let [only] = config.relays.as_slice()
            && only.name == "default"
        {
            // One relay without a name: the sections of a file without [[relay]] blocks.
            let mut block = blocks.remove(0);
            block.remove("name");
            for section in ["storage", "sink"] {
                top.insert(
                    section.into(),
                    block.remove(section).expect("written above"),
                );
            }
            top.insert("relay".into(), Value::Table(block));
        } else {
            let blocks = blocks.into_iter().map(Value::Table).collect();
            top.insert("relay".into(), Value::Array(blocks));
        }
        let o = &config.observability;
        let mut observability = Table::new();
        let mut put = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                observability.insert(key.into(), value);
            }
        };
        put("listen", o.listen.map(|a| Value::String(a.to_string())));
        put(
            "log_format",
            Some(Value::String(
                match o.log_format {
                    config::LogFormat::Text => "text",
                    config::LogFormat::Json => "json",
                }
                .into(),
            )),
        );
        put("log_level", Some(Value::String(o.log_level.clone())));
        put("summary_interval", Some(duration(o.summary_interval)));
        put("otlp_endpoint", o.otlp_endpoint.clone().map(Value::String));
        put("console", o.console.map(Value::Boolean));
        put(
            "console_token",
            o.console_token.clone().map(|s| Value::String(s.0)),
        );
        put(
            "console_read_only",
            Some(Value::Boolean(o.console_read_only)),
        );
        put("console_user", o.console_user.clone().map(Value::String));
        put(
            "console_password",
            o.console_password.clone().map(|s| Value::String(s.0)),
        );
        top.insert("observability".into(), Value::Table(observability));
        toml::to_string(&top).expect("a table is written")
    }

    fn duration(d: Duration) -> Value {
        Value::String(humantime::format_duration(d).to_string())
    }

    /// A number as TOML writes it: an integer, else (past `i64`) as text, which settings read
    /// as a number too.
    fn count(n: u64) -> Value {
        i64::try_from(n).map_or_else(|_| Value::String(n.to_string()), Value::Integer)
    }

    fn worker_table(w: &crate::WorkerConfig) -> Table {
        let backoff = Table::from_iter([
            ("initial".to_string(), duration(w.backoff.initial)),
            ("multiplier".into(), Value::Float(w.backoff.multiplier)),
            ("max".into(), duration(w.backoff.max)),
            ("jitter".into(), Value::Float(w.backoff.jitter)),
        ]);
        Table::from_iter([
            ("batch_size".to_string(), count(w.batch_size as u64)),
            ("poll_interval".into(), duration(w.poll_interval)),
            ("lease".into(), duration(w.lease)),
            ("max_attempts".into(), count(w.max_attempts.into())),
            ("backoff".into(), Value::Table(backoff)),
            ("shutdown_timeout".into(), duration(w.shutdown_timeout)),
            ("metric_topics".into(), count(w.metric_topics as u64)),
        ])
    }

    /// The key TOML's date-times have when they are converted to JSON.
    const DATETIME: &str = "$__toml_private_datetime";

    /// The JSON a section was turned into, as TOML again; `at` names it in a panic.
    fn toml_of(value: &serde_json::Value, at: &str) -> Value {
        match value {
            serde_json::Value::Null => panic!(
                "{at} holds a value that TOML cannot write (null): the file's value was \
                 turned into something else"
            ),
            serde_json::Value::Bool(b) => Value::Boolean(*b),
            serde_json::Value::Number(n) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => Value::Integer(i),
                (None, Some(f)) => Value::Float(f),
                (None, None) => panic!("{at}: number {n}"),
            },
            serde_json::Value::String(s) => Value::String(s.clone()),
            serde_json::Value::Array(items) => Value::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| toml_of(item, &format!("{at}[{i}]")))
                    .collect(),
            ),
            serde_json::Value::Object(map) => {
                if let (1, Some(serde_json::Value::String(time))) = (map.len(), map.get(DATETIME)) {
                    return Value::Datetime(time.parse().expect("a TOML date-time"));
                }
                Value::Table(table_of(value, at))
            }
        }
    }

    fn table_of(value: &serde_json::Value, at: &str) -> Table {
        let serde_json::Value::Object(map) = value else {
            panic!("{at} is not a table: {value}");
        };
        map.iter()
            .map(|(key, value)| (key.clone(), toml_of(value, &format!("{at}.{key}"))))
            .collect()
    }

    /// Names that mark a secret setting, as in `outbox_core`'s redaction.
    const SECRET_NAMES: [&str; 4] = ["pass", "pwd", "token", "secret"];

    /// Shorter values are not looked for in errors: they match ordinary words by chance.
    const MIN_SECRET: usize = 8;

    fn is_secret_name(name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        SECRET_NAMES.iter().any(|s| name.contains(s))
    }

    /// The secrets of the input: values of secret keys (`key = value`, anywhere: tables,
    /// inline tables, broken lines) and passwords of URLs, in the text and the variables.
    fn secrets(text: &str, env: &[(String, String)]) -> Vec<String> {
        let mut found = Vec::new();
        for (at, _) in text.match_indices('=') {
            let before = text[..at].trim_end_matches([' ', '\t']);
            let key_start = before
                .char_indices()
                .rfind(|(_, c)| !(c.is_alphanumeric() || "_-.\"'".contains(*c)))
                .map_or(0, |(i, c)| i + c.len_utf8());
            let key = &before[key_start..];
            if !is_secret_name(key) {
                continue;
            }
            let value = text[at + 1..].trim_start_matches([' ', '\t']);
            let value = match value.as_bytes().first() {
                Some(quote @ (b'"' | b'\'')) => {
                    let inner = &value[1..];
                    let end = inner.find([*quote as char, '\n']).unwrap_or(inner.len());
                    &inner[..end]
                }
                _ => {
                    let end = value
                        .find([',', '}', ']', '\n', '#', ' ', '\t', '\r'])
                        .unwrap_or(value.len());
                    &value[..end]
                }
            };
            found.push(value.to_string());
        }
        for (name, value) in env {
            if is_secret_name(name) {
                found.push(value.clone());
            }
        }
        let values = std::iter::once(text).chain(env.iter().map(|(_, v)| v.as_str()));
        for value in values {
            found.extend(url_passwords(value));
        }
        found.retain(|s| s.chars().count() >= MIN_SECRET);
        found.sort();
        found.dedup();
        // A value that is also written elsewhere may be shown as that.
        let everything: Vec<&str> = std::iter::once(text)
            .chain(env.iter().flat_map(|(n, v)| [n.as_str(), v.as_str()]))
            .collect();
        found.retain(|s| {
            everything
                .iter()
                .map(|t| t.matches(s.as_str()).count())
                .sum::<usize>()
                == 1
        });
        found
    }

    /// The passwords of the URLs in `text`: `scheme://user:password@host`.
    fn url_passwords(text: &str) -> Vec<String> {
        text.match_indices("://")
            .filter_map(|(at, _)| {
                let rest = &text[at + 3..];
                let end = rest
                    .find(['"', '\'', ' ', '\t', '\n', '\r'])
                    .unwrap_or(rest.len());
                let url = &rest[..end];
                let userinfo = &url[..url.rfind('@')?];
                let (_, password) = userinfo.split_once(':')?;
                Some(password.to_string())
            })
            .collect()
    }

    /// Text of the same shape as `s` (letters stay letters, digits digits, the rest as it
    /// is), and another value.
    fn disguise(s: &str) -> String {
        s.chars()
            .map(|c| match c {
                'a'..='z' => (((c as u8 - b'a' + 13) % 26) + b'a') as char,
                'A'..='Z' => (((c as u8 - b'A' + 13) % 26) + b'A') as char,
                '0'..='9' => (((c as u8 - b'0' + 5) % 10) + b'0') as char,
                _ => c,
            })
            .collect()
    }

    fn check_no_secret(text: &str, env: &[(String, String)], error: &ConfigError) {
        assert!(!error.0.is_empty(), "an empty error");
        for secret in secrets(text, env) {
            if !error.0.contains(&secret) {
                continue;
            }
            // The secret, or the same text by chance? Give the input another secret of the
            // same shape: an error that shows that one too shows whatever the secret is.
            let other = disguise(&secret);
            if other == secret || text.contains(&other) {
                continue;
            }
            let text = text.replace(&secret, &other);
            let env: Vec<(String, String)> = env
                .iter()
                .map(|(n, v)| (n.clone(), v.replace(&secret, &other)))
                .collect();
            if let Err(again) = read(&text, &env, false)
                && again.0.contains(&other)
            {
                panic!("the error shows the secret `{secret}`: {}", error.0);
            }
        }
    }

    /// The JSON-lines parser of `outbox enqueue --stdin`,
    /// [`message_from_line`](crate::cli::enqueue::message_from_line), on each line of the
    /// input (blank ones skipped, as `enqueue` does).
    ///
    /// Properties: nothing panics; an error names its line. A message made from a line has
    /// a topic, the line's topic, key, headers and trace context, and its payload: the text
    /// of a string, the bytes of `payload_base64`, or the JSON of another value (with
    /// `content-type: application/json` unless a header says otherwise). Written as a line
    /// again, it reads back equal.
    pub fn enqueue_line(data: &[u8]) -> Verdict {
        let Ok(text) = std::str::from_utf8(data) else {
            // `enqueue` refuses standard input that is not UTF-8 before it parses a line.
            return Verdict::Refused;
        };
        let mut verdict = Verdict::Accepted;
        for (i, line) in text.lines().enumerate() {
            if !line.trim().is_empty() && check_line(i + 1, line) == Verdict::Refused {
                verdict = Verdict::Refused;
            }
        }
        verdict
    }

    fn check_line(number: usize, line: &str) -> Verdict {
        let message = match message_from_line(number, line) {
            Ok(message) => message,
            Err(error) => {
                let prefix = format!("standard input line {number}: ");
                assert!(
                    error.starts_with(&prefix) && error.len() > prefix.len(),
                    "{error}"
                );
                return Verdict::Refused;
            }
        };
        assert!(!message.topic.is_empty(), "a message without a topic");
        let value: serde_json::Value = serde_json::from_str(line).expect("a line read is JSON");
        let field = |name: &str| value.get(name).filter(|v| !v.is_null());
        let text = |name: &str| field(name).map(|v| v.as_str().expect("text"));
        assert_eq!(Some(message.topic.as_str()), text("topic"));
        assert_eq!(message.key.as_deref(), text("key"));
        let headers = field("headers").map(|h| h.as_object().expect("headers"));
        for (name, header) in headers.into_iter().flatten() {
            assert_eq!(
                message.headers.get(name).map(String::as_str),
                header.as_str()
            );
        }
        for name in message.headers.keys() {
            assert!(
                name == "content-type" || headers.is_some_and(|h| h.contains_key(name)),
                "header {name} from nowhere"
            );
        }
        let content_type = message.headers.get("content-type").map(String::as_str);
        let given_type = headers
            .and_then(|h| h.get("content-type"))
            .and_then(|t| t.as_str());
        match (field("payload"), text("payload_base64")) {
            (Some(serde_json::Value::String(s)), None) => {
                assert_eq!(message.payload, s.as_bytes());
                assert_eq!(content_type, given_type);
            }
            (Some(json), None) => {
                let sent: serde_json::Value =
                    serde_json::from_slice(&message.payload).expect("a JSON payload");
                assert_eq!(&sent, json, "the JSON payload");
                // As the line writes it, not written again (that changed numbers).
                let sent = std::str::from_utf8(&message.payload).expect("JSON is text");
                assert!(line.contains(sent), "the payload is not the line's: {sent}");
                assert_eq!(content_type, given_type.or(Some("application/json")));
            }
            (None, Some(b64)) => {
                let engine = base64::engine::general_purpose::STANDARD;
                assert_eq!(engine.decode(b64).ok().as_ref(), Some(&message.payload));
                assert_eq!(content_type, given_type);
            }
            (None, None) => assert!(message.payload.is_empty()),
            (Some(_), Some(_)) => panic!("payload and payload_base64 both taken"),
        }
        let trace = text("traceparent").map(|parent| crate::TraceContext {
            traceparent: parent.to_string(),
            tracestate: text("tracestate").map(str::to_string),
        });
        assert_eq!(message.trace_context, trace);

        // Written as a line and read again.
        let mut written = serde_json::json!({ "topic": message.topic, "headers": message.headers });
        if let Some(key) = &message.key {
            written["key"] = key.as_str().into();
        }
        match std::str::from_utf8(&message.payload) {
            Ok(text) => written["payload"] = text.into(),
            Err(_) => {
                let engine = base64::engine::general_purpose::STANDARD;
                written["payload_base64"] = engine.encode(&message.payload).into();
            }
        }
        if let Some(trace) = &message.trace_context {
            written["traceparent"] = trace.traceparent.as_str().into();
            if let Some(state) = &trace.tracestate {
                written["tracestate"] = state.as_str().into();
            }
        }
        let again = message_from_line(number, &written.to_string())
            .unwrap_or_else(|e| panic!("a line written from a message is refused: {e}"));
        assert_eq!(
            (&again.topic, &again.key, &again.payload),
            (&message.topic, &message.key, &message.payload)
        );
        assert_eq!(again.headers, message.headers);
        assert_eq!(again.trace_context, message.trace_context);
        Verdict::Accepted
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::Verdict;

    /// The committed seeds of fuzz target `target`.
    fn seeds(target: &str) -> Vec<PathBuf> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target);
        let mut seeds: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .collect();
        seeds.sort();
        assert!(
            seeds.len() >= 5,
            "{} has {} seeds",
            dir.display(),
            seeds.len()
        );
        seeds
    }

    /// Runs every seed of `target` through `check`; a seed named `ok-…` must be accepted and
    /// one named `err-…` refused, so the seeds keep meaning what they were written for.
    fn run(target: &str, check: fn(&[u8]) -> Verdict) {
        for seed in seeds(target) {
            let data = std::fs::read(&seed).unwrap();
            let name = seed.file_name().unwrap().to_string_lossy().to_string();
            eprintln!("{target}: {name}");
            let verdict = check(&data);
            if name.starts_with("ok-") {
                assert_eq!(verdict, Verdict::Accepted, "{name}");
            } else if name.starts_with("err-") {
                assert_eq!(verdict, Verdict::Refused, "{name}");
            }
        }
    }

    #[test]
    fn envelope_seeds_hold_the_properties() {
        run("envelope", super::envelope);
    }

    #[test]
    fn config_seeds_hold_the_properties() {
        run("config", super::config);
    }

    #[test]
    fn enqueue_line_seeds_hold_the_properties() {
        run("enqueue_line", super::enqueue_line);
    }
}
