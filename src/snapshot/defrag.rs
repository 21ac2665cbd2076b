//! Which member to defragment next: a pure decision over the members' status, so the order
//! (followers first, the leader last), the free-space rule and the health stop are tested
//! without etcd.
//!
//! Defragmenting a member blocks its reads and writes while its database file is rewritten. One
//! member at a time keeps a quorum serving; the leader last avoids a leader change in the middle
//! of the pass (and a follower's defragmentation cannot disturb the raft group the way a stalled
//! leader can). The plan is made again before every member, from fresh status, so a member that
//! became unhealthy, or a leader that moved, stops or reorders the rest of the pass.

/// One member as its own status (and the member list) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberState {
    /// The member's ID.
    pub id: u64,
    /// Its client URLs, from the member list.
    pub client_urls: Vec<String>,
    /// It leads the raft group.
    pub is_leader: bool,
    /// It is a learner.
    pub is_learner: bool,
    /// Bytes of its database file.
    pub db_size: i64,
    /// Bytes of the file in use; the rest is free space defragmentation gives back.
    pub db_size_in_use: i64,
    /// It answered a status request, reports no errors and knows a leader.
    pub healthy: bool,
}

impl MemberState {
    /// The fraction of its database file that is free, 0 when the sizes make no sense.
    pub fn free_fraction(&self) -> f64 {
        if self.db_size <= 0 || self.db_size_in_use < 0 || self.db_size_in_use > self.db_size {
            return 0.0;
        }
        (self.db_size - self.db_size_in_use) as f64 / self.db_size as f64
    }
}

/// What to do next.
#[derive(Debug, Clone, PartialEq)]
pub enum DefragPlan {
    /// Defragment these members, in this order (the first now; the plan is made again before
    /// the next). Empty when nothing is left to do.
    Defragment(Vec<u64>),
    /// The cluster is not healthy: defragment nothing (more).
    Stop(String),
}

/// The members still to defragment in order, or why to stop. `me` is the member next to this
/// sidecar, which must lead (so two sidecars never run passes at once); `done` are those already
/// defragmented in this pass; a member whose free fraction is below `min_free_fraction` is
/// skipped. Every member (done or not) must be healthy and exactly one must lead.
pub fn plan(members: &[MemberState], me: u64, done: &[u64], min_free_fraction: f64) -> DefragPlan {
    if members.is_empty() {
        return DefragPlan::Stop("the member list is empty".into());
    }
    let unhealthy: Vec<String> = members
        .iter()
        .filter(|m| !m.healthy)
        .map(|m| format!("{:x}", m.id))
        .collect();
    if !unhealthy.is_empty() {
        return DefragPlan::Stop(format!("unhealthy members: {}", unhealthy.join(", ")));
    }
    let leaders = members.iter().filter(|m| m.is_leader).count();
    if leaders != 1 {
        return DefragPlan::Stop(format!("{leaders} members claim to lead; want exactly 1"));
    }
    if !members.iter().any(|m| m.is_leader && m.id == me) {
        return DefragPlan::Stop(format!("this sidecar's member {me:x} does not lead"));
    }
    let mut todo: Vec<&MemberState> = members
        .iter()
        .filter(|m| !done.contains(&m.id))
        .filter(|m| m.free_fraction() >= min_free_fraction)
        .collect();
    // Learners, then voting followers, then the leader; by ID within each, so the order is stable.
    todo.sort_by_key(|m| (m.is_leader, !m.is_learner, m.id));
    DefragPlan::Defragment(todo.into_iter().map(|m| m.id).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member(id: u64, leader: bool, size: i64, in_use: i64) -> MemberState {
        MemberState {
            id,
            client_urls: vec![format!("http://m{id}:2379")],
            is_leader: leader,
            is_learner: false,
            db_size: size,
            db_size_in_use: in_use,
            healthy: true,
        }
    }

    #[test]
    fn followers_first_leader_last_and_members_with_little_free_space_skipped() {
        let roomy = [
            member(3, false, 100, 10),
            member(1, true, 100, 10),
            member(2, false, 100, 10),
        ];
        // 5% free is below 10%; exactly 10% is not.
        let full = [
            member(1, true, 100, 95),
            member(2, false, 100, 90),
            member(3, false, 100, 99),
        ];
        // (members, done, min free fraction, the order planned)
        type Case<'a> = (&'a [MemberState], &'a [u64], f64, &'a [u64]);
        let cases: [Case; 6] = [
            (&roomy, &[], 0.1, &[2, 3, 1]),
            (&roomy, &[2], 0.1, &[3, 1]),
            (&roomy, &[2, 3], 0.1, &[1]),
            (&roomy, &[1, 2, 3], 0.1, &[]),
            (&full, &[], 0.1, &[2]),
            (&full, &[], 0.0, &[2, 3, 1]),
        ];
        for (ms, done, min_free, order) in cases {
            assert_eq!(
                plan(ms, 1, done, min_free),
                DefragPlan::Defragment(order.to_vec()),
                "done {done:?}, min free {min_free}"
            );
        }
    }

    #[test]
    fn an_unhealthy_member_or_no_leader_stops_the_pass() {
        let mut ms = vec![member(1, true, 100, 10), member(2, false, 100, 10)];
        ms[1].healthy = false;
        assert!(matches!(plan(&ms, 1, &[], 0.1), DefragPlan::Stop(r) if r.contains('2')));
        ms[1].healthy = true;
        // Another member leads: its sidecar runs the pass, not this one.
        assert!(
            matches!(plan(&ms, 2, &[], 0.1), DefragPlan::Stop(r) if r.contains("does not lead"))
        );
        ms[0].is_leader = false;
        assert!(matches!(plan(&ms, 1, &[], 0.1), DefragPlan::Stop(_)));
        assert!(matches!(plan(&[], 1, &[], 0.1), DefragPlan::Stop(_)));
        // A done member that fails afterwards still stops the rest.
        ms[0].is_leader = true;
        ms[0].healthy = false;
        assert!(matches!(plan(&ms, 1, &[1], 0.1), DefragPlan::Stop(_)));
    }

    #[test]
    fn nonsense_sizes_count_as_no_free_space() {
        assert_eq!(member(1, true, 0, 0).free_fraction(), 0.0);
        assert_eq!(member(1, true, 100, 200).free_fraction(), 0.0);
        assert_eq!(member(1, true, 100, -1).free_fraction(), 0.0);
        assert_eq!(member(1, true, 100, 25).free_fraction(), 0.75);
    }

    fn cluster() -> impl Strategy<Value = (Vec<MemberState>, u64, Vec<u64>, f64)> {
        (1usize..7).prop_flat_map(|n| {
            (
                proptest::collection::vec(
                    (
                        any::<bool>(),
                        1i64..1000,
                        0i64..1000,
                        prop::bool::weighted(0.9),
                    ),
                    n,
                ),
                0..n,
                0..n,
                proptest::collection::vec(any::<bool>(), n),
                0.0f64..1.0,
            )
                .prop_map(|(ms, leader, me, done, frac)| {
                    let members: Vec<MemberState> = ms
                        .into_iter()
                        .enumerate()
                        .map(|(i, (learner, size, in_use, healthy))| MemberState {
                            id: i as u64 + 1,
                            client_urls: vec![],
                            is_leader: i == leader,
                            is_learner: learner && i != leader,
                            db_size: size,
                            db_size_in_use: in_use.min(size),
                            healthy,
                        })
                        .collect();
                    let done = members
                        .iter()
                        .zip(done)
                        .filter(|(_, d)| *d)
                        .map(|(m, _)| m.id)
                        .collect();
                    (members, me as u64 + 1, done, frac)
                })
        })
    }

    proptest! {
        #[test]
        fn the_plan_is_safe((members, me, done, frac) in cluster()) {
            let leader = members.iter().find(|m| m.is_leader).map(|m| m.id);
            match plan(&members, me, &done, frac) {
                DefragPlan::Stop(_) => {
                    prop_assert!(members.iter().any(|m| !m.healthy) || leader != Some(me));
                }
                DefragPlan::Defragment(order) => {
                    prop_assert!(members.iter().all(|m| m.healthy));
                    prop_assert_eq!(leader, Some(me));
                    let of = |id: u64| members.iter().find(|m| m.id == id).unwrap();
                    // Each member at most once, none already done, none under the rule.
                    let mut seen = order.clone();
                    seen.sort_unstable();
                    seen.dedup();
                    prop_assert_eq!(seen.len(), order.len());
                    for id in &order {
                        prop_assert!(!done.contains(id));
                        prop_assert!(of(*id).free_fraction() >= frac);
                    }
                    // Every member not done and over the rule is in it.
                    for m in &members {
                        if !done.contains(&m.id) && m.free_fraction() >= frac {
                            prop_assert!(order.contains(&m.id));
                        }
                    }
                    // The leader, if in it, comes last.
                    if let Some(pos) = order.iter().position(|id| of(*id).is_leader) {
                        prop_assert_eq!(pos, order.len() - 1);
                    }
                }
            }
        }
    }
}
