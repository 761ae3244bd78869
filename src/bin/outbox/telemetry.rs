//! Logs and traces: `tracing` to standard error (text or JSON, `RUST_LOG` overrides the
//! level), and with the `otlp` feature and `observability.otlp_endpoint`, the relay's spans
//! exported over OTLP (HTTP/protobuf) to a collector.

use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::{ConfigError, LogFormat, Observability};

/// What must outlive the program's work: the trace exporter, flushed on [`Telemetry::shutdown`].
pub struct Telemetry {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans still buffered.
    pub fn shutdown(self) {
        #[cfg(feature = "otlp")]
        if let Some(provider) = self.provider
            && let Err(error) = provider.shutdown()
        {
            eprintln!("outbox: could not send the last spans: {error}");
        }
    }
}

/// Installs the subscriber. An `otlp_endpoint` in a build without the `otlp` feature, or one
/// that is not a URL, is a configuration error.
pub fn init(observability: &Observability) -> Result<Telemetry, ConfigError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&observability.log_level));
    // Colour codes only on a terminal: a file or a journal would keep them as noise.
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let fmt = match observability.log_format {
        LogFormat::Text => fmt.fmt_fields(printable_fields()).boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    let registry = tracing_subscriber::registry().with(filter).with(fmt);
    #[cfg(feature = "otlp")]
    {
        let provider = match &observability.otlp_endpoint {
            Some(endpoint) => Some(otlp::provider(endpoint)?),
            None => None,
        };
        let layer = provider.as_ref().map(|provider| {
            use opentelemetry::trace::TracerProvider as _;
            tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox"))
        });
        let _ = registry.with(layer).try_init();
        Ok(Telemetry { provider })
    }
    #[cfg(not(feature = "otlp"))]
    {
        if observability.otlp_endpoint.is_some() {
            return Err(ConfigError(
                "observability.otlp_endpoint: this build cannot export traces; build with the \
                 cargo feature `otlp`, or remove the setting"
                    .into(),
            ));
        }
        let _ = registry.try_init();
        Ok(Telemetry {})
    }
}

/// The text format's fields (`message`, then `name=value`, space-separated) with control
/// characters and bidirectional-text controls escaped ([`outbox::printable`]): topics, keys
/// and broker errors come from whoever writes messages, who must not be able to forge a log
/// line with a newline or drive a terminal that follows the log. JSON escapes by itself.
fn printable_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = format!("{value:?}");
        let text = outbox::printable(&text);
        match field.name() {
            "message" => write!(writer, "{text}"),
            name => write!(writer, "{name}={text}"),
        }
    })
    .delimited(" ")
}

#[cfg(feature = "otlp")]
mod otlp {
    use opentelemetry_otlp::{SpanExporter, WithExportConfig};
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use crate::config::ConfigError;

    /// A tracer provider exporting in batches, from a thread of its own, to the collector at
    /// `endpoint` (its base URL: spans go to `<endpoint>/v1/traces`). The service name is
    /// `outbox` unless `OTEL_SERVICE_NAME` says otherwise; other `OTEL_*` variables apply as
    /// the OpenTelemetry SDK reads them.
    pub(super) fn provider(endpoint: &str) -> Result<SdkTracerProvider, ConfigError> {
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(ConfigError(format!(
                "observability.otlp_endpoint: `{endpoint}` is not an http:// or https:// URL \
                 (the collector's OTLP/HTTP address, e.g. http://127.0.0.1:4318)"
            )));
        }
        let traces = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
        let exporter = SpanExporter::builder()
            .with_http()
            .with_endpoint(traces)
            .build()
            .map_err(|e| ConfigError(format!("observability.otlp_endpoint: {e}")))?;
        let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "outbox".into());
        Ok(SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name(service).build())
            .build())
    }
}
