//! The messages of PostgreSQL's `pgoutput` plugin, protocol version 1, as
//! `pg_logical_slot_peek_binary_changes` returns them (one message a row) and as a
//! replication connection's `XLogData` carries them. Only what the outbox reads is decoded
//! (begin, commit, relation, insert, logical message); the rest (origin, type, update,
//! delete, truncate) is named and passed over. Layouts: PostgreSQL's "Logical Replication
//! Message Formats" (protocol 1, no `streaming`, no `binary`: column values are text).
//!
//! A message that does not decode is an error that says which message, which field and at
//! which byte, never a panic: the caller decides what an undecodable change means.

use std::fmt;

/// One pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PgOutput {
    /// A transaction's first message.
    Begin {
        /// Where the transaction's commit record starts (its commit LSN).
        final_lsn: u64,
        /// Commit time, microseconds since 2000-01-01 00:00 UTC.
        commit_time: i64,
        /// The transaction id.
        xid: u32,
    },
    /// A transaction's last message.
    Commit {
        /// Where the commit record starts (the begin's `final_lsn`).
        commit_lsn: u64,
        /// Just past the commit record: confirming this position confirms the transaction.
        end_lsn: u64,
        /// Commit time, microseconds since 2000-01-01 00:00 UTC.
        commit_time: i64,
    },
    /// A table's columns, sent before its first change in a decoding session.
    Relation(Relation),
    /// A row inserted into the relation `relation`.
    Insert {
        /// The relation's id (its [`Relation::id`]).
        relation: u32,
        /// The row's values in column order, as text; `None` for NULL.
        values: Vec<Option<Vec<u8>>>,
    },
    /// A message written with `pg_logical_emit_message`.
    Message {
        /// Written as part of its transaction (`true`), or at once, alone (`false`).
        transactional: bool,
        /// Where the message was written.
        lsn: u64,
        /// The writer's prefix, which says whose message it is.
        prefix: String,
        /// The message's bytes.
        content: Vec<u8>,
    },
    /// A message the outbox does not read, by its type byte (`O`rigin, t`Y`pe, `U`pdate,
    /// `D`elete, `T`runcate).
    Other(u8),
}

/// A table as a `Relation` message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relation {
    /// The table's id, which later inserts name.
    pub(crate) id: u32,
    /// The table's schema.
    pub(crate) namespace: String,
    /// The table's name.
    pub(crate) name: String,
    /// The column names, in the order an insert's values come.
    pub(crate) columns: Vec<String>,
}

/// A pgoutput message that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError {
    /// The message's type byte (`0` for an empty message).
    pub(crate) message: u8,
    /// What was being read.
    pub(crate) field: &'static str,
    /// The byte offset in the message where reading failed.
    pub(crate) at: usize,
    /// What was wrong.
    pub(crate) problem: String,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.message {
            0 => "an empty pgoutput message".to_string(),
            b => format!("pgoutput message `{}`", char::from(b)),
        };
        write!(
            f,
            "{kind}: {} at byte {}: {} (the slot must use pgoutput protocol 1 without \
             `binary` or `streaming`)",
            self.field, self.at, self.problem
        )
    }
}

impl std::error::Error for DecodeError {}

/// Decodes one pgoutput message.
pub(crate) fn decode(bytes: &[u8]) -> Result<PgOutput, DecodeError> {
    let Some((&kind, _)) = bytes.split_first() else {
        return Err(DecodeError {
            message: 0,
            field: "the message type",
            at: 0,
            problem: "no bytes".into(),
        });
    };
    let mut r = Reader {
        bytes,
        at: 1,
        message: kind,
    };
    let decoded = match kind {
        b'B' => PgOutput::Begin {
            final_lsn: r.u64("the final LSN")?,
            commit_time: r.i64("the commit time")?,
            xid: r.u32("the transaction id")?,
        },
        b'C' => {
            r.u8("the flags")?;
            PgOutput::Commit {
                commit_lsn: r.u64("the commit LSN")?,
                end_lsn: r.u64("the end LSN")?,
                commit_time: r.i64("the commit time")?,
            }
        }
        b'R' => {
            let id = r.u32("the relation id")?;
            let namespace = r.string("the schema name")?;
            let name = r.string("the table name")?;
            r.u8("the replica identity")?;
            let count = r.u16("the column count")?;
            let mut columns = Vec::with_capacity(usize::from(count));
            for _ in 0..count {
                r.u8("a column's flags")?;
                columns.push(r.string("a column's name")?);
                r.u32("a column's type")?;
                r.u32("a column's type modifier")?;
            }
            PgOutput::Relation(Relation {
                id,
                namespace,
                name,
                columns,
            })
        }
        b'I' => {
            let relation = r.u32("the relation id")?;
            let start = r.at;
            let marker = r.u8("the new-tuple marker")?;
            if marker != b'N' {
                let problem = format!("{marker:#04x}, not `N`");
                return Err(r.error_at(start, "the new-tuple marker", problem));
            }
            PgOutput::Insert {
                relation,
                values: r.tuple()?,
            }
        }
        b'M' => {
            let transactional = r.u8("the flags")? & 1 == 1;
            let lsn = r.u64("the message LSN")?;
            let prefix = r.string("the prefix")?;
            let length = r.u32("the content length")?;
            let content = r.take(length as usize, "the content")?.to_vec();
            PgOutput::Message {
                transactional,
                lsn,
                prefix,
                content,
            }
        }
        b'O' | b'Y' | b'U' | b'D' | b'T' => return Ok(PgOutput::Other(kind)),
        other => {
            return Err(r.error_at(
                0,
                "the message type",
                format!("unknown type {other:#04x} (not protocol 1)"),
            ));
        }
    };
    if r.at != bytes.len() {
        return Err(r.error(
            "the end of the message",
            format!("{} bytes left over", bytes.len() - r.at),
        ));
    }
    Ok(decoded)
}

/// Reads a message's fields in order, big-endian, as the protocol writes them.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    message: u8,
}

impl<'a> Reader<'a> {
    /// An error about the field that starts at the current byte.
    fn error(&self, field: &'static str, problem: String) -> DecodeError {
        self.error_at(self.at, field, problem)
    }

    /// An error about the field that starts at byte `at`.
    fn error_at(&self, at: usize, field: &'static str, problem: String) -> DecodeError {
        DecodeError {
            message: self.message,
            field,
            at,
            problem,
        }
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let left = self.bytes.len() - self.at;
        if n > left {
            return Err(self.error(field, format!("needs {n} bytes, {left} left")));
        }
        let taken = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(field)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array(field)?))
    }

    /// A NUL-terminated UTF-8 string.
    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let rest = &self.bytes[self.at..];
        let Some(end) = rest.iter().position(|&b| b == 0) else {
            return Err(self.error(field, "no terminating NUL".into()));
        };
        let text = std::str::from_utf8(&rest[..end])
            .map_err(|e| self.error(field, format!("not UTF-8: {e}")))?
            .to_owned();
        self.at += end + 1;
        Ok(text)
    }

    /// A row's values (`TupleData`): text or NULL; an unchanged TOAST value (`u`) never
    /// comes with an insert, and binary values (`b`) only with the `binary` option.
    fn tuple(&mut self) -> Result<Vec<Option<Vec<u8>>>, DecodeError> {
        let count = self.u16("the value count")?;
        let mut values = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let start = self.at;
            match self.u8("a value's kind")? {
                b'n' => values.push(None),
                b't' => {
                    let length = self.u32("a value's length")?;
                    values.push(Some(self.take(length as usize, "a value")?.to_vec()));
                }
                other => {
                    return Err(self.error_at(
                        start,
                        "a value's kind",
                        format!("{other:#04x}, not `t` (text) or `n` (NULL)"),
                    ));
                }
            }
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests;
