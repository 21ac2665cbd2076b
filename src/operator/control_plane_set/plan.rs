//! The ControlPlaneSet planner (seeds 003 and 004): from the set's spec, the control-plane
//! Machines and what etcd says about their members, the next Machine actions. Pure, like
//! [`crate::operator::quorum::plan`]: the controller observes, plans, applies, and observes again.
//!
//! The set keeps `replicas` (3 or 5) Machines at the template's spec, spread over the failure
//! domains, replacing one Machine at a time:
//! - **RollingUpdate**: a replacement is created first (surge of one), in the failure domain the
//!   replaced Machine leaves; the old Machine is deleted only once every other Machine is Ready
//!   and its etcd member votes. Never more than `replicas + 1` Machines.
//! - **Recreate**: the old Machine is deleted first and its replacement created once it is gone,
//!   only when the voters left keep quorum with one fewer (3 voters: both others healthy).
//! - **OnDelete**: a Machine is replaced only once someone marks it for deletion.
//!
//! In every strategy a Machine deleted by hand is replaced in the same failure domain (unless
//! rebalancing moves it), and quorum itself is the quorum operator's: the Machines' pre-drain
//! hooks hold a deleting Machine until its member is gone.
//!
//! A Machine is up to date when its spec, without the failure-domain field the controller
//! injects, hashes like the template's ([`spec_hash`]). Failure domains are used equally,
//! reused in alphabetical order when there are fewer than replicas ([`domain_targets`]); a
//! domain added or removed makes Machines misplaced, and they are replaced like outdated ones.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::operator::quorum::plan::quorum;

/// How outdated Machines are replaced (`spec.strategy.type` of the resource).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, schemars::JsonSchema,
)]
pub enum Strategy {
    /// Create the replacement, wait until it is Ready and votes, then delete the old Machine.
    #[default]
    RollingUpdate,
    /// Delete the old Machine (only when quorum survives one voter fewer), then create.
    Recreate,
    /// Replace a Machine only once it is marked for deletion.
    OnDelete,
}

/// What the set asks for (after validation: `replicas` is 3 or 5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetSpec {
    /// Desired Machines, 3 or 5.
    pub replicas: usize,
    /// How outdated Machines are replaced.
    pub strategy: Strategy,
    /// Failure domains; empty means one (whatever the template gives).
    pub failure_domains: Vec<String>,
    /// [`spec_hash`] of the template's Machine spec.
    pub template_hash: String,
}

/// The etcd member on a Machine, as the quorum operator and etcd report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub enum MemberRole {
    /// No member for this Machine (yet, or any more).
    #[default]
    None,
    /// A raft learner (not voting).
    Learner,
    /// A voting member.
    Voter {
        /// Answers and knows a leader.
        healthy: bool,
    },
}

impl MemberRole {
    fn votes(self) -> bool {
        matches!(self, MemberRole::Voter { .. })
    }
}

/// One control-plane Machine matching the set's selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineView {
    /// Machine name.
    pub name: String,
    /// [`spec_hash`] of its spec.
    pub spec_hash: String,
    /// The failure domain in its provider spec, if any.
    pub failure_domain: Option<String>,
    /// Its node is Ready (phase Running and the node reports Ready).
    pub ready: bool,
    /// Provisioning failed (phase Failed): it will not become Ready by itself.
    pub failed: bool,
    /// Marked for deletion.
    pub deleting: bool,
    /// Carries the set's owner reference (else it is adopted).
    pub owned: bool,
    /// Its etcd member.
    pub member: MemberRole,
}

/// Everything the planner looks at.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observed {
    /// Machines matching the selector.
    pub machines: Vec<MachineView>,
    /// Control-plane nodes that no Machine backs (the set stops acting while there are any).
    pub nodes_without_machine: Vec<String>,
}

/// Why a Machine is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeleteReason {
    /// Its spec differs from the template.
    Outdated,
    /// Its failure domain is not (or no longer) where the balance wants it.
    Misplaced,
}

/// One step for the controller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Put the set's label on a Machine that matches the selector.
    Adopt {
        /// Machine name.
        machine: String,
    },
    /// Create a Machine from the template in `failure_domain`.
    Create {
        /// The domain to inject; `None` leaves the template's.
        failure_domain: Option<String>,
        /// The Machine it replaces, when there is one.
        replaces: Option<String>,
    },
    /// Delete a Machine (its pre-drain hook holds it until its member is gone).
    Delete {
        /// Machine name.
        machine: String,
        /// Why.
        reason: DeleteReason,
    },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Adopt { machine } => write!(f, "adopt machine {machine}"),
            Action::Create {
                failure_domain,
                replaces,
            } => {
                write!(f, "create a machine")?;
                if let Some(d) = failure_domain {
                    write!(f, " in failure domain {d}")?;
                }
                if let Some(r) = replaces {
                    write!(f, " to replace {r}")?;
                }
                Ok(())
            }
            Action::Delete { machine, reason } => {
                write!(f, "delete machine {machine} ({reason:?})")
            }
        }
    }
}

/// A condition as Kubernetes writes them: `type` with status True/False, a reason and a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Condition {
    /// `Available`, `Progressing` or `Degraded`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// True or false.
    pub status: bool,
    /// CamelCase reason.
    pub reason: &'static str,
    /// For a person.
    pub message: String,
}

/// The status counts of seed 004.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// Machines of the set, deleting ones included.
    pub replicas: usize,
    /// Machines not being deleted whose node is Ready.
    pub ready_replicas: usize,
    /// Machines not being deleted whose spec matches the template.
    pub updated_replicas: usize,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Adoptions first, then at most one Create or Delete.
    pub actions: Vec<Action>,
    /// Available, Progressing, Degraded.
    pub conditions: Vec<Condition>,
    /// For the status subresource.
    pub counts: Counts,
}

/// How many Machines each failure domain should hold: equal shares, the remainder to the
/// alphabetically first domains. No domains: one anonymous domain holds all.
pub fn domain_targets(replicas: usize, domains: &[String]) -> BTreeMap<Option<String>, usize> {
    let mut sorted: Vec<&String> = domains.iter().collect();
    sorted.sort();
    sorted.dedup();
    if sorted.is_empty() {
        return BTreeMap::from([(None, replicas)]);
    }
    let (each, extra) = (replicas / sorted.len(), replicas % sorted.len());
    sorted
        .into_iter()
        .enumerate()
        .map(|(i, d)| (Some(d.clone()), each + usize::from(i < extra)))
        .collect()
}

/// Where a platform's provider spec keeps the failure domain: a JSON pointer into the Machine
/// spec. The extension point for another platform is one more pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DomainField(pub &'static str);

impl DomainField {
    /// AWS: `providerSpec.value.placement.availabilityZone`.
    pub const AWS: DomainField = DomainField("/providerSpec/value/placement/availabilityZone");
    /// Azure and GCP: `providerSpec.value.zone`.
    pub const ZONE: DomainField = DomainField("/providerSpec/value/zone");
    /// OpenStack: `providerSpec.value.availabilityZone`.
    pub const OPENSTACK: DomainField = DomainField("/providerSpec/value/availabilityZone");
    /// vSphere: `providerSpec.value.workspace.datacenter`.
    pub const VSPHERE: DomainField = DomainField("/providerSpec/value/workspace/datacenter");

    /// The failure domain in `spec`, if set.
    pub fn get(self, spec: &Value) -> Option<String> {
        spec.pointer(self.0)
            .and_then(Value::as_str)
            .map(str::to_owned)
    }

    /// `spec` with the failure domain set (creating the objects on the way).
    pub fn inject(self, spec: &Value, domain: &str) -> Value {
        let mut out = spec.clone();
        let mut at = &mut out;
        let parts: Vec<&str> = self.0.split('/').skip(1).collect();
        for (i, part) in parts.iter().enumerate() {
            if !at.is_object() {
                *at = Value::Object(Default::default());
            }
            let map = at.as_object_mut().expect("made an object above");
            if i + 1 == parts.len() {
                map.insert((*part).to_owned(), Value::String(domain.to_owned()));
                break;
            }
            at = map
                .entry((*part).to_owned())
                .or_insert_with(|| Value::Object(Default::default()));
        }
        out
    }

    /// `spec` without the failure domain, and without the objects that held only it (an AWS
    /// spec whose `placement` carried just the zone equals a template without `placement`).
    pub fn strip(self, spec: &Value) -> Value {
        let mut out = spec.clone();
        let mut path = self.0;
        while let Some((parent, leaf)) = path.rsplit_once('/') {
            let Some(Value::Object(map)) = out.pointer_mut(parent) else {
                break;
            };
            if path != self.0
                && !map
                    .get(leaf)
                    .is_some_and(|v| v.as_object().is_some_and(|o| o.is_empty()))
            {
                break;
            }
            map.remove(leaf);
            path = parent;
        }
        out
    }
}

/// A stable hash of a Machine spec without its failure domain: SHA-256 of the spec as JSON with
/// every object's keys sorted and nulls dropped (an absent field and a null one are the same
/// spec), hex.
pub fn spec_hash(spec: &Value, field: DomainField) -> String {
    fn canonical(v: &Value, out: &mut String) {
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map
                    .iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, _)| k)
                    .collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String((*k).clone()).to_string());
                    out.push(':');
                    canonical(&map[k.as_str()], out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical(item, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut text = String::new();
    canonical(&field.strip(spec), &mut text);
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn condition(kind: &'static str, status: bool, reason: &'static str, message: String) -> Condition {
    Condition {
        kind,
        status,
        reason,
        message,
    }
}

/// What the one step is, or why there is none.
enum Progress {
    /// A Create or Delete.
    Acting(Action),
    /// A replacement is under way; waiting for the world to catch up.
    Progressing(&'static str, String),
    /// Nothing to do until someone acts (OnDelete), and nothing wrong.
    Idle(&'static str, String),
    /// Something needs an administrator.
    Blocked(&'static str, String),
    /// Every Machine is up to date and in place.
    Settled,
}

/// Decides the next actions. Pure: same input, same plan.
pub fn plan(spec: &SetSpec, obs: &Observed) -> Plan {
    let live: Vec<&MachineView> = obs.machines.iter().filter(|m| !m.deleting).collect();
    let counts = Counts {
        replicas: obs.machines.len(),
        ready_replicas: live.iter().filter(|m| m.ready).count(),
        updated_replicas: live
            .iter()
            .filter(|m| m.spec_hash == spec.template_hash)
            .count(),
    };
    let mut actions: Vec<Action> = obs
        .machines
        .iter()
        .filter(|m| !m.owned && !m.deleting)
        .map(|m| Action::Adopt {
            machine: m.name.clone(),
        })
        .collect();

    let progress = if !matches!(spec.replicas, 3 | 5) {
        Progress::Blocked(
            "InvalidSpec",
            format!("spec.replicas must be 3 or 5, got {}", spec.replicas),
        )
    } else if !obs.nodes_without_machine.is_empty() {
        Progress::Blocked(
            "NoMachineForNode",
            format!(
                "control-plane node(s) {} have no Machine; remove the node or create its Machine",
                obs.nodes_without_machine.join(", ")
            ),
        )
    } else {
        step(spec, obs, &live)
    };

    let available = counts.ready_replicas >= quorum(spec.replicas.max(1));
    let failed: Vec<&str> = live
        .iter()
        .filter(|m| m.failed)
        .map(|m| m.name.as_str())
        .collect();
    let mut conditions = vec![condition(
        "Available",
        available,
        if available {
            "AsExpected"
        } else {
            "NotEnoughReadyMachines"
        },
        format!(
            "{} of {} machines ready; quorum needs {}",
            counts.ready_replicas,
            spec.replicas,
            quorum(spec.replicas.max(1))
        ),
    )];
    let (progressing, degraded) = match progress {
        Progress::Acting(action) => {
            let text = action.to_string();
            actions.push(action);
            (condition("Progressing", true, "Replacing", text), None)
        }
        Progress::Progressing(reason, text) => (condition("Progressing", true, reason, text), None),
        Progress::Idle(reason, text) => (condition("Progressing", false, reason, text), None),
        Progress::Blocked(reason, text) => (
            condition("Progressing", false, reason, text.clone()),
            Some(condition("Degraded", true, reason, text)),
        ),
        Progress::Settled => (
            condition(
                "Progressing",
                false,
                "AsExpected",
                "every machine is up to date".into(),
            ),
            None,
        ),
    };
    conditions.push(progressing);
    conditions.push(match degraded {
        Some(d) => d,
        None if !failed.is_empty() => condition(
            "Degraded",
            true,
            "MachineFailed",
            format!(
                "machine(s) {} failed to provision; delete them to retry",
                failed.join(", ")
            ),
        ),
        None if !available => condition(
            "Degraded",
            true,
            "NotEnoughReadyMachines",
            format!(
                "{} of {} machines ready",
                counts.ready_replicas, spec.replicas
            ),
        ),
        None => condition("Degraded", false, "AsExpected", String::new()),
    });
    Plan {
        actions,
        conditions,
        counts,
    }
}

/// What the rules of one step look at: the set, its Machines, and the domains' shares.
struct Scene<'a> {
    spec: &'a SetSpec,
    /// The Machines not being deleted.
    live: &'a [&'a MachineView],
    /// The Machines being deleted.
    deleting: Vec<&'a MachineView>,
    /// Every Machine, deleting or not.
    total: usize,
    /// Machines wanted per failure domain ([`domain_targets`]).
    targets: BTreeMap<Option<String>, usize>,
    /// Live Machines to replace ([`replaceable`]).
    stale: Vec<&'a MachineView>,
}

/// The one Create or Delete to do now, or why there is none. The rules are tried in this
/// order, and the first that answers decides.
fn step(spec: &SetSpec, obs: &Observed, live: &[&MachineView]) -> Progress {
    let targets = domain_targets(spec.replicas, &spec.failure_domains);
    let scene = Scene {
        spec,
        live,
        deleting: obs.machines.iter().filter(|m| m.deleting).collect(),
        total: obs.machines.len(),
        stale: replaceable(spec, live, &targets),
        targets,
    };
    if live.len() < spec.replicas {
        return scene.create_missing();
    }
    if let Some(blocked) = scene.blocked() {
        return blocked;
    }
    if let Some(waiting) = scene.removal_under_way() {
        return waiting;
    }
    let Some(victim) = pick_victim(live, &scene.stale, &scene.targets) else {
        return scene.nothing_to_replace();
    };
    let reason = delete_reason(spec, victim);
    if spec.strategy == Strategy::OnDelete {
        return on_delete_waits(victim, reason);
    }
    if live.len() == spec.replicas {
        return match spec.strategy {
            Strategy::RollingUpdate => scene.surge(victim),
            _ => scene.recreate(victim, reason),
        };
    }
    scene.delete_surged(victim, reason)
}

/// Why `victim` is replaced: its spec is outdated, else its domain is wrong.
fn delete_reason(spec: &SetSpec, victim: &MachineView) -> DeleteReason {
    if victim.spec_hash != spec.template_hash {
        DeleteReason::Outdated
    } else {
        DeleteReason::Misplaced
    }
}

/// OnDelete replaces nothing by itself: it waits for someone to delete `victim`.
fn on_delete_waits(victim: &MachineView, reason: DeleteReason) -> Progress {
    Progress::Idle(
        "WaitingForDeletion",
        format!(
            "machine {} is {}; OnDelete replaces it once it is deleted",
            victim.name,
            if reason == DeleteReason::Outdated {
                "outdated"
            } else {
                "misplaced"
            }
        ),
    )
}

impl Scene<'_> {
    /// Fewer live Machines than replicas (deleted by hand, or the old half of a replacement):
    /// create, in the domain short of most. RollingUpdate and OnDelete surge past a deleting
    /// Machine (never above replicas + 1 in all); Recreate waits until it is gone.
    fn create_missing(&self) -> Progress {
        let room = match self.spec.strategy {
            Strategy::Recreate => self.total < self.spec.replicas,
            Strategy::RollingUpdate | Strategy::OnDelete => self.total <= self.spec.replicas,
        };
        if !room {
            let names: Vec<&str> = self.deleting.iter().map(|m| m.name.as_str()).collect();
            return Progress::Progressing(
                "WaitingForRemoval",
                format!(
                    "waiting for machine(s) {} to be removed before creating a replacement",
                    names.join(", ")
                ),
            );
        }
        let (domain, replaces) = self.replacement_domain();
        Progress::Acting(Action::Create {
            failure_domain: domain,
            replaces: replaces.map(|m| m.name.clone()),
        })
    }

    /// Where a missing Machine is created, and the deleting Machine it replaces: in the deleted
    /// Machine's own domain while that domain is short; else where the balance wants it (a
    /// domain added or removed meanwhile).
    fn replacement_domain(&self) -> (Option<String>, Option<&MachineView>) {
        let anonymous = self.targets.contains_key(&None);
        let deficits = deficits(self.live, &self.stale, &self.targets);
        let own = self.deleting.iter().find(|m| {
            let domain = if anonymous {
                None
            } else {
                m.failure_domain.clone()
            };
            deficits.get(&domain).is_some_and(|&d| d > 0)
        });
        match own {
            Some(m) if !anonymous => (m.failure_domain.clone(), Some(*m)),
            Some(m) => (None, Some(*m)),
            None => (
                short_domain(self.live, &self.stale, &self.targets),
                self.deleting.first().copied(),
            ),
        }
    }

    /// A Machine that failed to provision, or more live Machines than one surge allows, needs
    /// an administrator.
    fn blocked(&self) -> Option<Progress> {
        if let Some(f) = self.live.iter().find(|m| m.failed) {
            return Some(Progress::Blocked(
                "MachineFailed",
                format!("machine {} failed to provision; delete it to retry", f.name),
            ));
        }
        (self.live.len() > self.spec.replicas + 1).then(|| {
            Progress::Blocked(
                "TooManyMachines",
                format!(
                    "{} machines for {} replicas; remove the extra machines by hand",
                    self.live.len(),
                    self.spec.replicas
                ),
            )
        })
    }

    /// The old half of a replacement (or a hand-deleted Machine) is still being removed: one
    /// replacement at a time.
    fn removal_under_way(&self) -> Option<Progress> {
        (!self.deleting.is_empty()).then(|| {
            let names: Vec<&str> = self.deleting.iter().map(|m| m.name.as_str()).collect();
            Progress::Progressing(
                "WaitingForRemoval",
                format!("waiting for machine(s) {} to be removed", names.join(", ")),
            )
        })
    }

    /// No Machine to replace: settled, unless a Machine too many is there that no rule removes.
    fn nothing_to_replace(&self) -> Progress {
        if self.live.len() > self.spec.replicas {
            Progress::Blocked(
                "TooManyMachines",
                format!(
                    "{} machines for {} replicas and none outdated or misplaced; remove the extra machine by hand",
                    self.live.len(),
                    self.spec.replicas
                ),
            )
        } else {
            Progress::Settled
        }
    }

    /// RollingUpdate at `replicas`: the replacement for `victim` is created first (a surge of
    /// one), in the domain short of most.
    fn surge(&self, victim: &MachineView) -> Progress {
        Progress::Acting(Action::Create {
            failure_domain: short_domain(self.live, &self.stale, &self.targets),
            replaces: Some(victim.name.clone()),
        })
    }

    /// Recreate at `replicas`: `victim` is deleted first, once every Machine is Ready and only
    /// when the voters left keep quorum with one fewer.
    fn recreate(&self, victim: &MachineView, reason: DeleteReason) -> Progress {
        if let Some(m) = self.live.iter().find(|m| !m.ready) {
            return Progress::Progressing(
                "WaitingForReady",
                format!("waiting for machine {} to be Ready", m.name),
            );
        }
        match recreate_keeps_quorum(self.live, victim) {
            Ok(()) => Progress::Acting(Action::Delete {
                machine: victim.name.clone(),
                reason,
            }),
            Err(text) => Progress::Blocked("RecreateWouldRiskQuorum", text),
        }
    }

    /// Surged by one (a RollingUpdate's replacement, or a strategy changed mid-way): the old
    /// Machine goes once every other Machine is Ready and its member votes.
    fn delete_surged(&self, victim: &MachineView, reason: DeleteReason) -> Progress {
        if let Some(m) = self
            .live
            .iter()
            .find(|m| m.name != victim.name && !(m.ready && m.member.votes()))
        {
            return Progress::Progressing(
                "WaitingForReplacement",
                format!(
                    "waiting for machine {} to be Ready with a voting etcd member before deleting {}",
                    m.name, victim.name
                ),
            );
        }
        Progress::Acting(Action::Delete {
            machine: victim.name.clone(),
            reason,
        })
    }
}

/// The Machine the set replaces next and why (what OnDelete waits for someone to delete).
pub fn next_replacement(spec: &SetSpec, obs: &Observed) -> Option<(String, DeleteReason)> {
    let live: Vec<&MachineView> = obs.machines.iter().filter(|m| !m.deleting).collect();
    let targets = domain_targets(spec.replicas, &spec.failure_domains);
    let stale = replaceable(spec, &live, &targets);
    pick_victim(&live, &stale, &targets).map(|m| (m.name.clone(), delete_reason(spec, m)))
}

/// Whether deleting `victim` leaves voters that keep quorum: the voters other than the victim's
/// member, healthy ones counted, against the quorum of one voter fewer.
fn recreate_keeps_quorum(live: &[&MachineView], victim: &MachineView) -> Result<(), String> {
    let voters = live.iter().filter(|m| m.member.votes()).count();
    let remaining = if victim.member.votes() {
        voters - 1
    } else {
        voters
    };
    let healthy_remaining = live
        .iter()
        .filter(|m| m.name != victim.name && m.member == MemberRole::Voter { healthy: true })
        .count();
    if remaining == 0 || healthy_remaining < quorum(remaining) {
        return Err(format!(
            "Recreate would delete machine {} leaving {healthy_remaining} healthy of {remaining} voters (quorum {}); waiting",
            victim.name,
            quorum(remaining.max(1))
        ));
    }
    Ok(())
}

/// Live Machines to replace: outdated, in a domain the set does not use, or beyond their
/// domain's share (the outdated ones of a crowded domain first, then the last by name).
fn replaceable<'a>(
    spec: &SetSpec,
    live: &[&'a MachineView],
    targets: &BTreeMap<Option<String>, usize>,
) -> Vec<&'a MachineView> {
    let anonymous = targets.contains_key(&None);
    let domain_of = |m: &MachineView| {
        if anonymous {
            None
        } else {
            m.failure_domain.clone()
        }
    };
    let mut out: Vec<&MachineView> = live
        .iter()
        .copied()
        .filter(|m| m.spec_hash != spec.template_hash || !targets.contains_key(&domain_of(m)))
        .collect();
    for (domain, &target) in targets {
        let mut here: Vec<&MachineView> = live
            .iter()
            .copied()
            .filter(|m| &domain_of(m) == domain && !out.iter().any(|o| o.name == m.name))
            .collect();
        let over = here.len().saturating_sub(target);
        // The last by name go first.
        here.sort_by(|a, b| b.name.cmp(&a.name));
        out.extend(here.into_iter().take(over));
    }
    out
}

/// How many Machines each domain lacks once `stale` ones are left out (negative: too many).
fn deficits(
    live: &[&MachineView],
    stale: &[&MachineView],
    targets: &BTreeMap<Option<String>, usize>,
) -> BTreeMap<Option<String>, i64> {
    let anonymous = targets.contains_key(&None);
    targets
        .iter()
        .map(|(domain, &target)| {
            let kept = live
                .iter()
                .filter(|m| !stale.iter().any(|s| s.name == m.name))
                .filter(|m| anonymous || &m.failure_domain == domain)
                .count();
            (domain.clone(), target as i64 - kept as i64)
        })
        .collect()
}

/// The domain short of most Machines once `stale` ones are left out (ties: alphabetical).
fn short_domain(
    live: &[&MachineView],
    stale: &[&MachineView],
    targets: &BTreeMap<Option<String>, usize>,
) -> Option<String> {
    deficits(live, stale, targets)
        .into_iter()
        // Largest deficit; among equals the alphabetically first (max_by keeps the last max).
        .rev()
        .max_by_key(|(_, deficit)| *deficit)
        .and_then(|(d, _)| d)
}

/// The Machine to replace next: in the most crowded domain, outdated before misplaced, the last
/// by name first; zone by zone, so a rolling update finishes one domain before the next.
fn pick_victim<'a>(
    live: &[&'a MachineView],
    stale: &[&'a MachineView],
    targets: &BTreeMap<Option<String>, usize>,
) -> Option<&'a MachineView> {
    let anonymous = targets.contains_key(&None);
    let crowding = |m: &MachineView| -> i64 {
        let domain = if anonymous {
            None
        } else {
            m.failure_domain.clone()
        };
        let here = live
            .iter()
            .filter(|o| anonymous || o.failure_domain == domain)
            .count() as i64;
        here - targets.get(&domain).copied().unwrap_or(0) as i64
    };
    stale.iter().copied().max_by(|a, b| {
        crowding(a)
            .cmp(&crowding(b))
            .then_with(|| b.failure_domain.cmp(&a.failure_domain))
            .then_with(|| a.name.cmp(&b.name))
    })
}
