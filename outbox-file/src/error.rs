//! Every failure of the `file` and `stdout` sinks, mapped onto the engine's [`ErrorKind`]s.
//!
//! Writing a line cannot fail because of what is in a message (any message encodes as JSON),
//! so every failure is about the disk or the output as a whole: an I/O error (a full disk, a
//! quota, a read-only file or file system, a directory that went away, a reader that closed
//! standard output), a write that did not finish within `publish_timeout`. All are
//! `Unavailable`: the worker charges no attempt, releases the batch and waits for `health()`
//! to pass. Each message says what to do. A bad setting is `Config`, at start-up only
//! (see `config.rs`).

use std::io;
use std::path::Path;
use std::time::Duration;

use outbox_core::{Error, ErrorKind};

/// The kind of an I/O failure of either sink: always [`ErrorKind::Unavailable`], since none
/// says anything about a message; the retries go through once the cause is fixed.
pub(crate) fn kind_of(_error: &io::Error) -> ErrorKind {
    ErrorKind::Unavailable
}

/// What to do about an I/O failure on the file `path`, by its kind.
pub(crate) fn file_advice(kind: io::ErrorKind, path: &Path) -> String {
    let file = path.display();
    let directory = crate::config::directory_of(path).display();
    match kind {
        io::ErrorKind::StorageFull => {
            format!("the disk holding `{file}` is full; free space on it (or rotate the file away)")
        }
        io::ErrorKind::QuotaExceeded => {
            "the disk quota of the relay's user is used up; free space or raise the quota".into()
        }
        io::ErrorKind::FileTooLarge => format!(
            "`{file}` has reached the largest size the file system or the process's limit \
             (ulimit -f) allows; rotate it away (the sink starts a new file at the same path)"
        ),
        io::ErrorKind::PermissionDenied => format!(
            "the relay's user may not read and append to `{file}` (or create it in \
             `{directory}`); give it read and write permission"
        ),
        io::ErrorKind::ReadOnlyFilesystem => format!(
            "the file system holding `{file}` is read-only; remount it read-write or point \
             sink.path elsewhere"
        ),
        io::ErrorKind::NotFound => format!(
            "the directory `{directory}` does not exist any more; create it again and the \
             retries will go through"
        ),
        io::ErrorKind::NotADirectory => {
            format!("a part of `{directory}` is not a directory any more; restore the directory")
        }
        io::ErrorKind::IsADirectory => {
            format!("`{file}` is a directory now; remove it or point sink.path at a file")
        }
        _ => format!("check the disk and the file system holding `{file}`"),
    }
}

/// What to do about an I/O failure on standard output (or the writer a test gave).
pub(crate) fn stdout_advice(kind: io::ErrorKind) -> &'static str {
    match kind {
        io::ErrorKind::BrokenPipe => {
            "whatever read standard output has closed it (broken pipe); restart the relay \
             with a reader attached"
        }
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => {
            "standard output goes to a full disk; free space on it"
        }
        _ => "check where standard output goes",
    }
}

/// An I/O failure of the `file` sink while doing `what` (`append the batch to`, …).
pub(crate) fn file_io(what: &str, path: &Path, error: &io::Error) -> Error {
    Error::new(
        kind_of(error),
        format!(
            "file: cannot {what} `{}`: {}",
            path.display(),
            file_advice(error.kind(), path)
        ),
    )
    .with_source(copy(error))
}

/// An I/O failure of the `stdout` sink.
pub(crate) fn stdout_io(error: &io::Error) -> Error {
    Error::new(
        kind_of(error),
        format!(
            "stdout: cannot write the batch: {}",
            stdout_advice(error.kind())
        ),
    )
    .with_source(copy(error))
}

/// `path` exists but is not a regular file any more (something replaced it).
pub(crate) fn not_a_file(path: &Path) -> Error {
    Error::unavailable(format!(
        "file: `{}` is not a regular file any more (a device, pipe or socket took its place); \
         remove it and the sink will create the file again",
        path.display()
    ))
}

/// The write (and sync) of a batch to `target` did not finish within the time-out.
pub(crate) fn timed_out(target: &str, timeout: Duration) -> Error {
    Error::unavailable(format!(
        "{target}: the batch was not written within sink.publish_timeout ({timeout:?}); the \
         disk or the reader is too slow or stalled. The write may still finish, so the batch \
         may show up twice after the retry"
    ))
}

/// A write to `target` started by an earlier call has not finished within the time-out: the
/// output is stalled, and this call writes nothing.
pub(crate) fn stalled(target: &str, timeout: Duration) -> Error {
    Error::unavailable(format!(
        "{target}: an earlier write has not finished after sink.publish_timeout ({timeout:?}); \
         the disk or the reader is stalled"
    ))
}

/// The write of a batch to `target` panicked (a bug): nothing is known to be written.
pub(crate) fn write_panicked(target: &str) -> Error {
    Error::unavailable(format!(
        "{target}: the write of the batch panicked; nothing is known to be written"
    ))
}

/// The sink's writer thread could not be started (the process is out of threads).
pub(crate) fn no_thread(target: &str, error: std::io::Error) -> Error {
    Error::unavailable(format!("{target}: cannot start the writer thread")).with_source(error)
}

/// A copy of an I/O error (each message of a failed batch gets its own [`Error`]).
fn copy(error: &io::Error) -> io::Error {
    io::Error::new(error.kind(), error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_error(kind: io::ErrorKind) -> Error {
        let error = io::Error::from(kind);
        file_io("append the batch to", Path::new("/data/out.jsonl"), &error)
    }

    #[test]
    fn every_io_failure_is_unavailable() {
        for kind in [
            io::ErrorKind::StorageFull,
            io::ErrorKind::QuotaExceeded,
            io::ErrorKind::FileTooLarge,
            io::ErrorKind::PermissionDenied,
            io::ErrorKind::ReadOnlyFilesystem,
            io::ErrorKind::NotFound,
            io::ErrorKind::NotADirectory,
            io::ErrorKind::IsADirectory,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::Other,
        ] {
            assert_eq!(file_error(kind).kind(), ErrorKind::Unavailable, "{kind:?}");
            let stdout = stdout_io(&io::Error::from(kind));
            assert_eq!(stdout.kind(), ErrorKind::Unavailable, "{kind:?}");
        }
        assert!(timed_out("file", Duration::from_secs(1)).is_retryable());
        assert!(stalled("stdout", Duration::from_secs(1)).is_retryable());
    }

    #[test]
    fn messages_say_what_to_do() {
        let full = file_error(io::ErrorKind::StorageFull).to_string();
        assert!(
            full.starts_with(
                "unavailable error: file: cannot append the batch to `/data/out.jsonl`: the \
                 disk holding `/data/out.jsonl` is full; free space on it (or rotate the file \
                 away): "
            ),
            "{full}"
        );
        let denied = file_error(io::ErrorKind::PermissionDenied).to_string();
        assert!(
            denied.contains("give it read and write permission"),
            "{denied}"
        );
        let gone = file_error(io::ErrorKind::NotFound).to_string();
        assert!(
            gone.contains("the directory `/data` does not exist any more; create it"),
            "{gone}"
        );
        let read_only = file_error(io::ErrorKind::ReadOnlyFilesystem).to_string();
        assert!(read_only.contains("remount it read-write"), "{read_only}");
        let pipe = stdout_io(&io::Error::from(io::ErrorKind::BrokenPipe)).to_string();
        assert!(pipe.contains("(broken pipe)"), "{pipe}");
    }

    #[test]
    fn raw_os_errors_map_by_their_kind() {
        // As the kernel reports them on Linux: ENOSPC, EDQUOT, EROFS, EACCES, EFBIG.
        #[cfg(target_os = "linux")]
        for (code, kind) in [
            (28, io::ErrorKind::StorageFull),
            (122, io::ErrorKind::QuotaExceeded),
            (30, io::ErrorKind::ReadOnlyFilesystem),
            (13, io::ErrorKind::PermissionDenied),
            (27, io::ErrorKind::FileTooLarge),
        ] {
            let error = io::Error::from_raw_os_error(code);
            assert_eq!(error.kind(), kind, "errno {code}");
            let mapped = file_io("append the batch to", Path::new("x"), &error);
            assert_eq!(mapped.kind(), ErrorKind::Unavailable);
            assert!(
                mapped.to_string().ends_with(&format!("(os error {code})")),
                "{mapped}"
            );
        }
    }
}
