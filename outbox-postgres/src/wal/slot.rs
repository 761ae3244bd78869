//! Reading a logical replication slot through PostgreSQL's SQL functions: a peek
//! (`pg_logical_slot_peek_binary_changes`, which leaves the slot where it is) returns what
//! was committed past the slot's confirmed position, in commit order, whole transactions
//! only; an advance (`pg_replication_slot_advance`) confirms. A transaction comes back on
//! every peek until the slot is advanced to its `end_lsn`; advancing to its `commit_lsn`
//! keeps it (docs/design/wal-mode.md, §0).

use std::collections::HashMap;
use std::sync::Arc;

use outbox_core::{Error, ErrorKind, Result};
use sqlx::{PgConnection, Row};

use super::pgoutput::{self, PgOutput, Relation};
use crate::error::db_error;

/// A committed transaction as the slot gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Txn {
    /// The transaction id.
    pub(crate) xid: u32,
    /// Where its commit record starts: transactions come in this order.
    pub(crate) commit_lsn: u64,
    /// Just past its commit record: advancing the slot here confirms the transaction.
    pub(crate) end_lsn: u64,
    /// Commit time, microseconds since 2000-01-01 00:00 UTC.
    pub(crate) commit_time: i64,
    /// The rows it inserted into the published tables, in the order it inserted them.
    pub(crate) inserts: Vec<Insert>,
    /// The logical messages it wrote (`pg_logical_emit_message(true, …)`), as
    /// `(prefix, content)`.
    pub(crate) messages: Vec<(String, Vec<u8>)>,
}

/// A row inserted into a published table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Insert {
    /// The table, with its column names.
    pub(crate) relation: Arc<Relation>,
    /// The values in the relation's column order, as text; `None` for NULL.
    pub(crate) values: Vec<Option<Vec<u8>>>,
}

/// Puts a peek's messages together into transactions. Relations are sent once per decoding
/// session (every peek is one), before the first insert that needs them.
#[derive(Default)]
pub(crate) struct Assembler {
    relations: HashMap<u32, Arc<Relation>>,
    open: Option<Txn>,
}

impl Assembler {
    /// Takes the next message of the slot; returns the transaction it completes, if any.
    /// A message out of place (an insert outside a transaction, an unknown relation) is a
    /// `Schema` error that names the position: the slot is not what this relay expects.
    pub(crate) fn push(&mut self, lsn: u64, message: PgOutput) -> Result<Option<Txn>> {
        let out_of_place = |what: &str| {
            Error::new(
                ErrorKind::Schema,
                format!(
                    "postgres: the replication slot sent {what} at {} (expected pgoutput's \
                     begin, changes, commit)",
                    Lsn(lsn)
                ),
            )
        };
        match message {
            PgOutput::Begin {
                final_lsn,
                commit_time,
                xid,
            } => {
                if self.open.is_some() {
                    return Err(out_of_place("a begin inside a transaction"));
                }
                self.open = Some(Txn {
                    xid,
                    commit_lsn: final_lsn,
                    end_lsn: final_lsn,
                    commit_time,
                    inserts: Vec::new(),
                    messages: Vec::new(),
                });
            }
            PgOutput::Relation(relation) => {
                self.relations.insert(relation.id, Arc::new(relation));
            }
            PgOutput::Insert { relation, values } => {
                let Some(relation) = self.relations.get(&relation).cloned() else {
                    return Err(out_of_place("an insert into a table it never described"));
                };
                let Some(txn) = self.open.as_mut() else {
                    return Err(out_of_place("an insert outside a transaction"));
                };
                txn.inserts.push(Insert { relation, values });
            }
            PgOutput::Message {
                transactional,
                prefix,
                content,
                ..
            } => match (transactional, self.open.as_mut()) {
                (true, Some(txn)) => txn.messages.push((prefix, content)),
                (true, None) => return Err(out_of_place("a message outside a transaction")),
                // Written at once, outside any transaction: not atomic with a writer's
                // change, so never an outbox message.
                (false, _) => {}
            },
            PgOutput::Commit {
                commit_lsn,
                end_lsn,
                commit_time,
            } => {
                let Some(mut txn) = self.open.take() else {
                    return Err(out_of_place("a commit outside a transaction"));
                };
                if txn.commit_lsn != commit_lsn {
                    return Err(out_of_place("a commit of another transaction"));
                }
                txn.end_lsn = end_lsn;
                txn.commit_time = commit_time;
                return Ok(Some(txn));
            }
            PgOutput::Other(_) => {}
        }
        Ok(None)
    }
}

/// What one peek read.
#[derive(Debug)]
pub(crate) struct Peeked {
    /// The server's flush position when the peek began. A peek that returned fewer
    /// changes than asked has decoded every transaction committed before it.
    pub(crate) flushed: u64,
    /// The transactions, whole, in commit order.
    pub(crate) txns: Vec<Txn>,
}

/// Peeks at most about `changes` changes (whole transactions: one larger transaction
/// comes whole) of `slot` for `publication`, without moving the slot.
pub(crate) async fn peek(
    conn: &mut PgConnection,
    slot: &str,
    publication: &str,
    changes: i32,
) -> Result<Peeked> {
    let rows = sqlx::query(
        "WITH w AS MATERIALIZED (SELECT pg_current_wal_flush_lsn() AS w) \
         SELECT (w.w - '0/0'::pg_lsn)::bigint AS flushed, \
                (c.lsn - '0/0'::pg_lsn)::bigint AS lsn, c.data \
         FROM w LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes($1, w.w, $2, \
              'proto_version', '1', 'publication_names', $3, 'messages', 'true') c ON true",
    )
    .bind(slot)
    .bind(changes)
    .bind(publication)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| db_error(&format!("cannot read replication slot {slot:?}"), e))?;
    let mut flushed = 0;
    let mut assembler = Assembler::default();
    let mut txns = Vec::new();
    for row in rows {
        flushed = lsn_of(row.try_get("flushed"))?;
        let Some(data) = row.try_get::<Option<Vec<u8>>, _>("data").ok().flatten() else {
            continue; // nothing committed past the slot's position
        };
        let lsn = lsn_of(row.try_get("lsn"))?;
        let message = pgoutput::decode(&data).map_err(|e| {
            Error::new(
                ErrorKind::Schema,
                format!("postgres: replication slot {slot:?} at {}: {e}", Lsn(lsn)),
            )
        })?;
        txns.extend(assembler.push(lsn, message)?);
    }
    Ok(Peeked { flushed, txns })
}

/// Moves `slot` to `lsn`, confirming every transaction that ends at or before it; returns
/// where the slot stands (at most the server's flush position). A slot does not move back:
/// a position before where it stands is refused with the server's error (`minimum is …`).
pub(crate) async fn advance(conn: &mut PgConnection, slot: &str, lsn: u64) -> Result<u64> {
    let moved_to: i64 = sqlx::query_scalar(
        "SELECT (end_lsn - '0/0'::pg_lsn)::bigint \
         FROM pg_replication_slot_advance($1, '0/0'::pg_lsn + $2::numeric)",
    )
    .bind(slot)
    .bind(i64::try_from(lsn).unwrap_or(i64::MAX))
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| db_error(&format!("cannot advance replication slot {slot:?}"), e))?;
    lsn_of(Ok(Some(moved_to)))
}

/// A slot as the server sees it, checked to be one WAL mode can read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotState {
    /// `reserved` or `extended` (the WAL it needs is kept), `unreserved` (about to be
    /// lost: past `max_slot_wal_keep_size`, kept until the next checkpoint).
    pub(crate) wal_status: String,
    /// Where the slot was last advanced to.
    pub(crate) confirmed: u64,
    /// The WAL the server keeps for the slot (from its restart position to the head).
    pub(crate) retained_bytes: i64,
    /// The WAL written since the slot's confirmed position.
    pub(crate) unconfirmed_bytes: i64,
    /// How much more WAL may be written before the slot is lost (`None`: no
    /// `max_slot_wal_keep_size`).
    pub(crate) safe_bytes: Option<i64>,
}

/// Reads `slot`'s state, refusing a slot WAL mode cannot read: missing or lost (`Schema`:
/// messages may be missing from it, so it is never read or silently replaced), or not a
/// permanent pgoutput slot of this database (`Config`).
pub(crate) async fn check(conn: &mut PgConnection, slot: &str) -> Result<SlotState> {
    let row = sqlx::query(
        "SELECT plugin, database = current_database() AS here, temporary, \
                coalesce(wal_status, 'lost') AS wal_status, \
                (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS confirmed, \
                (pg_current_wal_lsn() - restart_lsn)::bigint AS retained, \
                (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint AS unconfirmed, \
                safe_wal_size, current_setting('max_slot_wal_keep_size') AS keep \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| db_error(&format!("cannot read replication slot {slot:?}"), e))?;
    let Some(row) = row else {
        return Err(Error::new(
            ErrorKind::Schema,
            format!(
                "postgres: replication slot {slot:?} does not exist: WAL mode reads the \
                 outbox through it. A new slot would start now and miss what was committed \
                 before it, so none is created behind your back"
            ),
        ));
    };
    let field = |e| db_error(&format!("cannot read replication slot {slot:?}"), e);
    let plugin: Option<String> = row.try_get("plugin").map_err(field)?;
    let here: Option<bool> = row.try_get("here").map_err(field)?;
    let temporary: bool = row.try_get("temporary").map_err(field)?;
    if plugin.as_deref() != Some("pgoutput") || here != Some(true) || temporary {
        let what = match plugin {
            None => "a physical slot".to_string(),
            Some(plugin) => format!(
                "plugin {plugin}, {}{}",
                if here == Some(true) {
                    "this database"
                } else {
                    "another database"
                },
                if temporary { ", temporary" } else { "" },
            ),
        };
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "postgres: replication slot {slot:?} is not a permanent pgoutput slot of this \
                 database ({what}): give WAL mode a slot of its own"
            ),
        ));
    }
    let wal_status: String = row.try_get("wal_status").map_err(field)?;
    let confirmed = lsn_of(row.try_get("confirmed"))?;
    if wal_status == "lost" {
        let keep: String = row.try_get("keep").map_err(field)?;
        return Err(Error::new(
            ErrorKind::Schema,
            format!(
                "postgres: replication slot {slot:?} is lost (wal_status = lost: the server \
                 removed WAL the slot still needed; max_slot_wal_keep_size = {keep}): what \
                 was committed after {}, its last confirmed position, cannot be read from it, \
                 so the relay does not read it",
                Lsn(confirmed)
            ),
        ));
    }
    Ok(SlotState {
        wal_status,
        confirmed,
        retained_bytes: row
            .try_get::<Option<i64>, _>("retained")
            .map_err(field)?
            .unwrap_or(0),
        unconfirmed_bytes: row
            .try_get::<Option<i64>, _>("unconfirmed")
            .map_err(field)?
            .unwrap_or(0),
        safe_bytes: row.try_get("safe_wal_size").map_err(field)?,
    })
}

/// An LSN read as a bigint (`lsn - '0/0'`), which is never negative.
fn lsn_of(value: std::result::Result<Option<i64>, sqlx::Error>) -> Result<u64> {
    let value = value.map_err(|e| db_error("cannot read a WAL position", e))?;
    Ok(value.and_then(|v| u64::try_from(v).ok()).unwrap_or(0))
}

/// An LSN as PostgreSQL writes it (`16/B374D848`).
pub(crate) struct Lsn(pub(crate) u64);

impl std::fmt::Display for Lsn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

#[cfg(test)]
mod tests;
