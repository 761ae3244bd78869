//! Every failure of the AMQP sink, mapped onto the engine's [`ErrorKind`]s.
//!
//! In short: what says nothing about the message (the transport, a time-out, a channel that
//! closed because of another message) is `Unavailable`, so the worker charges no attempt; a
//! broker refusing this message or its exchange, a nack and an unroutable message under
//! [`Unroutable::Retry`] are `Temporary`; a message that can never be published as it is,
//! CONTENT_TOO_LARGE and an unroutable message under [`Unroutable::DeadLetter`] are
//! `Permanent`; what the operator must fix before the relay can start is `Config`.

use std::time::Duration;

use lapin::ErrorKind as LapinKind;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use outbox_core::{Error, ErrorKind};

use crate::Unroutable;

/// What kind of failure a lapin error is, for the message(s) it concerns.
///
/// The broker refusing a request on a channel (a "soft" error: not found, access refused,
/// precondition failed) says something about that request, which may succeed once the
/// topology or permissions are fixed: temporary; CONTENT_TOO_LARGE never will: permanent.
/// Everything about the transport (I/O, heartbeats, the connection closed by the broker, a
/// channel that is no longer open) says nothing about the message: unavailable, so the
/// worker charges no attempt.
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

/// The engine error for a lapin error met while doing `what` (declaring an exchange, or the
/// broker's answer to a published message), of the kind [`kind_of`] gives.
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

/// Connecting or opening the channel failed. A refused login (403 ACCESS_REFUSED: user or
/// password; 530 NOT_ALLOWED: vhost) `at_startup` is a configuration error; anything else,
/// and a refused login later, is unavailable like any other failure to connect.
pub(crate) fn connect_failed(url: &str, error: lapin::Error, at_startup: bool) -> Error {
    if at_startup && matches!(reply_code(&error), Some(403 | 530)) {
        return Error::setting(
            "url",
            format!(
                "`{url}`: the AMQP broker refused the login; check the user, password and vhost"
            ),
        )
        .with_source(error);
    }
    Error::unavailable(format!("cannot connect to the AMQP broker at {url}")).with_source(error)
}

/// The broker could not be reached (or lost the link) while doing `what`: unavailable,
/// whatever lapin says, since nothing reached the broker as a request of its own.
pub(crate) fn transport(what: impl std::fmt::Display, error: lapin::Error) -> Error {
    Error::unavailable(what.to_string()).with_source(error)
}

/// `what` did not finish within the setting `setting` (`connect_timeout` or
/// `publish_timeout`), which was `after`: unavailable.
pub(crate) fn timed_out(what: impl std::fmt::Display, after: Duration, setting: &str) -> Error {
    Error::unavailable(format!("{what} timed out after {after:?} (sink.{setting})"))
}

/// No connection, and the reconnect backoff does not allow a new attempt yet: unavailable.
pub(crate) fn not_connected(url: &str, wait: Duration, failures: u32, last_error: &str) -> Error {
    Error::unavailable(format!(
        "not connected to the AMQP broker at {url}; next attempt in {wait:?} after {failures} \
         failed (last error: {last_error})"
    ))
}

/// A passive declare found no exchange `name`: temporary for the messages routed to it (it
/// may be created), a configuration error at start-up (see [`at_startup`]).
pub(crate) fn missing_exchange(name: &str, url: &str, error: lapin::Error) -> Error {
    Error::temporary(format!(
        "exchange `{name}` does not exist on {url}; create it, or let the sink declare \
         exchanges (exchange_setup = \"declare\")"
    ))
    .with_source(error)
}

/// An exchange that is missing or declared otherwise can only be fixed by the operator: at
/// start-up that is a configuration error. An unavailable broker stays unavailable.
pub(crate) fn at_startup(error: Error) -> Error {
    if error.kind() == ErrorKind::Unavailable {
        return error;
    }
    Error::config(text(&error))
}

/// A message that can never be published as it is (payload over `max_payload`, an empty or
/// too long routing key, a too long name, properties larger than a frame): permanent, and
/// it is not sent.
pub(crate) fn unpublishable(reason: String) -> Error {
    Error::permanent(reason)
}

/// The broker returned the message (no queue took it) and acked it: as `setting` says.
pub(crate) fn returned(reason: String, setting: Unroutable) -> Error {
    match setting {
        Unroutable::Retry => Error::temporary(reason),
        Unroutable::DeadLetter => Error::permanent(reason),
    }
}

/// The broker nacked the message: temporary.
pub(crate) fn nacked(reason: String) -> Error {
    Error::temporary(reason)
}

/// The channel lost confirm mode or closed under the message for another message's sake:
/// unavailable, nothing is wrong with this one.
pub(crate) fn channel_lost(reason: String) -> Error {
    Error::unavailable(reason)
}

/// An error of the same kind and text, for each message it concerns.
pub(crate) fn copy(error: &Error) -> Error {
    Error::new(error.kind(), text(error))
}

/// The error's message and sources, without the kind in front.
pub(crate) fn text(error: &Error) -> String {
    let text = error.to_string();
    let prefix = format!("{} error: ", error.kind());
    text.strip_prefix(&prefix).unwrap_or(&text).to_string()
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

    #[test]
    fn a_refused_login_is_configuration_only_at_start_up() {
        let refused = || protocol(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED));
        let error = connect_failed("amqp://u:***@h", refused(), true);
        assert_eq!(error.kind(), ErrorKind::Config);
        assert!(
            error
                .in_section("sink")
                .message()
                .starts_with("sink.url `amqp://u:***@h`: the AMQP broker refused the login"),
        );
        let error = connect_failed("amqp://u:***@h", refused(), false);
        assert_eq!(error.kind(), ErrorKind::Unavailable);
        let missing = missing_exchange(
            "x",
            "amqp://h",
            protocol(AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)),
        );
        assert_eq!(missing.kind(), ErrorKind::Temporary);
        assert_eq!(at_startup(missing).kind(), ErrorKind::Config);
        assert_eq!(
            at_startup(Error::unavailable("down")).kind(),
            ErrorKind::Unavailable
        );
    }

    #[test]
    fn returned_messages_fail_as_configured() {
        assert_eq!(
            returned("no queue".into(), Unroutable::Retry).kind(),
            ErrorKind::Temporary
        );
        assert_eq!(
            returned("no queue".into(), Unroutable::DeadLetter).kind(),
            ErrorKind::Permanent
        );
        assert_eq!(nacked("nack".into()).kind(), ErrorKind::Temporary);
        assert_eq!(channel_lost("gone".into()).kind(), ErrorKind::Unavailable);
        assert_eq!(unpublishable("big".into()).kind(), ErrorKind::Permanent);
        let late = timed_out("publishing to x", Duration::from_secs(2), "publish_timeout");
        assert_eq!(late.kind(), ErrorKind::Unavailable);
        assert!(
            late.to_string().ends_with("(sink.publish_timeout)"),
            "{late}"
        );
    }
}
