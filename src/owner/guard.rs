//! Ownership for controllers (seed 001, "Extension Controller Watchdogs"): a task looks the owner
//! record up every `interval` and hands out a [`CancellationToken`] per stretch of ownership,
//! cancelled the moment that stretch ends. A controller runs each reconcile under the token it
//! got, so a reconcile started while we were owner is cut off at its next await once the record
//! names someone else, and the next one waits until the record names us again.
//!
//! Fail closed: the guard starts not owning (nothing acts before a lookup has said "owner"); a
//! record that names someone else or authoritatively does not exist ends ownership at once;
//! failed lookups end it after `failure_threshold` in a row (the sidecar's rule, so a controller
//! and the etcd it drives stop together); a lookup that hangs past twice its timeout counts as
//! failed; and when the guard's task ends for any reason (shutdown, panic) the current token is
//! cancelled and no new one is handed out.
//!
//! Unlike the sidecar's Deactivated state, losing ownership is not sticky here: a controller has
//! no final snapshot to take, so it acts again once the record names it again.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::resolve::Verdict;
use super::resolve::{CheckResult, Failure, FailureCounter, OwnerLookup};

/// Where the guard stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// No lookup has decided yet (start, or failures below the threshold since start).
    Unknown,
    /// The record names us.
    Owner,
    /// The record names someone else, or there is none.
    NotOwner,
    /// `failure_threshold` lookups in a row failed.
    Unresolvable,
    /// The guard's task ended: nothing may act any more.
    Stopped,
}

impl Standing {
    /// Whether a controller may act.
    pub fn owns(self) -> bool {
        self == Standing::Owner
    }
}

/// One step of the guard, pure: the standing after `result`, given the standing before and the
/// failure counter (which it updates). Failures below the threshold keep the standing.
pub fn next(before: Standing, counter: &mut FailureCounter, result: &CheckResult) -> Standing {
    if before == Standing::Stopped {
        return Standing::Stopped;
    }
    match counter.observe(result) {
        Some(Verdict::Owner) => Standing::Owner,
        Some(Verdict::NotOwner) => Standing::NotOwner,
        Some(Verdict::Unresolvable) => Standing::Unresolvable,
        None => before,
    }
}

#[derive(Debug, Clone)]
struct Epoch {
    standing: Standing,
    /// Cancelled when this stretch of ownership ends; already cancelled unless `Owner`.
    token: CancellationToken,
}

impl Epoch {
    fn new(standing: Standing) -> Epoch {
        let token = CancellationToken::new();
        if !standing.owns() {
            token.cancel();
        }
        Epoch { standing, token }
    }
}

/// What a controller needs to start a guard: the lookup (the sidecar's resolver) and its timing.
#[derive(Debug, Clone)]
pub struct GuardSettings {
    /// Looks the owner record up.
    pub lookup: Arc<super::resolve::OwnerResolver>,
    /// How often and how patiently.
    pub timing: GuardTiming,
}

impl GuardSettings {
    /// From an `[owner]` section, as the sidecar reads it.
    pub fn new(config: &crate::config::OwnerConfig) -> Result<Self, super::resolve::ResolveError> {
        Ok(GuardSettings {
            lookup: Arc::new(super::resolve::OwnerResolver::new(config)?),
            timing: GuardTiming {
                interval: config.interval,
                timeout: config.timeout,
                failure_threshold: config.failure_threshold,
            },
        })
    }
}

/// A handle on the guard: cheap to clone, one per controller.
#[derive(Debug, Clone)]
pub struct OwnerGuard {
    rx: watch::Receiver<Epoch>,
}

/// How often and how patiently the guard looks.
#[derive(Debug, Clone, Copy)]
pub struct GuardTiming {
    /// Time between lookups.
    pub interval: Duration,
    /// The lookup's own timeout; a lookup still running after twice this counts as failed.
    pub timeout: Duration,
    /// Consecutive failed lookups before ownership ends.
    pub failure_threshold: u32,
}

impl OwnerGuard {
    /// Starts looking the record up with `lookup` until `cancel`; the task's handle is returned
    /// so a caller can watch it (when it ends, the guard reads `Stopped`).
    pub fn start(
        lookup: Arc<dyn OwnerLookup>,
        timing: GuardTiming,
        cancel: CancellationToken,
    ) -> (OwnerGuard, JoinHandle<()>) {
        let (tx, rx) = watch::channel(Epoch::new(Standing::Unknown));
        let task = tokio::spawn(run(lookup, timing, tx, cancel));
        (OwnerGuard { rx }, task)
    }

    /// The standing now.
    pub fn standing(&self) -> Standing {
        if self.rx.has_changed().is_err() {
            return Standing::Stopped;
        }
        self.rx.borrow().standing
    }

    /// A token for the current stretch of ownership: cancelled when it ends, and already
    /// cancelled when we do not own now.
    pub fn token(&self) -> CancellationToken {
        if self.rx.has_changed().is_err() {
            return Epoch::new(Standing::Stopped).token;
        }
        self.rx.borrow().token.clone()
    }

    /// Waits until the standing changes; `false` once the guard has stopped.
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }

    /// Waits until we own, then returns the token of that stretch; `None` once the guard has
    /// stopped (nothing may act any more).
    pub async fn owned(&mut self) -> Option<CancellationToken> {
        let epoch = self.rx.wait_for(|e| e.standing.owns()).await.ok()?;
        Some(epoch.token.clone())
    }
}

async fn run(
    lookup: Arc<dyn OwnerLookup>,
    timing: GuardTiming,
    tx: watch::Sender<Epoch>,
    cancel: CancellationToken,
) {
    // However the task ends (shutdown, panic), the stretch in progress is over.
    struct EndEpoch<'a>(&'a watch::Sender<Epoch>);
    impl Drop for EndEpoch<'_> {
        fn drop(&mut self) {
            self.0.send_modify(|e| {
                e.token.cancel();
                e.standing = Standing::Stopped;
            });
        }
    }
    let _end = EndEpoch(&tx);

    let mut counter = FailureCounter::new(timing.failure_threshold);
    let mut ticks = tokio::time::interval(timing.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let limit = timing
        .timeout
        .saturating_mul(2)
        .max(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(limit, lookup.check()) => {
                r.unwrap_or(CheckResult::Failed(Failure::Timeout))
            }
        };
        let before = tx.borrow().standing;
        let after = next(before, &mut counter, &result);
        if after == before {
            continue;
        }
        match after {
            Standing::Owner => info!(%result, "owner record names us: acting"),
            _ => warn!(%result, standing = ?after, "ownership lost: cancelling work, not acting"),
        }
        tx.send_modify(|e| {
            e.token.cancel();
            *e = Epoch::new(after);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    const ALL: [Standing; 5] = [
        Standing::Unknown,
        Standing::Owner,
        Standing::NotOwner,
        Standing::Unresolvable,
        Standing::Stopped,
    ];

    fn results() -> Vec<CheckResult> {
        vec![
            CheckResult::Owner,
            CheckResult::OtherOwner(vec!["other".into()]),
            CheckResult::NoRecord,
            CheckResult::Failed(Failure::Timeout),
            CheckResult::Failed(Failure::Ambiguous(vec!["us".into(), "other".into()])),
        ]
    }

    /// Every standing, every result, every failure count up to past a threshold of 3.
    #[test]
    fn next_is_exhaustively_fail_closed() {
        for before in ALL {
            for result in results() {
                for prior_failures in 0..4u32 {
                    let mut counter = FailureCounter::new(3);
                    for _ in 0..prior_failures {
                        counter.observe(&CheckResult::Failed(Failure::Timeout));
                    }
                    let after = next(before, &mut counter, &result);
                    let expected = match (&before, &result) {
                        (Standing::Stopped, _) => Standing::Stopped,
                        (_, CheckResult::Owner) => Standing::Owner,
                        (_, CheckResult::OtherOwner(_) | CheckResult::NoRecord) => {
                            Standing::NotOwner
                        }
                        (_, CheckResult::Failed(_)) if prior_failures + 1 >= 3 => {
                            Standing::Unresolvable
                        }
                        (b, CheckResult::Failed(_)) => *b,
                    };
                    assert_eq!(
                        after, expected,
                        "{before:?} + {result:?} after {prior_failures}"
                    );
                    // Only a lookup naming us ever grants ownership.
                    if after.owns() {
                        assert!(before.owns() || result == CheckResult::Owner);
                    }
                }
            }
        }
    }

    struct Scripted(Mutex<Vec<CheckResult>>);

    #[async_trait::async_trait]
    impl OwnerLookup for Scripted {
        async fn check(&self) -> CheckResult {
            let mut v = self.0.lock().unwrap();
            if v.len() > 1 {
                v.remove(0)
            } else {
                v[0].clone()
            }
        }
    }

    struct Hangs;

    #[async_trait::async_trait]
    impl OwnerLookup for Hangs {
        async fn check(&self) -> CheckResult {
            std::future::pending().await
        }
    }

    fn timing(failure_threshold: u32) -> GuardTiming {
        GuardTiming {
            interval: Duration::from_millis(10),
            timeout: Duration::from_millis(50),
            failure_threshold,
        }
    }

    #[tokio::test]
    async fn a_stretch_of_ownership_is_cancelled_when_the_record_names_someone_else() {
        let lookup = Arc::new(Scripted(Mutex::new(vec![
            CheckResult::Owner,
            CheckResult::Owner,
            CheckResult::Owner,
            CheckResult::OtherOwner(vec!["b".into()]),
            CheckResult::OtherOwner(vec!["b".into()]),
            CheckResult::Owner,
        ])));
        let cancel = CancellationToken::new();
        let (mut guard, task) = OwnerGuard::start(lookup, timing(3), cancel.clone());
        assert!(
            guard.token().is_cancelled(),
            "nothing acts before the first lookup"
        );
        let first = guard.owned().await.expect("owner");
        // The work running under it is cut off when the record moves.
        tokio::time::timeout(Duration::from_secs(2), first.cancelled())
            .await
            .expect("the stretch ends");
        // And a new stretch starts when it names us again, with a fresh token.
        let second = guard.owned().await.expect("owner again");
        assert!(!second.is_cancelled());
        cancel.cancel();
        task.await.unwrap();
        assert!(second.is_cancelled(), "a stopped guard ends the stretch");
        assert_eq!(guard.standing(), Standing::Stopped);
        assert!(guard.owned().await.is_none());
    }

    #[tokio::test]
    async fn failures_end_ownership_only_at_the_threshold_and_a_hang_counts() {
        let lookup = Arc::new(Scripted(Mutex::new(vec![
            CheckResult::Owner,
            CheckResult::Failed(Failure::Timeout),
            CheckResult::Owner,
            CheckResult::Failed(Failure::Timeout),
            CheckResult::Failed(Failure::Timeout),
        ])));
        let (mut guard, task) = OwnerGuard::start(lookup, timing(2), CancellationToken::new());
        let token = guard.owned().await.unwrap();
        tokio::time::timeout(Duration::from_secs(2), token.cancelled())
            .await
            .unwrap();
        assert_eq!(guard.standing(), Standing::Unresolvable);
        task.abort();

        // A lookup that never answers is a failure, not a stretch kept alive forever.
        let (guard, task) = OwnerGuard::start(Arc::new(Hangs), timing(1), CancellationToken::new());
        let mut rx = guard.rx.clone();
        tokio::time::timeout(
            Duration::from_secs(2),
            rx.wait_for(|e| e.standing == Standing::Unresolvable),
        )
        .await
        .unwrap()
        .unwrap();
        // A task that dies (aborted here; a panic is the same) stops the guard.
        task.abort();
        let _ = task.await;
        assert_eq!(guard.standing(), Standing::Stopped);
        assert!(guard.token().is_cancelled());
    }
}
