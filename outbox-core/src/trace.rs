//! Trace context across the outbox: a message made inside a traced span carries that span's
//! W3C context (`traceparent`, `tracestate`), and the relay's spans for a batch link to the
//! context of each message they handle, so a trace continues from the writer through the
//! relay to the consumer. Without the `opentelemetry` feature there is no current context to
//! read and spans get no links; the relay's `tracing` spans are there either way.

use crate::TraceContext;

impl TraceContext {
    /// The context of the current `tracing` span, when it belongs to an OpenTelemetry trace
    /// (the `opentelemetry` feature, with a `tracing-opentelemetry` layer installed); else
    /// `None`. [`NewMessage::new`](crate::NewMessage::new) calls it.
    pub fn current() -> Option<TraceContext> {
        #[cfg(feature = "opentelemetry")]
        {
            otel::current()
        }
        #[cfg(not(feature = "opentelemetry"))]
        {
            None
        }
    }
}

/// Links `span` to the trace context of each message (OpenTelemetry span links), so the
/// relay's claim, publish and settle spans are found from the writer's trace.
#[cfg(feature = "runner")]
pub(crate) fn link_messages(span: &tracing::Span, messages: &[crate::Message]) {
    #[cfg(feature = "opentelemetry")]
    otel::link(span, messages);
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, messages);
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::TraceContext;

    pub(super) fn current() -> Option<TraceContext> {
        let context = tracing::Span::current().context();
        let span = context.span();
        let span_context = span.span_context();
        if !span_context.is_valid() {
            return None;
        }
        let tracestate = span_context.trace_state().header();
        Some(TraceContext {
            traceparent: format!(
                "00-{}-{}-{:02x}",
                span_context.trace_id(),
                span_context.span_id(),
                span_context.trace_flags().to_u8()
            ),
            tracestate: (!tracestate.is_empty()).then_some(tracestate),
        })
    }

    /// A `traceparent` (version 00) as a remote span context; `None` when it does not parse.
    #[cfg_attr(not(feature = "runner"), allow(dead_code))]
    pub(super) fn parse(context: &TraceContext) -> Option<SpanContext> {
        let mut parts = context.traceparent.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 {
            return None;
        }
        let flags = u8::from_str_radix(flags, 16).ok()?;
        let state = (context.tracestate.as_deref())
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        let span_context = SpanContext::new(
            TraceId::from_hex(trace).ok()?,
            SpanId::from_hex(span).ok()?,
            TraceFlags::new(flags),
            true,
            state,
        );
        span_context.is_valid().then_some(span_context)
    }

    #[cfg(feature = "runner")]
    pub(super) fn link(span: &tracing::Span, messages: &[crate::Message]) {
        for message in messages {
            if let Some(context) = message.trace_context.as_ref().and_then(parse) {
                span.add_link(context);
            }
        }
    }
}

#[cfg(all(test, feature = "opentelemetry"))]
mod tests {
    use super::otel::parse;
    use crate::TraceContext;

    #[test]
    fn traceparent_round_trips_and_bad_ones_are_ignored() {
        let good = TraceContext {
            traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
            tracestate: Some("vendor=x".into()),
        };
        let context = parse(&good).expect("a valid traceparent");
        assert_eq!(
            context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(context.span_id().to_string(), "00f067aa0ba902b7");
        assert!(context.is_sampled() && context.is_remote());
        assert_eq!(context.trace_state().header(), "vendor=x");
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-xyz-00f067aa0ba902b7-01",
        ] {
            let context = TraceContext {
                traceparent: bad.into(),
                tracestate: None,
            };
            assert!(parse(&context).is_none(), "{bad} parsed");
        }
    }
}
