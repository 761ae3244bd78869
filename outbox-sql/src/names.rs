//! Which names of tables, schemas and databases a SQL storage accepts. A name is validated,
//! then quoted by the storage; it is never spliced into SQL unchecked.

use outbox_core::{Error, Result};

/// The longest name accepted, leaving room for the companion tables' suffixes
/// (`_dead_letters`, `_migrations`, ...) within every database's identifier limit
/// (PostgreSQL 63 bytes, MySQL 64).
pub const MAX_NAME: usize = 40;

/// Checks that `name` is a plain lower-case identifier: 1 to [`MAX_NAME`] lower-case ASCII
/// letters, digits and underscores, starting with a letter or an underscore, and, when
/// `reserved` is given, not starting with that prefix (the database's own names: `pg_`,
/// `sqlite_`). The error is a `Config` error keyed `key` (`table`, `schema`, `database`).
pub fn validate(key: &str, name: &str, reserved: Option<&str>) -> Result<()> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    let reserved_ok = reserved.is_none_or(|prefix| !name.starts_with(prefix));
    if !first_ok || !rest_ok || name.len() > MAX_NAME || !reserved_ok {
        let not_with = reserved
            .map(|prefix| format!(" and not with `{prefix}`"))
            .unwrap_or_default();
        return Err(Error::setting(
            key,
            format!(
                "`{name}` is not allowed: use 1 to {MAX_NAME} lower-case letters, digits and \
                 underscores, starting with a letter or underscore{not_with}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass() {
        for good in ["outbox", "outbox_2", "_x", &"a".repeat(MAX_NAME)] {
            assert!(validate("table", good, Some("pg_")).is_ok(), "{good}");
        }
        assert!(validate("table", "pg_x", None).is_ok());
    }

    #[test]
    fn others_are_refused_with_the_key_and_the_rule() {
        for bad in [
            "",
            "Outbox",
            "a-b",
            "x\"; DROP TABLE y; --",
            "x`; DROP TABLE y; --",
            "1abc",
            "é",
            &"a".repeat(MAX_NAME + 1),
        ] {
            let err = validate("schema", bad, None).unwrap_err();
            assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
            assert!(err.message().starts_with("schema `"), "{err}");
            assert!(err.to_string().ends_with("letter or underscore"), "{err}");
        }
    }

    #[test]
    fn reserved_prefixes_are_refused_and_named() {
        let err = validate("table", "sqlite_master", Some("sqlite_")).unwrap_err();
        assert_eq!(
            err.message(),
            "table `sqlite_master` is not allowed: use 1 to 40 lower-case letters, digits and \
             underscores, starting with a letter or underscore and not with `sqlite_`"
        );
        let err = validate("table", "Bad", Some("pg_")).unwrap_err();
        assert!(err.to_string().ends_with("and not with `pg_`"), "{err}");
    }
}
