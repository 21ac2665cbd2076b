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
//! 4. once etcd answers again, the **hand-off check** looks at the cluster: every member fenced?
//!    a final at or after the cluster's revision already stored? are we the member that takes it?
//!    It answers Done, Take (with the revision the final must reach), Wait (poll again after
//!    `kill_retry`) or Failed (backoff);
//! 5. **take the final**; a failure goes back to the check, so an upload that succeeded although
//!    its caller saw an error is found instead of repeated.
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
    /// Every member is fenced and a final at or after the cluster's revision is stored.
    Done,
    /// Every member is fenced, no final counts yet, and this member takes it: its revision must
    /// be at least `min_revision` (the cluster's revision once every member was fenced).
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
    /// The final snapshot of [`Action::TakeFinal`] is stored (`true`) or failed (`false`).
    FinalStored(bool),
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
    /// Look at the cluster's fence markers and finals; report [`Event::HandOff`].
    CheckHandOff,
    /// Take the final full snapshot at `min_revision` or later; report [`Event::FinalStored`].
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
    /// Other members are not fenced yet, or another member takes the final: checked again later.
    Waiting,
    /// The final snapshot is being taken.
    Taking,
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
    /// The hand-off check (after a failed check or a failed take).
    Check,
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
}

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
                FinalStep::Waiting => {
                    "not the owner; waiting for every member to be fenced and the final snapshot"
                }
                FinalStep::Taking => "not the owner; taking the final snapshot",
                FinalStep::Backoff(Retry::Fence) => {
                    "not the owner; storing the fence marker failed, retrying"
                }
                FinalStep::Backoff(Retry::Check) => {
                    "not the owner; the hand-off check or the final snapshot failed, retrying"
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

    fn check(&mut self, actions: &mut Vec<Action>) -> FinalStep {
        actions.push(Action::CheckHandOff);
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
            | (FinalStep::Waiting | FinalStep::Backoff(Retry::Check), Event::RetryDue) => {
                self.check(actions)
            }
            (FinalStep::Checking, Event::HandOff(answer)) => match answer {
                HandOff::Done => FinalStep::Done(FinalOutcome::FoundInStore),
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
            (FinalStep::Taking, Event::FinalStored(true)) => FinalStep::Done(FinalOutcome::Taken),
            (FinalStep::Taking, Event::FinalStored(false)) => self.backoff(Retry::Check, actions),
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
mod tests {
    use super::*;
    use Action::*;
    use Event::{EtcdHealth, EtcdProcess, Fenced, FinalStored, Killed, RetryDue, StartChecked};
    use std::collections::{HashSet, VecDeque};

    const OWNER: Event = Event::Verdict(Verdict::Owner);
    const NOT_OWNER: Event = Event::Verdict(Verdict::NotOwner);
    const UNRESOLVABLE: Event = Event::Verdict(Verdict::Unresolvable);
    const HEALTHY: Event = EtcdHealth(true);
    const VISIBLE: Event = EtcdProcess(true);
    const CLEAR: Event = StartChecked(StartCheck::Clear);
    const TAKE: Event = Event::HandOff(HandOff::Take { min_revision: 42 });
    /// Not owner: killed, settled, killed again, fenced, etcd back, and the check says Take.
    const TO_THE_TAKE: [Event; 7] = [
        NOT_OWNER,
        Killed(true),
        RetryDue,
        Killed(true),
        Fenced(true),
        HEALTHY,
        TAKE,
    ];

    fn timing() -> Timing {
        Timing {
            kill_retry: Duration::from_millis(300),
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(8)),
            settle: SETTLE,
        }
    }

    const SETTLE: Duration = Duration::from_secs(2);

    fn run(events: &[Event]) -> (Protocol, Vec<Action>) {
        run_with(timing(), events)
    }

    fn run_with(timing: Timing, events: &[Event]) -> (Protocol, Vec<Action>) {
        let mut p = Protocol::new(timing);
        let mut all = Vec::new();
        for &e in events {
            let (next, actions) = p.step(e);
            p = next;
            all.extend(actions);
        }
        (p, all)
    }

    fn active() -> Vec<Event> {
        vec![HEALTHY, VISIBLE, OWNER, CLEAR]
    }

    fn with(prefix: Vec<Event>, rest: &[Event]) -> Vec<Event> {
        let mut v = prefix;
        v.extend_from_slice(rest);
        v
    }

    #[test]
    fn owner_with_a_visible_healthy_etcd_becomes_active_after_the_start_check() {
        let (p, actions) = run(&active());
        assert_eq!(p.state(), State::Active);
        assert_eq!(
            actions,
            vec![CheckStart, SetGate(Gate::Open), SetReady(true)]
        );
    }

    #[test]
    fn no_active_while_the_etcd_process_cannot_be_seen_or_signalled() {
        let (p, actions) = run(&[HEALTHY, EtcdProcess(false), OWNER, OWNER]);
        assert_eq!(p.state(), State::Starting);
        assert!(actions.is_empty(), "{actions:?}");
        assert!(p.reason().contains("not visible"), "{}", p.reason());
        // Seen later: the start check runs, then Active.
        let (p, _) = run(&[HEALTHY, EtcdProcess(false), OWNER, VISIBLE, CLEAR]);
        assert_eq!(p.state(), State::Active);
    }

    #[test]
    fn a_member_fenced_by_an_earlier_hand_off_stays_handed_off() {
        let (p, actions) = run(&[HEALTHY, VISIBLE, OWNER, StartChecked(StartCheck::Fenced)]);
        assert_eq!(p.state(), State::Deactivated(FinalStep::Killing));
        assert_eq!(actions, vec![CheckStart, SetGate(Gate::Final), KillEtcd]);
        assert!(!p.ready());
    }

    #[test]
    fn a_failed_start_check_is_asked_again_at_the_next_verdict() {
        let (p, actions) = run(&[HEALTHY, VISIBLE, OWNER]);
        assert_eq!(actions, vec![CheckStart]);
        // The failure itself asks nothing: it only schedules a retry, so the watchdog goes back
        // to its observations instead of running the check again at once.
        let (p, actions) = p.step(StartChecked(StartCheck::Failed));
        assert_eq!(p.state(), State::Starting);
        assert_eq!(
            actions,
            vec![ScheduleRetry {
                delay: Duration::from_millis(300)
            }]
        );
        // Neither do observations of etcd.
        let (p, actions) = p.step(HEALTHY);
        assert!(actions.is_empty(), "{actions:?}");
        // The next owner verdict asks again.
        let (by_verdict, actions) = p.step(OWNER);
        assert_eq!(by_verdict.state(), State::Starting);
        assert_eq!(actions, vec![CheckStart]);
        // So does the retry, whichever comes first; the other then finds the check running.
        let (by_retry, actions) = p.step(RetryDue);
        assert_eq!(actions, vec![CheckStart]);
        let (_, actions) = by_retry.step(OWNER);
        assert!(actions.is_empty(), "{actions:?}");
    }

    #[test]
    fn a_not_owner_verdict_kills_while_the_start_check_keeps_failing() {
        let (p, _) = run(&[
            HEALTHY,
            VISIBLE,
            OWNER,
            StartChecked(StartCheck::Failed),
            RetryDue,
            StartChecked(StartCheck::Failed),
        ]);
        assert_eq!(p.state(), State::Starting);
        let (p, actions) = p.step(NOT_OWNER);
        assert_eq!(p.state(), State::Deactivated(FinalStep::Killing));
        assert_eq!(actions, vec![SetGate(Gate::Final), KillEtcd]);
    }

    #[test]
    fn losing_ownership_sets_readiness_and_the_gate_then_kills_in_the_same_step() {
        let (p, actions) = run(&with(active(), &[NOT_OWNER]));
        assert_eq!(p.state(), State::Deactivated(FinalStep::Killing));
        assert_eq!(
            &actions[3..],
            &[SetReady(false), SetGate(Gate::Final), KillEtcd]
        );
    }

    #[test]
    fn an_unverified_kill_is_retried_and_nothing_else_happens() {
        let (p, actions) = run(&with(
            active(),
            &[
                NOT_OWNER,
                Killed(false),
                HEALTHY,
                RetryDue,
                Killed(false),
                RetryDue,
            ],
        ));
        assert_eq!(p.state(), State::Deactivated(FinalStep::Killing));
        let after: Vec<_> = actions[3..].to_vec();
        assert_eq!(
            after,
            vec![
                SetReady(false),
                SetGate(Gate::Final),
                KillEtcd,
                ScheduleRetry {
                    delay: Duration::from_millis(300)
                },
                KillEtcd,
                ScheduleRetry {
                    delay: Duration::from_millis(300)
                },
                KillEtcd,
            ]
        );
    }

    #[test]
    fn the_whole_hand_off_of_the_member_that_takes_the_final() {
        let (p, actions) = run(&[&active()[..], &TO_THE_TAKE, &[FinalStored(true)]].concat());
        assert_eq!(
            p.state(),
            State::Deactivated(FinalStep::Done(FinalOutcome::Taken))
        );
        assert_eq!(
            &actions[3..],
            &[
                SetReady(false),
                SetGate(Gate::Final),
                KillEtcd,
                AwaitSettle { settle: SETTLE },
                KillAgain,
                WriteFence,
                CheckHandOff,
                TakeFinal {
                    min_revision: 42,
                    attempt: 1
                },
            ]
        );
        assert!(p.final_in_store());
    }

    #[test]
    fn etcd_is_killed_again_after_the_settle_before_the_fence() {
        let (p, actions) = run(&[NOT_OWNER, Killed(true)]);
        assert_eq!(p.state(), State::Deactivated(FinalStep::Settling));
        assert_eq!(
            actions,
            vec![
                SetGate(Gate::Final),
                KillEtcd,
                AwaitSettle { settle: SETTLE }
            ]
        );
        // Nothing but the settle's end moves it on: no fence while etcd may have been restarted
        // and taken a client.
        for e in [HEALTHY, Killed(true), Fenced(true), NOT_OWNER, TAKE] {
            let (same, actions) = p.step(e);
            assert_eq!(same.state(), p.state(), "{e:?}");
            assert!(actions.is_empty(), "{e:?}: {actions:?}");
        }
        // The second kill is verified like the first: retried until it is, then the fence.
        let (p, actions) = p.step(RetryDue);
        assert_eq!(actions, vec![KillAgain]);
        let (p, actions) = p.step(Killed(false));
        assert_eq!(p.state(), State::Deactivated(FinalStep::KillAgainRetry));
        assert_eq!(
            actions,
            vec![ScheduleRetry {
                delay: Duration::from_millis(300)
            }]
        );
        let (p, actions) = p.step(Fenced(true));
        assert!(actions.is_empty(), "{actions:?}");
        let (p, actions) = p.step(RetryDue);
        assert_eq!(actions, vec![KillAgain]);
        let (p, actions) = p.step(Killed(true));
        assert_eq!(p.state(), State::Deactivated(FinalStep::Fencing));
        assert_eq!(actions, vec![WriteFence]);
    }

    #[test]
    fn a_zero_settle_fences_right_after_the_first_kill() {
        let timing = Timing {
            settle: Duration::ZERO,
            ..timing()
        };
        let (p, actions) = run_with(timing, &[NOT_OWNER, Killed(true)]);
        assert_eq!(p.state(), State::Deactivated(FinalStep::Fencing));
        assert_eq!(actions, vec![SetGate(Gate::Final), KillEtcd, WriteFence]);
    }

    #[test]
    fn a_member_that_does_not_take_the_final_waits_for_it() {
        let (p, actions) = run(&[
            NOT_OWNER,
            Killed(true),
            RetryDue,
            Killed(true),
            HEALTHY,
            Fenced(true),
            Event::HandOff(HandOff::Wait),
            RetryDue,
            Event::HandOff(HandOff::Done),
        ]);
        assert_eq!(
            p.state(),
            State::Deactivated(FinalStep::Done(FinalOutcome::FoundInStore))
        );
        assert!(!actions.iter().any(|a| matches!(a, TakeFinal { .. })));
    }

    #[test]
    fn a_failed_take_checks_the_store_again_before_another_take() {
        let (p, actions) = run(&with(
            TO_THE_TAKE.to_vec(),
            &[FinalStored(false), RetryDue, Event::HandOff(HandOff::Done)],
        ));
        assert_eq!(
            p.state(),
            State::Deactivated(FinalStep::Done(FinalOutcome::FoundInStore))
        );
        let takes = actions
            .iter()
            .filter(|a| matches!(a, TakeFinal { .. }))
            .count();
        assert_eq!(takes, 1);
    }

    #[test]
    fn unresolvable_suspends_kills_and_resumes_without_a_final() {
        let (p, actions) = run(&with(
            active(),
            &[UNRESOLVABLE, Killed(true), HEALTHY, OWNER],
        ));
        assert_eq!(p.state(), State::Active);
        assert_eq!(
            &actions[3..],
            &[
                SetReady(false),
                SetGate(Gate::Closed),
                KillEtcd,
                SetGate(Gate::Open),
                SetReady(true)
            ]
        );
    }

    #[test]
    fn deactivated_is_sticky() {
        let (p, _) = run(&with(
            active(),
            &[NOT_OWNER, Killed(true), OWNER, CLEAR, OWNER],
        ));
        assert!(matches!(p.state(), State::Deactivated(_)));
        assert!(!p.ready());
    }

    // ---- Exhaustive check: every reachable state, every event. ----

    fn all_events() -> Vec<Event> {
        let mut v = vec![
            OWNER,
            NOT_OWNER,
            UNRESOLVABLE,
            HEALTHY,
            EtcdHealth(false),
            VISIBLE,
            EtcdProcess(false),
            Killed(true),
            Killed(false),
            Fenced(true),
            Fenced(false),
            Event::HandOff(HandOff::Done),
            Event::HandOff(HandOff::Take { min_revision: 7 }),
            TAKE,
            Event::HandOff(HandOff::Wait),
            Event::HandOff(HandOff::Failed),
            FinalStored(true),
            FinalStored(false),
            RetryDue,
        ];
        v.extend([StartCheck::Clear, StartCheck::Fenced, StartCheck::Failed].map(StartChecked));
        v
    }

    /// What an outside observer knows from the events fed and the actions seen, independent of
    /// the protocol's internals. Counters are capped so the reachable set is finite.
    #[derive(Clone, Default, PartialEq, Eq, Hash)]
    struct Observer {
        not_owner_seen: bool,
        ready: bool,
        gate_open: bool,
        gate_final: bool,
        owner: bool,
        healthy: bool,
        visible: bool,
        start_clear: bool,
        start_pending: bool,
        kill_pending: bool,
        /// Deactivated and a kill was verified after entering it.
        verified_in_deactivated: bool,
        fence_pending: bool,
        fenced: bool,
        /// etcd answered healthy after the last kill.
        healthy_after_kill: bool,
        check_pending: bool,
        take_pending: bool,
        last_take_answer: Option<i64>,
        done: bool,
        takes: u8,
        take_failures: u8,
        retry_pending: bool,
        /// An AwaitSettle is the pending retry.
        settle_waiting: bool,
        /// The settle's RetryDue came.
        settle_elapsed: bool,
        /// The pending kill is the second one.
        again_pending: bool,
        /// The second kill was verified.
        settle_verified: bool,
    }

    impl Observer {
        fn check(
            &mut self,
            timing: Timing,
            before: State,
            event: Event,
            after: State,
            actions: &[Action],
        ) {
            let ctx = || format!("{before:?} + {event:?} -> {after:?} {actions:?}");
            let deactivated = |s: State| matches!(s, State::Deactivated(_));
            match event {
                Event::Verdict(v) => {
                    self.owner = v == Verdict::Owner;
                    self.not_owner_seen |= v == Verdict::NotOwner;
                }
                EtcdHealth(h) => {
                    self.healthy = h;
                    self.healthy_after_kill |= h;
                }
                EtcdProcess(v) => self.visible = v,
                StartChecked(c) if self.start_pending => {
                    self.start_pending = false;
                    self.start_clear = c == StartCheck::Clear;
                }
                Killed(ok) if self.kill_pending => {
                    self.kill_pending = false;
                    if ok && deactivated(before) {
                        self.verified_in_deactivated = true;
                    }
                    if ok && self.again_pending {
                        self.settle_verified = true;
                    }
                    self.again_pending = false;
                }
                Fenced(ok) if self.fence_pending => {
                    self.fence_pending = false;
                    self.fenced |= ok;
                }
                Event::HandOff(answer) if self.check_pending => {
                    self.check_pending = false;
                    self.last_take_answer = match answer {
                        HandOff::Take { min_revision } => Some(min_revision),
                        _ => None,
                    };
                    if answer == HandOff::Done {
                        self.done = true;
                    }
                }
                FinalStored(ok) if self.take_pending => {
                    self.take_pending = false;
                    if ok {
                        self.done = true;
                    } else {
                        self.take_failures = (self.take_failures + 1).min(3);
                    }
                }
                RetryDue if self.retry_pending => {
                    self.retry_pending = false;
                    self.settle_elapsed |= self.settle_waiting;
                    self.settle_waiting = false;
                }
                _ => {}
            }

            if deactivated(before) {
                assert!(deactivated(after), "left Deactivated: {}", ctx());
            }
            if after == State::Active && before != State::Active {
                assert!(
                    self.owner && self.visible && self.start_clear,
                    "Active without owner verdict, visible etcd and a clear start check: {}",
                    ctx()
                );
            }
            let entered_deactivated = deactivated(after) && !deactivated(before);
            if entered_deactivated {
                // Kill first: readiness and the gate (no waiting), then the kill, nothing between.
                let expected: Vec<Action> = [
                    self.ready.then_some(SetReady(false)),
                    (!self.gate_final).then_some(SetGate(Gate::Final)),
                    Some(KillEtcd),
                ]
                .into_iter()
                .flatten()
                .collect();
                let tail = &actions[actions.len().saturating_sub(expected.len())..];
                assert_eq!(tail, expected.as_slice(), "entering Deactivated: {}", ctx());
                assert!(
                    matches!(
                        event,
                        Event::Verdict(Verdict::NotOwner) | StartChecked(StartCheck::Fenced)
                    ),
                    "{}",
                    ctx()
                );
            }
            let entered_suspended =
                matches!(after, State::Suspended(_)) && !matches!(before, State::Suspended(_));
            if entered_suspended {
                assert!(
                    actions.contains(&KillEtcd),
                    "Suspended without a kill: {}",
                    ctx()
                );
            }

            for action in actions {
                // Every step of the hand-off is taken in Deactivated; all but the take follow a
                // verified kill.
                let hand_off = matches!(
                    action,
                    WriteFence | CheckHandOff | AwaitSettle { .. } | KillAgain
                );
                if hand_off || matches!(action, TakeFinal { .. }) {
                    assert!(
                        deactivated(after),
                        "{action:?} outside Deactivated: {}",
                        ctx()
                    );
                }
                if hand_off {
                    assert!(
                        self.verified_in_deactivated,
                        "{action:?} before a verified kill: {}",
                        ctx()
                    );
                }
                match *action {
                    SetReady(r) => {
                        assert_ne!(r, self.ready, "redundant readiness change: {}", ctx());
                        self.ready = r;
                    }
                    SetGate(g) => {
                        assert!(
                            !(g == Gate::Open && self.ready),
                            "gate opened after readiness: {}",
                            ctx()
                        );
                        self.gate_open = g == Gate::Open;
                        self.gate_final = g == Gate::Final;
                    }
                    KillEtcd => {
                        self.kill_pending = true;
                        self.healthy = false;
                        self.healthy_after_kill = false;
                        assert!(!self.ready, "kill while ready: {}", ctx());
                    }
                    CheckStart => {
                        assert!(after == State::Starting, "{}", ctx());
                        assert!(!self.start_pending, "{}", ctx());
                        self.start_pending = true;
                    }
                    WriteFence => {
                        assert!(
                            timing.settle.is_zero() || self.settle_verified,
                            "fence before the kill after the settle is verified: {}",
                            ctx()
                        );
                        assert!(!self.fence_pending && !self.fenced, "{}", ctx());
                        self.fence_pending = true;
                    }
                    CheckHandOff => {
                        assert!(
                            self.fenced,
                            "hand-off check before this member is fenced: {}",
                            ctx()
                        );
                        assert!(
                            self.healthy_after_kill,
                            "hand-off check before etcd came back: {}",
                            ctx()
                        );
                        assert!(
                            !self.check_pending && !self.take_pending && !self.done,
                            "{}",
                            ctx()
                        );
                        self.check_pending = true;
                    }
                    TakeFinal { min_revision, .. } => {
                        assert_eq!(
                            Some(min_revision),
                            self.last_take_answer,
                            "a take only follows a Take answer, with its revision: {}",
                            ctx()
                        );
                        assert!(
                            matches!(event, Event::HandOff(HandOff::Take { .. })),
                            "{}",
                            ctx()
                        );
                        assert!(!self.done && !self.take_pending, "{}", ctx());
                        assert!(!self.ready && self.gate_final, "{}", ctx());
                        assert_eq!(self.takes.min(3), self.take_failures, "{}", ctx());
                        self.takes = (self.takes + 1).min(3);
                        self.take_pending = true;
                    }
                    AwaitSettle { settle } => {
                        assert!(!timing.settle.is_zero(), "settle disabled: {}", ctx());
                        assert_eq!(settle, timing.settle, "{}", ctx());
                        assert!(
                            event == Killed(true),
                            "the settle starts at the first verified kill: {}",
                            ctx()
                        );
                        assert!(!self.fenced && !self.fence_pending, "{}", ctx());
                        self.retry_pending = true;
                        self.settle_waiting = true;
                    }
                    KillAgain => {
                        assert!(
                            self.settle_elapsed,
                            "second kill before the settle: {}",
                            ctx()
                        );
                        assert!(!self.kill_pending && !self.fenced, "{}", ctx());
                        assert!(!self.ready, "kill while ready: {}", ctx());
                        self.kill_pending = true;
                        self.again_pending = true;
                        self.healthy = false;
                        self.healthy_after_kill = false;
                    }
                    // The watchdog keeps one timer: a new retry replaces a pending one.
                    ScheduleRetry { delay } => {
                        assert!(
                            delay >= timing.kill_retry.min(timing.backoff.initial)
                                && delay <= timing.backoff.max.max(timing.kill_retry),
                            "{}",
                            ctx()
                        );
                        self.retry_pending = true;
                        self.settle_waiting = false;
                    }
                }
            }

            if self.not_owner_seen {
                assert!(!self.ready, "ready after a not-owner verdict: {}", ctx());
            }
            assert_eq!(
                self.ready,
                after == State::Active && self.healthy && self.visible,
                "readiness must be exactly Active, healthy and visible: {}",
                ctx()
            );
            assert_eq!(self.gate_open, after == State::Active, "{}", ctx());
            assert_eq!(self.gate_final, deactivated(after), "{}", ctx());
            assert!(!after.to_string().is_empty());
        }
    }

    #[test]
    fn every_reachable_state_keeps_the_invariants_for_every_event() {
        explore(
            timing(),
            &[
                State::Deactivated(FinalStep::Settling),
                State::Deactivated(FinalStep::KillingAgain),
                State::Deactivated(FinalStep::KillAgainRetry),
            ],
        );
    }

    #[test]
    fn every_reachable_state_keeps_the_invariants_without_a_settle() {
        explore(
            Timing {
                settle: Duration::ZERO,
                ..timing()
            },
            &[],
        );
    }

    /// Breadth-first over every reachable (protocol, observer) pair with every event; `extra`
    /// are states this timing must reach besides the common ones.
    fn explore(timing: Timing, extra: &[State]) {
        let events = all_events();
        let start = (Protocol::new(timing), Observer::default());
        let mut seen: HashSet<(Protocol, Observer)> = HashSet::from([start.clone()]);
        let mut queue = VecDeque::from([start]);
        let mut transitions = 0u64;
        let mut states = HashSet::new();
        while let Some((p, observer)) = queue.pop_front() {
            states.insert(p.state());
            for &event in &events {
                let (next, actions) = p.step(event);
                let mut o = observer.clone();
                o.check(timing, p.state(), event, next.state(), &actions);
                transitions += 1;
                // Counters beyond a few failures only repeat what was explored.
                let mut capped = next;
                capped.failures = capped.failures.min(4);
                capped.takes = capped.takes.min(3);
                if seen.insert((capped, o.clone())) {
                    queue.push_back((capped, o));
                }
            }
        }
        // Guard against vacuity: the exploration reached every step of the protocol.
        for s in [
            State::Starting,
            State::Active,
            State::Suspended(KillStep::Killing),
            State::Suspended(KillStep::Retrying),
            State::Suspended(KillStep::Verified),
            State::Deactivated(FinalStep::Killing),
            State::Deactivated(FinalStep::KillRetry),
            State::Deactivated(FinalStep::Fencing),
            State::Deactivated(FinalStep::AwaitingEtcd),
            State::Deactivated(FinalStep::Checking),
            State::Deactivated(FinalStep::Waiting),
            State::Deactivated(FinalStep::Taking),
            State::Deactivated(FinalStep::Backoff(Retry::Fence)),
            State::Deactivated(FinalStep::Backoff(Retry::Check)),
            State::Deactivated(FinalStep::Done(FinalOutcome::Taken)),
            State::Deactivated(FinalStep::Done(FinalOutcome::FoundInStore)),
        ]
        .iter()
        .chain(extra)
        {
            assert!(states.contains(s), "{s:?} never reached");
        }
        assert!(
            transitions > 100_000,
            "only {transitions} transitions explored"
        );
    }
}
