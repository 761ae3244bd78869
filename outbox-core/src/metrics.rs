//! The names of every metric the relay records, and of their labels, in one place: the
//! worker and the binary record them under these names, docs/configuration.md lists them
//! (a test checks that it lists each one), and dashboards can rely on them.

/// Label: the relay the figure belongs to: its configured name (`WorkerConfig::relay`), the
/// same on every replica and across restarts (Prometheus' `instance` tells replicas apart).
pub const RELAY: &str = "relay";
/// Label: the `outbox` version, on [`BUILD_INFO`].
pub const VERSION: &str = "version";
/// Label: the message's topic.
pub const TOPIC: &str = "topic";

/// Counter (relay, topic): messages the sink accepted.
pub const DELIVERED_TOTAL: &str = "outbox_delivered_total";
/// Counter (relay, topic): failed attempts that will be retried.
pub const RETRIED_TOTAL: &str = "outbox_retried_total";
/// Counter (relay, topic): messages dead-lettered.
pub const DEAD_LETTERED_TOTAL: &str = "outbox_dead_lettered_total";
/// Counter (relay, topic): retried plus dead-lettered.
pub const FAILED_TOTAL: &str = "outbox_failed_total";
/// Histogram (relay): one publish call, a round of a batch, in seconds.
pub const PUBLISH_DURATION_SECONDS: &str = "outbox_publish_duration_seconds";
/// Histogram (relay): a batch from claim to recorded outcomes, in seconds.
pub const BATCH_DURATION_SECONDS: &str = "outbox_batch_duration_seconds";
/// Gauge (relay): 1 when the sink's last health check or publish succeeded, else 0.
pub const SINK_UP: &str = "outbox_sink_up";
/// Gauge (relay): messages waiting for delivery.
pub const PENDING: &str = "outbox_pending";
/// Gauge (relay): messages claimed by a relay right now.
pub const IN_FLIGHT: &str = "outbox_in_flight";
/// Gauge (relay): pending messages that failed at least one attempt and wait to be retried.
pub const RETRYING: &str = "outbox_retrying";
/// Gauge (relay): messages in the dead-letter table.
pub const DEAD_LETTERED: &str = "outbox_dead_lettered";
/// Gauge (relay): partition keys held back behind a dead letter.
pub const PARKED_KEYS: &str = "outbox_parked_keys";
/// Gauge (relay): age of the oldest pending message, in seconds.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "outbox_oldest_pending_age_seconds";
/// Gauge (relay): committed messages not readable yet because an older transaction is still
/// open (storages that wait for older transactions, such as PostgreSQL's log mode).
pub const HORIZON_WAITING: &str = "outbox_horizon_waiting";
/// Gauge (relay): how long the transaction holding the horizon has been open, in seconds
/// (0 when none is known).
pub const HORIZON_HELD_SECONDS: &str = "outbox_horizon_held_seconds";

/// Histogram (relay): a message's age when the broker acknowledged it, from its creation
/// (the writer's clock) to its delivery (the relay's), in seconds.
pub const DELIVERY_LATENCY_SECONDS: &str = "outbox_delivery_latency_seconds";
/// Gauge (version): 1, labelled with the running binary's version.
pub const BUILD_INFO: &str = "outbox_build_info";

/// Counter (reason): connections the HTTP listener closed to stay within its cap
/// (`reason="cap"`).
pub const HTTP_CONNECTIONS_CLOSED_TOTAL: &str = "outbox_http_connections_closed_total";
/// Label of [`HTTP_CONNECTIONS_CLOSED_TOTAL`]: why the connection was closed.
pub const REASON: &str = "reason";

/// Counter (relay): runs of the worker that failed (a claim, settlement or maintenance the
/// storage refused or could not do); each is restarted after a wait.
pub const RUN_FAILURES_TOTAL: &str = "outbox_run_failures_total";

/// Every metric name above.
pub const ALL: [&str; 19] = [
    DELIVERED_TOTAL,
    RETRIED_TOTAL,
    DEAD_LETTERED_TOTAL,
    FAILED_TOTAL,
    PUBLISH_DURATION_SECONDS,
    BATCH_DURATION_SECONDS,
    SINK_UP,
    PENDING,
    IN_FLIGHT,
    RETRYING,
    DEAD_LETTERED,
    PARKED_KEYS,
    OLDEST_PENDING_AGE_SECONDS,
    HORIZON_WAITING,
    HORIZON_HELD_SECONDS,
    DELIVERY_LATENCY_SECONDS,
    BUILD_INFO,
    HTTP_CONNECTIONS_CLOSED_TOTAL,
    RUN_FAILURES_TOTAL,
];
