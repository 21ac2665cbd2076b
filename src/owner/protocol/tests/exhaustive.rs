//! The exhaustive check: every reachable state with every event, the hand-off's take phase
//! included, against an observer that knows only the events fed and the actions seen.

use super::*;

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
        Event::HandOff(HandOff::Stored),
        Event::HandOff(HandOff::NeedRevision),
        Event::HandOff(HandOff::Claim { epoch: 0 }),
        Event::HandOff(HandOff::Claim { epoch: 1 }),
        Event::HandOff(HandOff::FixIntent { revision: 42 }),
        RevisionRead(Some(42)),
        RevisionRead(Some(43)),
        RevisionRead(None),
        Claimed(true),
        Claimed(false),
        IntentCreated(true),
        IntentCreated(false),
        Recorded(true),
        Recorded(false),
        RetryDue,
    ];
    v.extend([StartCheck::Clear, StartCheck::Fenced, StartCheck::Failed].map(StartChecked));
    v
}

/// The take-phase calls, for [`Observer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Io {
    Revision,
    Claim,
    Intent,
    Record,
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
    /// A take-phase call (revision, claim, intent, record) is pending.
    io_pending: Option<Io>,
    /// The pending record write follows a take (its failure fails that take).
    record_after_take: bool,
    /// The revision read in the current check.
    revision_read: Option<i64>,
    /// Views of the current check.
    views: u8,
    /// A final of this hand-off is in the store and the hand-off record names it.
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
            RevisionRead(r) if self.io_pending == Some(Io::Revision) => {
                self.io_pending = None;
                if r.is_some() {
                    self.revision_read = r;
                }
            }
            Claimed(_) if self.io_pending == Some(Io::Claim) => self.io_pending = None,
            IntentCreated(_) if self.io_pending == Some(Io::Intent) => self.io_pending = None,
            Recorded(ok) if self.io_pending == Some(Io::Record) => {
                self.io_pending = None;
                self.done |= ok;
                if !ok && self.record_after_take {
                    self.take_failures = (self.take_failures + 1).min(3);
                }
            }
            FinalStored(ok) if self.take_pending => {
                self.take_pending = false;
                if !ok {
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
                WriteFence
                    | CheckHandOff { .. }
                    | AwaitSettle { .. }
                    | KillAgain
                    | ReadRevision
                    | CreateClaim { .. }
                    | CreateIntent { .. }
                    | WriteRecord
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
                CheckHandOff { revision } => {
                    let continued = matches!(
                        event,
                        RevisionRead(Some(_)) | Claimed(true) | IntentCreated(true)
                    );
                    if continued {
                        self.views += 1;
                        assert_eq!(
                            revision,
                            self.revision_read,
                            "a check goes on with the revision it read: {}",
                            ctx()
                        );
                    } else {
                        self.views = 1;
                        self.revision_read = None;
                        assert_eq!(revision, None, "a new check reads afresh: {}", ctx());
                    }
                    assert!(self.views <= 5, "more than five views: {}", ctx());
                    assert!(self.io_pending.is_none(), "{}", ctx());
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
                ReadRevision | CreateClaim { .. } | CreateIntent { .. } | WriteRecord => {
                    let (io, answered) = match *action {
                        ReadRevision => {
                            (Io::Revision, event == Event::HandOff(HandOff::NeedRevision))
                        }
                        CreateClaim { epoch } => {
                            (Io::Claim, event == Event::HandOff(HandOff::Claim { epoch }))
                        }
                        CreateIntent { revision } => (
                            Io::Intent,
                            event == Event::HandOff(HandOff::FixIntent { revision }),
                        ),
                        _ => (
                            Io::Record,
                            matches!(event, Event::HandOff(HandOff::Stored) | FinalStored(true)),
                        ),
                    };
                    assert!(
                        answered,
                        "{action:?} without the answer asking for it: {}",
                        ctx()
                    );
                    assert!(
                        self.io_pending.is_none()
                            && !self.check_pending
                            && !self.take_pending
                            && !self.done,
                        "one call at a time, none after the hand-off is done: {}",
                        ctx()
                    );
                    assert!(self.fenced && self.healthy_after_kill, "{}", ctx());
                    self.io_pending = Some(io);
                    self.record_after_take = event == FinalStored(true);
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
        if matches!(after, State::Deactivated(FinalStep::Done(_))) {
            assert!(
                self.done,
                "Done before a final was recorded (or found recorded): {}",
                ctx()
            );
        }
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
        State::Deactivated(FinalStep::ReadingRevision),
        State::Deactivated(FinalStep::Claiming),
        State::Deactivated(FinalStep::FixingIntent),
        State::Deactivated(FinalStep::Recording(FinalOutcome::Taken)),
        State::Deactivated(FinalStep::Recording(FinalOutcome::FoundInStore)),
        State::Deactivated(FinalStep::Backoff(Retry::Unsettled)),
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
