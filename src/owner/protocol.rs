//! The ownership protocol (DESIGN.md "The ownership protocol") as a pure transition function.
//!
//! [`Protocol::step`] maps `(protocol, event)` to `(protocol, actions)` and does no I/O; the
//! watchdog executes the actions in order and feeds their results back as events.
//!
//! | state | readiness | snapshot gate | etcd | final snapshot |
//! |---|---|---|---|---|
//! | Starting | 503 | closed | untouched | no |
//! | Active | 200 if etcd healthy and its process visible | open | serving | never |
//! | Suspended | 503 | closed | killed on entry (verified, retried) | no, so it can come back |
//! | Deactivated | 503 forever | final only | killed on entry (verified, retried) | the hand-off's, once |
//!
//! **Becoming Active** needs three things: an owner verdict, the etcd process visible and
//! signallable (a sidecar that could not kill etcd must never be trusted with it), and, once per
//! process, a start check that this member was not fenced by an earlier hand-off (a restarted
//! sidecar whose member was handed off stays handed off until an operator reclaims it).
//!
//! **Entering Deactivated** runs, in this order and in the same step as the verdict: readiness 503,
//! the snapshot gate set to "final only" (the actor drops whatever it was doing; nothing waits for
//! it), kill etcd. Then:
//! 1. the kill must be **verified** (the process that was serving is gone); a failed kill (none
//!    found, no permission, still alive) is retried every `kill_retry` and nothing else happens;
//! 2. unless `settle` is zero, **kill again**: once `settle` has passed since readiness went 503,
//!    etcd is killed a second time, verified like the first (the processes the first kill stopped
//!    count as found, so nothing restarted verifies by their absence). The kubelet restarts etcd
//!    within seconds while the pod may still be in the Service's endpoints; a client connecting to
//!    the restarted etcd then keeps its connection after the endpoint is removed, and its writes
//!    after the frozen revision would be acknowledged but missing from the final. After `settle`
//!    no new connection reaches this member, so the second kill ends the last ones;
//! 3. this member's **fence marker** goes to the store (retried with backoff);
//! 4. once etcd answers again, the **hand-off check** reads the cluster (members, fence markers,
//!    finals, the hand-off record, the intent, the claims) and `handoff::decide` answers. The take
//!    phase is this table's, one store or etcd call per action, each answered by an event:
//!
//!    | check answers | action | its event | then |
//!    |---|---|---|---|
//!    | NeedRevision (all fenced, no intent) | ReadRevision | RevisionRead | check again with it |
//!    | Claim { epoch } (we take, or take over) | CreateClaim (if absent) | Claimed | check again |
//!    | FixIntent { revision } (we hold the newest claim) | CreateIntent (if absent) | IntentCreated | check again |
//!    | Take { min_revision } (the intent names the final) | TakeFinal | FinalStored | WriteRecord |
//!    | Stored (a final is stored, not recorded) | WriteRecord | Recorded | Done |
//!    | Done (stored and recorded) | none | | Done |
//!    | Wait (members unfenced, another member takes it) | ScheduleRetry (`kill_retry`) | RetryDue | check |
//!    | Failed | ScheduleRetry (backoff) | RetryDue | check |
//!
//!    A failed call backs off and checks again from the start (the revision read is forgotten);
//!    a check that still writes a claim or an intent after five views backs off as Unsettled (the
//!    store does not keep what it is given). A check never writes more than one object per view;
//! 5. a failed **take** goes back to the check too, so an upload that succeeded although its caller
//!    saw an error is found instead of repeated, and the record is written then.
//!
//! Events that make no sense in the current state (a result nobody asked for) are ignored, so the
//! watchdog never has to filter them.

use std::fmt;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::snapshot::gate::Gate;

pub use super::resolve::Verdict;

/// The answer of [`Action::CheckStart`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StartCheck {
    /// No earlier hand-off fenced this member: it may become Active.
    Clear,
    /// An earlier hand-off fenced this member (its marker is in the store, or the store's latest
    /// full snapshot is a final at or after etcd's revision): it stays handed off.
    Fenced,
    /// The store or etcd could not be asked; asked again after `kill_retry` or at the next owner
    /// verdict, whichever comes first.
    Failed,
}

/// The answer of [`Action::CheckHandOff`] (decided by `handoff::decide`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandOff {
    /// Every member is fenced, a final of this hand-off is stored and the hand-off record names it.
    Done,
    /// Every member is fenced and a final of this hand-off is stored, but the hand-off record does
    /// not name it yet: write the record.
    Stored,
    /// Every member is fenced and no intent fixes the final yet: read etcd's revision.
    NeedRevision,
    /// This member takes the final (or takes it over) and claims `epoch` first.
    Claim {
        /// The epoch to claim.
        epoch: u32,
    },
    /// This member holds the newest claim: fix the final's identity at `revision`.
    FixIntent {
        /// The frozen revision.
        revision: i64,
    },
    /// Every member is fenced, no final counts yet, and this member takes the one the intent
    /// names: its revision must be at least `min_revision` (the intent's).
    Take {
        /// The revision the final must reach.
        min_revision: i64,
    },
    /// Members are not all fenced yet, or another member takes the final and has not stored it.
    Wait,
    /// etcd or the store could not be asked.
    Failed,
}

/// Something the watchdog observed, or the result of an action it executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// An owner check concluded.
    Verdict(Verdict),
    /// An etcd health check answered healthy (`true`) or failed (`false`).
    EtcdHealth(bool),
    /// The etcd process is visible in the PID namespace and may be signalled (`true`), or not.
    EtcdProcess(bool),
    /// The answer to [`Action::CheckStart`].
    StartChecked(StartCheck),
    /// The [`Action::KillEtcd`] finished: `true` when verified (every etcd process that was
    /// serving is gone), `false` when not (none found, no permission, still alive).
    Killed(bool),
    /// The answer to [`Action::WriteFence`]: stored or not.
    Fenced(bool),
    /// The answer to [`Action::CheckHandOff`].
    HandOff(HandOff),
    /// The answer to [`Action::ReadRevision`]: the revision, or `None` when etcd did not answer.
    RevisionRead(Option<i64>),
    /// The answer to [`Action::CreateClaim`]: created or already there (`true`), or the store
    /// failed (`false`).
    Claimed(bool),
    /// The answer to [`Action::CreateIntent`]: created or already there (`true`), or the store
    /// failed (`false`).
    IntentCreated(bool),
    /// The final snapshot of [`Action::TakeFinal`] is stored (`true`) or failed (`false`).
    FinalStored(bool),
    /// The answer to [`Action::WriteRecord`]: the hand-off record is stored (`true`) or not.
    Recorded(bool),
    /// The delay of an [`Action::ScheduleRetry`] has passed.
    RetryDue,
}

/// Something the watchdog must do, in the order given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Make `/healthz` answer 200 (`true`) or 503 (`false`).
    SetReady(bool),
    /// Set what the snapshot actor may do; never waits for it.
    SetGate(Gate),
    /// SIGTERM etcd, SIGKILL after the grace, verify it is gone; report [`Event::Killed`].
    KillEtcd,
    /// Ask whether an earlier hand-off fenced this member; report [`Event::StartChecked`].
    CheckStart,
    /// Store this member's fence marker; report [`Event::Fenced`].
    WriteFence,
    /// Read the cluster (members, fence markers, finals, the hand-off record, the intent, the
    /// claims) and decide; report [`Event::HandOff`].
    CheckHandOff {
        /// etcd's revision as read earlier in this check, if it was.
        revision: Option<i64>,
    },
    /// Read etcd's revision linearizably; report [`Event::RevisionRead`].
    ReadRevision,
    /// Create this member's claim of `epoch` unless one is there; report [`Event::Claimed`].
    CreateClaim {
        /// The epoch claimed.
        epoch: u32,
    },
    /// Create the final's intent at `revision` unless one is there; report
    /// [`Event::IntentCreated`].
    CreateIntent {
        /// The frozen revision the final must hold.
        revision: i64,
    },
    /// Take the final full snapshot the intent names, at `min_revision` or later; report
    /// [`Event::FinalStored`].
    TakeFinal {
        /// The revision the final must reach.
        min_revision: i64,
        /// 1-based count of takes in this process (a higher one follows a failed take).
        attempt: u32,
    },
    /// Report [`Event::RetryDue`] once `settle` has passed since readiness last went 503 (at once
    /// if it already has); replaces a pending retry as [`Action::ScheduleRetry`] does.
    AwaitSettle {
        /// How long after readiness went 503.
        settle: Duration,
    },
    /// Write the hand-off record naming the stored final (the one just taken, or the one the
    /// last check found unrecorded); report [`Event::Recorded`].
    WriteRecord,
    /// Kill etcd again after the settle: every etcd process running now (one the kubelet
    /// restarted) is stopped, and the processes the last verified kill stopped count as found,
    /// so the kill verifies when none was restarted and those stay gone; report [`Event::Killed`].
    KillAgain,
    /// Report [`Event::RetryDue`] after `delay`.
    ScheduleRetry {
        /// How long to wait.
        delay: Duration,
    },
}

/// The ownership state of this sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Not Active yet: no owner verdict, the etcd process not visible, or the start check pending.
    Starting,
    /// We own etcd.
    Active,
    /// The owner record could not be resolved; reversible.
    Suspended(KillStep),
    /// Someone else owns etcd, or nobody does; sticky for the life of the process.
    Deactivated(FinalStep),
}

/// Progress of the kill while Suspended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KillStep {
    /// The kill is running.
    Killing,
    /// The kill was not verified; it is tried again after `kill_retry`.
    Retrying,
    /// etcd was killed and the kill verified.
    Verified,
}

/// Progress of the hand-off while Deactivated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinalStep {
    /// The kill is running.
    Killing,
    /// The kill was not verified; it is tried again after `kill_retry`.
    KillRetry,
    /// Killed and verified; waiting until `settle` has passed since readiness went 503.
    Settling,
    /// The second kill (after the settle) is running.
    KillingAgain,
    /// The second kill was not verified; it is tried again after `kill_retry`.
    KillAgainRetry,
    /// This member's fence marker is being stored.
    Fencing,
    /// Fenced; waiting for etcd to answer a health check again (the kubelet restarts it).
    AwaitingEtcd,
    /// The hand-off check is running.
    Checking,
    /// etcd's revision is being read (every member fenced, no intent yet).
    ReadingRevision,
    /// This member's claim to take the final is being created.
    Claiming,
    /// The final's intent is being created.
    FixingIntent,
    /// Other members are not fenced yet, or another member takes the final: checked again later.
    Waiting,
    /// The final snapshot is being taken.
    Taking,
    /// The hand-off record naming the stored final is being written; then Done with this outcome.
    Recording(FinalOutcome),
    /// A step failed; it is retried after a backoff.
    Backoff(Retry),
    /// A final of this hand-off is in the store; nothing more to do.
    Done(FinalOutcome),
}

/// What a [`FinalStep::Backoff`] retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retry {
    /// Storing the fence marker.
    Fence,
    /// The hand-off check (after a failed check, read, create, take or record write).
    Check,
    /// The hand-off check, after one that still wrote a claim or an intent after five views
    /// (the store does not show what it was given).
    Unsettled,
}

/// How the hand-off's final snapshot came to be in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinalOutcome {
    /// This process took and stored it.
    Taken,
    /// It was already there (taken by another member, an earlier process, or an upload whose
    /// success this process did not see).
    FoundInStore,
}

impl State {
    /// A short stable name for logs, metrics and `/status`.
    pub fn name(&self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Active => "active",
            State::Suspended(_) => "suspended",
            State::Deactivated(_) => "deactivated",
        }
    }

    /// The snapshot gate this state implies.
    pub fn gate(&self) -> Gate {
        match self {
            State::Active => Gate::Open,
            State::Deactivated(_) => Gate::Final,
            State::Starting | State::Suspended(_) => Gate::Closed,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            State::Deactivated(step) => write!(f, "deactivated ({step:?})"),
            State::Suspended(step) => write!(f, "suspended ({step:?})"),
            other => f.write_str(other.name()),
        }
    }
}

/// Where the once-per-process start check stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Start {
    Unchecked,
    Checking,
    /// The last check failed: it runs again only at [`Event::RetryDue`] or the next owner
    /// verdict, so the watchdog returns to its observations in between (a NotOwner verdict must
    /// never wait behind a check that keeps failing).
    Failed,
    Clear,
}

/// The protocol's timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Timing {
    /// Delay before a failed kill is tried again, and between hand-off checks while waiting for
    /// other members (the owner check interval).
    pub kill_retry: Duration,
    /// Delays after failed fence writes, hand-off checks and takes.
    pub backoff: Backoff,
    /// How long after readiness went 503 the hand-off kills etcd a second time before fencing;
    /// zero: no second kill.
    pub settle: Duration,
}

/// The whole ownership state plus what the protocol knows about the world; small and `Copy`, so
/// a transition is a plain function of its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Protocol {
    state: State,
    timing: Timing,
    /// The last verdict was Owner.
    owner: bool,
    etcd_healthy: bool,
    process_visible: bool,
    start: Start,
    ready: bool,
    gate: Gate,
    /// Consecutive failures of the hand-off's fence, check and take steps.
    failures: u32,
    /// Final snapshots requested in this process.
    takes: u32,
    /// etcd's revision as read in the current hand-off check.
    check_revision: Option<i64>,
    /// Views the current hand-off check decided on (1 to [`VIEWS_PER_CHECK`]).
    views: u8,
}

/// How many views one hand-off check decides on before it gives up as Unsettled: claim,
/// revision, intent and take need four.
const VIEWS_PER_CHECK: u8 = 5;

impl Protocol {
    /// The protocol in [`State::Starting`]: not ready, gate closed, nothing known.
    pub fn new(timing: Timing) -> Self {
        Protocol {
            state: State::Starting,
            timing,
            owner: false,
            etcd_healthy: false,
            process_visible: false,
            start: Start::Unchecked,
            ready: false,
            gate: Gate::Closed,
            failures: 0,
            takes: 0,
            check_revision: None,
            views: 0,
        }
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Whether readiness is 200 after the actions emitted so far.
    pub fn ready(&self) -> bool {
        self.ready
    }

    /// The snapshot gate after the actions emitted so far.
    pub fn gate(&self) -> Gate {
        self.gate
    }

    /// Whether the hand-off's final snapshot is in the store (taken here or found there).
    pub fn final_in_store(&self) -> bool {
        matches!(self.state, State::Deactivated(FinalStep::Done(_)))
    }

    /// Why the sidecar is where it is, in words, for `/status`, readiness and logs. The watchdog
    /// adds the details it knows (the last error, the members still serving).
    pub fn reason(&self) -> &'static str {
        match self.state {
            State::Starting if !self.owner => "waiting for an owner verdict naming this seed",
            State::Starting if !self.process_visible => {
                "owner, but the etcd process is not visible or may not be signalled"
            }
            State::Starting => "owner; checking the store for an earlier hand-off of this member",
            State::Active if !self.process_visible => {
                "owner, but the etcd process is not visible or may not be signalled"
            }
            State::Active if !self.etcd_healthy => "owner, but etcd is not healthy",
            State::Active => "owner, etcd healthy",
            State::Suspended(KillStep::Killing) => "owner record unresolvable; killing etcd",
            State::Suspended(KillStep::Retrying) => {
                "owner record unresolvable; the kill of etcd is not verified yet, retrying"
            }
            State::Suspended(KillStep::Verified) => {
                "owner record unresolvable; etcd killed, waiting for the record to resolve"
            }
            State::Deactivated(step) => match step {
                FinalStep::Killing => "not the owner; killing etcd",
                FinalStep::KillRetry => {
                    "not the owner; the kill of etcd is not verified yet, retrying (no final snapshot until it is)"
                }
                FinalStep::Settling => {
                    "not the owner; etcd killed, waiting for kill.settle to kill it again before fencing"
                }
                FinalStep::KillingAgain => {
                    "not the owner; killing etcd again after kill.settle (a restarted etcd may have taken clients)"
                }
                FinalStep::KillAgainRetry => {
                    "not the owner; the second kill of etcd is not verified yet, retrying (no final snapshot until it is)"
                }
                FinalStep::Fencing => "not the owner; storing this member's fence marker",
                FinalStep::AwaitingEtcd => "not the owner; fenced, waiting for etcd to restart",
                FinalStep::Checking => "not the owner; checking the hand-off",
                FinalStep::ReadingRevision => {
                    "not the owner; every member fenced, reading etcd's revision for the final"
                }
                FinalStep::Claiming => "not the owner; claiming the final snapshot",
                FinalStep::FixingIntent => {
                    "not the owner; fixing the final snapshot's name and revision before its upload"
                }
                FinalStep::Waiting => {
                    "not the owner; waiting for every member to be fenced and the final snapshot"
                }
                FinalStep::Taking => "not the owner; taking the final snapshot",
                FinalStep::Recording(_) => {
                    "not the owner; final snapshot stored, writing the hand-off record"
                }
                FinalStep::Backoff(Retry::Fence) => {
                    "not the owner; storing the fence marker failed, retrying"
                }
                FinalStep::Backoff(Retry::Check) => {
                    "not the owner; the hand-off check or the final snapshot failed, retrying"
                }
                FinalStep::Backoff(Retry::Unsettled) => {
                    "not the owner; the store did not show the hand-off's claim or intent after writing it, retrying"
                }
                FinalStep::Done(FinalOutcome::Taken) => "not the owner; final snapshot stored",
                FinalStep::Done(FinalOutcome::FoundInStore) => {
                    "not the owner; the hand-off's final snapshot is in the store"
                }
            },
        }
    }

    /// The transition function: the next protocol and the actions to execute, in order.
    #[must_use]
    pub fn step(mut self, event: Event) -> (Protocol, Vec<Action>) {
        let mut actions = Vec::new();
        match event {
            Event::EtcdHealth(healthy) => self.etcd_healthy = healthy,
            Event::EtcdProcess(visible) => self.process_visible = visible,
            Event::Verdict(v) => self.owner = v == Verdict::Owner,
            _ => {}
        }
        if self.start == Start::Failed
            && matches!(event, Event::RetryDue | Event::Verdict(Verdict::Owner))
        {
            self.start = Start::Unchecked;
        }
        match (self.state, event) {
            (State::Deactivated(step), event) => self.hand_off(step, event, &mut actions),
            (_, Event::Verdict(Verdict::NotOwner)) => self.deactivate(&mut actions),
            (State::Starting | State::Active, Event::Verdict(Verdict::Unresolvable)) => {
                self.state = State::Suspended(KillStep::Killing);
                self.follow(&mut actions);
                self.kill(&mut actions);
            }
            (_, Event::StartChecked(check)) if self.start == Start::Checking => match check {
                StartCheck::Clear => self.start = Start::Clear,
                StartCheck::Failed => {
                    self.start = Start::Failed;
                    actions.push(Action::ScheduleRetry {
                        delay: self.timing.kill_retry,
                    });
                }
                StartCheck::Fenced => {
                    self.start = Start::Unchecked;
                    self.deactivate(&mut actions);
                }
            },
            (State::Suspended(step), event) => {
                let next = match (step, event) {
                    (KillStep::Killing, Event::Killed(true)) => KillStep::Verified,
                    (KillStep::Killing, Event::Killed(false)) => {
                        actions.push(Action::ScheduleRetry {
                            delay: self.timing.kill_retry,
                        });
                        KillStep::Retrying
                    }
                    (KillStep::Retrying, Event::RetryDue) => {
                        self.kill(&mut actions);
                        KillStep::Killing
                    }
                    (step, _) => step,
                };
                self.state = State::Suspended(next);
            }
            _ => {}
        }
        self.try_activate(&mut actions);
        self.follow(&mut actions);
        (self, actions)
    }

    /// Starting or Suspended (with no kill running) becomes Active when every condition holds;
    /// the first time in a process, the start check runs first.
    fn try_activate(&mut self, actions: &mut Vec<Action>) {
        let may = matches!(
            self.state,
            State::Starting | State::Suspended(KillStep::Retrying | KillStep::Verified)
        );
        if !may || !self.owner || !self.process_visible {
            return;
        }
        match self.start {
            Start::Clear => {
                self.state = State::Active;
                self.failures = 0;
            }
            Start::Unchecked if self.state == State::Starting => {
                self.start = Start::Checking;
                actions.push(Action::CheckStart);
            }
            // From Suspended the check runs in Starting's place: go back there to ask.
            Start::Unchecked => {
                self.state = State::Starting;
                self.start = Start::Checking;
                actions.push(Action::CheckStart);
            }
            Start::Checking | Start::Failed => {}
        }
    }

    /// Enter Deactivated: readiness and the gate first so no new client arrives and the actor
    /// drops its work, then the kill, all in this step.
    fn deactivate(&mut self, actions: &mut Vec<Action>) {
        self.state = State::Deactivated(FinalStep::Killing);
        self.follow(actions);
        self.kill(actions);
    }

    fn kill(&mut self, actions: &mut Vec<Action>) {
        // etcd goes down now; only a health check after this counts as "back".
        self.etcd_healthy = false;
        actions.push(Action::KillEtcd);
    }

    fn backoff(&mut self, retry: Retry, actions: &mut Vec<Action>) -> FinalStep {
        self.failures = self.failures.saturating_add(1);
        actions.push(Action::ScheduleRetry {
            delay: self.timing.backoff.delay(self.failures),
        });
        FinalStep::Backoff(retry)
    }

    /// A hand-off check from the start: nothing read yet.
    fn check(&mut self, actions: &mut Vec<Action>) -> FinalStep {
        self.check_revision = None;
        self.views = 1;
        actions.push(Action::CheckHandOff { revision: None });
        FinalStep::Checking
    }

    /// The same check once more, after it read the revision or wrote a claim or the intent: the
    /// next view shows it. After [`VIEWS_PER_CHECK`] views it gives up as Unsettled.
    fn check_again(&mut self, actions: &mut Vec<Action>) -> FinalStep {
        if self.views >= VIEWS_PER_CHECK {
            return self.backoff(Retry::Unsettled, actions);
        }
        self.views += 1;
        actions.push(Action::CheckHandOff {
            revision: self.check_revision,
        });
        FinalStep::Checking
    }

    /// Move the hand-off along; verdicts are ignored because Deactivated is sticky.
    fn hand_off(&mut self, step: FinalStep, event: Event, actions: &mut Vec<Action>) {
        let next = match (step, event) {
            (FinalStep::Killing, Event::Killed(true)) if !self.timing.settle.is_zero() => {
                actions.push(Action::AwaitSettle {
                    settle: self.timing.settle,
                });
                FinalStep::Settling
            }
            // Verified dead: fence, after the second kill or after the first without a settle.
            (FinalStep::Killing | FinalStep::KillingAgain, Event::Killed(true)) => {
                actions.push(Action::WriteFence);
                FinalStep::Fencing
            }
            (FinalStep::Settling | FinalStep::KillAgainRetry, Event::RetryDue) => {
                // etcd goes down again; only a health check after this counts as "back".
                self.etcd_healthy = false;
                actions.push(Action::KillAgain);
                FinalStep::KillingAgain
            }
            (FinalStep::Killing | FinalStep::KillingAgain, Event::Killed(false)) => {
                actions.push(Action::ScheduleRetry {
                    delay: self.timing.kill_retry,
                });
                if step == FinalStep::KillingAgain {
                    FinalStep::KillAgainRetry
                } else {
                    FinalStep::KillRetry
                }
            }
            (FinalStep::KillRetry, Event::RetryDue) => {
                self.kill(actions);
                FinalStep::Killing
            }
            (FinalStep::Fencing, Event::Fenced(true)) => {
                self.failures = 0;
                if self.etcd_healthy {
                    self.check(actions)
                } else {
                    FinalStep::AwaitingEtcd
                }
            }
            (FinalStep::Fencing, Event::Fenced(false)) => self.backoff(Retry::Fence, actions),
            (FinalStep::Backoff(Retry::Fence), Event::RetryDue) => {
                actions.push(Action::WriteFence);
                FinalStep::Fencing
            }
            (FinalStep::AwaitingEtcd, Event::EtcdHealth(true))
            | (
                FinalStep::Waiting | FinalStep::Backoff(Retry::Check | Retry::Unsettled),
                Event::RetryDue,
            ) => self.check(actions),
            (FinalStep::Checking, Event::HandOff(answer)) => match answer {
                HandOff::Done => FinalStep::Done(FinalOutcome::FoundInStore),
                HandOff::Stored => {
                    actions.push(Action::WriteRecord);
                    FinalStep::Recording(FinalOutcome::FoundInStore)
                }
                HandOff::NeedRevision => {
                    actions.push(Action::ReadRevision);
                    FinalStep::ReadingRevision
                }
                HandOff::Claim { epoch } => {
                    actions.push(Action::CreateClaim { epoch });
                    FinalStep::Claiming
                }
                HandOff::FixIntent { revision } => {
                    actions.push(Action::CreateIntent { revision });
                    FinalStep::FixingIntent
                }
                HandOff::Take { min_revision } => {
                    self.takes = self.takes.saturating_add(1);
                    actions.push(Action::TakeFinal {
                        min_revision,
                        attempt: self.takes,
                    });
                    FinalStep::Taking
                }
                HandOff::Wait => {
                    self.failures = 0;
                    actions.push(Action::ScheduleRetry {
                        delay: self.timing.kill_retry,
                    });
                    FinalStep::Waiting
                }
                HandOff::Failed => self.backoff(Retry::Check, actions),
            },
            (FinalStep::ReadingRevision, Event::RevisionRead(Some(revision))) => {
                self.check_revision = Some(revision);
                self.check_again(actions)
            }
            (FinalStep::Claiming, Event::Claimed(true))
            | (FinalStep::FixingIntent, Event::IntentCreated(true)) => self.check_again(actions),
            (FinalStep::ReadingRevision, Event::RevisionRead(None))
            | (FinalStep::Claiming, Event::Claimed(false))
            | (FinalStep::FixingIntent, Event::IntentCreated(false))
            | (FinalStep::Taking, Event::FinalStored(false))
            | (FinalStep::Recording(_), Event::Recorded(false)) => {
                self.backoff(Retry::Check, actions)
            }
            (FinalStep::Taking, Event::FinalStored(true)) => {
                actions.push(Action::WriteRecord);
                FinalStep::Recording(FinalOutcome::Taken)
            }
            (FinalStep::Recording(outcome), Event::Recorded(true)) => FinalStep::Done(outcome),
            (step, _) => step,
        };
        self.state = State::Deactivated(next);
    }

    /// Readiness and the gate follow the state: readiness first when it drops, last when it
    /// rises, so a client is never let in before the gate allows the owner's work.
    fn follow(&mut self, actions: &mut Vec<Action>) {
        let ready = self.state == State::Active && self.etcd_healthy && self.process_visible;
        let gate = self.state.gate();
        if self.ready && !ready {
            self.ready = false;
            actions.push(Action::SetReady(false));
        }
        if self.gate != gate {
            self.gate = gate;
            actions.push(Action::SetGate(gate));
        }
        if !self.ready && ready {
            self.ready = true;
            actions.push(Action::SetReady(true));
        }
    }
}

#[cfg(test)]
mod tests;
