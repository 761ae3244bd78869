//! Mapping database errors onto the engine's error kinds.

use outbox_core::{Error, ErrorKind};

/// A refused login (SQLSTATE class 28): a role that does not exist or may not log in, a
/// wrong password, no `pg_hba.conf` line for this client, a missing client certificate.
const LOGIN: &str = " (the server refused the login; not retryable: check the user and password \
                     in `url`, that the role exists and has LOGIN, and the TLS client \
                     certificate that pg_hba.conf asks for)";

/// The database of the URL does not exist (SQLSTATE 3D000).
const NO_DATABASE: &str = " (the database named in `url` does not exist on the server; not \
                           retryable: create it (CREATE DATABASE) or fix the database in `url`)";

/// A missing privilege (SQLSTATE 42501) of a relay, an operator's command or an enqueue.
const GRANTS: &str = " (the role lacks a privilege on the outbox tables; not retryable until it \
                      is granted: GRANT USAGE ON SCHEMA <schema> TO <role>; GRANT SELECT, \
                      INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA <schema> TO <role>; GRANT \
                      USAGE, SELECT ON ALL SEQUENCES IN SCHEMA <schema> TO <role>)";

/// A missing privilege (SQLSTATE 42501) of a migration.
const MIGRATION_GRANTS: &str = " (the role may not create the outbox schema or its tables; not \
                                retryable: migrations need CREATE on the database (for a new \
                                schema) or ownership of the schema; run `outbox migrate` as such \
                                a role, or have a DBA apply `outbox migrate --print-sql`)";

/// Bad SQL or another access rule (SQLSTATE class 42 but 42501 and the missing objects).
const ACCESS_RULE: &str = " (not retryable: check the role's grants on the outbox tables)";

/// The tables are missing or older than this release.
const MIGRATE: &str = ": the outbox tables are missing or older than this release; run `outbox \
                       migrate` (or apply the SQL of `outbox migrate --print-sql`)";

/// Classifies a sqlx error: lost connections, time-outs and server shutdowns are
/// `Unavailable`; missing tables, columns or functions are `Schema` (run `outbox migrate`);
/// refused logins, a database that does not exist and missing grants are `Config` (the
/// message says what to fix; trying again does not help); bad data is `Permanent`; anything
/// else `Temporary`. `context` says what failed (`claim failed`, `migration failed`, …).
pub(crate) fn db_error(context: &str, error: sqlx::Error) -> Error {
    let migrating = context.contains("migration");
    let (kind, hint) = match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => (ErrorKind::Unavailable, ""),
        sqlx::Error::Configuration(_) => (ErrorKind::Config, ""),
        sqlx::Error::Database(db) => classify(db.code().as_deref().unwrap_or(""), migrating),
        _ => (ErrorKind::Temporary, ""),
    };
    Error::new(kind, format!("postgres: {context}{hint}")).with_source(error)
}

/// The kind and the hint for a SQLSTATE.
fn classify(code: &str, migrating: bool) -> (ErrorKind, &'static str) {
    match code {
        // connection exception, insufficient resources, operator intervention
        code if code.starts_with("08") || code.starts_with("53") || code.starts_with("57") => {
            (ErrorKind::Unavailable, "")
        }
        // serialization failure, deadlock
        "40001" | "40P01" => (ErrorKind::Temporary, ""),
        // invalid authorization: no such role, wrong password, no pg_hba.conf entry, no
        // client certificate
        code if code.starts_with("28") => (ErrorKind::Config, LOGIN),
        // invalid catalog name: the database does not exist
        "3D000" => (ErrorKind::Config, NO_DATABASE),
        // undefined table, column, function, schema: not migrated, or by an older release
        "42P01" | "42703" | "42883" | "3F000" => (ErrorKind::Schema, MIGRATE),
        // insufficient privilege
        "42501" if migrating => (ErrorKind::Config, MIGRATION_GRANTS),
        "42501" => (ErrorKind::Config, GRANTS),
        // another syntax error or access rule violation
        code if code.starts_with("42") => (ErrorKind::Config, ACCESS_RULE),
        // data exception, integrity constraint violation
        code if code.starts_with("22") || code.starts_with("23") => (ErrorKind::Permanent, ""),
        _ => (ErrorKind::Temporary, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_map_to_kinds_with_what_to_do() {
        for (code, migrating, kind, says) in [
            ("08006", false, ErrorKind::Unavailable, ""),
            ("57P01", false, ErrorKind::Unavailable, ""),
            ("40001", false, ErrorKind::Temporary, ""),
            (
                "28000",
                false,
                ErrorKind::Config,
                "the role exists and has LOGIN",
            ),
            (
                "28P01",
                false,
                ErrorKind::Config,
                "user and password in `url`",
            ),
            ("3D000", false, ErrorKind::Config, "CREATE DATABASE"),
            ("42P01", false, ErrorKind::Schema, "run `outbox migrate`"),
            ("3F000", false, ErrorKind::Schema, "run `outbox migrate`"),
            ("42501", false, ErrorKind::Config, "GRANT USAGE ON SCHEMA"),
            ("42501", true, ErrorKind::Config, "CREATE on the database"),
            ("42601", false, ErrorKind::Config, "grants"),
            ("23505", false, ErrorKind::Permanent, ""),
            ("XX000", false, ErrorKind::Temporary, ""),
        ] {
            let (got, hint) = classify(code, migrating);
            assert_eq!(got, kind, "{code}");
            assert!(hint.contains(says), "{code}: {hint}");
            if kind == ErrorKind::Config {
                assert!(hint.contains("not retryable"), "{code}: {hint}");
            }
        }
    }
}
