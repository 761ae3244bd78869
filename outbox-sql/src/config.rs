//! The settings every SQL storage has, with their limits and checks. Each check returns the
//! `Config` error keyed by its setting, as the storage's `validate` does for the rest.

use std::time::Duration;

use outbox_core::{Error, Result};

/// The default of a storage's `max_per_key`: messages of one key a claim takes at most.
pub const DEFAULT_MAX_PER_KEY: usize = 8;

/// The largest `max_per_key` accepted.
pub const MAX_MAX_PER_KEY: usize = 10_000;

/// Checks `max_per_key`: between 1 and [`MAX_MAX_PER_KEY`].
pub fn check_max_per_key(max_per_key: usize) -> Result<()> {
    if !(1..=MAX_MAX_PER_KEY).contains(&max_per_key) {
        return Err(Error::setting(
            "max_per_key",
            format!("is {max_per_key}; it must be between 1 and {MAX_MAX_PER_KEY}"),
        ));
    }
    Ok(())
}

/// Checks `retention`: unset (delivered rows are deleted) or a duration that is not 0.
pub fn check_retention(retention: Option<Duration>) -> Result<()> {
    if retention.is_some_and(|r| r.is_zero()) {
        return Err(Error::setting(
            "retention",
            "is 0; leave it unset to delete delivered rows, or give a duration",
        ));
    }
    Ok(())
}

/// Checks `max_connections` of a storage that needs one connection at least (a storage that
/// needs more, for a listener, says why in its own message).
pub fn check_max_connections(max_connections: u32) -> Result<()> {
    if max_connections < 1 {
        return Err(Error::setting(
            "max_connections",
            "is 0; it must be at least 1",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_per_key_is_bounded() {
        for good in [1, DEFAULT_MAX_PER_KEY, MAX_MAX_PER_KEY] {
            assert!(check_max_per_key(good).is_ok(), "{good}");
        }
        let err = check_max_per_key(0).unwrap_err();
        assert_eq!(
            err.message(),
            "max_per_key is 0; it must be between 1 and 10000"
        );
        assert!(check_max_per_key(MAX_MAX_PER_KEY + 1).is_err());
    }

    #[test]
    fn retention_is_unset_or_positive() {
        assert!(check_retention(None).is_ok());
        assert!(check_retention(Some(Duration::from_secs(1))).is_ok());
        let err = check_retention(Some(Duration::ZERO)).unwrap_err();
        assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
        assert!(err.message().starts_with("retention is 0; "), "{err}");
    }

    #[test]
    fn one_connection_at_least() {
        assert!(check_max_connections(1).is_ok());
        assert_eq!(
            check_max_connections(0).unwrap_err().message(),
            "max_connections is 0; it must be at least 1"
        );
    }
}
