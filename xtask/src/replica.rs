//! A streaming read replica of the local PostgreSQL for the log-mode replica tests.

use crate::Result;

/// Makes sure the replica is up (placeholder: filled in by the replica work before commit).
pub fn ensure() -> Result {
    Ok(())
}
