//! `EtcdQuorum`: the status a user reads with `kubectl get etcdquorum` — conditions Available,
//! Progressing and Degraded, the members, the last action.
//!
//! One object, `cluster`, in the operator's namespace. Its **spec is empty**: the desired voter
//! count is the operator's configuration (`voters`), read once at start and validated with the
//! rest of it. A spec field would be a second source of truth that anyone allowed to edit this
//! object could use to change the quorum size behind the deployment's back; the status reports
//! `desiredVoters` so the two can be compared.
//!
//! The conditions are derived by [`derive`](fn@derive), a pure function of the observation the planner
//! sees (and the plan it makes of it), whether the Machine API works, and whether a learner has
//! stopped catching up; [`merge`] keeps a condition's `lastTransitionTime` until its status
//! flips. Everything here is pure; the Kubernetes controller (`operator::kube::controller`)
//! creates the object when missing and writes the status only through the `/status`
//! subresource, and only when something changed.

use std::time::{Duration, Instant};

use ::kube::CustomResource;
use chrono::{DateTime, SecondsFormat, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::execute::{ActionRecord, MemberStatus};
use super::plan::{
    Action, Condition, Observed, RemoveReason, Spec, has_quorum, plan, same_url, voters_and_healthy,
};
use super::request::{RestorePhase, SurvivorChoice, next_phase};

/// The one object's name.
pub const NAME: &str = "cluster";

/// A learner whose applied index has not moved for this long while behind is reported as not
/// catching up (Degraded); a healthy learner catches up a control plane's data in seconds.
pub const LEARNER_STALL: Duration = Duration::from_secs(120);

/// The desired voter count is the operator's configuration, not a field anyone who may edit
/// this object could change. The one field is an administrator's request, acted on only after
/// quorum loss.
// Clippy reads the repeated `type_ = ...` of separate printcolumns as one duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, Default, PartialEq, JsonSchema)]
#[kube(
    group = "etcd-warden.io",
    version = "v1alpha1",
    kind = "EtcdQuorum",
    namespaced,
    status = "EtcdQuorumStatus",
    doc = "The control plane's etcd quorum as the operator sees it (status), and an administrator's quorum restore request (spec.quorumRestore)",
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].status"
    ),
    printcolumn(
        name = "Progressing",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Progressing\")].status"
    ),
    printcolumn(
        name = "Degraded",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Degraded\")].status"
    ),
    printcolumn(name = "Voters", type_ = "integer", json_path = ".status.voters"),
    printcolumn(name = "Learners", type_ = "integer", json_path = ".status.learners"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EtcdQuorumSpec {
    /// Rebuild from a survivor after a majority of the members is lost for good. Refused
    /// (in the status) unless quorum is lost when it is first seen; the rebuild itself runs on
    /// the survivor's node (`etcd-warden quorum-restore`); the operator then grows the cluster
    /// back with learners. Remove it once the status says Done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quorum_restore: Option<QuorumRestoreSpec>,
}

/// An administrator's quorum restore request.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuorumRestoreSpec {
    /// The Machine whose member to rebuild from, or "freshest".
    #[schemars(length(min = 1, max = 253))]
    pub survivor: String,
}

/// Where a quorum restore request stands.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuorumRestoreStatus {
    /// The survivor requested.
    pub survivor: String,
    /// Refused, WaitingForRebuild, GrowingBack or Done.
    pub phase: String,
    /// Why it was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl QuorumRestoreStatus {
    /// The status of `phase` for `survivor`.
    pub fn new(survivor: &str, phase: &RestorePhase) -> QuorumRestoreStatus {
        let (name, message) = match phase {
            RestorePhase::Refused(m) => ("Refused", Some(m.clone())),
            RestorePhase::WaitingForRebuild => ("WaitingForRebuild", Some(rebuild_step(survivor))),
            RestorePhase::GrowingBack => ("GrowingBack", None),
            RestorePhase::Done => ("Done", None),
        };
        QuorumRestoreStatus {
            survivor: survivor.to_owned(),
            phase: name.to_owned(),
            message,
        }
    }

    /// The phase recorded.
    pub fn phase(&self) -> RestorePhase {
        match self.phase.as_str() {
            "WaitingForRebuild" => RestorePhase::WaitingForRebuild,
            "GrowingBack" => RestorePhase::GrowingBack,
            "Done" => RestorePhase::Done,
            _ => RestorePhase::Refused(self.message.clone().unwrap_or_default()),
        }
    }
}

/// What an administrator does while a request waits for its rebuild, and where: the operator
/// cannot reach the survivor's data directory; the survivor's sidecar rebuilds it before etcd
/// starts (`quorum_restore.machine`), so the pod must be restarted, or it is run by hand.
fn rebuild_step(survivor: &str) -> String {
    let then = "then start etcd again; the operator grows the cluster back with learners \
                (docs/operations.md \"Quorum loss\")";
    match survivor.parse::<SurvivorChoice>() {
        Ok(SurvivorChoice::Named(m)) => format!(
            "on Machine {m}: restart its etcd pod (a sidecar with quorum_restore.machine = \
             {m:?} rebuilds before etcd starts), or stop etcd there, run `etcd-warden \
             quorum-restore --data-dir <etcd's data directory>` and {then}"
        ),
        _ => format!(
            "the operator cannot read the survivors' data directories: on one surviving \
             Machine, stop etcd, copy every other survivor's data directory (its etcd stopped) \
             beside it and run `etcd-warden quorum-restore --data-dir <etcd's data directory> \
             --survivor-data-dir <copy> ...` (it rebuilds from the freshest), {then}"
        ),
    }
}

/// The quorum restore status for `request` (none without one), from the one recorded for the
/// same survivor and what is observed. A new request (another survivor) starts over. Pure.
pub fn restore_status(
    request: Option<&QuorumRestoreSpec>,
    previous: Option<&QuorumRestoreStatus>,
    observed: &Observed,
    desired: usize,
) -> Option<QuorumRestoreStatus> {
    let request = request?;
    let phase = match request.survivor.parse::<SurvivorChoice>() {
        Err(e) => RestorePhase::Refused(e),
        Ok(choice) => {
            let prev = previous
                .filter(|p| p.survivor == request.survivor)
                .map(QuorumRestoreStatus::phase);
            next_phase(prev.as_ref(), observed, &choice, desired)
        }
    };
    Some(QuorumRestoreStatus::new(&request.survivor, &phase))
}

/// What the operator last observed and concluded.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdQuorumStatus {
    /// The object's `metadata.generation` this status was written for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Available, Progressing and Degraded, in that order.
    #[serde(default)]
    pub conditions: Vec<QuorumCondition>,
    /// Voting members the operator keeps (its configuration).
    pub desired_voters: i32,
    /// Voting members observed.
    pub voters: i32,
    /// Learners observed.
    pub learners: i32,
    /// Every member in etcd's member list.
    #[serde(default)]
    pub members: Vec<QuorumMember>,
    /// The last action applied or attempted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_action: Option<LastAction>,
    /// Where `spec.quorumRestore` stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quorum_restore: Option<QuorumRestoreStatus>,
}

/// A condition, shaped as `metav1.Condition`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuorumCondition {
    /// Available, Progressing or Degraded.
    #[serde(rename = "type")]
    pub type_: String,
    /// "True" or "False".
    pub status: String,
    /// CamelCase reason, e.g. `UnhealthyMembers`.
    pub reason: String,
    /// In words.
    pub message: String,
    /// When `status` last changed (RFC 3339).
    pub last_transition_time: String,
    /// The generation observed when this was set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// One etcd member.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuorumMember {
    /// Member ID in hex, as etcdctl prints it.
    pub id: String,
    /// Member name (empty until it starts).
    pub name: String,
    /// First peer URL.
    pub peer_url: String,
    /// `voter` or `learner`.
    pub role: String,
    /// Answers status and knows a leader.
    pub healthy: bool,
}

/// The last action.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastAction {
    /// Kind, e.g. `promote`.
    pub action: String,
    /// In words.
    pub message: String,
    /// When it finished (RFC 3339).
    pub time: String,
    /// Why it failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Condition types, in the order they are written.
pub const TYPES: [&str; 3] = ["Available", "Progressing", "Degraded"];

/// Every reason [`derive`](fn@derive) gives.
pub mod reason {
    /// Nothing to report.
    pub const AS_EXPECTED: &str = "AsExpected";
    /// Fewer than a majority of voters are healthy (or none is seen).
    pub const NO_QUORUM: &str = "NoQuorum";
    /// A member other than a starting learner (or a voter this step removes: a dead one of a
    /// deleting Machine, or one whose replacement is already a voter) is unhealthy; membership
    /// changes pause.
    pub const UNHEALTHY_MEMBERS: &str = "UnhealthyMembers";
    /// A learner behind the leader has not advanced for [`super::LEARNER_STALL`].
    pub const LEARNER_NOT_CATCHING_UP: &str = "LearnerNotCatchingUp";
    /// A control-plane Machine hosts no member and nothing needs replacing: Degraded stays
    /// False with this reason. A rolling update creates the new Machine before it deletes the
    /// old one, and the operator waits for the deletion; only when the Machine stays is it worth
    /// a look, and the cluster is not at risk meanwhile.
    pub const MACHINE_WITHOUT_MEMBER: &str = "MachineWithoutMember";
    /// No control-plane Machine is Running; the operator does not act.
    pub const MACHINE_API_NOT_FUNCTIONAL: &str = "MachineAPINotFunctional";
    /// Fewer voters than desired and no machine to add one on.
    pub const TOO_FEW_VOTERS: &str = "TooFewVoters";
    /// Membership is not what the operator can reconcile by itself (e.g. too many voters).
    pub const UNEXPECTED_MEMBERSHIP: &str = "UnexpectedMembership";
    /// A member is being replaced (learner added, promoted, old member removed, or waiting for
    /// the replacement machine).
    pub const REPLACING_MEMBER: &str = "ReplacingMember";
    /// Only deletion hooks are being added or released.
    pub const UPDATING_HOOKS: &str = "UpdatingDeletionHooks";
    /// The unhealthy voter of a deleting Machine (a dead host a machine health check deleted)
    /// is being removed before its replacement joins. Not Degraded: the operator is repairing
    /// it, and a removal that keeps failing shows as [`RECONCILE_FAILED`].
    pub const REMOVING_UNHEALTHY_MEMBER: &str = "RemovingUnhealthyMember";
    /// Reconciles keep failing (etcd or the API server unreachable, or refusing); the rest of
    /// the status is the last one observed.
    pub const RECONCILE_FAILED: &str = "ReconcileFailed";
}

/// How long reconciles must have kept failing before the status says so: ten retries at the
/// longest backoff. A replacement meets failures that pass by themselves (etcd refuses a member
/// change for some seconds after the last one), and those are no news.
pub fn failures_reported_after(max_backoff: Duration) -> Duration {
    max_backoff.saturating_mul(10)
}

/// What [`derive`](fn@derive) looks at.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// Desired voters.
    pub spec: Spec,
    /// The planner's input, observed after the reconcile's actions.
    pub observed: &'a Observed,
    /// Whether at least one control-plane Machine runs.
    pub machine_api_functional: bool,
    /// A learner that has stopped catching up, by name (see [`LearnerProgress`]).
    pub stalled_learner: Option<&'a str>,
}

/// A condition before its transition time is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Derived {
    /// Available, Progressing or Degraded.
    pub type_: &'static str,
    /// True or False.
    pub status: bool,
    /// One of [`reason`].
    pub reason: &'static str,
    /// In words.
    pub message: String,
}

fn cond(type_: &'static str, status: bool, reason: &'static str, message: String) -> Derived {
    Derived {
        type_,
        status,
        reason,
        message,
    }
}

fn label(name: &str, id: u64) -> String {
    if name.is_empty() {
        format!("{id:x}")
    } else {
        name.to_owned()
    }
}

/// Available, Progressing and Degraded from what the planner knows. Pure.
pub fn derive(f: &Facts<'_>) -> [Derived; 3] {
    let obs = f.observed;
    let p = plan(f.spec, obs);
    let (voters, healthy) = voters_and_healthy(&obs.members);
    let quorum = has_quorum(&obs.members);
    let condition_text = |c: &Condition| match c {
        Condition::Settled => "membership matches the machines".to_owned(),
        Condition::Progressing(m) | Condition::Waiting(m) | Condition::Degraded(m) => m.clone(),
    };

    let available = if quorum {
        cond(
            TYPES[0],
            true,
            reason::AS_EXPECTED,
            format!("{healthy} of {voters} voters healthy"),
        )
    } else {
        cond(
            TYPES[0],
            false,
            reason::NO_QUORUM,
            format!("{healthy} of {voters} voters healthy: no quorum"),
        )
    };

    let machine_of = |peer_urls: &[String]| {
        obs.machines
            .iter()
            .find(|mc| peer_urls.iter().any(|u| same_url(u, &mc.peer_url)))
    };
    // The dead voter of a deleting Machine the planner removes (only when every other member
    // is healthy).
    let removing_unhealthy = p.actions.iter().find_map(|a| match a {
        Action::RemoveMember {
            member_id,
            name,
            reason: RemoveReason::UnhealthyOnDeletingMachine,
        } => Some((*member_id, label(name, *member_id))),
        _ => None,
    });
    // Members this step removes: a dead voter of a deleting Machine, or one whose replacement
    // has been promoted (it may already have stopped: etcd exits once it applies its own
    // removal, and a member list served a moment before still shows it).
    let removing = p.removed_members();
    // A learner on a live machine that has not answered yet is starting, not broken; a voter
    // being removed is being repaired or replaced.
    let unhealthy: Vec<String> = obs
        .members
        .iter()
        .filter(|m| !m.healthy)
        .filter(|m| !(m.is_learner && machine_of(&m.peer_urls).is_some_and(|mc| !mc.deleting)))
        .filter(|m| !removing.contains(&m.id))
        .map(|m| label(&m.name, m.id))
        .collect();
    let spare: Vec<&str> = obs
        .machines
        .iter()
        .filter(|mc| {
            !mc.deleting
                && !obs
                    .members
                    .iter()
                    .any(|m| m.peer_urls.iter().any(|u| same_url(u, &mc.peer_url)))
        })
        .map(|mc| mc.name.as_str())
        .collect();
    let membership_action = p.actions.iter().any(Action::is_membership_change)
        || p.actions
            .iter()
            .any(|a| matches!(a, Action::StartMember { .. }));
    let learner = obs.members.iter().any(|m| m.is_learner);
    let deleting_member = obs.machines.iter().any(|mc| {
        mc.deleting
            && obs
                .members
                .iter()
                .any(|m| m.peer_urls.iter().any(|u| same_url(u, &mc.peer_url)))
    });

    let degraded = if !f.machine_api_functional {
        cond(
            TYPES[2],
            true,
            reason::MACHINE_API_NOT_FUNCTIONAL,
            "no control-plane Machine is Running; the operator does not act".into(),
        )
    } else if !quorum {
        cond(
            TYPES[2],
            true,
            reason::NO_QUORUM,
            condition_text(&p.condition),
        )
    } else if !unhealthy.is_empty() {
        cond(
            TYPES[2],
            true,
            reason::UNHEALTHY_MEMBERS,
            format!(
                "unhealthy member(s) {}; membership changes paused",
                unhealthy.join(", ")
            ),
        )
    } else if let Some(l) = f.stalled_learner.filter(|_| learner) {
        cond(
            TYPES[2],
            true,
            reason::LEARNER_NOT_CATCHING_UP,
            format!(
                "learner {l} has not advanced for {}s",
                LEARNER_STALL.as_secs()
            ),
        )
    } else if let Condition::Degraded(m) = &p.condition {
        cond(TYPES[2], true, reason::UNEXPECTED_MEMBERSHIP, m.clone())
    } else if voters < f.spec.desired_voters && !membership_action && !learner && !deleting_member {
        cond(
            TYPES[2],
            true,
            reason::TOO_FEW_VOTERS,
            condition_text(&p.condition),
        )
    } else if !spare.is_empty() && !membership_action && !learner && !deleting_member {
        cond(
            TYPES[2],
            false,
            reason::MACHINE_WITHOUT_MEMBER,
            format!(
                "machine(s) {} host no member and no member needs replacing; waiting for a machine to be deleted",
                spare.join(", ")
            ),
        )
    } else {
        cond(
            TYPES[2],
            false,
            reason::AS_EXPECTED,
            "no problem seen".into(),
        )
    };

    let progressing = if !f.machine_api_functional {
        cond(
            TYPES[1],
            false,
            reason::MACHINE_API_NOT_FUNCTIONAL,
            "not acting while the Machine API does not work".into(),
        )
    } else if !quorum {
        cond(
            TYPES[1],
            false,
            reason::NO_QUORUM,
            "not acting without quorum".into(),
        )
    } else if let Some((_, name)) = &removing_unhealthy {
        cond(
            TYPES[1],
            true,
            reason::REMOVING_UNHEALTHY_MEMBER,
            format!(
                "removing unhealthy member {name} of a deleting Machine; its replacement joins next"
            ),
        )
    } else if membership_action || learner || deleting_member || voters > f.spec.desired_voters {
        cond(
            TYPES[1],
            true,
            reason::REPLACING_MEMBER,
            condition_text(&p.condition),
        )
    } else if !p.actions.is_empty() {
        let what: Vec<String> = p.actions.iter().map(ToString::to_string).collect();
        cond(TYPES[1], true, reason::UPDATING_HOOKS, what.join("; "))
    } else {
        cond(
            TYPES[1],
            false,
            reason::AS_EXPECTED,
            condition_text(&p.condition),
        )
    };
    [available, progressing, degraded]
}

/// The conditions to write: `derived`, each keeping `previous`'s `lastTransitionTime` when its
/// status did not change. Pure.
pub fn merge(
    previous: &[QuorumCondition],
    derived: &[Derived],
    now: DateTime<Utc>,
    generation: Option<i64>,
) -> Vec<QuorumCondition> {
    derived
        .iter()
        .map(|d| {
            let status = if d.status { "True" } else { "False" };
            let since = previous
                .iter()
                .find(|c| c.type_ == d.type_ && c.status == status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| now.to_rfc3339_opts(SecondsFormat::Secs, true));
            QuorumCondition {
                type_: d.type_.to_owned(),
                status: status.to_owned(),
                reason: d.reason.to_owned(),
                message: d.message.clone(),
                last_transition_time: since,
                observed_generation: generation,
            }
        })
        .collect()
}

/// Follows the learner's applied index between observations, to tell a learner still catching
/// up from one that stopped.
#[derive(Debug, Default)]
pub struct LearnerProgress {
    last: Option<(u64, u64, Instant)>,
}

impl LearnerProgress {
    /// The name of a learner behind the leader whose applied index has not moved for
    /// [`LEARNER_STALL`] as of `now`.
    pub fn stalled(&mut self, obs: &Observed, now: Instant) -> Option<String> {
        let Some(l) = obs.members.iter().find(|m| m.is_learner) else {
            self.last = None;
            return None;
        };
        let behind = obs
            .leader_applied_index
            .is_some_and(|leader| l.applied_index < leader);
        match self.last {
            Some((id, applied, since)) if id == l.id && applied == l.applied_index => {
                (behind && now.duration_since(since) >= LEARNER_STALL).then(|| label(&l.name, l.id))
            }
            _ => {
                self.last = Some((l.id, l.applied_index, now));
                None
            }
        }
    }
}

/// The status for `members` and `last_action`, with conditions merged onto `previous`.
pub fn status(
    facts: &Facts<'_>,
    members: &[MemberStatus],
    last_action: Option<&ActionRecord>,
    previous: Option<&EtcdQuorumStatus>,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> EtcdQuorumStatus {
    let prev = previous.map(|p| p.conditions.as_slice()).unwrap_or(&[]);
    // int32, as Kubernetes API conventions have counts.
    let count = |learner: bool| {
        i32::try_from(members.iter().filter(|m| m.is_learner == learner).count())
            .unwrap_or(i32::MAX)
    };
    EtcdQuorumStatus {
        observed_generation: generation,
        conditions: merge(prev, &derive(facts), now, generation),
        desired_voters: i32::try_from(facts.spec.desired_voters).unwrap_or(i32::MAX),
        voters: count(false),
        learners: count(true),
        members: members
            .iter()
            .map(|m| QuorumMember {
                id: m.id.clone(),
                name: m.name.clone(),
                peer_url: m.peer_urls.first().cloned().unwrap_or_default(),
                role: if m.is_learner { "learner" } else { "voter" }.to_owned(),
                healthy: m.healthy,
            })
            .collect(),
        last_action: last_action.map(|a| LastAction {
            action: a.action.kind().to_owned(),
            message: a.text.clone(),
            time: a.at.to_rfc3339_opts(SecondsFormat::Secs, true),
            error: a.error.clone(),
        }),
        quorum_restore: previous.and_then(|p| p.quorum_restore.clone()),
    }
}

/// The status after reconciles keep failing with `error`: `previous` (what was last observed)
/// with Degraded True for [`reason::RECONCILE_FAILED`]. Pure.
pub fn failed(
    previous: Option<&EtcdQuorumStatus>,
    error: &str,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> EtcdQuorumStatus {
    let mut st = previous.cloned().unwrap_or_default();
    let degraded = cond(
        TYPES[2],
        true,
        reason::RECONCILE_FAILED,
        format!("reconciles keep failing: {error}"),
    );
    let merged = merge(
        &st.conditions,
        std::slice::from_ref(&degraded),
        now,
        generation,
    );
    st.conditions.retain(|c| c.type_ != TYPES[2]);
    st.conditions.extend(merged);
    st.observed_generation = generation;
    st
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::quorum::plan::{MachineState, MemberState};

    /// What one of four machine slots holds.
    #[derive(Debug, Clone, Copy)]
    enum Slot {
        Empty,
        Voter { healthy: bool },
        Learner { healthy: bool, applied: u64 },
    }

    const SLOTS: [Slot; 6] = [
        Slot::Empty,
        Slot::Voter { healthy: true },
        Slot::Voter { healthy: false },
        Slot::Learner {
            healthy: true,
            applied: 100,
        },
        Slot::Learner {
            healthy: true,
            applied: 10,
        },
        Slot::Learner {
            healthy: false,
            applied: 0,
        },
    ];

    fn world(slots: &[(Slot, bool, bool)], orphan: bool) -> Observed {
        let mut obs = Observed {
            leader_applied_index: Some(100),
            ..Observed::default()
        };
        for (i, (slot, deleting, hook)) in slots.iter().enumerate() {
            let peer = format!("https://10.0.0.{i}:2380");
            obs.machines.push(MachineState {
                name: format!("cp-{i}"),
                peer_url: peer.clone(),
                deleting: *deleting,
                has_hook: *hook,
                hook_removed_by_other: false,
            });
            let (is_learner, healthy, applied) = match *slot {
                Slot::Empty => continue,
                Slot::Voter { healthy } => (false, healthy, 100),
                Slot::Learner { healthy, applied } => (true, healthy, applied),
            };
            obs.members.push(MemberState {
                id: 0x10 + i as u64,
                name: if healthy {
                    format!("cp-{i}")
                } else {
                    String::new()
                },
                peer_urls: vec![peer],
                is_learner,
                healthy,
                applied_index: applied,
            });
        }
        if orphan {
            // A voter whose machine is gone (the escape hatch was used).
            obs.members.push(MemberState {
                id: 0xff,
                name: "gone".into(),
                peer_urls: vec!["https://10.0.9.9:2380".into()],
                is_learner: false,
                healthy: false,
                applied_index: 1,
            });
        }
        obs
    }

    fn get<'a>(c: &'a [Derived; 3], t: &str) -> &'a Derived {
        c.iter().find(|d| d.type_ == t).unwrap()
    }

    /// Every combination of four slots (member kind × health × deleting × hook), with and
    /// without an orphaned voter, a working Machine API and a stalled learner: the conditions
    /// agree with quorum, with the planner and with each other.
    #[test]
    fn conditions_agree_with_quorum_and_the_planner_over_every_small_world() {
        let spec = Spec::new(3).unwrap();
        let mut per_slot = Vec::new();
        for s in SLOTS {
            for deleting in [false, true] {
                for hook in [false, true] {
                    per_slot.push((s, deleting, hook));
                }
            }
        }
        let known = [
            reason::AS_EXPECTED,
            reason::NO_QUORUM,
            reason::UNHEALTHY_MEMBERS,
            reason::LEARNER_NOT_CATCHING_UP,
            reason::MACHINE_WITHOUT_MEMBER,
            reason::MACHINE_API_NOT_FUNCTIONAL,
            reason::UNEXPECTED_MEMBERSHIP,
            reason::TOO_FEW_VOTERS,
            reason::REPLACING_MEMBER,
            reason::UPDATING_HOOKS,
            reason::REMOVING_UNHEALTHY_MEMBER,
        ];
        let mut seen = std::collections::BTreeSet::new();
        let mut worlds = 0;
        let n = per_slot.len();
        for a in 0..n {
            for b in a..n {
                for c in b..n {
                    for d in c..n {
                        let slots = [per_slot[a], per_slot[b], per_slot[c], per_slot[d]];
                        for orphan in [false, true] {
                            let obs = world(&slots, orphan);
                            for functional in [true, false] {
                                for stalled in [None, Some("cp-3")] {
                                    worlds += 1;
                                    let f = Facts {
                                        spec,
                                        observed: &obs,
                                        machine_api_functional: functional,
                                        stalled_learner: stalled,
                                    };
                                    let c = derive(&f);
                                    check(&f, &c, &known);
                                    for d in &c {
                                        seen.insert((d.type_, d.status, d.reason));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(worlds > 10_000, "{worlds}");
        // Every reason is reachable.
        for r in known {
            assert!(seen.iter().any(|s| s.2 == r), "{r} never derived");
        }
    }

    /// CI caught this world mid-replacement: cp-3 replaced cp-0 and is a voter; cp-0 is being
    /// removed and no longer answers (etcd exits once it applies its own removal, and a member
    /// list served a moment earlier still lists it). That is the replacement going to plan, not
    /// a degradation.
    #[test]
    fn a_replaced_voter_that_stopped_before_its_removal_is_seen_is_no_degradation() {
        let spec = Spec::new(3).unwrap();
        let slots = [
            (Slot::Voter { healthy: false }, true, true),
            (Slot::Voter { healthy: true }, false, true),
            (Slot::Voter { healthy: true }, false, true),
            (Slot::Voter { healthy: true }, false, true),
        ];
        let obs = world(&slots, false);
        let f = Facts {
            spec,
            observed: &obs,
            machine_api_functional: true,
            stalled_learner: None,
        };
        let c = derive(&f);
        assert!(plan(spec, &obs).actions.iter().any(|a| matches!(
            a,
            Action::RemoveMember {
                member_id: 0x10,
                reason: RemoveReason::Replaced,
                ..
            }
        )));
        let (av, pr, dg) = (
            get(&c, "Available"),
            get(&c, "Progressing"),
            get(&c, "Degraded"),
        );
        assert!(av.status, "{c:?}");
        assert!(pr.status && pr.reason == reason::REPLACING_MEMBER, "{c:?}");
        assert!(!dg.status && dg.reason == reason::AS_EXPECTED, "{c:?}");
        // A dead voter whose Machine stays is a degradation.
        let mut slots = slots;
        slots[0].1 = false;
        let obs = world(&slots, false);
        let f = Facts {
            observed: &obs,
            ..f
        };
        let c = derive(&f);
        assert_eq!(
            get(&c, "Degraded").reason,
            reason::UNHEALTHY_MEMBERS,
            "{c:?}"
        );
    }

    fn check(f: &Facts<'_>, c: &[Derived; 3], known: &[&str]) {
        let obs = f.observed;
        let ctx = || format!("{obs:#?} functional={} -> {c:#?}", f.machine_api_functional);
        let [av, pr, dg] = [
            get(c, "Available"),
            get(c, "Progressing"),
            get(c, "Degraded"),
        ];
        assert_eq!(c.each_ref().map(|d| d.type_), TYPES, "{}", ctx());
        for d in c {
            assert!(known.contains(&d.reason), "{}", ctx());
            assert!(!d.message.is_empty(), "{}", ctx());
        }
        let quorum = has_quorum(&obs.members);
        let p = plan(f.spec, obs);
        // Available is exactly quorum.
        assert_eq!(av.status, quorum, "{}", ctx());
        assert_eq!(av.reason == reason::NO_QUORUM, !quorum, "{}", ctx());
        // Not acting (no Machine API, no quorum): not progressing, degraded, for that reason.
        if !f.machine_api_functional {
            assert!(dg.status && dg.reason == reason::MACHINE_API_NOT_FUNCTIONAL);
            assert!(!pr.status, "{}", ctx());
            return;
        }
        if !quorum {
            assert!(dg.status && dg.reason == reason::NO_QUORUM, "{}", ctx());
            assert!(!pr.status, "{}", ctx());
            return;
        }
        // Any action the planner takes is progress.
        assert_eq!(
            pr.status,
            !p.actions.is_empty() || pr.reason == reason::REPLACING_MEMBER
        );
        if !p.actions.is_empty() {
            assert!(pr.status, "{}", ctx());
        }
        let removing_dead = p.actions.iter().find_map(|a| match a {
            Action::RemoveMember {
                member_id,
                reason: RemoveReason::UnhealthyOnDeletingMachine,
                ..
            } => Some(*member_id),
            _ => None,
        });
        if removing_dead.is_some() {
            assert_eq!(pr.reason, reason::REMOVING_UNHEALTHY_MEMBER, "{}", ctx());
        } else if p.actions.iter().any(Action::is_membership_change) {
            assert_eq!(pr.reason, reason::REPLACING_MEMBER, "{}", ctx());
        }
        // An unhealthy voter is always Degraded, and for that reason, unless this step removes
        // it: the dead voter of a deleting Machine (then it is the only unhealthy member, and
        // being repaired), or a replaced voter whose successor is already a voter.
        let removing = p.removed_members();
        if removing_dead.is_some() {
            assert_ne!(dg.reason, reason::UNHEALTHY_MEMBERS, "{}", ctx());
        } else if obs
            .members
            .iter()
            .any(|m| !m.is_learner && !m.healthy && !removing.contains(&m.id))
        {
            assert!(
                dg.status && dg.reason == reason::UNHEALTHY_MEMBERS,
                "{}",
                ctx()
            );
        }
        if f.stalled_learner.is_some() && obs.members.iter().any(|m| m.is_learner) {
            assert!(dg.status, "{}", ctx());
        }
        if let Condition::Degraded(_) = p.condition {
            assert!(dg.status, "{}", ctx());
        }
        // All quiet means the planner is settled, and the reverse.
        let quiet = !pr.status && !dg.status;
        let all_as_expected = c.iter().all(|d| d.reason == reason::AS_EXPECTED);
        assert_eq!(
            quiet && all_as_expected,
            p.condition == Condition::Settled,
            "{}",
            ctx()
        );
        // A machine without a member is the one quiet state the planner does not call settled.
        if quiet && !all_as_expected {
            assert_eq!(dg.reason, reason::MACHINE_WITHOUT_MEMBER, "{}", ctx());
            assert!(matches!(p.condition, Condition::Waiting(_)), "{}", ctx());
        }
        // Reasons match statuses.
        assert_eq!(pr.reason == reason::AS_EXPECTED, !pr.status, "{}", ctx());
        if dg.status {
            assert_ne!(dg.reason, reason::AS_EXPECTED, "{}", ctx());
        } else {
            assert!(
                [reason::AS_EXPECTED, reason::MACHINE_WITHOUT_MEMBER].contains(&dg.reason),
                "{}",
                ctx()
            );
        }
    }

    #[test]
    fn each_reason_in_a_world_an_administrator_would_recognise() {
        let spec = Spec::new(3).unwrap();
        let v = Slot::Voter { healthy: true };
        let derive_for = |slots: &[(Slot, bool, bool)], functional, stalled| {
            let obs = world(slots, false);
            let c = derive(&Facts {
                spec,
                observed: &obs,
                machine_api_functional: functional,
                stalled_learner: stalled,
            });
            c.map(|d| (d.status, d.reason))
        };
        let ok = (true, reason::AS_EXPECTED);
        let settled = [(v, false, true), (v, false, true), (v, false, true)];
        assert_eq!(
            derive_for(&settled, true, None),
            [
                ok,
                (false, reason::AS_EXPECTED),
                (false, reason::AS_EXPECTED)
            ]
        );
        // A replacement: new machine, old one deleting.
        let replacing = [
            (v, false, true),
            (v, false, true),
            (v, true, true),
            (Slot::Empty, false, false),
        ];
        assert_eq!(
            derive_for(&replacing, true, None)[1],
            (true, reason::REPLACING_MEMBER)
        );
        let stopped = [
            (v, false, true),
            (v, false, true),
            (Slot::Voter { healthy: false }, false, true),
        ];
        assert_eq!(
            derive_for(&stopped, true, None)[2],
            (true, reason::UNHEALTHY_MEMBERS)
        );
        let lost = [
            (v, false, true),
            (Slot::Voter { healthy: false }, false, true),
            (Slot::Voter { healthy: false }, false, true),
        ];
        assert_eq!(
            derive_for(&lost, true, None),
            [
                (false, reason::NO_QUORUM),
                (false, reason::NO_QUORUM),
                (true, reason::NO_QUORUM)
            ]
        );
        let spare = [
            (v, false, true),
            (v, false, true),
            (v, false, true),
            (Slot::Empty, false, false),
        ];
        assert_eq!(
            derive_for(&spare, true, None)[2],
            (false, reason::MACHINE_WITHOUT_MEMBER)
        );
        let learner = [
            (v, false, true),
            (v, false, true),
            (v, true, true),
            (
                Slot::Learner {
                    healthy: true,
                    applied: 10,
                },
                false,
                true,
            ),
        ];
        assert_eq!(
            derive_for(&learner, true, Some("cp-3"))[2],
            (true, reason::LEARNER_NOT_CATCHING_UP)
        );
        assert_eq!(
            derive_for(&settled, false, None)[2],
            (true, reason::MACHINE_API_NOT_FUNCTIONAL)
        );
        let unprotected = [(v, false, false), (v, false, true), (v, false, true)];
        assert_eq!(
            derive_for(&unprotected, true, None)[1],
            (true, reason::UPDATING_HOOKS)
        );
        // A dead host's Machine deleted by a health check: its voter goes first.
        let dead = [
            (v, false, true),
            (v, false, true),
            (Slot::Voter { healthy: false }, true, true),
            (Slot::Empty, false, false),
        ];
        assert_eq!(
            derive_for(&dead, true, None),
            [
                ok,
                (true, reason::REMOVING_UNHEALTHY_MEMBER),
                (false, reason::AS_EXPECTED)
            ]
        );
        // Its Machine not deleted: paused, Degraded as before.
        let dead_live = [
            (v, false, true),
            (v, false, true),
            (Slot::Voter { healthy: false }, false, true),
            (Slot::Empty, false, false),
        ];
        assert_eq!(
            derive_for(&dead_live, true, None)[2],
            (true, reason::UNHEALTHY_MEMBERS)
        );
    }

    #[test]
    fn transition_time_changes_only_when_the_status_flips() {
        let t0 = DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let t1 = t0 + chrono::Duration::minutes(5);
        let d = |status, reason: &'static str, message: &str| Derived {
            type_: "Degraded",
            status,
            reason,
            message: message.into(),
        };
        let first = merge(&[], &[d(false, reason::AS_EXPECTED, "fine")], t0, Some(1));
        assert_eq!(first[0].last_transition_time, "2026-01-01T00:00:00Z");
        // Same status, new reason and message: the time stays.
        let same = merge(
            &first,
            &[d(false, reason::AS_EXPECTED, "still")],
            t1,
            Some(2),
        );
        assert_eq!(same[0].last_transition_time, "2026-01-01T00:00:00Z");
        assert_eq!(
            (same[0].message.as_str(), same[0].observed_generation),
            ("still", Some(2))
        );
        let flipped = merge(
            &same,
            &[d(true, reason::UNHEALTHY_MEMBERS, "x")],
            t1,
            Some(2),
        );
        assert_eq!(flipped[0].last_transition_time, "2026-01-01T00:05:00Z");
        assert_eq!(flipped[0].status, "True");
    }

    #[test]
    fn failing_reconciles_mark_degraded_and_keep_what_was_observed() {
        let t0 = DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let obs = world(
            &[
                (Slot::Voter { healthy: true }, false, true),
                (Slot::Voter { healthy: true }, false, true),
                (Slot::Voter { healthy: true }, false, true),
            ],
            false,
        );
        let f = Facts {
            spec: Spec::new(3).unwrap(),
            observed: &obs,
            machine_api_functional: true,
            stalled_learner: None,
        };
        let ok = status(&f, &[], None, None, Some(1), t0);
        let t1 = t0 + chrono::Duration::minutes(1);
        let bad = failed(Some(&ok), "etcd unreachable", Some(1), t1);
        assert_eq!(bad.conditions.len(), 3);
        let d = bad
            .conditions
            .iter()
            .find(|c| c.type_ == "Degraded")
            .unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", reason::RECONCILE_FAILED)
        );
        assert!(d.message.contains("etcd unreachable"));
        assert_eq!(d.last_transition_time, "2026-01-01T00:01:00Z");
        // Available and Progressing as last observed.
        assert_eq!(bad.conditions[..2], ok.conditions[..2]);
        // Failing again changes nothing (no write); recovering flips Degraded back.
        assert_eq!(
            failed(
                Some(&bad),
                "etcd unreachable",
                Some(1),
                t1 + chrono::Duration::minutes(1)
            ),
            bad
        );
        let back = status(
            &f,
            &[],
            None,
            Some(&bad),
            Some(1),
            t1 + chrono::Duration::minutes(2),
        );
        let d = back
            .conditions
            .iter()
            .find(|c| c.type_ == "Degraded")
            .unwrap();
        assert_eq!(d.status, "False");
        assert_eq!(d.last_transition_time, "2026-01-01T00:03:00Z");
    }

    #[test]
    fn a_learner_is_stalled_only_after_its_index_stood_still_while_behind() {
        let l = Slot::Learner {
            healthy: true,
            applied: 10,
        };
        let v = Slot::Voter { healthy: true };
        let mut obs = world(&[(v, false, true), (l, false, true)], false);
        let mut p = LearnerProgress::default();
        let t = Instant::now();
        assert_eq!(p.stalled(&obs, t), None);
        assert_eq!(p.stalled(&obs, t + LEARNER_STALL / 2), None);
        assert_eq!(p.stalled(&obs, t + LEARNER_STALL), Some("cp-1".into()));
        // It moves: the clock starts again.
        obs.members[1].applied_index = 11;
        assert_eq!(p.stalled(&obs, t + LEARNER_STALL * 2), None);
        assert_eq!(
            p.stalled(&obs, t + LEARNER_STALL * 3 - Duration::from_secs(1)),
            None
        );
        // Caught up: never stalled.
        obs.leader_applied_index = Some(11);
        assert_eq!(p.stalled(&obs, t + LEARNER_STALL * 9), None);
    }

    #[test]
    fn the_crd_is_namespaced_with_a_status_subresource_and_the_columns() {
        use ::kube::CustomResourceExt as _;
        let crd = EtcdQuorum::crd();
        assert_eq!(crd.spec.group, crate::operator::crd::GROUP);
        assert_eq!(crd.spec.scope, "Namespaced");
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, crate::operator::crd::VERSION);
        assert!(v.subresources.as_ref().unwrap().status.is_some());
        let cols: Vec<&str> = v
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            cols,
            [
                "Available",
                "Progressing",
                "Degraded",
                "Voters",
                "Learners",
                "Age"
            ]
        );
    }

    #[test]
    fn a_request_waiting_for_its_rebuild_says_what_to_run_and_where() {
        // Nothing answers: quorum lost; cp-0 is a live Machine.
        let lost = Observed {
            machines: vec![super::super::plan::MachineState {
                name: "cp-0".into(),
                peer_url: "http://10.0.0.1:2380".into(),
                deleting: false,
                has_hook: true,
                hook_removed_by_other: false,
            }],
            ..Observed::default()
        };
        let ask = |survivor: &str| QuorumRestoreSpec {
            survivor: survivor.into(),
        };
        let st = restore_status(Some(&ask("cp-0")), None, &lost, 3).unwrap();
        assert_eq!(st.phase, "WaitingForRebuild");
        let m = st.message.clone().unwrap_or_default();
        assert!(
            m.contains("on Machine cp-0") && m.contains("etcd-warden quorum-restore --data-dir"),
            "{m}"
        );
        // Read back, the message is no part of the phase.
        assert_eq!(st.phase(), RestorePhase::WaitingForRebuild);
        let st = restore_status(Some(&ask("freshest")), None, &lost, 3).unwrap();
        let m = st.message.unwrap_or_default();
        assert!(m.contains("--survivor-data-dir"), "{m}");
    }
}
