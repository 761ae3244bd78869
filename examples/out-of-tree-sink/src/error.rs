//! How the spool's failures map onto the worker's error kinds.

use std::path::Path;

use outbox_core::Error;

/// A file or directory the spool cannot read or write: retryable (`Unavailable`), as a
/// broker that is down is: the directory may come back (a mount, a permission fixed).
pub(crate) fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::unavailable(format!("spool: cannot {what} {}: {e}", path.display()))
}

/// A message that can never be spooled: dead-lettered (`Permanent`).
pub(crate) fn refused(why: String) -> Error {
    Error::permanent(format!("spool: {why}"))
}

#[cfg(test)]
mod tests {
    use outbox_core::ErrorKind;

    use super::*;

    #[test]
    fn io_failures_are_retryable_and_refusals_are_not() {
        let e = io(
            "write",
            Path::new("/x/t.jsonl"),
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        );
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.is_retryable());
        assert!(e.to_string().contains("/x/t.jsonl"), "{e}");
        let e = refused("too large".into());
        assert_eq!(e.kind(), ErrorKind::Permanent);
        assert!(!e.is_retryable());
    }
}
