//! A quorum restore asked for by an administrator: which survivor to rebuild the cluster
//! from, and the refusals the operator applies before anything is touched.
//!
//! The operator never rebuilds on its own: reviving a minority can lose writes a cut-off
//! majority acknowledged, which only a person who knows the majority is gone for good may
//! accept. Once the survivor serves as a one-member cluster, the grow-back is the planner's
//! usual work: fewer voters than desired, so a learner is added on a machine without a member,
//! promoted once caught up, one at a time ([`super::plan::plan`]).

use std::fmt;
use std::str::FromStr;

use super::plan::{Observed, has_quorum, voters_and_healthy};

/// Which survivor a quorum restore rebuilds from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SurvivorChoice {
    /// The member of this machine.
    Named(String),
    /// The survivor with the highest committed raft index, read from the data directories.
    Freshest,
}

impl FromStr for SurvivorChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" => Err("survivor is empty: name a machine, or \"freshest\"".into()),
            "freshest" => Ok(SurvivorChoice::Freshest),
            name => Ok(SurvivorChoice::Named(name.to_owned())),
        }
    }
}

impl fmt::Display for SurvivorChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SurvivorChoice::Named(m) => f.write_str(m),
            SurvivorChoice::Freshest => f.write_str("freshest"),
        }
    }
}

impl serde::Serialize for SurvivorChoice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for SurvivorChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Why a quorum restore request is refused before anything is touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestRefusal {
    /// A majority of the voters is healthy, or a member knows a leader: nothing to restore.
    #[error("quorum is not lost: {0}; not restoring")]
    NotLost(String),
    /// The named survivor is no machine of the control plane.
    #[error("survivor {0:?} is no machine of the control plane")]
    UnknownMachine(String),
    /// The named survivor's machine is being deleted.
    #[error("survivor {0:?} is being deleted; name another machine or \"freshest\"")]
    Deleting(String),
}

/// Checks a request against what the operator observes: quorum must be lost (no healthy
/// majority of voters, and no leader), and a named survivor must be a live machine. The rebuild
/// itself checks again, from the survivor's own member list, for its `lost_for`.
pub fn check_request(obs: &Observed, survivor: &SurvivorChoice) -> Result<(), RequestRefusal> {
    let (voters, healthy) = voters_and_healthy(&obs.members);
    // A leader seen anywhere means a quorum elected it: fail closed.
    if has_quorum(&obs.members) || obs.leader_applied_index.is_some() {
        return Err(RequestRefusal::NotLost(format!(
            "{healthy} of {voters} voters healthy{}",
            if obs.leader_applied_index.is_some() {
                ", a leader elected"
            } else {
                ""
            }
        )));
    }
    if let SurvivorChoice::Named(name) = survivor {
        let mc = obs
            .machines
            .iter()
            .find(|m| &m.name == name)
            .ok_or_else(|| RequestRefusal::UnknownMachine(name.clone()))?;
        if mc.deleting {
            return Err(RequestRefusal::Deleting(name.clone()));
        }
    }
    Ok(())
}

/// Where a requested quorum restore stands, for a backend whose rebuild runs elsewhere
/// (Kubernetes: `etcd-warden quorum-restore` on the survivor's node) and which records the
/// request's phase beside it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "phase", content = "message", rename_all = "PascalCase")]
pub enum RestorePhase {
    /// Refused before anything was touched; the request must be made again.
    Refused(String),
    /// Accepted: waiting until the survivor serves as a one-member cluster.
    WaitingForRebuild,
    /// The survivor serves alone; the planner adds learners, one at a time.
    GrowingBack,
    /// Back to the desired voters, all healthy: the request can be removed.
    Done,
}

/// The next phase of a request from the last one recorded (`None` for a new request) and what
/// is observed now. A request made while the cluster serves is refused, and stays refused: left
/// in place, it would be accepted by the next quorum loss, which its author never judged (and
/// the survivor's sidecar would then rebuild on its own); it must be made again. Once accepted, the
/// cluster serving again with one voter (on the named machine) means the survivor was
/// rebuilt, and `desired` healthy voters without learners means it grew back.
pub fn next_phase(
    previous: Option<&RestorePhase>,
    obs: &Observed,
    survivor: &SurvivorChoice,
    desired: usize,
) -> RestorePhase {
    let voters: Vec<_> = obs.members.iter().filter(|m| !m.is_learner).collect();
    let learners = obs.members.len() - voters.len();
    let serving = obs.leader_applied_index.is_some() && voters.iter().all(|m| m.healthy);
    match previous {
        None => match check_request(obs, survivor) {
            Ok(()) => RestorePhase::WaitingForRebuild,
            Err(e) => RestorePhase::Refused(format!(
                "{e} (remove spec.quorumRestore, wait until its status is gone, and ask again)"
            )),
        },
        Some(refused @ RestorePhase::Refused(_)) => refused.clone(),
        Some(RestorePhase::WaitingForRebuild) => {
            let on_survivor = |m: &&super::plan::MemberState| match survivor {
                SurvivorChoice::Freshest => true,
                SurvivorChoice::Named(name) => obs.machines.iter().any(|mc| {
                    &mc.name == name
                        && m.peer_urls
                            .iter()
                            .any(|u| super::plan::same_url(u, &mc.peer_url))
                }),
            };
            if serving && voters.len() == 1 && voters.iter().all(on_survivor) {
                RestorePhase::GrowingBack
            } else {
                RestorePhase::WaitingForRebuild
            }
        }
        Some(RestorePhase::GrowingBack) | Some(RestorePhase::Done) => {
            if serving && voters.len() >= desired && learners == 0 {
                RestorePhase::Done
            } else {
                RestorePhase::GrowingBack
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::quorum::plan::{MachineState, MemberState};

    fn obs(healthy: &[bool], leader: bool) -> Observed {
        Observed {
            members: healthy
                .iter()
                .enumerate()
                .map(|(i, h)| MemberState {
                    id: i as u64 + 1,
                    name: format!("m{i}"),
                    peer_urls: vec![format!("http://10.0.0.{i}:2380")],
                    is_learner: false,
                    healthy: *h,
                    applied_index: 0,
                })
                .collect(),
            machines: (0..healthy.len())
                .map(|i| MachineState {
                    name: format!("m{i}"),
                    peer_url: format!("http://10.0.0.{i}:2380"),
                    deleting: i == 2,
                    has_hook: true,
                    hook_removed_by_other: false,
                })
                .collect(),
            leader_applied_index: leader.then_some(10),
        }
    }

    #[test]
    fn survivor_parses_a_machine_or_freshest() {
        assert_eq!("freshest".parse(), Ok(SurvivorChoice::Freshest));
        assert_eq!(" m1 ".parse(), Ok(SurvivorChoice::Named("m1".into())));
        assert!("".parse::<SurvivorChoice>().is_err());
        let json: SurvivorChoice = serde_json::from_str("\"freshest\"").unwrap();
        assert_eq!(json, SurvivorChoice::Freshest);
        assert_eq!(serde_json::to_string(&json).unwrap(), "\"freshest\"");
    }

    #[test]
    fn refused_unless_quorum_is_lost() {
        let any = SurvivorChoice::Freshest;
        let e = check_request(&obs(&[true, true, false], true), &any).unwrap_err();
        assert!(e.to_string().contains("2 of 3 voters healthy"), "{e}");
        // One healthy member that still knows a leader: fail closed.
        let e = check_request(&obs(&[true, false, false], true), &any).unwrap_err();
        assert!(matches!(e, RequestRefusal::NotLost(_)), "{e}");
        assert!(check_request(&obs(&[false, false, false], false), &any).is_ok());
        // Nothing observed at all (no member answers) is lost too.
        assert!(check_request(&Observed::default(), &any).is_ok());
    }

    #[test]
    fn a_named_survivor_must_be_a_live_machine() {
        let lost = obs(&[false, false, false], false);
        let named = |n: &str| SurvivorChoice::Named(n.into());
        assert!(check_request(&lost, &named("m0")).is_ok());
        assert_eq!(
            check_request(&lost, &named("m9")),
            Err(RequestRefusal::UnknownMachine("m9".into()))
        );
        assert_eq!(
            check_request(&lost, &named("m2")),
            Err(RequestRefusal::Deleting("m2".into()))
        );
    }

    #[test]
    fn a_request_is_refused_accepted_then_followed_to_done() {
        let named = SurvivorChoice::Named("m0".into());
        // Made while the cluster serves: refused, and stays so, even once quorum is lost:
        // nobody judged that loss.
        let serving = obs(&[true, true, true], true);
        let refused = next_phase(None, &serving, &named, 3);
        assert!(
            matches!(&refused, RestorePhase::Refused(m) if m.contains("quorum is not lost") && m.contains("ask again")),
            "{refused:?}"
        );
        let lost = obs(&[false, false, false], false);
        assert_eq!(next_phase(Some(&refused), &lost, &named, 3), refused);
        // Made again after the loss: accepted, then waiting until m0 serves alone.
        let p = next_phase(None, &lost, &named, 3);
        assert_eq!(p, RestorePhase::WaitingForRebuild);
        assert_eq!(
            next_phase(Some(&p), &lost, &named, 3),
            RestorePhase::WaitingForRebuild
        );
        // Another machine's member alone is not the survivor asked for.
        let mut alone = obs(&[true, true, true], true);
        alone.members.retain(|m| m.name == "m1");
        assert_eq!(
            next_phase(Some(&p), &alone, &named, 3),
            RestorePhase::WaitingForRebuild
        );
        let mut rebuilt = obs(&[true, true, true], true);
        rebuilt.members.retain(|m| m.name == "m0");
        let p = next_phase(Some(&p), &rebuilt, &named, 3);
        assert_eq!(p, RestorePhase::GrowingBack);
        // A learner on the way, then two voters: still growing.
        let mut growing = obs(&[true, true, true], true);
        growing.members[1].is_learner = true;
        growing.members.pop();
        assert_eq!(
            next_phase(Some(&p), &growing, &named, 3),
            RestorePhase::GrowingBack
        );
        assert_eq!(
            next_phase(Some(&p), &serving, &named, 3),
            RestorePhase::Done
        );
    }
}
