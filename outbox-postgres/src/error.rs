//! Mapping database errors onto the engine's error kinds.

use outbox_core::{Error, ErrorKind};

/// Classifies a sqlx error: lost connections, time-outs and server shutdowns are
/// `Unavailable`; missing tables or grants are `Config` (run `migrate`, check grants);
/// bad data is `Permanent`; anything else `Temporary`.
pub(crate) fn db_error(context: &str, error: sqlx::Error) -> Error {
    let kind = match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => ErrorKind::Unavailable,
        sqlx::Error::Configuration(_) => ErrorKind::Config,
        sqlx::Error::Database(db) => match db.code().as_deref().unwrap_or("") {
            // connection exception, insufficient resources, operator intervention,
            // serialization failure, deadlock
            code if code.starts_with("08") || code.starts_with("53") || code.starts_with("57") => {
                ErrorKind::Unavailable
            }
            "40001" | "40P01" => ErrorKind::Temporary,
            // syntax error or access rule violation: missing table, missing grant
            code if code.starts_with("42") => ErrorKind::Config,
            // data exception, integrity constraint violation
            code if code.starts_with("22") || code.starts_with("23") => ErrorKind::Permanent,
            _ => ErrorKind::Temporary,
        },
        _ => ErrorKind::Temporary,
    };
    let hint = if kind == ErrorKind::Config {
        " (are the outbox tables migrated, and does the role have its grants?)"
    } else {
        ""
    };
    Error::new(kind, format!("postgres: {context}{hint}")).with_source(error)
}
