//! Who may use the console, kept in memory: the sessions the login form opens (one per
//! login, with an idle and an absolute expiry) and the throttle that slows down guessing of
//! the token or password (per client address).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A session ends after this long without a request...
pub const SESSION_IDLE: Duration = Duration::from_secs(60 * 60);
/// ...and this long after its login, whatever happens (the cookie's `Max-Age` too).
pub const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 60 * 60);
/// Sessions kept at most; a login beyond it ends the one idle the longest.
const MAX_SESSIONS: usize = 1000;

/// Wrong credentials one address may give before it has to wait...
pub const FREE_FAILURES: u32 = 20;
/// ...first this long, doubling with each further failure...
const FIRST_WAIT: Duration = Duration::from_secs(1);
/// ...up to this.
const LONGEST_WAIT: Duration = Duration::from_secs(60);
/// An address's failures are forgotten after this long without one.
const FORGET_AFTER: Duration = Duration::from_secs(15 * 60);
/// Addresses tracked at most; beyond it the ones quiet the longest are forgotten.
const MAX_ADDRESSES: usize = 10_000;

/// What a session was opened with, for the log of actions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Login {
    /// The console token.
    Token,
    /// `console_user` and its password.
    User(Arc<str>),
}

/// Locks a map of this module. A panic while one was held leaves it whole (every change is
/// one insert, update or remove), so a poisoned lock is still usable.
fn unpoisoned<T>(map: &Mutex<T>) -> MutexGuard<'_, T> {
    map.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Session {
    login: Login,
    opened: Instant,
    seen: Instant,
}

/// The open sessions, by the random value of their cookie.
#[derive(Clone, Default)]
pub struct Sessions(Arc<Mutex<HashMap<String, Session>>>);

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Session>> {
        unpoisoned(&self.0)
    }

    /// Opens a session under `id` (a fresh random value).
    pub fn open(&self, id: String, login: Login, now: Instant) {
        let mut sessions = self.lock();
        sessions.retain(|_, s| s.live(now));
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.seen)
                .map(|(id, _)| id.clone())
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            id,
            Session {
                login,
                opened: now,
                seen: now,
            },
        );
    }

    /// The login of the live session `id`, which this request keeps alive; `None` when
    /// there is none (never opened, logged out, expired, or opened by an earlier process).
    pub fn find(&self, id: &str, now: Instant) -> Option<Login> {
        let mut sessions = self.lock();
        let session = sessions.get_mut(id)?;
        if !session.live(now) {
            sessions.remove(id);
            return None;
        }
        session.seen = now;
        Some(session.login.clone())
    }

    /// Ends session `id`; whether it was open.
    pub fn close(&self, id: &str) -> bool {
        self.lock().remove(id).is_some()
    }
}

impl Session {
    fn live(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.seen) < SESSION_IDLE
            && now.saturating_duration_since(self.opened) < SESSION_LIFETIME
    }
}

struct Failures {
    count: u32,
    last: Instant,
    /// No credentials from this address are checked before then.
    locked_until: Option<Instant>,
}

/// Wrong credentials per client address. After [`FREE_FAILURES`], an address must wait
/// before its next try (1 s, doubling to 60 s); while it waits, its credentials are not
/// checked at all, right ones included, so guessing gains nothing from going on.
#[derive(Clone, Default)]
pub struct Throttle(Arc<Mutex<HashMap<IpAddr, Failures>>>);

impl Throttle {
    fn lock(&self) -> MutexGuard<'_, HashMap<IpAddr, Failures>> {
        unpoisoned(&self.0)
    }

    /// `Err(wait)` while `ip` must wait before its credentials are checked again.
    pub fn check(&self, ip: IpAddr, now: Instant) -> Result<(), Duration> {
        match self.lock().get(&ip).and_then(|f| f.locked_until) {
            Some(until) if until > now => Err(until - now),
            _ => Ok(()),
        }
    }

    /// `ip` gave wrong credentials.
    pub fn failed(&self, ip: IpAddr, now: Instant) {
        let mut all = self.lock();
        if all.len() >= MAX_ADDRESSES && !all.contains_key(&ip) {
            all.retain(|_, f| now.saturating_duration_since(f.last) < FORGET_AFTER);
            if all.len() >= MAX_ADDRESSES
                && let Some(quietest) = all.iter().min_by_key(|(_, f)| f.last).map(|(ip, _)| *ip)
            {
                all.remove(&quietest);
            }
        }
        let failures = all.entry(ip).or_insert(Failures {
            count: 0,
            last: now,
            locked_until: None,
        });
        if now.saturating_duration_since(failures.last) >= FORGET_AFTER {
            failures.count = 0;
        }
        failures.count = failures.count.saturating_add(1);
        failures.last = now;
        if let Some(over) = failures.count.checked_sub(FREE_FAILURES)
            && over > 0
        {
            let wait = FIRST_WAIT
                .saturating_mul(1u32 << (over - 1).min(16))
                .min(LONGEST_WAIT);
            failures.locked_until = Some(now + wait);
        }
    }

    /// `ip` gave the right credentials: its failures are forgotten.
    pub fn succeeded(&self, ip: IpAddr) {
        self.lock().remove(&ip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_expire_when_idle_and_at_their_lifetime() {
        let sessions = Sessions::default();
        let t0 = Instant::now();
        sessions.open("a".into(), Login::Token, t0);
        sessions.open("b".into(), Login::User("ops".into()), t0);
        assert_eq!(sessions.find("a", t0), Some(Login::Token));
        assert_eq!(sessions.find("c", t0), None, "never opened");
        // Kept alive by use, b until its lifetime ends; a left idle ends first.
        let mut now = t0;
        while now + SESSION_IDLE / 2 < t0 + SESSION_LIFETIME {
            now += SESSION_IDLE / 2;
            assert_eq!(sessions.find("b", now), Some(Login::User("ops".into())));
        }
        assert_eq!(sessions.find("a", now), None, "idle too long");
        assert_eq!(sessions.find("b", t0 + SESSION_LIFETIME), None, "too old");
        sessions.open("d".into(), Login::Token, now);
        assert!(sessions.close("d"));
        assert_eq!(sessions.find("d", now), None, "logged out");
    }

    #[test]
    fn a_guesser_waits_longer_and_longer_and_a_right_login_forgets() {
        let throttle = Throttle::default();
        let (ip, other): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        let mut now = Instant::now();
        for _ in 0..FREE_FAILURES {
            assert_eq!(throttle.check(ip, now), Ok(()));
            throttle.failed(ip, now);
        }
        assert_eq!(
            throttle.check(ip, now),
            Ok(()),
            "the free failures cost nothing"
        );
        let mut waits = Vec::new();
        for _ in 0..8 {
            throttle.failed(ip, now);
            let wait = throttle.check(ip, now).expect_err("locked");
            assert_eq!(throttle.check(other, now), Ok(()), "other addresses go on");
            waits.push(wait.as_secs());
            now += wait;
            assert_eq!(throttle.check(ip, now), Ok(()));
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60]);
        throttle.succeeded(ip);
        throttle.failed(ip, now);
        assert_eq!(
            throttle.check(ip, now),
            Ok(()),
            "forgotten after a right login"
        );
        for _ in 0..FREE_FAILURES {
            throttle.failed(ip, now);
        }
        now += FORGET_AFTER;
        throttle.failed(ip, now);
        assert_eq!(
            throttle.check(ip, now),
            Ok(()),
            "forgotten after a quiet time"
        );
    }
}
