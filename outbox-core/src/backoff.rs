//! Exponential backoff with jitter, used for message retries and for waits while a
//! sink or storage is down.

use std::time::Duration;

/// Exponential backoff: `initial`, multiplied by `multiplier` after each failure, capped at
/// `max`, with up to `jitter` (a fraction, 0 to 1) taken off at random so that many relays
/// do not retry in step.
///
/// In configuration files it is a table whose keys all have defaults:
/// `backoff = { initial = "1s", max = "60s", multiplier = 2.0, jitter = 0.2 }`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Backoff {
    /// Delay after the first failure.
    #[serde(with = "humantime_serde")]
    pub initial: Duration,
    /// Growth factor per failure (at least 1).
    pub multiplier: f64,
    /// Upper bound of any delay.
    #[serde(with = "humantime_serde")]
    pub max: Duration,
    /// Fraction of the delay that is randomised away (0 = none, 1 = full jitter).
    pub jitter: f64,
}

impl Default for Backoff {
    /// From 1 s, doubling, capped at 60 s, with 20 % jitter.
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(1),
            multiplier: 2.0,
            max: Duration::from_secs(60),
            jitter: 0.2,
        }
    }
}

impl Backoff {
    /// The delay after `failures` consecutive failures (1 for the first), before jitter.
    pub fn base_delay(&self, failures: u32) -> Duration {
        let exponent = failures.saturating_sub(1).min(64) as i32;
        let secs = self.initial.as_secs_f64() * self.multiplier.max(1.0).powi(exponent);
        Duration::from_secs_f64(secs.min(self.max.as_secs_f64()))
    }

    /// The delay after `failures` consecutive failures, with jitter applied.
    pub fn delay(&self, failures: u32) -> Duration {
        let base = self.base_delay(failures);
        let jitter = self.jitter.clamp(0.0, 1.0);
        base.mul_f64(1.0 - jitter * fastrand::f64())
    }

    /// Checks that the settings make sense; the error is keyed by the bad field (`initial`,
    /// `max`, …), so the owner places it with [`Error::in_section`](crate::Error::in_section).
    pub fn validate(&self) -> crate::Result<()> {
        use crate::Error;
        if self.initial.is_zero() {
            return Err(Error::setting("initial", "must be greater than zero"));
        }
        if !(self.multiplier >= 1.0 && self.multiplier.is_finite()) {
            return Err(Error::setting(
                "multiplier",
                format!(
                    "is {}, it must be a finite number of at least 1",
                    self.multiplier
                ),
            ));
        }
        if self.max < self.initial {
            return Err(Error::setting("max", "must be at least initial"));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(Error::setting(
                "jitter",
                format!("is {}, it must be between 0 and 1", self.jitter),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_one_second_and_caps_at_sixty() {
        let b = Backoff::default();
        let secs: Vec<u64> = (1..=9).map(|n| b.base_delay(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(b.base_delay(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn jitter_stays_within_its_fraction() {
        let b = Backoff::default();
        let mut seen_below = false;
        for _ in 0..1000 {
            let d = b.delay(3);
            assert!(
                d <= Duration::from_secs(4) && d >= Duration::from_secs_f64(3.2),
                "{d:?}"
            );
            seen_below |= d < Duration::from_secs(4);
        }
        assert!(seen_below, "jitter never applied");
        let none = Backoff { jitter: 0.0, ..b };
        assert_eq!(none.delay(3), Duration::from_secs(4));
    }

    #[test]
    fn validate_names_the_bad_field() {
        let bad = Backoff {
            multiplier: 0.5,
            ..Backoff::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .in_section("backoff")
                .to_string()
                .contains("backoff.multiplier is 0.5")
        );
        assert!(Backoff::default().validate().is_ok());
    }

    #[test]
    fn deserialises_with_defaults_for_missing_keys() {
        let b: Backoff = crate::config::from_value(serde_json::json!({ "max": "30s" })).unwrap();
        assert_eq!(
            b,
            Backoff {
                max: Duration::from_secs(30),
                ..Backoff::default()
            }
        );
        let error = crate::config::from_value::<Backoff>(serde_json::json!({ "maximum": "1s" }))
            .unwrap_err();
        assert!(
            error.to_string().contains("unknown field `maximum`"),
            "{error}"
        );
    }
}
