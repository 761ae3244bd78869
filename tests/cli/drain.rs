//! What the kill -9 tests on MySQL and SQLite share: the writer's numbered messages, the
//! file sink's deliveries read back, and the checks that a killed relay lost nothing and
//! kept per-key order.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use super::{RelayProcess, outbox, text};

/// A delivered message: (key, number, id).
pub(super) type Delivery = (String, usize, String);

/// The `enqueue --stdin` lines of `keys` keys (`k0`, `k1`, …), `per_key` messages each, the
/// payload numbering them per key; interleaved, so every key is in every batch.
pub(super) fn numbered_lines(keys: usize, per_key: usize) -> String {
    let mut lines = String::new();
    for n in 0..per_key {
        for k in 0..keys {
            lines.push_str(&format!(
                "{{\"topic\":\"orders\",\"key\":\"k{k}\",\"payload\":\"{n}\"}}\n"
            ));
        }
    }
    lines
}

/// The delivered lines of the file sink, in file order, read by the names of its wire
/// module (nothing yet when the file does not exist).
pub(super) fn delivered(path: &Path) -> Vec<Delivery> {
    use outbox::file::wire::{ID, KEY, PAYLOAD};
    let Ok(contents) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    contents
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .map(|m| {
            (
                m[KEY].as_str().unwrap_or_default().to_string(),
                m[PAYLOAD]
                    .as_str()
                    .unwrap_or_default()
                    .parse()
                    .unwrap_or(usize::MAX),
                m[ID].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Waits until the sink holds at least `lines` deliveries: the first relay is well into
/// the drain.
pub(super) fn wait_for_deliveries(sink: &Path, lines: usize, deadline: Instant) {
    while delivered(sink).len() < lines {
        assert!(
            Instant::now() < deadline,
            "the first relay delivered too little"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// After the kill: waits until the `second` relay delivered every one of the `keys` ×
/// `per_key` messages at least once, stops it, checks the per-key order of every delivery
/// ([`assert_key_order`]) and that `status` on `config` shows nothing pending.
pub(super) fn delivered_in_key_order(
    second: RelayProcess,
    config: &Path,
    sink: &Path,
    (keys, per_key): (usize, usize),
    deadline: Instant,
) {
    let all = wait_for_every_message(sink, keys * per_key, deadline);
    assert_eq!(second.terminate().0, Some(0));
    assert_key_order(&all, keys, per_key);
    let status = outbox(config, &["status"]);
    assert!(
        text(&status.stdout).contains("pending 0 "),
        "{}",
        text(&status.stdout)
    );
}

/// Waits until every one of `total` messages was delivered at least once; returns every
/// delivery, redeliveries included.
fn wait_for_every_message(sink: &Path, total: usize, deadline: Instant) -> Vec<Delivery> {
    loop {
        let all = delivered(sink);
        let ids: HashSet<&str> = all.iter().map(|(_, _, id)| id.as_str()).collect();
        if ids.len() == total {
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {total} messages delivered by the deadline",
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Per key: every delivery of a message (a redelivery after the kill included) comes after
/// a delivery of the one before it, and the first deliveries are the `per_key` messages in
/// enqueue order, for each of the `keys` keys.
fn assert_key_order(all: &[Delivery], keys: usize, per_key: usize) {
    let mut seen: HashMap<&str, Vec<usize>> = HashMap::new();
    for (key, n, _) in all {
        let numbers = seen.entry(key.as_str()).or_default();
        assert!(
            *n == 0 || numbers.contains(&(n - 1)),
            "key {key}: message {n} delivered before message {}: {numbers:?}",
            n - 1
        );
        numbers.push(*n);
    }
    assert_eq!(seen.len(), keys);
    for (key, numbers) in &seen {
        let mut first_seen = Vec::new();
        for n in numbers {
            if !first_seen.contains(n) {
                first_seen.push(*n);
            }
        }
        assert_eq!(first_seen, (0..per_key).collect::<Vec<_>>(), "key {key}");
    }
}
