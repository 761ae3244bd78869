//! `outbox`: the outbox relay as a program. Brokers are swapped by configuration; see
//! docs/configuration.md for every key and `outbox --help` for the commands.

mod commands;
mod config;
mod console;
mod http;
mod relay;
mod telemetry;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

/// Exit code for a configuration error (EX_CONFIG from sysexits.h).
const EXIT_CONFIG: u8 = 78;
/// Exit code for a failure at run time (database or broker unreachable, …).
const EXIT_FAILURE: u8 = 1;

#[derive(Parser)]
#[command(
    name = "outbox",
    version,
    about = "Transactional outbox relay: delivers the messages your transactions write to a broker"
)]
struct Cli {
    /// Configuration file (TOML).
    #[arg(
        long,
        short,
        global = true,
        env = "OUTBOX_CONFIG",
        default_value = "outbox.toml"
    )]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the relay(s) until SIGTERM or SIGINT, then shut down gracefully.
    Relay,
    /// Create or upgrade the outbox tables.
    Migrate {
        /// Print the SQL that would run (only the steps the database lacks) instead of
        /// running it, for a database administrator to apply.
        #[arg(long)]
        print_sql: bool,
    },
    /// Validate the configuration, connect to the storage and the sink, report, exit.
    Check,
    /// Queue figures: pending, oldest pending age, in flight, dead-lettered, parked keys.
    Status {
        /// Print again every interval (e.g. `5s`) until interrupted.
        #[arg(long, num_args = 0..=1, default_missing_value = "5s", value_parser = humantime::parse_duration)]
        watch: Option<Duration>,
        #[command(flatten)]
        relay: RelayChoice,
        /// Text, or one JSON object per relay (and per interval with --watch).
        #[arg(long, value_enum, default_value_t)]
        output: commands::Output,
    },
    /// Inspect and repair dead letters.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
    /// Enqueue messages: one from the arguments, or JSON lines from standard input.
    Enqueue(commands::EnqueueArgs),
}

#[derive(Args, Clone, Default)]
struct RelayChoice {
    /// Which [[relay]] block (by name) when the configuration has several.
    #[arg(long)]
    relay: Option<String>,
}

#[derive(Subcommand)]
enum DeadLetterCommand {
    /// List dead letters, oldest first.
    List {
        #[command(flatten)]
        filter: commands::FilterArgs,
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Text, or one JSON object per dead letter.
        #[arg(long, value_enum, default_value_t)]
        output: commands::Output,
    },
    /// Show one dead letter in full.
    Show {
        id: uuid::Uuid,
        #[command(flatten)]
        relay: RelayChoice,
        /// Text, or one JSON object.
        #[arg(long, value_enum, default_value_t)]
        output: commands::Output,
    },
    /// Put dead letters back in the outbox, first in their key's order, and release the
    /// parked rest of their keys.
    Replay {
        #[command(flatten)]
        filter: commands::FilterArgs,
    },
    /// Delete dead letters for good (their keys stay parked until released).
    Purge {
        #[command(flatten)]
        filter: commands::FilterArgs,
    },
    /// Let a parked key flow again without replaying its dead letter.
    Release {
        key: String,
        #[command(flatten)]
        relay: RelayChoice,
    },
}

/// Why a command failed, which decides the exit code.
pub enum Failure {
    Config(String),
    Runtime(String),
}

impl From<config::ConfigError> for Failure {
    fn from(e: config::ConfigError) -> Self {
        Failure::Config(e.0)
    }
}

impl From<outbox::Error> for Failure {
    fn from(e: outbox::Error) -> Self {
        if e.kind() == outbox::ErrorKind::Config {
            // `main` says "configuration error" in front: the kind once.
            let text = e.to_string();
            let text = text.strip_prefix("configuration error: ").unwrap_or(&text);
            Failure::Config(text.to_string())
        } else {
            Failure::Runtime(e.to_string())
        }
    }
}

fn main() -> ExitCode {
    let matches = Cli::command()
        .after_help(outbox::backends::help())
        .get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    let config = match config::load(&cli.config) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("outbox: configuration error: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let telemetry = match telemetry::init(&config.observability) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("outbox: configuration error: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if !config.ignored_env.is_empty() {
        tracing::warn!(
            variables = %config.ignored_env.join(", "),
            "ignored OUTBOX_* environment variables that name no section; an override is \
             spelled OUTBOX_<SECTION>__<KEY> (see docs/configuration.md)"
        );
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("outbox: cannot start the runtime: {error}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Relay => relay::run(config).await,
            Command::Migrate { print_sql } => commands::migrate(&config, print_sql).await,
            Command::Check => commands::check(&config).await,
            Command::Status {
                watch,
                relay,
                output,
            } => commands::status(&config, relay.relay.as_deref(), watch, output).await,
            Command::DeadLetters(command) => commands::dead_letters(&config, command).await,
            Command::Enqueue(args) => commands::enqueue(&config, args).await,
        }
    });
    drop(runtime);
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Config(message)) => {
            eprintln!("outbox: configuration error: {message}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(Failure::Runtime(message)) => {
            eprintln!("outbox: {message}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
