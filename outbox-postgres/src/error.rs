//! Mapping database errors onto the engine's error kinds.

use outbox_core::{Error, ErrorKind};

/// Classifies a sqlx error: lost connections, time-outs and server shutdowns are
/// `Unavailable`; missing tables, columns or functions are `Schema` (run `outbox migrate`);
/// refused logins and missing grants are `Config`;
/// bad data is `Permanent`; anything else `Temporary`.
pub(crate) fn db_error(context: &str, error: sqlx::Error) -> Error {
    const LOGIN: &str = " (the server refused the login: check the user and password in `url` \
                         and the TLS client certificate that pg_hba.conf asks for)";
    const GRANTS: &str = " (does the role have its grants on the outbox tables?)";
    const MIGRATE: &str = ": the outbox tables are missing or older than this release; run \
                           `outbox migrate` (or apply the SQL of `outbox migrate --print-sql`)";
    let (kind, hint) = match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => (ErrorKind::Unavailable, ""),
        sqlx::Error::Configuration(_) => (ErrorKind::Config, ""),
        sqlx::Error::Database(db) => match db.code().as_deref().unwrap_or("") {
            // connection exception, insufficient resources, operator intervention
            code if code.starts_with("08") || code.starts_with("53") || code.starts_with("57") => {
                (ErrorKind::Unavailable, "")
            }
            // serialization failure, deadlock
            "40001" | "40P01" => (ErrorKind::Temporary, ""),
            // invalid authorization: wrong password, no pg_hba.conf entry, no client certificate
            code if code.starts_with("28") => (ErrorKind::Config, LOGIN),
            // undefined table, column, function: not migrated, or by an older release
            "42P01" | "42703" | "42883" => (ErrorKind::Schema, MIGRATE),
            // syntax error or access rule violation: a missing grant
            code if code.starts_with("42") => (ErrorKind::Config, GRANTS),
            // data exception, integrity constraint violation
            code if code.starts_with("22") || code.starts_with("23") => (ErrorKind::Permanent, ""),
            _ => (ErrorKind::Temporary, ""),
        },
        _ => (ErrorKind::Temporary, ""),
    };
    Error::new(kind, format!("postgres: {context}{hint}")).with_source(error)
}
