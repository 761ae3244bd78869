//! What the SQL storages of the outbox engine (`outbox-postgres`, `outbox-mysql`,
//! `outbox-sqlite`) share, so that each rule is written once and each storage keeps only
//! its dialect: its statements, its connection and its error codes.
//!
//! Nothing here talks to a database (there is no sqlx in this crate): these are the checks,
//! conversions and loops around the statements.
//!
//! - [`names`]: which table, schema and database names are allowed.
//! - [`columns`]: a [`NewMessage`](outbox_core::NewMessage) as the columns of an INSERT,
//!   the multi-row INSERT statements, and the column lists of the statements that copy a
//!   row.
//! - [`rows`]: decoding columns written by hand (the `headers` JSON).
//! - [`inbox`]: the inbox's rules (consumer names, transactions, purges, its errors).
//! - [`migrate`]: the versioned-migration runner, over a small [`migrate::Dialect`] trait.
//! - [`config`]: the limits and checks of settings every SQL storage has.
//! - [`lock_name`], [`fnv1a`], [`first_of_each`], [`saturating_millis`],
//!   [`saturating_micros`], [`missing_table_or_column`], [`bind_dead_letter_filter!`]: small
//!   helpers.
#![deny(missing_docs)]

pub mod columns;
pub mod config;
pub mod inbox;
pub mod migrate;
pub mod names;
pub mod rows;

use std::collections::HashSet;
use std::time::Duration;

use uuid::Uuid;

pub use config::{DEFAULT_MAX_PER_KEY, MAX_MAX_PER_KEY};

/// 64-bit FNV-1a of `text`: stable across processes, builds, platforms and releases, unlike
/// std's hasher. Lock keys and names that other processes (and older releases) compute too
/// are made from it, so it must never change.
pub fn fnv1a(text: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// A lock name that fits any database's limit: `prefix`, `_` and 16 hex digits of the
/// [`fnv1a`] of `text` (MySQL's `GET_LOCK` names are server-wide and at most 64
/// characters, so a hash of the qualified table stands for it).
pub fn lock_name(prefix: &str, text: &str) -> String {
    format!("{prefix}_{:016x}", fnv1a(text))
}

/// Keeps the first entry of each id: a list that names a message twice changes it once.
pub fn first_of_each<T>(items: &[T], id: impl Fn(&T) -> Uuid) -> Vec<&T> {
    let mut seen = HashSet::new();
    items.iter().filter(|item| seen.insert(id(item))).collect()
}

/// A duration in whole milliseconds, saturating at `i64::MAX`.
pub fn saturating_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A duration in whole microseconds, saturating at `i64::MAX`.
pub fn saturating_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Whether a database error's SQLSTATE says a table or a column is missing: PostgreSQL's
/// 42P01 (undefined table) and 42703 (undefined column), MySQL's and MariaDB's 42S02 (no
/// such table) and 42S22 (unknown column). Such an error on a table a later migration
/// creates, or on a column it adds, means the schema is an older release's. (SQLite has no
/// SQLSTATE: its storage reads its own error codes.)
pub fn missing_table_or_column(sqlstate: Option<&str>) -> bool {
    matches!(sqlstate, Some("42P01" | "42703" | "42S02" | "42S22"))
}

/// Binds the [`DeadLetterFilter`](outbox_core::DeadLetterFilter) `$filter` and the limit
/// `$limit` (a `usize`) to the sqlx query `$query`, a dead-letter search that takes them as
/// its six placeholders (PostgreSQL, SQLite), in their order: the limit (at most
/// `i64::MAX`), `$ids` (the filter's ids as the dialect binds a list), the topic, the key,
/// the text in the last error, and whether to leave the payloads out. A part of the filter
/// that is `None` binds NULL, which the statement reads as "any". `$filter` is evaluated
/// more than once: pass a name.
///
/// ```text
/// let ids = filter.ids.as_deref();
/// let query = outbox_sql::bind_dead_letter_filter!(sqlx::query(&sql), filter, limit, ids);
/// ```
#[macro_export]
macro_rules! bind_dead_letter_filter {
    ($query:expr, $filter:expr, $limit:expr, $ids:expr) => {
        $query
            .bind(i64::try_from($limit).unwrap_or(i64::MAX))
            .bind($ids)
            .bind($filter.topic.as_deref())
            .bind($filter.key.as_deref())
            .bind($filter.last_error.as_deref())
            .bind($filter.without_payloads)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_pinned() {
        // The published FNV-1a test vectors: these values are in deployed lock keys.
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn lock_names_fit_and_differ() {
        let long = lock_name(
            "outbox_inbox_migrate",
            &format!("{}.{}", "d".repeat(40), "t".repeat(40)),
        );
        assert!(long.len() <= 64, "{long}");
        assert!(long.starts_with("outbox_inbox_migrate_"));
        assert_ne!(lock_name("p", "a.b"), lock_name("p", "a.c"));
        assert_eq!(lock_name("p", ""), "p_cbf29ce484222325");
    }

    #[test]
    fn lists_name_each_message_once() {
        let a = Uuid::now_v7();
        let b = Uuid::now_v7();
        assert_eq!(first_of_each(&[a, b, a, b], |id| *id), vec![&a, &b]);
        assert!(first_of_each(&[] as &[Uuid], |id| *id).is_empty());
    }

    #[test]
    fn durations_saturate() {
        assert_eq!(saturating_millis(Duration::from_micros(1_500_999)), 1_500);
        assert_eq!(saturating_millis(Duration::MAX), i64::MAX);
        assert_eq!(saturating_micros(Duration::from_millis(1_500)), 1_500_000);
        assert_eq!(saturating_micros(Duration::MAX), i64::MAX);
    }

    #[test]
    fn missing_tables_and_columns_are_told_apart() {
        for code in ["42P01", "42703", "42S02", "42S22"] {
            assert!(missing_table_or_column(Some(code)), "{code}");
        }
        for code in [None, Some("23505"), Some("42S21"), Some("40001")] {
            assert!(!missing_table_or_column(code), "{code:?}");
        }
    }
}
