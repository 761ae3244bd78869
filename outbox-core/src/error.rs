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
    /// The storage's tables are missing or older than this release needs: run `outbox
    /// migrate` (or apply `outbox migrate --print-sql`). A relay waits, retrying, until they
    /// are there.
    Schema,
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
            ErrorKind::Schema => "schema",
        })
    }
}

/// An error from a storage, a sink or the configuration, with its [`ErrorKind`].
#[derive(Debug, thiserror::Error)]
#[error("{kind} error: {message}{}", source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
pub struct Error {
    kind: ErrorKind,
    message: String,
    /// A configuration error whose message starts with the key of the bad setting, so that
    /// [`Error::in_section`] can put the section in front of it.
    keyed: bool,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// A new error of `kind` that says what went wrong.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            keyed: false,
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

    /// Shorthand for [`ErrorKind::Schema`].
    pub fn schema(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Schema, message)
    }

    /// A configuration error about the setting `key` (its path inside its own section, such
    /// as `batch_size` or `backoff.max`): the message is the key followed by `problem`, e.g.
    /// `Error::setting("batch_size", "is 0; it must be at least 1")`. Whoever knows the
    /// section adds it with [`Error::in_section`], so the message names the key as the user
    /// wrote it.
    pub fn setting(key: impl AsRef<str>, problem: impl AsRef<str>) -> Self {
        let mut error = Self::config(format!("{} {}", key.as_ref(), problem.as_ref()));
        error.keyed = !key.as_ref().is_empty();
        error
    }

    /// Places a configuration error in `section` (`storage`, `relay[orders].sink`, …): the
    /// key of a [`setting`](Error::setting) error becomes `section.key`; any other
    /// configuration error is prefixed with `section: `. Errors of other kinds are returned
    /// unchanged.
    pub fn in_section(mut self, section: &str) -> Self {
        if self.kind != ErrorKind::Config || section.is_empty() {
            return self;
        }
        self.message = if self.keyed {
            format!("{section}.{}", self.message)
        } else {
            format!("{section}: {}", self.message)
        };
        self.keyed = true;
        self
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

    #[test]
    fn sections_go_in_front_of_the_key() {
        let error = Error::setting("backoff.max", "must be at least backoff.initial")
            .in_section("relay[orders]");
        assert_eq!(
            error.message(),
            "relay[orders].backoff.max must be at least backoff.initial"
        );
        let whole = Error::config("unknown field `x`").in_section("sink");
        assert_eq!(whole.message(), "sink: unknown field `x`");
        assert_eq!(
            whole.in_section("relay[a]").message(),
            "relay[a].sink: unknown field `x`"
        );
        let other = Error::unavailable("down").in_section("sink");
        assert_eq!(other.message(), "down");
    }
}
