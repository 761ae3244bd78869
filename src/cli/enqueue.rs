//! `outbox enqueue --stdin`: one message per JSON line,
//! `{"topic": "t", "key": "k", "payload": …, "headers": {"h": "v"}, "traceparent": …}`, where a
//! string payload is sent as its UTF-8 bytes, any other JSON value as JSON (content-type
//! application/json) exactly as the line writes it, and `payload_base64` gives raw bytes.

use base64::Engine;

use crate::{NewMessage, TraceContext};

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    topic: String,
    key: Option<String>,
    payload: Option<serde_json::Value>,
    payload_base64: Option<String>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    /// W3C trace context of the writer, carried to the consumer.
    traceparent: Option<String>,
    tracestate: Option<String>,
}

/// The message of line `number` of standard input, `text`; the error starts with
/// `standard input line <number>: ` and says what is wrong.
pub fn message_from_line(number: usize, text: &str) -> Result<NewMessage, String> {
    let bad = |why: String| format!("standard input line {number}: {why}");
    let line: Line = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    let mut message = match (line.payload, line.payload_base64) {
        (Some(_), Some(_)) => return Err(bad("give payload or payload_base64, not both".into())),
        (Some(serde_json::Value::String(s)), None) => NewMessage::new(line.topic, s.into_bytes()),
        // The line's own text of the value: written again from `serde_json::Value`, a number
        // changed (past 64 bits it became a float, and a float may be read one bit off, so
        // `-1.0000000001999999e43` became `-1.0000000002e43`; found by the fuzz target).
        (Some(value), None) => match raw_value(text, "payload") {
            Some(raw) => NewMessage::new(line.topic, raw.as_bytes().to_vec())
                .header("content-type", "application/json"),
            None => NewMessage::json(line.topic, &value).map_err(|e| bad(e.to_string()))?,
        },
        (None, Some(b64)) => NewMessage::new(
            line.topic,
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| bad(format!("payload_base64: {e}")))?,
        ),
        (None, None) => NewMessage::new(line.topic, Vec::new()),
    };
    if message.topic.is_empty() {
        return Err(bad("topic is empty".into()));
    }
    message.key = line.key;
    message.headers.extend(line.headers);
    match (line.traceparent, line.tracestate) {
        (Some(traceparent), tracestate) => {
            message.trace_context = Some(TraceContext {
                traceparent,
                tracestate,
            })
        }
        (None, Some(_)) => return Err(bad("tracestate without traceparent".into())),
        (None, None) => {}
    }
    Ok(message)
}

/// The text of the value of key `wanted` in `object`, a JSON object that has been read (so
/// it is well formed and names each field once); `None` if it has no such key.
fn raw_value<'a>(object: &'a str, wanted: &str) -> Option<&'a str> {
    let bytes = object.as_bytes();
    let mut at = skip_space(bytes, 0);
    if bytes.get(at) != Some(&b'{') {
        return None;
    }
    at += 1;
    loop {
        at = skip_space(bytes, at);
        match bytes.get(at)? {
            b'}' => return None,
            b',' => {
                at += 1;
                continue;
            }
            _ => {}
        }
        let key_end = string_end(bytes, at)?;
        let key: String = serde_json::from_str(&object[at..key_end]).ok()?;
        at = skip_space(bytes, key_end);
        if bytes.get(at) != Some(&b':') {
            return None;
        }
        at = skip_space(bytes, at + 1);
        let end = value_end(bytes, at)?;
        if key == wanted {
            return Some(&object[at..end]);
        }
        at = end;
    }
}

/// The first byte at or after `at` that is not JSON white space.
fn skip_space(bytes: &[u8], mut at: usize) -> usize {
    while matches!(bytes.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// Where the JSON string starting at `at` ends (after its closing quote).
fn string_end(bytes: &[u8], at: usize) -> Option<usize> {
    if bytes.get(at) != Some(&b'"') {
        return None;
    }
    let mut i = at + 1;
    loop {
        match bytes.get(i)? {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
}

/// Where the JSON value starting at `at` ends.
fn value_end(bytes: &[u8], at: usize) -> Option<usize> {
    match bytes.get(at)? {
        b'"' => string_end(bytes, at),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = at;
            loop {
                match bytes.get(i)? {
                    b'"' => {
                        i = string_end(bytes, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            let mut i = at;
            while !matches!(
                bytes.get(i),
                None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            ) {
                i += 1;
            }
            Some(i)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_become_messages() {
        let m = message_from_line(
            1,
            r#"{"topic":"t","key":"k","payload":{"a":1},"headers":{"h":"v"}}"#,
        )
        .unwrap();
        assert_eq!(
            (m.topic.as_str(), m.key.as_deref(), m.payload.as_slice()),
            ("t", Some("k"), br#"{"a":1}"#.as_slice())
        );
        assert_eq!(m.headers["h"], "v");
        assert_eq!(m.headers["content-type"], "application/json");
        let m = message_from_line(2, r#"{"topic":"t","payload_base64":"AP8="}"#).unwrap();
        assert_eq!(m.payload, vec![0, 255]);
        let e = message_from_line(7, r#"{"topic":"t","paylod":"x"}"#).unwrap_err();
        assert!(e.contains("line 7") && e.contains("paylod"), "{e}");
    }

    /// A JSON payload is the line's own text: written again from a `serde_json::Value`, its
    /// numbers changed (found by the fuzz target,
    /// fuzz/corpus/enqueue_line/ok-found-numbers-kept.jsonl).
    #[test]
    fn a_json_payload_is_sent_as_the_line_writes_it() {
        let payload =
            r#"{"n": 123456789012345678901234567890, "f": -1.0000000001999999e+43, "s": "a\"}"}"#;
        for line in [
            [r#"{"topic":"t","payload": "#, payload, " }"].concat(),
            // Keys around it, white space, an escaped key, braces inside strings.
            [
                r#" { "topic":"t", "key" : "k" , "pay\u006coad":"#,
                payload,
                r#","headers":{"a":"}"} }"#,
            ]
            .concat(),
        ] {
            let m = message_from_line(1, &line).unwrap();
            assert_eq!(String::from_utf8(m.payload).unwrap(), payload, "{line}");
            assert_eq!(m.headers["content-type"], "application/json");
        }
        for (value, sent) in [
            ("[1, [2, {}]]", "[1, [2, {}]]"),
            ("-0.0", "-0.0"),
            ("true", "true"),
        ] {
            let m = message_from_line(1, &format!(r#"{{"payload":{value},"topic":"t"}}"#)).unwrap();
            assert_eq!(m.payload, sent.as_bytes());
        }
    }
}
