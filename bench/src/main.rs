//! Benchmarks of the outbox engine against the real services on this machine. Every figure
//! is reported next to a baseline measured in the same run, as a ratio: the machines are
//! shared and noisy, so absolute numbers mean little on their own.
//!
//! `cargo xtask bench [--quick] [drain] [latency] [enqueue] [backlog] [sqlite] [mysql] [log]`
//! (all when none named); `log-drain`, `log-cleanup`, `log-enqueue`, `log-latency`,
//! `log-txn`, `log-binary`, `log-pairs` run one part of `log` (PostgreSQL log mode).
//! Writes a table to the terminal, `target/bench/results.json`, and the generated part of
//! BENCHMARKS.md with `bench/drain.svg`.

mod baselines;
mod binary;
mod drain;
mod enqueue;
mod latency;
mod log_mode;
mod mysql;
mod report;
mod setup;
mod sqlite;

use std::time::Duration;

/// How big and how often: `--quick` is a smoke run of under five minutes.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub quick: bool,
    /// Messages preloaded for a drain.
    pub drain_messages: u64,
    pub keys: u64,
    /// Repetitions; the median is reported.
    pub runs: usize,
    pub enqueue_duration: Duration,
    pub latency_duration: Duration,
    pub large_backlog: u64,
}

impl Scale {
    pub(crate) fn new(quick: bool) -> Self {
        if quick {
            Scale {
                quick,
                drain_messages: 20_000,
                keys: 1_000,
                runs: 1,
                enqueue_duration: Duration::from_secs(3),
                latency_duration: Duration::from_secs(3),
                large_backlog: 100_000,
            }
        } else {
            Scale {
                quick,
                drain_messages: 200_000,
                keys: 1_000,
                runs: 3,
                enqueue_duration: Duration::from_secs(10),
                latency_duration: Duration::from_secs(10),
                large_backlog: 1_000_000,
            }
        }
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale = Scale::new(args.iter().any(|a| a == "--quick"));
    let named: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |name: &str| named.is_empty() || named.contains(&name);
    let mut report = report::Report::new(scale);
    report.args = args.join(" ");
    let log_parts: Vec<&str> = named
        .iter()
        .copied()
        .filter(|n| *n == "log" || n.starts_with("log-"))
        .collect();
    println!("{}", report.machine);
    let result: Result<(), String> = async {
        // A part runs when named (every part when none is), in this order.
        macro_rules! part {
            ($name:literal, $run:path) => {
                if wanted($name) {
                    $run(scale, &mut report).await?;
                }
            };
        }
        part!("drain", drain::run);
        part!("backlog", drain::backlog);
        part!("latency", latency::run);
        part!("enqueue", enqueue::run);
        part!("sqlite", sqlite::run);
        part!("mysql", mysql::run);
        if named.is_empty() || !log_parts.is_empty() {
            log_mode::run(scale, &mut report, &log_parts).await?;
        }
        Ok(())
    }
    .await;
    if let Err(error) = result {
        eprintln!("benchmark failed: {error}");
        std::process::exit(1);
    }
    if let Err(error) = report.write() {
        eprintln!("cannot write the results: {error}");
        std::process::exit(1);
    }
}

/// The median of `values` (which must not be empty).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
