//! Exponential backoff: the one retry delay used by the ownership watchdog, the snapshot actor
//! and the operator.

use std::time::Duration;

/// `initial` after the first failure, doubling, capped at `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Longest delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// A backoff from `initial` doubling up to `max`.
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Backoff { initial, max }
    }

    /// The delay after the `failed`-th consecutive failure (1-based; 0 counts as 1).
    pub fn delay(&self, failed: u32) -> Duration {
        let doublings = failed.saturating_sub(1).min(31);
        self.initial
            .checked_mul(1u32 << doublings)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(8));
        let delays: Vec<u64> = (1..=6).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 8, 8]);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(8));
        assert_eq!(b.delay(0), Duration::from_secs(1));
    }

    #[test]
    fn a_huge_initial_delay_is_capped_not_overflowed() {
        let b = Backoff::new(Duration::MAX, Duration::from_secs(5));
        assert_eq!(b.delay(3), Duration::from_secs(5));
    }
}
