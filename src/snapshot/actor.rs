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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::defrag::{MemberState, PassState, Rule, StopReason};
use super::full::FullError;
use super::gate::{Gate, Operation};
use super::metrics::SnapshotMetrics;
use crate::backoff::Backoff;
use crate::store::gc::GcReport;
use crate::store::layout::{Kind, Snapshot};
use crate::store::{Chain, StoreError};

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
    /// A client to another member could not be built.
    #[error(transparent)]
    Connect(#[from] crate::etcd::EtcdError),
    /// The operation took longer than `snapshot.timeout` and was abandoned (dropped, so an
    /// upload in flight is aborted and nothing is stored).
    #[error("{operation} took longer than snapshot.timeout ({after:?}); abandoned, nothing stored")]
    TimedOut {
        /// What timed out.
        operation: &'static str,
        /// The timeout.
        after: Duration,
    },
}

impl EngineError {
    /// The failure's class, the `error` label of `etcdbr_snapshotter_failure`.
    pub fn class(&self) -> &'static str {
        use super::delta::DeltaError;
        match self {
            EngineError::Full(FullError::Etcd(_))
            | EngineError::Etcd(_)
            | EngineError::Connect(_) => "etcd",
            EngineError::Full(FullError::Store(_) | FullError::Mark(_))
            | EngineError::Delta(DeltaError::Store(_))
            | EngineError::Store(_) => "store",
            EngineError::Full(FullError::Codec(_)) => "codec",
            EngineError::Full(FullError::Behind { .. } | FullError::Moved { .. }) => "behind",
            EngineError::Delta(_) => "delta",
            EngineError::Watch(_) => "watch",
            EngineError::TimedOut { .. } => "timeout",
        }
    }
}

/// A snapshot the engine stored, and its size in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// Bytes stored (compressed).
    pub bytes: u64,
}

/// This sidecar's member as etcd reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Membership {
    /// It leads the raft group.
    pub leader: bool,
    /// It is a learner (not yet a voting member).
    pub learner: bool,
    /// Members in etcd's member list; `None` when the list could not be read.
    pub cluster_size: Option<u64>,
}

/// What a full snapshot is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FullKind {
    /// A scheduled one, named when it is taken.
    Regular,
    /// One taken on request (`POST /snapshot/full`), named when it is taken and marked as
    /// requested ([`crate::store::gc::mark_triggered`]) before the actor answers, so no
    /// retention pass ever counts it among the scheduled ones.
    Requested,
    /// etcd-druid's requested final (`POST /snapshot/full?final=true` under `[druid]`): a
    /// [`FullKind::Requested`] named `.final` as etcd-backup-restore names it, and marked as
    /// druid's before its upload, so no reader takes it for a hand-off's final
    /// ([`crate::store::gc`]'s notes). Refused, as every request is, unless the gate is open.
    RequestedFinal,
    /// The hand-off's final: exactly the object `name` (fixed before its first attempt, so every
    /// attempt writes the same one), refused (nothing stored) when the member is below
    /// `min_revision`.
    Final {
        /// The final's name, fixed by the hand-off's intent.
        name: Snapshot,
        /// The revision it must hold at least.
        min_revision: i64,
    },
}

/// The work the actor schedules: etcd and the store in production, a fake in tests.
#[async_trait]
pub trait Engine: Send + 'static {
    /// Takes a full snapshot and returns it once stored; later deltas start after its revision.
    async fn full(&mut self, kind: &FullKind) -> Result<Stored, EngineError>;
    /// Waits for watch events and buffers them. Cancel-safe: the actor drops this future
    /// whenever something else is due.
    async fn collect(&mut self) -> Result<Collected, EngineError>;
    /// Bytes of events buffered for the next delta.
    fn buffered_bytes(&self) -> u64;
    /// Writes the buffered events as a delta snapshot; `None` when there were none.
    async fn flush_delta(&mut self) -> Result<Option<Stored>, EngineError>;
    /// Drops buffered events and restarts the watch after the latest stored snapshot (after a
    /// pause, or when this sidecar becomes the snapshot leader), so the revision stream has no gap.
    async fn resume(&mut self) -> Result<(), EngineError>;
    /// Stops watching (regular work paused).
    fn pause(&mut self);
    /// Whether the store has no base this etcd continues (its history was set aside by
    /// `resume`): a full snapshot is due now.
    fn base_needed(&self) -> bool {
        false
    }
    /// Whether this sidecar's member is the raft leader, whether it is a learner, and how many
    /// members the cluster has.
    async fn membership(&mut self) -> Result<Membership, EngineError>;
    /// The newest full snapshot in the store and the deltas after it.
    async fn latest_chain(&mut self) -> Result<Chain, EngineError>;
    /// Applies retention at `now`; reports what was deleted.
    async fn gc(&mut self, now: DateTime<Utc>) -> Result<GcReport, EngineError>;
    /// One step of a defragmentation pass: reads every member's status and does what
    /// [`defrag::plan`](super::defrag::plan) says for `pass` and `rule` (defragment a member
    /// through a client to its own URLs, or move leadership away from the leader), each request
    /// allowed `timeout`.
    async fn defrag_step(
        &mut self,
        pass: &PassState,
        rule: Rule,
        timeout: Duration,
    ) -> Result<StepOutcome, EngineError>;
}

/// What one [`Engine::defrag_step`] saw and did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// Every member's state as the step read it (for the fragmentation metrics).
    pub observed: Vec<MemberState>,
    /// What it did.
    pub step: DefragStep,
}

/// What one [`Engine::defrag_step`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum DefragStep {
    /// This member was defragmented.
    Defragmented {
        /// Its ID.
        member: u64,
        /// The leader its own status named right before its defragmentation started.
        leader: u64,
        /// Its database file's size before.
        db_size_before: i64,
        /// Its database file's size after, when its status could be read.
        db_size_after: Option<i64>,
        /// How long etcd took.
        took: Duration,
    },
    /// Leadership was moved from the leader to a caught-up follower.
    MovedLeader {
        /// The former leader.
        from: u64,
        /// The new one.
        to: u64,
    },
    /// The member planned took leadership before its defragmentation: nothing was done, the
    /// next step plans again.
    LeaderMoved,
    /// Nothing is left: every member is done or under the rule.
    Done,
    /// The pass stops (kill switch, health, learner, leadership).
    Stopped {
        /// Why, for metrics.
        reason: StopReason,
        /// Why, in words.
        detail: String,
    },
}

/// One thing a pass did, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefragEvent {
    /// A member was defragmented while its own status named `leader` as leader.
    Defragmented {
        /// The member.
        member: u64,
        /// The leader right before.
        leader: u64,
    },
    /// Leadership was moved.
    MovedLeader {
        /// The former leader.
        from: u64,
        /// The new one.
        to: u64,
    },
}

/// What a defragmentation pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefragReport {
    /// The members defragmented, in order.
    pub defragmented: Vec<u64>,
    /// The defragmentations and leadership moves, in order.
    pub events: Vec<DefragEvent>,
    /// The full snapshot taken after (none when no member was defragmented).
    pub snapshot: Option<Snapshot>,
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
    /// A defragmentation pass stopped before it was done: the kill switch, an unhealthy member,
    /// a learner catching up, or leadership (not this member at the start, no follower to take
    /// over, moving too often); the members in `done` were defragmented before.
    #[error("defragmentation stopped after {done:x?}: {reason}")]
    Unhealthy {
        /// Why.
        reason: String,
        /// Members defragmented before it stopped.
        done: Vec<u64>,
    },
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
    /// Longest a full snapshot, a delta, or opening the watch for deltas may take; then it fails
    /// with [`EngineError::TimedOut`] and the actor goes on.
    pub timeout: Duration,
    /// Defragmentation: scheduled, triggered by fragmentation, the kill switch (all off by
    /// default).
    pub defrag: crate::config::DefragConfig,
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
    /// When the next scheduled defragmentation is due (none while inactive or off).
    pub next_defrag_at: Option<DateTime<Utc>>,
    /// The last failure, cleared by the next success.
    pub last_error: Option<String>,
    /// The last defragmentation pass that defragmented a member or moved leadership.
    #[serde(skip)]
    pub last_defrag: Option<DefragReport>,
}

enum Command {
    Full {
        kind: FullKind,
        reply: oneshot::Sender<Result<Snapshot, ActorError>>,
    },
    Delta {
        reply: oneshot::Sender<Result<Option<Snapshot>, ActorError>>,
    },
    Defrag {
        reply: oneshot::Sender<Result<DefragReport, ActorError>>,
    },
}

/// The way to talk to the actor; cheap to clone.
#[derive(Clone)]
pub struct ActorHandle {
    tx: mpsc::Sender<Command>,
    status: watch::Receiver<ActorStatus>,
    changes: Arc<AtomicU64>,
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

    /// Takes a requested full (non-final) snapshot now, after whatever the actor is doing,
    /// marked as requested for retention; refused unless the gate is open.
    pub async fn full(&self) -> Result<Snapshot, ActorError> {
        self.ask(|reply| Command::Full {
            kind: FullKind::Requested,
            reply,
        })
        .await
    }

    /// Takes etcd-druid's requested final now ([`FullKind::RequestedFinal`]); refused unless
    /// the gate is open.
    pub async fn requested_final(&self) -> Result<Snapshot, ActorError> {
        self.ask(|reply| Command::Full {
            kind: FullKind::RequestedFinal,
            reply,
        })
        .await
    }

    /// Takes the hand-off's final full snapshot as the object `name`, at `min_revision` or
    /// later; refused unless the gate says "final".
    pub async fn final_snapshot(
        &self,
        name: Snapshot,
        min_revision: i64,
    ) -> Result<Snapshot, ActorError> {
        self.ask(|reply| Command::Full {
            kind: FullKind::Final { name, min_revision },
            reply,
        })
        .await
    }

    /// Writes the buffered events as a delta now; refused unless the gate is open.
    pub async fn delta(&self) -> Result<Option<Snapshot>, ActorError> {
        self.ask(|reply| Command::Delta { reply }).await
    }

    /// Runs a defragmentation pass now (then a full snapshot), after whatever the actor is
    /// doing; refused unless regular work is allowed: the gate is open and this sidecar's member
    /// leads.
    pub async fn defrag(&self) -> Result<DefragReport, ActorError> {
        self.ask(|reply| Command::Defrag { reply }).await
    }

    /// The actor's current status.
    pub fn status(&self) -> ActorStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change.
    pub fn watch_status(&self) -> watch::Receiver<ActorStatus> {
        self.status.clone()
    }

    /// How many of the actor's operations so far stored or deleted something in the store (or
    /// may have): a listing made before it last grew may be out of date. It grows before the
    /// actor answers the request or the hand-off whose snapshot was stored.
    pub fn store_changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
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

/// Runs `op` for at most `limit`: a hung etcd stream (or store) fails the operation instead of
/// stalling the actor; dropping `op` cancels it.
async fn bounded<T>(
    limit: Duration,
    operation: &'static str,
    op: impl std::future::Future<Output = Result<T, EngineError>>,
) -> Result<T, EngineError> {
    match tokio::time::timeout(limit, op).await {
        Ok(r) => r,
        Err(_) => Err(EngineError::TimedOut {
            operation,
            after: limit,
        }),
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
        next_defrag_at: None,
        last_error: None,
        last_defrag: None,
    };
    let (status_tx, status_rx) = watch::channel(status);
    let changes = Arc::new(AtomicU64::new(0));
    let actor = Actor {
        engine,
        config,
        metrics,
        status: Arc::new(status_tx),
        gate,
        leader: false,
        next_full: None,
        next_defrag: None,
        defrag_hold_until: None,
        saw_other_leader: false,
        cluster_size: None,
        watching: false,
        was_active: false,
        changes: changes.clone(),
    };
    let task = tokio::spawn(actor.run(rx, cancel));
    (
        ActorHandle {
            tx,
            status: status_rx,
            changes,
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
    /// When the next scheduled defragmentation is due (None while inactive or off).
    next_defrag: Option<DateTime<Utc>>,
    /// No automatic defragmentation pass starts before this: leadership was just taken from
    /// another member, whose sidecar may still be running a pass (see [`super::defrag::holdoff`]).
    defrag_hold_until: Option<tokio::time::Instant>,
    /// A leadership check said another member leads.
    saw_other_leader: bool,
    /// The cluster's size at the last leadership check.
    cluster_size: Option<u64>,
    /// The engine's watch is running.
    watching: bool,
    /// Regular work was allowed at the last look (gate open and leader).
    was_active: bool,
    /// [`ActorHandle::store_changes`].
    changes: Arc<AtomicU64>,
}

/// The cluster size assumed for the defragmentation hold-off when no member list was read.
const DEFAULT_CLUSTER_SIZE: u64 = 5;

/// Retries after a failed scheduled full snapshot (first) and a watch failure (every time).
const FULL_RETRY: Backoff = Backoff::new(Duration::from_secs(60), Duration::from_secs(60));
const WATCH_RETRY: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));

/// Whether the defragmentation kill switch is on: its file exists, or whether it does cannot be
/// told (fail closed: an operator who cannot tell either would not want a member paused).
async fn kill_switch_on(path: Option<&std::path::Path>) -> bool {
    let Some(path) = path else {
        return false;
    };
    match tokio::fs::try_exists(path).await {
        Ok(on) => on,
        Err(error) => {
            tracing::warn!(%error, path = %path.display(), "cannot tell whether the defragmentation kill switch (defrag.disable_file) exists; treating it as on");
            true
        }
    }
}

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

    /// The store may hold something else now: listings cached before are out of date.
    fn store_changed(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
    }

    fn publish(&self, f: impl FnOnce(&mut ActorStatus)) {
        self.status.send_modify(|s| {
            f(s);
            s.gate = *self.gate.borrow();
            s.leader = self.leader;
            s.next_full_at = if self.active() { self.next_full } else { None };
            s.next_defrag_at = if self.active() {
                self.next_defrag
            } else {
                None
            };
        });
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Command>, cancel: CancellationToken) {
        let mut leader_tick = tokio::time::interval(self.config.leader_check_interval);
        let mut delta_tick =
            tokio::time::interval(self.config.delta_period.max(Duration::from_millis(10)));
        let mut gc_tick = tokio::time::interval(self.config.gc_period);
        let trigger_on = self.config.defrag.check_interval.is_some();
        let mut trigger_tick = tokio::time::interval(
            self.config
                .defrag
                .check_interval
                .unwrap_or(Duration::from_secs(3600)),
        );
        for t in [
            &mut leader_tick,
            &mut delta_tick,
            &mut gc_tick,
            &mut trigger_tick,
        ] {
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        let mut watch_retry_at: Option<tokio::time::Instant> = None;
        let mut gate = self.gate.clone();
        // Without ownership checks nobody holds the sender: the gate stays as it is.
        let mut gate_live = true;
        loop {
            let active = self.active();
            let full_at = self.next_full.map(until);
            let defrag_at = self.next_defrag.map(until);
            // At the memory limit the watch is not read until a delta is stored: a store that is
            // down for long would otherwise let the buffer grow with every write. etcd keeps the
            // events (or says they are compacted, and a full snapshot follows).
            let buffered = self.engine.buffered_bytes();
            self.metrics.set_delta_buffered(buffered);
            let can_collect = active
                && self.deltas_on()
                && buffered < self.config.delta_memory_limit
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
                _ = async { tokio::time::sleep_until(defrag_at.unwrap_or_else(tokio::time::Instant::now)).await }, if active && defrag_at.is_some() => {
                    self.scheduled_defrag().await;
                }
                _ = trigger_tick.tick(), if active && trigger_on => self.triggered_defrag().await,
                _ = delta_tick.tick(), if active && self.deltas_on() => { let _ = self.delta(Operation::Regular).await; }
                r = self.engine.collect(), if can_collect && self.watching => match r {
                    Ok(Collected::Events) => {
                        let buffered = self.engine.buffered_bytes();
                        self.metrics.set_required(Kind::Incr, buffered > 0);
                        if buffered >= self.config.delta_memory_limit
                            && self.delta(Operation::Regular).await.is_err()
                            && self.engine.buffered_bytes() >= self.config.delta_memory_limit
                        {
                            tracing::warn!(
                                buffered = self.engine.buffered_bytes(),
                                limit = self.config.delta_memory_limit,
                                "the delta buffer is at snapshot.delta_memory_limit and cannot be stored: etcd's watch is not read until a delta is stored (tried every delta period)"
                            );
                        }
                    }
                    Ok(Collected::Compacted) => {
                        self.metrics.set_required(Kind::Full, true);
                        self.next_full = Some(Utc::now());
                    }
                    Err(e) => {
                        self.metrics.failure(e.class());
                        tracing::warn!(error = %e, "watching etcd for deltas failed; resuming from the latest snapshot");
                        self.watching = false;
                        watch_retry_at = Some(tokio::time::Instant::now() + WATCH_RETRY.delay(1));
                        self.publish(|s| s.last_error = Some(format!("watch: {e}")));
                    }
                },
                _ = async { tokio::time::sleep_until(watch_retry_at.unwrap_or_else(tokio::time::Instant::now)).await }, if active && !self.watching && self.deltas_on() => {
                    watch_retry_at = None;
                    self.start_watch().await;
                    if !self.watching {
                        // A failed start waits as a failed watch does: unset, this branch would
                        // fire again at once, a busy loop until the next leadership check (a
                        // leader whose etcd just died logged a warning every few ms).
                        watch_retry_at = Some(tokio::time::Instant::now() + WATCH_RETRY.delay(1));
                    }
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
            Command::Full { kind, reply } => {
                let op = match kind {
                    FullKind::Final { .. } => Operation::Final,
                    FullKind::Regular | FullKind::Requested | FullKind::RequestedFinal => {
                        Operation::Requested
                    }
                };
                let r = self.full(op, kind).await;
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
            Command::Defrag { reply } => {
                let r = self.defrag(self.config.defrag.scheduled_rule()).await;
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
        let leader = match until_gate_changes(&mut self.gate, self.engine.membership()).await {
            // The loop sees the change next and acts on it.
            None => return,
            Some(Ok(m)) => {
                self.metrics.membership(m.learner, m.cluster_size);
                self.cluster_size = m.cluster_size.or(self.cluster_size);
                if !m.leader {
                    self.saw_other_leader = true;
                }
                m.leader
            }
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
            if leader && std::mem::take(&mut self.saw_other_leader) {
                // Taken from another member, whose sidecar may still run a pass it started.
                let n = self.cluster_size.unwrap_or(DEFAULT_CLUSTER_SIZE);
                let hold = super::defrag::holdoff(self.config.defrag.timeout, n);
                self.defrag_hold_until = tokio::time::Instant::now().checked_add(hold);
                tracing::info!(
                    seconds = hold.as_secs(),
                    "no automatic defragmentation pass starts for a while: the former leader's sidecar may still run one"
                );
            }
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
            self.next_defrag = self.next_defrag_occurrence(Utc::now());
        } else if !now && was {
            self.engine.pause();
            self.watching = false;
            self.next_full = None;
            self.next_defrag = None;
        }
        self.publish(|_| {});
    }

    async fn start_watch(&mut self) {
        if !self.deltas_on() {
            return;
        }
        let resume = bounded(
            self.config.timeout,
            "opening the watch for deltas",
            self.engine.resume(),
        );
        match until_gate_changes(&mut self.gate, resume).await {
            None => self.watching = false,
            Some(Ok(())) => self.watching = true,
            Some(Err(e)) => {
                self.metrics.failure(e.class());
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
        if self.engine.base_needed() {
            self.metrics.set_required(Kind::Full, true);
            return Some(now);
        }
        let next = self.next_occurrence(now);
        match until_gate_changes(&mut self.gate, self.engine.latest_chain()).await {
            None => None,
            Some(Ok(chain)) => {
                self.metrics.chain(&chain);
                let due = match &chain.full_snapshot {
                    Some(last) => match self.next_occurrence(last.created_on) {
                        Some(d) if d <= now => Some(now),
                        _ => next,
                    },
                    None => Some(now),
                };
                self.metrics
                    .set_required(Kind::Full, due.is_some_and(|d| d <= now));
                due
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot list the store; taking a full snapshot now");
                Some(now)
            }
        }
    }

    async fn scheduled_full(&mut self) {
        self.metrics.set_required(Kind::Full, true);
        match self.full(Operation::Regular, FullKind::Regular).await {
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

    async fn full(&mut self, kind: Operation, full: FullKind) -> Result<Snapshot, ActorError> {
        if !self.gate.borrow().allows(kind) {
            return Err(self.refused(kind));
        }
        let span = match &full {
            FullKind::Regular => tracing::info_span!("full_snapshot", is_final = false),
            FullKind::Requested => {
                tracing::info_span!("full_snapshot", is_final = false, requested = true)
            }
            FullKind::RequestedFinal => {
                tracing::info_span!("full_snapshot", is_final = false, requested_final = true)
            }
            FullKind::Final { name, min_revision } => {
                tracing::info_span!("full_snapshot", is_final = true, snapshot = %name.snap_name, min_revision)
            }
        };
        let started = Instant::now();
        let op = bounded(
            self.config.timeout,
            "full snapshot",
            self.engine.full(&full),
        );
        let op = tracing::Instrument::instrument(op, span.clone());
        let result = while_allowed(&mut self.gate, kind, op).await;
        let took = started.elapsed().as_secs_f64();
        let _in = span.enter();
        // Whatever the outcome: a failure after the upload (the request's mark) may have left
        // the snapshot stored, and one more listing after a full snapshot costs nothing.
        self.store_changed();
        match result {
            None => {
                tracing::warn!("full snapshot dropped: ownership changed while it ran");
                Err(ActorError::Cancelled)
            }
            Some(Ok(Stored {
                snapshot: snap,
                bytes,
            })) => {
                self.metrics.stored(&snap, bytes, took);
                // Events after the full snapshot's revision stay buffered for the next delta.
                self.metrics
                    .set_required(Kind::Incr, self.engine.buffered_bytes() > 0);
                self.publish(|s| {
                    s.last_full = Some(snap.clone());
                    s.last_error = None;
                });
                Ok(snap)
            }
            Some(Err(e)) => {
                self.metrics.failed(Kind::Full, took);
                self.metrics.failure(e.class());
                tracing::error!(error = %e, "full snapshot failed");
                let msg = format!("full snapshot: {e}");
                self.publish(|s| s.last_error = Some(msg));
                Err(ActorError::Failed(Arc::new(e)))
            }
        }
    }

    async fn delta(&mut self, kind: Operation) -> Result<Option<Snapshot>, ActorError> {
        let started = Instant::now();
        let flush = bounded(
            self.config.timeout,
            "delta snapshot",
            self.engine.flush_delta(),
        );
        let result = while_allowed(&mut self.gate, kind, flush).await;
        // Only a delta with nothing to write certainly stored nothing (a timed-out or dropped
        // flush may have completed its upload).
        if !matches!(result, Some(Ok(None))) {
            self.store_changed();
        }
        match result {
            None => Err(ActorError::Cancelled),
            Some(Ok(None)) => Ok(None),
            Some(Ok(Some(Stored {
                snapshot: snap,
                bytes,
            }))) => {
                self.metrics
                    .stored(&snap, bytes, started.elapsed().as_secs_f64());
                self.metrics
                    .set_required(Kind::Incr, self.engine.buffered_bytes() > 0);
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
                self.metrics.failure(e.class());
                if matches!(e, EngineError::TimedOut { .. }) {
                    // The flush was dropped part-way and may have taken its buffered events
                    // with it: continue from what the store holds, so the chain has no gap.
                    self.engine.pause();
                    self.watching = false;
                }
                tracing::warn!(error = %e, "delta snapshot failed; events stay buffered for the next attempt");
                let msg = format!("delta snapshot: {e}");
                self.publish(|s| s.last_error = Some(msg));
                Err(ActorError::Failed(Arc::new(e)))
            }
        }
    }

    fn next_defrag_occurrence(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let schedule = self.config.defrag.schedule.as_ref()?;
        schedule.find_next_occurrence(&after, false).ok()
    }

    /// Whether automatic passes are held off (leadership was just taken from another member).
    fn held_off(&self) -> bool {
        self.defrag_hold_until
            .is_some_and(|t| tokio::time::Instant::now() < t)
    }

    async fn scheduled_defrag(&mut self) {
        // The next occurrence whatever the outcome: a failed pass waits for the schedule, as
        // defragmenting again at once would only pause members again.
        self.next_defrag = self.next_defrag_occurrence(Utc::now());
        if self.held_off() {
            tracing::warn!(
                "scheduled defragmentation skipped: leadership was just taken from another member, whose sidecar may still run a pass"
            );
            return;
        }
        match self.defrag(self.config.defrag.scheduled_rule()).await {
            Ok(report) => {
                tracing::info!(members = ?report.defragmented, "scheduled defragmentation done")
            }
            Err(e) => tracing::warn!(error = %e, "scheduled defragmentation did not complete"),
        }
        self.publish(|_| {});
    }

    /// The fragmentation trigger's check: a pass over the members over its rule (none when no
    /// member is, which reads every member's status and nothing more).
    async fn triggered_defrag(&mut self) {
        if self.held_off() {
            return;
        }
        match self.defrag(self.config.defrag.trigger_rule()).await {
            Ok(report) if report.defragmented.is_empty() => {}
            Ok(report) => {
                tracing::info!(members = ?report.defragmented, "fragmentation-triggered defragmentation done")
            }
            Err(e) => {
                tracing::warn!(error = %e, "fragmentation-triggered defragmentation did not complete")
            }
        }
        self.publish(|_| {});
    }

    /// A defragmentation pass over the members over `rule`: one step at a time (a member's
    /// defragmentation, or a leadership move before the leader's turn), each planned from fresh
    /// status, each only while the kill switch is off and regular work stays allowed (a gate
    /// change drops the step in flight). Only the sidecar whose member leads starts one; it then
    /// runs it to its end whoever leads (see [`super::defrag`]). A full snapshot follows when a
    /// member was defragmented and this sidecar's member still leads.
    /// A defragmentation pass ([`Actor::defrag_pass`]); one that did anything is published in
    /// the status (`last_defrag`), for the Events that report it.
    async fn defrag(&mut self, rule: Rule) -> Result<DefragReport, ActorError> {
        let report = self.defrag_pass(rule).await?;
        if !report.events.is_empty() {
            let shown = report.clone();
            self.publish(|s| s.last_defrag = Some(shown));
        }
        Ok(report)
    }

    async fn defrag_pass(&mut self, rule: Rule) -> Result<DefragReport, ActorError> {
        let span = tracing::info_span!("defragmentation");
        let timeout = self.config.defrag.timeout;
        let mut pass = PassState::start();
        let mut events = Vec::new();
        let mut observed: Vec<MemberState> = Vec::new();
        // Since when a pass under way has been waiting for an election to settle.
        let mut waiting_since: Option<Instant> = None;
        loop {
            // At the start this sidecar must lead; later only the gate counts (a leadership
            // change, the pass's own move or not, does not drop the pass).
            let allowed = if pass.starting {
                self.active()
            } else {
                self.gate.borrow().allows(Operation::Regular)
            };
            if !allowed {
                let _in = span.enter();
                if pass.starting {
                    return Err(self.refused_regular());
                }
                self.metrics.defrag_pass("cancelled");
                tracing::warn!(done = ?pass.done, "defragmentation dropped: no longer allowed");
                return Err(ActorError::Cancelled);
            }
            pass.disabled = kill_switch_on(self.config.defrag.disable_file.as_deref()).await;
            let started = Instant::now();
            // One bound for the step: the status reads and the member's defragmentation (or
            // the leadership move).
            let step = bounded(
                timeout,
                "defragmentation",
                self.engine.defrag_step(&pass, rule, timeout),
            );
            let step = tracing::Instrument::instrument(step, span.clone());
            let result = while_allowed(&mut self.gate, Operation::Regular, step).await;
            let _in = span.enter();
            let outcome = match result {
                None => {
                    self.metrics
                        .defragmented(false, started.elapsed().as_secs_f64());
                    self.metrics.defrag_pass("cancelled");
                    tracing::warn!(done = ?pass.done, "defragmentation dropped: ownership changed while it ran");
                    return Err(ActorError::Cancelled);
                }
                Some(Err(e)) => {
                    self.metrics
                        .defragmented(false, started.elapsed().as_secs_f64());
                    self.metrics.failure(e.class());
                    self.metrics.defrag_pass("failed");
                    tracing::error!(error = %e, done = ?pass.done, "defragmentation failed");
                    let msg = format!("defragmentation: {e}");
                    self.publish(|s| s.last_error = Some(msg));
                    return Err(ActorError::Failed(Arc::new(e)));
                }
                Some(Ok(outcome)) => outcome,
            };
            if !outcome.observed.is_empty() {
                self.metrics.defrag_members_seen(&outcome.observed);
                observed = outcome.observed;
            }
            let started_before = !pass.starting;
            pass.starting = false;
            if !matches!(outcome.step, DefragStep::Stopped { .. }) {
                waiting_since = None;
            }
            match outcome.step {
                DefragStep::Defragmented {
                    member,
                    leader,
                    db_size_before,
                    db_size_after,
                    took,
                } => {
                    self.metrics.defragmented(true, took.as_secs_f64());
                    self.metrics.defrag_member();
                    tracing::info!(
                        member = format_args!("{member:x}"),
                        leader = format_args!("{leader:x}"),
                        db_size_before,
                        db_size_after,
                        seconds = took.as_secs_f64(),
                        "member defragmented"
                    );
                    pass.done.push(member);
                    events.push(DefragEvent::Defragmented { member, leader });
                }
                DefragStep::MovedLeader { from, to } => {
                    self.metrics.defrag_leader_moved();
                    tracing::info!(
                        from = format_args!("{from:x}"),
                        to = format_args!("{to:x}"),
                        "leadership moved"
                    );
                    pass.moves += 1;
                    events.push(DefragEvent::MovedLeader { from, to });
                }
                DefragStep::LeaderMoved => pass.moves += 1,
                DefragStep::Done => break,
                DefragStep::Stopped { reason, detail }
                    if started_before
                        && reason.transient()
                        && waiting_since.get_or_insert_with(Instant::now).elapsed()
                            < super::defrag::ELECTION_GRACE =>
                {
                    tracing::info!(reason = reason.label(), %detail, "waiting for the cluster to settle (an election) before the next step");
                    drop(_in);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                DefragStep::Stopped { reason, detail } => {
                    let left = observed
                        .iter()
                        .filter(|m| !pass.done.contains(&m.id) && rule.wants(m))
                        .count();
                    // A stop before anything was looked at still counts: nothing was done.
                    self.metrics.defrag_skipped(reason.label(), left.max(1));
                    self.metrics.defrag_pass("stopped");
                    tracing::warn!(reason = reason.label(), %detail, done = ?pass.done, "defragmentation stopped");
                    let msg = format!("defragmentation stopped: {detail}");
                    self.publish(|s| s.last_error = Some(msg));
                    return Err(ActorError::Unhealthy {
                        reason: detail,
                        done: pass.done,
                    });
                }
            }
        }
        let below = observed
            .iter()
            .filter(|m| !pass.done.contains(&m.id) && !rule.wants(m))
            .count();
        self.metrics.defrag_skipped("below_threshold", below);
        let done = pass.done;
        if done.is_empty() {
            self.metrics.defrag_pass("idle");
            return Ok(DefragReport {
                defragmented: done,
                events,
                snapshot: None,
            });
        }
        self.metrics.defrag_pass("done");
        // The reference follows a defragmentation with a full snapshot: a fresh base, taken
        // from the compacted database. Only while this member still leads: after a move the
        // new leader's sidecar owns the store's chain.
        let still_leads = match self.engine.membership().await {
            Ok(m) => m.leader,
            Err(e) => {
                tracing::warn!(error = %e, "leader check after defragmentation failed");
                false
            }
        };
        if !still_leads {
            drop(span);
            self.leader = false;
            self.saw_other_leader = true;
            self.metrics.set_leader(false);
            self.on_activity_change().await;
            tracing::info!(members = ?done, "defragmentation done; leadership moved, so the new leader's sidecar takes the next full snapshot");
            return Ok(DefragReport {
                defragmented: done,
                events,
                snapshot: None,
            });
        }
        drop(span);
        let snap = self.full(Operation::Regular, FullKind::Regular).await?;
        Ok(DefragReport {
            defragmented: done,
            events,
            snapshot: Some(snap),
        })
    }

    /// Refusal of regular work: by the gate, or because another sidecar's member leads.
    fn refused_regular(&self) -> ActorError {
        let gate = *self.gate.borrow();
        if !gate.allows(Operation::Regular) {
            return self.refused(Operation::Regular);
        }
        ActorError::Refused {
            gate,
            reason: "this sidecar's member does not lead the raft group; the leader's sidecar defragments",
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
            None => {
                self.store_changed();
                tracing::info!("retention pass dropped: ownership changed while it ran")
            }
            Some(Ok(report)) => {
                if !(report.deleted.is_empty() && report.failed.is_empty()) {
                    self.store_changed();
                }
                self.metrics.gc(&report)
            }
            Some(Err(e)) => {
                self.store_changed();
                tracing::warn!(error = %e, "retention failed; will retry")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use prometheus_client::registry::Registry;

    use crate::store::Codec;

    /// An engine whose etcd (and store) may hang: while `hang` is set, a full snapshot and a
    /// delta never finish, as when etcd stops answering in the middle of its stream.
    struct HangingEtcd {
        hang: Arc<AtomicBool>,
        buffered: Arc<AtomicU64>,
        revision: i64,
        defrag_steps: Arc<AtomicU64>,
        /// Whether its member leads (the leadership check's answer).
        leads: Arc<AtomicBool>,
        /// A file created once a member is defragmented (an operator flipping the kill switch).
        switch: Option<std::path::PathBuf>,
    }

    impl HangingEtcd {
        /// An engine at revision 10 whose streams hang while `hang` is set.
        fn new(hang: bool) -> Self {
            HangingEtcd {
                hang: Arc::new(AtomicBool::new(hang)),
                buffered: Arc::new(AtomicU64::new(0)),
                revision: 10,
                defrag_steps: Arc::new(AtomicU64::new(0)),
                leads: Arc::new(AtomicBool::new(true)),
                switch: None,
            }
        }

        async fn maybe_hang(&self) {
            if self.hang.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
        }
    }

    #[async_trait]
    impl Engine for HangingEtcd {
        async fn full(&mut self, kind: &FullKind) -> Result<Stored, EngineError> {
            let is_final = matches!(kind, FullKind::Final { .. } | FullKind::RequestedFinal);
            self.maybe_hang().await;
            self.revision += 1;
            Ok(Stored {
                snapshot: Snapshot::new(
                    "",
                    Kind::Full,
                    0,
                    self.revision,
                    Utc::now(),
                    Codec::None,
                    is_final,
                ),
                bytes: 4096,
            })
        }
        async fn collect(&mut self) -> Result<Collected, EngineError> {
            std::future::pending().await
        }
        fn buffered_bytes(&self) -> u64 {
            self.buffered.load(Ordering::SeqCst)
        }
        async fn flush_delta(&mut self) -> Result<Option<Stored>, EngineError> {
            // Nothing buffered: nothing to write, etcd and the store are not asked.
            if self.buffered.load(Ordering::SeqCst) == 0 {
                return Ok(None);
            }
            self.maybe_hang().await;
            self.buffered.store(0, Ordering::SeqCst);
            self.revision += 1;
            Ok(Some(Stored {
                snapshot: Snapshot::new(
                    "",
                    Kind::Incr,
                    self.revision,
                    self.revision,
                    Utc::now(),
                    Codec::None,
                    false,
                ),
                bytes: 100,
            }))
        }
        async fn resume(&mut self) -> Result<(), EngineError> {
            Ok(())
        }
        fn pause(&mut self) {}
        async fn membership(&mut self) -> Result<Membership, EngineError> {
            Ok(Membership {
                leader: self.leads.load(Ordering::SeqCst),
                learner: false,
                cluster_size: Some(3),
            })
        }
        async fn latest_chain(&mut self) -> Result<Chain, EngineError> {
            // No full snapshot yet: one is due at once.
            Ok(Chain {
                full_snapshot: None,
                delta_snapshots: vec![],
            })
        }
        async fn gc(&mut self, _now: DateTime<Utc>) -> Result<GcReport, EngineError> {
            Ok(GcReport::default())
        }
        async fn defrag_step(
            &mut self,
            pass: &PassState,
            _rule: Rule,
            _timeout: Duration,
        ) -> Result<StepOutcome, EngineError> {
            self.defrag_steps.fetch_add(1, Ordering::SeqCst);
            self.maybe_hang().await;
            if pass.disabled {
                return Ok(StepOutcome {
                    observed: vec![],
                    step: DefragStep::Stopped {
                        reason: StopReason::Disabled,
                        detail: "the kill switch is on".into(),
                    },
                });
            }
            // Flipped while the first member's defragmentation runs.
            if let (Some(switch), true) = (&self.switch, pass.done.is_empty()) {
                std::fs::write(switch, "").unwrap();
            }
            // Followers 2 and 3, then the leader 1, as the plan orders them.
            let step = match [2, 3, 1].into_iter().find(|m| !pass.done.contains(m)) {
                Some(member) => DefragStep::Defragmented {
                    member,
                    leader: 1,
                    db_size_before: 100,
                    db_size_after: Some(10),
                    took: Duration::from_millis(1),
                },
                None => DefragStep::Done,
            };
            Ok(StepOutcome {
                observed: vec![],
                step,
            })
        }
    }

    fn render(reg: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, reg).unwrap();
        out
    }

    fn assert_has(reg: &Registry, line: &str) {
        let out = render(reg);
        assert!(out.lines().any(|l| l == line), "no {line:?} in\n{out}");
    }

    fn timed_out(r: Result<impl std::fmt::Debug, ActorError>) {
        match r {
            Err(ActorError::Failed(e)) => {
                assert!(matches!(*e, EngineError::TimedOut { .. }), "{e:?}");
                assert!(e.to_string().contains("snapshot.timeout (200ms)"), "{e}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    fn quiet_config(timeout: Duration) -> ActorConfig {
        ActorConfig {
            schedule: std::str::FromStr::from_str("0 0 1 1 *").unwrap(),
            delta_period: Duration::ZERO,
            delta_memory_limit: u64::MAX,
            gc_period: Duration::from_secs(3600),
            leader_check_interval: Duration::from_millis(20),
            timeout,
            defrag: crate::config::DefragConfig {
                timeout,
                ..Default::default()
            },
        }
    }

    /// Fresh metrics, and the registry they are registered in (what the assertions read).
    fn registered() -> (SnapshotMetrics, Registry) {
        let metrics = SnapshotMetrics::default();
        let mut reg = Registry::default();
        metrics.register(&mut reg);
        (metrics, reg)
    }

    /// Whether the actor's status comes to meet `f` within five seconds.
    async fn status_within_5s(actor: &ActorHandle, f: impl FnMut(&ActorStatus) -> bool) -> bool {
        let mut status = actor.watch_status();
        // `is_ok()` drops the borrow `wait_for` returns: holding it would block the actor.
        tokio::time::timeout(Duration::from_secs(5), status.wait_for(f))
            .await
            .is_ok()
    }

    /// `/snapshot/latest` keeps its answer while this count stands still: it must grow with
    /// every snapshot stored (the hand-off's final too) before the actor answers for it, and not
    /// for a delta that had nothing to write.
    #[tokio::test]
    async fn store_changes_grows_before_a_stored_snapshot_is_answered() {
        let engine = HangingEtcd::new(false);
        let buffered = engine.buffered.clone();
        let mut config = quiet_config(Duration::from_secs(5));
        config.delta_period = Duration::from_secs(3600);
        let (gate, gate_rx) = watch::channel(Gate::Open);
        let cancel = CancellationToken::new();
        let (actor, task) = spawn(
            engine,
            config,
            gate_rx,
            SnapshotMetrics::default(),
            cancel.clone(),
        );
        // The first full snapshot is due at once (the store has none), then deltas are taken.
        assert!(status_within_5s(&actor, |s| s.last_full.is_some()).await);
        let start = Instant::now();
        while let Err(ActorError::NoDeltas) = actor.delta().await {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "deltas never started"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let at_start = actor.store_changes();
        assert!(at_start >= 1, "the first full snapshot counts");

        assert_eq!(actor.delta().await.unwrap(), None);
        assert_eq!(actor.store_changes(), at_start, "nothing was written");
        buffered.store(5, Ordering::SeqCst);
        assert!(actor.delta().await.unwrap().is_some());
        assert_eq!(actor.store_changes(), at_start + 1);
        actor.full().await.unwrap();
        assert_eq!(actor.store_changes(), at_start + 2);

        gate.send_replace(Gate::Final);
        let name = Snapshot::new("", Kind::Full, 0, 30, Utc::now(), Codec::None, true);
        let stored = actor.final_snapshot(name, 0).await.unwrap();
        assert!(stored.is_final);
        assert_eq!(actor.store_changes(), at_start + 3);

        cancel.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn defragmentation_only_while_the_gate_is_open_and_cancelled_when_it_changes() {
        let engine = HangingEtcd::new(false);
        let (hang, steps) = (engine.hang.clone(), engine.defrag_steps.clone());
        let (metrics, reg) = registered();
        let (gate, gate_rx) = watch::channel(Gate::Closed);
        let cancel = CancellationToken::new();
        let (actor, task) = spawn(
            engine,
            quiet_config(Duration::from_secs(5)),
            gate_rx,
            metrics,
            cancel.clone(),
        );
        let _ = status_within_5s(&actor, |s| s.leader).await;

        // Not Active (no verdict yet, then deactivated): refused, nothing defragmented.
        for g in [Gate::Closed, Gate::Final] {
            gate.send_replace(g);
            match actor.defrag().await {
                Err(ActorError::Refused { gate: got, .. }) => assert_eq!(got, g),
                other => panic!("{g:?}: expected a refusal, got {other:?}"),
            }
        }
        assert_has(
            &reg,
            r#"etcdbr_defragmentation_duration_seconds_count{succeeded="true"} 0"#,
        );

        // Open: every member in the plan's order, then a full snapshot.
        gate.send_replace(Gate::Open);
        let report = actor.defrag().await.unwrap();
        assert_eq!(report.defragmented, vec![2, 3, 1]);
        assert_eq!(report.snapshot.map(|s| s.kind), Some(Kind::Full));
        assert_has(
            &reg,
            r#"etcdbr_defragmentation_duration_seconds_count{succeeded="true"} 3"#,
        );

        // The gate closes while a member's defragmentation hangs: the pass is dropped at once.
        hang.store(true, Ordering::SeqCst);
        let before = steps.load(Ordering::SeqCst);
        let pass = tokio::spawn({
            let actor = actor.clone();
            async move { actor.defrag().await }
        });
        // Closed only once a member's defragmentation hangs (a fixed sleep lost that race on a
        // loaded machine: the pass had not started, and the closed gate refused it instead).
        tokio::time::timeout(Duration::from_secs(10), async {
            while steps.load(Ordering::SeqCst) == before {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the pass reaches a member");
        gate.send_replace(Gate::Closed);
        let r = tokio::time::timeout(Duration::from_secs(2), pass)
            .await
            .expect("the pass ends when the gate closes")
            .unwrap();
        assert!(matches!(r, Err(ActorError::Cancelled)), "{r:?}");
        assert_has(
            &reg,
            r#"etcdbr_defragmentation_duration_seconds_count{succeeded="false"} 1"#,
        );

        cancel.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn scheduled_defragmentation_runs_only_while_active() {
        let engine = HangingEtcd::new(false);
        let steps = engine.defrag_steps.clone();
        let mut config = quiet_config(Duration::from_secs(5));
        // Every second (croner reads a sixth, leading field as seconds when asked to).
        config.defrag.schedule = Some(
            croner::parser::CronParser::builder()
                .seconds(croner::parser::Seconds::Optional)
                .build()
                .parse("* * * * * *")
                .unwrap(),
        );
        let (gate, gate_rx) = watch::channel(Gate::Closed);
        let cancel = CancellationToken::new();
        let metrics = SnapshotMetrics::default();
        let (actor, task) = spawn(engine, config, gate_rx, metrics, cancel.clone());

        // Not Active: the schedule never fires, nothing is due.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(steps.load(Ordering::SeqCst), 0);
        assert_eq!(actor.status().next_defrag_at, None);

        // Active: a pass within a couple of seconds (three members and the final "done").
        gate.send_replace(Gate::Open);
        let due = status_within_5s(&actor, |s| s.next_defrag_at.is_some()).await;
        assert!(due, "{:?}", actor.status());
        let started = Instant::now();
        while steps.load(Ordering::SeqCst) < 4 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "no scheduled pass"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // Deactivated: no further pass.
        gate.send_replace(Gate::Final);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = steps.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(steps.load(Ordering::SeqCst), after);
        assert_eq!(actor.status().next_defrag_at, None);

        cancel.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn the_kill_switch_is_looked_for_before_every_member() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no-defrag");
        let mut engine = HangingEtcd::new(false);
        engine.switch = Some(path.clone());
        let mut config = quiet_config(Duration::from_secs(5));
        config.defrag.disable_file = Some(path.clone());
        let (_gate, gate_rx) = watch::channel(Gate::Open);
        let cancel = CancellationToken::new();
        let (metrics, reg) = registered();
        let (actor, task) = spawn(engine, config, gate_rx, metrics, cancel.clone());
        assert!(status_within_5s(&actor, |s| s.leader).await);

        // Flipped on while the pass runs (after its first member): the rest waits.
        match actor.defrag().await {
            Err(ActorError::Unhealthy { reason, done }) => {
                assert!(reason.contains("kill switch"), "{reason}");
                assert_eq!(done, vec![2]);
            }
            other => panic!("expected the kill switch to stop the pass, got {other:?}"),
        }
        assert_has(
            &reg,
            r#"etcd_warden_defrag_passes_total{result="stopped"} 1"#,
        );
        assert_has(&reg, "etcd_warden_defrag_members_defragmented_total 1");
        assert_has(
            &reg,
            r#"etcd_warden_defrag_members_skipped_total{reason="disabled"} 1"#,
        );
        // The switch is the file itself: removed, it is off.
        assert!(kill_switch_on(Some(&path)).await);
        std::fs::remove_file(&path).unwrap();
        assert!(!kill_switch_on(Some(&path)).await);
        assert!(!kill_switch_on(None).await);
        cancel.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn a_sidecar_that_takes_leadership_from_another_holds_off_automatic_passes() {
        for (leads_at_start, passes) in [(true, true), (false, false)] {
            let engine = HangingEtcd::new(false);
            let (steps, leads) = (engine.defrag_steps.clone(), engine.leads.clone());
            leads.store(leads_at_start, Ordering::SeqCst);
            let mut config = quiet_config(Duration::from_secs(5));
            config.defrag.check_interval = Some(Duration::from_millis(50));
            let (_gate, gate_rx) = watch::channel(Gate::Open);
            let cancel = CancellationToken::new();
            let (metrics, _reg) = registered();
            let (actor, task) = spawn(engine, config, gate_rx, metrics, cancel.clone());
            tokio::time::sleep(Duration::from_millis(200)).await;
            // Taken from another member: its sidecar may still be running a pass.
            leads.store(true, Ordering::SeqCst);
            assert!(status_within_5s(&actor, |s| s.leader).await);
            tokio::time::sleep(Duration::from_millis(500)).await;
            let ran = steps.load(Ordering::SeqCst) > 0;
            assert_eq!(ran, passes, "leading at the start: {leads_at_start}");
            // A requested pass is the operator's call: not held off.
            if !passes {
                assert_eq!(actor.defrag().await.unwrap().defragmented, vec![2, 3, 1]);
            }
            cancel.cancel();
            task.await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_hung_etcd_stream_times_out_and_the_actor_takes_the_next_command() {
        let engine = HangingEtcd::new(true);
        let (hang, buffered) = (engine.hang.clone(), engine.buffered.clone());
        let (metrics, reg) = registered();
        let config = ActorConfig {
            schedule: std::str::FromStr::from_str("0 0 1 1 *").unwrap(),
            delta_period: Duration::from_secs(3600),
            delta_memory_limit: u64::MAX,
            gc_period: Duration::from_secs(3600),
            leader_check_interval: Duration::from_millis(20),
            timeout: Duration::from_millis(200),
            defrag: crate::config::DefragConfig {
                timeout: Duration::from_secs(60),
                ..Default::default()
            },
        };
        let (_gate, gate_rx) = watch::channel(Gate::Open);
        let cancel = CancellationToken::new();
        let (actor, task) = spawn(engine, config, gate_rx, metrics, cancel.clone());

        // The first full snapshot is due at once (empty store) and hangs: it times out, counts
        // as a failure, and stays required.
        let failed = status_within_5s(&actor, |s| s.last_error.is_some()).await;
        assert!(failed, "{:?}", actor.status());
        let error = actor.status().last_error.unwrap_or_default();
        assert!(error.contains("snapshot.timeout"), "{error}");
        assert_has(&reg, r#"etcdbr_snapshot_required{kind="Full"} 1"#);
        assert_has(&reg, r#"etcdbr_snapshotter_failure{error="timeout"} 1"#);
        assert_has(
            &reg,
            r#"etcdbr_snapshot_duration_seconds_count{kind="Full",succeeded="false"} 1"#,
        );
        assert_has(&reg, "etcdbr_cluster_size 3");
        assert_has(&reg, "etcdbr_is_learner 0");

        // Requested snapshots while etcd still hangs: each one is answered with the timeout.
        buffered.store(1, Ordering::SeqCst);
        let started = Instant::now();
        timed_out(actor.full().await);
        timed_out(actor.delta().await);
        assert!(started.elapsed() < Duration::from_secs(3));
        assert_has(&reg, r#"etcdbr_snapshotter_failure{error="timeout"} 3"#);
        assert_has(
            &reg,
            r#"etcdbr_snapshot_duration_seconds_count{kind="Incr",succeeded="false"} 1"#,
        );

        // etcd answers again: the next commands succeed.
        hang.store(false, Ordering::SeqCst);
        let full = actor.full().await.unwrap();
        assert_eq!(full.kind, Kind::Full);
        assert_has(&reg, r#"etcdbr_snapshot_required{kind="Full"} 0"#);
        // An event is still buffered after the full snapshot's revision.
        assert_has(&reg, r#"etcdbr_snapshot_required{kind="Incr"} 1"#);
        assert_has(
            &reg,
            r#"etcd_warden_snapshot_latest_size_bytes{kind="Full"} 4096"#,
        );
        // The timed-out delta restarted the watch from the store; once it runs again a delta
        // goes through.
        let delta = loop {
            match actor.delta().await {
                Err(ActorError::NoDeltas) => tokio::time::sleep(Duration::from_millis(10)).await,
                other => break other.unwrap(),
            }
        };
        assert_eq!(delta.map(|d| d.kind), Some(Kind::Incr));
        assert_has(&reg, r#"etcdbr_snapshot_required{kind="Incr"} 0"#);
        assert_has(&reg, "etcdbr_snapstore_latest_deltas_total 1");
        assert_has(&reg, "etcdbr_snapstore_latest_deltas_revisions_total 0");
        assert_has(&reg, r#"etcdbr_snapshotter_failure{error="timeout"} 3"#);
        assert!(buffered.load(Ordering::SeqCst) == 0);

        cancel.cancel();
        task.await.unwrap();
    }
}
