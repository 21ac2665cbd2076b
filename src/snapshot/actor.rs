//! The one snapshot actor: scheduled full snapshots, periodic deltas, retention, requested and
//! final snapshots all go through one task, so two snapshots never run at once.
//!
//! What the actor may do is the [`Gate`] the ownership watchdog sets: regular work (schedule,
//! deltas, retention) and requested snapshots only while it is open and this sidecar's member leads
//! the raft group; the hand-off's final snapshot only once it says "final". The gate is read, never
//! waited for: when it changes, the operation in flight is dropped at once if the new gate forbids
//! it (an upload dropped before it completes never becomes visible), and queued requests it
//! forbids are refused. So losing ownership never waits behind a slow store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::full::FullError;
use super::gate::{Gate, Operation};
use super::metrics::SnapshotMetrics;
use crate::backoff::Backoff;
use crate::store::StoreError;
use crate::store::gc::GcReport;
use crate::store::layout::{Kind, Snapshot};

/// Why the engine failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A full snapshot failed (etcd, the store, the codec, or the member is behind).
    #[error(transparent)]
    Full(#[from] FullError),
    /// A delta snapshot could not be written.
    #[error(transparent)]
    Delta(#[from] super::delta::DeltaError),
    /// The watch for deltas failed.
    #[error(transparent)]
    Watch(#[from] super::watcher::WatchError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// etcd failed.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
}

/// The work the actor schedules: etcd and the store in production, a fake in tests.
#[async_trait]
pub trait Engine: Send + 'static {
    /// Takes a full snapshot (named final when asked) and returns it once stored; later deltas
    /// start after its revision. With `min_revision`, the snapshot is refused (nothing stored)
    /// when the member's revision is below it.
    async fn full(
        &mut self,
        is_final: bool,
        min_revision: Option<i64>,
    ) -> Result<Snapshot, EngineError>;
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
    /// Applies retention at `now`; reports what was deleted.
    async fn gc(&mut self, now: DateTime<Utc>) -> Result<GcReport, EngineError>;
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
#[derive(Debug, Clone, thiserror::Error)]
pub enum ActorError {
    /// The actor has shut down.
    #[error("the snapshot actor has stopped")]
    Stopped,
    /// The gate does not allow it.
    #[error("refused: {reason}")]
    Refused {
        /// The gate at the time.
        gate: Gate,
        /// Why, in words.
        reason: &'static str,
    },
    /// The gate changed while it ran, and the new one forbids it; nothing was stored.
    #[error("cancelled: ownership changed while it ran; nothing was stored")]
    Cancelled,
    /// Deltas are not being collected (not the snapshot leader, paused, or disabled).
    #[error("deltas are not being collected (not the snapshot leader, paused, or disabled)")]
    NoDeltas,
    /// The snapshot failed.
    #[error("{0}")]
    Failed(Arc<EngineError>),
}

/// When and how the actor works.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// Full snapshots (cron).
    pub schedule: croner::Cron,
    /// Zero disables deltas.
    pub delta_period: Duration,
    /// Buffered event bytes that trigger a delta before the period.
    pub delta_memory_limit: u64,
    /// Time between retention passes.
    pub gc_period: Duration,
    /// Time between raft leadership checks.
    pub leader_check_interval: Duration,
}

/// What the actor is doing, for `/status`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ActorStatus {
    /// What the gate allows.
    pub gate: Gate,
    /// This sidecar's member leads the raft group.
    pub leader: bool,
    /// The last full snapshot stored by this process.
    pub last_full: Option<Snapshot>,
    /// The last delta snapshot stored by this process.
    pub last_delta: Option<Snapshot>,
    /// When the next scheduled full snapshot is due.
    pub next_full_at: Option<DateTime<Utc>>,
    /// The last failure, cleared by the next success.
    pub last_error: Option<String>,
}

enum Command {
    Full {
        is_final: bool,
        min_revision: Option<i64>,
        reply: oneshot::Sender<Result<Snapshot, ActorError>>,
    },
    Delta {
        reply: oneshot::Sender<Result<Option<Snapshot>, ActorError>>,
    },
}

/// The way to talk to the actor; cheap to clone.
#[derive(Clone)]
pub struct ActorHandle {
    tx: mpsc::Sender<Command>,
    status: watch::Receiver<ActorStatus>,
}

impl ActorHandle {
    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ActorError>>) -> Command,
    ) -> Result<T, ActorError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| ActorError::Stopped)?;
        rx.await.map_err(|_| ActorError::Stopped)?
    }

    /// Takes a full (non-final) snapshot now, after whatever the actor is doing; refused unless
    /// the gate is open.
    pub async fn full(&self) -> Result<Snapshot, ActorError> {
        self.ask(|reply| Command::Full {
            is_final: false,
            min_revision: None,
            reply,
        })
        .await
    }

    /// Takes the hand-off's final full snapshot at `min_revision` or later; refused unless the
    /// gate says "final".
    pub async fn final_snapshot(&self, min_revision: i64) -> Result<Snapshot, ActorError> {
        self.ask(|reply| Command::Full {
            is_final: true,
            min_revision: Some(min_revision),
            reply,
        })
        .await
    }

    /// Writes the buffered events as a delta now; refused unless the gate is open.
    pub async fn delta(&self) -> Result<Option<Snapshot>, ActorError> {
        self.ask(|reply| Command::Delta { reply }).await
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

/// Runs `op` until the gate changes at all: `None` when it changed first (then `op` is dropped).
/// For the actor's housekeeping (leader checks, listing the store, starting the watch), so a slow
/// etcd or store never keeps the actor from seeing that ownership changed.
async fn until_gate_changes<T>(
    gate: &mut watch::Receiver<Gate>,
    op: impl std::future::Future<Output = T>,
) -> Option<T> {
    let at_start = *gate.borrow_and_update();
    let changed = async {
        if gate.wait_for(|g| *g != at_start).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        biased;
        _ = changed => None,
        r = op => Some(r),
    }
}

/// Runs `op` while `gate` allows `kind`: `None` when the gate forbids it at the start or changes
/// to forbid it before `op` finishes (then `op` is dropped, which cancels it).
async fn while_allowed<T>(
    gate: &mut watch::Receiver<Gate>,
    kind: Operation,
    op: impl std::future::Future<Output = T>,
) -> Option<T> {
    if !gate.borrow_and_update().allows(kind) {
        return None;
    }
    let forbidden = async {
        // A dropped sender means the gate never changes again.
        if gate.wait_for(|g| !g.allows(kind)).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        biased;
        _ = forbidden => None,
        r = op => Some(r),
    }
}

/// Starts the actor on the current runtime; it stops when `cancel` fires (flushing a pending
/// delta first, while the gate allows it) or every handle is dropped. `gate` is what the
/// ownership watchdog allows (always open without ownership checks).
pub fn spawn<E: Engine>(
    engine: E,
    config: ActorConfig,
    gate: watch::Receiver<Gate>,
    metrics: SnapshotMetrics,
    cancel: CancellationToken,
) -> (ActorHandle, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(16);
    let status = ActorStatus {
        gate: *gate.borrow(),
        leader: false,
        last_full: None,
        last_delta: None,
        next_full_at: None,
        last_error: None,
    };
    let (status_tx, status_rx) = watch::channel(status);
    let actor = Actor {
        engine,
        config,
        metrics,
        status: Arc::new(status_tx),
        gate,
        leader: false,
        next_full: None,
        watching: false,
        was_active: false,
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
    metrics: SnapshotMetrics,
    status: Arc<watch::Sender<ActorStatus>>,
    gate: watch::Receiver<Gate>,
    leader: bool,
    /// When the next scheduled full snapshot is due (None until first computed).
    next_full: Option<DateTime<Utc>>,
    /// The engine's watch is running.
    watching: bool,
    /// Regular work was allowed at the last look (gate open and leader).
    was_active: bool,
}

/// Retries after a failed scheduled full snapshot (first) and a watch failure (every time).
const FULL_RETRY: Backoff = Backoff::new(Duration::from_secs(60), Duration::from_secs(60));
const WATCH_RETRY: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));

fn until(at: DateTime<Utc>) -> tokio::time::Instant {
    let d = (at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
    tokio::time::Instant::now() + d
}

impl<E: Engine> Actor<E> {
    fn active(&self) -> bool {
        self.gate.borrow().allows(Operation::Regular) && self.leader
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
            s.gate = *self.gate.borrow();
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
        let mut gate = self.gate.clone();
        // Without ownership checks nobody holds the sender: the gate stays as it is.
        let mut gate_live = true;
        loop {
            let active = self.active();
            let full_at = self.next_full.map(until);
            let can_collect = active
                && self.deltas_on()
                && watch_retry_at.is_none_or(|t| t <= tokio::time::Instant::now());
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                // The gate first: a change is acted on before anything else is started.
                changed = gate.changed(), if gate_live => {
                    if changed.is_err() {
                        gate_live = false;
                    }
                    self.on_activity_change().await;
                }
                cmd = rx.recv() => match cmd {
                    None => break,
                    Some(cmd) => self.handle(cmd).await,
                },
                _ = leader_tick.tick() => self.check_leader().await,
                _ = async { tokio::time::sleep_until(full_at.unwrap_or_else(tokio::time::Instant::now)).await }, if active && full_at.is_some() => {
                    self.scheduled_full().await;
                }
                _ = delta_tick.tick(), if active && self.deltas_on() => { let _ = self.delta(Operation::Regular).await; }
                r = self.engine.collect(), if can_collect && self.watching => match r {
                    Ok(Collected::Events) => {
                        if self.engine.buffered_bytes() >= self.config.delta_memory_limit {
                            let _ = self.delta(Operation::Regular).await;
                        }
                    }
                    Ok(Collected::Compacted) => self.next_full = Some(Utc::now()),
                    Err(e) => {
                        tracing::warn!(error = %e, "watching etcd for deltas failed; resuming from the latest snapshot");
                        self.watching = false;
                        watch_retry_at = Some(tokio::time::Instant::now() + WATCH_RETRY.delay(1));
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
        // Shutting down: what was buffered is written (if the gate still allows it), so a restart
        // loses nothing.
        if self.active() && self.watching && self.engine.buffered_bytes() > 0 {
            let _ = self.delta(Operation::Regular).await;
        }
        self.engine.pause();
        tracing::info!("snapshot actor stopped");
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Full {
                is_final,
                min_revision,
                reply,
            } => {
                let kind = if is_final {
                    Operation::Final
                } else {
                    Operation::Requested
                };
                let r = self.full(kind, min_revision).await;
                let _ = reply.send(r);
            }
            Command::Delta { reply } => {
                let r = if !self.gate.borrow().allows(Operation::Requested) {
                    Err(self.refused(Operation::Requested))
                } else if self.watching {
                    self.delta(Operation::Requested).await
                } else {
                    Err(ActorError::NoDeltas)
                };
                let _ = reply.send(r);
            }
        }
    }

    fn refused(&self, op: Operation) -> ActorError {
        let gate = *self.gate.borrow();
        ActorError::Refused {
            gate,
            reason: gate.refusal(op),
        }
    }

    async fn check_leader(&mut self) {
        let leader = match until_gate_changes(&mut self.gate, self.engine.is_leader()).await {
            // The loop sees the change next and acts on it.
            None => return,
            Some(Ok(l)) => l,
            Some(Err(e)) => {
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
            self.metrics.set_leader(leader);
        }
        self.leader = leader;
        self.on_activity_change().await;
    }

    /// Starts or stops regular work when `active()` changed since the last look.
    async fn on_activity_change(&mut self) {
        let now = self.active();
        let was = std::mem::replace(&mut self.was_active, now);
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
        match until_gate_changes(&mut self.gate, self.engine.resume()).await {
            None => self.watching = false,
            Some(Ok(())) => self.watching = true,
            Some(Err(e)) => {
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
        match until_gate_changes(&mut self.gate, self.engine.latest_full()).await {
            None => None,
            Some(Ok(Some(last))) => {
                let due_after_last = self.next_occurrence(last.created_on);
                match due_after_last {
                    Some(d) if d <= now => Some(now),
                    _ => next,
                }
            }
            Some(Ok(None)) => Some(now),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot list the store; taking a full snapshot now");
                Some(now)
            }
        }
    }

    async fn scheduled_full(&mut self) {
        match self.full(Operation::Regular, None).await {
            Ok(_) => self.next_full = self.next_occurrence(Utc::now()),
            Err(ActorError::Cancelled | ActorError::Refused { .. }) => {}
            Err(_) => {
                let retry = Utc::now()
                    + chrono::Duration::from_std(FULL_RETRY.delay(1)).unwrap_or_default();
                self.next_full = Some(
                    self.next_occurrence(Utc::now())
                        .map_or(retry, |n| n.min(retry)),
                );
            }
        }
        self.publish(|_| {});
    }

    async fn full(
        &mut self,
        kind: Operation,
        min_revision: Option<i64>,
    ) -> Result<Snapshot, ActorError> {
        if !self.gate.borrow().allows(kind) {
            return Err(self.refused(kind));
        }
        let is_final = kind == Operation::Final;
        let span = tracing::info_span!("full_snapshot", is_final, min_revision);
        let started = Instant::now();
        let op =
            tracing::Instrument::instrument(self.engine.full(is_final, min_revision), span.clone());
        let result = while_allowed(&mut self.gate, kind, op).await;
        let took = started.elapsed().as_secs_f64();
        let _in = span.enter();
        match result {
            None => {
                tracing::warn!("full snapshot dropped: ownership changed while it ran");
                Err(ActorError::Cancelled)
            }
            Some(Ok(snap)) => {
                self.metrics.stored(&snap, took);
                self.publish(|s| {
                    s.last_full = Some(snap.clone());
                    s.last_error = None;
                });
                Ok(snap)
            }
            Some(Err(e)) => {
                self.metrics.failed(Kind::Full, took);
                tracing::error!(error = %e, "full snapshot failed");
                let msg = format!("full snapshot: {e}");
                self.publish(|s| s.last_error = Some(msg));
                Err(ActorError::Failed(Arc::new(e)))
            }
        }
    }

    async fn delta(&mut self, kind: Operation) -> Result<Option<Snapshot>, ActorError> {
        let started = Instant::now();
        let result = while_allowed(&mut self.gate, kind, self.engine.flush_delta()).await;
        match result {
            None => Err(ActorError::Cancelled),
            Some(Ok(None)) => Ok(None),
            Some(Ok(Some(snap))) => {
                self.metrics.stored(&snap, started.elapsed().as_secs_f64());
                tracing::debug!(snapshot = %snap.snap_name, revision = snap.last_revision, "delta snapshot stored");
                self.publish(|s| {
                    s.last_delta = Some(snap.clone());
                    s.last_error = None;
                });
                Ok(Some(snap))
            }
            Some(Err(e)) => {
                self.metrics
                    .failed(Kind::Incr, started.elapsed().as_secs_f64());
                tracing::warn!(error = %e, "delta snapshot failed; events stay buffered for the next attempt");
                let msg = format!("delta snapshot: {e}");
                self.publish(|s| s.last_error = Some(msg));
                Err(ActorError::Failed(Arc::new(e)))
            }
        }
    }

    async fn gc(&mut self) {
        match while_allowed(
            &mut self.gate,
            Operation::Regular,
            self.engine.gc(Utc::now()),
        )
        .await
        {
            None => tracing::info!("retention pass dropped: ownership changed while it ran"),
            Some(Ok(report)) => self.metrics.gc(&report),
            Some(Err(e)) => tracing::warn!(error = %e, "retention failed; will retry"),
        }
    }
}
