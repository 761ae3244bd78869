//! Every failure of the NATS sink, mapped onto the engine's [`ErrorKind`]s.
//!
//! In short: what says nothing about the message (the connection, a time-out, JetStream not
//! enabled, a cluster without a leader, a full stream that discards new messages) is
//! `Unavailable`, so the worker charges no attempt; a message that can never be stored as it
//! is (too large, an expected-stream mismatch, a topic that makes an invalid subject, a header
//! NATS cannot carry) is `Permanent`; no stream for the subject and any other JetStream
//! refusal are `Temporary`; a URL the client cannot parse is `Config`.

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{
    PublishError, PublishErrorKind, RequestError, RequestErrorKind,
};
use async_nats::{ConnectError, ConnectErrorKind};
use outbox_core::{Error, ErrorKind};

/// A failed connection attempt: a URL the client cannot parse is `Config`; everything else
/// (refused, time-out, TLS, authentication) is `Unavailable`, since it says nothing about the
/// messages and the health gate keeps the worker from claiming until it passes.
pub(crate) fn connect_error(servers: &str, error: ConnectError) -> Error {
    let (kind, hint) = match error.kind() {
        ConnectErrorKind::ServerParse => (ErrorKind::Config, " (check sink.url)"),
        ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => (
            ErrorKind::Unavailable,
            " (check sink.credentials_file, sink.nkey_file, sink.token or the credentials \
             in sink.url)",
        ),
        ConnectErrorKind::TimedOut => (ErrorKind::Unavailable, " within sink.publish_timeout"),
        _ => (ErrorKind::Unavailable, ""),
    };
    Error::new(kind, format!("nats: cannot connect to {servers}{hint}")).with_source(error)
}

/// What did not happen within `sink.publish_timeout`, where the client's own time-out did
/// not fire.
#[derive(Clone, Copy)]
pub(crate) enum Waited {
    /// The connection.
    Connect,
    /// The connection taking a window's messages.
    Handover,
    /// A window's acknowledgements, all of them.
    Acks,
    /// The answer to the health check's account query.
    Health,
}

/// Something `servers` did not do within the time-out: `Unavailable`, since it says nothing
/// about the messages.
pub(crate) fn timed_out(servers: &str, waited: Waited) -> Error {
    let what = match waited {
        Waited::Connect => format!("cannot connect to {servers}"),
        Waited::Handover => format!("could not hand the batch to the connection to {servers}"),
        Waited::Acks => format!("no acknowledgements from {servers}"),
        Waited::Health => format!("JetStream at {servers} did not answer"),
    };
    Error::unavailable(format!("nats: {what} within sink.publish_timeout"))
}

/// The client lost its connection and is reconnecting: `Unavailable` at once, so nothing is
/// queued in the client to go out on some later reconnect.
pub(crate) fn disconnected(servers: &str) -> Error {
    Error::unavailable(format!(
        "nats: disconnected from {servers}; the client is reconnecting"
    ))
}

/// A message of a batch after the batch's connection failed (`why`): not sent,
/// `Unavailable`.
pub(crate) fn not_sent(why: &str) -> Error {
    Error::unavailable(why)
}

/// Why a message can never be sent as it is.
pub(crate) enum Unsendable<'a> {
    /// Its topic (first) does not make a valid subject, for the reason given.
    Subject(&'a str, &'a str),
    /// A header named `Nats-…`, which would change JetStream's handling.
    ReservedHeader(&'a str),
    /// A header name NATS cannot carry.
    HeaderName(&'a str),
    /// A header value NATS cannot carry; the header's name.
    HeaderValue(&'a str),
}

/// A message that can never be sent as it is: `Permanent`, nothing is sent.
pub(crate) fn unsendable(why: Unsendable<'_>) -> Error {
    Error::permanent(match why {
        Unsendable::Subject(topic, why) => {
            format!("nats: topic `{topic}` does not make a valid subject: {why}")
        }
        Unsendable::ReservedHeader(name) => {
            format!("nats: header `{name}` starts with `Nats-`, which NATS reserves for itself")
        }
        Unsendable::HeaderName(name) => format!(
            "nats: header name `{name}` is not valid in NATS (printable ASCII without ':' or spaces)"
        ),
        Unsendable::HeaderValue(name) => format!(
            "nats: the value of header `{name}` contains a line break, which NATS headers cannot carry"
        ),
    })
}

/// Where a publish failed: handing it to the connection, or waiting for its ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stage {
    Send,
    Ack,
}

/// The kind of a JetStream API error returned in a publish ack.
fn jetstream_kind(error: &async_nats::jetstream::Error) -> ErrorKind {
    match error.error_code() {
        // The message is larger than the stream allows, or the expected stream (sink.stream)
        // is not the one that captures its subject: it will never be stored as it is.
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_NOT_MATCH => {
            ErrorKind::Permanent
        }
        // The cluster cannot take writes right now (no leader, no quorum): nothing is wrong
        // with the message.
        ErrorCode::CLUSTER_NOT_AVAILABLE
        | ErrorCode::CLUSTER_NOT_LEADER
        | ErrorCode::CLUSTER_NOT_ACTIVE
        | ErrorCode::CLUSTER_INCOMPLETE
        | ErrorCode::CLUSTER_NO_PEERS
        | ErrorCode::RAFT_GENERAL
        | ErrorCode::JETSTREAM_NOT_ENABLED
        | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT => ErrorKind::Unavailable,
        // The server cannot store anything right now (a full stream that discards new
        // messages, failing storage): back-pressure, nothing is wrong with the message.
        _ if error.code() == 503 => ErrorKind::Unavailable,
        // Anything else may pass on a later try.
        _ => ErrorKind::Temporary,
    }
}

/// A failed publish of one message to `subject`, as an engine error of the right kind.
pub(crate) fn publish_error(subject: &str, stage: Stage, error: PublishError) -> Error {
    let (kind, text) = match error.kind() {
        PublishErrorKind::TimedOut => (
            ErrorKind::Unavailable,
            match stage {
                Stage::Send => format!(
                    "nats: could not hand the message for `{subject}` to the connection within sink.publish_timeout"
                ),
                Stage::Ack => {
                    format!("nats: no acknowledgement for `{subject}` within sink.publish_timeout")
                }
            },
        ),
        PublishErrorKind::BrokenPipe | PublishErrorKind::MaxAckPending => (
            ErrorKind::Unavailable,
            format!("nats: connection lost while publishing to `{subject}`"),
        ),
        PublishErrorKind::StreamNotFound => (
            ErrorKind::Temporary,
            format!(
                "nats: no JetStream stream captures subject `{subject}`; add the subject to a \
                 stream (nats stream add --subjects ...) and the retries will go through"
            ),
        ),
        PublishErrorKind::MaxPayloadExceeded => (
            ErrorKind::Permanent,
            format!("nats: the message for `{subject}` is larger than the server's max_payload"),
        ),
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => (
            ErrorKind::Permanent,
            format!("nats: JetStream refused the message for `{subject}`"),
        ),
        PublishErrorKind::Other => {
            let api = std::error::Error::source(&error)
                .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>());
            match (api, stage) {
                (Some(api), _) => (
                    jetstream_kind(api),
                    format!("nats: JetStream refused the message for `{subject}`"),
                ),
                // Before an ack the only failure left is the connection's queue being closed.
                (None, Stage::Send) => (
                    ErrorKind::Unavailable,
                    format!("nats: the connection is closed; cannot publish to `{subject}`"),
                ),
                (None, Stage::Ack) => (
                    ErrorKind::Temporary,
                    format!("nats: unreadable acknowledgement for `{subject}`"),
                ),
            }
        }
    };
    Error::new(kind, text).with_source(error)
}

/// A failed health check: `Unavailable` whatever the cause, with what to do about it.
pub(crate) fn health_error(servers: &str, error: RequestError) -> Error {
    let text = match error.kind() {
        RequestErrorKind::TimedOut => return timed_out(servers, Waited::Health).with_source(error),
        RequestErrorKind::NoResponders => {
            format!("nats: JetStream is not enabled at {servers} (start nats-server with -js)")
        }
        _ => format!("nats: the JetStream account query to {servers} failed"),
    };
    Error::unavailable(text).with_source(error)
}

/// The account query was answered with an error: JetStream is not usable for this account.
pub(crate) fn health_refused(servers: &str, error: &serde_json::Value) -> Error {
    Error::unavailable(format!(
        "nats: JetStream at {servers} refused the account query: {error}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_errors_are_classified() {
        use ErrorKind::{Permanent, Temporary, Unavailable};
        use PublishErrorKind::{BrokenPipe, MaxPayloadExceeded, Other, StreamNotFound, TimedOut};
        for (kind, stage, expected) in [
            (TimedOut, Stage::Ack, Unavailable),
            (BrokenPipe, Stage::Ack, Unavailable),
            (Other, Stage::Send, Unavailable),
            (Other, Stage::Ack, Temporary),
            (StreamNotFound, Stage::Ack, Temporary),
            (MaxPayloadExceeded, Stage::Send, Permanent),
        ] {
            let error = publish_error("s", stage, PublishError::new(kind));
            assert_eq!(error.kind(), expected, "{kind:?} at {stage:?}");
        }
    }

    #[test]
    fn jetstream_api_errors_are_classified_by_code() {
        use ErrorKind::{Permanent, Temporary, Unavailable};
        // As the server sends them in a publish ack.
        for (code, err_code, expected, what) in [
            (400, 10054, Permanent, "message too large"),
            (400, 10060, Permanent, "expected stream"),
            (503, 10008, Unavailable, "no cluster"),
            (503, 0, Unavailable, "503"),
            // A full stream (discard new) or failing storage: back-pressure, nothing charged.
            (503, 10077, Unavailable, "full stream"),
            (400, 10999, Temporary, "any other"),
        ] {
            let api: async_nats::jetstream::Error = serde_json::from_value(serde_json::json!({
                "code": code, "err_code": err_code, "description": "from the server"
            }))
            .unwrap();
            assert_eq!(jetstream_kind(&api), expected, "{what}");
        }
    }
}
