//! What every backend's configuration shares: one struct serves the relay's file and the
//! Rust API (deserialised with [`from_value`], so a bad value is reported under the key the
//! user wrote), and the [`Template`] that turns a message's topic into a broker name.

use std::fmt;

use serde::de::DeserializeOwned;

use crate::{Error, Result};

/// Deserialises a configuration section (the relay's TOML table, handed over as JSON) into
/// `T`. An error is a `Config` error keyed by the path of the bad setting inside the
/// section (for example `backoff.max`), so the caller only adds the section with
/// [`Error::in_section`].
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(value).map_err(|error| {
        let path = error.path().to_string();
        let problem = error.into_inner().to_string();
        if path == "." {
            Error::config(problem)
        } else {
            Error::setting(format!("{path}:"), problem)
        }
    })
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
    use super::*;

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
