//! The ownership watchdog: looks the owner record up every `interval`, watches etcd's health and
//! process, feeds all of it into the [`Protocol`] and executes its actions through the traits
//! below (the I/O seams: DNS, the etcd process, etcd, the store and snapshot actor, readiness).
//!
//! Three loops run in one task: owner lookups and etcd observations only produce events, and the
//! driver alone steps the protocol and acts, one action at a time in the order given, feeding each
//! result back before anything else. A slow lookup never delays a health observation or the
//! other way round; a kill (up to `kill.grace`) delays only the driver. Observations of etcd's
//! health that started before the last kill finished are dropped: only a check begun afterwards
//! says etcd is back.
//!
//! Wiring: the snapshot gate must start closed when ownership checks are configured (the watchdog
//! opens it in Active), and `/healthz` must start at 503.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::handoff::{FinalIntent, HandOffError, HandOffObjects, Member};
use super::metrics::OwnerMetrics;
use super::protocol::{Action, Event, FinalStep, Protocol, Retry, State, Timing, Verdict};
use super::resolve::{CheckResult, FailureCounter, OwnerLookup};
use crate::backoff::Backoff;
use crate::config::{KillConfig, OwnerConfig};
use crate::health::Health;
use crate::kill::{ProcessControl, ProcessId};
use crate::server::Readiness;
use crate::snapshot::actor::ActorError;
use crate::snapshot::gate::Gate;
use crate::store::{Codec, Snapshot};

mod hand_off;

/// Why a seam call failed; the watchdog logs it, shows it in `/status` and retries.
#[derive(Debug, thiserror::Error)]
pub enum SeamError {
    /// etcd answered with an error.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd could not be reached.
    #[error("etcd unreachable: {0}")]
    EtcdUnreachable(#[from] crate::health::Unreachable),
    /// A call did not finish in time.
    #[error("{what} did not answer within {after:?}")]
    Timeout {
        /// What was asked.
        what: &'static str,
        /// The limit.
        after: Duration,
    },
    /// etcd has not told its member ID yet (it has not answered a status request).
    #[error("etcd's member ID is not known yet ({0})")]
    NoMemberId(String),
    /// The store's hand-off objects could not be read or written.
    #[error("store: {0}")]
    HandOff(#[from] HandOffError),
    /// The snapshot actor refused or failed.
    #[error("snapshot: {0}")]
    Snapshot(#[from] ActorError),
}

/// etcd as the watchdog sees it.
#[async_trait::async_trait]
pub trait EtcdView: Send + Sync {
    /// One health check of this sidecar's member (also tells its member ID).
    async fn health(&self) -> Health;
    /// The cluster's members.
    async fn members(&self) -> Result<Vec<Member>, SeamError>;
    /// The cluster's revision, read linearizably (through the leader).
    async fn revision(&self) -> Result<i64, SeamError>;
    /// This member's ID as its write-ahead log on disk records it, for when etcd does not
    /// answer (a data disk that filled, a crash loop) and the ID was never heard from it;
    /// `None` when there is no data directory to read or it does not read.
    async fn member_on_disk(&self) -> Option<u64> {
        None
    }
}

/// The hand-off's final, taken by the snapshot actor: the one call of the hand-off that is not
/// a read or write of the store's objects (those go straight to [`HandOffObjects`]).
#[async_trait::async_trait]
pub trait FinalTaker: Send + Sync {
    /// Takes the final full snapshot `name` (the intent's), holding at least `min_revision`; an
    /// earlier attempt's object of that name is replaced.
    async fn take_final(&self, name: Snapshot, min_revision: i64) -> Result<Snapshot, SeamError>;
}

#[async_trait::async_trait]
impl FinalTaker for crate::snapshot::actor::ActorHandle {
    async fn take_final(&self, name: Snapshot, min_revision: i64) -> Result<Snapshot, SeamError> {
        Ok(self.final_snapshot(name, min_revision).await?)
    }
}

/// Where readiness goes (what `/healthz` answers).
pub trait ReadinessSink: Send + Sync {
    /// Sets readiness, with the ownership state and a reason for whoever reads the probe body.
    fn set_ready(&self, ready: bool, state: &str, reason: &str);
}

impl ReadinessSink for watch::Sender<Readiness> {
    fn set_ready(&self, ready: bool, state: &str, reason: &str) {
        crate::server::set_readiness(self, ready, state, reason);
    }
}

/// The watchdog's timing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// This seed's owner ID.
    pub owner_id: String,
    /// Time between owner lookups; also the delay before a failed kill is tried again.
    pub interval: Duration,
    /// Consecutive failed lookups before the verdict is "unresolvable".
    pub failure_threshold: u32,
    /// Time between etcd health and process checks.
    pub health_interval: Duration,
    /// Retry delays for the hand-off's steps.
    pub backoff: Backoff,
    /// How long after readiness went 503 the hand-off kills etcd again before fencing (`kill.settle`).
    pub settle: Duration,
    /// How long a fenced member waits for the member taking the final before it takes over
    /// (`owner.takeover_after`, times its rank).
    pub takeover_after: Duration,
}

impl WatchdogConfig {
    /// The timing from the `[owner]` and `[kill]` sections, with a 2 s health poll and a 1 s…30 s
    /// backoff.
    pub fn from_config(owner: &OwnerConfig, kill: &KillConfig) -> Self {
        WatchdogConfig {
            owner_id: owner.id.clone(),
            interval: owner.interval,
            failure_threshold: owner.failure_threshold,
            health_interval: crate::health::INTERVAL,
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            settle: kill.settle,
            takeover_after: owner.takeover_after,
        }
    }
}

/// The kill as `/status` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KillStatus {
    /// Attempts of the current (or last) kill.
    pub attempts: u32,
    /// The last attempt was verified.
    pub verified: bool,
    /// What the last attempt did, per process, or why it failed.
    pub last: String,
}

/// What the watchdog knows, for `/status` and logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchdogStatus {
    /// `starting`, `active`, `suspended` or `deactivated`.
    pub state: String,
    /// The state with its step, e.g. `deactivated (Waiting)`.
    pub detail: String,
    /// Why the sidecar is where it is, in words; never empty.
    pub reason: String,
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
    /// The etcd processes seen (`pid 12 (started at tick 345)`), or why none can be signalled.
    pub etcd_process: Option<String>,
    /// How those processes were told from others of etcd's name (`client port 2379
    /// listener`, or `name only: …`).
    pub etcd_identified_by: Option<String>,
    /// This sidecar's etcd member ID (hex), once etcd told it.
    pub member_id: Option<String>,
    /// The kill of etcd, once one was needed.
    pub kill: Option<KillStatus>,
    /// Members (or the member taking the final) the hand-off waits for.
    pub waiting_for: Vec<String>,
    /// The hand-off's final snapshot, once it is in the store.
    pub final_snapshot: Option<String>,
    /// The last error of a step, cleared by its success.
    pub last_error: Option<String>,
    /// The protocol's state, typed (`state` and `detail` are its words), for the Events.
    #[serde(skip)]
    pub phase: State,
}

impl WatchdogStatus {
    fn new(protocol: &Protocol) -> Self {
        WatchdogStatus {
            state: protocol.state().name().into(),
            detail: protocol.state().to_string(),
            reason: protocol.reason().into(),
            ready: false,
            last_check_at: None,
            last_check: None,
            last_success_at: None,
            consecutive_failures: 0,
            etcd_process: None,
            etcd_identified_by: None,
            member_id: None,
            kill: None,
            waiting_for: Vec::new(),
            final_snapshot: None,
            last_error: None,
            phase: protocol.state(),
        }
    }
}

/// What the watchdog acts through.
#[derive(Clone)]
pub struct Context {
    /// Owner record lookups.
    pub lookup: Arc<dyn OwnerLookup>,
    /// Seeing and stopping the etcd process.
    pub process: Arc<dyn ProcessControl>,
    /// etcd's health, members and revision.
    pub etcd: Arc<dyn EtcdView>,
    /// The store's hand-off objects (fence markers, claims, the intent, the record, finals).
    pub objects: HandOffObjects,
    /// The codec a final's name carries.
    pub codec: Codec,
    /// The final snapshot (the snapshot actor).
    pub finals: Arc<dyn FinalTaker>,
    /// `/healthz`.
    pub readiness: Arc<dyn ReadinessSink>,
    /// What the snapshot actor may do.
    pub gate: watch::Sender<Gate>,
}

/// The ownership watchdog; [`Watchdog::run`] drives it until cancelled.
pub struct Watchdog {
    config: WatchdogConfig,
    ctx: Context,
    metrics: OwnerMetrics,
    status: watch::Sender<WatchdogStatus>,
}

/// What the observing loops send the driver.
enum Observation {
    Verdict(Verdict, String),
    Health(Health, Instant),
    Process(Result<Vec<ProcessId>, String>),
}

impl Watchdog {
    /// A watchdog in Starting.
    pub fn new(config: WatchdogConfig, ctx: Context, metrics: OwnerMetrics) -> Self {
        let protocol = Protocol::new(timing(&config));
        let (status, _) = watch::channel(WatchdogStatus::new(&protocol));
        Watchdog {
            config,
            ctx,
            metrics,
            status,
        }
    }

    /// Follows the watchdog's status.
    pub fn status(&self) -> watch::Receiver<WatchdogStatus> {
        self.status.subscribe()
    }

    /// Checks and acts until `cancel` fires; returns the last state.
    pub async fn run(self, cancel: CancellationToken) -> State {
        let Watchdog {
            config,
            ctx,
            metrics,
            status,
        } = self;
        let protocol = Protocol::new(timing(&config));
        ctx.readiness
            .set_ready(false, protocol.state().name(), protocol.reason());
        set_gate(&ctx.gate, protocol.gate());
        let (tx, rx) = mpsc::channel(64);
        let parts = Parts {
            config: &config,
            ctx: &ctx,
            metrics: &metrics,
            status: &status,
        };
        let mut driver = Driver {
            config: &config,
            ctx: &ctx,
            metrics: &metrics,
            status: &status,
            protocol,
            retry_at: None,
            member_id: None,
            kill_targets: Vec::new(),
            killed: Vec::new(),
            kill_done_at: None,
            last_verdict: String::new(),
            intent: None,
            to_record: None,
            taker_seen: None,
            not_ready_since: Instant::now(),
        };
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = lookups(parts, tx.clone()) => {}
            _ = observe_etcd(parts, tx) => {}
            _ = driver.drive(rx) => {}
        }
        driver.protocol.state()
    }
}

/// Sets the gate; receivers are told only of a change.
fn set_gate(tx: &watch::Sender<Gate>, gate: Gate) {
    tx.send_if_modified(|g| std::mem::replace(g, gate) != gate);
}

fn timing(config: &WatchdogConfig) -> Timing {
    Timing {
        kill_retry: config.interval,
        backoff: config.backoff,
        settle: config.settle,
    }
}

/// What the watchdog's loops share.
#[derive(Clone, Copy)]
struct Parts<'a> {
    config: &'a WatchdogConfig,
    ctx: &'a Context,
    metrics: &'a OwnerMetrics,
    status: &'a watch::Sender<WatchdogStatus>,
}

/// A tick every `period`, late ticks delayed rather than bunched.
fn every(period: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick
}

/// Looks the owner record up every interval and sends each verdict.
async fn lookups(parts: Parts<'_>, tx: mpsc::Sender<Observation>) {
    let mut tick = every(parts.config.interval);
    let mut failures = FailureCounter::new(parts.config.failure_threshold);
    let mut last_label = "";
    loop {
        tick.tick().await;
        let span = tracing::info_span!("owner_check", owner_id = %parts.config.owner_id);
        let result = tracing::Instrument::instrument(parts.ctx.lookup.check(), span.clone()).await;
        let verdict = failures.observe(&result);
        let consecutive = failures.consecutive();
        parts.metrics.record_check(&result, consecutive);
        {
            let _in = span.enter();
            match &result {
                CheckResult::Failed(_) => {
                    tracing::warn!(result = %result, consecutive_failures = consecutive, "owner check failed")
                }
                // Each check at debug; a change of answer at info, so the log shows every turn.
                _ if result.label() != last_label => {
                    tracing::info!(result = %result, "owner check")
                }
                _ => tracing::debug!(result = %result, "owner check"),
            }
        }
        last_label = result.label();
        let now = Utc::now();
        parts.status.send_modify(|s| {
            s.last_check_at = Some(now);
            s.last_check = Some(result.to_string());
            s.consecutive_failures = consecutive;
            if result.verdict().is_some() {
                s.last_success_at = Some(now);
            }
        });
        if let Some(v) = verdict
            && tx
                .send(Observation::Verdict(v, result.to_string()))
                .await
                .is_err()
        {
            return;
        }
    }
}

/// Checks etcd's health and process every health interval and sends both.
async fn observe_etcd(parts: Parts<'_>, tx: mpsc::Sender<Observation>) {
    let mut tick = every(parts.config.health_interval);
    loop {
        tick.tick().await;
        let started = Instant::now();
        let health = parts.ctx.etcd.health().await;
        let process = parts.ctx.process.probe().await.map_err(|e| e.to_string());
        parts.metrics.set_process_visible(process.is_ok());
        parts.status.send_modify(|s| {
            s.etcd_process = Some(match &process {
                Ok(found) => found
                    .iter()
                    .map(ProcessId::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                Err(e) => e.clone(),
            });
            s.etcd_identified_by = parts.ctx.process.identified_by();
            if let Some(id) = health.member_id {
                s.member_id = Some(format!("{id:x}"));
            }
        });
        if tx.send(Observation::Health(health, started)).await.is_err()
            || tx.send(Observation::Process(process)).await.is_err()
        {
            return;
        }
    }
}

/// The current taker's ID and the newest claim's epoch.
type TakerSeen = (Option<u64>, Option<u32>);

/// Steps the protocol and executes its actions.
struct Driver<'a> {
    config: &'a WatchdogConfig,
    ctx: &'a Context,
    metrics: &'a OwnerMetrics,
    status: &'a watch::Sender<WatchdogStatus>,
    protocol: Protocol,
    retry_at: Option<Instant>,
    member_id: Option<u64>,
    /// Processes the current kill found so far (a retry verifies them too).
    kill_targets: Vec<ProcessId>,
    /// Processes the last verified kill stopped (for the fence marker).
    killed: Vec<ProcessId>,
    kill_done_at: Option<Instant>,
    last_verdict: String,
    /// The final's intent this member takes (from the last check that said Take).
    intent: Option<FinalIntent>,
    /// The stored final the next [`Action::WriteRecord`] records.
    to_record: Option<hand_off::ToRecord>,
    /// The taker (and newest claim epoch) this member saw once every member was fenced, and
    /// since when: the take-over counts from there.
    taker_seen: Option<(TakerSeen, Instant)>,
    /// When readiness last went 503 (set 503 at start): the settle before the second kill of a
    /// hand-off counts from here, since that is when the Service began to drop this member.
    not_ready_since: Instant,
}

impl Driver<'_> {
    async fn drive(&mut self, mut rx: mpsc::Receiver<Observation>) {
        loop {
            let retry_at = self.retry_at;
            let event = tokio::select! {
                biased;
                _ = async { tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)).await },
                    if retry_at.is_some() => {
                    self.retry_at = None;
                    Some(Event::RetryDue)
                }
                msg = rx.recv() => match msg {
                    None => return,
                    Some(msg) => self.observe(msg),
                },
            };
            if let Some(event) = event {
                self.feed(event).await;
            }
        }
    }

    /// Turns an observation into an event (or drops a stale one).
    fn observe(&mut self, msg: Observation) -> Option<Event> {
        match msg {
            Observation::Verdict(v, text) => {
                self.last_verdict = text;
                Some(Event::Verdict(v))
            }
            Observation::Health(health, started) => {
                if self.kill_done_at.is_some_and(|k| started < k) {
                    return None;
                }
                if let Some(id) = health.member_id {
                    self.member_id = Some(id);
                }
                Some(Event::EtcdHealth(health.healthy))
            }
            Observation::Process(found) => Some(Event::EtcdProcess(found.is_ok())),
        }
    }

    /// Steps the protocol with `event` and every event its actions produce.
    async fn feed(&mut self, event: Event) {
        let mut pending = std::collections::VecDeque::from([event]);
        while let Some(event) = pending.pop_front() {
            let before = self.protocol.state();
            let (protocol, actions) = self.protocol.step(event);
            self.protocol = protocol;
            let after = protocol.state();
            if before != after {
                tracing::info!(owner_id = %self.config.owner_id, from = %before, to = %after, event = ?event, "ownership state changed");
                if after == State::Deactivated(FinalStep::Backoff(Retry::Unsettled)) {
                    let e = HandOffError::Unsettled;
                    tracing::warn!(error = %e, "the hand-off check failed; retrying");
                    self.fail(&format!("hand-off check: store: {e}"));
                }
                self.metrics.set_state(&after);
                // `/status` shows the step while its actions run (the kill, the final's upload),
                // not the step before it; readiness moves only through the actions, in order.
                self.publish_status();
            }
            for action in actions {
                if let Some(next) = self.execute(action).await {
                    pending.push_back(next);
                }
            }
            self.publish();
        }
    }

    /// Status, metrics and readiness's reason after a step.
    fn publish(&self) {
        let p = self.protocol;
        let state = p.state();
        let reason = self.reason();
        self.metrics.set_final_snapshot_taken(p.final_in_store());
        self.ctx
            .readiness
            .set_ready(p.ready(), state.name(), &reason);
        self.publish_status();
    }

    /// `/status`'s state, step and reason.
    fn publish_status(&self) {
        let p = self.protocol;
        let state = p.state();
        let reason = self.reason();
        self.status.send_modify(|s| {
            s.state = state.name().into();
            s.detail = state.to_string();
            s.phase = state;
            s.reason = reason;
            s.ready = p.ready();
        });
    }

    /// The protocol's reason with what the watchdog knows of the cause.
    fn reason(&self) -> String {
        let base = self.protocol.reason();
        let state = self.protocol.state();
        let s = self.status.borrow();
        let detail = if base.contains("not visible") {
            s.etcd_process.clone()
        } else if matches!(state, State::Deactivated(_)) && !s.waiting_for.is_empty() {
            Some(format!("waiting for {}", s.waiting_for.join(", ")))
        } else if state == State::Starting && base.contains("verdict") {
            s.last_check.clone().map(|c| format!("last check: {c}"))
        } else if state != State::Active {
            s.last_error.clone()
        } else {
            None
        };
        match detail {
            Some(d) if !d.is_empty() => format!("{base}: {d}"),
            _ => base.to_string(),
        }
    }

    fn fail(&self, error: &dyn std::fmt::Display) {
        let text = error.to_string();
        self.status.send_modify(|s| s.last_error = Some(text));
    }

    fn succeed(&self) {
        self.status.send_modify(|s| s.last_error = None);
    }

    /// Runs one action; returns the event that reports its result, if it has one.
    async fn execute(&mut self, action: Action) -> Option<Event> {
        match action {
            Action::SetReady(ready) => {
                if !ready && crate::plant::active("ready-late") {
                    // Planted (`crate::plant`): readiness cleared a second late.
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                if !ready {
                    self.not_ready_since = Instant::now();
                }
                let state = self.protocol.state();
                self.ctx
                    .readiness
                    .set_ready(ready, state.name(), &self.reason());
                None
            }
            Action::SetGate(gate) => {
                set_gate(&self.ctx.gate, gate);
                tracing::info!(?gate, "snapshot gate set");
                None
            }
            // Planted (`crate::plant`): etcd reported killed, left serving.
            Action::KillEtcd | Action::KillAgain if crate::plant::active("ack-after-kill") => {
                Some(Event::Killed(true))
            }
            Action::KillEtcd => Some(Event::Killed(self.kill(false).await)),
            Action::KillAgain => Some(Event::Killed(self.kill(true).await)),
            Action::AwaitSettle { settle } => {
                let at = (self.not_ready_since + settle).max(Instant::now());
                tracing::info!(settle = ?settle, after = ?at.saturating_duration_since(Instant::now()), "etcd killed; killing it again after kill.settle before fencing (a restarted etcd may still get clients from the Service)");
                self.retry_at = Some(at);
                None
            }
            Action::CheckStart => Some(Event::StartChecked(self.start_check().await)),
            Action::WriteFence => Some(Event::Fenced(self.write_fence().await)),
            Action::CheckHandOff { revision } => {
                Some(Event::HandOff(self.check_hand_off(revision).await))
            }
            Action::ReadRevision => Some(Event::RevisionRead(self.read_revision().await)),
            Action::CreateClaim { epoch } => Some(Event::Claimed(self.create_claim(epoch).await)),
            Action::CreateIntent { revision } => {
                Some(Event::IntentCreated(self.create_intent(revision).await))
            }
            Action::WriteRecord => Some(Event::Recorded(self.write_record().await)),
            Action::TakeFinal {
                min_revision,
                attempt,
            } => Some(Event::FinalStored(
                self.take_final(min_revision, attempt).await,
            )),
            Action::ScheduleRetry { delay } => {
                self.retry_at = Some(Instant::now() + delay);
                None
            }
        }
    }

    /// Kills etcd; true when verified. `again`: the kill after the settle, which counts the
    /// processes the last verified kill stopped as found, so it verifies by their absence when
    /// etcd was not restarted (and the process table could be read), and stops any restarted one.
    async fn kill(&mut self, again: bool) -> bool {
        let attempts = self
            .status
            .borrow()
            .kill
            .as_ref()
            .map_or(0, |k| if k.verified { 0 } else { k.attempts })
            + 1;
        if attempts == 1 {
            self.kill_targets = if again {
                self.killed.clone()
            } else {
                Vec::new()
            };
        }
        let span = tracing::info_span!("kill_etcd", owner_id = %self.config.owner_id, attempt = attempts, again);
        let report = tracing::Instrument::instrument(
            self.ctx.process.kill_etcd(&self.kill_targets),
            span.clone(),
        )
        .await;
        let _in = span.enter();
        let (verified, last) = match report {
            Ok(report) => {
                self.metrics.record_kill(&report);
                for (p, _) in &report.processes {
                    if !self.kill_targets.contains(p) {
                        self.kill_targets.push(*p);
                    }
                }
                match report.failure() {
                    None => {
                        tracing::info!(processes = ?report.processes, "etcd killed and verified gone");
                        self.killed = std::mem::take(&mut self.kill_targets);
                        self.kill_done_at = Some(Instant::now());
                        let last = report
                            .processes
                            .iter()
                            .map(|(p, o)| format!("{p}: {}", o.label()))
                            .collect::<Vec<_>>()
                            .join(", ");
                        (true, last)
                    }
                    Some(why) => {
                        tracing::error!(attempt = attempts, error = %why, "the kill of etcd is not verified; no final snapshot until it is, retrying");
                        (false, why)
                    }
                }
            }
            Err(e) => {
                tracing::error!(attempt = attempts, error = %e, "cannot kill etcd; retrying");
                self.metrics.record_kill_error();
                (false, e.to_string())
            }
        };
        if verified {
            self.succeed();
        } else {
            self.fail(&last);
        }
        self.status.send_modify(|s| {
            s.kill = Some(KillStatus {
                attempts,
                verified,
                last,
            })
        });
        verified
    }

    /// This member's ID: known from a health check, or asked now.
    async fn member(&mut self) -> Result<u64, SeamError> {
        if let Some(id) = self.member_id {
            return Ok(id);
        }
        let health = self.ctx.etcd.health().await;
        match health.member_id {
            Some(id) => {
                self.member_id = Some(id);
                self.status
                    .send_modify(|s| s.member_id = Some(format!("{id:x}")));
                Ok(id)
            }
            None => match self.ctx.etcd.member_on_disk().await {
                // A member whose etcd stays down is still fenced by its own ID: the other
                // members wait for its marker.
                Some(id) => {
                    tracing::info!(member_id = %format!("{id:x}"), detail = %health.detail, "etcd does not answer; its member ID is read from its write-ahead log");
                    self.member_id = Some(id);
                    self.status
                        .send_modify(|s| s.member_id = Some(format!("{id:x}")));
                    Ok(id)
                }
                None => Err(SeamError::NoMemberId(health.detail)),
            },
        }
    }
}
