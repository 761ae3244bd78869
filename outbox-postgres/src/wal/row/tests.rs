use std::sync::Arc;

use outbox_core::{NewMessage, TraceContext};
use sqlx::Row;

use super::*;
use crate::OutboxTable;
use crate::wal::pgoutput::Relation;
use crate::wal::slot::peek;
use crate::wal::{logical_server, run_all};

/// Settings unlike the ones [`SESSION`] pins, as a role's defaults might be.
const OTHER_SETTINGS: &[&str] = &[
    "SET DateStyle = 'SQL, DMY'",
    "SET TimeZone = 'Asia/Kolkata'",
    "SET bytea_output = 'escape'",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_enqueued_into_the_outbox_table_reads_back_whole_from_the_slot() {
    let (_server, mut conn) = logical_server("wal-row", "").await;
    let table = OutboxTable::new("public", "ob").expect("names");
    table.migrate(&mut conn).await.expect("migrate");
    run_all(
        &mut conn,
        &[
            "CREATE PUBLICATION p FOR TABLE public.ob",
            "SELECT 1 FROM pg_create_logical_replication_slot('s', 'pgoutput')",
        ],
    )
    .await;
    let trace = TraceContext {
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        tracestate: Some("vendor=1".into()),
    };
    let sent = [
        NewMessage::new("orders", vec![0u8, 0xff, b'\\', b'x'])
            .key("k\u{e9}")
            .header("h", "1")
            .trace_context(trace.clone()),
        NewMessage::new("users", "plain"),
    ];
    table.enqueue_many(&mut conn, &sent).await.expect("enqueue");
    let stored = sqlx::query("SELECT seq, id, created_at FROM public.ob ORDER BY seq")
        .fetch_all(&mut conn)
        .await
        .expect("the rows");

    run_all(&mut conn, OTHER_SETTINGS).await;
    let txns = peek(&mut conn, "s", "p", 100).await.expect("peek").txns;
    let unpinned = message(&txns[0].inserts[0]).expect_err("dates and bytea in other forms");
    assert_eq!(unpinned.kind(), ErrorKind::Permanent, "{unpinned}");

    run_all(&mut conn, &[SESSION]).await;
    let txns = peek(&mut conn, "s", "p", 100).await.expect("peek").txns;
    let read: Vec<(i64, Message)> = txns[0]
        .inserts
        .iter()
        .map(|i| message(i).expect("decodes"))
        .collect();
    assert_eq!(read.len(), 2);
    for ((seq, got), (row, want)) in read.iter().zip(stored.iter().zip(&sent)) {
        assert_eq!(*seq, row.get::<i64, _>("seq"));
        assert_eq!(got.id, row.get::<Uuid, _>("id"));
        assert_eq!(got.created_at, row.get::<DateTime<Utc>, _>("created_at"));
        assert_eq!(
            (
                &got.topic,
                &got.key,
                &got.payload,
                &got.headers,
                got.attempts
            ),
            (&want.topic, &want.key, &want.payload, &want.headers, 0)
        );
        assert_eq!(got.trace_context, want.trace_context);
    }
    assert_eq!(read[0].1.trace_context, Some(trace));
}

fn insert(columns: &[&str], values: &[Option<&str>]) -> Insert {
    Insert {
        relation: Arc::new(Relation {
            id: 1,
            namespace: "public".into(),
            name: "ob".into(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
        }),
        values: values
            .iter()
            .map(|v| v.map(|t| t.as_bytes().to_vec()))
            .collect(),
    }
}

const COLUMNS: &[&str] = &[
    "seq",
    "id",
    "topic",
    "partition_key",
    "payload",
    "headers",
    "traceparent",
    "tracestate",
    "created_at",
    "attempts",
];

/// A good row's values, with `column` set to `value`.
fn row_with(column: &str, value: Option<&str>) -> Insert {
    let mut values = [
        Some("7"),
        Some("0193a0b4-0000-7000-8000-000000000001"),
        Some("t"),
        None,
        Some("\\x6869"),
        Some("{}"),
        None,
        None,
        Some("2026-12-04 19:30:00.123456+00"),
        Some("0"),
    ];
    let index = COLUMNS.iter().position(|c| *c == column).expect("a column");
    values[index] = value;
    insert(COLUMNS, &values)
}

#[test]
fn a_good_row_decodes_and_each_bad_value_is_refused_naming_the_row_and_column() {
    let (seq, good) = message(&row_with("partition_key", Some("k"))).expect("a good row");
    assert_eq!(
        (seq, good.payload.as_slice(), good.key.as_deref()),
        (7, &b"hi"[..], Some("k"))
    );
    assert_eq!(
        good.created_at.to_rfc3339(),
        "2026-12-04T19:30:00.123456+00:00"
    );
    let cases = [
        (
            "seq",
            Some("seven"),
            "column seq is missing or does not parse",
        ),
        (
            "id",
            Some("not-a-uuid"),
            "outbox row seq 7 of public.ob: column id is not a UUID",
        ),
        ("topic", None, "column topic is missing"),
        (
            "payload",
            Some("\\x6"),
            "column payload is not bytea in hex",
        ),
        ("payload", Some("hi"), "column payload is not bytea in hex"),
        ("headers", Some("{"), "column headers is not JSON"),
        (
            "created_at",
            Some("04/12/2026 19:30:00 UTC"),
            "column created_at is not a timestamp",
        ),
        ("attempts", Some("x"), "column attempts is not an integer"),
    ];
    for (column, value, says) in cases {
        let error = message(&row_with(column, value)).expect_err(column);
        assert_eq!(error.kind(), ErrorKind::Permanent, "{column}");
        assert!(
            error.to_string().contains(says),
            "{column} {value:?}: {error}"
        );
    }
    let no_seq = insert(&["id"], &[Some("x")]);
    assert!(
        message(&no_seq).is_err(),
        "a table without the outbox's columns"
    );
}
