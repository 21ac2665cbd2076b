//! The pure planner: from the desired voter count and what was observed of etcd members and
//! machines, the next actions that keep quorum safe while machines are replaced.
//!
//! Nothing here does I/O. The executor observes, calls [`plan`], applies the actions in order and
//! observes again, so every decision is taken on fresh facts. At most one membership change is
//! planned per call: etcd applies membership changes one at a time and each changes the facts the
//! next one depends on.

use std::fmt;

use serde::Serialize;

pub use crate::etcd::membership::{
    MemberState, has_quorum, quorum, removal_keeps_quorum, same_url, voters_and_healthy,
};

/// A learner is worth promoting once its applied index reaches this share of the leader's
/// (seed 002: "promotable when the learner's raft progress is greater than 90%"). etcd makes the
/// final decision; the executor retries its "not in sync" refusal.
const IN_SYNC_PERCENT: u64 = 90;

/// What the configuration asks for. Never derived from observation: a member that is briefly
/// missing from a list is not a scale-in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// Desired number of voting members (3 or 5).
    pub desired_voters: usize,
    /// How a replacement's membership changes are ordered.
    pub replacement: Replacement,
}

/// How a replacement's membership changes are ordered, after what drives the machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Replacement {
    /// The machine API (or a person) deletes a machine and creates another: a new machine's
    /// learner is promoted only when a voter's machine is being deleted or voters are missing.
    #[default]
    OnDeletion,
    /// A ControlPlaneSet's RollingUpdate creates the new machine first and deletes the old one
    /// only once the new member votes: a learner is promoted while there are `desired` voters,
    /// so there are `desired + 1` until the old machine is deleted.
    Surge,
    /// A ControlPlaneSet's Recreate deletes first, with no room for another machine: a deleting
    /// machine's voter is removed without a replacement when no machine is there to host one,
    /// every member is healthy, and at least `desired - 1` voters stay.
    ShrinkFirst,
}

/// A desired voter count the operator cannot keep safely.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("desired voting members must be 3 or 5, got {0}")]
pub struct SpecError(pub usize);

impl Spec {
    /// A spec for 3 or 5 voters: odd sizes that survive one (or two) failures; 1 has no
    /// replacement story and 7 or more only slow writes down.
    pub fn new(desired_voters: usize) -> Result<Spec, SpecError> {
        match desired_voters {
            3 | 5 => Ok(Spec {
                desired_voters,
                replacement: Replacement::OnDeletion,
            }),
            n => Err(SpecError(n)),
        }
    }
}

/// One machine (a control-plane host) as observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MachineState {
    /// Machine name; also the etcd member name of the member it hosts.
    pub name: String,
    /// The peer URL the machine's etcd member advertises (derived from its address by the backend).
    pub peer_url: String,
    /// Marked for deletion.
    pub deleting: bool,
    /// Carries our pre-drain deletion hook.
    pub has_hook: bool,
    /// Someone else removed our hook while the machine was being deleted (the escape hatch).
    pub hook_removed_by_other: bool,
}

/// Everything the planner looks at.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Observed {
    /// etcd members (voters and learners).
    pub members: Vec<MemberState>,
    /// Machines of the control plane.
    pub machines: Vec<MachineState>,
    /// The leader's raft applied index; `None` when no member knows a leader.
    pub leader_applied_index: Option<u64>,
}

/// Why a member is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoveReason {
    /// A voter on a deleting machine whose replacement already votes.
    Replaced,
    /// A learner on a deleting machine (never promoted).
    LearnerOnDeletingMachine,
    /// A learner whose peer URL matches no machine (an add whose machine went away).
    DanglingLearner,
    /// A voter on a deleting machine removed before its replacement exists
    /// ([`Replacement::ShrinkFirst`]).
    ShrunkFirst,
    /// An unhealthy voter on a deleting machine (a dead host a machine health check deleted),
    /// removed before its replacement joins: the only unhealthy member, no voter missing yet.
    UnhealthyOnDeletingMachine,
}

/// One step the executor carries out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Put our pre-drain deletion hook on a machine.
    AddHook {
        /// Machine name.
        machine: String,
    },
    /// Take our hook off a machine (its member is gone).
    ReleaseHook {
        /// Machine name.
        machine: String,
    },
    /// Add a raft learner for a new machine, then start its member.
    AddLearner {
        /// Machine name.
        machine: String,
        /// Peer URL the new member advertises.
        peer_url: String,
    },
    /// Start the member of a machine whose learner was added but never started (an add whose
    /// executor stopped before starting it).
    StartMember {
        /// Machine name.
        machine: String,
        /// The added member's ID.
        member_id: u64,
    },
    /// Promote a caught-up learner to voter.
    Promote {
        /// Member ID.
        member_id: u64,
        /// Machine name.
        machine: String,
    },
    /// Remove a member from the cluster.
    RemoveMember {
        /// Member ID.
        member_id: u64,
        /// Member name (may be empty for a never-started learner).
        name: String,
        /// Why.
        reason: RemoveReason,
    },
}

impl Action {
    /// Whether this action changes etcd membership (as opposed to hooks or processes).
    pub fn is_membership_change(&self) -> bool {
        matches!(
            self,
            Action::AddLearner { .. } | Action::Promote { .. } | Action::RemoveMember { .. }
        )
    }

    /// The machine acted on, where the action names one (a never-started learner's removal
    /// names none).
    pub fn machine(&self) -> Option<&str> {
        match self {
            Action::AddHook { machine }
            | Action::ReleaseHook { machine }
            | Action::AddLearner { machine, .. }
            | Action::StartMember { machine, .. }
            | Action::Promote { machine, .. } => Some(machine.as_str()),
            Action::RemoveMember { name, .. } => Some(name.as_str()).filter(|n| !n.is_empty()),
        }
    }

    /// The etcd member acted on, where it exists yet.
    pub fn member_id(&self) -> Option<u64> {
        match self {
            Action::StartMember { member_id, .. }
            | Action::Promote { member_id, .. }
            | Action::RemoveMember { member_id, .. } => Some(*member_id),
            Action::AddHook { .. } | Action::ReleaseHook { .. } | Action::AddLearner { .. } => None,
        }
    }

    /// Short stable name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Action::AddHook { .. } => "add_hook",
            Action::ReleaseHook { .. } => "release_hook",
            Action::AddLearner { .. } => "add_learner",
            Action::StartMember { .. } => "start_member",
            Action::Promote { .. } => "promote",
            Action::RemoveMember { .. } => "remove_member",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::AddHook { machine } => write!(f, "add deletion hook to machine {machine}"),
            Action::ReleaseHook { machine } => {
                write!(f, "release deletion hook of machine {machine}")
            }
            Action::AddLearner { machine, peer_url } => {
                write!(f, "add learner for machine {machine} ({peer_url})")
            }
            Action::StartMember { machine, member_id } => {
                write!(f, "start member {member_id:x} on machine {machine}")
            }
            Action::Promote { member_id, machine } => {
                write!(f, "promote learner {member_id:x} on machine {machine}")
            }
            Action::RemoveMember {
                member_id,
                name,
                reason,
            } => write!(f, "remove member {member_id:x} ({name}): {reason:?}"),
        }
    }
}

/// The overall condition the operator reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "condition", content = "reason", rename_all = "snake_case")]
pub enum Condition {
    /// Membership matches the machines; nothing to do.
    Settled,
    /// A replacement is under way.
    Progressing(String),
    /// Nothing safe to do until something outside changes (e.g. a replacement machine appears).
    Waiting(String),
    /// Needs an administrator; the operator does not change membership.
    Degraded(String),
}

impl Condition {
    /// Short stable name.
    pub fn kind(&self) -> &'static str {
        match self {
            Condition::Settled => "settled",
            Condition::Progressing(_) => "progressing",
            Condition::Waiting(_) => "waiting",
            Condition::Degraded(_) => "degraded",
        }
    }
}

/// The planner's answer: actions to apply in order, and the condition to report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Hook and start actions first, then at most one membership change.
    pub actions: Vec<Action>,
    /// What to report.
    pub condition: Condition,
}

impl Plan {
    /// The members this step removes (its `RemoveMember` actions).
    pub fn removed_members(&self) -> Vec<u64> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::RemoveMember { member_id, .. } => Some(*member_id),
                _ => None,
            })
            .collect()
    }
}

/// The member hosted by a machine, matched on peer URL.
fn member_on<'a>(obs: &'a Observed, machine: &MachineState) -> Option<&'a MemberState> {
    obs.members
        .iter()
        .find(|m| m.peer_urls.iter().any(|u| same_url(u, &machine.peer_url)))
}

/// The machine hosting a member, matched on peer URL.
fn machine_of<'a>(obs: &'a Observed, member: &MemberState) -> Option<&'a MachineState> {
    obs.machines
        .iter()
        .find(|mc| member.peer_urls.iter().any(|u| same_url(u, &mc.peer_url)))
}

fn label(m: &MemberState) -> String {
    if m.name.is_empty() {
        format!("{:x}", m.id)
    } else {
        m.name.clone()
    }
}

/// Decides the next actions. Pure: same input, same plan.
pub fn plan(spec: Spec, obs: &Observed) -> Plan {
    let voters: Vec<&MemberState> = obs.members.iter().filter(|m| !m.is_learner).collect();
    let healthy_voters = voters.iter().filter(|m| m.healthy).count();

    // Quorum loss (or no voters at all) is for an administrator: any action could make it worse.
    if voters.is_empty() {
        return Plan {
            actions: vec![],
            condition: Condition::Degraded("no voting members observed".into()),
        };
    }
    if !has_quorum(&obs.members) {
        return Plan {
            actions: vec![],
            condition: Condition::Degraded(format!(
                "quorum lost: {healthy_voters} of {} voters healthy; not acting",
                voters.len()
            )),
        };
    }

    let mut actions = hook_actions(obs);
    actions.extend(start_actions(obs));
    let condition = match membership_action(spec, obs, &voters) {
        Ok(action) => {
            let c = Condition::Progressing(action.to_string());
            actions.push(action);
            c
        }
        Err(c) => {
            if matches!(c, Condition::Settled) && !actions.is_empty() {
                Condition::Progressing("protecting machines with deletion hooks".into())
            } else {
                c
            }
        }
    };
    Plan { actions, condition }
}

/// Hooks go on every machine that hosts a member before that member can vote, and come off a
/// deleting machine only once its member is gone. A hook someone else removed from a deleting
/// machine stays off: that is the administrator's escape hatch.
fn hook_actions(obs: &Observed) -> Vec<Action> {
    let mut out = Vec::new();
    for mc in &obs.machines {
        let member = member_on(obs, mc);
        match member {
            Some(m) if !mc.has_hook => {
                let protect = if mc.deleting {
                    // A learner on a deleting machine is removed, not protected.
                    !m.is_learner && !mc.hook_removed_by_other
                } else {
                    true
                };
                if protect {
                    out.push(Action::AddHook {
                        machine: mc.name.clone(),
                    });
                }
            }
            None if mc.has_hook && mc.deleting => out.push(Action::ReleaseHook {
                machine: mc.name.clone(),
            }),
            _ => {}
        }
    }
    out
}

/// A learner added for a live machine but never started gets started (idempotent in backends).
fn start_actions(obs: &Observed) -> Vec<Action> {
    obs.members
        .iter()
        .filter(|m| m.is_learner && !m.started())
        .filter_map(|m| {
            let mc = machine_of(obs, m)?;
            (!mc.deleting).then(|| Action::StartMember {
                machine: mc.name.clone(),
                member_id: m.id,
            })
        })
        .collect()
}

/// At most one membership change, or the condition explaining why there is none. The rules are
/// tried in this order, and the first that answers decides.
fn membership_action(
    spec: Spec,
    obs: &Observed,
    voters: &[&MemberState],
) -> Result<Action, Condition> {
    let unhealthy: Vec<&MemberState> = obs.members.iter().filter(|m| !m.healthy).collect();
    if !unhealthy.is_empty() {
        return unhealthy_member_removal(spec, obs, voters, &unhealthy);
    }

    let Some(leader_applied) = obs.leader_applied_index else {
        return Err(Condition::Waiting("no leader elected".into()));
    };

    let learners: Vec<&MemberState> = obs.members.iter().filter(|m| m.is_learner).collect();
    if let Some(action) = stray_learner_removal(obs, &learners) {
        return Ok(action);
    }

    let deleting_voters: Vec<&&MemberState> = voters
        .iter()
        .filter(|m| machine_of(obs, m).is_some_and(|mc| mc.deleting))
        .collect();
    if voters.len() > spec.desired_voters {
        return surplus_voter_removal(spec, voters, &deleting_voters);
    }

    let needed = voters.len() < spec.desired_voters || !deleting_voters.is_empty();
    // Planted (`crate::plant`): the replaced voter goes before its learner votes.
    if let (Some(v), false) = (deleting_voters.first(), learners.is_empty())
        && crate::plant::active("remove-voter-first")
    {
        return Ok(Action::RemoveMember {
            member_id: v.id,
            name: v.name.clone(),
            reason: RemoveReason::Replaced,
        });
    }
    if !learners.is_empty() {
        return learner_promotion(spec, obs, &learners, needed, leader_applied);
    }
    learner_addition(spec, obs, voters, &deleting_voters, needed)
}

/// With any unhealthy member the only change allowed is removing an unhealthy member of a
/// deleting machine (or of one already gone, e.g. through the escape hatch): a learner, a voter
/// whose replacement already votes, or the one dead voter of [`dead_voter_removal`]. Otherwise
/// membership changes pause, and the condition says why.
fn unhealthy_member_removal(
    spec: Spec,
    obs: &Observed,
    voters: &[&MemberState],
    unhealthy: &[&MemberState],
) -> Result<Action, Condition> {
    if let Some(action) = unhealthy_removable(obs, voters, spec.desired_voters, unhealthy) {
        return Ok(action);
    }
    if let Some(action) = dead_voter_removal(spec, obs, voters, unhealthy) {
        return Ok(action);
    }
    Err(paused_by_unhealthy(obs, unhealthy))
}

/// The first unhealthy member not on a live machine that can go at once: a learner, or a voter
/// while there are more voters than desired (its replacement already votes).
fn unhealthy_removable(
    obs: &Observed,
    voters: &[&MemberState],
    desired: usize,
    unhealthy: &[&MemberState],
) -> Option<Action> {
    for m in unhealthy {
        if machine_of(obs, m).is_some_and(|mc| !mc.deleting) {
            continue;
        }
        if m.is_learner {
            return Some(Action::RemoveMember {
                member_id: m.id,
                name: m.name.clone(),
                reason: RemoveReason::LearnerOnDeletingMachine,
            });
        }
        if voters.len() > desired {
            return Some(Action::RemoveMember {
                member_id: m.id,
                name: m.name.clone(),
                reason: RemoveReason::Replaced,
            });
        }
    }
    None
}

/// Why membership changes pause while `unhealthy` members are there: a new learner still
/// starting is progress; a member whose machine is gone needs an administrator.
fn paused_by_unhealthy(obs: &Observed, unhealthy: &[&MemberState]) -> Condition {
    let names: Vec<String> = unhealthy.iter().map(|m| label(m)).collect();
    let only_new_learners = unhealthy
        .iter()
        .all(|m| m.is_learner && machine_of(obs, m).is_some_and(|mc| !mc.deleting));
    let orphans: Vec<String> = unhealthy
        .iter()
        .filter(|m| machine_of(obs, m).is_none())
        .map(|m| format!("{} ({:x})", label(m), m.id))
        .collect();
    if only_new_learners {
        Condition::Progressing(format!("waiting for learner {} to start", names.join(", ")))
    } else if !orphans.is_empty() {
        // Typically after the escape hatch: the machine went away with its voter.
        Condition::Degraded(format!(
            "unhealthy member(s) {}; membership changes paused; the machine of {} is gone: remove that member (etcdctl member remove ID) to continue",
            names.join(", "),
            orphans.join(", ")
        ))
    } else {
        Condition::Degraded(format!(
            "unhealthy member(s) {}; membership changes paused",
            names.join(", ")
        ))
    }
}

/// A learner on a deleting machine, or on no machine, is removed and never promoted.
fn stray_learner_removal(obs: &Observed, learners: &[&MemberState]) -> Option<Action> {
    for l in learners {
        match machine_of(obs, l) {
            Some(mc) if mc.deleting => {
                return Some(Action::RemoveMember {
                    member_id: l.id,
                    name: l.name.clone(),
                    reason: RemoveReason::LearnerOnDeletingMachine,
                });
            }
            None => {
                return Some(Action::RemoveMember {
                    member_id: l.id,
                    name: l.name.clone(),
                    reason: RemoveReason::DanglingLearner,
                });
            }
            Some(_) => {}
        }
    }
    None
}

/// Above the desired count: shed the replaced voter first, so an even count lasts as short as
/// possible and nothing else changes meanwhile. Without a voter on a deleting machine, nothing
/// is removed (under Surge that is the wait for the old machine's deletion).
fn surplus_voter_removal(
    spec: Spec,
    voters: &[&MemberState],
    deleting_voters: &[&&MemberState],
) -> Result<Action, Condition> {
    let desired = spec.desired_voters;
    match deleting_voters.first() {
        Some(v) => Ok(Action::RemoveMember {
            member_id: v.id,
            name: v.name.clone(),
            reason: RemoveReason::Replaced,
        }),
        None if spec.replacement == Replacement::Surge => Err(Condition::Waiting(format!(
            "{} voters: the new member votes; waiting for the machine it replaces to be deleted",
            voters.len()
        ))),
        None => Err(Condition::Degraded(format!(
            "{} voters but {desired} desired and no voter's machine is being deleted; not removing any",
            voters.len()
        ))),
    }
}

/// The one learner is promoted once a voter is `needed` (or under Surge, which promotes a new
/// machine's learner before the old machine is deleted: at most desired + 1 voters), its
/// machine is protected by the hook, and it has caught up with the leader.
fn learner_promotion(
    spec: Spec,
    obs: &Observed,
    learners: &[&MemberState],
    needed: bool,
    leader_applied: u64,
) -> Result<Action, Condition> {
    let surge = spec.replacement == Replacement::Surge;
    let [l] = learners else {
        return Err(Condition::Degraded(format!(
            "{} learners; expected at most one",
            learners.len()
        )));
    };
    let mc = machine_of(obs, l)
        .ok_or_else(|| Condition::Degraded(format!("learner {} matches no machine", label(l))))?;
    if !needed && !surge {
        return Err(Condition::Waiting(format!(
            "learner {} has no member to replace",
            label(l)
        )));
    }
    if !mc.has_hook {
        return Err(Condition::Progressing(format!(
            "protecting machine {} before promotion",
            mc.name
        )));
    }
    if l.applied_index.saturating_mul(100) < leader_applied.saturating_mul(IN_SYNC_PERCENT) {
        return Err(Condition::Progressing(format!(
            "learner {} catching up ({} of {leader_applied})",
            label(l),
            l.applied_index
        )));
    }
    Ok(Action::Promote {
        member_id: l.id,
        machine: mc.name.clone(),
    })
}

/// A learner is added on the first spare machine (live, no member; by name) when a voter is
/// `needed`, or under Surge whenever a spare machine is there. Recreate with no spare machine
/// removes the deleting machine's voter first instead.
fn learner_addition(
    spec: Spec,
    obs: &Observed,
    voters: &[&MemberState],
    deleting_voters: &[&&MemberState],
    needed: bool,
) -> Result<Action, Condition> {
    let desired = spec.desired_voters;
    let mut spare: Vec<&MachineState> = obs
        .machines
        .iter()
        .filter(|mc| !mc.deleting && member_on(obs, mc).is_none())
        .collect();
    spare.sort_by(|a, b| a.name.cmp(&b.name));
    let surge_add = spec.replacement == Replacement::Surge && !spare.is_empty();
    if !needed && !surge_add {
        return Err(match spare.first() {
            None => Condition::Settled,
            Some(mc) => Condition::Waiting(format!(
                "machine {} has no member and there is nothing to replace",
                mc.name
            )),
        });
    }
    match spare.first() {
        Some(mc) => Ok(Action::AddLearner {
            machine: mc.name.clone(),
            peer_url: mc.peer_url.clone(),
        }),
        // Recreate: no machine can host a replacement until the deleting one is gone. Every
        // member is healthy here (an unhealthy one returned above), so the voters left keep
        // quorum; never fewer than desired - 1 of them.
        None if spec.replacement == Replacement::ShrinkFirst
            && voters.len() >= desired
            && let Some(v) = deleting_voters.first() =>
        {
            Ok(Action::RemoveMember {
                member_id: v.id,
                name: v.name.clone(),
                reason: RemoveReason::ShrunkFirst,
            })
        }
        None => {
            let names: Vec<String> = deleting_voters.iter().map(|m| label(m)).collect();
            Err(Condition::Waiting(if names.is_empty() {
                format!(
                    "{} voters, {desired} desired, and no machine without a member to add",
                    voters.len()
                )
            } else {
                format!(
                    "machine of member {} is being deleted but there is no replacement machine; membership untouched",
                    names.join(", ")
                )
            }))
        }
    }
}

/// The voter of a deleting machine that is dead, removed before its replacement joins.
///
/// A machine health check deletes a control-plane machine whose host died, expecting a
/// replacement (seed 003). The usual order (learner, promotion, then removal) cannot start: no
/// member is added while one is unhealthy, and a fourth voter with one dead would need three of
/// four for quorum. So the dead voter goes first, and only when nothing else is wrong:
/// - it is the only unhealthy member (any other keeps membership paused, Degraded);
/// - its machine is there and being deleted (a member whose machine is gone, as after the escape
///   hatch, is left to the administrator: a machine briefly missing from a list is not a death);
/// - at least `desired` voters are there, so one voter at most is ever missing: never a second
///   removal before the first one's replacement votes;
/// - the voters left keep a healthy majority (all of them are healthy, so this holds whenever
///   another voter is there).
///
/// Its process is dead, so the removal is agreed by the healthy voters alone; its machine's hook
/// is released by the next plan (no member on it), and the replacement joins as usual.
fn dead_voter_removal(
    spec: Spec,
    obs: &Observed,
    voters: &[&MemberState],
    unhealthy: &[&MemberState],
) -> Option<Action> {
    let [m] = unhealthy else {
        return None;
    };
    let on_deleting_machine = machine_of(obs, m).is_some_and(|mc| mc.deleting);
    (!m.is_learner
        && on_deleting_machine
        && voters.len() >= spec.desired_voters
        && removal_keeps_quorum(&obs.members, m.id))
    .then(|| Action::RemoveMember {
        member_id: m.id,
        name: m.name.clone(),
        reason: RemoveReason::UnhealthyOnDeletingMachine,
    })
}
