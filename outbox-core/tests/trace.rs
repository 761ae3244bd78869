//! A trace started in an application's span continues through the outbox: the message
//! carries the span's context, the relay's claim, batch and publish spans link to it (the
//! settlement is a span within the batch), and the sink is handed the same context to put in
//! the broker's headers. Exported with the OpenTelemetry SDK's in-memory exporter.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_core::memory::{MemorySink, MemoryStorage};
use outbox_core::{CancellationToken, NewMessage, Worker, WorkerConfig};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

#[tokio::test]
async fn a_trace_continues_from_the_writer_through_the_relay() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    // One thread (the test's runtime is single-threaded): the worker's spans go here too.
    let _subscriber = tracing::subscriber::set_default(subscriber);

    let storage = Arc::new(MemoryStorage::new(true));
    let sink = Arc::new(MemorySink::new());
    let app_trace = {
        let span = tracing::info_span!("checkout");
        let _entered = span.enter();
        storage.enqueue(NewMessage::new("orders", "paid").key("o-1"));
        span.context().span().span_context().trace_id()
    };
    // Outside any span, a message has no context.
    assert!(NewMessage::new("orders", "x").trace_context.is_none());

    let config = WorkerConfig {
        poll_interval: Duration::from_millis(10),
        ..WorkerConfig::new("traced")
    };
    let worker = Worker::new(config, storage.clone(), sink.clone()).expect("worker");
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    for _ in 0..500 {
        if !sink.published().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    run.await.expect("worker task");

    let published = sink.published();
    assert_eq!(published.len(), 1, "the message was not relayed");
    let traceparent = &published[0]
        .trace_context
        .as_ref()
        .expect("the message carries the writer's context")
        .traceparent;
    assert!(
        traceparent.starts_with(&format!("00-{app_trace}-")),
        "{traceparent} is not in trace {app_trace}"
    );

    provider.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().expect("spans");
    let linked = |name: &str| -> &SpanData {
        spans
            .iter()
            .find(|s| {
                s.name == name
                    && (s.links.links.iter()).any(|l| l.span_context.trace_id() == app_trace)
            })
            .unwrap_or_else(|| {
                let names: Vec<_> = spans.iter().map(|s| s.name.to_string()).collect();
                panic!("no {name} span linked to the writer's trace among {names:?}")
            })
    };
    linked("outbox.claim");
    linked("outbox.publish");
    let batch = linked("outbox.batch");
    assert!(
        spans
            .iter()
            .any(|s| s.name == "outbox.settle" && s.parent_span_id == batch.span_context.span_id()),
        "the settlement is not a span within the batch"
    );
}
