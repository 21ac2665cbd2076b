//! The ownership watchdog: looks the owner record up every `interval`, polls etcd's health, feeds
//! both into the [`Machine`] and executes its actions through the I/O seams below.
//!
//! Actions run one at a time, in the order the machine gives them, and their results go back into
//! the machine before anything else is looked at; so a kill or a final snapshot blocks the next
//! owner check until it finishes (the machine ignores verdicts in Deactivated anyway, and a
//! Suspended sidecar only resumes after its kill is done).
//!
//! Wiring: the regular snapshotter must start *off* when ownership checks are configured (the
//! watchdog turns it on in Active), and `/healthz` must start at 503.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::machine::{Action, Backoff, Event, FinalOutcome, FinalStep, Machine, State};
use super::metrics::OwnerMetrics;
use super::resolve::{CheckResult, FailureCounter, OwnerLookup};
use crate::config::OwnerConfig;
use crate::process::ProcessControl;

/// An error from a seam, as text: the watchdog only logs it and retries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SeamError(pub String);

/// The snapshot side as the watchdog needs it (implemented over the one snapshot actor).
#[async_trait::async_trait]
pub trait Snapshotter: Send + Sync {
    /// Turns the regular (scheduled full and delta) snapshots on or off.
    async fn set_regular(&self, on: bool) -> Result<(), SeamError>;
    /// Whether the latest full snapshot in the store is marked final.
    async fn latest_is_final(&self) -> Result<bool, SeamError>;
    /// Takes one full snapshot marked final and stores it; returns its name.
    async fn request_final(&self) -> Result<String, SeamError>;
}

/// Whether etcd answers (e.g. a status request with a short timeout).
#[async_trait::async_trait]
pub trait EtcdHealth: Send + Sync {
    /// True when etcd answered healthy.
    async fn healthy(&self) -> bool;
}

/// Where readiness goes (what `/healthz` answers).
pub trait ReadinessSink: Send + Sync {
    /// Sets readiness, with the ownership state and a reason for whoever reads the probe body.
    fn set_ready(&self, ready: bool, state: &str, reason: &str);
}

/// The watchdog's timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// Time between owner lookups.
    pub interval: Duration,
    /// Consecutive failed lookups before the verdict is "unresolvable".
    pub failure_threshold: u32,
    /// Time between etcd health checks.
    pub health_interval: Duration,
    /// Retry delays for the final snapshot.
    pub backoff: Backoff,
}

impl WatchdogConfig {
    /// The timing from the `[owner]` section, with a 2 s health poll and the default backoff.
    pub fn from_owner(config: &OwnerConfig) -> Self {
        WatchdogConfig {
            interval: config.interval,
            failure_threshold: config.failure_threshold,
            health_interval: Duration::from_secs(2),
            backoff: Backoff::default(),
        }
    }
}

/// What the watchdog knows, for `/status` and logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchdogStatus {
    /// `starting`, `active`, `suspended` or `deactivated`.
    pub state: String,
    /// The state with its final-snapshot step, e.g. `deactivated (AwaitingEtcd)`.
    pub detail: String,
    /// Whether `/healthz` answers 200.
    pub ready: bool,
    /// When the last lookup finished.
    pub last_check_at: Option<DateTime<Utc>>,
    /// What the last lookup found.
    pub last_check: Option<String>,
    /// When a lookup last gave an answer (owner or not).
    pub last_success_at: Option<DateTime<Utc>>,
    /// Failed lookups in a row.
    pub consecutive_failures: u32,
    /// The final snapshot this process stored, or `found in store`.
    pub final_snapshot: Option<String>,
}

impl WatchdogStatus {
    fn new() -> Self {
        WatchdogStatus {
            state: State::Starting.name().into(),
            detail: State::Starting.to_string(),
            ready: false,
            last_check_at: None,
            last_check: None,
            last_success_at: None,
            consecutive_failures: 0,
            final_snapshot: None,
        }
    }
}

/// The seams the watchdog acts through.
#[derive(Clone)]
pub struct Seams {
    /// Owner record lookups.
    pub lookup: Arc<dyn OwnerLookup>,
    /// Stopping etcd.
    pub process: Arc<dyn ProcessControl>,
    /// The snapshot actor.
    pub snapshotter: Arc<dyn Snapshotter>,
    /// etcd health.
    pub health: Arc<dyn EtcdHealth>,
    /// `/healthz`.
    pub readiness: Arc<dyn ReadinessSink>,
}

/// The ownership watchdog; [`Watchdog::run`] drives it until cancelled.
pub struct Watchdog {
    config: WatchdogConfig,
    seams: Seams,
    metrics: OwnerMetrics,
    machine: Machine,
    failures: FailureCounter,
    status: watch::Sender<WatchdogStatus>,
    retry_at: Option<Instant>,
}

impl Watchdog {
    /// A watchdog in Starting.
    pub fn new(config: WatchdogConfig, seams: Seams, metrics: OwnerMetrics) -> Self {
        let (status, _) = watch::channel(WatchdogStatus::new());
        Watchdog {
            machine: Machine::new(config.backoff),
            failures: FailureCounter::new(config.failure_threshold),
            config,
            seams,
            metrics,
            status,
            retry_at: None,
        }
    }

    /// Follows the watchdog's status.
    pub fn status(&self) -> watch::Receiver<WatchdogStatus> {
        self.status.subscribe()
    }

    /// Checks and acts until `cancel` fires; returns the last state.
    pub async fn run(mut self, cancel: CancellationToken) -> State {
        self.seams
            .readiness
            .set_ready(false, State::Starting.name(), "no owner verdict yet");
        let mut checks = tokio::time::interval(self.config.interval);
        checks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut health = tokio::time::interval(self.config.health_interval);
        health.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let retry_at = self.retry_at;
            let event = tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                _ = async { tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)).await },
                    if retry_at.is_some() => {
                    self.retry_at = None;
                    Some(Event::RetryDue)
                }
                _ = checks.tick() => self.check().await.map(Event::Verdict),
                _ = health.tick() => Some(Event::EtcdHealth(self.seams.health.healthy().await)),
            };
            if let Some(event) = event {
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => break,
                    _ = self.feed(event) => {}
                }
            }
        }
        self.machine.state()
    }

    /// One lookup: metrics, status, and the verdict it yields (if any).
    async fn check(&mut self) -> Option<super::machine::Verdict> {
        let result = self.seams.lookup.check().await;
        let verdict = self.failures.observe(&result);
        let failures = self.failures.consecutive();
        self.metrics.record_check(&result, failures);
        let now = Utc::now();
        match &result {
            CheckResult::Failed(_) => {
                tracing::warn!(result = %result, consecutive_failures = failures, "owner check failed")
            }
            _ => tracing::debug!(result = %result, "owner check"),
        }
        self.status.send_modify(|s| {
            s.last_check_at = Some(now);
            s.last_check = Some(result.to_string());
            s.consecutive_failures = failures;
            if result.verdict().is_some() {
                s.last_success_at = Some(now);
            }
        });
        verdict
    }

    /// Steps the machine with `event` and every event its actions produce.
    async fn feed(&mut self, event: Event) {
        let mut pending = std::collections::VecDeque::from([event]);
        while let Some(event) = pending.pop_front() {
            let before = self.machine.state();
            let (machine, actions) = self.machine.step(event);
            self.machine = machine;
            let after = machine.state();
            if before != after {
                tracing::info!(from = %before, to = %after, event = ?event, "ownership state changed");
                self.metrics.set_state(&after);
            }
            for action in actions {
                if let Some(next) = self.execute(action).await {
                    pending.push_back(next);
                }
            }
            let final_in_store = self.machine.final_in_store();
            self.metrics.set_final_snapshot_taken(final_in_store);
            self.status.send_modify(|s| {
                s.state = after.name().into();
                s.detail = after.to_string();
                s.ready = machine.ready();
                if let State::Deactivated(FinalStep::Done(FinalOutcome::FoundInStore)) = after {
                    s.final_snapshot
                        .get_or_insert_with(|| "found in store".into());
                }
            });
        }
    }

    /// Runs one action; returns the event that reports its result, if it has one.
    async fn execute(&mut self, action: Action) -> Option<Event> {
        let state = self.machine.state();
        match action {
            Action::SetReady(ready) => {
                let reason = match (ready, state) {
                    (true, _) => "owner, etcd healthy",
                    (false, State::Active) => "owner, etcd not healthy",
                    (false, State::Suspended) => "owner record unresolvable",
                    (false, State::Deactivated(_)) => "not the owner",
                    (false, State::Starting) => "no owner verdict yet",
                };
                self.seams.readiness.set_ready(ready, state.name(), reason);
                None
            }
            Action::StartSnapshotter | Action::StopSnapshotter => {
                let on = action == Action::StartSnapshotter;
                if let Err(error) = self.seams.snapshotter.set_regular(on).await {
                    tracing::error!(%error, on, "cannot switch the regular snapshotter");
                }
                None
            }
            Action::KillEtcd => {
                match self.seams.process.kill_etcd().await {
                    Ok(report) => {
                        self.metrics.record_kill(&report);
                        if report.not_found() {
                            tracing::warn!(
                                "no etcd process found to stop; is the PID namespace shared?"
                            );
                        } else {
                            tracing::info!(processes = ?report.processes, "stopped etcd");
                        }
                    }
                    Err(error) => tracing::error!(%error, "cannot stop etcd"),
                }
                Some(Event::KillDone)
            }
            Action::CheckStoreForFinal => match self.seams.snapshotter.latest_is_final().await {
                Ok(latest_is_final) => {
                    if latest_is_final {
                        tracing::info!(
                            "the store's latest full snapshot is already final; not taking another"
                        );
                    }
                    Some(Event::StoreChecked { latest_is_final })
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot check the store for a final snapshot");
                    Some(Event::StoreCheckFailed)
                }
            },
            Action::TakeFinalSnapshot { attempt } => {
                tracing::info!(attempt, "taking the final full snapshot");
                match self.seams.snapshotter.request_final().await {
                    Ok(name) => {
                        tracing::info!(snapshot = %name, attempt, "final snapshot stored");
                        self.status.send_modify(|s| s.final_snapshot = Some(name));
                        Some(Event::FinalStored)
                    }
                    Err(error) => {
                        tracing::warn!(%error, attempt, "final snapshot failed; will retry");
                        Some(Event::FinalFailed)
                    }
                }
            }
            Action::ScheduleRetry { delay } => {
                self.retry_at = Some(Instant::now() + delay);
                None
            }
        }
    }
}
