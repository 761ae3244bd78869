//! `outbox-chaos`: several `outbox relay` processes on one outbox table (PostgreSQL in lease
//! or log mode, or MySQL: `--storage`) while writers enqueue with plain SQL and faults are
//! injected at random (seeded): kill -9 of a relay, its database sessions terminated, the
//! broker link cut or stalled past the lease through a proxy, and (AMQP) a lagging consumer
//! that makes RabbitMQ refuse publishes. With AMQP a poison topic makes dead letters, which
//! an operator replays, releases past and purges with the CLI all along. Then it drains
//! (replaying the dead letters left once the poison topic is routable), reads back
//! everything the broker received and fails on any loss, per-key order violation,
//! rolled-back or purged message delivered, dead letter left, or more duplicates than the
//! faults explain.
//! Run it with `cargo xtask chaos`; see docs/chaos.md.

mod brokers;
mod check;
mod database;
mod operator;
mod relays;
mod writers;

use std::fmt::Display;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_core::redact_url;
use outbox_test_support::{Proxy, Service, host_port, through};
use tokio_util::sync::CancellationToken;

use brokers::{Broker, Kind};
use check::{Verdict, Waived};
use database::{Database, LOG_SHARDS, Store};
use operator::Operator;
use relays::{Relays, Settings};
use writers::{Counters, Ledger, Writer};

pub type Result<T> = std::result::Result<T, String>;

/// Says what failed: `.ctx("reading the stream")?`.
pub trait Context<T> {
    fn ctx(self, what: impl Display) -> Result<T>;
}

impl<T, E: Display> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl Display) -> Result<T> {
        self.map_err(|error| format!("{what}: {error}"))
    }
}

/// Every sink's time-outs (publish, connect, health), in seconds.
const SINK_TIMEOUT: u64 = 2;
/// Messages of one key per claim: 3 is the least at which a claim can hold a due message
/// behind one that waits to retry (due, waiting, due), the shape of the per-key order bugs
/// this run is after; with 2 a faulty claim could not show them.
const MAX_PER_KEY: usize = 3;
const DRAIN_DEADLINE: Duration = Duration::from_secs(180);
/// The share of messages sent to the poison topic where the sink has one: with 30–40
/// messages a second (debug builds, AMQP), one every few seconds, so the operator (an action
/// every 2–5 s) keeps up and most keys flow most of the time.
const POISON_RATE: f64 = 0.01;

#[derive(Parser)]
#[command(about = "Chaos run of the outbox relay against one broker; see docs/chaos.md")]
struct Args {
    /// How long faults are injected; draining and checking come after.
    #[arg(long, default_value_t = 2.0, value_parser = minutes)]
    minutes: f64,
    /// The broker the relays publish to.
    #[arg(long, value_enum, default_value = "amqp")]
    sink: Kind,
    /// Seed of the fault schedule and the writers' choices (random when not given).
    #[arg(long)]
    seed: Option<u64>,
    /// The relay binary, built with `--features amqp,kafka,nats,mysql`.
    #[arg(long, default_value = "target/debug/outbox")]
    outbox: PathBuf,
    /// The storage of the outbox: PostgreSQL in lease mode, PostgreSQL in log mode
    /// (`mode = "log"`, 8 shards), or MySQL.
    #[arg(long, value_enum, default_value = "postgres")]
    storage: Store,
    /// The database of the outbox with `--storage postgres` or `postgres-log` (a schema of
    /// the run's own is created and dropped).
    #[arg(long, env = Service::Postgres.env(), default_value = Service::Postgres.default_url())]
    postgres_url: String,
    /// The database of the outbox with `--storage mysql` (tables of the run's own are created
    /// and dropped).
    #[arg(long, env = Service::MySql.env(), default_value = Service::MySql.default_url())]
    mysql_url: String,
    /// Relay processes on the one outbox table.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..))]
    relays: u8,
    /// Keep the run's directory (relay logs, what was written, what arrived) even when it
    /// passes; a failed run always keeps it.
    #[arg(long)]
    keep: bool,
}

/// A positive number of minutes, at most a day.
fn minutes(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(m) if m > 0.0 && m <= 1440.0 => Ok(m),
        _ => Err(format!(
            "`{text}` is not a number of minutes between 0 and 1440"
        )),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    println!("chaos: seed {seed} (repeat the schedule with --seed {seed})");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build();
    let outcome = match runtime {
        Ok(runtime) => runtime.block_on(run(&args, seed)),
        Err(error) => Err(format!("cannot start the runtime: {error}")),
    };
    let sink = format!("{:?}", args.sink).to_lowercase();
    let storage = format!("{:?}", args.storage).to_lowercase();
    match outcome {
        Ok(true) => return ExitCode::SUCCESS,
        Ok(false) => eprintln!("chaos: FAILED (sink {sink}, storage {storage}, seed {seed})"),
        Err(error) => {
            eprintln!("chaos: error: {error} (sink {sink}, storage {storage}, seed {seed})")
        }
    }
    ExitCode::FAILURE
}

/// The faults injected so far, shared with the progress line and the AMQP consumer.
#[derive(Default)]
pub struct Faults {
    kills: AtomicU64,
    /// Relays stopped with SIGTERM (they give their shards up) and started again.
    restarts: AtomicU64,
    terminations: AtomicU64,
    sessions: AtomicU64,
    cuts: AtomicU64,
    stalls: AtomicU64,
    pub pauses: AtomicU64,
    /// Relays hit, summed over faults: each hit may redeliver at most one batch, so
    /// duplicates may reach `hits × batch_size`.
    hits: AtomicU64,
    unexpected_exits: AtomicU64,
}

impl Faults {
    fn summary(&self) -> String {
        let [k, r, t, s, c, st, p] = [
            &self.kills,
            &self.restarts,
            &self.terminations,
            &self.sessions,
            &self.cuts,
            &self.stalls,
            &self.pauses,
        ]
        .map(|n| n.load(Relaxed));
        format!(
            "{k} kill -9, {r} SIGTERM restarts, {t} session kills ({s} sessions), {c} cuts, {st} stalls, {p} consumer pauses"
        )
    }
}

/// The relay binary as it is now, kept in the run's directory: relays are restarted all
/// run long, and a build in the shared target directory (without the sinks' features, say)
/// must not swap the binary under them. A hard link (a rebuild writes a new file and leaves
/// the old one to the link), or a copy where links are not possible.
fn keep_binary(binary: &std::path::Path, dir: &std::path::Path) -> Result<PathBuf> {
    let kept = dir.join("outbox");
    if std::fs::hard_link(binary, &kept).is_err() {
        std::fs::copy(binary, &kept).ctx(format_args!(
            "copying the relay binary {} to {}",
            binary.display(),
            kept.display()
        ))?;
    }
    Ok(kept)
}

/// How many duplicates one relay hit may explain. A hit relay's batches in flight are published
/// again: two batches (the worker writes a batch's settlement while the next one goes out). In
/// log mode the next owner of its shards also reads from their stored
/// cursors, which sit just before the oldest message not settled: what the relay delivered
/// past a message still waiting to retry goes out again. That is counted as one batch more
/// for each shard of a relay's share (shards ÷ relays, rounded up).
fn redelivery_per_hit(store: Store, batch: usize, relays: usize) -> usize {
    match store {
        Store::PostgresLog => batch * (2 + (LOG_SHARDS as usize).div_ceil(relays.max(1))),
        Store::Postgres | Store::Mysql => 2 * batch,
    }
}

/// Everything a run set up; [`Run::cleanup`] tears it down whatever the outcome.
struct Run {
    name: String,
    kind: Kind,
    db: Database,
    database: Proxy,
    link: Proxy,
    broker: Broker,
    relays: Relays,
    binary: PathBuf,
    settings: Settings,
    dir: PathBuf,
    faults: Arc<Faults>,
    /// Acts on dead letters during the run (where the sink has a poison topic).
    operator: Option<Operator>,
    /// Stops the writers.
    stop: CancellationToken,
    started: Instant,
}

async fn run(args: &Args, seed: u64) -> Result<bool> {
    let mut run = Run::setup(args, seed).await?;
    let outcome = run.chaos(args, seed).await;
    run.cleanup(matches!(outcome, Ok(true)) && !args.keep).await;
    outcome
}

impl Run {
    async fn setup(args: &Args, seed: u64) -> Result<Run> {
        // Unique per run even with a repeated seed: runs may overlap on the shared servers.
        let name = format!("chaos_{:016x}", fastrand::u64(..));
        let binary = std::fs::canonicalize(&args.outbox).ctx(format_args!(
            "relay binary {} (build it with `cargo build --features amqp,kafka,nats,mysql`)",
            args.outbox.display()
        ))?;
        let url = match args.storage {
            Store::Postgres | Store::PostgresLog => &args.postgres_url,
            Store::Mysql => &args.mysql_url,
        };
        let db = Database::connect(args.storage, url, &name).await?;
        // Relays reach the database through a proxy that is never cut: its connections' ports
        // tell this run's relay sessions from those of other relays on the shared server.
        let database = Proxy::try_start(&host_port(url)).await.ctx("proxy")?;
        let relay_url = through(url, &database.addr());
        let upstream = brokers::upstream(args.sink);
        let link = Proxy::try_start(&upstream).await.ctx("proxy")?;
        let faults = Arc::new(Faults::default());
        let broker = Broker::setup(
            args.sink,
            &name,
            &upstream,
            &link.addr(),
            seed.rotate_left(17),
            faults.clone(),
        )
        .await?;
        // The relay refuses a lease shorter than max_per_key rounds of the sink's publish
        // time-out: take that, and at least 8 s.
        let round = args.sink.round_timeout(SINK_TIMEOUT);
        let settings = Settings {
            lease: Duration::from_secs((MAX_PER_KEY as u64 * round).max(8)),
            batch_size: 20,
            max_per_key: MAX_PER_KEY,
        };
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).ctx(dir.display())?;
        let binary = keep_binary(&binary, &dir)?;
        let sink = broker.sink_table(&name, &link.addr(), SINK_TIMEOUT);
        let config = relays::config(&relay_url, &db.storage_keys(), &settings, &sink);
        let config_file = dir.join("relay.toml");
        std::fs::write(&config_file, config).ctx(config_file.display())?;
        let operator = if broker.has_poison() {
            let config = relays::config(url, &db.storage_keys(), &settings, &sink);
            let file = dir.join("operator.toml");
            std::fs::write(&file, config).ctx(file.display())?;
            Some(Operator::new(&binary, &file, db.clone()))
        } else {
            None
        };
        println!(
            "chaos: sink {:?}, storage {:?} ({}), {} relays, lease {:?}, {} min; relay config and logs in {}",
            args.sink,
            args.storage,
            redact_url(url),
            args.relays,
            settings.lease,
            args.minutes,
            dir.display()
        );
        Ok(Run {
            relays: Relays::new(&binary, &config_file, &dir, args.relays.into()),
            name,
            kind: args.sink,
            db,
            database,
            link,
            broker,
            binary,
            settings,
            dir,
            faults,
            operator,
            stop: CancellationToken::new(),
            started: Instant::now(),
        })
    }

    async fn chaos(&mut self, args: &Args, seed: u64) -> Result<bool> {
        let mut rng = fastrand::Rng::with_seed(seed);
        relays::migrate(&self.binary, &self.dir.join("relay.toml")).await?;
        for relay in 0..self.relays.count() {
            self.relays.start(relay)?;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        if let Some((relay, status)) = self.relays.exited().into_iter().next() {
            let log = self.relays.tail(relay, 20);
            return Err(format!("relay {relay} exited at start ({status}):\n{log}"));
        }
        let counters = Arc::new(Counters::default());
        let writers = self.start_writers(&mut rng, &counters);
        let progress = self.start_progress(&counters);
        let stop_operator = CancellationToken::new();
        let operator = self.operator.take().map(|op| {
            let task = operator::run(op, rng.u64(..), self.started, stop_operator.clone());
            tokio::spawn(task)
        });
        let until = Instant::now() + Duration::from_secs_f64(args.minutes * 60.0);
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(rng.u64(2000..6000))).await;
            self.restart_exited()?;
            self.inject(&mut rng).await?;
            if operator.as_ref().is_some_and(|task| task.is_finished()) {
                break; // a command failed: the error is taken below
            }
        }
        println!("chaos: no more faults; writers and operator stop; draining");
        self.stop.cancel();
        stop_operator.cancel();
        let mut ledger = Ledger::default();
        for writer in writers {
            ledger.merge(writer.await.ctx("writer task")?);
        }
        if let Some(task) = operator {
            self.operator = Some(task.await.ctx("operator task")??);
            self.broker.route_poison(&self.name).await?;
        }
        self.broker.steady();
        let left = self.drain().await?;
        progress.abort();
        let dead = self.dead_letters().await?;
        let killed = self.relays.stop(Duration::from_secs(20)).await;
        if !killed.is_empty() {
            println!("chaos: relays {killed:?} did not stop within 20 s of SIGTERM: killed");
        }
        let arrivals = self.broker.collect(&self.name, &self.link.addr()).await?;
        let record = self.operator.as_ref().map(|op| &op.record);
        let waived = Waived {
            purged: record.map(|r| &r.purged),
            released_past: record.map(|r| &r.released_past),
        };
        let verdict = check::check(&ledger, &arrivals, &waived);
        self.save(&ledger, &arrivals)?;
        let receipts = self.receipts(&verdict.lost).await?;
        Ok(self.report(&ledger, &verdict, left, &dead, &receipts, seed))
    }

    /// Two writers with keys of their own, and two that share keys and hold their
    /// transactions open a little, so that theirs overlap.
    fn start_writers(
        &self,
        rng: &mut fastrand::Rng,
        counters: &Arc<Counters>,
    ) -> Vec<tokio::task::JoinHandle<Ledger>> {
        let insert: Arc<str> = self.db.insert().into();
        let own = (0..2).map(|w| (format!("w{w}"), (0..8).map(move |k| format!("w{w}-k{k}"))));
        let own = own.map(|(name, keys)| (name, keys.collect::<Vec<_>>(), false));
        let shared = (0..2).map(|w| {
            (
                format!("s{w}"),
                (0..4).map(|k| format!("s-k{k}")).collect(),
                true,
            )
        });
        let mut tasks = Vec::new();
        for (name, keys, shared) in own.chain(shared) {
            let writer = Writer {
                name,
                keys,
                shared,
                seed: rng.u64(..),
                poison: if self.broker.has_poison() {
                    POISON_RATE
                } else {
                    0.0
                },
            };
            let (pool, insert, stop) = (self.db.pool.clone(), insert.clone(), self.stop.clone());
            let task = writers::run(pool, insert, writer, counters.clone(), stop);
            tasks.push(tokio::spawn(task));
        }
        tasks
    }

    /// A line every 10 s: committed, not settled yet, relayed, received (AMQP), faults.
    fn start_progress(&self, counters: &Arc<Counters>) -> tokio::task::JoinHandle<()> {
        let (counters, faults, db) = (counters.clone(), self.faults.clone(), self.db.clone());
        let started = self.started;
        let receipts = self.broker.receipts();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                let pending = db.unsettled().await.unwrap_or(-1);
                let committed = counters.committed.load(Relaxed);
                let received = match &receipts {
                    Some(r) => format!(", received {}", r.lock().map_or(0, |a| a.len())),
                    None => String::new(),
                };
                println!(
                    "[{:>4}s] committed {committed} (rolled back {}), not settled {pending}, relayed ~{}{received} | faults: {}",
                    started.elapsed().as_secs(),
                    counters.rolled_back.load(Relaxed),
                    committed as i64 - pending.max(0),
                    faults.summary()
                );
            }
        })
    }

    /// A relay must never exit on its own: count it, show why, start it again.
    fn restart_exited(&mut self) -> Result<()> {
        for (relay, status) in self.relays.exited() {
            self.faults.unexpected_exits.fetch_add(1, Relaxed);
            let log = self.relays.tail(relay, 10);
            println!("chaos: relay {relay} exited on its own ({status}); restarting. Log:\n{log}");
            self.relays.start(relay)?;
        }
        Ok(())
    }

    /// One fault, chosen at random; it is over (link restored, relay restarted) on return.
    async fn inject(&mut self, rng: &mut fastrand::Rng) -> Result<()> {
        let (faults, t) = (self.faults.clone(), self.started.elapsed().as_secs());
        let relays = self.relays.count() as u64;
        let (counter, hits) = match rng.u32(0..100) {
            0..22 => {
                let relay = rng.usize(..self.relays.count());
                println!("[{t:>4}s] fault: kill -9 relay {relay}");
                self.relays.kill(relay).await;
                tokio::time::sleep(Duration::from_millis(rng.u64(500..2000))).await;
                self.relays.start(relay)?;
                (&faults.kills, 1)
            }
            // A shutdown and a start, as at a deployment: the relay gives its shards up (in
            // log mode with the rows it delivered past their cursors), another takes them.
            22..34 => {
                let relay = rng.usize(..self.relays.count());
                println!("[{t:>4}s] fault: SIGTERM relay {relay}, then start it again");
                let clean = self.relays.terminate(relay, Duration::from_secs(10)).await;
                if !clean {
                    println!("[{t:>4}s]   relay {relay} did not stop within 10 s: killed");
                }
                tokio::time::sleep(Duration::from_millis(rng.u64(200..1500))).await;
                self.relays.start(relay)?;
                (&faults.restarts, 1)
            }
            34..55 => {
                let sessions = self.terminate_sessions().await?;
                println!("[{t:>4}s] fault: {sessions} relay database sessions terminated");
                faults.sessions.fetch_add(sessions, Relaxed);
                (&faults.terminations, sessions.min(relays))
            }
            55..80 => {
                let down = Duration::from_millis(rng.u64(1000..4000));
                println!("[{t:>4}s] fault: broker link cut for {down:.1?}");
                self.link.cut();
                tokio::time::sleep(down).await;
                self.link.restore();
                (&faults.cuts, relays)
            }
            _ => {
                // Longer than the lease: a relay that waited on the broker this long would
                // find its claim taken over.
                let stall = self.settings.lease + Duration::from_millis(rng.u64(1000..4000));
                println!("[{t:>4}s] fault: broker link stalled for {stall:.1?}");
                self.link.stall();
                tokio::time::sleep(stall).await;
                self.link.restore();
                (&faults.stalls, relays)
            }
        };
        counter.fetch_add(1, Relaxed);
        faults.hits.fetch_add(hits, Relaxed);
        Ok(())
    }

    /// Terminates the sessions of this run's relays only, those that came through our proxy:
    /// other relays on the shared server have the same application_name.
    async fn terminate_sessions(&self) -> Result<u64> {
        self.db
            .terminate_sessions(&self.database.server_ports())
            .await
    }

    /// Waits until every message is settled (the outbox table is empty; in log mode, every
    /// row is behind its shard's cursor) or the deadline passes; returns the rows left. The
    /// operator replays the dead letters left meanwhile (the poison topic is routable now).
    async fn drain(&mut self) -> Result<i64> {
        let deadline = Instant::now() + DRAIN_DEADLINE;
        loop {
            self.restart_exited()?;
            let replayed = match &mut self.operator {
                Some(operator) => operator.replay_all().await?,
                None => 0,
            };
            let left = self.db.unsettled().await?;
            if (left == 0 && replayed == 0) || Instant::now() >= deadline {
                let t = self.started.elapsed().as_secs();
                println!("[{t:>4}s] drained: {left} messages not settled");
                return Ok(left);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// What the relays recorded for up to ten lost messages: the broker's receipt and when.
    async fn receipts(&self, lost: &[uuid::Uuid]) -> Result<Vec<String>> {
        self.db.receipts(lost).await
    }

    /// The number of dead letters and up to five of their errors.
    async fn dead_letters(&self) -> Result<(i64, Vec<String>)> {
        self.db.dead_letters().await
    }

    /// For investigating a failure: `written.csv` (id, key, INSERT issued and COMMIT returned,
    /// in ms since the start) and `arrivals.txt` (payloads in order of receipt).
    fn save(&self, ledger: &Ledger, arrivals: &[Vec<u8>]) -> Result<()> {
        let ms = |t: Instant| t.duration_since(self.started).as_secs_f64() * 1000.0;
        let mut written = String::from("id,key,began_ms,committed_ms\n");
        for w in &ledger.committed {
            let (began, committed) = (ms(w.began), ms(w.committed));
            written += &format!("{},{},{began:.1},{committed:.1}\n", w.id, w.key);
        }
        let file = self.dir.join("written.csv");
        std::fs::write(&file, written).ctx(file.display())?;
        let lines: Vec<_> = arrivals
            .iter()
            .map(|p| String::from_utf8_lossy(p))
            .collect();
        let file = self.dir.join("arrivals.txt");
        std::fs::write(&file, lines.join("\n")).ctx(file.display())
    }

    /// Prints the report; true when the run passed.
    fn report(
        &self,
        ledger: &Ledger,
        verdict: &Verdict,
        left: i64,
        dead: &(i64, Vec<String>),
        receipts: &[String],
        seed: u64,
    ) -> bool {
        let faults = &self.faults;
        let (hits, batch) = (faults.hits.load(Relaxed), self.settings.batch_size);
        let per_hit = redelivery_per_hit(self.db.store, batch, self.relays.count());
        let allowed = hits as usize * per_hit;
        let refusals = self.relays.count_in_logs("basic.nack");
        let exits = faults.unexpected_exits.load(Relaxed);
        let (lost, violations) = (verdict.lost.len(), verdict.violations.len());
        let rolled_back = verdict.rolled_back_delivered.len();
        let t = self.started.elapsed().as_secs();
        println!(
            "\nchaos report: sink {:?}, storage {:?}, seed {seed}, {t} s, {} relays",
            self.kind,
            self.db.store,
            self.relays.count()
        );
        let rows = [
            ("committed messages", ledger.committed.len().to_string()),
            ("rolled back", ledger.rolled_back.len().to_string()),
            ("commit outcome unknown", ledger.uncertain.len().to_string()),
            ("broker arrivals", verdict.arrivals.to_string()),
            ("faults", faults.summary()),
            ("broker refusals (nacks)", refusals.to_string()),
            ("lost", format!("{lost} ({left} not settled)")),
            (
                "duplicates",
                format!(
                    "{} (allowed: {hits} relays hit × {per_hit} = {allowed})",
                    verdict.duplicates
                ),
            ),
            (
                "order violations",
                format!(
                    "{violations} (of {} messages with an order to keep)",
                    verdict.ordered
                ),
            ),
            ("rolled back, delivered", rolled_back.to_string()),
            ("dead letters left", dead.0.to_string()),
            ("not written by this run", verdict.foreign.to_string()),
            ("relays exited on their own", exits.to_string()),
        ];
        let mut rows = Vec::from(rows);
        let record = self.operator.as_ref().map(|op| &op.record);
        if let Some(r) = record {
            let poison = ledger.committed.iter().filter(|w| w.poison).count();
            rows.extend([
                ("poison messages", poison.to_string()),
                (
                    "operator actions",
                    format!(
                        "{} replays, {} releases ({} dead letters released past), {} purges ({} dead letters)",
                        r.replays,
                        r.releases,
                        r.released_past.len(),
                        r.purges,
                        r.purged.len()
                    ),
                ),
                (
                    "purged, delivered",
                    verdict.purged_delivered.len().to_string(),
                ),
                (
                    "purged, dead again",
                    r.purged_came_back.len().to_string(),
                ),
            ]);
        }
        if self.db.store == Store::PostgresLog {
            rows.extend(self.log_mode_rows());
        }
        println!("  | {:<26} | figure\n  |{:-<28}|{:-<60}", "what", "", "");
        for (what, figure) in rows {
            println!("  | {what:<26} | {figure}");
        }
        for v in verdict.violations.iter().take(10) {
            println!(
                "  order violation: key {}: {} (arrived #{}) committed {:.1?} before {} (arrived #{}) began",
                v.key, v.earlier, v.earlier_at, v.margin, v.later, v.later_at
            );
        }
        for lost in receipts {
            println!("  lost: {lost}");
        }
        for error in &dead.1 {
            println!("  dead letter: {error}");
        }
        for id in verdict.purged_delivered.iter().take(10) {
            println!("  purged, delivered: {id}");
        }
        if self.kind == Kind::Amqp && refusals == 0 {
            println!("  warning: RabbitMQ refused no publish: the retry path was not exercised");
        }
        let failures: Vec<String> = [
            (lost > 0, format!("{lost} messages lost")),
            (
                violations > 0,
                format!("{violations} per-key order violations"),
            ),
            (
                rolled_back > 0,
                format!("{rolled_back} rolled-back messages delivered"),
            ),
            (dead.0 > 0, format!("{} dead letters left", dead.0)),
            (
                !verdict.purged_delivered.is_empty(),
                format!(
                    "{} purged messages delivered",
                    verdict.purged_delivered.len()
                ),
            ),
            (
                record.is_some_and(|r| !r.purged_came_back.is_empty()),
                format!(
                    "{} purged messages dead-lettered again",
                    record.map_or(0, |r| r.purged_came_back.len())
                ),
            ),
            (
                verdict.duplicates > allowed,
                format!("{} duplicates, over {allowed}", verdict.duplicates),
            ),
            (
                verdict.foreign > 0,
                format!("{} messages this run did not write", verdict.foreign),
            ),
            (exits > 0, format!("{exits} relay exits nobody asked for")),
        ]
        .into_iter()
        .filter_map(|(failed, what)| failed.then_some(what))
        .collect();
        if failures.is_empty() {
            println!("chaos: PASSED");
            return true;
        }
        let keys: std::collections::BTreeSet<&str> =
            verdict.violations.iter().map(|v| v.key.as_str()).collect();
        if !keys.is_empty() {
            println!("chaos: keys out of order: {keys:?}");
        }
        let dir = self.dir.display();
        println!(
            "chaos: FAILED: {} (seed {seed}; relay logs kept in {dir})",
            failures.join("; ")
        );
        false
    }

    /// Log mode's own figures, from the relays' debug lines: shards taken (at start, and from
    /// relays that died or stalled past their lease), stale owners refused, and the rows the
    /// ranged deletes removed behind the cursors while the faults went on.
    fn log_mode_rows(&self) -> [(&'static str, String); 2] {
        let taken = self.relays.count_in_logs("took a shard");
        let refused = self
            .relays
            .count_in_logs("another relay took this shard over")
            + self
                .relays
                .count_in_logs("shard taken over by another relay");
        let removed = self
            .relays
            .sum_in_logs("removed delivered rows behind the cursors", "rows=");
        [
            (
                "shards taken (log mode)",
                format!("{taken} ({refused} times a stale owner dropped a shard taken over)"),
            ),
            (
                "rows cleaned up (log mode)",
                format!("{removed} behind the cursors"),
            ),
        ]
    }

    /// Drops the schema or tables and the broker's destination; removes the run's directory when told.
    async fn cleanup(&mut self, remove_dir: bool) {
        self.stop.cancel(); // the writers, if a failure left them running
        self.relays.stop(Duration::from_secs(5)).await;
        self.broker.cleanup(&self.name).await;
        self.db.cleanup().await;
        if remove_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Store, redelivery_per_hit};

    #[test]
    fn a_hit_may_redeliver_two_batches_and_in_log_mode_a_batch_per_shard_of_its_share() {
        assert_eq!(redelivery_per_hit(Store::Postgres, 20, 3), 40);
        assert_eq!(redelivery_per_hit(Store::Mysql, 20, 3), 40);
        // 8 shards over 3 relays: a share of 3.
        assert_eq!(redelivery_per_hit(Store::PostgresLog, 20, 3), 20 * (2 + 3));
        assert_eq!(redelivery_per_hit(Store::PostgresLog, 20, 1), 20 * (2 + 8));
    }
}
