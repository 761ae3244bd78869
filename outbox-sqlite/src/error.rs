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
    /// The disk holding the database or its `-wal` file is full (`SQLITE_FULL`).
    Full,
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
        7 | 10 | 15 => Cause::Io,         // SQLITE_NOMEM, SQLITE_IOERR, SQLITE_PROTOCOL
        13 => Cause::Full,                // SQLITE_FULL
        14 => Cause::CannotOpen,          // SQLITE_CANTOPEN
        26 => Cause::NotADatabase,        // SQLITE_NOTADB
        11 => Cause::Corrupt,             // SQLITE_CORRUPT
        8 | 23 => Cause::ReadOnly,        // SQLITE_READONLY, SQLITE_AUTH
        1 => Cause::Schema,               // SQLITE_ERROR: no such table, no such column
        18 | 19 | 20 | 25 => Cause::Data, // SQLITE_TOOBIG, CONSTRAINT, MISMATCH, RANGE
        _ => Cause::Other,                // SQLITE_SCHEMA (re-prepare), ABORT, INTERRUPT, ...
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
    let cause = cause(&error);
    // Why the file cannot be opened or written, when the file system can tell.
    let unwritable = match cause {
        Cause::CannotOpen | Cause::ReadOnly | Cause::Setup => path.and_then(why_not_writable),
        _ => None,
    };
    let classified = match cause {
        Cause::Busy => Error::unavailable(format!(
            "sqlite: {context}: the database is locked (another connection held the write lock \
             longer than busy_timeout; keep application write transactions short)"
        )),
        Cause::Io => Error::unavailable(format!("sqlite: {context}")),
        Cause::Full => Error::unavailable(match path {
            Some(path) => format!(
                "sqlite: {context}: the disk holding `{}` (or its -wal file) is full; free space \
                 on it. Nothing of this write was kept; it is tried again once there is room",
                path.display()
            ),
            None => format!(
                "sqlite: {context}: the disk holding the database (or its -wal file) is full; \
                 free space on it. The statement wrote nothing: roll the transaction back and \
                 run it again once there is room"
            ),
        }),
        _ if unwritable.is_some() => file(unwritable.unwrap_or_default()),
        Cause::CannotOpen => file(
            "cannot be opened: check that its directory exists and that the relay may read and \
             write the file and its directory (SQLite keeps -wal and -shm files next to it)",
        ),
        Cause::NotADatabase => file("is not a SQLite database; point `path` at the database file"),
        Cause::Corrupt => file(
            "is damaged (database disk image is malformed); check it with `PRAGMA \
             integrity_check` and restore it from a backup",
        ),
        Cause::ReadOnly if path.is_some() => file(
            "is read-only for the relay; not retryable: it must be able to write the file and its directory",
        ),
        Cause::ReadOnly => file(
            "is read-only for this connection (a read-only file, directory or file system, or a \
             connection opened read-only): writers need to write the file and its directory",
        ),
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

/// What stops this process from writing the database file at `path` (or creating it),
/// with what to do, if the file system says: a read-only file system (which stops root
/// too), or no permission. `None` when it can be written as far as opening it tells: an
/// existing file is opened for appending and closed again, never changed; for a file that
/// does not exist, a scratch file of a name of its own is created in the directory and
/// removed again (never the database's name, which another process may be creating).
fn why_not_writable(path: &Path) -> Option<&'static str> {
    let opened = match std::fs::OpenOptions::new().append(true).open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let directory = match path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir,
                _ => Path::new("."),
            };
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let scratch = directory.join(format!(
                ".outbox-write-check-{}-{nanos}",
                std::process::id()
            ));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&scratch)
            {
                Ok(_) => {
                    let _ = std::fs::remove_file(&scratch);
                    return None;
                }
                Err(e) => Err(e),
            }
        }
        opened => opened,
    };
    match opened.err()?.kind() {
        std::io::ErrorKind::ReadOnlyFilesystem => Some(
            "is on a read-only file system; not retryable: remount it read-write or move the \
             database to a writable file system (the relay writes the file, and -wal and -shm \
             files next to it)",
        ),
        std::io::ErrorKind::PermissionDenied => Some(
            "may not be written by the relay's user; not retryable: give it write permission \
             on the file and its directory (SQLite keeps -wal and -shm files next to it)",
        ),
        _ => None,
    }
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
            (13, Cause::Full),
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
