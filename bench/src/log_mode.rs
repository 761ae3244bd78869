//! PostgreSQL log mode (`[storage] mode = "log"`, issue 15) against lease mode and the bare
//! `DELETE … SKIP LOCKED` ceiling measured in the same run: drains to every sink, the cost of
//! the cleanup (and ranged deletes against dropping a time partition), the writers' cost of
//! the extra columns, latency, the delay an open transaction causes, and the `outbox` binary
//! itself with several batch sizes. Every row's section starts with `log`, so a full run
//! writes them to the log-mode block of BENCHMARKS.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{Storage, WorkerConfig};
use outbox_postgres::{PgStorage, StorageMode};

use crate::baselines;
use crate::binary::{self, Binary};
use crate::drain::{self, BATCH, repeat};
use crate::enqueue;
use crate::latency;
use crate::report::Report;
use crate::setup::{BenchOutbox, CountingSink, NullSink, SinkKind, spawn_relay, text};
use crate::{Scale, median};

/// Which parts of the log section to run: `log` runs them all, `log-drain` etc. one each.
pub async fn run(scale: Scale, report: &mut Report, named: &[&str]) -> Result<(), String> {
    let all = named.is_empty() || named.contains(&"log");
    let wanted = |part: &str| all || named.contains(&format!("log-{part}").as_str());
    // A part that fails does not throw away the others' figures: they are written first.
    let mut failed = Vec::new();
    macro_rules! part {
        ($name:literal, $body:expr) => {
            if wanted($name) {
                if let Err(error) = $body.await {
                    eprintln!("log {} failed: {error}", $name);
                    failed.push(format!("log {}: {error}", $name));
                }
            }
        };
    }
    part!("drain", drains(scale, report));
    part!("pairs", redis_pairs(scale, report));
    part!("cleanup", cleanup(scale, report));
    part!("cleanup", partitions(scale, report));
    part!("enqueue", enqueue(scale, report));
    part!("latency", latency(scale, report));
    part!("txn", open_transaction(scale, report));
    part!("binary", binary_relay(scale, report));
    if failed.is_empty() {
        return Ok(());
    }
    report.write()?;
    Err(failed.join("\n"))
}

fn relays_name(relays: usize) -> String {
    format!("{relays} relay{}", if relays == 1 { "" } else { "s" })
}

/// Drains with 1, 2 and 4 relays to every sink, key order on, in log and in lease mode.
async fn drains(scale: Scale, report: &mut Report) -> Result<(), String> {
    let n = scale.drain_messages;
    println!(
        "\n== log drain: {n} messages over {} keys, key order on, log against lease mode ==",
        scale.keys
    );
    let bare = drain::bare_delete_ceiling(scale, report, "log drain").await?;
    for (kind, runs) in drain::sinks(scale) {
        let ceiling = if kind == SinkKind::Null {
            None
        } else {
            let c = median(repeat(runs, || baselines::sink_ceiling(scale, kind)).await?);
            report.add(
                "log drain",
                &format!("ceiling: {} publish, no database", kind.name()),
                c,
                "events/s",
                Some(("bare delete", bare)),
            );
            Some(c)
        };
        for &relays in drain::relay_counts(scale) {
            // Log and lease alternate, so drift on the shared machine hits both alike.
            let (mut log, mut lease) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                log.push(
                    drain::one_drain(scale, kind, relays, true, StorageMode::Log)
                        .await?
                        .rate,
                );
                lease.push(
                    drain::one_drain(scale, kind, relays, true, StorageMode::Lease)
                        .await?
                        .rate,
                );
            }
            let (log, lease) = (median(log), median(lease));
            let name = format!("{} → {}", relays_name(relays), kind.name());
            report.add(
                "log drain",
                &format!("{name}, log mode"),
                log,
                "events/s",
                Some(("bare delete", bare)),
            );
            report.add(
                "log drain",
                &format!("{name}, lease mode"),
                lease,
                "events/s",
                Some(("bare delete", bare)),
            );
            report.add_ratio("log drain", &format!("{name}: log vs lease"), log / lease);
            if let Some(ceiling) = ceiling {
                report.add_ratio(
                    "log drain",
                    &format!("{name}: log vs its sink ceiling"),
                    log / ceiling,
                );
            }
        }
    }
    Ok(())
}

/// The headline target on a shared machine: five pairs, each a bare-DELETE ceiling run
/// followed at once by one log-mode relay draining the same backlog to Redis, key order on.
/// Each pair's ratio is taken against its own ceiling, so drift between pairs cancels out;
/// the median ratio is reported with the lowest and highest.
async fn redis_pairs(scale: Scale, report: &mut Report) -> Result<(), String> {
    let pairs = if scale.quick { 1 } else { 5 };
    println!(
        "\n== log pairs: {pairs} × (bare DELETE, then 1 relay → redis in log mode), {} messages ==",
        scale.drain_messages
    );
    let mut ratios = Vec::new();
    let (mut bares, mut logs) = (Vec::new(), Vec::new());
    for pair in 1..=pairs {
        let bare = baselines::bare_delete(scale).await?;
        let log = drain::one_drain(scale, SinkKind::Redis, 1, true, StorageMode::Log)
            .await?
            .rate;
        println!(
            "pair {pair}: ceiling {bare:.0} rows/s, log → redis {log:.0} events/s, {:.2}×",
            log / bare
        );
        ratios.push(log / bare);
        bares.push(bare);
        logs.push(log);
    }
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = ratios.iter().copied().fold(0.0, f64::max);
    report.add(
        "log pairs",
        "ceiling: bare DELETE … SKIP LOCKED loop (median)",
        median(bares),
        "rows/s",
        None,
    );
    report.add(
        "log pairs",
        "1 relay → redis, log mode (median)",
        median(logs),
        "events/s",
        None,
    );
    report.add_ratio(
        "log pairs",
        "1 relay → redis vs its pair's ceiling: median",
        median(ratios),
    );
    report.add_ratio(
        "log pairs",
        "1 relay → redis vs its pair's ceiling: lowest",
        lowest,
    );
    report.add_ratio(
        "log pairs",
        "1 relay → redis vs its pair's ceiling: highest",
        highest,
    );
    Ok(())
}

/// One relay → none draining a large backlog in log mode, with the cleanup as configured
/// (`retention`: `None` deletes behind the cursors); then one more housekeeping, timed.
async fn drain_with_cleanup(
    n: u64,
    keys: u64,
    retention: Option<Duration>,
) -> Result<Cleaned, String> {
    let outbox = BenchOutbox::new_in(StorageMode::Log).await?;
    outbox.preload(n, keys).await?;
    let mut config = outbox.config(true, outbox_postgres::DEFAULT_MAX_PER_KEY);
    config.retention = retention;
    let storage = Arc::new(PgStorage::new(config).map_err(text)?);
    let delivered = Arc::new(AtomicU64::new(0));
    let sink = Arc::new(CountingSink {
        inner: Arc::new(NullSink),
        delivered: delivered.clone(),
    });
    let started = Instant::now();
    let (handle, shutdown) = spawn_relay(
        WorkerConfig {
            batch_size: BATCH,
            poll_interval: Duration::from_millis(50),
            ..WorkerConfig::new("bench-cleanup")
        },
        storage.clone(),
        sink,
    )?;
    let deadline = started + Duration::from_secs(600);
    while delivered.load(Ordering::Relaxed) < n {
        if Instant::now() > deadline {
            shutdown.cancel();
            return Err("log drain with cleanup did not finish in 10 minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    // Wait for the cursors to pass every row, then run the housekeeping once more: with
    // the worker still owning every shard, it deletes all that was delivered.
    let t = outbox.table.qualified("");
    let shards = outbox.table.qualified("_shards");
    let unsettled = format!(
        "SELECT count(*) FROM {t} o JOIN {shards} s ON s.shard = o.shard
         WHERE (o.xid, o.seq) > (s.cursor_xid, s.cursor_seq)"
    );
    loop {
        let left: i64 = sqlx::query_scalar(&unsettled)
            .fetch_one(&outbox.pool)
            .await
            .map_err(text)?;
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            shutdown.cancel();
            return Err(format!(
                "{left} rows stayed past the cursors after the drain"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let count = format!("SELECT count(*) FROM {t}");
    let before: i64 = sqlx::query_scalar(&count)
        .fetch_one(&outbox.pool)
        .await
        .map_err(text)?;
    let at = Instant::now();
    storage.maintain().await.map_err(text)?;
    let maintain = at.elapsed();
    let left: i64 = sqlx::query_scalar(&count)
        .fetch_one(&outbox.pool)
        .await
        .map_err(text)?;
    shutdown.cancel();
    handle.await.map_err(text)?;
    outbox.drop_schema().await?;
    Ok(Cleaned {
        rate,
        maintain,
        before,
        left,
    })
}

/// What [`drain_with_cleanup`] measured.
struct Cleaned {
    /// Drain rate, events/s.
    rate: f64,
    /// How long the housekeeping after the drain took.
    maintain: Duration,
    /// Rows in the log before it, and after.
    before: i64,
    left: i64,
}

/// The cleanup's cost: a drain long enough for the housekeeping (every 10 s) to delete
/// behind the cursors while it runs, against the same drain with `retention` keeping rows.
async fn cleanup(scale: Scale, report: &mut Report) -> Result<(), String> {
    let n = scale.large_backlog;
    println!("\n== log cleanup: one relay → none draining {n}, cleanup against retention ==");
    let (mut with, mut kept, mut rows_left, mut delete_rate, mut maintain_kept) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Large drains: one run each in the quick run, two otherwise (each takes about a minute).
    let runs = if scale.quick { 1 } else { 2 };
    for _ in 0..runs {
        let c = drain_with_cleanup(n, scale.keys, None).await?;
        if c.left != 0 {
            return Err(format!(
                "the cleanup left {} delivered rows behind the cursors",
                c.left
            ));
        }
        with.push(c.rate);
        rows_left.push(c.before as f64);
        delete_rate.push(c.before as f64 / c.maintain.as_secs_f64().max(1e-6));
        let c = drain_with_cleanup(n, scale.keys, Some(Duration::from_secs(3600))).await?;
        if c.left as u64 != n {
            return Err(format!(
                "retention 1 h kept {} of {n} delivered rows; it should keep them all",
                c.left
            ));
        }
        kept.push(c.rate);
        maintain_kept.push(c.maintain.as_secs_f64() * 1000.0);
    }
    let (with, kept) = (median(with), median(kept));
    report.add(
        "log cleanup",
        &format!("1 relay → none, {n} backlog, cleanup on"),
        with,
        "events/s",
        Some(("retention", kept)),
    );
    report.add(
        "log cleanup",
        &format!("1 relay → none, {n} backlog, retention 1 h (rows kept)"),
        kept,
        "events/s",
        None,
    );
    report.add(
        "log cleanup",
        "rows the housekeeping during the drain had not yet deleted at its end",
        median(rows_left),
        "rows",
        None,
    );
    report.add(
        "log cleanup",
        "housekeeping after the drain: ranged delete of those rows",
        median(delete_rate),
        "rows/s",
        None,
    );
    report.add(
        "log cleanup",
        "housekeeping after the drain with retention 1 h (deletes nothing)",
        median(maintain_kept),
        "ms",
        None,
    );
    Ok(())
}

/// Ranged DELETE of N delivered rows (the housekeeping's statement) against detaching and
/// dropping a time partition that holds them: a plain SQL experiment on a partitioned copy
/// of the log table, not something the storage does.
async fn partitions(scale: Scale, report: &mut Report) -> Result<(), String> {
    let n = scale.drain_messages;
    println!("\n== log cleanup: ranged DELETE of {n} rows against DETACH + DROP PARTITION ==");
    let (mut delete, mut vacuum, mut dropped) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..scale.runs {
        let (d, v, p) = partition_run(n, scale.keys).await?;
        delete.push(d);
        vacuum.push(v);
        dropped.push(p);
    }
    let (delete, vacuum, dropped) = (median(delete), median(vacuum), median(dropped));
    report.add(
        "log cleanup",
        &format!("ranged DELETE of {n} delivered rows (16 shards)"),
        delete,
        "ms",
        None,
    );
    report.add(
        "log cleanup",
        "VACUUM of the log after that DELETE",
        vacuum,
        "ms",
        None,
    );
    report.add(
        "log cleanup",
        &format!("DETACH + DROP of a partition holding the {n} rows"),
        dropped,
        "ms",
        Some(("ranged DELETE", delete)),
    );
    report.add_ratio(
        "log cleanup",
        "DETACH + DROP vs DELETE + VACUUM",
        dropped / (delete + vacuum),
    );
    Ok(())
}

/// One run of [`partitions`]: (DELETE ms, VACUUM ms, DETACH + DROP ms).
async fn partition_run(n: u64, keys: u64) -> Result<(f64, f64, f64), String> {
    let outbox = BenchOutbox::new_in(StorageMode::Log).await?;
    outbox.preload(n, keys).await?;
    let t = outbox.table.qualified("");
    let shards = outbox.table.qualified("_shards");
    let s = &outbox.schema;
    // The partitioned copy: the old partition holds every row (delivered), the current one
    // a few newer rows that must stay.
    let setup = format!(
        r#"CREATE TABLE "{s}".plog (
            seq bigint NOT NULL, xid xid8 NOT NULL, id uuid NOT NULL, topic text NOT NULL,
            partition_key text, payload bytea NOT NULL, headers jsonb NOT NULL,
            traceparent text, tracestate text, created_at timestamptz NOT NULL,
            shard integer NOT NULL, PRIMARY KEY (shard, xid, seq, created_at)
        ) PARTITION BY RANGE (created_at);
        CREATE TABLE "{s}".plog_old PARTITION OF "{s}".plog
            FOR VALUES FROM ('2000-01-01 00:00+00') TO ('2000-01-02 00:00+00');
        CREATE TABLE "{s}".plog_new PARTITION OF "{s}".plog
            FOR VALUES FROM ('2000-01-02 00:00+00') TO (MAXVALUE);
        INSERT INTO "{s}".plog SELECT seq, xid, id, topic, partition_key, payload, headers,
            traceparent, tracestate, '2000-01-01 12:00+00', shard FROM {t};
        INSERT INTO "{s}".plog SELECT seq, xid, id, topic, partition_key, payload, headers,
            traceparent, tracestate, '2000-01-02 12:00+00', shard FROM {t} LIMIT 1000;
        UPDATE {shards} s SET cursor_xid = m.xid, cursor_seq = m.seq
        FROM (SELECT DISTINCT ON (shard) shard, xid, seq FROM {t}
              ORDER BY shard, xid DESC, seq DESC) m
        WHERE s.shard = m.shard;"#
    );
    sqlx::raw_sql(&setup)
        .execute(&outbox.pool)
        .await
        .map_err(text)?;
    for table in ["plog_old", "plog_new"] {
        sqlx::query(&format!(r#"VACUUM ANALYZE "{s}".{table}"#))
            .execute(&outbox.pool)
            .await
            .map_err(text)?;
    }
    let all: Vec<i32> = sqlx::query_scalar(&format!("SELECT shard FROM {shards}"))
        .fetch_all(&outbox.pool)
        .await
        .map_err(text)?;
    // The housekeeping's statement (outbox-postgres/src/log/sql.rs, `cleanup`), without retention.
    let cleanup = format!(
        "DELETE FROM {t} o USING {shards} s
         WHERE s.shard = ANY($1) AND o.shard = s.shard
           AND (o.xid, o.seq) <= (s.cursor_xid, s.cursor_seq)
           AND ($2::bigint IS NULL OR o.created_at < now() - $2 * interval '1 millisecond')"
    );
    let mut conn = outbox.pool.acquire().await.map_err(text)?;
    let at = Instant::now();
    let deleted = sqlx::query(&cleanup)
        .bind(&all)
        .bind(None::<i64>)
        .execute(&mut *conn)
        .await
        .map_err(text)?
        .rows_affected();
    let delete = at.elapsed().as_secs_f64() * 1000.0;
    if deleted != n {
        return Err(format!("the ranged delete removed {deleted} of {n} rows"));
    }
    let at = Instant::now();
    sqlx::query(&format!("VACUUM {t}"))
        .execute(&mut *conn)
        .await
        .map_err(text)?;
    let vacuum = at.elapsed().as_secs_f64() * 1000.0;
    let at = Instant::now();
    sqlx::query(&format!(
        r#"ALTER TABLE "{s}".plog DETACH PARTITION "{s}".plog_old"#
    ))
    .execute(&mut *conn)
    .await
    .map_err(text)?;
    sqlx::query(&format!(r#"DROP TABLE "{s}".plog_old"#))
        .execute(&mut *conn)
        .await
        .map_err(text)?;
    let dropped = at.elapsed().as_secs_f64() * 1000.0;
    let left: i64 = sqlx::query_scalar(&format!(r#"SELECT count(*) FROM "{s}".plog"#))
        .fetch_one(&mut *conn)
        .await
        .map_err(text)?;
    if left != 1000 {
        return Err(format!(
            "the partitioned copy kept {left} rows after the drop; expected 1000"
        ));
    }
    drop(conn);
    outbox.drop_schema().await?;
    Ok((delete, vacuum, dropped))
}

/// 16 writers of single-message transactions into a log-mode table against a lease-mode one
/// (trigger present, no relay, in both).
async fn enqueue(scale: Scale, report: &mut Report) -> Result<(), String> {
    println!("\n== log enqueue: 16 writers, log-mode table against lease-mode table ==");
    let (mut log, mut lease) = (Vec::new(), Vec::new());
    for _ in 0..scale.runs {
        lease.push(enqueue_run(StorageMode::Lease, scale.enqueue_duration).await?);
        log.push(enqueue_run(StorageMode::Log, scale.enqueue_duration).await?);
    }
    let lease = median(lease);
    report.add(
        "log enqueue",
        "16 writers into the lease-mode table",
        lease,
        "commits/s",
        None,
    );
    report.add(
        "log enqueue",
        "16 writers into the log-mode table",
        median(log),
        "commits/s",
        Some(("lease table", lease)),
    );
    Ok(())
}

async fn enqueue_run(mode: StorageMode, duration: Duration) -> Result<f64, String> {
    let outbox = BenchOutbox::new_in(mode).await?;
    let rate = enqueue::commits_per_second(&outbox, duration).await?;
    outbox.drop_schema().await?;
    Ok(rate)
}

/// Latency at 500 messages/s, log mode beside lease mode.
async fn latency(scale: Scale, report: &mut Report) -> Result<(), String> {
    println!("\n== log latency: 500/s, commit to arrival in Redis, one library relay ==");
    for mode in [StorageMode::Log, StorageMode::Lease] {
        let (achieved, latencies) = latency::measure(500, scale.latency_duration, mode).await?;
        let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize];
        let name = format!(
            "{} mode, 500/s offered ({achieved:.0}/s achieved)",
            mode.name()
        );
        for (label, p) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
            report.add(
                "log latency",
                &format!("{name} {label}"),
                pct(p),
                "ms",
                None,
            );
        }
    }
    Ok(())
}

/// A transaction that took an xid held open while others enqueue: their delivery waits for
/// it (the horizon), and nothing is lost.
async fn open_transaction(scale: Scale, report: &mut Report) -> Result<(), String> {
    let hold = if scale.quick {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(10)
    };
    println!(
        "\n== log open transaction: one held {} s while 100 messages/s are enqueued ==",
        hold.as_secs()
    );
    let outbox = BenchOutbox::new_in(StorageMode::Log).await?;
    let run = outbox.schema.clone();
    let storage = outbox.storage(true)?;
    let (relay, shutdown) = spawn_relay(
        WorkerConfig::new("bench-open-txn"),
        storage.clone(),
        SinkKind::Redis.build(&run)?,
    )?;
    let blocker_table = format!(r#""{run}".blocker"#);
    sqlx::query(&format!("CREATE TABLE {blocker_table} (n int)"))
        .execute(&outbox.pool)
        .await
        .map_err(text)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let arrivals = binary::Arrivals::default();
    let consumer = tokio::spawn(binary::consume_redis(
        format!("{run}:latency"),
        arrivals.clone(),
        shutdown.clone(),
    ));
    let total = Duration::from_secs(1) + hold + Duration::from_secs(2);
    let producing = tokio::spawn(binary::produce(
        outbox.pool.clone(),
        outbox.table.clone(),
        "latency",
        100,
        total,
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut blocker = outbox.pool.begin().await.map_err(text)?;
    sqlx::query(&format!("INSERT INTO {blocker_table} VALUES (1)"))
        .execute(&mut *blocker)
        .await
        .map_err(text)?;
    let opened = Instant::now();
    tokio::time::sleep(hold / 2).await;
    let lag = storage.horizon().await.map_err(text)?;
    tokio::time::sleep(hold - hold / 2).await;
    blocker.commit().await.map_err(text)?;
    let committed = Instant::now();
    let sent = producing.await.map_err(text)??;
    arrivals.wait_for(sent.len(), Duration::from_secs(30)).await;
    shutdown.cancel();
    consumer.await.map_err(text)??;
    relay.await.map_err(text)?;
    SinkKind::Redis.cleanup(&run).await?;
    outbox.drop_schema().await?;

    let arrived = arrivals.snapshot();
    let lost = sent
        .iter()
        .filter(|(id, _)| !arrived.contains_key(id))
        .count();
    let during: Vec<(Instant, Instant)> = sent
        .iter()
        .filter(|(_, at)| *at > opened && *at < committed)
        .filter_map(|(id, at)| arrived.get(id).map(|got| (*at, *got)))
        .collect();
    // The longest wait: a message committed just after the blocker took its xid waits for
    // all of it. (One whose INSERT came before the blocker's is not held, whenever its
    // commit returned.)
    let longest = during
        .iter()
        .map(|(at, got)| got.saturating_duration_since(*at).as_secs_f64())
        .fold(0.0, f64::max);
    let released = during
        .iter()
        .map(|(_, got)| got.saturating_duration_since(committed).as_secs_f64() * 1000.0)
        .fold(0.0, f64::max);
    let after: Vec<f64> = sent
        .iter()
        .filter(|(_, at)| *at > committed + Duration::from_millis(500))
        .filter_map(|(id, at)| {
            arrived
                .get(id)
                .map(|got| ms(got.saturating_duration_since(*at)))
        })
        .collect();
    let name = format!("{} s open transaction", hold.as_secs());
    report.add(
        "log open txn",
        &format!("{name}: messages enqueued while it was open"),
        during.len() as f64,
        "messages",
        None,
    );
    report.add(
        "log open txn",
        &format!("{name}: longest delay of a message enqueued while it was open"),
        longest,
        "s",
        None,
    );
    report.add(
        "log open txn",
        &format!("{name}: last held message delivered after its commit"),
        released,
        "ms",
        None,
    );
    report.add(
        "log open txn",
        &format!("{name}: messages lost of {}", sent.len()),
        lost as f64,
        "messages",
        None,
    );
    if !after.is_empty() {
        report.add(
            "log open txn",
            &format!("{name}: p99 latency once it ended"),
            percentile(after, 0.99),
            "ms",
            None,
        );
    }
    if let Some(lag) = lag {
        report.add(
            "log open txn",
            &format!(
                "{name}: horizon() at half time: waiting rows (blocker found: {})",
                lag.held_by.is_some()
            ),
            lag.waiting as f64,
            "rows",
            None,
        );
    }
    if lost > 0 {
        return Err(format!(
            "the open-transaction run lost {lost} of {} messages",
            sent.len()
        ));
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn percentile(mut values: Vec<f64>, p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values[((values.len() as f64 - 1.0) * p).round() as usize]
}

/// The `outbox` binary as the relay: against the library worker draining to Redis, and
/// draining to Redis and Kafka with several batch sizes, with their latency at 200/s.
async fn binary_relay(scale: Scale, report: &mut Report) -> Result<(), String> {
    println!("\n== log binary: the `outbox` relay process, log mode ==");
    let bin = Binary::build()?;
    let n = scale.drain_messages;
    let (mut lib, mut proc) = (Vec::new(), Vec::new());
    for _ in 0..scale.runs {
        lib.push(
            drain::one_drain(scale, SinkKind::Redis, 1, true, StorageMode::Log)
                .await?
                .rate,
        );
        proc.push(bin.drain(SinkKind::Redis, BATCH, n, scale.keys).await?);
    }
    let lib = median(lib);
    report.add(
        "log binary",
        &format!("library worker, 1 relay → redis, {n} backlog, batch {BATCH}"),
        lib,
        "events/s",
        None,
    );
    report.add(
        "log binary",
        &format!("outbox binary, 1 relay → redis, {n} backlog, batch {BATCH}"),
        median(proc),
        "events/s",
        Some(("library", lib)),
    );
    let backlog: u64 = if scale.quick { 10_000 } else { 50_000 };
    let batches: &[usize] = &[100, 500, 1000];
    let latency_for = if scale.quick {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(10)
    };
    for kind in [SinkKind::Redis, SinkKind::Kafka] {
        for &batch in batches {
            let rates = repeat(scale.runs, || bin.drain(kind, batch, backlog, scale.keys)).await?;
            report.add(
                "log binary",
                &format!("→ {}, batch_size {batch}: {backlog} backlog", kind.name()),
                median(rates),
                "events/s",
                None,
            );
            let (achieved, latencies) = bin.latency(kind, batch, 200, latency_for).await?;
            let name = format!(
                "→ {}, batch_size {batch}: 200/s ({achieved:.0}/s achieved)",
                kind.name()
            );
            report.add(
                "log binary",
                &format!("{name} p50"),
                percentile(latencies.clone(), 0.5),
                "ms",
                None,
            );
            report.add(
                "log binary",
                &format!("{name} p99"),
                percentile(latencies, 0.99),
                "ms",
                None,
            );
        }
    }
    Ok(())
}
