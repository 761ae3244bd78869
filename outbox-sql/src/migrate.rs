//! The versioned-migration runner every SQL storage's outbox and inbox use: under a lock
//! that makes migrators take turns, read the highest version recorded in the
//! `<table>_migrations` table, then apply and record each later step, in order. What
//! differs per database (the lock, the statements, whether DDL is transactional) is a
//! [`Dialect`]; the loop is [`run`].
//!
//! Migrations are a list of steps: version = position + 1. A step that has shipped never
//! changes its effect; a change is a new step.

use std::future::Future;

use outbox_core::Result;

/// What a database does for [`run`]. Each method runs statements on the connection (or
/// transaction) the dialect holds. The futures are `Send`, so a migration can run in a
/// spawned task.
pub trait Dialect: Send {
    /// One migration (a SQL template, a list of statements, ...).
    type Step: Sync;

    /// Takes the lock that makes migrators of this table take turns, waiting for it.
    /// Default: none, where the transaction the dialect holds is the lock (SQLite's
    /// `BEGIN IMMEDIATE`, a PostgreSQL transaction-level advisory lock taken before).
    fn lock(&mut self) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Checks, holding the lock, that the table may be migrated (an inbox refuses a table
    /// that is not one). Default: nothing to check.
    fn check(&mut self) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }

    /// Creates the versions table if it is missing, and returns the highest version it
    /// records (0 for none).
    fn applied(&mut self) -> impl Future<Output = Result<i64>> + Send;

    /// Applies `step`, the migration to `version`, and records the version.
    fn apply(&mut self, version: i64, step: &Self::Step)
    -> impl Future<Output = Result<()>> + Send;

    /// Releases the lock of [`lock`](Dialect::lock). Called after [`check`](Dialect::check),
    /// [`applied`](Dialect::applied) and [`apply`](Dialect::apply), whether they succeeded
    /// or not (a session-level lock outlives the call, and the connection usually goes back
    /// to a pool); their error wins over this one's. Default: nothing to release.
    fn unlock(&mut self) -> impl Future<Output = Result<()>> + Send {
        async { Ok(()) }
    }
}

/// The steps after version `applied`, up to version `target` (at most all of them), each
/// with its version, in order.
pub fn pending<S>(applied: i64, steps: &[S], target: usize) -> impl Iterator<Item = (i64, &S)> {
    (1i64..)
        .zip(steps)
        .take(target.min(steps.len()))
        .filter(move |(version, _)| *version > applied)
}

/// The companion tables of every SQL outbox table, as [`fill_names`] names them:
/// `<table>_dead_letters`, `<table>_parked_keys` and `<table>_delivered`.
pub const OUTBOX_COMPANIONS: [&str; 3] = ["dead_letters", "parked_keys", "delivered"];

/// A migration template with its table names filled in: `{<main>}` is the table itself
/// (`{outbox}`, `{inbox}`), `{<name>}` for each of `companions` its companion table
/// `<table>_<name>` (`{dead_letters}` is `<table>_dead_letters`), each as `quote` writes a
/// table name from its suffix (`""` for the table: validated, quoted, qualified if need
/// be), and `{table}` the bare table name, for index and constraint names. The storage
/// fills its own other placeholders after.
pub fn fill_names<'a>(
    template: &str,
    table: &str,
    main: &str,
    companions: impl IntoIterator<Item = &'a str>,
    quote: impl Fn(&str) -> String,
) -> String {
    let mut sql = template.replace(&format!("{{{main}}}"), &quote(""));
    for name in companions {
        sql = sql.replace(&format!("{{{name}}}"), &quote(&format!("_{name}")));
    }
    sql.replace("{table}", table)
}

/// The first placeholder left in rendered SQL, if any: `{name}`, a name of lower-case
/// letters, digits and `_` that does not start with a digit. For the tests that check a
/// storage fills every placeholder of its migrations; `{8}` (a count in a regex) and `{}`
/// (an empty JSON object) are not placeholders.
pub fn unfilled(sql: &str) -> Option<&str> {
    sql.match_indices('{').find_map(|(start, _)| {
        let name = &sql[start + 1..];
        let end = name.find('}')?;
        let name = &name[..end];
        let first = name.chars().next()?;
        let is_name = (first.is_ascii_lowercase() || first == '_')
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        is_name.then(|| &sql[start..start + end + 2])
    })
}

/// Migrates up to version `target` (`steps.len()` for all): [`lock`](Dialect::lock),
/// [`check`](Dialect::check), read the [`applied`](Dialect::applied) version,
/// [`apply`](Dialect::apply) each [`pending`] step in order, and
/// [`unlock`](Dialect::unlock) whatever happened. Returns the first error. Safe to run
/// repeatedly: a recorded version is never applied again.
pub async fn run<D: Dialect>(dialect: &mut D, steps: &[D::Step], target: usize) -> Result<()> {
    dialect.lock().await?;
    let result = apply_pending(dialect, steps, target).await;
    let unlocked = dialect.unlock().await;
    result?;
    unlocked
}

async fn apply_pending<D: Dialect>(
    dialect: &mut D,
    steps: &[D::Step],
    target: usize,
) -> Result<()> {
    dialect.check().await?;
    let applied = dialect.applied().await?;
    for (version, step) in pending(applied, steps, target) {
        dialect.apply(version, step).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_left_are_found() {
        assert_eq!(unfilled("SELECT 1"), None);
        assert_eq!(
            unfilled("x REGEXP '^[0-9a-f]{8}-' AND h = '{}'::jsonb"),
            None
        );
        assert_eq!(unfilled("CREATE TABLE {outbox} ({x}"), Some("{outbox}"));
        assert_eq!(unfilled("{} {8} {shard_count}"), Some("{shard_count}"));
        assert_eq!(unfilled("{Outbox} {a b} {open"), None);
    }

    #[test]
    fn names_fill_their_placeholders() {
        let quote = |suffix: &str| format!(r#""app"."t{suffix}""#);
        assert_eq!(
            fill_names(
                "CREATE TABLE {outbox}; DROP TABLE {stats}; CREATE INDEX {table}_k ON {dead_letters}; {other}",
                "t",
                "outbox",
                ["dead_letters", "stats"],
                quote,
            ),
            r#"CREATE TABLE "app"."t"; DROP TABLE "app"."t_stats"; CREATE INDEX t_k ON "app"."t_dead_letters"; {other}"#
        );
        assert_eq!(
            fill_names("{inbox} {table}", "i", "inbox", [], quote),
            r#""app"."t" i"#
        );
    }
    use outbox_core::Error;

    /// A database in memory: the versions recorded and what happened, in order.
    #[derive(Default)]
    struct Fake {
        recorded: Vec<i64>,
        log: Vec<String>,
        refuse: bool,
        fail_at: Option<i64>,
    }

    impl Dialect for Fake {
        type Step = &'static str;

        async fn lock(&mut self) -> Result<()> {
            self.log.push("lock".into());
            Ok(())
        }

        async fn check(&mut self) -> Result<()> {
            if self.refuse {
                return Err(Error::config("not an inbox"));
            }
            Ok(())
        }

        async fn applied(&mut self) -> Result<i64> {
            Ok(self.recorded.iter().copied().max().unwrap_or(0))
        }

        async fn apply(&mut self, version: i64, step: &&'static str) -> Result<()> {
            if self.fail_at == Some(version) {
                return Err(Error::unavailable("gone"));
            }
            self.log.push(format!("{version}: {step}"));
            self.recorded.push(version);
            Ok(())
        }

        async fn unlock(&mut self) -> Result<()> {
            self.log.push("unlock".into());
            Ok(())
        }
    }

    const STEPS: [&str; 3] = ["create", "index", "alter"];

    fn block_on<F: Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(future)
    }

    #[test]
    fn pending_steps_follow_the_recorded_version_up_to_the_target() {
        let versions = |applied, target| -> Vec<i64> {
            pending(applied, &STEPS, target).map(|(v, _)| v).collect()
        };
        assert_eq!(versions(0, 3), [1, 2, 3]);
        assert_eq!(versions(1, 3), [2, 3]);
        assert_eq!(versions(3, 3), [] as [i64; 0]);
        assert_eq!(versions(0, 2), [1, 2]);
        assert_eq!(versions(0, 99), [1, 2, 3]);
        assert_eq!(versions(5, 3), [] as [i64; 0]);
        assert_eq!(pending(1, &STEPS, 3).next(), Some((2, &"index")));
    }

    #[test]
    fn runs_each_step_once_under_the_lock() {
        let mut db = Fake::default();
        block_on(run(&mut db, &STEPS, 2)).unwrap();
        assert_eq!(db.log, ["lock", "1: create", "2: index", "unlock"]);
        db.log.clear();
        block_on(run(&mut db, &STEPS, STEPS.len())).unwrap();
        assert_eq!(db.log, ["lock", "3: alter", "unlock"]);
        db.log.clear();
        block_on(run(&mut db, &STEPS, STEPS.len())).unwrap();
        assert_eq!(db.log, ["lock", "unlock"]);
        assert_eq!(db.recorded, [1, 2, 3]);
    }

    #[test]
    fn unlocks_after_a_failure_and_returns_it() {
        let mut db = Fake {
            fail_at: Some(2),
            ..Fake::default()
        };
        let err = block_on(run(&mut db, &STEPS, 3)).unwrap_err();
        assert_eq!(err.message(), "gone");
        assert_eq!(db.log, ["lock", "1: create", "unlock"]);
        let mut db = Fake {
            refuse: true,
            ..Fake::default()
        };
        let err = block_on(run(&mut db, &STEPS, 3)).unwrap_err();
        assert_eq!(err.message(), "not an inbox");
        assert_eq!(db.log, ["lock", "unlock"]);
    }

    /// Compiles only if a migration can run in a spawned task.
    #[allow(dead_code)]
    fn run_is_spawnable(mut db: Fake) {
        drop(tokio::spawn(async move { run(&mut db, &STEPS, 3).await }));
    }
}
