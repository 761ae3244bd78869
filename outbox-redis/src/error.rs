//! Mapping Redis client errors onto the engine's error kinds.

use deadpool_redis::PoolError;
use deadpool_redis::redis::{ErrorKind as RedisKind, RedisError, ServerErrorKind};
use outbox_core::{Error, ErrorKind};

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
            "redis: {context}: no connection within sink.command_timeout"
        )),
        other => Error::unavailable(format!("redis: {context}")).with_source(other),
    }
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
