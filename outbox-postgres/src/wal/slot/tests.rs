use super::*;
use crate::wal::{logical_server, run_all};

/// The table, its publication and slot, as a WAL-mode outbox would have them.
const SETUP: &[&str] = &[
    "CREATE TABLE ob (seq bigserial PRIMARY KEY, key text)",
    "CREATE PUBLICATION p FOR TABLE ob",
    "SELECT 1 FROM pg_create_logical_replication_slot('s', 'pgoutput')",
];

/// The `seq` of each insert of each transaction.
fn seqs(txns: &[Txn]) -> Vec<Vec<String>> {
    txns.iter()
        .map(|t| {
            t.inserts
                .iter()
                .map(|i| String::from_utf8_lossy(i.values[0].as_deref().unwrap_or(b"?")).into())
                .collect()
        })
        .collect()
}

async fn peeked(conn: &mut PgConnection) -> Vec<Txn> {
    peek(conn, "s", "p", 1000).await.expect("peek").txns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_arrive_in_commit_order_not_seq_order_and_rollbacks_never() {
    let (server, mut conn) = logical_server("wal-order", "").await;
    run_all(&mut conn, SETUP).await;
    let url = server.url("127.0.0.1", "postgres", "");
    let mut early = <PgConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("a second connection");
    // `early` takes seq 1 first and commits last; seq 2 commits in between; seq 3 rolls back.
    run_all(&mut early, &["BEGIN", "INSERT INTO ob (key) VALUES ('k')"]).await;
    run_all(
        &mut conn,
        &[
            "INSERT INTO ob (key) VALUES ('k')",
            "BEGIN",
            "INSERT INTO ob (key) VALUES ('k')",
            "ROLLBACK",
        ],
    )
    .await;
    run_all(&mut early, &["COMMIT"]).await;
    let txns = peeked(&mut conn).await;
    assert_eq!(seqs(&txns), [["2"], ["1"]], "{txns:?}");
    assert!(txns[0].end_lsn <= txns[1].commit_lsn, "{txns:?}");
    assert_eq!(
        (
            txns[0].inserts[0].relation.name.as_str(),
            txns[0].xid < txns[1].xid
        ),
        ("ob", false),
        "the later transaction id committed first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advancing_to_a_commit_keeps_its_transaction_and_to_its_end_confirms_it() {
    let (_server, mut conn) = logical_server("wal-advance", "").await;
    run_all(&mut conn, SETUP).await;
    let idle = peek(&mut conn, "s", "p", 1000).await.expect("peek");
    assert!(idle.txns.is_empty() && idle.flushed > 0, "{idle:?}");
    run_all(
        &mut conn,
        &[
            "INSERT INTO ob (key) VALUES ('a')",
            "INSERT INTO ob (key) VALUES ('b')",
        ],
    )
    .await;
    let txns = peeked(&mut conn).await;
    assert_eq!(seqs(&txns), [["1"], ["2"]]);
    assert_eq!(
        seqs(&peeked(&mut conn).await),
        [["1"], ["2"]],
        "a peek moves nothing"
    );

    advance(&mut conn, "s", txns[0].commit_lsn)
        .await
        .expect("advance");
    assert_eq!(
        seqs(&peeked(&mut conn).await),
        [["1"], ["2"]],
        "kept at its commit"
    );
    let at = advance(&mut conn, "s", txns[0].end_lsn)
        .await
        .expect("advance");
    assert_eq!(at, txns[0].end_lsn);
    assert_eq!(
        seqs(&peeked(&mut conn).await),
        [["2"]],
        "confirmed at its end"
    );
    let back = advance(&mut conn, "s", txns[0].commit_lsn).await;
    assert!(
        back.as_ref()
            .is_err_and(|e| e.to_string().contains("cannot advance")),
        "a slot does not move back: {back:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_larger_than_logical_decoding_work_mem_arrives_once_and_whole() {
    let (_server, mut conn) =
        logical_server("wal-large", "logical_decoding_work_mem = 64kB\n").await;
    run_all(&mut conn, SETUP).await;
    run_all(
        &mut conn,
        &["INSERT INTO ob (key) SELECT 'k' || n FROM generate_series(1, 20000) n"],
    )
    .await;
    // Asked for 5 changes: a peek stops only at a transaction's end.
    let txns = peek(&mut conn, "s", "p", 5).await.expect("peek").txns;
    let spilled: i64 = sqlx::query_scalar(
        "SELECT spill_txns FROM pg_stat_replication_slots WHERE slot_name = 's'",
    )
    .fetch_one(&mut conn)
    .await
    .expect("the slot's figures");
    assert_eq!(txns.len(), 1);
    let want: Vec<String> = (1..=20000).map(|n| n.to_string()).collect();
    assert_eq!(seqs(&txns)[0], want, "each row once, in insert order");
    assert!(
        spilled >= 1,
        "the transaction went past logical_decoding_work_mem"
    );
}

fn begin(lsn: u64) -> PgOutput {
    PgOutput::Begin {
        final_lsn: lsn,
        commit_time: 0,
        xid: 7,
    }
}

fn commit(lsn: u64) -> PgOutput {
    PgOutput::Commit {
        commit_lsn: lsn,
        end_lsn: lsn + 0x30,
        commit_time: 1,
    }
}

fn insert() -> PgOutput {
    PgOutput::Insert {
        relation: 1,
        values: vec![None],
    }
}

fn relation() -> PgOutput {
    PgOutput::Relation(Relation {
        id: 1,
        namespace: "public".into(),
        name: "ob".into(),
        columns: vec!["seq".into()],
    })
}

fn message(transactional: bool) -> PgOutput {
    PgOutput::Message {
        transactional,
        lsn: 0,
        prefix: "outbox:public.ob".into(),
        content: b"m".to_vec(),
    }
}

#[test]
fn messages_out_of_place_are_refused_with_where_they_came() {
    let cases: [(&str, Vec<PgOutput>, &str); 5] = [
        (
            "insert, no relation",
            vec![begin(16), insert()],
            "a table it never described",
        ),
        (
            "insert, no begin",
            vec![relation(), insert()],
            "an insert outside a transaction",
        ),
        (
            "commit, no begin",
            vec![commit(16)],
            "a commit outside a transaction",
        ),
        (
            "begin twice",
            vec![begin(16), begin(32)],
            "a begin inside a transaction",
        ),
        (
            "another commit",
            vec![begin(16), commit(32)],
            "a commit of another transaction",
        ),
    ];
    for (case, messages, says) in cases {
        let mut assembler = Assembler::default();
        let error = messages
            .into_iter()
            .try_for_each(|m| assembler.push(0x1_0000_0010, m).map(drop))
            .expect_err(case);
        assert_eq!(error.kind(), ErrorKind::Schema, "{case}");
        let said = error.to_string();
        assert!(
            said.contains(says) && said.contains("at 1/10"),
            "{case}: {said}"
        );
    }
}

#[test]
fn a_transaction_keeps_its_inserts_and_messages_and_lone_messages_are_passed_over() {
    let mut assembler = Assembler::default();
    let mut done = Vec::new();
    for m in [
        message(false),
        relation(),
        begin(16),
        insert(),
        message(true),
        insert(),
        commit(16),
    ] {
        done.extend(assembler.push(16, m).expect("in place"));
    }
    let [txn] = done.as_slice() else {
        panic!("one transaction: {done:?}");
    };
    assert_eq!(
        (
            txn.commit_lsn,
            txn.end_lsn,
            txn.commit_time,
            txn.inserts.len()
        ),
        (16, 16 + 0x30, 1, 2)
    );
    assert_eq!(
        txn.messages,
        [("outbox:public.ob".to_string(), b"m".to_vec())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slots_figures_show_the_wal_it_keeps_and_a_missing_or_foreign_slot_is_refused() {
    let (_server, mut conn) = logical_server("wal-check", "").await;
    run_all(&mut conn, SETUP).await;
    let fresh = check(&mut conn, "s").await.expect("a fresh slot");
    assert_eq!(fresh.wal_status, "reserved");
    assert_eq!(fresh.safe_bytes, None, "no max_slot_wal_keep_size");
    // 2 MB of WAL written elsewhere: kept for the slot until it is advanced.
    run_all(
        &mut conn,
        &[
            "CREATE TABLE other (filler text)",
            "INSERT INTO other SELECT repeat('x', 1000) FROM generate_series(1, 2000)",
        ],
    )
    .await;
    let behind = check(&mut conn, "s").await.expect("the slot");
    assert!(behind.unconfirmed_bytes > 2_000_000, "{behind:?}");
    assert!(
        behind.retained_bytes >= behind.unconfirmed_bytes,
        "{behind:?}"
    );
    let head = peek(&mut conn, "s", "p", 1000).await.expect("peek");
    assert!(
        head.txns.is_empty(),
        "nothing of the publication's: {head:?}"
    );
    advance(&mut conn, "s", head.flushed)
        .await
        .expect("advance");
    let current = check(&mut conn, "s").await.expect("the slot");
    assert!(current.unconfirmed_bytes < 100_000, "{current:?}");
    assert_eq!(current.confirmed, head.flushed);

    run_all(
        &mut conn,
        &[
            "SELECT 1 FROM pg_create_logical_replication_slot('decoder', 'test_decoding')",
            "SELECT 1 FROM pg_create_physical_replication_slot('physical')",
        ],
    )
    .await;
    for (slot, kind, says) in [
        (
            "nowhere",
            ErrorKind::Schema,
            r#"replication slot "nowhere" does not exist"#,
        ),
        (
            "decoder",
            ErrorKind::Config,
            "(plugin test_decoding, this database)",
        ),
        ("physical", ErrorKind::Config, "(a physical slot)"),
    ] {
        let error = check(&mut conn, slot).await.expect_err(slot);
        assert_eq!(error.kind(), kind, "{slot}: {error}");
        assert!(error.to_string().contains(says), "{slot}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_past_max_slot_wal_keep_size_is_lost_and_refused_naming_it() {
    let (_server, mut conn) = logical_server("wal-lost", "max_slot_wal_keep_size = 1MB\n").await;
    run_all(&mut conn, SETUP).await;
    let kept = check(&mut conn, "s").await.expect("a fresh slot");
    assert!(kept.safe_bytes.is_some(), "{kept:?}");
    // Several 16 MB segments past the limit, and a checkpoint that removes them.
    run_all(
        &mut conn,
        &[
            "CREATE TABLE other (filler text)",
            "INSERT INTO other SELECT repeat(md5(n::text), 32) FROM generate_series(1, 60000) n",
            "SELECT pg_switch_wal()",
            "CHECKPOINT",
        ],
    )
    .await;
    let error = check(&mut conn, "s").await.expect_err("a lost slot");
    assert_eq!(error.kind(), ErrorKind::Schema);
    let said = error.to_string();
    for part in [
        r#"replication slot "s" is lost"#,
        "max_slot_wal_keep_size = 1MB",
        &format!("committed after {}", Lsn(kept.confirmed)),
    ] {
        assert!(said.contains(part), "{part}: {said}");
    }
}
