//! Mapping lapin's errors onto the engine's [`ErrorKind`]s.

use lapin::ErrorKind as LapinKind;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use outbox_core::{Error, ErrorKind};

/// What kind of failure a lapin error is, for the message(s) it concerns.
///
/// The broker refusing a request on a channel (a "soft" error: not found, access refused,
/// precondition failed) says something about that request, which may succeed once the
/// topology or permissions are fixed: temporary. Everything about the transport (I/O,
/// heartbeats, the connection closed by the broker, a channel that is no longer open) says
/// nothing about the message: unavailable, so the worker charges no attempt.
fn kind_of(error: &lapin::Error) -> ErrorKind {
    match error.kind() {
        LapinKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::CONTENTTOOLARGE) => ErrorKind::Permanent,
            AMQPErrorKind::Soft(_) => ErrorKind::Temporary,
            AMQPErrorKind::Hard(_) => ErrorKind::Unavailable,
        },
        LapinKind::FutureCompleted => ErrorKind::Temporary,
        _ => ErrorKind::Unavailable,
    }
}

/// The engine error for a lapin error met while doing `what`.
pub(crate) fn from_lapin(what: impl std::fmt::Display, error: lapin::Error) -> Error {
    Error::new(kind_of(&error), what.to_string()).with_source(error)
}

/// The AMQP reply code of a broker refusal (404 not found, 403 access refused, ...), if the
/// error is one.
pub(crate) fn reply_code(error: &lapin::Error) -> Option<u16> {
    match error.kind() {
        LapinKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPHardError};

    fn protocol(kind: AMQPErrorKind) -> lapin::Error {
        LapinKind::ProtocolError(AMQPError::new(kind, "refused".into())).into()
    }

    #[test]
    fn transport_failures_are_unavailable_and_refusals_are_not() {
        let io: lapin::Error =
            std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset").into();
        assert_eq!(kind_of(&io), ErrorKind::Unavailable);
        assert_eq!(
            kind_of(&LapinKind::MissingHeartbeatError.into()),
            ErrorKind::Unavailable
        );
        let forced = protocol(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED));
        assert_eq!(kind_of(&forced), ErrorKind::Unavailable);
        let not_found = protocol(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND));
        assert_eq!(kind_of(&not_found), ErrorKind::Temporary);
        assert_eq!(reply_code(&not_found), Some(404));
        let too_large = protocol(AMQPErrorKind::Soft(AMQPSoftError::CONTENTTOOLARGE));
        assert_eq!(kind_of(&too_large), ErrorKind::Permanent);
        let error = from_lapin("publishing to exchange `x`", not_found);
        assert_eq!(error.kind(), ErrorKind::Temporary);
        assert!(
            error.to_string().contains("publishing to exchange `x`"),
            "{error}"
        );
    }
}
