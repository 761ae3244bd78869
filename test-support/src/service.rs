//! The servers the suites run against, in one table: where each is, how to point the suites
//! at another one, and what `cargo xtask services` installs. Plain `std`, so that xtask and
//! the benchmark read this same file (`#[path]`) without depending on the crate.

use std::time::Duration;

/// The Debian package that installs a server, and the program whose absence means it is
/// not installed yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Package {
    /// The package, for `apt-get install`.
    pub name: &'static str,
    /// A program the package installs (looked for on `PATH`, `/usr/sbin` and RabbitMQ's
    /// directory).
    pub program: &'static str,
}

/// How `cargo xtask services` starts a server that is down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// This command line, which returns once the server runs in the background (a shell
    /// line, run with `sh -c`).
    Command(&'static str),
    /// A function of xtask's own, for servers that take more than one command (a database
    /// made first, a program built first).
    Xtask,
}

/// One row of the table.
struct Spec {
    id: &'static str,
    name: &'static str,
    env: &'static str,
    default_url: &'static str,
    package: Option<Package>,
    start: Start,
    startup: Duration,
}

/// Expands the table into [`Service`], [`Service::ALL`] and the match that gives each
/// variant its row.
macro_rules! services {
    ($( $(#[$doc:meta])* $variant:ident { $($field:ident: $value:expr),* $(,)? } )*) => {
        /// A server the suites run against, on this machine unless its environment variable
        /// says otherwise. `cargo xtask services` starts them all.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Service {
            $( $(#[$doc])* $variant, )*
        }

        impl Service {
            /// Every service, in the order `cargo xtask services` starts them.
            pub const ALL: &'static [Service] = &[$(Service::$variant),*];

            const fn spec(self) -> Spec {
                match self {
                    $( Service::$variant => Spec { $($field: $value),* }, )*
                }
            }
        }
    };
}

services! {
    /// PostgreSQL.
    Postgres {
        id: "postgres",
        name: "PostgreSQL",
        env: "OUTBOX_TEST_POSTGRES_URL",
        default_url: "postgres://postgres@127.0.0.1:5432/test",
        package: Some(Package { name: "postgresql", program: "pg_ctlcluster" }),
        start: Start::Xtask,
        startup: Duration::from_secs(30),
    }
    /// MySQL or MariaDB (`cargo xtask services` starts MariaDB).
    MySql {
        id: "mysql",
        name: "MariaDB",
        env: "OUTBOX_TEST_MYSQL_URL",
        default_url: "mysql://root@127.0.0.1:3306/test",
        package: Some(Package { name: "mariadb-server", program: "mariadbd" }),
        start: Start::Xtask,
        startup: Duration::from_secs(30),
    }
    /// Redis.
    Redis {
        id: "redis",
        name: "Redis",
        env: "OUTBOX_TEST_REDIS_URL",
        default_url: "redis://127.0.0.1:6379",
        package: Some(Package { name: "redis-server", program: "redis-server" }),
        start: Start::Command(
            "mkdir -p /var/lib/redis /var/log/redis && redis-server --daemonize yes \
             --bind 127.0.0.1 -::1 --port 6379 --save '' --appendonly no \
             --dir /var/lib/redis --logfile /var/log/redis/ci.log",
        ),
        startup: Duration::from_secs(15),
    }
    /// RabbitMQ.
    Amqp {
        id: "amqp",
        name: "RabbitMQ",
        env: "OUTBOX_TEST_AMQP_URL",
        default_url: "amqp://guest:guest@127.0.0.1:5672/%2f",
        package: Some(Package { name: "rabbitmq-server", program: "rabbitmq-server" }),
        start: Start::Command("rabbitmq-server -detached"),
        startup: Duration::from_secs(90),
    }
    /// NATS with JetStream.
    Nats {
        id: "nats",
        name: "NATS with JetStream",
        env: "OUTBOX_TEST_NATS_URL",
        default_url: "nats://127.0.0.1:4222",
        package: Some(Package { name: "nats-server", program: "nats-server" }),
        start: Start::Command(
            "mkdir -p /var/lib/nats-server && start-stop-daemon --start --oknodo --background \
             --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
             -l /var/log/nats-server.log",
        ),
        startup: Duration::from_secs(15),
    }
    /// A Kafka-protocol broker (tansu); its "URL" is a `host:port` bootstrap list. xtask
    /// builds it with `cargo install`.
    Kafka {
        id: "kafka",
        name: "Kafka (tansu)",
        env: "OUTBOX_TEST_KAFKA_BROKERS",
        default_url: "127.0.0.1:9092",
        package: None,
        start: Start::Xtask,
        startup: Duration::from_secs(30),
    }
}

impl Service {
    /// The environment variable that points the suites at another server.
    pub const fn env(self) -> &'static str {
        self.spec().env
    }

    /// The local server `cargo xtask services` starts.
    pub const fn default_url(self) -> &'static str {
        self.spec().default_url
    }

    /// A short name, for names of relays and reports: `redis`.
    pub const fn id(self) -> &'static str {
        self.spec().id
    }

    /// What to call the server in a message.
    pub const fn name(self) -> &'static str {
        self.spec().name
    }

    /// The Debian package `cargo xtask services` installs when the server is missing
    /// (`None`: it installs it another way).
    pub const fn package(self) -> Option<Package> {
        self.spec().package
    }

    /// How `cargo xtask services` starts the local server when it is down.
    pub const fn start(self) -> Start {
        self.spec().start
    }

    /// How long a start of the local server may take before it accepts connections.
    pub const fn startup(self) -> Duration {
        self.spec().startup
    }

    /// The port of the local server ([`Service::default_url`]) on 127.0.0.1.
    pub fn local_port(self) -> u16 {
        let url = self.default_url();
        let after = url.find("127.0.0.1:").map_or("", |at| &url[at + 10..]);
        let digits = after
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after.len());
        after[..digits].parse().unwrap_or(0)
    }

    /// `$`[`Service::env`], or [`Service::default_url`].
    pub fn url(self) -> String {
        std::env::var(self.env()).unwrap_or_else(|_| self.default_url().to_string())
    }
}
