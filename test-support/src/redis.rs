//! Redis: a connection for the tests' own checks, stream readers, and the names of the
//! commands in a [`Proxy`](crate::Proxy) recording.

use std::collections::BTreeMap;
use std::time::Duration;

pub use redis::aio::MultiplexedConnection;
use redis::{AsyncCommands, Value};

use crate::Service;

/// One stream entry: its id and its fields.
pub type Entry = (String, BTreeMap<String, Vec<u8>>);

/// Redis for tests: `$OUTBOX_TEST_REDIS_URL`, or the local server.
pub fn url() -> String {
    Service::Redis.url()
}

/// A connection for the test's own checks (replies within 30 s); panics naming the server
/// when it does not answer within 5 s.
pub async fn client() -> MultiplexedConnection {
    let url = url();
    let connect = async {
        redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection_with_config(
                &redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(Duration::from_secs(30))),
            )
            .await
    };
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(e)) => Service::Redis.missing(e),
        Err(_) => Service::Redis.missing("no answer within 5 s"),
    }
}

/// Every entry of `stream`, oldest first.
pub async fn xrange(stream: &str) -> Vec<Entry> {
    let reply: Value = client().await.xrange_all(stream).await.expect("XRANGE");
    let Value::Array(entries) = reply else {
        panic!("XRANGE reply {reply:?}")
    };
    entries
        .into_iter()
        .map(|entry| {
            let Value::Array(mut parts) = entry else {
                panic!("entry {entry:?}")
            };
            let (Some(Value::Array(flat)), Some(id)) = (parts.pop(), parts.pop()) else {
                panic!("entry parts")
            };
            let id: String = redis::from_redis_value(id).expect("entry id");
            let fields = flat
                .chunks(2)
                .map(|pair| {
                    let name: String =
                        redis::from_redis_value(pair[0].clone()).expect("field name");
                    let value: Vec<u8> =
                        redis::from_redis_value(pair[1].clone()).expect("field value");
                    (name, value)
                })
                .collect();
            (id, fields)
        })
        .collect()
}

/// The number of entries of `stream`.
pub async fn xlen(stream: &str) -> usize {
    client().await.xlen(stream).await.expect("XLEN")
}

/// A field of an entry as text; panics naming it when it is missing or not UTF-8.
pub fn text(fields: &BTreeMap<String, Vec<u8>>, name: &str) -> String {
    let value = fields
        .get(name)
        .unwrap_or_else(|| panic!("entry has no field `{name}`: {fields:?}"));
    String::from_utf8(value.clone()).unwrap_or_else(|_| panic!("field `{name}` is not text"))
}

/// Deletes every key that starts with `prefix`; panics naming the server when it cannot.
pub async fn delete_prefixed(prefix: &str) {
    if let Err(error) = remove_prefixed(prefix).await {
        panic!("{error}");
    }
}

/// Deletes every key that starts with `prefix` (what a run under that prefix left: its
/// streams), saying what failed.
pub async fn remove_prefixed(prefix: &str) -> Result<(), String> {
    let failed = |e: &dyn std::fmt::Display| {
        let server = outbox_core::redact_url(&url());
        format!("deleting the keys {prefix}* on Redis at {server}: {e}")
    };
    let client = redis::Client::open(url().as_str()).map_err(|e| failed(&e))?;
    let connect = client.get_multiplexed_async_connection();
    let mut con = tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| failed(&"no answer within 5 s"))?
        .map_err(|e| failed(&e))?;
    let keys: Vec<String> = con
        .keys(format!("{prefix}*"))
        .await
        .map_err(|e| failed(&e))?;
    if !keys.is_empty() {
        let _: () = con.del(keys).await.map_err(|e| failed(&e))?;
    }
    Ok(())
}

/// The names of the complete commands in what a client sent (RESP arrays), upper-cased, in
/// order; panics on anything other than RESP arrays.
pub fn commands(sent: &[u8]) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = sent;
    while let Some((name, used)) = command(rest) {
        names.push(name);
        rest = &rest[used..];
    }
    names
}

/// One complete `*N\r\n$len\r\n...` command at the start of `buf`: its name and length.
fn command(buf: &[u8]) -> Option<(String, usize)> {
    fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let end = buf.get(at..)?.windows(2).position(|w| w == b"\r\n")? + at;
        Some((&buf[at..end], end + 2))
    }
    let (head, mut at) = line(buf, 0)?;
    assert_eq!(
        head.first(),
        Some(&b'*'),
        "client sent something other than a RESP array"
    );
    let count: usize = std::str::from_utf8(&head[1..]).ok()?.parse().ok()?;
    let mut name = None;
    for _ in 0..count {
        let (len_line, next) = line(buf, at)?;
        let len: usize = std::str::from_utf8(&len_line[1..]).ok()?.parse().ok()?;
        if buf.len() < next + len + 2 {
            return None;
        }
        name.get_or_insert_with(|| String::from_utf8_lossy(&buf[next..next + len]).to_uppercase());
        at = next + len + 2;
    }
    Some((name.unwrap_or_default(), at))
}

#[cfg(test)]
mod tests {
    use super::commands;

    #[test]
    fn command_names_of_complete_commands() {
        let sent = b"*2\r\n$4\r\nping\r\n$1\r\nx\r\n*3\r\n$4\r\nXADD\r\n$1\r\ns\r\n$1\r\n*\r\n*1\r\n$4\r\nPI";
        assert_eq!(commands(sent), ["PING", "XADD"]);
        assert!(commands(b"").is_empty());
    }
}
