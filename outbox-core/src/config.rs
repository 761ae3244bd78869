//! What every backend's configuration shares: one struct serves the relay's file and the
//! Rust API (deserialised with [`from_value`], so a bad value is reported under the key the
//! user wrote, and checked by its [`Settings::validate`]), and the [`Template`] that turns a
//! message's topic into a broker name.

use std::fmt;

use serde::de::{DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::{Error, Result};

/// Deserialises a configuration section (the relay's TOML table, handed over as JSON) into
/// `T`. An error is a `Config` error keyed by the path of the bad setting inside the
/// section (for example `backoff.max`), so the caller only adds the section with
/// [`Error::in_section`].
///
/// A string is taken for a number or a boolean where the setting is one (`"500"` for a batch
/// size), so values that arrive as text (environment variables) are typed by the setting
/// they set, and a setting that is text keeps a value that looks like a number (a numeric
/// password) as text.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(Lenient(value)).map_err(|error| {
        let path = error.path().to_string();
        let problem = without_value(&error.into_inner().to_string());
        if path == "." {
            Error::config(problem)
        } else {
            Error::setting(format!("{path}:"), problem)
        }
    })
}

/// A backend's settings: its section of the relay's configuration file (the `[storage]` or
/// `[sink]` table, without `type`) and its Rust API alike. A backend writes
/// [`validate`](Settings::validate); [`from_value`](Settings::from_value) reads a section and
/// checks it, so no setting reaches a backend unchecked.
pub trait Settings: DeserializeOwned {
    /// Checks every setting; the error is keyed by the bad one, relative to the section (the
    /// caller places it with [`Error::in_section`]).
    fn validate(&self) -> Result<()>;

    /// Reads the settings from a section (as JSON, see [`from_value`]) and validates them.
    fn from_value(value: serde_json::Value) -> Result<Self> {
        let settings: Self = from_value(value)?;
        settings.validate()?;
        Ok(settings)
    }
}

/// serde's "invalid type" message without the value it found: `invalid type: integer
/// `987654321012345`, expected a string` becomes `invalid type: integer, expected a string`.
/// The value may be a secret typed unquoted (a numeric password or token), and the kind of
/// value is what tells the user what to change.
fn without_value(problem: &str) -> String {
    const PREFIX: &str = "invalid type: ";
    let Some(rest) = problem.strip_prefix(PREFIX) else {
        return problem.to_string();
    };
    let Some((found, expected)) = rest.split_once(", expected ") else {
        return problem.to_string();
    };
    let kind = found.split(['`', '"']).next().unwrap_or(found).trim_end();
    format!("{PREFIX}{kind}, expected {expected}")
}

/// Writes the builder methods of a settings struct that set fields and return `self`, every
/// one with the doc comment written above it:
///
/// ```
/// #[derive(Default)]
/// struct MyConfig { schema: String, table: String, retention: Option<std::time::Duration> }
/// outbox_core::setters!(MyConfig {
///     /// Sets the schema and table names.
///     table(schema: &str, table: &str) => schema = schema.into(), table = table.into();
///     /// Keeps delivered messages for `keep`.
///     keep(keep: std::time::Duration) => retention = Some(keep);
/// });
/// let config = MyConfig::default().table("app", "events");
/// assert_eq!((config.schema.as_str(), config.table.as_str()), ("app", "events"));
/// ```
///
/// A method that does more than set fields is written out by hand.
#[macro_export]
macro_rules! setters {
    ($type:ty {
        $(
            $(#[$doc:meta])*
            $name:ident($($arg:ident: $arg_type:ty),+) => $($field:ident = $value:expr),+;
        )*
    }) => {
        impl $type {
            $(
                $(#[$doc])*
                pub fn $name(mut self, $($arg: $arg_type),+) -> Self {
                    $(self.$field = $value;)+
                    self
                }
            )*
        }
    };
}

/// Refuses a sink's `publish_timeout` shorter than `min`, with an error keyed by the setting
/// (`publish_timeout is 5ms; it must be at least 10ms (and shorter than the worker's lease)`).
/// For the sinks' [`Settings::validate`].
pub fn check_publish_timeout(timeout: std::time::Duration, min: std::time::Duration) -> Result<()> {
    if timeout < min {
        return Err(Error::setting(
            "publish_timeout",
            format!(
                "is {timeout:?}; it must be at least {min:?} (and shorter than the worker's lease)"
            ),
        ));
    }
    Ok(())
}

/// Refuses a count setting of 0 with an error keyed by the setting (`batch_size is 0; it
/// must be at least 1`), for settings that count things of which one at least is needed.
pub fn check_at_least_one(setting: &str, count: u64) -> Result<()> {
    if count == 0 {
        return Err(Error::setting(setting, "is 0; it must be at least 1"));
    }
    Ok(())
}

/// Refuses a duration setting of 0 with an error keyed by the setting (`poll_interval is 0;
/// it must be greater than zero`).
pub fn check_not_zero(setting: &str, duration: std::time::Duration) -> Result<()> {
    if duration.is_zero() {
        return Err(Error::setting(
            setting,
            "is 0; it must be greater than zero",
        ));
    }
    Ok(())
}

/// For a backend whose URL's scheme turns TLS on (`rediss://`, `amqps://`): refuses a
/// `tls_*` file given with a `url` that does not start with `tls_scheme`, then checks the
/// files as [`check_tls_files`] does.
pub fn check_tls_files_of_url(
    url: &str,
    tls_scheme: &str,
    ca: Option<&std::path::Path>,
    cert: Option<&std::path::Path>,
    key: Option<&std::path::Path>,
) -> Result<()> {
    let given = [
        ("tls_ca_file", ca),
        ("tls_cert_file", cert),
        ("tls_key_file", key),
    ];
    if let Some((setting, _)) = given.iter().find(|(_, file)| file.is_some())
        && !url.starts_with(tls_scheme)
    {
        return Err(Error::setting(
            setting,
            format!("needs a TLS connection: write the url as {tls_scheme}…"),
        ));
    }
    check_tls_files(ca, cert, key)
}

/// Checks the TLS files every backend takes under the same keys, `tls_ca_file`,
/// `tls_cert_file` and `tls_key_file`: each one given can be read, and a client certificate
/// comes with its key. Errors are `Config` errors keyed by the setting. A backend checks what
/// is its own (the URL's scheme, a file also given in the URL) before calling this.
pub fn check_tls_files(
    ca: Option<&std::path::Path>,
    cert: Option<&std::path::Path>,
    key: Option<&std::path::Path>,
) -> Result<()> {
    for (setting, file) in [
        ("tls_ca_file", ca),
        ("tls_cert_file", cert),
        ("tls_key_file", key),
    ] {
        let Some(file) = file else { continue };
        if let Err(e) = std::fs::metadata(file) {
            return Err(Error::setting(
                setting,
                format!("`{}` cannot be read: {e}", file.display()),
            ));
        }
    }
    if cert.is_some() != key.is_some() {
        return Err(Error::setting(
            "tls_cert_file",
            "and tls_key_file go together: give both for a client certificate, or neither",
        ));
    }
    Ok(())
}

/// A JSON value read as [`from_value`] reads it: a string is parsed where a number or a
/// boolean is asked for; everything else as `serde_json` reads it.
struct Lenient(serde_json::Value);

impl Lenient {
    /// The value as text, when it is text.
    fn text(&self) -> Option<&str> {
        self.0.as_str().map(str::trim)
    }
}

/// Asks `visitor` for a number parsed from text, else reads the value as it is.
macro_rules! number_from_text {
    ($($method:ident => $parse:ty, $visit:ident;)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
            match self.text().map(str::parse::<$parse>) {
                Some(Ok(number)) => visitor.$visit(number),
                _ => self.0.$method(visitor),
            }
        }
    )*};
}

impl<'de> Deserializer<'de> for Lenient {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            serde_json::Value::Object(map) => visitor.visit_map(LenientMap {
                entries: map.into_iter(),
                value: None,
            }),
            serde_json::Value::Array(items) => visitor.visit_seq(LenientSeq(items.into_iter())),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.text().map(str::parse::<bool>) {
            Some(Ok(flag)) => visitor.visit_bool(flag),
            _ => self.0.deserialize_bool(visitor),
        }
    }

    number_from_text! {
        deserialize_i8 => i64, visit_i64;
        deserialize_i16 => i64, visit_i64;
        deserialize_i32 => i64, visit_i64;
        deserialize_i64 => i64, visit_i64;
        deserialize_u8 => u64, visit_u64;
        deserialize_u16 => u64, visit_u64;
        deserialize_u32 => u64, visit_u64;
        deserialize_u64 => u64, visit_u64;
        deserialize_f32 => f64, visit_f64;
        deserialize_f64 => f64, visit_f64;
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            serde_json::Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_enum(name, variants, visitor)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_str(visitor)
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_string(visitor)
    }

    serde::forward_to_deserialize_any! {
        i128 u128 char bytes byte_buf unit unit_struct seq tuple tuple_struct map struct
        identifier ignored_any
    }
}

/// The entries of an object, each value read leniently.
struct LenientMap {
    entries: serde_json::map::IntoIter,
    value: Option<serde_json::Value>,
}

impl<'de> MapAccess<'de> for LenientMap {
    type Error = serde_json::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        match self.entries.next() {
            Some((key, value)) => {
                self.value = Some(value);
                seed.deserialize(serde_json::Value::String(key)).map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<S::Value, Self::Error> {
        let value = self.value.take().unwrap_or(serde_json::Value::Null);
        seed.deserialize(Lenient(value))
    }
}

/// The items of an array, each read leniently.
struct LenientSeq(std::vec::IntoIter<serde_json::Value>);

impl<'de> SeqAccess<'de> for LenientSeq {
    type Error = serde_json::Error;

    fn next_element_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, Self::Error> {
        self.0
            .next()
            .map(|item| seed.deserialize(Lenient(item)))
            .transpose()
    }
}

/// A broker name built from a message: `{topic}` is replaced by the message's topic and
/// `{key}` by its partition key (empty when it has none); everything else is kept as it is.
/// `outbox.{topic}` gives `outbox.orders` for topic `orders`.
///
/// Parsing checks the braces and the placeholder names, so a typo such as `{topc}` is
/// refused at start-up instead of producing odd names at run time. A sink that has no use
/// for `{key}` refuses it with [`Template::refuse_key`].
#[derive(Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(into = "String")]
pub struct Template(String);

impl Template {
    /// The placeholder for the message's topic.
    pub const TOPIC: &'static str = "{topic}";
    /// The placeholder for the message's partition key.
    pub const KEY: &'static str = "{key}";

    /// Parses `text`; the error says which brace or placeholder is wrong.
    pub fn new(text: impl Into<String>) -> Result<Self> {
        let text = text.into();
        let mut rest = text.as_str();
        while let Some(open) = rest.find(['{', '}']) {
            if rest[open..].starts_with('}') {
                return Err(Error::config(format!(
                    "`{text}` has a `}}` without a `{{`; the placeholders are {{topic}} and {{key}}"
                )));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(Error::config(format!(
                    "`{text}` has an unclosed `{{`; the placeholders are {{topic}} and {{key}}"
                )));
            };
            let placeholder = &rest[open..open + close + 1];
            if placeholder != Self::TOPIC && placeholder != Self::KEY {
                return Err(Error::config(format!(
                    "`{text}` uses the unknown placeholder `{placeholder}`; the placeholders are \
                     {{topic}} and {{key}}"
                )));
            }
            rest = &rest[open + close + 1..];
        }
        Ok(Template(text))
    }

    /// The template that gives the topic itself: `{topic}`.
    pub fn topic() -> Self {
        Template(Self::TOPIC.to_string())
    }

    /// The name for a message of `topic` with partition key `key`.
    pub fn render(&self, topic: &str, key: &str) -> String {
        self.0.replace(Self::TOPIC, topic).replace(Self::KEY, key)
    }

    /// Whether the name depends on the topic.
    pub fn uses_topic(&self) -> bool {
        self.0.contains(Self::TOPIC)
    }

    /// Whether the name depends on the partition key.
    pub fn uses_key(&self) -> bool {
        self.0.contains(Self::KEY)
    }

    /// A `Config` error keyed by `key` when the template uses `{key}`, for names that must
    /// not depend on the partition key (streams, topics, subjects: a key per name would
    /// scatter one key's order over many of them).
    pub fn refuse_key(&self, key: &str) -> Result<()> {
        if self.uses_key() {
            return Err(Error::setting(
                key,
                format!(
                    "`{}` uses {{key}}, which this setting does not take; only {{topic}} is replaced",
                    self.0
                ),
            ));
        }
        Ok(())
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> serde::Deserialize<'de> for Template {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Template::new(text).map_err(|error| serde::de::Error::custom(error.message()))
    }
}

impl From<Template> for String {
    fn from(template: Template) -> String {
        template.0
    }
}

impl std::str::FromStr for Template {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        Template::new(text)
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        batch: u64,
        ratio: f64,
        on: bool,
        limit: Option<u32>,
        password: String,
        ports: Vec<u16>,
        properties: BTreeMap<String, String>,
        inner: Inner,
        #[serde(with = "humantime_serde")]
        wait: Duration,
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Inner {
        depth: i32,
    }

    #[test]
    fn text_is_typed_by_the_setting_it_sets() {
        // As environment variables give them: every value text.
        let settings: Sample = from_value(serde_json::json!({
            "batch": "500", "ratio": "0.5", "on": "true", "limit": "7",
            "password": "12345", "ports": ["1", "2"],
            "properties": {"linger.ms": "5", "acks": "all"},
            "inner": {"depth": "-3"}, "wait": "2s",
        }))
        .unwrap();
        assert_eq!(settings.batch, 500);
        assert_eq!(settings.ratio, 0.5);
        assert!(settings.on);
        assert_eq!(settings.limit, Some(7));
        assert_eq!(settings.password, "12345");
        assert_eq!(settings.ports, [1, 2]);
        assert_eq!(settings.properties["linger.ms"], "5");
        assert_eq!(settings.inner, Inner { depth: -3 });
        assert_eq!(settings.wait, Duration::from_secs(2));
        // Typed values read as before.
        let typed: Sample = from_value(serde_json::json!({
            "batch": 500, "ratio": 0.5, "on": true, "limit": null, "password": "p",
            "ports": [], "properties": {}, "inner": {"depth": 1}, "wait": "1s",
        }))
        .unwrap();
        assert_eq!((typed.batch, typed.limit), (500, None));
    }

    #[test]
    fn text_that_is_not_a_number_is_refused_under_its_key() {
        let error = from_value::<Inner>(serde_json::json!({"depth": "deep"})).unwrap_err();
        assert!(error.to_string().contains("depth"), "{error}");
        let error =
            from_value::<Sample>(serde_json::json!({"batch": "1", "extra": 1})).unwrap_err();
        assert!(error.to_string().contains("extra"), "{error}");
    }

    #[test]
    fn a_value_of_the_wrong_type_is_not_echoed_it_may_be_a_secret() {
        // An unquoted numeric password or token in TOML (the security review's case).
        let error =
            from_value::<Sample>(serde_json::json!({"password": 987654321012345_u64})).unwrap_err();
        let text = error.to_string();
        assert!(!text.contains("987654321012345"), "{text}");
        assert!(
            text.contains("password") && text.contains("invalid type: integer, expected a string"),
            "{text}"
        );
        let error =
            from_value::<Sample>(serde_json::json!({"properties": {"sasl.password": 1.25}}))
                .unwrap_err();
        assert!(!error.to_string().contains("1.25"), "{error}");
        assert_eq!(without_value("unknown field `x`"), "unknown field `x`");
    }

    #[test]
    fn renders_topic_and_key() {
        let template = Template::new("shop.{topic}.{key}").unwrap();
        assert_eq!(template.render("orders", "o-1"), "shop.orders.o-1");
        assert!(template.uses_topic() && template.uses_key());
        assert_eq!(Template::topic().render("orders", "k"), "orders");
        assert_eq!(
            Template::new("fixed").unwrap().render("orders", "k"),
            "fixed"
        );
    }

    #[test]
    fn refuses_bad_braces_and_unknown_placeholders() {
        for (text, expected) in [
            ("a.{topc}", "unknown placeholder `{topc}`"),
            ("a.{topic", "unclosed `{`"),
            ("a.topic}", "`}` without a `{`"),
        ] {
            let error = Template::new(text).unwrap_err().to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
        let error = Template::new("s.{key}")
            .unwrap()
            .refuse_key("stream_template");
        assert!(
            error
                .unwrap_err()
                .to_string()
                .contains("stream_template `s.{key}` uses {key}")
        );
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Section {
        #[serde(with = "humantime_serde")]
        timeout: std::time::Duration,
        name: Template,
    }

    #[test]
    fn errors_name_the_key_inside_the_section() {
        let bad = from_value::<Section>(serde_json::json!({ "timeout": "soon", "name": "x" }));
        let error = bad.unwrap_err().in_section("sink");
        assert!(error.message().starts_with("sink.timeout: "), "{error}");
        let bad = from_value::<Section>(serde_json::json!({ "timeout": "1s", "name": "{x}" }));
        let error = bad.unwrap_err().in_section("sink");
        assert!(
            error
                .message()
                .starts_with("sink.name: `{x}` uses the unknown placeholder"),
            "{error}"
        );
        let bad =
            from_value::<Section>(serde_json::json!({ "timeout": "1s", "name": "x", "extra": 1 }));
        let error = bad.unwrap_err().in_section("sink");
        assert!(
            error
                .message()
                .starts_with("sink.extra: unknown field `extra`"),
            "{error}"
        );
    }
}
