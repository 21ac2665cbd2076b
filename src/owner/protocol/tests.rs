//! The protocol's examples and its exhaustive check: every reachable state, every event.

use super::*;
use Action::*;
use Event::{
    Claimed, EtcdHealth, EtcdProcess, Fenced, FinalStored, IntentCreated, Killed, Recorded,
    RetryDue, RevisionRead, StartChecked,
};
use std::collections::{HashSet, VecDeque};

const OWNER: Event = Event::Verdict(Verdict::Owner);
const NOT_OWNER: Event = Event::Verdict(Verdict::NotOwner);
const UNRESOLVABLE: Event = Event::Verdict(Verdict::Unresolvable);
const HEALTHY: Event = EtcdHealth(true);
const VISIBLE: Event = EtcdProcess(true);
const CLEAR: Event = StartChecked(StartCheck::Clear);
const TAKE: Event = Event::HandOff(HandOff::Take { min_revision: 42 });
/// Not owner: killed, settled, killed again, fenced, etcd back: the hand-off check is next.
const FENCED_AND_BACK: [Event; 6] = [
    NOT_OWNER,
    Killed(true),
    RetryDue,
    Killed(true),
    Fenced(true),
    HEALTHY,
];
/// [`FENCED_AND_BACK`], and the check says Take.
const TO_THE_TAKE: [Event; 7] = {
    let [a, b, c, d, e, f] = FENCED_AND_BACK;
    [a, b, c, d, e, f, TAKE]
};

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
    let (p, actions) = run(&[
        &active()[..],
        &TO_THE_TAKE,
        &[FinalStored(true), Recorded(true)],
    ]
    .concat());
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
            CheckHandOff { revision: None },
            TakeFinal {
                min_revision: 42,
                attempt: 1
            },
            WriteRecord,
        ]
    );
    assert!(p.final_in_store());
}

#[test]
fn the_take_phase_reads_claims_fixes_takes_and_records_one_call_per_step() {
    let (p, actions) = run(&with(
        FENCED_AND_BACK.to_vec(),
        &[
            Event::HandOff(HandOff::NeedRevision),
            RevisionRead(Some(42)),
            Event::HandOff(HandOff::Claim { epoch: 0 }),
            Claimed(true),
            Event::HandOff(HandOff::FixIntent { revision: 42 }),
            IntentCreated(true),
            TAKE,
            FinalStored(true),
            Recorded(true),
        ],
    ));
    assert_eq!(
        p.state(),
        State::Deactivated(FinalStep::Done(FinalOutcome::Taken))
    );
    assert_eq!(
        &actions[5..],
        &[
            CheckHandOff { revision: None },
            ReadRevision,
            CheckHandOff { revision: Some(42) },
            CreateClaim { epoch: 0 },
            CheckHandOff { revision: Some(42) },
            CreateIntent { revision: 42 },
            CheckHandOff { revision: Some(42) },
            TakeFinal {
                min_revision: 42,
                attempt: 1
            },
            WriteRecord,
        ]
    );
}

#[test]
fn a_failed_step_of_the_take_phase_checks_again_from_the_start() {
    let fenced = with(
        FENCED_AND_BACK.to_vec(),
        &[
            Event::HandOff(HandOff::NeedRevision),
            RevisionRead(Some(42)),
        ],
    );
    for failure in [
        vec![Event::HandOff(HandOff::Claim { epoch: 0 }), Claimed(false)],
        vec![
            Event::HandOff(HandOff::FixIntent { revision: 42 }),
            IntentCreated(false),
        ],
        vec![TAKE, FinalStored(true), Recorded(false)],
        vec![Event::HandOff(HandOff::Stored), Recorded(false)],
    ] {
        let (p, _) = run(&with(fenced.to_vec(), &failure));
        assert_eq!(
            p.state(),
            State::Deactivated(FinalStep::Backoff(Retry::Check)),
            "{failure:?}"
        );
        // The revision read is forgotten: the next check reads the cluster afresh.
        let (_, actions) = p.step(RetryDue);
        assert_eq!(
            actions,
            vec![CheckHandOff { revision: None }],
            "{failure:?}"
        );
    }
    let (p, _) = run(&with(fenced.to_vec(), &[]));
    let (p, actions) = p.step(RevisionRead(None));
    assert_eq!(p.state(), State::Deactivated(FinalStep::Checking));
    assert!(actions.is_empty(), "a read nobody asked for: {actions:?}");
    let (p, _) = run(&with(fenced[..7].to_vec(), &[RevisionRead(None)]));
    assert_eq!(
        p.state(),
        State::Deactivated(FinalStep::Backoff(Retry::Check))
    );
}

#[test]
fn a_check_whose_writes_never_show_gives_up_after_five_views() {
    let mut events = FENCED_AND_BACK.to_vec();
    for _ in 0..5 {
        events.extend([Event::HandOff(HandOff::Claim { epoch: 0 }), Claimed(true)]);
    }
    let (p, actions) = run(&events);
    assert_eq!(
        p.state(),
        State::Deactivated(FinalStep::Backoff(Retry::Unsettled))
    );
    let checks = actions
        .iter()
        .filter(|a| matches!(a, CheckHandOff { .. }))
        .count();
    assert_eq!(checks, 5);
    let (_, actions) = p.step(RetryDue);
    assert_eq!(actions, vec![CheckHandOff { revision: None }]);
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

mod exhaustive;
