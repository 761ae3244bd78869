//! The one error type of the engine, which says whether a failure is worth retrying.

use std::fmt;

/// Result with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure happened; decides what the worker does with the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The broker or database could not be reached, or did not answer in time. Says nothing
    /// about the message: the worker releases it without charging an attempt and retries later.
    Unavailable,
    /// This message failed but may succeed later (for example a broker nack). Charged as an
    /// attempt and retried with backoff.
    Temporary,
    /// This message can never be delivered as it is (too large, unroutable, wrong key type).
    /// Dead-lettered at once.
    Permanent,
    /// The configuration is invalid. Fix it and start again.
    Config,
}

impl ErrorKind {
    /// Whether the failed operation may succeed if tried again.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Unavailable | ErrorKind::Temporary)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Temporary => "temporary",
            ErrorKind::Permanent => "permanent",
            ErrorKind::Config => "configuration",
        })
    }
}

/// An error from a storage, a sink or the configuration, with its [`ErrorKind`].
#[derive(Debug, thiserror::Error)]
#[error("{kind} error: {message}{}", source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
pub struct Error {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// A new error of `kind` that says what went wrong.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Shorthand for [`ErrorKind::Unavailable`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// Shorthand for [`ErrorKind::Temporary`].
    pub fn temporary(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Temporary, message)
    }

    /// Shorthand for [`ErrorKind::Permanent`].
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Permanent, message)
    }

    /// Shorthand for [`ErrorKind::Config`].
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether the failed operation may succeed if tried again.
    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }

    /// The message without the kind prefix.
    pub fn message(&self) -> &str {
        &self.message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_kind_message_and_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = Error::unavailable("cannot reach redis at 127.0.0.1:1").with_source(io);
        assert_eq!(
            err.to_string(),
            "unavailable error: cannot reach redis at 127.0.0.1:1: refused"
        );
        assert!(err.is_retryable());
        assert!(!Error::permanent("too large").is_retryable());
        assert!(!Error::config("bad").is_retryable());
        assert!(Error::temporary("nack").is_retryable());
    }
}
