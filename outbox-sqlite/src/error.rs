//! Mapping SQLite errors onto the engine's error kinds.

use std::path::Path;

use outbox_core::{Error, ErrorKind};

/// What is wrong, by SQLite's primary result code (the low byte of the extended code sqlx
/// reports): <https://www.sqlite.org/rescode.html>.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// Another connection holds the lock we waited for longer than `busy_timeout`.
    Busy,
    /// The disk, the memory or the file's I/O failed, for now.
    Io,
    /// The file cannot be opened (missing directory, permissions).
    CannotOpen,
    /// The file is not a SQLite database.
    NotADatabase,
    /// The database file is damaged.
    Corrupt,
    /// The file or its directory is read-only for this process.
    ReadOnly,
    /// A missing table or column, or bad SQL: the tables are not migrated.
    Schema,
    /// A row breaks a constraint or a limit: bad data.
    Data,
    /// The connection's settings are wrong (the file cannot use WAL mode).
    Setup,
    /// Anything else, worth trying again.
    Other,
}

/// The cause of a SQLite result code (primary or extended).
pub(crate) fn cause_of_code(code: i64) -> Cause {
    match code & 0xff {
        5 | 6 => Cause::Busy,             // SQLITE_BUSY, SQLITE_LOCKED
        7 | 10 | 13 | 15 => Cause::Io, // SQLITE_NOMEM, SQLITE_IOERR, SQLITE_FULL, SQLITE_PROTOCOL
        14 => Cause::CannotOpen,       // SQLITE_CANTOPEN
        26 => Cause::NotADatabase,     // SQLITE_NOTADB
        11 => Cause::Corrupt,          // SQLITE_CORRUPT
        8 | 23 => Cause::ReadOnly,     // SQLITE_READONLY, SQLITE_AUTH
        1 => Cause::Schema,            // SQLITE_ERROR: no such table, no such column
        18 | 19 | 20 | 25 => Cause::Data, // SQLITE_TOOBIG, CONSTRAINT, MISMATCH, RANGE
        _ => Cause::Other,             // SQLITE_SCHEMA (re-prepare), ABORT, INTERRUPT, ...
    }
}

/// The cause of a sqlx error.
pub(crate) fn cause(error: &sqlx::Error) -> Cause {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => Cause::Io,
        sqlx::Error::Configuration(_) => Cause::Setup,
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|code| code.parse::<i64>().ok())
            .map_or(Cause::Other, cause_of_code),
        _ => Cause::Other,
    }
}

/// Classifies a sqlx error: a lock held too long or a failing disk is `Unavailable`; a file
/// that cannot be opened, is not a database, is damaged or read-only is `Config` (with what
/// to do); missing tables are `Schema`; bad data is `Permanent`; anything else `Temporary`.
/// `path` is the database file, when the caller knows it: a problem with the file is then a
/// configuration error keyed `path`.
pub(crate) fn db_error(path: Option<&Path>, context: &str, error: sqlx::Error) -> Error {
    let file = |problem: &str| match path {
        Some(path) => Error::setting(
            "path",
            format!("`{}` {problem} (sqlite: {context})", path.display()),
        ),
        None => Error::config(format!("sqlite: {context}: the database file {problem}")),
    };
    let classified = match cause(&error) {
        Cause::Busy => Error::unavailable(format!(
            "sqlite: {context}: the database is locked (another connection held the write lock \
             longer than busy_timeout; keep application write transactions short)"
        )),
        Cause::Io => Error::unavailable(format!("sqlite: {context}")),
        Cause::CannotOpen => file(
            "cannot be opened: check that its directory exists and that the relay may read and \
             write the file and its directory (SQLite keeps -wal and -shm files next to it)",
        ),
        Cause::NotADatabase => file("is not a SQLite database; point `path` at the database file"),
        Cause::Corrupt => file(
            "is damaged (database disk image is malformed); check it with `PRAGMA \
             integrity_check` and restore it from a backup",
        ),
        Cause::ReadOnly => {
            file("is read-only for the relay: it must be able to write the file and its directory")
        }
        Cause::Setup => file("cannot be used as the outbox database"),
        Cause::Schema => Error::schema(format!(
            "sqlite: {context}: the outbox tables are missing or older than this release; run \
             `outbox migrate` (or apply the SQL of `outbox migrate --print-sql`)"
        )),
        Cause::Data => Error::new(ErrorKind::Permanent, format!("sqlite: {context}")),
        Cause::Other => Error::temporary(format!("sqlite: {context}")),
    };
    classified.with_source(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_codes_map_to_causes() {
        for (code, expected) in [
            (5, Cause::Busy),
            (517, Cause::Busy), // SQLITE_BUSY_SNAPSHOT
            (6, Cause::Busy),
            (10, Cause::Io),
            (3338, Cause::Io), // SQLITE_IOERR_FSYNC
            (13, Cause::Io),
            (14, Cause::CannotOpen),
            (26, Cause::NotADatabase),
            (11, Cause::Corrupt),
            (8, Cause::ReadOnly),
            (1, Cause::Schema),
            (19, Cause::Data),
            (2067, Cause::Data), // SQLITE_CONSTRAINT_UNIQUE
            (275, Cause::Data),  // SQLITE_CONSTRAINT_CHECK
            (17, Cause::Other),
        ] {
            assert_eq!(cause_of_code(code), expected, "code {code}");
        }
    }

    #[test]
    fn file_problems_name_the_path_setting() {
        let error = db_error(
            Some(Path::new("/srv/app.db")),
            "cannot open",
            sqlx::Error::Io(std::io::Error::other("x")),
        );
        assert_eq!(error.kind(), ErrorKind::Unavailable);
        let pool = db_error(None, "claim failed", sqlx::Error::PoolTimedOut);
        assert_eq!(pool.kind(), ErrorKind::Unavailable);
        let other = db_error(None, "claim failed", sqlx::Error::RowNotFound);
        assert_eq!(other.kind(), ErrorKind::Temporary);
    }
}
