//! Mapping NATS client errors onto the engine's error kinds.

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
            " (check the credentials in sink.url or sink.token)",
        ),
        ConnectErrorKind::TimedOut => (ErrorKind::Unavailable, " within sink.timeout"),
        _ => (ErrorKind::Unavailable, ""),
    };
    Error::new(kind, format!("nats: cannot connect to {servers}{hint}")).with_source(error)
}

/// Where a publish failed: handing it to the connection, or waiting for its ack.
#[derive(Clone, Copy, PartialEq, Eq)]
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
                    "nats: could not hand the message for `{subject}` to the connection within sink.timeout"
                ),
                Stage::Ack => {
                    format!("nats: no acknowledgement for `{subject}` within sink.timeout")
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
        RequestErrorKind::TimedOut => {
            format!("nats: JetStream at {servers} did not answer within sink.timeout")
        }
        RequestErrorKind::NoResponders => {
            format!("nats: JetStream is not enabled at {servers} (start nats-server with -js)")
        }
        _ => format!("nats: the JetStream account query to {servers} failed"),
    };
    Error::unavailable(text).with_source(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_errors_are_classified() {
        let kind = |k, stage| publish_error("s", stage, PublishError::new(k)).kind();
        assert_eq!(
            kind(PublishErrorKind::TimedOut, Stage::Ack),
            ErrorKind::Unavailable
        );
        assert_eq!(
            kind(PublishErrorKind::BrokenPipe, Stage::Ack),
            ErrorKind::Unavailable
        );
        assert_eq!(
            kind(PublishErrorKind::Other, Stage::Send),
            ErrorKind::Unavailable
        );
        assert_eq!(
            kind(PublishErrorKind::Other, Stage::Ack),
            ErrorKind::Temporary
        );
        assert_eq!(
            kind(PublishErrorKind::StreamNotFound, Stage::Ack),
            ErrorKind::Temporary
        );
        assert_eq!(
            kind(PublishErrorKind::MaxPayloadExceeded, Stage::Send),
            ErrorKind::Permanent
        );
    }

    #[test]
    fn jetstream_api_errors_are_classified_by_code() {
        // As the server sends them in a publish ack.
        let api = |code: u64, err_code: u64| -> async_nats::jetstream::Error {
            serde_json::from_value(serde_json::json!({
                "code": code, "err_code": err_code, "description": "from the server"
            }))
            .unwrap()
        };
        assert_eq!(
            jetstream_kind(&api(400, 10054)),
            ErrorKind::Permanent,
            "message too large"
        );
        assert_eq!(
            jetstream_kind(&api(400, 10060)),
            ErrorKind::Permanent,
            "expected stream"
        );
        assert_eq!(
            jetstream_kind(&api(503, 10008)),
            ErrorKind::Unavailable,
            "no cluster"
        );
        assert_eq!(jetstream_kind(&api(503, 0)), ErrorKind::Unavailable, "503");
        // A full stream (discard new) or failing storage: back-pressure, nothing charged.
        assert_eq!(jetstream_kind(&api(503, 10077)), ErrorKind::Unavailable);
        assert_eq!(jetstream_kind(&api(400, 10999)), ErrorKind::Temporary);
    }
}
