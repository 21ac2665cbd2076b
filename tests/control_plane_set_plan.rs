//! The ControlPlaneSet planner against a simulated cluster: random Machine sets and random
//! events (hand deletions, template changes, failure domains added and removed, members that
//! turn unhealthy, Machines that fail to provision), with the quorum operator and the Machine
//! API simulated as the seeds describe them. Every plan is checked against the safety rules;
//! after the events stop, the set must settle with every Machine up to date and balanced.
//!
//! The simulated quorum operator adds one learner at a time on a Ready Machine without a
//! member, promotes it while there are at most `replicas` voters, and removes a deleting
//! Machine's member once a replacement votes (under Recreate: once the voters left keep
//! quorum); a deleting Machine disappears once its member is gone (its hook released).

use std::collections::BTreeMap;

use etcd_warden::operator::control_plane_set::plan::{
    Action, DomainField, MachineView, MemberRole, Observed, SetSpec, Strategy as UpdateStrategy,
    domain_targets, next_replacement, plan, spec_hash,
};
use etcd_warden::operator::quorum::plan::quorum;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Sim {
    spec: SetSpec,
    machines: Vec<MachineView>,
    /// Steps until a Machine (by name) becomes Ready.
    booting: BTreeMap<String, u8>,
    next: usize,
}

#[derive(Debug, Clone)]
enum Event {
    Tick,
    HandDelete(usize),
    TemplateChange,
    AddDomain(u8),
    RemoveDomain(usize),
    Unhealthy(usize),
    Healthy(usize),
    FailProvisioning(usize),
}

fn event() -> impl proptest::strategy::Strategy<Value = Event> {
    prop_oneof![
        6 => Just(Event::Tick),
        2 => (0..6usize).prop_map(Event::HandDelete),
        1 => Just(Event::TemplateChange),
        1 => (0..5u8).prop_map(Event::AddDomain),
        1 => (0..4usize).prop_map(Event::RemoveDomain),
        1 => (0..6usize).prop_map(Event::Unhealthy),
        2 => (0..6usize).prop_map(Event::Healthy),
        1 => (0..6usize).prop_map(Event::FailProvisioning),
    ]
}

fn domain_name(i: u8) -> String {
    format!("zone-{}", (b'a' + i) as char)
}

impl Sim {
    fn new(
        replicas: usize,
        strategy: UpdateStrategy,
        domains: Vec<String>,
        initial: &[(bool, Option<u8>, bool)],
    ) -> Sim {
        let mut sim = Sim {
            spec: SetSpec {
                replicas,
                strategy,
                failure_domains: domains,
                template_hash: "v1".into(),
            },
            machines: Vec::new(),
            booting: BTreeMap::new(),
            next: 0,
        };
        for &(old, domain, owned) in initial.iter().take(replicas) {
            let name = sim.name();
            sim.machines.push(MachineView {
                name,
                spec_hash: if old { "v0".into() } else { "v1".into() },
                failure_domain: domain.map(domain_name),
                ready: true,
                failed: false,
                deleting: false,
                owned,
                member: MemberRole::Voter { healthy: true },
            });
        }
        sim
    }

    fn name(&mut self) -> String {
        self.next += 1;
        format!("m{:03}", self.next)
    }

    fn observed(&self) -> Observed {
        Observed {
            machines: self.machines.clone(),
            nodes_without_machine: vec![],
        }
    }

    fn live(&self) -> impl Iterator<Item = &MachineView> {
        self.machines.iter().filter(|m| !m.deleting)
    }

    fn voters(&self) -> usize {
        self.machines.iter().filter(|m| m.member.votes_()).count()
    }

    /// Plans, checks the plan against the safety rules, applies it.
    fn reconcile(
        &mut self,
    ) -> Result<etcd_warden::operator::control_plane_set::plan::Plan, TestCaseError> {
        let p = plan(&self.spec, &self.observed());
        let changes: Vec<&Action> = p
            .actions
            .iter()
            .filter(|a| !matches!(a, Action::Adopt { .. }))
            .collect();
        prop_assert!(changes.len() <= 1, "one change at a time: {:?}", p.actions);
        let deleting = self.machines.iter().filter(|m| m.deleting).count();
        for action in &p.actions {
            match action {
                Action::Adopt { machine } => {
                    let m = self.machines.iter_mut().find(|m| &m.name == machine);
                    prop_assert!(m.is_some(), "adopting unknown {machine}");
                    m.unwrap().owned = true;
                }
                Action::Create { failure_domain, .. } => {
                    let after = self.machines.len() + 1;
                    prop_assert!(
                        after <= self.spec.replicas + 1,
                        "{after} machines for {} replicas",
                        self.spec.replicas
                    );
                    if self.spec.strategy == UpdateStrategy::Recreate {
                        prop_assert!(after <= self.spec.replicas, "Recreate surged");
                    }
                    if !self.spec.failure_domains.is_empty() {
                        prop_assert!(
                            failure_domain
                                .as_ref()
                                .is_some_and(|d| self.spec.failure_domains.contains(d)),
                            "created in {failure_domain:?}, domains {:?}",
                            self.spec.failure_domains
                        );
                    }
                    let name = self.name();
                    self.booting.insert(name.clone(), 2);
                    self.machines.push(MachineView {
                        name,
                        spec_hash: self.spec.template_hash.clone(),
                        failure_domain: failure_domain.clone(),
                        ready: false,
                        failed: false,
                        deleting: false,
                        owned: true,
                        member: MemberRole::None,
                    });
                }
                Action::Delete { machine, .. } => {
                    prop_assert!(
                        self.spec.strategy != UpdateStrategy::OnDelete,
                        "OnDelete deleted {machine}"
                    );
                    prop_assert_eq!(deleting, 0, "a second replacement at once");
                    let victim = self.machines.iter().find(|m| &m.name == machine).cloned();
                    prop_assert!(victim.is_some(), "deleting unknown {}", machine);
                    let victim = victim.unwrap();
                    prop_assert!(!victim.deleting);
                    let live_after = self.live().count() - 1;
                    if live_after >= self.spec.replicas {
                        // The surge's old Machine: everything else is Ready and votes.
                        for m in self.live().filter(|m| m.name != victim.name) {
                            prop_assert!(
                                m.ready && m.member.votes_(),
                                "deleted {} while {} is not Ready and voting",
                                victim.name,
                                m.name
                            );
                        }
                    } else {
                        prop_assert_eq!(self.spec.strategy, UpdateStrategy::Recreate);
                        let voters = self.voters();
                        let remaining = voters - usize::from(victim.member.votes_());
                        let healthy = self
                            .machines
                            .iter()
                            .filter(|m| {
                                m.name != victim.name
                                    && m.member == MemberRole::Voter { healthy: true }
                            })
                            .count();
                        prop_assert!(
                            remaining > 0 && healthy >= quorum(remaining),
                            "Recreate deleted {} leaving {healthy} healthy of {remaining}",
                            victim.name
                        );
                    }
                    self.machines
                        .iter_mut()
                        .find(|m| &m.name == machine)
                        .unwrap()
                        .deleting = true;
                }
            }
        }
        Ok(p)
    }

    /// The world moves one step: Machines boot, the quorum operator acts once, deleting
    /// Machines without a member go away.
    fn world(&mut self) {
        for m in &mut self.machines {
            if let Some(left) = self.booting.get_mut(&m.name) {
                if m.failed {
                    continue;
                }
                if *left == 0 {
                    m.ready = true;
                    self.booting.remove(&m.name);
                } else {
                    *left -= 1;
                }
            }
        }
        self.quorum_operator();
        self.machines
            .retain(|m| !(m.deleting && m.member == MemberRole::None));
    }

    fn quorum_operator(&mut self) {
        let replicas = self.spec.replicas;
        let voters = self.voters();
        let healthy = self
            .machines
            .iter()
            .filter(|m| m.member == MemberRole::Voter { healthy: true })
            .count();
        if healthy < quorum(voters.max(1)) {
            return;
        }
        // Remove a deleting Machine's member: a learner or nothing at once; a voter once a
        // replacement votes, or under Recreate once the others keep quorum.
        let removable = self.machines.iter().position(|m| {
            m.deleting
                && match m.member {
                    MemberRole::None => false,
                    MemberRole::Learner => true,
                    MemberRole::Voter { healthy: h } => {
                        let remaining = voters - 1;
                        let healthy_left = healthy - usize::from(h);
                        voters > replicas
                            || (self.spec.strategy == UpdateStrategy::Recreate
                                && remaining > 0
                                && healthy_left >= quorum(remaining))
                    }
                }
        });
        if let Some(i) = removable {
            self.machines[i].member = MemberRole::None;
            return;
        }
        // Promote the learner while there are at most `replicas` voters.
        if let Some(i) = self
            .machines
            .iter()
            .position(|m| m.member == MemberRole::Learner && !m.deleting)
        {
            if voters <= replicas {
                self.machines[i].member = MemberRole::Voter { healthy: true };
            }
            return;
        }
        // One learner at a time, on a Ready Machine without a member.
        if let Some(m) = self
            .machines
            .iter_mut()
            .find(|m| !m.deleting && m.ready && m.member == MemberRole::None)
        {
            m.member = MemberRole::Learner;
        }
    }

    fn event(&mut self, e: &Event) {
        let live: Vec<String> = self.live().map(|m| m.name.clone()).collect();
        let pick = |i: usize| live.get(i % live.len().max(1)).cloned();
        match e {
            Event::Tick => {}
            Event::HandDelete(i) => {
                if let Some(n) = pick(*i) {
                    self.find(&n).deleting = true;
                }
            }
            Event::TemplateChange => {
                let next = format!(
                    "v{}",
                    self.spec.template_hash[1..].parse::<u32>().unwrap() + 1
                );
                self.spec.template_hash = next;
            }
            Event::AddDomain(d) => {
                let d = domain_name(*d);
                if !self.spec.failure_domains.contains(&d) {
                    self.spec.failure_domains.push(d);
                }
            }
            Event::RemoveDomain(i) => {
                if !self.spec.failure_domains.is_empty() {
                    let at = i % self.spec.failure_domains.len();
                    self.spec.failure_domains.remove(at);
                }
            }
            Event::Unhealthy(i) => {
                if let Some(n) = pick(*i)
                    && let m = self.find(&n)
                    && m.member.votes_()
                {
                    m.member = MemberRole::Voter { healthy: false };
                }
            }
            Event::Healthy(i) => {
                if let Some(n) = pick(*i)
                    && let m = self.find(&n)
                    && m.member.votes_()
                {
                    m.member = MemberRole::Voter { healthy: true };
                }
            }
            Event::FailProvisioning(i) => {
                if let Some(n) = pick(*i)
                    && self.booting.contains_key(&n)
                {
                    self.find(&n).failed = true;
                }
            }
        }
    }

    fn find(&mut self, name: &str) -> &mut MachineView {
        self.machines.iter_mut().find(|m| m.name == name).unwrap()
    }

    /// Everyone heals; failed Machines are deleted by their owner (as seed 004 says); under
    /// OnDelete, the user deletes what the set waits for, one at a time.
    fn heal(&mut self) {
        for m in &mut self.machines {
            if m.member.votes_() {
                m.member = MemberRole::Voter { healthy: true };
            }
            if m.failed {
                m.deleting = true;
                m.failed = false;
                m.member = MemberRole::None;
            }
        }
        if self.spec.strategy == UpdateStrategy::OnDelete
            && !self.machines.iter().any(|m| m.deleting)
            && self.live().count() == self.spec.replicas
            && self.live().all(|m| m.ready && m.member.votes_())
            && let Some((name, _)) = next_replacement(&self.spec, &self.observed())
        {
            self.find(&name).deleting = true;
        }
    }
}

trait Votes {
    fn votes_(&self) -> bool;
}

impl Votes for MemberRole {
    fn votes_(&self) -> bool {
        matches!(self, MemberRole::Voter { .. })
    }
}

fn strategy() -> impl proptest::strategy::Strategy<Value = UpdateStrategy> {
    prop_oneof![
        Just(UpdateStrategy::RollingUpdate),
        Just(UpdateStrategy::Recreate),
        Just(UpdateStrategy::OnDelete)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn safe_at_every_step_and_settled_balanced_and_up_to_date(
        five in any::<bool>(),
        strategy in strategy(),
        domains in proptest::sample::subsequence(vec![0u8, 1, 2], 0..=3),
        initial in proptest::collection::vec((any::<bool>(), proptest::option::of(0u8..4), any::<bool>()), 5),
        events in proptest::collection::vec(event(), 0..40),
    ) {
        let replicas = if five { 5 } else { 3 };
        let mut sim = Sim::new(
            replicas,
            strategy,
            domains.into_iter().map(domain_name).collect(),
            &initial,
        );
        for e in &events {
            sim.event(e);
            sim.reconcile()?;
            sim.world();
        }
        // The events stop: the set settles.
        let mut settled = false;
        for _ in 0..600 {
            sim.heal();
            let p = sim.reconcile()?;
            sim.world();
            let progressing = p.conditions.iter().any(|c| c.kind == "Progressing" && c.status);
            if p.actions.is_empty()
                && !progressing
                && !sim.machines.iter().any(|m| m.deleting)
                && sim.machines.iter().all(|m| m.ready && m.member.votes_())
                && next_replacement(&sim.spec, &sim.observed()).is_none()
            {
                settled = true;
                break;
            }
        }
        prop_assert!(settled, "never settled: {:#?}", sim.machines);
        prop_assert_eq!(sim.machines.len(), replicas);
        for m in &sim.machines {
            prop_assert_eq!(&m.spec_hash, &sim.spec.template_hash, "{} outdated", m.name);
            prop_assert!(m.owned, "{} not adopted", m.name);
        }
        let mut targets = domain_targets(replicas, &sim.spec.failure_domains);
        targets.retain(|_, n| *n > 0);
        if !sim.spec.failure_domains.is_empty() {
            let mut counts: BTreeMap<Option<String>, usize> = BTreeMap::new();
            for m in &sim.machines {
                *counts.entry(m.failure_domain.clone()).or_default() += 1;
            }
            prop_assert_eq!(counts, targets);
        }
    }
}

#[test]
fn domain_targets_share_equally_and_reuse_alphabetically() {
    let d = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let t = domain_targets(3, &d(&["b", "a"]));
    assert_eq!(t.get(&Some("a".into())), Some(&2));
    assert_eq!(t.get(&Some("b".into())), Some(&1));
    let t = domain_targets(5, &d(&["c", "a", "b"]));
    assert_eq!(
        t.values().copied().collect::<Vec<_>>(),
        vec![2, 2, 1],
        "a, b, c"
    );
    assert_eq!(domain_targets(3, &[]), BTreeMap::from([(None, 3)]));
    let t = domain_targets(3, &d(&["a", "b", "c", "d"]));
    assert_eq!(t.values().copied().collect::<Vec<_>>(), vec![1, 1, 1, 0]);
}

#[test]
fn the_spec_hash_ignores_the_failure_domain_key_order_and_nulls() {
    let a = serde_json::json!({
        "providerSpec": {"value": {
            "instanceType": "m6i.xlarge",
            "placement": {"availabilityZone": "us-east-1a", "region": "us-east-1"},
            "ami": {"id": "ami-1"}
        }},
        "taints": null
    });
    let b = serde_json::json!({
        "providerSpec": {"value": {
            "ami": {"id": "ami-1"},
            "placement": {"region": "us-east-1", "availabilityZone": "us-east-1c"},
            "instanceType": "m6i.xlarge"
        }}
    });
    let aws = |spec: &serde_json::Value| spec_hash(spec, DomainField::AWS);
    assert_eq!(aws(&a), aws(&b));
    // b on another instance type.
    let mut c = b.clone();
    c["providerSpec"]["value"]["instanceType"] = "m6i.2xlarge".into();
    assert_ne!(aws(&b), aws(&c));
    // Another platform's field is part of the spec.
    assert_ne!(
        spec_hash(&a, DomainField::ZONE),
        spec_hash(&b, DomainField::ZONE)
    );
    // A placement that held only the zone is no placement: a template without one matches.
    let zoned = serde_json::json!({"providerSpec": {"value": {
        "instanceType": "m6i.xlarge", "placement": {"availabilityZone": "us-east-1a"}
    }}});
    let bare = serde_json::json!({"providerSpec": {"value": {"instanceType": "m6i.xlarge"}}});
    assert_eq!(aws(&zoned), aws(&bare));
    // ...while a placement with anything else stays part of the spec.
    assert_ne!(aws(&a), aws(&bare));

    let injected = DomainField::AWS.inject(&b, "us-east-1b");
    assert_eq!(
        DomainField::AWS.get(&injected).as_deref(),
        Some("us-east-1b")
    );
    assert_eq!(aws(&injected), aws(&b));
    let empty = DomainField::ZONE.inject(&serde_json::json!({}), "z1");
    assert_eq!(
        empty,
        serde_json::json!({"providerSpec": {"value": {"zone": "z1"}}})
    );
}

fn machine(name: &str, hash: &str, domain: Option<&str>) -> MachineView {
    MachineView {
        name: name.into(),
        spec_hash: hash.into(),
        failure_domain: domain.map(str::to_owned),
        ready: true,
        failed: false,
        deleting: false,
        owned: true,
        member: MemberRole::Voter { healthy: true },
    }
}

/// m1, m2 and m3 with spec hashes `hashes`, in `domains`' domains in turn (none when empty).
fn m1_to_m3(hashes: [&str; 3], domains: &[&str]) -> Vec<MachineView> {
    ["m1", "m2", "m3"]
        .into_iter()
        .zip(hashes)
        .enumerate()
        .map(|(i, (name, hash))| machine(name, hash, domains.get(i).copied()))
        .collect()
}

fn spec(strategy: UpdateStrategy, domains: &[&str]) -> SetSpec {
    SetSpec {
        replicas: 3,
        strategy,
        failure_domains: domains.iter().map(|s| s.to_string()).collect(),
        template_hash: "v2".into(),
    }
}

fn obs(machines: Vec<MachineView>) -> Observed {
    Observed {
        machines,
        nodes_without_machine: vec![],
    }
}

fn condition<'a>(
    p: &'a etcd_warden::operator::control_plane_set::plan::Plan,
    kind: &str,
) -> &'a etcd_warden::operator::control_plane_set::plan::Condition {
    p.conditions.iter().find(|c| c.kind == kind).unwrap()
}

#[test]
fn a_rolling_update_surges_in_the_old_machines_domain_and_deletes_only_after_it_votes() {
    let s = spec(UpdateStrategy::RollingUpdate, &["a", "b", "c"]);
    let mut machines = m1_to_m3(["v1", "v1", "v1"], &["a", "b", "c"]);
    let p = plan(&s, &obs(machines.clone()));
    assert_eq!(
        p.actions,
        vec![Action::Create {
            failure_domain: Some("a".into()),
            replaces: Some("m1".into())
        }]
    );
    let mut new = machine("m4", "v2", Some("a"));
    new.ready = true;
    new.member = MemberRole::Learner;
    machines.push(new);
    let p = plan(&s, &obs(machines.clone()));
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    assert_eq!(condition(&p, "Progressing").reason, "WaitingForReplacement");
    machines[3].member = MemberRole::Voter { healthy: true };
    let p = plan(&s, &obs(machines.clone()));
    assert_eq!(
        p.actions,
        vec![Action::Delete {
            machine: "m1".into(),
            reason: etcd_warden::operator::control_plane_set::plan::DeleteReason::Outdated
        }]
    );
    assert_eq!(p.counts.updated_replicas, 1);
}

#[test]
fn recreate_refuses_when_quorum_would_not_survive_and_says_so() {
    let s = spec(UpdateStrategy::Recreate, &[]);
    let mut machines = m1_to_m3(["v1", "v2", "v2"], &[]);
    machines[1].member = MemberRole::Voter { healthy: false };
    let p = plan(&s, &obs(machines.clone()));
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    let degraded = condition(&p, "Degraded");
    assert!(degraded.status);
    assert_eq!(degraded.reason, "RecreateWouldRiskQuorum");
    machines[1].member = MemberRole::Voter { healthy: true };
    let p = plan(&s, &obs(machines.clone()));
    assert!(matches!(&p.actions[..], [Action::Delete { machine, .. }] if machine == "m1"));
    // Deleted: no replacement until it is gone (no surge under Recreate).
    machines[0].deleting = true;
    let p = plan(&s, &obs(machines.clone()));
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    machines.remove(0);
    let p = plan(&s, &obs(machines));
    assert!(
        matches!(&p.actions[..], [Action::Create { .. }]),
        "{:?}",
        p.actions
    );
}

#[test]
fn on_delete_waits_and_a_hand_deleted_machine_is_replaced_in_its_domain() {
    let s = spec(UpdateStrategy::OnDelete, &["a", "b", "c"]);
    let mut machines = m1_to_m3(["v1", "v2", "v2"], &["a", "b", "c"]);
    let p = plan(&s, &obs(machines.clone()));
    assert!(p.actions.is_empty());
    let progressing = condition(&p, "Progressing");
    assert!(!progressing.status && progressing.reason == "WaitingForDeletion");
    machines[2].deleting = true;
    let p = plan(&s, &obs(machines));
    assert_eq!(
        p.actions,
        vec![Action::Create {
            failure_domain: Some("c".into()),
            replaces: Some("m3".into())
        }]
    );
}

#[test]
fn adoption_a_node_without_machine_and_bad_replicas() {
    let s = spec(UpdateStrategy::RollingUpdate, &[]);
    let mut machines = m1_to_m3(["v2", "v2", "v2"], &[]);
    machines[0].owned = false;
    let p = plan(&s, &obs(machines.clone()));
    assert_eq!(
        p.actions,
        vec![Action::Adopt {
            machine: "m1".into()
        }]
    );
    let mut o = obs(machines.clone());
    o.nodes_without_machine = vec!["master-9".into()];
    let p = plan(&s, &o);
    assert_eq!(condition(&p, "Degraded").reason, "NoMachineForNode");
    assert!(p.actions.iter().all(|a| matches!(a, Action::Adopt { .. })));
    let bad = SetSpec {
        replicas: 4,
        ..s.clone()
    };
    let p = plan(&bad, &obs(machines));
    assert_eq!(condition(&p, "Degraded").reason, "InvalidSpec");
}

#[test]
fn a_failed_replacement_degrades_and_is_not_doubled() {
    let s = spec(UpdateStrategy::RollingUpdate, &[]);
    let mut machines = m1_to_m3(["v1", "v2", "v2"], &[]);
    let mut new = machine("m4", "v2", None);
    new.ready = false;
    new.failed = true;
    new.member = MemberRole::None;
    machines.push(new);
    let p = plan(&s, &obs(machines));
    assert!(p.actions.is_empty(), "{:?}", p.actions);
    let degraded = condition(&p, "Degraded");
    assert!(
        degraded.status && degraded.reason == "MachineFailed",
        "{degraded:?}"
    );
}
