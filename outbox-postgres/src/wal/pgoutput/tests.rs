//! The messages below are what PostgreSQL 15.20 sent through
//! `pg_logical_slot_peek_binary_changes(slot, NULL, NULL, 'proto_version', '1',
//! 'publication_names', p, 'messages', 'true')` for a table
//! `ob(seq bigserial primary key, id uuid, topic text, key text, payload bytea, headers jsonb)`
//! (`encode(data, 'hex')`).

use super::*;

/// `BEGIN`, xid 726.
const BEGIN: &str = "42000000000153e480000304d2abba3bf6000002d6";
/// The table `public.ob` and its six columns.
const RELATION: &str = "52000040017075626c6963006f6200640006017365710000000014ffffffff0069640000000b86ffffffff00746f7069630000000019ffffffff006b65790000000019ffffffff007061796c6f61640000000011ffffffff00686561646572730000000edaffffffff";
/// `(1, '0193a0b4-…-0001', 'orders', 'k1', '\x00ff', '{"h": "1"}')`.
const INSERT: &str = "49000040014e0006740000000131740000002430313933613062342d303030302d373030302d383030302d30303030303030303030303174000000066f726465727374000000026b3174000000065c7830306666740000000a7b2268223a202231227d";
/// `(2, '0193a0b4-…-0002', 'orders', NULL, '\x', NULL)`.
const INSERT_NULLS: &str = "49000040014e0006740000000132740000002430313933613062342d303030302d373030302d383030302d30303030303030303030303274000000066f72646572736e74000000025c786e";
/// `COMMIT` of xid 726.
const COMMIT: &str = "4300000000000153e480000000000153e4b0000304d2abba3bf6";
/// `pg_logical_emit_message(true, 'outbox:public.ob', 'hello')`.
const MESSAGE: &str = "4d01000000000153e4f86f7574626f783a7075626c69632e6f62000000000568656c6c6f";
/// `pg_logical_emit_message(false, 'other', 'x')`.
const LONE_MESSAGE: &str = "4d00000000000153e5686f74686572000000000178";
/// An `UPDATE`, a `DELETE` and a `TRUNCATE` of the table.
const UPDATE: &str = "55000040014e0006740000000131740000002430313933613062342d303030302d373030302d383030302d30303030303030303030303174000000066f726465727374000000026b3274000000065c7830306666740000000a7b2268223a202231227d";
const DELETE: &str = "44000040014b00067400000001326e6e6e6e6e";
const TRUNCATE: &str = "54000000010000004001";

fn bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

fn decoded(hex: &str) -> PgOutput {
    decode(&bytes(hex)).unwrap_or_else(|e| panic!("{hex}: {e}"))
}

fn text(value: &str) -> Option<Vec<u8>> {
    Some(value.as_bytes().to_vec())
}

#[test]
fn a_transaction_decodes_with_its_positions() {
    assert_eq!(
        decoded(BEGIN),
        PgOutput::Begin {
            final_lsn: 0x153_E480,
            commit_time: 0x0003_04d2_abba_3bf6,
            xid: 726,
        }
    );
    assert_eq!(
        decoded(COMMIT),
        PgOutput::Commit {
            commit_lsn: 0x153_E480,
            end_lsn: 0x153_E4B0,
            commit_time: 0x0003_04d2_abba_3bf6,
        }
    );
}

#[test]
fn a_relation_names_its_columns_in_order() {
    assert_eq!(
        decoded(RELATION),
        PgOutput::Relation(Relation {
            id: 16385,
            namespace: "public".into(),
            name: "ob".into(),
            columns: ["seq", "id", "topic", "key", "payload", "headers"]
                .map(String::from)
                .to_vec(),
        })
    );
}

#[test]
fn an_insert_gives_its_values_as_text_and_nulls_as_none() {
    assert_eq!(
        decoded(INSERT),
        PgOutput::Insert {
            relation: 16385,
            values: vec![
                text("1"),
                text("0193a0b4-0000-7000-8000-000000000001"),
                text("orders"),
                text("k1"),
                text("\\x00ff"),
                text("{\"h\": \"1\"}"),
            ],
        }
    );
    assert_eq!(
        decoded(INSERT_NULLS),
        PgOutput::Insert {
            relation: 16385,
            values: vec![
                text("2"),
                text("0193a0b4-0000-7000-8000-000000000002"),
                text("orders"),
                None,
                text("\\x"),
                None,
            ],
        }
    );
}

#[test]
fn a_logical_message_keeps_its_prefix_content_and_whether_it_was_transactional() {
    assert_eq!(
        decoded(MESSAGE),
        PgOutput::Message {
            transactional: true,
            lsn: 0x153_E4F8,
            prefix: "outbox:public.ob".into(),
            content: b"hello".to_vec(),
        }
    );
    assert_eq!(
        decoded(LONE_MESSAGE),
        PgOutput::Message {
            transactional: false,
            lsn: 0x153_E568,
            prefix: "other".into(),
            content: b"x".to_vec(),
        }
    );
}

#[test]
fn changes_the_outbox_does_not_read_are_named_and_passed_over() {
    for (hex, kind) in [(UPDATE, b'U'), (DELETE, b'D'), (TRUNCATE, b'T')] {
        assert_eq!(decoded(hex), PgOutput::Other(kind), "{}", char::from(kind));
    }
}

#[test]
fn every_cut_short_message_is_an_error_that_names_the_field_never_a_panic() {
    for hex in [
        BEGIN,
        RELATION,
        INSERT,
        INSERT_NULLS,
        COMMIT,
        MESSAGE,
        LONE_MESSAGE,
    ] {
        let whole = bytes(hex);
        for end in 0..whole.len() {
            let error = decode(&whole[..end]).expect_err("a message cut short");
            let said = error.to_string();
            assert!(
                said.contains(error.field) && said.contains("pgoutput protocol 1"),
                "{hex} cut at {end}: {said}"
            );
        }
    }
}

#[test]
fn what_protocol_1_does_not_send_is_refused_with_what_was_found() {
    let mut left_over = bytes(COMMIT);
    left_over.push(0);
    let mut binary_value = bytes(INSERT_NULLS);
    let kind = binary_value.len() - 1; // the last value, a NULL: made a binary one
    binary_value[kind] = b'b';
    let mut update_marker = bytes(INSERT);
    update_marker[5] = b'K';
    let cases: [(&str, Vec<u8>, &str); 5] = [
        (
            "empty",
            vec![],
            "an empty pgoutput message: the message type at byte 0: no bytes",
        ),
        (
            "unknown type",
            vec![b'S', 0, 0],
            "the message type at byte 0: unknown type 0x53",
        ),
        (
            "left over",
            left_over,
            "the end of the message at byte 26: 1 bytes left over",
        ),
        (
            "binary value",
            binary_value,
            "a value's kind at byte 74: 0x62, not `t`",
        ),
        (
            "marker",
            update_marker,
            "the new-tuple marker at byte 5: 0x4b, not `N`",
        ),
    ];
    for (case, message, says) in cases {
        let error = decode(&message).expect_err(case).to_string();
        assert!(error.contains(says), "{case}: {error}");
    }
}

/// What a live server with `wal_level = logical` sends for a transaction of two inserts, a
/// logical message and a rolled-back insert decodes, in commit order, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_servers_changes_decode_in_commit_order() {
    use sqlx::{Connection, Row};

    let (_server, mut conn) = crate::wal::logical_server("pgoutput", "").await;
    crate::wal::run_all(
        &mut conn,
        &[
            "CREATE TABLE ob (seq bigserial PRIMARY KEY, key text, payload bytea NOT NULL)",
            "CREATE PUBLICATION p FOR TABLE ob",
            "SELECT 1 FROM pg_create_logical_replication_slot('s', 'pgoutput')",
            "BEGIN",
            "INSERT INTO ob (key, payload) VALUES ('k', '\\x01'), (NULL, '\\x02')",
            "SELECT 1 FROM pg_logical_emit_message(true, 'outbox:public.ob', 'm')",
            "COMMIT",
            "BEGIN",
            "INSERT INTO ob (key, payload) VALUES ('rolled back', '\\x03')",
            "ROLLBACK",
        ],
    )
    .await;
    let rows = sqlx::query(
        "SELECT data FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, \
         'proto_version', '1', 'publication_names', 'p', 'messages', 'true')",
    )
    .fetch_all(&mut conn)
    .await
    .expect("the slot's changes");
    let decoded: Vec<PgOutput> = rows
        .iter()
        .map(|row| decode(&row.get::<Vec<u8>, _>("data")).expect("decodes"))
        .collect();
    let [
        PgOutput::Begin { final_lsn, xid, .. },
        PgOutput::Relation(relation),
        PgOutput::Insert { values: first, .. },
        PgOutput::Insert { values: second, .. },
        PgOutput::Message {
            transactional: true,
            prefix,
            content,
            ..
        },
        PgOutput::Commit {
            commit_lsn,
            end_lsn,
            ..
        },
    ] = decoded.as_slice()
    else {
        panic!("one transaction of two inserts and a message, nothing rolled back: {decoded:?}");
    };
    assert!(*xid > 0 && commit_lsn == final_lsn && end_lsn > commit_lsn);
    assert_eq!(
        (relation.namespace.as_str(), relation.name.as_str()),
        ("public", "ob")
    );
    assert_eq!(relation.columns, ["seq", "key", "payload"]);
    assert_eq!(first, &[text("1"), text("k"), text("\\x01")]);
    assert_eq!(second, &[text("2"), None, text("\\x02")]);
    assert_eq!(
        (prefix.as_str(), content.as_slice()),
        ("outbox:public.ob", &b"m"[..])
    );
    conn.close().await.ok();
}
