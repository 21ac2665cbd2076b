//! Property tests of the operator's planner: generated states and event sequences, with the
//! planned actions applied to a simulated cluster and every invariant checked at each step.

use etcd_warden::operator::quorum::plan::{
    Action, Condition, MachineState, MemberState, Observed, RemoveReason, Replacement, Spec, plan,
    quorum,
};
use proptest::prelude::*;

/// A simulated cluster: etcd members and machines, plus the facts the planner cannot change.
#[derive(Debug, Clone)]
struct Sim {
    desired: usize,
    replacement: Replacement,
    members: Vec<MemberState>,
    machines: Vec<MachineState>,
    leader_applied: u64,
    next_id: u64,
    next_machine: usize,
    /// The fewest voters allowed instead of `desired - 1`: 1 while a quorum restore's
    /// one-member cluster grows back.
    floor_override: Option<usize>,
}

/// Things that happen to the cluster, generated.
#[derive(Debug, Clone)]
enum Event {
    /// Run the planner and apply its first `limit` actions (the executor may stop anywhere).
    Plan {
        limit: usize,
    },
    CreateMachine,
    DeleteMachine(usize),
    /// The machine API finishes deleting a machine without hooks: its member's process is gone.
    Finalize(usize),
    /// Someone else removes our hook from a deleting machine.
    EscapeHatch(usize),
    SetHealth(usize, bool),
    CatchUp(usize),
    Writes(u64),
}

fn peer(n: usize) -> String {
    format!("http://127.0.0.1:{}", 20000 + n)
}

impl Sim {
    /// [`Sim::new`], settled.
    fn settled(desired: usize) -> Self {
        let mut sim = Sim::new(desired);
        sim.settle().unwrap();
        sim
    }

    /// Twenty steps, every started member caught up with the leader before each and the
    /// unhooked deleting Machines gone after it; the kinds of the actions taken.
    fn twenty_steps(&mut self) -> Vec<&'static str> {
        let mut kinds = vec![];
        for _ in 0..20 {
            for m in &mut self.members {
                if m.started() {
                    m.applied_index = self.leader_applied;
                }
            }
            let actions = self.step(usize::MAX).unwrap();
            kinds.extend(actions.iter().map(|a| a.kind()));
            self.finalize_unhooked();
        }
        kinds
    }

    fn new(desired: usize) -> Self {
        Sim::with(desired, Replacement::OnDeletion)
    }

    fn with(desired: usize, replacement: Replacement) -> Self {
        let mut s = Sim {
            desired,
            replacement,
            members: vec![],
            machines: vec![],
            leader_applied: 100,
            next_id: 1,
            next_machine: 0,
            floor_override: None,
        };
        for _ in 0..desired {
            let name = s.create_machine();
            s.members.push(MemberState {
                id: s.next_id,
                name: name.clone(),
                peer_urls: vec![peer(s.next_machine - 1)],
                is_learner: false,
                healthy: true,
                applied_index: 100,
            });
            s.next_id += 1;
        }
        s
    }

    fn create_machine(&mut self) -> String {
        let n = self.next_machine;
        self.next_machine += 1;
        let name = format!("m{n}");
        self.machines.push(MachineState {
            name: name.clone(),
            peer_url: peer(n),
            deleting: false,
            has_hook: false,
            hook_removed_by_other: false,
        });
        name
    }

    fn observed(&self) -> Observed {
        Observed {
            members: self.members.clone(),
            machines: self.machines.clone(),
            leader_applied_index: Some(self.leader_applied),
        }
    }

    fn voters(&self) -> usize {
        self.members.iter().filter(|m| !m.is_learner).count()
    }

    fn healthy_voters(&self) -> usize {
        self.members
            .iter()
            .filter(|m| !m.is_learner && m.healthy)
            .count()
    }

    fn learners(&self) -> usize {
        self.members.iter().filter(|m| m.is_learner).count()
    }

    fn machine(&self, name: &str) -> Option<&MachineState> {
        self.machines.iter().find(|m| m.name == name)
    }

    fn member_on(&self, mc: &MachineState) -> Option<&MemberState> {
        self.members.iter().find(|m| m.peer_urls[0] == mc.peer_url)
    }

    fn machine_of(&self, m: &MemberState) -> Option<&MachineState> {
        self.machines
            .iter()
            .find(|mc| mc.peer_url == m.peer_urls[0])
    }

    fn spec(&self) -> Spec {
        Spec {
            desired_voters: self.desired,
            replacement: self.replacement,
        }
    }

    /// The fewest voters a replacement may leave: one fewer than desired, while Recreate's
    /// deleted machine or a dead voter's deleted machine has no successor yet. Which removals
    /// may go below desired is checked where they are applied; this floor is what keeps them
    /// one at a time.
    fn floor(&self) -> usize {
        self.floor_override.unwrap_or(self.desired - 1)
    }

    /// Whether removing voter `m` now is the dead-voter rule: `m` is the only unhealthy member,
    /// its machine is being deleted, and no other voter is missing.
    fn dead_voter_removal(&self, m: &MemberState) -> bool {
        !m.healthy
            && self.members.iter().filter(|x| !x.healthy).count() == 1
            && self.machine_of(m).is_some_and(|mc| mc.deleting)
            && self.voters() >= self.desired
    }

    fn check_invariants(&self) -> Result<(), TestCaseError> {
        prop_assert!(
            self.voters() >= self.floor(),
            "voters below {} (two removals at once): {self:?}",
            self.floor()
        );
        prop_assert!(
            self.voters() <= self.desired + 1,
            "voters above desired+1: {self:?}"
        );
        prop_assert!(self.learners() <= 1, "more than one learner: {self:?}");
        Ok(())
    }

    /// Runs the planner, checks the plan against the state it was made from, applies up to
    /// `limit` actions (checking each against the current state) and returns the plan.
    fn step(&mut self, limit: usize) -> Result<Vec<Action>, TestCaseError> {
        let obs = self.observed();
        let p = plan(self.spec(), &obs);
        let membership: Vec<&Action> = p
            .actions
            .iter()
            .filter(|a| a.is_membership_change())
            .collect();
        prop_assert!(membership.len() <= 1, "more than one membership change");

        if self.healthy_voters() < quorum(self.voters()) {
            prop_assert!(p.actions.is_empty(), "acted on quorum loss: {p:?}");
            prop_assert!(matches!(p.condition, Condition::Degraded(_)));
        }
        // An even voter count lasts no longer than needed: with everyone healthy and a replaced
        // voter still in, its removal is the change planned.
        let deleting_voter = self
            .members
            .iter()
            .any(|m| !m.is_learner && self.machine_of(m).is_some_and(|mc| mc.deleting));
        if self.members.iter().all(|m| m.healthy)
            && self.voters() > self.desired
            && deleting_voter
            && self
                .members
                .iter()
                .all(|m| !m.is_learner || self.machine_of(m).is_some_and(|mc| !mc.deleting))
        {
            prop_assert!(
                matches!(membership.first(), Some(Action::RemoveMember { .. })),
                "extra voter kept: {p:?}"
            );
        }
        if self.members.iter().any(|m| !m.healthy) {
            for a in &membership {
                let Action::RemoveMember { member_id, .. } = a else {
                    prop_assert!(false, "membership change {a:?} with an unhealthy member");
                    unreachable!()
                };
                let m = self.members.iter().find(|m| m.id == *member_id).unwrap();
                prop_assert!(
                    !m.healthy,
                    "removed a healthy member while another is unhealthy"
                );
                prop_assert!(
                    self.machine_of(m).is_none_or(|mc| mc.deleting),
                    "removed an unhealthy member of a live machine"
                );
            }
        }

        for a in p.actions.iter().take(limit) {
            self.apply(a)?;
            self.check_invariants()?;
        }
        Ok(p.actions)
    }

    fn apply(&mut self, a: &Action) -> Result<(), TestCaseError> {
        match a {
            Action::AddHook { machine } => {
                let mc = self
                    .machines
                    .iter_mut()
                    .find(|m| &m.name == machine)
                    .unwrap();
                prop_assert!(
                    !(mc.deleting && mc.hook_removed_by_other),
                    "hook put back on {machine} after someone removed it"
                );
                mc.has_hook = true;
            }
            Action::ReleaseHook { machine } => {
                let mc = self.machine(machine).unwrap().clone();
                prop_assert!(
                    self.member_on(&mc).is_none(),
                    "hook released while {machine} still hosts a member"
                );
                self.machines
                    .iter_mut()
                    .find(|m| &m.name == machine)
                    .unwrap()
                    .has_hook = false;
            }
            Action::AddLearner { machine, peer_url } => {
                prop_assert_eq!(self.learners(), 0, "second learner added");
                prop_assert!(!self.machine(machine).unwrap().deleting);
                // etcd itself would refuse adding a member with an unhealthy cluster.
                prop_assert!(self.members.iter().all(|m| m.healthy));
                self.members.push(MemberState {
                    id: self.next_id,
                    name: String::new(),
                    peer_urls: vec![peer_url.clone()],
                    is_learner: true,
                    healthy: false,
                    applied_index: 0,
                });
                self.next_id += 1;
            }
            Action::StartMember { machine, member_id } => {
                let m = self
                    .members
                    .iter_mut()
                    .find(|m| m.id == *member_id)
                    .unwrap();
                m.name = machine.clone();
                m.healthy = true;
            }
            Action::Promote { member_id, machine } => {
                let mc = self.machine(machine).unwrap();
                prop_assert!(mc.has_hook, "promoted before the hook was on {machine}");
                prop_assert!(!mc.deleting, "promoted a learner on a deleting machine");
                let m = self
                    .members
                    .iter_mut()
                    .find(|m| m.id == *member_id)
                    .unwrap();
                prop_assert!(m.is_learner);
                m.is_learner = false;
            }
            Action::RemoveMember { member_id, .. } => {
                let m = self
                    .members
                    .iter()
                    .find(|m| m.id == *member_id)
                    .unwrap()
                    .clone();
                if !m.is_learner && m.healthy {
                    // Only Recreate's shrink removes a healthy voter before its replacement votes.
                    let shrink = self.replacement == Replacement::ShrinkFirst
                        && self.voters() == self.desired
                        && self.members.iter().all(|m| m.healthy && !m.is_learner)
                        && self.machine_of(&m).is_some_and(|mc| mc.deleting)
                        && self
                            .machines
                            .iter()
                            .all(|mc| mc.deleting || self.member_on(mc).is_some());
                    prop_assert!(
                        self.voters() > self.desired || shrink,
                        "healthy voter removed before its replacement votes"
                    );
                }
                if !m.is_learner && !m.healthy {
                    prop_assert!(
                        self.voters() > self.desired || self.dead_voter_removal(&m),
                        "unhealthy voter removed without a replacement voter while another member is unhealthy or a voter is missing: {self:?}"
                    );
                }
                self.members.retain(|x| x.id != *member_id);
                if !m.is_learner {
                    prop_assert!(
                        self.healthy_voters() >= quorum(self.voters()),
                        "removal left the cluster below quorum"
                    );
                }
            }
        }
        Ok(())
    }

    fn event(&mut self, e: &Event) -> Result<(), TestCaseError> {
        let pick = |len: usize, i: usize| (len > 0).then(|| i % len);
        match *e {
            Event::Plan { limit } => {
                self.step(limit)?;
            }
            Event::CreateMachine => {
                if self.machines.len() < self.desired + 3 {
                    self.create_machine();
                }
            }
            Event::DeleteMachine(i) => {
                if let Some(i) = pick(self.machines.len(), i) {
                    self.machines[i].deleting = true;
                }
            }
            Event::Finalize(i) => {
                if let Some(i) = pick(self.machines.len(), i) {
                    let mc = self.machines[i].clone();
                    if mc.deleting && !mc.has_hook {
                        self.machines.remove(i);
                        if let Some(m) = self
                            .members
                            .iter_mut()
                            .find(|m| m.peer_urls[0] == mc.peer_url)
                        {
                            m.healthy = false;
                        }
                    }
                }
            }
            Event::EscapeHatch(i) => {
                if let Some(i) = pick(self.machines.len(), i) {
                    let mc = &mut self.machines[i];
                    if mc.deleting && mc.has_hook {
                        mc.has_hook = false;
                        mc.hook_removed_by_other = true;
                    }
                }
            }
            Event::SetHealth(i, healthy) => {
                if let Some(i) = pick(self.members.len(), i) {
                    let gone = self.machine_of(&self.members[i]).is_none();
                    let m = &mut self.members[i];
                    // A member whose machine is gone, or that never started, cannot recover.
                    if m.started() && !gone {
                        m.healthy = healthy;
                    }
                }
            }
            Event::CatchUp(i) => {
                if let Some(i) = pick(self.members.len(), i) {
                    self.members[i].applied_index = self.leader_applied;
                }
            }
            Event::Writes(n) => self.leader_applied += n,
        }
        Ok(())
    }

    /// The machine API deletes deleting machines that no hook holds and no member lives on.
    fn finalize_unhooked(&mut self) {
        let members = self.members.clone();
        self.machines.retain(|mc| {
            !(mc.deleting && !mc.has_hook && !members.iter().any(|m| m.peer_urls[0] == mc.peer_url))
        });
    }

    /// Drives the planner with a well-behaved world (members catch up, the machine API deletes
    /// unhooked deleting machines) until it has nothing left to do.
    fn settle(&mut self) -> Result<Condition, TestCaseError> {
        for _ in 0..100 {
            for m in &mut self.members {
                if m.started() {
                    m.applied_index = self.leader_applied;
                }
            }
            let actions = self.step(usize::MAX)?;
            self.check_invariants()?;
            let before = self.machines.len();
            self.finalize_unhooked();
            if actions.is_empty() && before == self.machines.len() {
                let obs = self.observed();
                return Ok(plan(self.spec(), &obs).condition);
            }
        }
        prop_assert!(false, "planner did not settle: {self:?}");
        unreachable!()
    }
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (0usize..8).prop_map(|limit| Event::Plan { limit }),
        2 => Just(Event::CreateMachine),
        2 => any::<usize>().prop_map(Event::DeleteMachine),
        1 => any::<usize>().prop_map(Event::Finalize),
        1 => any::<usize>().prop_map(Event::EscapeHatch),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, h)| Event::SetHealth(i, h)),
        2 => any::<usize>().prop_map(Event::CatchUp),
        1 => (1u64..50).prop_map(Event::Writes),
    ]
}

fn desired() -> impl Strategy<Value = usize> {
    prop_oneof![Just(3usize), Just(5usize)]
}

fn replacement() -> impl Strategy<Value = Replacement> {
    prop_oneof![
        Just(Replacement::OnDeletion),
        Just(Replacement::Surge),
        Just(Replacement::ShrinkFirst)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Every invariant holds after every action, whatever happens around the operator.
    #[test]
    fn invariants_hold_under_any_event_sequence(
        desired in desired(),
        replacement in replacement(),
        events in prop::collection::vec(event(), 1..80),
    ) {
        let mut sim = Sim::with(desired, replacement);
        for e in &events {
            sim.event(e)?;
            sim.check_invariants()?;
        }
    }

    /// Replacing any set of machines, with replacements created in any order, ends with one
    /// voter per live machine, no learner, and every deleted machine gone.
    #[test]
    fn replacements_complete(
        desired in desired(),
        replacement in replacement(),
        to_replace in prop::collection::vec(any::<usize>(), 1..6),
        create_first in any::<bool>(),
    ) {
        let mut sim = Sim::with(desired, replacement);
        for i in to_replace {
            let live: Vec<usize> = (0..sim.machines.len()).filter(|&j| !sim.machines[j].deleting).collect();
            let victim = live[i % live.len()];
            if create_first {
                sim.create_machine();
                sim.step(usize::MAX)?;
                sim.machines[victim].deleting = true;
            } else {
                sim.machines[victim].deleting = true;
                sim.step(usize::MAX)?;
                sim.create_machine();
            }
        }
        let condition = sim.settle()?;
        prop_assert_eq!(condition, Condition::Settled);
        prop_assert_eq!(sim.voters(), desired);
        prop_assert_eq!(sim.learners(), 0);
        prop_assert!(sim.machines.iter().all(|m| !m.deleting && m.has_hook));
        for mc in &sim.machines {
            prop_assert!(sim.member_on(mc).is_some(), "machine {} has no member", mc.name);
        }
    }

    /// The executor may stop after any action and restart: the replacement still completes.
    #[test]
    fn interrupted_replacement_completes(
        desired in desired(),
        replacement in replacement(),
        limits in prop::collection::vec(0usize..3, 1..30),
    ) {
        let mut sim = Sim::with(desired, replacement);
        sim.settle()?;
        sim.machines[0].deleting = true;
        sim.create_machine();
        for limit in limits {
            for m in &mut sim.members {
                if m.started() {
                    m.applied_index = sim.leader_applied;
                }
            }
            sim.step(limit)?;
        }
        prop_assert_eq!(sim.settle()?, Condition::Settled);
        prop_assert!(sim.machine("m0").is_none());
        prop_assert_eq!(sim.voters(), desired);
    }
}

#[test]
fn deleted_machine_without_replacement_leaves_membership_untouched() {
    let mut sim = Sim::settled(3);
    sim.machines[1].deleting = true;
    let before = sim.members.clone();
    let condition = sim.settle().unwrap();
    assert_eq!(sim.members, before);
    let Condition::Waiting(reason) = condition else {
        panic!("expected Waiting, got {condition:?}")
    };
    assert!(reason.contains("no replacement machine"), "{reason}");
    assert!(sim.machines[1].has_hook, "the hook keeps the machine");
}

#[test]
fn escape_hatch_hook_is_not_put_back() {
    let mut sim = Sim::settled(3);
    sim.machines[1].deleting = true;
    sim.machines[1].has_hook = false;
    sim.machines[1].hook_removed_by_other = true;
    let p = plan(Spec::new(3).unwrap(), &sim.observed());
    assert!(
        !p.actions
            .iter()
            .any(|a| matches!(a, Action::AddHook { machine } if machine == "m1")),
        "{p:?}"
    );
    // The machine API then deletes it; its member dies; membership stays, reported Degraded.
    sim.event(&Event::Finalize(1)).unwrap();
    let p = plan(Spec::new(3).unwrap(), &sim.observed());
    assert!(p.actions.iter().all(|a| !a.is_membership_change()), "{p:?}");
    assert!(matches!(p.condition, Condition::Degraded(_)), "{p:?}");
}

#[test]
fn briefly_missing_member_is_not_a_scale_in() {
    let sim = Sim::settled(5);
    let mut obs = sim.observed();
    obs.members.remove(2);
    let p = plan(Spec::new(5).unwrap(), &obs);
    assert!(
        !p.actions
            .iter()
            .any(|a| matches!(a, Action::RemoveMember { .. } | Action::ReleaseHook { .. })),
        "{p:?}"
    );
}

#[test]
fn spec_accepts_only_3_or_5() {
    assert!(Spec::new(3).is_ok() && Spec::new(5).is_ok());
    for n in [0, 1, 2, 4, 6, 7] {
        assert!(Spec::new(n).is_err(), "{n}");
    }
}

#[test]
fn quorum_loss_is_reported_not_acted_on() {
    let mut sim = Sim::new(3);
    sim.members[0].healthy = false;
    sim.members[1].healthy = false;
    sim.machines[0].deleting = true;
    sim.create_machine();
    let p = plan(Spec::new(3).unwrap(), &sim.observed());
    assert!(p.actions.is_empty());
    let Condition::Degraded(reason) = p.condition else {
        panic!("{p:?}")
    };
    assert!(reason.contains("quorum lost"), "{reason}");
}

#[test]
fn one_replacement_in_order() {
    let mut sim = Sim::settled(3);
    sim.machines[0].deleting = true;
    sim.create_machine();
    let kinds = sim.twenty_steps();
    assert_eq!(
        kinds,
        [
            "add_learner",
            "add_hook",
            "start_member",
            "promote",
            "remove_member",
            "release_hook"
        ]
    );
}

/// Arbitrary observed states, not only those reachable from a healthy cluster: a few machines
/// with random flags, members on some of them (or on none), random roles and health.
fn arbitrary_state() -> impl Strategy<Value = (usize, Observed)> {
    let machine = (any::<bool>(), any::<bool>(), any::<bool>());
    let member = (
        0usize..9,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0u64..120,
    );
    (
        desired(),
        prop::collection::vec(machine, 0..8),
        prop::collection::vec(member, 0..8),
        prop::option::of(50u64..120),
    )
        .prop_map(|(desired, machines, members, leader)| {
            let machines: Vec<MachineState> = machines
                .into_iter()
                .enumerate()
                .map(|(i, (deleting, has_hook, removed))| MachineState {
                    name: format!("m{i}"),
                    peer_url: peer(i),
                    deleting,
                    has_hook,
                    hook_removed_by_other: deleting && removed && !has_hook,
                })
                .collect();
            let mut used = std::collections::HashSet::new();
            let members = members
                .into_iter()
                .enumerate()
                // One member per peer URL, as etcd enforces.
                .filter(|(_, (slot, ..))| used.insert(*slot))
                .map(
                    |(i, (slot, learner, healthy, started, applied))| MemberState {
                        id: 100 + i as u64,
                        name: if started || !learner {
                            format!("m{slot}")
                        } else {
                            String::new()
                        },
                        peer_urls: vec![peer(slot)],
                        is_learner: learner,
                        healthy: healthy && (started || !learner),
                        applied_index: applied,
                    },
                )
                .collect();
            (
                desired,
                Observed {
                    members,
                    machines,
                    leader_applied_index: leader,
                },
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// Whatever the observed state, each planned action is safe in that state.
    #[test]
    fn every_planned_action_is_safe_in_any_state(
        (desired, obs) in arbitrary_state(),
        replacement in replacement(),
    ) {
        let p = plan(Spec { desired_voters: desired, replacement }, &obs);
        let voters = obs.members.iter().filter(|m| !m.is_learner).count();
        let healthy_voters = obs.members.iter().filter(|m| !m.is_learner && m.healthy).count();
        let learners = obs.members.len() - voters;
        let all_healthy = obs.members.iter().all(|m| m.healthy);
        let machine = |name: &str| obs.machines.iter().find(|m| m.name == name).unwrap();
        let machine_of = |m: &MemberState| obs.machines.iter().find(|mc| mc.peer_url == m.peer_urls[0]);
        let member = |id: u64| obs.members.iter().find(|m| m.id == id).unwrap();

        if voters == 0 || healthy_voters < quorum(voters) {
            prop_assert!(p.actions.is_empty(), "{p:?}");
            prop_assert!(matches!(p.condition, Condition::Degraded(_)));
        }
        prop_assert!(p.actions.iter().filter(|a| a.is_membership_change()).count() <= 1);
        for a in &p.actions {
            match a {
                Action::AddHook { machine: name } => {
                    let mc = machine(name);
                    prop_assert!(!mc.has_hook);
                    prop_assert!(!(mc.deleting && mc.hook_removed_by_other), "escape hatch undone");
                }
                Action::ReleaseHook { machine: name } => {
                    let mc = machine(name);
                    prop_assert!(mc.deleting);
                    prop_assert!(obs.members.iter().all(|m| m.peer_urls[0] != mc.peer_url));
                }
                Action::AddLearner { machine: name, .. } => {
                    prop_assert!(all_healthy && learners == 0 && voters <= desired);
                    prop_assert!(!machine(name).deleting);
                }
                Action::StartMember { machine: name, member_id } => {
                    prop_assert!(member(*member_id).is_learner && !machine(name).deleting);
                }
                Action::Promote { member_id, machine: name } => {
                    let mc = machine(name);
                    prop_assert!(all_healthy && voters <= desired && learners == 1);
                    prop_assert!(member(*member_id).is_learner);
                    prop_assert!(mc.has_hook && !mc.deleting, "{mc:?}");
                }
                Action::RemoveMember { member_id, .. } => {
                    let m = member(*member_id);
                    if !m.is_learner {
                        // Recreate's shrink: the last resort, with everyone healthy, no machine
                        // to host a replacement, and desired - 1 voters left.
                        let shrink = replacement == Replacement::ShrinkFirst
                            && voters == desired
                            && all_healthy
                            && learners == 0
                            && obs.machines.iter().all(|mc| {
                                mc.deleting || obs.members.iter().any(|x| x.peer_urls[0] == mc.peer_url)
                            });
                        // A dead voter of a deleting machine: the only unhealthy member, no
                        // voter missing yet (never two removals at once).
                        let dead = !m.healthy
                            && obs.members.iter().filter(|x| !x.healthy).count() == 1
                            && machine_of(m).is_some_and(|mc| mc.deleting)
                            && voters >= desired;
                        prop_assert!(voters > desired || shrink || dead, "no replacement voter: {p:?}");
                        prop_assert!(!m.healthy || voters > desired || shrink, "healthy voter removed before its replacement votes: {p:?}");
                        prop_assert!(machine_of(m).is_none_or(|mc| mc.deleting));
                        let healthy_after = healthy_voters - usize::from(m.healthy);
                        prop_assert!(healthy_after >= quorum(voters - 1), "below quorum");
                    } else {
                        prop_assert!(machine_of(m).is_none_or(|mc| mc.deleting));
                    }
                    if !all_healthy {
                        prop_assert!(!m.healthy, "removed a healthy member while another is unhealthy");
                    }
                }
            }
        }
    }
}

#[test]
fn an_action_names_the_machine_and_member_it_acts_on() {
    let promote = Action::Promote {
        member_id: 0x2a,
        machine: "m4".into(),
    };
    assert_eq!(
        (promote.machine(), promote.member_id()),
        (Some("m4"), Some(0x2a))
    );
    let add = Action::AddLearner {
        machine: "m5".into(),
        peer_url: "http://127.0.0.1:2380".into(),
    };
    assert_eq!((add.machine(), add.member_id()), (Some("m5"), None));
    // A learner that never started has no name yet.
    let dangling = Action::RemoveMember {
        member_id: 7,
        name: String::new(),
        reason: RemoveReason::DanglingLearner,
    };
    assert_eq!((dangling.machine(), dangling.member_id()), (None, Some(7)));
}

// A dead control-plane machine, deleted by a machine health check (seed 003): its voter is
// removed first, then its replacement joins as a learner and is promoted.

/// A settled cluster whose machine `victim` died (its member unhealthy for good) and was
/// deleted.
fn dead_and_deleted(desired: usize, replacement: Replacement, victim: usize) -> Sim {
    let mut sim = Sim::with(desired, replacement);
    sim.settle().unwrap();
    sim.members[victim].healthy = false;
    sim.machines[victim].deleting = true;
    sim
}

/// With a new Machine created, the plan changes no membership and is Degraded: its reason.
fn paused_with_a_new_machine(sim: &mut Sim) -> String {
    sim.create_machine();
    let p = plan(sim.spec(), &sim.observed());
    assert!(membership_changes(&p).is_empty(), "{p:?}");
    let Condition::Degraded(reason) = p.condition else {
        panic!("{p:?}")
    };
    reason
}

fn membership_changes(p: &etcd_warden::operator::quorum::plan::Plan) -> Vec<&Action> {
    p.actions
        .iter()
        .filter(|a| a.is_membership_change())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// A dead voter's machine deleted and a new one created, in either order and with the
    /// executor stopping anywhere: every step keeps the invariants (quorum, one removal at a
    /// time, no healthy voter removed early), and the cluster ends with `desired` healthy voters
    /// and the dead machine gone.
    #[test]
    fn a_dead_machine_is_replaced(
        desired in desired(),
        replacement in replacement(),
        victim in any::<usize>(),
        create_after in 0usize..4,
        limits in prop::collection::vec(0usize..4, 0..12),
    ) {
        let victim = victim % desired;
        let mut sim = dead_and_deleted(desired, replacement, victim);
        let dead = sim.machines[victim].name.clone();
        let mut created = false;
        for (i, limit) in limits.into_iter().enumerate() {
            if i == create_after {
                sim.create_machine();
                created = true;
            }
            sim.step(limit)?;
            sim.check_invariants()?;
            sim.finalize_unhooked();
        }
        if !created {
            sim.create_machine();
        }
        prop_assert_eq!(sim.settle()?, Condition::Settled);
        prop_assert!(sim.machine(&dead).is_none(), "{:?}", sim);
        prop_assert_eq!(sim.voters(), desired);
        prop_assert_eq!(sim.learners(), 0);
        prop_assert!(sim.members.iter().all(|m| m.healthy), "{:?}", sim);
    }

    /// With the dead voter's machine deleted and any other member unhealthy, nothing changes
    /// membership: Degraded, as before the rule existed.
    #[test]
    fn another_unhealthy_member_keeps_membership_paused(
        desired in desired(),
        replacement in replacement(),
        victim in any::<usize>(),
        other in any::<usize>(),
        other_deleting in any::<bool>(),
        new_machine in any::<bool>(),
    ) {
        let victim = victim % desired;
        let other = (victim + 1 + other % (desired - 1)) % desired;
        let mut sim = dead_and_deleted(desired, replacement, victim);
        sim.members[other].healthy = false;
        sim.machines[other].deleting = other_deleting;
        if new_machine {
            sim.create_machine();
        }
        let p = plan(sim.spec(), &sim.observed());
        prop_assert!(membership_changes(&p).is_empty(), "{p:?}");
        prop_assert!(matches!(p.condition, Condition::Degraded(_)), "{p:?}");
    }
}

#[test]
fn a_dead_voter_of_a_deleting_machine_goes_first_then_its_replacement_joins() {
    let mut sim = dead_and_deleted(3, Replacement::OnDeletion, 1);
    sim.create_machine();
    let dead_id = sim.members[1].id;
    let p = plan(sim.spec(), &sim.observed());
    assert_eq!(
        membership_changes(&p),
        [&Action::RemoveMember {
            member_id: dead_id,
            name: "m1".into(),
            reason: RemoveReason::UnhealthyOnDeletingMachine,
        }]
    );
    let Condition::Progressing(reason) = &p.condition else {
        panic!("{p:?}")
    };
    assert!(reason.contains("m1"), "{reason}");
    let kinds = sim.twenty_steps();
    assert_eq!(
        kinds,
        [
            "remove_member",
            "release_hook",
            "add_learner",
            "add_hook",
            "start_member",
            "promote"
        ]
    );
    assert!(sim.machine("m1").is_none());
    assert_eq!(sim.voters(), 3);
    assert_eq!(
        plan(sim.spec(), &sim.observed()).condition,
        Condition::Settled
    );
}

#[test]
fn a_dead_voter_goes_before_a_replacement_machine_exists() {
    // The health check deletes first; the set (or a person) creates the new machine later. The
    // dead voter is removed and its hook released meanwhile: 2 healthy voters of 2 are a
    // quorum, and a dead third could only count against it.
    let mut sim = dead_and_deleted(3, Replacement::OnDeletion, 0);
    let p = plan(sim.spec(), &sim.observed());
    assert!(
        matches!(
            membership_changes(&p)[..],
            [Action::RemoveMember {
                reason: RemoveReason::UnhealthyOnDeletingMachine,
                ..
            }]
        ),
        "{p:?}"
    );
    sim.step(usize::MAX).unwrap();
    let p = plan(sim.spec(), &sim.observed());
    assert_eq!(
        p.actions,
        [Action::ReleaseHook {
            machine: "m0".into()
        }]
    );
    sim.step(usize::MAX).unwrap();
    sim.finalize_unhooked();
    assert!(sim.machine("m0").is_none());
    let p = plan(sim.spec(), &sim.observed());
    assert!(p.actions.is_empty(), "{p:?}");
    let Condition::Waiting(reason) = &p.condition else {
        panic!("{p:?}")
    };
    assert!(reason.contains("2 voters, 3 desired"), "{reason}");
    // The new machine appears: its learner is added.
    sim.create_machine();
    let p = plan(sim.spec(), &sim.observed());
    assert!(
        matches!(membership_changes(&p)[..], [Action::AddLearner { .. }]),
        "{p:?}"
    );
}

#[test]
fn a_deleting_machine_whose_member_is_already_gone_is_released_and_replaced() {
    // An administrator (or an operator that died after the removal) already removed the dead
    // member: the hook comes off and a learner is added in the same step.
    let mut sim = dead_and_deleted(3, Replacement::OnDeletion, 2);
    let dead = sim.members[2].id;
    sim.members.retain(|m| m.id != dead);
    sim.create_machine();
    let p = plan(sim.spec(), &sim.observed());
    assert_eq!(
        p.actions,
        [
            Action::ReleaseHook {
                machine: "m2".into()
            },
            Action::AddLearner {
                machine: "m3".into(),
                peer_url: peer(3),
            }
        ]
    );
}

#[test]
fn a_dead_voter_on_a_live_machine_stays_degraded() {
    // No machine is being deleted: nothing says the member is gone for good.
    let mut sim = Sim::settled(3);
    sim.members[1].healthy = false;
    let reason = paused_with_a_new_machine(&mut sim);
    assert_eq!(reason, "unhealthy member(s) m1; membership changes paused");
}

#[test]
fn a_second_dead_voter_waits_for_the_first_ones_replacement() {
    // 5 voters: the first dead voter goes; a second one dies and its machine is deleted before
    // the first one's replacement votes. 3 of 4 voters healthy would keep quorum after it went
    // too, but that would be two removals at once: Degraded until an administrator looks.
    let mut sim = dead_and_deleted(5, Replacement::OnDeletion, 0);
    sim.step(usize::MAX).unwrap();
    assert_eq!(sim.voters(), 4);
    sim.members
        .iter_mut()
        .find(|m| m.name == "m2")
        .unwrap()
        .healthy = false;
    sim.machines
        .iter_mut()
        .find(|m| m.name == "m2")
        .unwrap()
        .deleting = true;
    let reason = paused_with_a_new_machine(&mut sim);
    assert_eq!(reason, "unhealthy member(s) m2; membership changes paused");
}

#[test]
fn a_dead_voter_with_another_member_unhealthy_is_not_removed() {
    // 5 voters, two dead: quorum holds (3 of 5) but the rule wants every other member healthy.
    let mut sim = dead_and_deleted(5, Replacement::OnDeletion, 0);
    sim.members[3].healthy = false;
    let reason = paused_with_a_new_machine(&mut sim);
    assert_eq!(
        reason,
        "unhealthy member(s) m0, m3; membership changes paused"
    );
    // With 3 voters, a second unhealthy one is quorum lost: nothing at all is done.
    let mut sim = dead_and_deleted(3, Replacement::OnDeletion, 0);
    sim.members[1].healthy = false;
    let p = plan(sim.spec(), &sim.observed());
    assert!(p.actions.is_empty(), "{p:?}");
    assert!(matches!(p.condition, Condition::Degraded(_)), "{p:?}");
}

/// A settled cluster after a quorum restore: only `survivor`'s member is left, a one-member
/// cluster; the other machines either stay (wiped, to rejoin) or, with `replace`, are deleted
/// and new ones created.
fn restored(desired: usize, survivor: usize, replace: bool) -> Sim {
    let mut sim = Sim::settled(desired);
    let keep = sim.members[survivor % desired].clone();
    sim.members = vec![keep.clone()];
    sim.floor_override = Some(1);
    if replace {
        for mc in &mut sim.machines {
            if mc.peer_url != keep.peer_urls[0] {
                mc.deleting = true;
            }
        }
        for _ in 1..desired {
            sim.create_machine();
        }
    }
    sim
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// After a quorum restore the planner grows the one-member cluster back to `desired`
    /// voters: only learner additions and promotions, one learner at a time, the voter count
    /// never falling, whatever the executor completes of each plan.
    #[test]
    fn a_restored_cluster_grows_back_one_learner_at_a_time(
        desired in desired(),
        survivor in any::<usize>(),
        replace in any::<bool>(),
        limits in prop::collection::vec(0usize..4, 0..16),
    ) {
        let mut sim = restored(desired, survivor, replace);
        let mut voters = sim.voters();
        for limit in limits {
            for m in &mut sim.members {
                if m.started() {
                    m.applied_index = sim.leader_applied;
                }
            }
            let actions = sim.step(limit)?;
            for a in actions.iter().filter(|a| a.is_membership_change()) {
                prop_assert!(
                    matches!(a, Action::AddLearner { .. } | Action::Promote { .. }),
                    "{a:?} while growing back: {sim:?}"
                );
            }
            prop_assert!(sim.voters() >= voters, "a voter lost: {sim:?}");
            voters = sim.voters();
            sim.finalize_unhooked();
        }
        prop_assert_eq!(sim.settle()?, Condition::Settled);
        prop_assert_eq!(sim.voters(), desired);
        prop_assert_eq!(sim.learners(), 0);
        prop_assert!(sim.members.iter().all(|m| m.healthy), "{:?}", sim);
    }
}

#[test]
fn a_one_member_cluster_grows_back_in_order() {
    let mut sim = restored(3, 0, false);
    let kinds = sim.twenty_steps();
    assert_eq!(
        kinds,
        [
            "add_learner",
            "start_member",
            "promote",
            "add_learner",
            "start_member",
            "promote"
        ]
    );
    assert_eq!(sim.voters(), 3);
}
