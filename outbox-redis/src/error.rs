//! Every failure of the Redis sink, mapped onto the engine's [`ErrorKind`]s.
//!
//! In short: what says nothing about the message (the connection, a time-out, a server-wide
//! refusal such as `READONLY`, `OOM` or bad credentials) is `Unavailable`, so the worker
//! charges no attempt; a message that can never be appended as it is (`WRONGTYPE`, a topic
//! missing from the stream map, a payload over `max_payload`) is `Permanent`; any other
//! error reply is `Temporary`; a URL the client cannot use is `Config`.

use std::time::Duration;

use deadpool_redis::PoolError;
use deadpool_redis::redis::{ErrorKind as RedisKind, RedisError, ServerErrorKind};
use outbox_core::{Error, ErrorKind, redact_url};

/// Whether a Redis error is about the connection or the server as a whole (`Unavailable`:
/// nothing is wrong with the message), about this message for good (`Permanent`), or may
/// pass on a later try (`Temporary`).
pub(crate) fn kind_of(error: &RedisError) -> ErrorKind {
    match error.kind() {
        RedisKind::Io
        | RedisKind::AuthenticationFailed
        | RedisKind::InvalidClientConfig
        | RedisKind::RESP3NotSupported
        | RedisKind::ClusterConnectionNotFound => ErrorKind::Unavailable,
        RedisKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask
            // An ACL that forbids the command or the stream: fix the user's rights, and the
            // waiting messages go out then.
            | ServerErrorKind::NoPerm,
        ) => ErrorKind::Unavailable,
        _ if error.is_timeout() || error.is_connection_dropped() || error.is_io_error() => {
            ErrorKind::Unavailable
        }
        _ => match error.code() {
            // The stream key holds another type: this message can never be appended there.
            Some("WRONGTYPE") => ErrorKind::Permanent,
            // Server-wide refusals: out of memory, a busy script, failing persistence, too few
            // replicas, missing authentication.
            Some("OOM" | "BUSY" | "MISCONF" | "NOREPLICAS" | "NOAUTH" | "WRONGPASS") => {
                ErrorKind::Unavailable
            }
            _ => ErrorKind::Temporary,
        },
    }
}

/// A Redis error as an engine error of the right kind, saying what was being done.
pub(crate) fn redis_error(context: &str, error: RedisError) -> Error {
    Error::new(kind_of(&error), format!("redis: {context}{}", hint(&error))).with_source(error)
}

/// A failure to get a connection from the pool: always `Unavailable`, since nothing that
/// stops a connection from opening says anything about the messages.
pub(crate) fn pool_error(context: &str, error: PoolError) -> Error {
    match error {
        PoolError::Backend(error) => {
            Error::unavailable(format!("redis: {context}{}", hint(&error))).with_source(error)
        }
        PoolError::Timeout(_) => Error::unavailable(format!(
            "redis: {context}: no connection within sink.publish_timeout"
        )),
        other => Error::unavailable(format!("redis: {context}")).with_source(other),
    }
}

/// No answer from the server at `url` within `timeout` while doing `what`: `Unavailable`.
pub(crate) fn timed_out(what: &str, url: &str, timeout: Duration) -> Error {
    Error::unavailable(format!(
        "redis: {what}: no answer from {} within sink.publish_timeout ({timeout:?})",
        redact_url(url)
    ))
}

/// A `PING` that got an error reply: the server is not usable, whatever the error.
pub(crate) fn ping_error(error: RedisError) -> Error {
    Error::unavailable(redis_error("PING", error).to_string())
}

/// A `PING` that got no reply at all: `Unavailable`.
pub(crate) fn no_ping_reply() -> Error {
    Error::unavailable("redis: PING got no reply")
}

/// A pipeline that came back without a reply for this message: `Temporary` (it should not
/// happen; the message is tried again).
pub(crate) fn no_reply(message: impl std::fmt::Display) -> Error {
    Error::temporary(format!(
        "redis: no reply for message {message} in the pipeline"
    ))
}

/// A message not tried because an earlier message of its key in the same batch failed:
/// `Unavailable` (the worker puts it back uncharged), so that it does not land before the
/// earlier one.
pub(crate) fn behind_failure(message: impl std::fmt::Display, key: &str) -> Error {
    Error::unavailable(format!(
        "redis: message {message} not appended: an earlier message of key `{key}` in the batch failed"
    ))
}

/// A topic the stream map does not name: `Permanent`, until the map names it and the
/// message is replayed.
pub(crate) fn unmapped_topic(topic: &str) -> Error {
    Error::permanent(format!(
        "redis: topic `{topic}` has no stream in sink.streams; add it and replay the message"
    ))
}

/// A payload over `max_payload`: `Permanent`, it is not sent.
pub(crate) fn too_large(size: usize, max_payload: usize) -> Error {
    Error::permanent(format!(
        "redis: payload of {size} bytes is larger than sink.max_payload ({max_payload} bytes)"
    ))
}

/// A URL the client refuses when the sink is made: `Config`, keyed `url`.
pub(crate) fn bad_url(url: &str, error: RedisError) -> Error {
    Error::setting(
        "url",
        format!(
            "`{}` cannot be used: {}",
            redact_url(url),
            error.detail().unwrap_or(error.category())
        ),
    )
}

/// The connection pool could not be built: `Config`.
pub(crate) fn pool_not_built(error: impl std::fmt::Display) -> Error {
    Error::config(format!("redis: cannot build the connection pool: {error}"))
}

fn hint(error: &RedisError) -> &'static str {
    match error.code() {
        Some("NOAUTH" | "WRONGPASS") => " (check the user and password in sink.url)",
        Some("NOPERM") => " (the Redis user lacks a permission: check its ACL)",
        _ if error.kind() == RedisKind::AuthenticationFailed => {
            " (check the user and password in sink.url)"
        }
        _ => "",
    }
}
