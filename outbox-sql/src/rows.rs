//! Decoding what a row holds into the engine's types, where every SQL storage has the same
//! rule. Rows may be written by hand, in SQL, by writers in any language: odd values are
//! passed on rather than dropped or refused.

use std::collections::BTreeMap;

use outbox_core::{Error, ParkedKey, Result};
use serde_json::Value;
use uuid::Uuid;

/// The headers of message `id` from the text of its `headers` column (MySQL, SQLite).
/// Headers are a JSON object of strings: non-string values become their JSON text; JSON
/// `null` and an empty column are no headers; anything else (another JSON value, text that
/// is not JSON) is passed on as it is, in one header named `headers`, with a warning.
pub fn headers_from_json(id: Uuid, text: &str) -> BTreeMap<String, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => object(map),
        Ok(Value::Null) => BTreeMap::new(),
        _ if text.is_empty() => BTreeMap::new(),
        _ => not_an_object(id, text.to_string()),
    }
}

/// The headers of message `id` from its `headers` column read as JSON (PostgreSQL's
/// `jsonb`): the rules of [`headers_from_json`], with another JSON value passed on as its
/// JSON text.
pub fn headers_from_value(id: Uuid, value: Value) -> BTreeMap<String, String> {
    match value {
        Value::Object(map) => object(map),
        Value::Null => BTreeMap::new(),
        other => not_an_object(id, other.to_string()),
    }
}

/// A parked key from its two columns as MySQL and SQLite store them: the key's bytes (a
/// key that is not valid UTF-8 is listed, lossily) and the dead letter's id as text. An id
/// that is not a UUID is a `Permanent` error naming the key; `storage` prefixes it.
pub fn parked_key(storage: &str, key: &[u8], id: &str) -> Result<ParkedKey> {
    let key = String::from_utf8_lossy(key).into_owned();
    let dead_letter = Uuid::parse_str(id).map_err(|e| {
        Error::permanent(format!(
            "{storage}: parked key `{key}` names the dead letter `{id}`, which is not a UUID: {e}"
        ))
    })?;
    Ok(ParkedKey { key, dead_letter })
}

fn object(map: serde_json::Map<String, Value>) -> BTreeMap<String, String> {
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect()
}

fn not_an_object(id: Uuid, text: String) -> BTreeMap<String, String> {
    tracing::warn!(%id, "headers column is not a JSON object; passing it on as `headers`");
    BTreeMap::from([("headers".to_string(), text)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn headers_survive_odd_json_text() {
        let id = Uuid::now_v7();
        assert_eq!(
            headers_from_json(id, r#"{"a": "b", "n": 1, "o": {"x": true}}"#),
            map(&[("a", "b"), ("n", "1"), ("o", r#"{"x":true}"#)])
        );
        assert!(headers_from_json(id, "null").is_empty());
        assert!(headers_from_json(id, "").is_empty());
        assert!(headers_from_json(id, "{}").is_empty());
        assert_eq!(
            headers_from_json(id, "[1, 2]"),
            map(&[("headers", "[1, 2]")])
        );
        assert_eq!(
            headers_from_json(id, "not json"),
            map(&[("headers", "not json")])
        );
    }

    #[test]
    fn parked_keys_need_a_dead_letter_uuid() {
        let id = Uuid::now_v7();
        let parked = parked_key("mysql", b"k-\xff", &id.to_string()).unwrap();
        assert_eq!(
            (parked.key.as_str(), parked.dead_letter),
            ("k-\u{fffd}", id)
        );
        let err = parked_key("sqlite", b"k", "nope").unwrap_err();
        assert_eq!(err.kind(), outbox_core::ErrorKind::Permanent);
        assert!(
            err.message().starts_with(
                "sqlite: parked key `k` names the dead letter `nope`, which is not a UUID: "
            ),
            "{err}"
        );
    }

    #[test]
    fn headers_survive_odd_json_values() {
        let id = Uuid::now_v7();
        assert_eq!(
            headers_from_value(id, serde_json::json!({"a": "b", "n": 1})),
            map(&[("a", "b"), ("n", "1")])
        );
        assert!(headers_from_value(id, Value::Null).is_empty());
        assert_eq!(
            headers_from_value(id, serde_json::json!([1, 2])),
            map(&[("headers", "[1,2]")])
        );
        assert_eq!(
            headers_from_value(id, serde_json::json!("text")),
            map(&[("headers", r#""text""#)])
        );
    }
}
