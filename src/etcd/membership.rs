//! Facts about etcd membership that the restore's rejoin and the operator both rely on: what a
//! member looks like when observed, what quorum is, whether a removal keeps it, and the
//! `--initial-cluster` a joining member starts with. Pure, and below both: neither the sidecar
//! side (`restore/`) nor the operator decides anything here.

use serde::Serialize;

/// One etcd member as observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemberState {
    /// etcd member ID.
    pub id: u64,
    /// Member name; etcd reports an empty name until the member's process has started.
    pub name: String,
    /// Peer URLs; the link between a member and the machine that hosts it.
    pub peer_urls: Vec<String>,
    /// Raft learner (non-voting) rather than voter.
    pub is_learner: bool,
    /// Answered a status request without errors and knows a leader.
    pub healthy: bool,
    /// Raft applied index reported by the member (0 when unknown).
    pub applied_index: u64,
}

impl MemberState {
    /// Whether the member's process has ever joined (etcd names a member when it starts).
    pub fn started(&self) -> bool {
        !self.name.is_empty()
    }
}

/// Majority of `voters`.
pub fn quorum(voters: usize) -> usize {
    voters / 2 + 1
}

/// Whether the voters among `members` have a healthy majority: the planner's rule before any
/// membership change (no voters at all is no quorum).
pub fn has_quorum<'a>(members: impl IntoIterator<Item = &'a MemberState>) -> bool {
    let (voters, healthy) = voters_and_healthy(members);
    voters > 0 && healthy >= quorum(voters)
}

/// How many members vote (learners do not), and how many of those are healthy.
pub fn voters_and_healthy<'a>(
    members: impl IntoIterator<Item = &'a MemberState>,
) -> (usize, usize) {
    members
        .into_iter()
        .filter(|m| !m.is_learner)
        .fold((0, 0), |(v, h), m| (v + 1, h + usize::from(m.healthy)))
}

/// Whether removing member `id` leaves voters with a healthy majority ([`has_quorum`] of the
/// others).
pub fn removal_keeps_quorum(members: &[MemberState], id: u64) -> bool {
    has_quorum(members.iter().filter(|m| m.id != id))
}

/// Whether two peer URLs name the same endpoint (a trailing slash aside).
pub fn same_url(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// `name=peerURL,...` for every member, naming the one being started after its machine (etcd
/// lists it without a name until it starts).
pub fn initial_cluster(list: &[etcd_client::Member], machine: &str, member_id: u64) -> String {
    let mut parts = Vec::new();
    for m in list {
        let name = if m.id() == member_id {
            machine
        } else {
            m.name()
        };
        if name.is_empty() {
            continue;
        }
        for u in m.peer_urls() {
            parts.push(format!("{name}={u}"));
        }
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voter(id: u64, healthy: bool) -> MemberState {
        MemberState {
            id,
            name: format!("m{id}"),
            peer_urls: vec![format!("http://10.0.0.{id}:2380")],
            is_learner: false,
            healthy,
            applied_index: 1,
        }
    }

    #[test]
    fn quorum_is_a_healthy_majority_of_voters_and_learners_do_not_count() {
        assert_eq!((1..=5).map(quorum).collect::<Vec<_>>(), [1, 2, 2, 3, 3]);
        let mut m = vec![voter(1, true), voter(2, true), voter(3, false)];
        assert!(has_quorum(&m));
        assert!(removal_keeps_quorum(&m, 3));
        assert!(!removal_keeps_quorum(&m, 1));
        m[1].healthy = false;
        assert!(!has_quorum(&m));
        let learner = MemberState {
            is_learner: true,
            healthy: true,
            ..voter(4, true)
        };
        m.push(learner);
        assert!(!has_quorum(&m));
        // The two unhealthy ones become learners: one healthy voter of one.
        m[1].is_learner = true;
        m[2].is_learner = true;
        assert!(has_quorum(&m));
        assert!(!has_quorum(&[]));
        assert!(same_url("http://a:2380/", "http://a:2380"));
        assert!(!same_url("http://a:2380", "http://b:2380"));
    }
}
