//! The ownership state machine (DESIGN.md "The ownership protocol") as a pure transition function.
//!
//! [`Machine::step`] maps `(machine, event)` to `(machine, actions)` and does no I/O; the watchdog
//! executes the actions in order and feeds their results back as events. The states and what
//! each one means for readiness, the snapshotter, etcd and the final snapshot:
//!
//! | state | readiness | snapshotter | etcd | final snapshot |
//! |---|---|---|---|---|
//! | Starting | 503 | off | untouched | no |
//! | Active | 200 if etcd healthy | on | serving | no |
//! | Suspended | 503 | off | killed once on entry | no, so it can come back |
//! | Deactivated | 503 forever | off | killed on entry | exactly once, retried until stored |
//!
//! Entering Deactivated runs, in this order: readiness 503, stop the snapshotter, kill etcd, wait
//! for the kill to finish and for etcd to answer a health check again (the kubelet restarts it;
//! readiness keeps clients away), check whether the store's latest full snapshot is already final
//! (a restarted sidecar must not take a second one), take one final full snapshot. A failed check
//! or snapshot is retried after a backoff; a retry continues the same request (it checks the store
//! again first, so an upload that succeeded although its caller saw an error is not repeated).
//!
//! Events that make no sense in the current state (a snapshot result nobody asked for, a health
//! report during the kill) are ignored, so the watchdog never has to filter them.

use std::fmt;
use std::time::Duration;

pub use crate::backoff::Backoff;

/// What an owner check concluded. `Unresolvable` is only produced after the configured number of
/// consecutive failed lookups (see `resolve::FailureCounter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The record names our ID.
    Owner,
    /// The record names someone else, or there is authoritatively no record.
    NotOwner,
    /// The record could not be looked up often enough in a row.
    Unresolvable,
}

/// Something the watchdog observed, or the result of an action it executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// An owner check concluded.
    Verdict(Verdict),
    /// An etcd health check answered healthy (`true`) or failed (`false`). After a kill, the first
    /// healthy answer means etcd was seen again.
    EtcdHealth(bool),
    /// The [`Action::KillEtcd`] finished (process gone, or none found).
    KillDone,
    /// The answer to [`Action::CheckStoreForFinal`].
    StoreChecked {
        /// The store's latest full snapshot is marked final.
        latest_is_final: bool,
    },
    /// [`Action::CheckStoreForFinal`] failed (store unreachable).
    StoreCheckFailed,
    /// The final snapshot requested by [`Action::TakeFinalSnapshot`] is stored.
    FinalStored,
    /// The final snapshot requested by [`Action::TakeFinalSnapshot`] failed.
    FinalFailed,
    /// The delay of an [`Action::ScheduleRetry`] has passed.
    RetryDue,
}

/// Something the watchdog must do, in the order given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Make `/healthz` answer 200 (`true`) or 503 (`false`).
    SetReady(bool),
    /// Start the regular (scheduled full and delta) snapshotter.
    StartSnapshotter,
    /// Stop the regular snapshotter.
    StopSnapshotter,
    /// SIGTERM etcd, SIGKILL after the grace; report [`Event::KillDone`].
    KillEtcd,
    /// Ask the store whether its latest full snapshot is final; report [`Event::StoreChecked`] or
    /// [`Event::StoreCheckFailed`].
    CheckStoreForFinal,
    /// Take one full snapshot marked final; report [`Event::FinalStored`] or [`Event::FinalFailed`].
    /// There is one final-snapshot request per process; `attempt` counts its attempts (each one
    /// checks the store first), so a higher attempt is that request continuing after a failure.
    TakeFinalSnapshot {
        /// 1-based attempt of the one final-snapshot request.
        attempt: u32,
    },
    /// Report [`Event::RetryDue`] after `delay`.
    ScheduleRetry {
        /// How long to wait before the next attempt.
        delay: Duration,
    },
}

/// The ownership state of this sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// No verdict yet.
    Starting,
    /// We own etcd.
    Active,
    /// The owner record could not be resolved; reversible.
    Suspended,
    /// Someone else owns etcd, or nobody does; sticky for the life of the process.
    Deactivated(FinalStep),
}

/// Progress of the final snapshot while [`State::Deactivated`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinalStep {
    /// etcd is being killed.
    Killing,
    /// Waiting for etcd to answer a health check again.
    AwaitingEtcd,
    /// Asked the store whether its latest full snapshot is already final.
    CheckingStore {
        /// Which attempt of the final snapshot request this is (1 = first).
        attempt: u32,
    },
    /// The final snapshot is being taken.
    Taking {
        /// Which attempt of the final snapshot request this is (1 = first).
        attempt: u32,
    },
    /// An attempt failed; waiting for the retry.
    Backoff {
        /// The attempt that failed.
        failed: u32,
    },
    /// A final snapshot is in the store; nothing more to do.
    Done(FinalOutcome),
}

/// How the Deactivated state's final snapshot came to be in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinalOutcome {
    /// This process took and stored it.
    Taken,
    /// The store already had a final full snapshot (a restart, or an upload whose success this
    /// process did not see).
    FoundInStore,
}

impl State {
    /// A short stable name for logs, metrics and `/status`.
    pub fn name(&self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Active => "active",
            State::Suspended => "suspended",
            State::Deactivated(_) => "deactivated",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            State::Deactivated(step) => write!(f, "deactivated ({step:?})"),
            other => f.write_str(other.name()),
        }
    }
}

/// The whole ownership state plus what the machine knows about the world; small and `Copy`, so a
/// transition is a plain function of its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Machine {
    state: State,
    etcd_healthy: bool,
    ready: bool,
    snapshotter_on: bool,
    backoff: Backoff,
}

impl Machine {
    /// A machine in [`State::Starting`]: not ready, snapshotter off, etcd health unknown (treated
    /// as unhealthy).
    pub fn new(backoff: Backoff) -> Self {
        Machine {
            state: State::Starting,
            etcd_healthy: false,
            ready: false,
            snapshotter_on: false,
            backoff,
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

    /// Whether the regular snapshotter runs after the actions emitted so far.
    pub fn snapshotter_on(&self) -> bool {
        self.snapshotter_on
    }

    /// Whether a final snapshot is in the store (taken here or found there).
    pub fn final_in_store(&self) -> bool {
        matches!(self.state, State::Deactivated(FinalStep::Done(_)))
    }

    /// The transition function: the next machine and the actions to execute, in order.
    #[must_use]
    pub fn step(mut self, event: Event) -> (Machine, Vec<Action>) {
        let mut actions = Vec::new();
        if let Event::EtcdHealth(healthy) = event {
            self.etcd_healthy = healthy;
        }
        match (self.state, event) {
            (State::Deactivated(step), event) => self.advance_final(step, event, &mut actions),
            (
                State::Starting | State::Active | State::Suspended,
                Event::Verdict(Verdict::NotOwner),
            ) => self.deactivate(&mut actions),
            (State::Starting | State::Suspended, Event::Verdict(Verdict::Owner)) => {
                self.state = State::Active;
                self.set_snapshotter(true, &mut actions);
            }
            (State::Starting | State::Active, Event::Verdict(Verdict::Unresolvable)) => {
                self.set_ready(false, &mut actions);
                self.set_snapshotter(false, &mut actions);
                self.state = State::Suspended;
                actions.push(Action::KillEtcd);
            }
            _ => {}
        }
        // Readiness follows etcd health only while Active; every other state already set 503.
        let want_ready = self.state == State::Active && self.etcd_healthy;
        self.set_ready(want_ready, &mut actions);
        (self, actions)
    }

    /// Enter Deactivated: readiness first so no new client arrives, then the snapshotter, then etcd.
    fn deactivate(&mut self, actions: &mut Vec<Action>) {
        self.set_ready(false, actions);
        self.set_snapshotter(false, actions);
        self.state = State::Deactivated(FinalStep::Killing);
        actions.push(Action::KillEtcd);
    }

    /// Move the final snapshot along; verdicts are ignored because Deactivated is sticky.
    fn advance_final(&mut self, step: FinalStep, event: Event, actions: &mut Vec<Action>) {
        let next = match (step, event) {
            (FinalStep::Killing, Event::KillDone) => FinalStep::AwaitingEtcd,
            (FinalStep::AwaitingEtcd, Event::EtcdHealth(true)) => {
                actions.push(Action::CheckStoreForFinal);
                FinalStep::CheckingStore { attempt: 1 }
            }
            (
                FinalStep::CheckingStore { .. },
                Event::StoreChecked {
                    latest_is_final: true,
                },
            ) => FinalStep::Done(FinalOutcome::FoundInStore),
            (
                FinalStep::CheckingStore { attempt },
                Event::StoreChecked {
                    latest_is_final: false,
                },
            ) => {
                actions.push(Action::TakeFinalSnapshot { attempt });
                FinalStep::Taking { attempt }
            }
            (FinalStep::CheckingStore { attempt }, Event::StoreCheckFailed)
            | (FinalStep::Taking { attempt }, Event::FinalFailed) => {
                actions.push(Action::ScheduleRetry {
                    delay: self.backoff.delay(attempt),
                });
                FinalStep::Backoff { failed: attempt }
            }
            (FinalStep::Taking { .. }, Event::FinalStored) => FinalStep::Done(FinalOutcome::Taken),
            (FinalStep::Backoff { failed }, Event::RetryDue) => {
                actions.push(Action::CheckStoreForFinal);
                FinalStep::CheckingStore {
                    attempt: failed.saturating_add(1),
                }
            }
            (step, _) => step,
        };
        self.state = State::Deactivated(next);
    }

    fn set_ready(&mut self, ready: bool, actions: &mut Vec<Action>) {
        if self.ready != ready {
            self.ready = ready;
            actions.push(Action::SetReady(ready));
        }
    }

    fn set_snapshotter(&mut self, on: bool, actions: &mut Vec<Action>) {
        if self.snapshotter_on != on {
            self.snapshotter_on = on;
            actions.push(if on {
                Action::StartSnapshotter
            } else {
                Action::StopSnapshotter
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Verdict::{NotOwner, Owner, Unresolvable};
    use super::*;
    use Action::*;
    use Event::{
        EtcdHealth, FinalFailed, FinalStored, KillDone, RetryDue, StoreCheckFailed, StoreChecked,
        Verdict,
    };

    const OWNER: Event = Verdict(Owner);
    const NOT_OWNER: Event = Verdict(NotOwner);
    const UNRESOLVABLE: Event = Verdict(Unresolvable);
    const HEALTHY: Event = EtcdHealth(true);
    const UNHEALTHY: Event = EtcdHealth(false);

    fn backoff() -> Backoff {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(8),
        }
    }

    /// Runs `events` from a fresh machine and returns the machine and all actions.
    fn run(events: &[Event]) -> (Machine, Vec<Action>) {
        let mut machine = Machine::new(backoff());
        let mut all = Vec::new();
        for event in events {
            let (next, actions) = machine.step(*event);
            machine = next;
            all.extend(actions);
        }
        (machine, all)
    }

    /// Runs `prefix`, then returns what `event` does from there.
    fn after(prefix: &[Event], event: Event) -> (State, Vec<Action>) {
        let (machine, _) = run(prefix);
        let (next, actions) = machine.step(event);
        (next.state(), actions)
    }

    fn deactivated(step: FinalStep) -> State {
        State::Deactivated(step)
    }

    // ---- Table tests: one row per transition, read as "after <prefix>, <event> gives <state>
    // and <actions>". ----

    #[test]
    fn transitions_from_starting() {
        let rows: &[(Event, State, &[Action])] = &[
            (OWNER, State::Active, &[StartSnapshotter]),
            (UNRESOLVABLE, State::Suspended, &[KillEtcd]),
            (NOT_OWNER, deactivated(FinalStep::Killing), &[KillEtcd]),
            (HEALTHY, State::Starting, &[]),
            (UNHEALTHY, State::Starting, &[]),
            (KillDone, State::Starting, &[]),
            (FinalStored, State::Starting, &[]),
            (RetryDue, State::Starting, &[]),
        ];
        for (event, state, actions) in rows {
            assert_eq!(
                after(&[], *event),
                (*state, actions.to_vec()),
                "Starting + {event:?}"
            );
        }
    }

    #[test]
    fn transitions_from_active() {
        let healthy_active: &[Event] = &[HEALTHY, OWNER];
        let rows: &[(&[Event], Event, State, &[Action])] = &[
            (&[OWNER], HEALTHY, State::Active, &[SetReady(true)]),
            (&[OWNER], UNHEALTHY, State::Active, &[]),
            (&[OWNER], OWNER, State::Active, &[]),
            (healthy_active, UNHEALTHY, State::Active, &[SetReady(false)]),
            (healthy_active, HEALTHY, State::Active, &[]),
            (healthy_active, OWNER, State::Active, &[]),
            (
                healthy_active,
                UNRESOLVABLE,
                State::Suspended,
                &[SetReady(false), StopSnapshotter, KillEtcd],
            ),
            (
                healthy_active,
                NOT_OWNER,
                deactivated(FinalStep::Killing),
                &[SetReady(false), StopSnapshotter, KillEtcd],
            ),
            (
                &[OWNER],
                NOT_OWNER,
                deactivated(FinalStep::Killing),
                &[StopSnapshotter, KillEtcd],
            ),
            (&[OWNER], FinalStored, State::Active, &[]),
        ];
        for (prefix, event, state, actions) in rows {
            assert_eq!(
                after(prefix, *event),
                (*state, actions.to_vec()),
                "{prefix:?} + {event:?}"
            );
        }
    }

    #[test]
    fn starting_owner_with_healthy_etcd_becomes_ready_after_starting_the_snapshotter() {
        assert_eq!(
            after(&[HEALTHY], OWNER),
            (State::Active, vec![StartSnapshotter, SetReady(true)])
        );
    }

    #[test]
    fn transitions_from_suspended() {
        let suspended: &[Event] = &[HEALTHY, OWNER, UNRESOLVABLE];
        let rows: &[(Event, State, &[Action])] = &[
            (OWNER, State::Active, &[StartSnapshotter, SetReady(true)]),
            (UNRESOLVABLE, State::Suspended, &[]),
            (NOT_OWNER, deactivated(FinalStep::Killing), &[KillEtcd]),
            (HEALTHY, State::Suspended, &[]),
            (UNHEALTHY, State::Suspended, &[]),
            (KillDone, State::Suspended, &[]),
            (
                StoreChecked {
                    latest_is_final: false,
                },
                State::Suspended,
                &[],
            ),
            (FinalFailed, State::Suspended, &[]),
            (RetryDue, State::Suspended, &[]),
        ];
        for (event, state, actions) in rows {
            assert_eq!(
                after(suspended, *event),
                (*state, actions.to_vec()),
                "Suspended + {event:?}"
            );
        }
    }

    #[test]
    fn suspended_back_to_owner_with_unhealthy_etcd_stays_unready() {
        assert_eq!(
            after(&[OWNER, UNRESOLVABLE, UNHEALTHY], OWNER),
            (State::Active, vec![StartSnapshotter])
        );
    }

    #[test]
    fn transitions_through_the_final_snapshot() {
        let killing: &[Event] = &[NOT_OWNER];
        let awaiting: &[Event] = &[NOT_OWNER, KillDone];
        let checking: &[Event] = &[NOT_OWNER, KillDone, HEALTHY];
        let taking: &[Event] = &[
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: false,
            },
        ];
        let backoff_after_take: &[Event] = &[
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: false,
            },
            FinalFailed,
        ];
        let second_check: &[Event] = &[
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: false,
            },
            FinalFailed,
            RetryDue,
        ];
        let one_sec = Duration::from_secs(1);
        let two_secs = Duration::from_secs(2);
        let rows: &[(&[Event], Event, FinalStep, &[Action])] = &[
            // A health report during the kill is about the etcd being killed: not "seen again".
            (killing, HEALTHY, FinalStep::Killing, &[]),
            (killing, KillDone, FinalStep::AwaitingEtcd, &[]),
            (killing, OWNER, FinalStep::Killing, &[]),
            (awaiting, UNHEALTHY, FinalStep::AwaitingEtcd, &[]),
            (awaiting, OWNER, FinalStep::AwaitingEtcd, &[]),
            (
                awaiting,
                HEALTHY,
                FinalStep::CheckingStore { attempt: 1 },
                &[CheckStoreForFinal],
            ),
            (
                checking,
                StoreChecked {
                    latest_is_final: false,
                },
                FinalStep::Taking { attempt: 1 },
                &[TakeFinalSnapshot { attempt: 1 }],
            ),
            (
                checking,
                StoreChecked {
                    latest_is_final: true,
                },
                FinalStep::Done(FinalOutcome::FoundInStore),
                &[],
            ),
            (
                checking,
                StoreCheckFailed,
                FinalStep::Backoff { failed: 1 },
                &[ScheduleRetry { delay: one_sec }],
            ),
            (
                checking,
                FinalStored,
                FinalStep::CheckingStore { attempt: 1 },
                &[],
            ),
            (
                taking,
                FinalStored,
                FinalStep::Done(FinalOutcome::Taken),
                &[],
            ),
            (
                taking,
                FinalFailed,
                FinalStep::Backoff { failed: 1 },
                &[ScheduleRetry { delay: one_sec }],
            ),
            (taking, RetryDue, FinalStep::Taking { attempt: 1 }, &[]),
            (
                backoff_after_take,
                RetryDue,
                FinalStep::CheckingStore { attempt: 2 },
                &[CheckStoreForFinal],
            ),
            (
                backoff_after_take,
                FinalStored,
                FinalStep::Backoff { failed: 1 },
                &[],
            ),
            (
                second_check,
                StoreChecked {
                    latest_is_final: false,
                },
                FinalStep::Taking { attempt: 2 },
                &[TakeFinalSnapshot { attempt: 2 }],
            ),
            (
                second_check,
                StoreCheckFailed,
                FinalStep::Backoff { failed: 2 },
                &[ScheduleRetry { delay: two_secs }],
            ),
        ];
        for (prefix, event, step, actions) in rows {
            assert_eq!(
                after(prefix, *event),
                (deactivated(*step), actions.to_vec()),
                "{prefix:?} + {event:?}"
            );
        }
    }

    #[test]
    fn done_ignores_everything() {
        let done: &[Event] = &[
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: false,
            },
            FinalStored,
        ];
        for event in all_events() {
            assert_eq!(
                after(done, event),
                (deactivated(FinalStep::Done(FinalOutcome::Taken)), vec![]),
                "Done + {event:?}"
            );
        }
    }

    #[test]
    fn suspended_then_not_owner_kills_again_and_takes_the_final_snapshot() {
        let (machine, actions) = run(&[
            HEALTHY,
            OWNER,
            UNRESOLVABLE,
            KillDone,
            HEALTHY,
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: false,
            },
            FinalStored,
        ]);
        assert_eq!(
            actions,
            vec![
                StartSnapshotter,
                SetReady(true),
                SetReady(false),
                StopSnapshotter,
                KillEtcd,
                KillEtcd,
                CheckStoreForFinal,
                TakeFinalSnapshot { attempt: 1 },
            ]
        );
        assert!(machine.final_in_store());
    }

    #[test]
    fn restart_with_final_already_in_store_takes_no_second_one() {
        let (machine, actions) = run(&[
            HEALTHY,
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: true,
            },
        ]);
        assert_eq!(actions, vec![KillEtcd, CheckStoreForFinal]);
        assert_eq!(
            machine.state(),
            deactivated(FinalStep::Done(FinalOutcome::FoundInStore))
        );
    }

    #[test]
    fn upload_that_succeeded_unseen_is_not_repeated() {
        let (machine, actions) = run(&[
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: false,
            },
            FinalFailed,
            RetryDue,
            StoreChecked {
                latest_is_final: true,
            },
        ]);
        assert_eq!(
            actions
                .iter()
                .filter(|a| matches!(a, TakeFinalSnapshot { .. }))
                .count(),
            1
        );
        assert_eq!(
            machine.state(),
            deactivated(FinalStep::Done(FinalOutcome::FoundInStore))
        );
    }

    // ---- Exhaustive check: every sequence of up to six events. ----

    fn all_events() -> Vec<Event> {
        vec![
            OWNER,
            NOT_OWNER,
            UNRESOLVABLE,
            HEALTHY,
            UNHEALTHY,
            KillDone,
            StoreChecked {
                latest_is_final: false,
            },
            StoreChecked {
                latest_is_final: true,
            },
            StoreCheckFailed,
            FinalStored,
            FinalFailed,
            RetryDue,
        ]
    }

    /// What an outside observer knows from the events fed and the actions seen, independent of the
    /// machine's internals.
    #[derive(Clone, Default)]
    struct Observer {
        not_owner_seen: bool,
        ready: bool,
        snapshotter_on: bool,
        etcd_healthy: bool,
        ever_deactivated: bool,
        /// A kill is pending (emitted, no KillDone yet).
        kill_pending: bool,
        /// Deactivated, its kill finished, and etcd answered healthy after that.
        etcd_back_after_deactivation_kill: bool,
        deactivation_kill_done: bool,
        check_pending: bool,
        store_said_final: bool,
        take_pending: bool,
        final_stored: bool,
        takes: u32,
        final_failures: u32,
        last_attempt: u32,
    }

    impl Observer {
        fn check(
            &mut self,
            before: State,
            event: Event,
            after: State,
            actions: &[Action],
            trace: &[Event],
        ) {
            let ctx =
                || format!("trace {trace:?}: {before:?} + {event:?} -> {after:?} {actions:?}");
            match event {
                Verdict(NotOwner) => self.not_owner_seen = true,
                EtcdHealth(h) => {
                    self.etcd_healthy = h;
                    if h && self.deactivation_kill_done {
                        self.etcd_back_after_deactivation_kill = true;
                    }
                }
                KillDone if self.kill_pending => {
                    self.kill_pending = false;
                    if matches!(before, State::Deactivated(_)) {
                        self.deactivation_kill_done = true;
                    }
                }
                StoreChecked { latest_is_final } if self.check_pending => {
                    self.check_pending = false;
                    self.store_said_final |= latest_is_final;
                }
                StoreCheckFailed if self.check_pending => self.check_pending = false,
                FinalStored if self.take_pending => {
                    self.take_pending = false;
                    self.final_stored = true;
                }
                FinalFailed if self.take_pending => {
                    self.take_pending = false;
                    self.final_failures += 1;
                }
                _ => {}
            }

            // Deactivated is sticky; Active is only entered on an owner verdict.
            if matches!(before, State::Deactivated(_)) {
                assert!(
                    matches!(after, State::Deactivated(_)),
                    "left Deactivated: {}",
                    ctx()
                );
            }
            if after == State::Active && before != State::Active {
                assert_eq!(
                    event,
                    OWNER,
                    "became Active without an owner verdict: {}",
                    ctx()
                );
            }
            if before == State::Suspended && after != State::Suspended {
                assert!(
                    matches!(event, Verdict(Owner | NotOwner)),
                    "left Suspended without a resolved verdict: {}",
                    ctx()
                );
            }
            let entered_deactivated =
                matches!(after, State::Deactivated(_)) && !matches!(before, State::Deactivated(_));
            let entered_suspended = after == State::Suspended && before != State::Suspended;
            let kills = actions.iter().filter(|a| **a == KillEtcd).count();
            assert_eq!(
                kills,
                usize::from(entered_deactivated || entered_suspended),
                "etcd is killed exactly on entering Suspended or Deactivated: {}",
                ctx()
            );
            if entered_deactivated {
                self.ever_deactivated = true;
                // Order: readiness, snapshotter, kill; each only if needed, but never reordered.
                let expected: Vec<Action> = [
                    self.ready.then_some(SetReady(false)),
                    self.snapshotter_on.then_some(StopSnapshotter),
                    Some(KillEtcd),
                ]
                .into_iter()
                .flatten()
                .collect();
                assert_eq!(
                    actions,
                    expected.as_slice(),
                    "entering Deactivated: {}",
                    ctx()
                );
            }

            for action in actions {
                match *action {
                    SetReady(r) => {
                        assert_ne!(r, self.ready, "redundant readiness change: {}", ctx());
                        self.ready = r;
                    }
                    StartSnapshotter => {
                        assert!(!self.snapshotter_on, "started twice: {}", ctx());
                        self.snapshotter_on = true;
                    }
                    StopSnapshotter => {
                        assert!(self.snapshotter_on, "stopped while off: {}", ctx());
                        self.snapshotter_on = false;
                    }
                    KillEtcd => self.kill_pending = true,
                    CheckStoreForFinal => {
                        assert!(
                            matches!(after, State::Deactivated(_)),
                            "store check outside Deactivated: {}",
                            ctx()
                        );
                        assert!(
                            self.etcd_back_after_deactivation_kill,
                            "store check before etcd came back: {}",
                            ctx()
                        );
                        assert!(
                            !self.check_pending && !self.take_pending && !self.final_stored,
                            "{}",
                            ctx()
                        );
                        self.check_pending = true;
                    }
                    TakeFinalSnapshot { attempt } => {
                        // Only from Deactivated (so never from Suspended), only after the kill and
                        // etcd answering again, never when the store already has a final one.
                        assert!(
                            matches!(before, State::Deactivated(_)),
                            "final outside Deactivated: {}",
                            ctx()
                        );
                        assert!(
                            self.etcd_back_after_deactivation_kill,
                            "final before etcd came back: {}",
                            ctx()
                        );
                        assert!(!self.store_said_final, "second final snapshot: {}", ctx());
                        assert!(
                            !self.final_stored && !self.take_pending,
                            "final while one exists: {}",
                            ctx()
                        );
                        assert!(!self.ready && !self.snapshotter_on, "{}", ctx());
                        // One request per process; later attempts are that request continuing.
                        // `attempt` counts attempts of that one request, store checks included;
                        // a take after the first only follows a failed take.
                        assert_eq!(self.final_failures, self.takes, "{}", ctx());
                        assert!(
                            attempt > self.last_attempt,
                            "attempts must increase: {}",
                            ctx()
                        );
                        self.takes += 1;
                        self.last_attempt = attempt;
                        self.take_pending = true;
                    }
                    ScheduleRetry { delay } => {
                        assert!(matches!(event, FinalFailed | StoreCheckFailed), "{}", ctx());
                        assert!(
                            delay >= backoff().initial && delay <= backoff().max,
                            "{}",
                            ctx()
                        );
                    }
                }
            }

            // Readiness: never after a not-owner verdict, and 200 only while Active with etcd healthy.
            if self.not_owner_seen {
                assert!(!self.ready, "ready after a not-owner verdict: {}", ctx());
            }
            assert_eq!(
                self.ready,
                after == State::Active && self.etcd_healthy,
                "readiness must be exactly Active && healthy: {}",
                ctx()
            );
            assert_eq!(
                self.snapshotter_on,
                after == State::Active,
                "snapshotter on iff Active: {}",
                ctx()
            );
            if self.ever_deactivated {
                assert!(!self.snapshotter_on, "{}", ctx());
            }
        }
    }

    fn explore(
        machine: Machine,
        observer: &Observer,
        trace: &mut Vec<Event>,
        depth: usize,
        events: &[Event],
        count: &mut u64,
    ) {
        if depth == 0 {
            return;
        }
        for &event in events {
            let (next, actions) = machine.step(event);
            trace.push(event);
            let mut observer = observer.clone();
            observer.check(machine.state(), event, next.state(), &actions, trace);
            *count += 1;
            explore(next, &observer, trace, depth - 1, events, count);
            trace.pop();
        }
    }

    #[test]
    fn every_sequence_of_up_to_six_events_keeps_the_invariants() {
        let events = all_events();
        let mut count = 0;
        explore(
            Machine::new(backoff()),
            &Observer::default(),
            &mut Vec::new(),
            6,
            &events,
            &mut count,
        );
        let n = events.len() as u64;
        assert_eq!(
            count,
            (1..=6).map(|k| n.pow(k)).sum::<u64>(),
            "every sequence visited"
        );
    }

    #[test]
    fn every_six_event_continuation_of_deeper_states_keeps_the_invariants() {
        // Six events from a fresh machine do not reach a retried final snapshot or a resumed
        // Active; these prefixes put the machine there first (checked by the same observer).
        let prefixes: &[&[Event]] = &[
            &[HEALTHY, OWNER, UNRESOLVABLE, KillDone],
            &[NOT_OWNER, KillDone, HEALTHY],
            &[
                NOT_OWNER,
                KillDone,
                HEALTHY,
                StoreChecked {
                    latest_is_final: false,
                },
                FinalFailed,
            ],
        ];
        let events = all_events();
        for prefix in prefixes {
            let mut machine = Machine::new(backoff());
            let mut observer = Observer::default();
            let mut trace = Vec::new();
            for &event in *prefix {
                let (next, actions) = machine.step(event);
                trace.push(event);
                observer.check(machine.state(), event, next.state(), &actions, &trace);
                machine = next;
            }
            let mut count = 0;
            explore(machine, &observer, &mut trace, 6, &events, &mut count);
            assert!(count > 0);
        }
    }

    #[test]
    fn the_final_snapshot_is_reachable_within_the_exhaustive_depth() {
        // Guards the exhaustive test against vacuity: its depth reaches a stored final snapshot and
        // a retried one.
        let (m, a) = run(&[
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreChecked {
                latest_is_final: false,
            },
            FinalStored,
        ]);
        assert!(m.final_in_store() && a.contains(&TakeFinalSnapshot { attempt: 1 }));
        let (_, a) = run(&[
            NOT_OWNER,
            KillDone,
            HEALTHY,
            StoreCheckFailed,
            RetryDue,
            StoreChecked {
                latest_is_final: false,
            },
        ]);
        assert!(a.contains(&TakeFinalSnapshot { attempt: 2 }));
    }
}
