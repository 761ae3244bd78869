//! WAL mode (issue 32, being built; docs/design/wal-mode.md): reading the outbox through a
//! logical replication slot with the `pgoutput` plugin. What is here so far is the decoder
//! of pgoutput's messages, which the SQL reader (`pg_logical_slot_peek_binary_changes`) and
//! a later streaming reader share; no configuration selects this mode yet.

// Used by the WAL engine as it lands; until then only its tests call it.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod pgoutput;
