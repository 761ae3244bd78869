//! The verdict: what the writers committed against what the broker received.
//!
//! Order is only promised where it is defined: for two messages a and b of one key, a must
//! arrive (first) before b when a's COMMIT returned before b's INSERT was issued. Messages of
//! transactions that overlap in time have no defined order, so they are never compared; nor
//! is a dead letter its key was released past (the operator let later messages go on).
//! A message the operator purged is neither lost nor ever to arrive.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use uuid::Uuid;

use crate::writers::{Ledger, Written};

/// b arrived before a although a committed before b began.
#[derive(Debug)]
pub struct Violation {
    pub key: String,
    pub earlier: Uuid,
    pub later: Uuid,
    /// Positions of the first arrivals (0 = first message the broker took).
    pub earlier_at: usize,
    pub later_at: usize,
    /// How long before b's INSERT a's COMMIT had returned.
    pub margin: Duration,
}

#[derive(Debug, Default)]
pub struct Verdict {
    pub arrivals: usize,
    /// Broker messages whose payload names no message of this run.
    pub foreign: usize,
    pub lost: Vec<Uuid>,
    pub duplicates: usize,
    pub rolled_back_delivered: Vec<Uuid>,
    /// Purged dead letters that arrived anyway.
    pub purged_delivered: Vec<Uuid>,
    /// Messages that have at least one message of their key committed before they began.
    pub ordered: usize,
    /// One per message b that arrived before some message it must follow (with the
    /// latest-arriving such a).
    pub violations: Vec<Violation>,
}

/// The message id at the head of a payload (`<uuid> <key> <writer>#<n>`).
pub fn payload_id(payload: &[u8]) -> Option<Uuid> {
    let text = std::str::from_utf8(payload).ok()?;
    text.split(' ').next()?.parse().ok()
}

/// What the operator did that changes what is expected (operator.rs).
#[derive(Default)]
pub struct Waived<'a> {
    /// Deleted for good: not lost, and never to arrive.
    pub purged: Option<&'a HashSet<Uuid>>,
    /// Released past: later messages of their key may arrive before them.
    pub released_past: Option<&'a HashSet<Uuid>>,
}

/// Compares `arrivals` (broker payloads in order of receipt) with the ledger.
pub fn check(ledger: &Ledger, arrivals: &[Vec<u8>], waived: &Waived) -> Verdict {
    let empty = HashSet::new();
    let purged = waived.purged.unwrap_or(&empty);
    let released_past = waived.released_past.unwrap_or(&empty);
    let known: HashSet<Uuid> = ledger
        .committed
        .iter()
        .map(|w| w.id)
        .chain(ledger.rolled_back.iter().copied())
        .chain(ledger.uncertain.iter().copied())
        .collect();
    let mut first: HashMap<Uuid, usize> = HashMap::new();
    let mut verdict = Verdict {
        arrivals: arrivals.len(),
        ..Verdict::default()
    };
    for (position, payload) in arrivals.iter().enumerate() {
        match payload_id(payload).filter(|id| known.contains(id)) {
            None => verdict.foreign += 1,
            Some(id) if first.contains_key(&id) => verdict.duplicates += 1,
            Some(id) => {
                first.insert(id, position);
            }
        }
    }
    verdict.lost = ledger
        .committed
        .iter()
        .filter(|w| !first.contains_key(&w.id) && !purged.contains(&w.id))
        .map(|w| w.id)
        .collect();
    verdict.purged_delivered = purged
        .iter()
        .filter(|id| first.contains_key(id))
        .copied()
        .collect();
    verdict.rolled_back_delivered = ledger
        .rolled_back
        .iter()
        .filter(|id| first.contains_key(id))
        .copied()
        .collect();
    let (ordered, violations) = order(&ledger.committed, &first, released_past);
    verdict.ordered = ordered;
    verdict.violations = violations;
    verdict
}

/// Per key, sweeps the messages in order of their INSERT while adding, in order of their
/// COMMIT, every message that committed before it (but those released past): b violates when
/// the latest first arrival among those comes after b's own. O(n log n) per key.
fn order(
    committed: &[Written],
    first: &HashMap<Uuid, usize>,
    released_past: &HashSet<Uuid>,
) -> (usize, Vec<Violation>) {
    let mut by_key: HashMap<&str, Vec<&Written>> = HashMap::new();
    for written in committed {
        by_key.entry(&written.key).or_default().push(written);
    }
    let (mut ordered, mut violations) = (0, Vec::new());
    for (key, mut by_begin) in by_key {
        let mut by_commit = by_begin.clone();
        by_commit.sort_by_key(|w| w.committed);
        by_begin.sort_by_key(|w| w.began);
        let mut next = 0;
        let mut latest: Option<(usize, &Written)> = None;
        for b in by_begin {
            while next < by_commit.len() && by_commit[next].committed < b.began {
                let a = by_commit[next];
                if let Some(&at) = first.get(&a.id).filter(|_| !released_past.contains(&a.id))
                    && latest.is_none_or(|(max, _)| at > max)
                {
                    latest = Some((at, a));
                }
                next += 1;
            }
            if next > 0 {
                ordered += 1;
            }
            if let (Some(&later_at), Some((earlier_at, a))) = (first.get(&b.id), latest)
                && earlier_at > later_at
            {
                violations.push(Violation {
                    key: key.to_string(),
                    earlier: a.id,
                    later: b.id,
                    earlier_at,
                    later_at,
                    margin: b.began.duration_since(a.committed),
                });
            }
        }
    }
    violations.sort_by_key(|v| v.later_at);
    (ordered, violations)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// A message of `key` whose INSERT was issued at `began` ms and COMMIT returned at
    /// `committed` ms after `t0`.
    fn written(t0: Instant, key: &str, began: u64, committed: u64) -> Written {
        Written {
            id: Uuid::now_v7(),
            key: key.into(),
            began: t0 + Duration::from_millis(began),
            committed: t0 + Duration::from_millis(committed),
            poison: false,
        }
    }

    /// Three messages of key `k`, each written (begun and committed) after the one before.
    fn one_after_another() -> [Written; 3] {
        let t0 = Instant::now();
        [
            written(t0, "k", 0, 10),
            written(t0, "k", 20, 30),
            written(t0, "k", 40, 50),
        ]
    }

    fn payloads(messages: &[&Written]) -> Vec<Vec<u8>> {
        let payload = |w: &&Written| format!("{} {} w#1", w.id, w.key).into_bytes();
        messages.iter().map(payload).collect()
    }

    /// The verdict's one violation; panics when there is not exactly one.
    fn the_violation(verdict: &Verdict) -> &Violation {
        let [v] = &verdict.violations[..] else {
            panic!("one violation: {:?}", verdict.violations)
        };
        v
    }

    fn ledger(committed: &[&Written]) -> Ledger {
        Ledger {
            committed: committed.iter().map(|w| (*w).clone()).collect(),
            ..Ledger::default()
        }
    }

    #[test]
    fn sequential_messages_in_order_pass() {
        let [a, b, c] = one_after_another();
        let verdict = check(
            &ledger(&[&a, &b, &c]),
            &payloads(&[&a, &b, &c]),
            &Waived::default(),
        );
        assert!(verdict.violations.is_empty());
        assert_eq!((verdict.ordered, verdict.duplicates), (2, 0));
        assert!(verdict.lost.is_empty());
    }

    #[test]
    fn a_later_message_first_is_a_violation_naming_both() {
        let [a, b, _] = one_after_another();
        let verdict = check(&ledger(&[&a, &b]), &payloads(&[&b, &a]), &Waived::default());
        let v = the_violation(&verdict);
        assert_eq!((v.earlier, v.later, v.key.as_str()), (a.id, b.id, "k"));
        assert_eq!((v.earlier_at, v.later_at), (1, 0));
        assert_eq!(v.margin, Duration::from_millis(10));
    }

    #[test]
    fn overlapping_transactions_and_other_keys_are_not_compared() {
        let t0 = Instant::now();
        // b's INSERT came before a's COMMIT returned: no order between them.
        let (a, b) = (written(t0, "k", 0, 100), written(t0, "k", 50, 60));
        let c = written(t0, "other", 200, 210);
        let verdict = check(
            &ledger(&[&a, &b, &c]),
            &payloads(&[&c, &b, &a]),
            &Waived::default(),
        );
        assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
        assert_eq!(verdict.ordered, 0);
    }

    #[test]
    fn first_arrivals_count_and_duplicates_are_counted() {
        let [a, b, _] = one_after_another();
        // a, b, then a again (a redelivery): first arrivals are in order.
        let verdict = check(
            &ledger(&[&a, &b]),
            &payloads(&[&a, &b, &a]),
            &Waived::default(),
        );
        assert!(verdict.violations.is_empty());
        assert_eq!(verdict.duplicates, 1);
    }

    #[test]
    fn the_latest_predecessor_is_found_whatever_the_commit_order() {
        let t0 = Instant::now();
        // a1 commits late but before c begins; c arrives before a1.
        let a0 = written(t0, "k", 0, 10);
        let a1 = written(t0, "k", 5, 90);
        let c = written(t0, "k", 100, 110);
        let verdict = check(
            &ledger(&[&a0, &a1, &c]),
            &payloads(&[&a0, &c, &a1]),
            &Waived::default(),
        );
        let v = the_violation(&verdict);
        assert_eq!((v.earlier, v.later), (a1.id, c.id));
    }

    #[test]
    fn purged_messages_are_not_lost_and_must_not_arrive() {
        let [a, b, c] = one_after_another();
        let purged = HashSet::from([a.id, c.id]);
        let waived = Waived {
            purged: Some(&purged),
            ..Waived::default()
        };
        // a never arrived (purged: not lost); c arrived although purged.
        let verdict = check(&ledger(&[&a, &b, &c]), &payloads(&[&b, &c]), &waived);
        assert!(verdict.lost.is_empty(), "{:?}", verdict.lost);
        assert_eq!(verdict.purged_delivered, vec![c.id]);
    }

    #[test]
    fn a_dead_letter_released_past_may_arrive_after_later_messages_of_its_key() {
        let [a, b, c] = one_after_another();
        // a was a dead letter when k was released: b and c went on; a was replayed last.
        let arrivals = payloads(&[&b, &c, &a]);
        let released = HashSet::from([a.id]);
        let waived = Waived {
            released_past: Some(&released),
            ..Waived::default()
        };
        let verdict = check(&ledger(&[&a, &b, &c]), &arrivals, &waived);
        assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
        // Without the release the same arrivals are two violations (b and c before a).
        let verdict = check(&ledger(&[&a, &b, &c]), &arrivals, &Waived::default());
        assert_eq!(verdict.violations.len(), 2, "{:?}", verdict.violations);
        // c before b is still a violation after the release.
        let arrivals = payloads(&[&c, &b, &a]);
        let verdict = check(&ledger(&[&a, &b, &c]), &arrivals, &waived);
        let v = the_violation(&verdict);
        assert_eq!((v.earlier, v.later), (b.id, c.id));
    }

    #[test]
    fn lost_rolled_back_and_foreign_messages_are_reported() {
        let [a, b, _] = one_after_another();
        let rolled_back = Uuid::now_v7();
        let mut ledger = ledger(&[&a, &b]);
        ledger.rolled_back.push(rolled_back);
        let mut arrivals = payloads(&[&a]);
        arrivals.push(format!("{rolled_back} k w#9").into_bytes());
        arrivals.push(b"not ours".to_vec());
        let verdict = check(&ledger, &arrivals, &Waived::default());
        assert_eq!(verdict.lost, vec![b.id]);
        assert_eq!(verdict.rolled_back_delivered, vec![rolled_back]);
        assert_eq!(verdict.foreign, 1);
    }
}
