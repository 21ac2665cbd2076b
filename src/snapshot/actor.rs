//! The one snapshot actor: scheduled full snapshots, periodic deltas, retention, on-demand and
//! final requests all go through one task, so two snapshots never run at once.
//!
//! Regular work (schedule, deltas, retention) runs only while the owner allows it
//! ([`ActorHandle::set_regular`]) and this sidecar's member leads the raft group; requests are
//! served whenever they come.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::store::layout::{Kind, Snapshot};

/// An engine failure, described for logs and callers.
pub type EngineError = Box<dyn std::error::Error + Send + Sync>;

/// The work the actor schedules: etcd and the store in production, a fake in tests.
#[async_trait]
pub trait Engine: Send + 'static {
    /// Takes a full snapshot (named final when asked) and returns it once stored; later deltas
    /// start after its revision.
    async fn full(&mut self, is_final: bool) -> Result<Snapshot, EngineError>;
    /// Waits for watch events and buffers them. Cancel-safe: the actor drops this future
    /// whenever something else is due.
    async fn collect(&mut self) -> Result<Collected, EngineError>;
    /// Bytes of events buffered for the next delta.
    fn buffered_bytes(&self) -> u64;
    /// Writes the buffered events as a delta snapshot; `None` when there were none.
    async fn flush_delta(&mut self) -> Result<Option<Snapshot>, EngineError>;
    /// Drops buffered events and restarts the watch after the latest stored snapshot (after a
    /// pause, or when this sidecar becomes the snapshot leader), so the revision stream has no gap.
    async fn resume(&mut self) -> Result<(), EngineError>;
    /// Stops watching (regular work paused).
    fn pause(&mut self);
    /// Whether this sidecar's member is the raft leader.
    async fn is_leader(&mut self) -> Result<bool, EngineError>;
    /// The newest full snapshot in the store.
    async fn latest_full(&mut self) -> Result<Option<Snapshot>, EngineError>;
    /// Applies retention at `now`; returns the deleted snapshots.
    async fn gc(&mut self, now: DateTime<Utc>) -> Result<Vec<Snapshot>, EngineError>;
}

/// What one [`Engine::collect`] call found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collected {
    /// Events were buffered (or none arrived yet).
    Events,
    /// etcd compacted past the delta stream: only a full snapshot can continue it.
    Compacted,
}

/// Why a request to the actor failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorError {
    /// The actor has shut down.
    #[error("the snapshot actor has stopped")]
    Stopped,
    /// The snapshot failed; the message says why.
    #[error("{0}")]
    Failed(String),
}

/// When and how the actor works.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    pub schedule: croner::Cron,
    /// Zero disables deltas.
    pub delta_period: Duration,
    pub delta_memory_limit: u64,
    pub gc_period: Duration,
    pub leader_check_interval: Duration,
    /// Regular work on from the start (no owner check configured).
    pub regular_at_start: bool,
}

/// What the actor is doing, for `/status`.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ActorStatus {
    /// Regular snapshots allowed by the owner.
    pub regular: bool,
    /// This sidecar's member leads the raft group.
    pub leader: bool,
    pub last_full: Option<Snapshot>,
    pub last_delta: Option<Snapshot>,
    pub next_full_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

enum Command {
    Full {
        is_final: bool,
        reply: oneshot::Sender<Result<Snapshot, ActorError>>,
    },
    Delta {
        reply: oneshot::Sender<Result<Option<Snapshot>, ActorError>>,
    },
    Regular {
        on: bool,
        reply: oneshot::Sender<()>,
    },
}

/// The way to talk to the actor; cheap to clone.
#[derive(Clone)]
pub struct ActorHandle {
    tx: mpsc::Sender<Command>,
    status: watch::Receiver<ActorStatus>,
}

impl ActorHandle {
    /// Takes a full snapshot now (after whatever the actor is doing).
    pub async fn full(&self, is_final: bool) -> Result<Snapshot, ActorError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Full { is_final, reply })
            .await
            .map_err(|_| ActorError::Stopped)?;
        rx.await.map_err(|_| ActorError::Stopped)?
    }

    /// Writes the buffered events as a delta now.
    pub async fn delta(&self) -> Result<Option<Snapshot>, ActorError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Delta { reply })
            .await
            .map_err(|_| ActorError::Stopped)?;
        rx.await.map_err(|_| ActorError::Stopped)?
    }

    /// Turns regular work on or off; returns once the actor has done so (so after
    /// `set_regular(false)` no regular snapshot is running or will start).
    pub async fn set_regular(&self, on: bool) -> Result<(), ActorError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Regular { on, reply })
            .await
            .map_err(|_| ActorError::Stopped)?;
        rx.await.map_err(|_| ActorError::Stopped)
    }

    /// The actor's current status.
    pub fn status(&self) -> ActorStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change.
    pub fn watch_status(&self) -> watch::Receiver<ActorStatus> {
        self.status.clone()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    kind: &'static str,
    succeeded: &'static str,
}

/// The actor's metrics, named as etcd-backup-restore names them.
#[derive(Clone)]
pub struct ActorMetrics {
    latest_revision: Family<KindLabel, Gauge>,
    latest_timestamp: Family<KindLabel, Gauge>,
    duration: Family<DurationLabels, Histogram>,
    gc_total: Family<KindLabel, Counter>,
    failures: Family<KindLabel, Counter>,
    required: Family<KindLabel, Gauge>,
    leader: Gauge,
}

impl Default for ActorMetrics {
    fn default() -> Self {
        ActorMetrics {
            latest_revision: Family::default(),
            latest_timestamp: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new([
                    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                ])
            }),
            gc_total: Family::default(),
            failures: Family::default(),
            required: Family::default(),
            leader: Gauge::default(),
        }
    }
}

impl ActorMetrics {
    /// Registers every metric under `registry` (metric names are prefixed `etcdbr_`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("etcdbr");
        r.register(
            "snapshot_latest_revision",
            "Revision of the latest snapshot by kind",
            self.latest_revision.clone(),
        );
        r.register(
            "snapshot_latest_timestamp",
            "Unix time of the latest snapshot by kind",
            self.latest_timestamp.clone(),
        );
        r.register(
            "snapshot_duration_seconds",
            "Time taken by snapshots by kind and outcome",
            self.duration.clone(),
        );
        r.register(
            "snapshot_gc",
            "Snapshots deleted by retention by kind",
            self.gc_total.clone(),
        );
        r.register(
            "snapshotter_failure",
            "Failed snapshots by kind",
            self.failures.clone(),
        );
        r.register(
            "snapshot_required",
            "1 while a snapshot of this kind is due",
            self.required.clone(),
        );
        r.register(
            "snapshot_leader",
            "1 while this sidecar is the one taking snapshots",
            self.leader.clone(),
        );
    }

    fn kind(s: &Snapshot) -> &'static str {
        match s.kind {
            Kind::Full => "Full",
            Kind::Incr => "Incr",
        }
    }

    fn stored(&self, s: &Snapshot) {
        let k = KindLabel {
            kind: Self::kind(s),
        };
        self.latest_revision.get_or_create(&k).set(s.last_revision);
        self.latest_timestamp
            .get_or_create(&k)
            .set(s.created_on.timestamp());
    }

    fn timed(&self, kind: &'static str, ok: bool, took: Duration) {
        let l = DurationLabels {
            kind,
            succeeded: if ok { "true" } else { "false" },
        };
        self.duration.get_or_create(&l).observe(took.as_secs_f64());
        if !ok {
            self.failures.get_or_create(&KindLabel { kind }).inc();
        }
    }
}

/// Starts the actor on the current runtime; it stops when `cancel` fires (flushing a pending
/// delta first) or every handle is dropped.
pub fn spawn<E: Engine>(
    engine: E,
    config: ActorConfig,
    metrics: ActorMetrics,
    cancel: CancellationToken,
) -> (ActorHandle, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(16);
    let status = ActorStatus {
        regular: config.regular_at_start,
        ..Default::default()
    };
    let (status_tx, status_rx) = watch::channel(status);
    let actor = Actor {
        regular: config.regular_at_start,
        engine,
        config,
        metrics,
        status: Arc::new(status_tx),
        leader: false,
        next_full: None,
        watching: false,
    };
    let task = tokio::spawn(actor.run(rx, cancel));
    (
        ActorHandle {
            tx,
            status: status_rx,
        },
        task,
    )
}

struct Actor<E: Engine> {
    engine: E,
    config: ActorConfig,
    metrics: ActorMetrics,
    status: Arc<watch::Sender<ActorStatus>>,
    regular: bool,
    leader: bool,
    /// When the next scheduled full snapshot is due (None until first computed).
    next_full: Option<DateTime<Utc>>,
    /// The engine's watch is running.
    watching: bool,
}

/// Wait before retrying a failed scheduled full snapshot.
const FULL_RETRY: Duration = Duration::from_secs(60);
/// Wait after a watch failure before watching again.
const WATCH_RETRY: Duration = Duration::from_secs(1);

fn until(at: DateTime<Utc>) -> tokio::time::Instant {
    let d = (at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
    tokio::time::Instant::now() + d
}

impl<E: Engine> Actor<E> {
    fn active(&self) -> bool {
        self.regular && self.leader
    }

    fn deltas_on(&self) -> bool {
        !self.config.delta_period.is_zero()
    }

    fn next_occurrence(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.config
            .schedule
            .find_next_occurrence(&after, false)
            .ok()
    }

    fn publish(&self, f: impl FnOnce(&mut ActorStatus)) {
        self.status.send_modify(|s| {
            f(s);
            s.regular = self.regular;
            s.leader = self.leader;
            s.next_full_at = if self.active() { self.next_full } else { None };
        });
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Command>, cancel: CancellationToken) {
        let mut leader_tick = tokio::time::interval(self.config.leader_check_interval);
        let mut delta_tick =
            tokio::time::interval(self.config.delta_period.max(Duration::from_millis(10)));
        let mut gc_tick = tokio::time::interval(self.config.gc_period);
        for t in [&mut leader_tick, &mut delta_tick, &mut gc_tick] {
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        let mut watch_retry_at: Option<tokio::time::Instant> = None;
        loop {
            let active = self.active();
            let full_at = self.next_full.map(until);
            let can_collect = active
                && self.deltas_on()
                && watch_retry_at.is_none_or(|t| t <= tokio::time::Instant::now());
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                cmd = rx.recv() => match cmd {
                    None => break,
                    Some(cmd) => self.handle(cmd).await,
                },
                _ = leader_tick.tick() => self.check_leader().await,
                _ = async { tokio::time::sleep_until(full_at.unwrap_or_else(tokio::time::Instant::now)).await }, if active && full_at.is_some() => {
                    self.scheduled_full().await;
                }
                _ = delta_tick.tick(), if active && self.deltas_on() => { let _ = self.delta().await; }
                r = self.engine.collect(), if can_collect && self.watching => match r {
                    Ok(Collected::Events) => {
                        if self.engine.buffered_bytes() >= self.config.delta_memory_limit {
                            let _ = self.delta().await;
                        }
                    }
                    Ok(Collected::Compacted) => self.next_full = Some(Utc::now()),
                    Err(e) => {
                        tracing::warn!(error = %e, "watching etcd for deltas failed; resuming from the latest snapshot");
                        self.watching = false;
                        watch_retry_at = Some(tokio::time::Instant::now() + WATCH_RETRY);
                        self.publish(|s| s.last_error = Some(format!("watch: {e}")));
                    }
                },
                _ = async { tokio::time::sleep_until(watch_retry_at.unwrap_or_else(tokio::time::Instant::now)).await }, if active && !self.watching && self.deltas_on() => {
                    watch_retry_at = None;
                    self.start_watch().await;
                }
                _ = gc_tick.tick(), if active => self.gc().await,
            }
        }
        // Shutting down: what was buffered is written, so a restart loses nothing.
        if self.active() && self.watching && self.engine.buffered_bytes() > 0 {
            let _ = self.delta().await;
        }
        self.engine.pause();
        tracing::info!("snapshot actor stopped");
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Full { is_final, reply } => {
                let r = self.full(is_final).await;
                let _ = reply.send(r);
            }
            Command::Delta { reply } => {
                let r = if self.watching {
                    self.delta().await
                } else {
                    Err(ActorError::Failed("deltas are not being collected (not the snapshot leader, paused, or disabled)".into()))
                };
                let _ = reply.send(r);
            }
            Command::Regular { on, reply } => {
                if on != self.regular {
                    tracing::info!(
                        regular = on,
                        "regular snapshots {}",
                        if on { "resumed" } else { "stopped" }
                    );
                }
                let was = self.active();
                self.regular = on;
                self.on_activity_change(was).await;
                let _ = reply.send(());
            }
        }
    }

    async fn check_leader(&mut self) {
        let leader = match self.engine.is_leader().await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "leader check failed");
                false
            }
        };
        if leader != self.leader {
            tracing::info!(
                leader,
                "snapshot leadership {}",
                if leader { "taken" } else { "lost" }
            );
            self.metrics.leader.set(i64::from(leader));
        }
        let was = self.active();
        self.leader = leader;
        self.on_activity_change(was).await;
    }

    /// Starts or stops regular work when `active()` changed from `was`.
    async fn on_activity_change(&mut self, was: bool) {
        let now = self.active();
        if now && !was {
            self.start_watch().await;
            self.next_full = self.first_full_due().await;
        } else if !now && was {
            self.engine.pause();
            self.watching = false;
            self.next_full = None;
        }
        self.publish(|_| {});
    }

    async fn start_watch(&mut self) {
        if !self.deltas_on() {
            return;
        }
        match self.engine.resume().await {
            Ok(()) => self.watching = true,
            Err(e) => {
                tracing::warn!(error = %e, "cannot start watching etcd for deltas");
                self.watching = false;
                self.publish(|s| s.last_error = Some(format!("watch: {e}")));
            }
        }
    }

    /// Now, when the store has no full snapshot or the newest is older than the schedule's
    /// previous occurrence; else the next occurrence.
    async fn first_full_due(&mut self) -> Option<DateTime<Utc>> {
        let now = Utc::now();
        let next = self.next_occurrence(now);
        match self.engine.latest_full().await {
            Ok(Some(last)) => {
                let due_after_last = self.next_occurrence(last.created_on);
                match due_after_last {
                    Some(d) if d <= now => Some(now),
                    _ => next,
                }
            }
            Ok(None) => Some(now),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the store; taking a full snapshot now");
                Some(now)
            }
        }
    }

    async fn scheduled_full(&mut self) {
        match self.full(false).await {
            Ok(_) => self.next_full = self.next_occurrence(Utc::now()),
            Err(_) => {
                let retry = Utc::now() + chrono::Duration::from_std(FULL_RETRY).unwrap_or_default();
                self.next_full = Some(
                    self.next_occurrence(Utc::now())
                        .map_or(retry, |n| n.min(retry)),
                );
            }
        }
        self.publish(|_| {});
    }

    async fn full(&mut self, is_final: bool) -> Result<Snapshot, ActorError> {
        let started = Instant::now();
        self.metrics
            .required
            .get_or_create(&KindLabel { kind: "Full" })
            .set(1);
        let span = tracing::info_span!("snapshot", kind = "Full", is_final);
        let result = {
            let _e = span.enter();
            tracing::info!("taking full snapshot");
            drop(_e);
            self.engine.full(is_final).await
        };
        self.metrics
            .required
            .get_or_create(&KindLabel { kind: "Full" })
            .set(0);
        self.metrics
            .timed("Full", result.is_ok(), started.elapsed());
        match result {
            Ok(snap) => {
                self.metrics.stored(&snap);
                self.publish(|s| {
                    s.last_full = Some(snap.clone());
                    s.last_error = None;
                });
                Ok(snap)
            }
            Err(e) => {
                tracing::error!(error = %e, is_final, "full snapshot failed");
                let msg = format!("full snapshot: {e}");
                self.publish(|s| s.last_error = Some(msg.clone()));
                Err(ActorError::Failed(msg))
            }
        }
    }

    async fn delta(&mut self) -> Result<Option<Snapshot>, ActorError> {
        let started = Instant::now();
        let result = self.engine.flush_delta().await;
        match result {
            Ok(None) => Ok(None),
            Ok(Some(snap)) => {
                self.metrics.timed("Incr", true, started.elapsed());
                self.metrics.stored(&snap);
                self.publish(|s| {
                    s.last_delta = Some(snap.clone());
                    s.last_error = None;
                });
                Ok(Some(snap))
            }
            Err(e) => {
                self.metrics.timed("Incr", false, started.elapsed());
                tracing::warn!(error = %e, "delta snapshot failed; events stay buffered for the next attempt");
                let msg = format!("delta snapshot: {e}");
                self.publish(|s| s.last_error = Some(msg.clone()));
                Err(ActorError::Failed(msg))
            }
        }
    }

    async fn gc(&mut self) {
        match self.engine.gc(Utc::now()).await {
            Ok(deleted) => {
                for s in &deleted {
                    tracing::info!(snapshot = %s.snap_name, "retention deleted snapshot");
                    self.metrics
                        .gc_total
                        .get_or_create(&KindLabel {
                            kind: ActorMetrics::kind(s),
                        })
                        .inc();
                }
            }
            Err(e) => tracing::warn!(error = %e, "retention failed; will retry"),
        }
    }
}
