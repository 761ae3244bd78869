//! The relay exports its spans over OTLP/HTTP to the collector named by
//! `observability.otlp_endpoint`, and they link to the trace context the writer gave the
//! message: an in-process receiver decodes what arrives.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;

use super::{ConfigFile, RelayProcess, outbox_with_stdin, text};

/// Every request the receiver was sent.
type Received = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

/// An OTLP/HTTP trace receiver on a free port: its base URL and what it receives.
async fn receiver() -> (String, Received) {
    let received: Received = Arc::default();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post({
            let received = received.clone();
            move |body: axum::body::Bytes| async move {
                let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                received.lock().expect("lock").push(request);
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_exports_spans_linked_to_the_writers_trace() {
    let (endpoint, received) = receiver().await;
    let dir = std::env::temp_dir().join(outbox_tests::unique_name("outbox_otlp"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let delivered = dir.join("delivered.jsonl");
    let config = ConfigFile::new(&format!(
        "[storage]\ntype = \"sqlite\"\npath = \"{}\"\nmigrate = true\n{}\
         [observability]\notlp_endpoint = \"{endpoint}\"\n\
         [sink]\ntype = \"file\"\npath = \"{}\"\n",
        dir.join("app.db").display(),
        super::FAST_RELAY,
        delivered.display()
    ));
    assert!(super::outbox(&config.path, &["migrate"]).status.success());
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let line = format!(
        "{{\"topic\":\"orders\",\"payload\":\"paid\",\"traceparent\":\"00-{trace}-00f067aa0ba902b7-01\"}}\n"
    );
    let enqueued = outbox_with_stdin(&config.path, &["enqueue", "--stdin"], &line);
    assert!(enqueued.status.success(), "{}", text(&enqueued.stderr));

    let relay = RelayProcess::start(&config.path);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string(&delivered)
        .unwrap_or_default()
        .lines()
        .count()
        < 1
    {
        assert!(Instant::now() < deadline, "the message was not delivered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A graceful stop sends the spans still buffered.
    assert_eq!(relay.terminate().0, Some(0));

    let requests = received.lock().expect("lock").clone();
    let resources: Vec<_> = requests.iter().flat_map(|r| &r.resource_spans).collect();
    assert!(!resources.is_empty(), "nothing was exported");
    let service = resources[0]
        .resource
        .as_ref()
        .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
        .and_then(|a| a.value.as_ref())
        .map(|v| format!("{:?}", v.value));
    assert!(
        service.as_deref().is_some_and(|s| s.contains("\"outbox\"")),
        "{service:?}"
    );
    let spans: Vec<_> = resources
        .iter()
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| &s.spans)
        .collect();
    let trace_id = (0..16)
        .map(|i| u8::from_str_radix(&trace[2 * i..2 * i + 2], 16).expect("hex"))
        .collect::<Vec<u8>>();
    for name in ["outbox.claim", "outbox.batch", "outbox.publish"] {
        assert!(
            spans
                .iter()
                .any(|s| s.name == name && s.links.iter().any(|l| l.trace_id == trace_id)),
            "no {name} span linked to the writer's trace among {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
    }
    assert!(spans.iter().any(|s| s.name == "outbox.settle"));
    let line = std::fs::read_to_string(&delivered).expect("delivered");
    assert!(
        line.contains(trace),
        "the sink did not carry the context: {line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
