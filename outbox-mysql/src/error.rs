//! Mapping MySQL and MariaDB errors onto the engine's error kinds.

use outbox_core::{Error, ErrorKind};
use sqlx::mysql::MySqlDatabaseError;

/// What is wrong, by the server's error number
/// (<https://dev.mysql.com/doc/mysql-errors/8.0/en/server-error-reference.html>, the same
/// numbers on MariaDB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The server is down, unreachable, shutting down, out of connections; a pool time-out.
    Unreachable,
    /// A row lock held by another transaction past `innodb_lock_wait_timeout`.
    LockWait,
    /// Deadlock: the server rolled the transaction back.
    Deadlock,
    /// Wrong user or password (1045), or no access to the database (1044).
    Credentials,
    /// The database does not exist (1049).
    UnknownDatabase,
    /// A missing table or column: not migrated, or by an older release.
    Schema,
    /// A missing grant on a table or command.
    Grants,
    /// A row breaks a constraint or a limit: bad data.
    Data,
    /// The client's settings (URL, TLS) are wrong.
    Setup,
    /// The server takes only TLS connections (`require_secure_transport`) and this one has
    /// none: MySQL 3159, MariaDB 4036.
    TlsRequired,
    /// Anything else, worth trying again.
    Other,
}

/// The cause of a server error number.
pub(crate) fn cause_of_number(number: u16) -> Cause {
    match number {
        // ER_CON_COUNT_ERROR, ER_SERVER_SHUTDOWN, ER_NORMAL_SHUTDOWN, query interrupted,
        // ER_TOO_MANY_USER_CONNECTIONS, read-only server (failover), out of resources
        1040 | 1053 | 1077 | 1317 | 1203 | 1290 | 1836 | 1041 | 1037 | 1038 => Cause::Unreachable,
        1205 => Cause::LockWait,
        1213 => Cause::Deadlock,
        1044 | 1045 | 1698 | 1251 | 1862 | 1820 => Cause::Credentials,
        1049 => Cause::UnknownDatabase,
        3159 | 4036 => Cause::TlsRequired,
        // no such table, unknown column, unknown table in a multi-table delete
        1146 | 1054 | 1109 => Cause::Schema,
        // command, column or privilege denied
        1142 | 1143 | 1227 => Cause::Grants,
        // duplicate key, column cannot be null, data too long, out of range, bad value,
        // CHECK constraint (MySQL 3819, MariaDB 4025), packet too large
        1062 | 1048 | 1406 | 1264 | 1366 | 1292 | 1265 | 3819 | 4025 | 3140 | 1153 | 1301 => {
            Cause::Data
        }
        _ => Cause::Other,
    }
}

/// The cause of a sqlx error.
pub(crate) fn cause(error: &sqlx::Error) -> Cause {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => Cause::Unreachable,
        sqlx::Error::Tls(_) | sqlx::Error::Configuration(_) => Cause::Setup,
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map_or(Cause::Other, |e| cause_of_number(e.number())),
        _ => Cause::Other,
    }
}

/// Where the storage connects, for errors that are the configuration's fault.
#[derive(Debug, Clone)]
pub(crate) struct Origin {
    /// The URL with its password hidden.
    pub(crate) url: String,
    /// The database the tables are in, and the setting that named it (`url` or `database`).
    pub(crate) database: String,
    pub(crate) database_key: &'static str,
}

/// Classifies a sqlx error: an unreachable server, a pool time-out or a lock held too long
/// are `Unavailable` (the worker backs off and retries, charging nothing); wrong credentials,
/// a missing database, missing grants, a server that requires TLS are `Config` (with what to fix, keyed by the
/// setting when `origin` is known); bad data is `Permanent`; deadlocks and anything else
/// `Temporary`. Passwords never appear: only `origin.url`, redacted, is quoted.
pub(crate) fn db_error(origin: Option<&Origin>, context: &str, error: sqlx::Error) -> Error {
    let classified = match cause(&error) {
        Cause::Unreachable => Error::unavailable(format!("mysql: {context}")),
        Cause::LockWait => Error::unavailable(format!(
            "mysql: {context}: a row lock was held past innodb_lock_wait_timeout (keep \
             application transactions that touch the outbox short)"
        )),
        Cause::Deadlock => Error::temporary(format!("mysql: {context}: deadlock, rolled back")),
        Cause::Credentials => match origin {
            Some(o) => Error::setting(
                "url",
                format!(
                    "`{}`: the server refused the user or password, or the user may not use \
                     database `{}`, or needs TLS or a client certificate (tls_ca_file, \
                     tls_cert_file); not retryable: fix the user and password in the url, or \
                     GRANT the user SELECT, INSERT, UPDATE, DELETE ON `{}`.* (mysql: {context})",
                    o.url, o.database, o.database
                ),
            ),
            None => Error::config(format!(
                "mysql: {context}: access denied (not retryable: check the user, its password \
                 and its grants on the database)"
            )),
        },
        Cause::UnknownDatabase => match origin {
            Some(o) => Error::setting(
                o.database_key,
                format!(
                    "names database `{}`, which does not exist on the server; create it \
                     (CREATE DATABASE {}) or fix the setting (mysql: {context})",
                    o.database, o.database
                ),
            ),
            None => Error::config(format!("mysql: {context}: unknown database")),
        },
        Cause::Schema => Error::schema(format!(
            "mysql: {context}: the outbox tables are missing or older than this release; run \
             `outbox migrate` (or apply the SQL of `outbox migrate --print-sql`)"
        )),
        Cause::Grants => {
            let database = origin.map_or("<database>", |o| o.database.as_str());
            let on = match origin {
                Some(o) => format!(" in database `{}`", o.database),
                None => String::new(),
            };
            let grant = format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.* TO the user, then \
                 restart the relay (the server gives a database grant to new sessions only)"
            );
            Error::config(if context.contains("migration") {
                format!(
                    "mysql: {context}: the user lacks a privilege on the outbox tables{on}; not \
                     retryable: migrations need CREATE and INDEX besides SELECT, INSERT, UPDATE, \
                     DELETE (GRANT CREATE, INDEX, SELECT, INSERT, UPDATE, DELETE ON \
                     `{database}`.*), or have a DBA apply `outbox migrate --print-sql`"
                )
            } else {
                format!(
                    "mysql: {context}: the user lacks a privilege on the outbox tables{on}; not \
                     retryable until it is granted: {grant}"
                )
            })
        }
        Cause::Data => Error::new(ErrorKind::Permanent, format!("mysql: {context}")),
        Cause::Setup => match origin {
            Some(o) => Error::setting(
                "url",
                format!("`{}` cannot be used (mysql: {context})", o.url),
            ),
            None => Error::config(format!("mysql: {context}")),
        },
        Cause::TlsRequired => match origin {
            Some(o) => Error::setting(
                "url",
                format!(
                    "`{}`: the server accepts only TLS connections; set tls_ca_file (or write \
                     ssl-mode=VERIFY_IDENTITY in the url) (mysql: {context})",
                    o.url
                ),
            ),
            None => Error::config(format!("mysql: {context}: the server requires TLS")),
        },
        Cause::Other => Error::temporary(format!("mysql: {context}")),
    };
    classified.with_source(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_map_to_causes() {
        for (number, expected) in [
            (1040, Cause::Unreachable),
            (1053, Cause::Unreachable),
            (1205, Cause::LockWait),
            (1213, Cause::Deadlock),
            (1045, Cause::Credentials),
            (1044, Cause::Credentials),
            (1049, Cause::UnknownDatabase),
            (3159, Cause::TlsRequired),
            (4036, Cause::TlsRequired),
            (1146, Cause::Schema),
            (1142, Cause::Grants),
            (1062, Cause::Data),
            (4025, Cause::Data),
            (3819, Cause::Data),
            (1406, Cause::Data),
            (1064, Cause::Other),
        ] {
            assert_eq!(cause_of_number(number), expected, "error {number}");
        }
    }

    #[test]
    fn kinds_say_whether_to_retry() {
        let origin = Origin {
            url: "mysql://app:***@db/app".into(),
            database: "app".into(),
            database_key: "database",
        };
        let io = db_error(
            Some(&origin),
            "claim failed",
            sqlx::Error::Io(std::io::Error::other("reset")),
        );
        assert_eq!(io.kind(), ErrorKind::Unavailable);
        assert!(io.is_retryable());
        let pool = db_error(None, "claim failed", sqlx::Error::PoolTimedOut);
        assert_eq!(pool.kind(), ErrorKind::Unavailable);
        let other = db_error(None, "claim failed", sqlx::Error::RowNotFound);
        assert_eq!(other.kind(), ErrorKind::Temporary);
        let setup = db_error(
            Some(&origin),
            "cannot connect",
            sqlx::Error::Configuration("bad".into()),
        );
        assert_eq!(setup.kind(), ErrorKind::Config);
        assert!(
            setup.message().starts_with("url `mysql://app:***@db/app`"),
            "{setup}"
        );
    }
}
