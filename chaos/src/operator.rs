//! The operator: while the faults go on, dead letters made by the poison topic are replayed,
//! released past or purged with the relay's own CLI (`outbox dead-letters …`), as a person
//! on call would; at the end every dead letter left is replayed once the poison topic is
//! routable. It records what the checker needs: the messages purged (never to be delivered
//! nor dead-lettered again) and those a release let later messages pass (no order to keep
//! after them).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use tokio::process::Command;
use uuid::Uuid;

use crate::database::Database;
use crate::{Context, Result};

/// What the operator did and saw.
#[derive(Default)]
pub struct Record {
    pub replays: u64,
    pub releases: u64,
    pub purges: u64,
    /// Dead letters purged for good: none may arrive, nor come back as a dead letter.
    pub purged: HashSet<Uuid>,
    /// Dead letters of a key when it was released: the key's later messages went on past
    /// them (that is what release means), so no order is kept after them.
    pub released_past: HashSet<Uuid>,
    /// Purged messages seen again among the dead letters.
    pub purged_came_back: HashSet<Uuid>,
}

pub struct Operator {
    binary: PathBuf,
    /// A configuration of its own: the relays' file, with the database reached directly
    /// (not through the run's proxy), so terminating the relays' sessions never ends a
    /// command half-way with an unknown outcome.
    config: PathBuf,
    db: Database,
    pub record: Record,
}

impl Operator {
    pub fn new(binary: &Path, config: &Path, db: Database) -> Operator {
        Operator {
            binary: binary.to_path_buf(),
            config: config.to_path_buf(),
            db,
            record: Record::default(),
        }
    }

    /// One action on the dead letters of one key, chosen at random; what it did, or None
    /// when there was no dead letter. Replay 40%, release 30%, purge (then release, or the
    /// key would stay parked) 30%.
    pub async fn act(&mut self, rng: &mut fastrand::Rng) -> Result<Option<String>> {
        let dead = self.dead_letters().await?;
        if dead.is_empty() {
            return Ok(None);
        }
        let key = dead[rng.usize(..dead.len())].1.clone();
        let ids: Vec<Uuid> = dead
            .iter()
            .filter(|(_, k)| *k == key)
            .map(|(id, _)| *id)
            .collect();
        let n = ids.len();
        Ok(Some(match rng.u32(0..100) {
            0..40 => {
                self.cli(&["dead-letters", "replay", "--key", &key]).await?;
                self.record.replays += 1;
                format!("replayed the {n} dead letters of key {key}")
            }
            40..70 => {
                self.release(&key, &ids).await?;
                format!("released key {key} past its {n} dead letters")
            }
            _ => {
                let mut args = vec!["dead-letters".to_string(), "purge".to_string()];
                args.extend(ids.iter().map(Uuid::to_string));
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                self.cli(&args).await?;
                self.record.purges += 1;
                self.record.purged.extend(&ids);
                self.release(&key, &[]).await?;
                format!("purged the {n} dead letters of key {key}, then released it")
            }
        }))
    }

    /// `dead-letters release KEY`; `before` are the key's dead letters listed before it. A
    /// dead letter of the key listed after it is passed too when it was made before the
    /// release took effect (the listing cannot tell), so both count as released past.
    async fn release(&mut self, key: &str, before: &[Uuid]) -> Result<()> {
        self.cli(&["dead-letters", "release", key]).await?;
        self.record.releases += 1;
        self.record.released_past.extend(before);
        let after = self.dead_letters().await?;
        let after = after
            .into_iter()
            .filter(|(_, k)| k == key)
            .map(|(id, _)| id);
        self.record.released_past.extend(after);
        Ok(())
    }

    /// Replays every dead letter (the end of the run, with the poison topic routable);
    /// returns how many there were.
    pub async fn replay_all(&mut self) -> Result<usize> {
        let dead = self.dead_letters().await?;
        if !dead.is_empty() {
            self.cli(&["dead-letters", "replay", "--all"]).await?;
            self.record.replays += 1;
        }
        Ok(dead.len())
    }

    /// The dead letters (id, key), noting purged ones that came back.
    async fn dead_letters(&mut self) -> Result<Vec<(Uuid, String)>> {
        let dead = self.db.dead_letter_keys().await?;
        let back = dead.iter().map(|(id, _)| *id);
        let back = back.filter(|id| self.record.purged.contains(id));
        let back: Vec<Uuid> = back.collect();
        self.record.purged_came_back.extend(back);
        Ok(dead)
    }

    /// Runs `outbox --config <operator.toml> ARGS`; an exit other than 0 fails the run.
    async fn cli(&self, args: &[&str]) -> Result<()> {
        let output = Command::new(&self.binary)
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .env("NO_COLOR", "1")
            .output()
            .await
            .ctx(self.binary.display())?;
        if output.status.success() {
            return Ok(());
        }
        Err(format!(
            "`outbox {}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Runs the operator until `stop`: an action every 2–5 s. Returns it, with its record, or
/// the first command that failed.
pub async fn run(
    mut operator: Operator,
    seed: u64,
    started: std::time::Instant,
    stop: tokio_util::sync::CancellationToken,
) -> Result<Operator> {
    let mut rng = fastrand::Rng::with_seed(seed);
    loop {
        let pause = std::time::Duration::from_millis(rng.u64(2000..5000));
        tokio::select! {
            () = stop.cancelled() => return Ok(operator),
            () = tokio::time::sleep(pause) => {}
        }
        if let Some(what) = operator.act(&mut rng).await? {
            println!("[{:>4}s] operator: {what}", started.elapsed().as_secs());
        }
    }
}
