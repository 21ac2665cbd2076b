//! What a defragmentation pass does next: a pure decision over the members' status, so the order
//! (followers first, leadership moved away before the leader's turn), the size and free-space
//! rule, the kill switch and the health and learner stops are tested without etcd.
//!
//! Defragmenting a member blocks its reads and writes while its database file is rewritten. One
//! member at a time keeps a quorum serving. The leader is never defragmented in place: etcd
//! answers lease keep-alives only at the leader, so a leader rewriting its file stalls every
//! keep-alive in the cluster (etcd-backup-restore's #1052). When every other member is done,
//! leadership is first moved to a healthy, caught-up voting follower ([`DefragPlan::MoveLeader`]),
//! and the former leader, now a follower, is defragmented at the next step.
//!
//! **Who runs a pass, across a leadership change.** Only the sidecar next to the raft leader
//! *starts* a pass (checked at its first step). The pass then belongs to that sidecar until it
//! ends, whoever leads meanwhile: its progress (the members done, the moves made) lives in that
//! sidecar alone and the decision is made again from fresh status before every step, so a
//! leadership change, the pass's own move or a spontaneous election, reorders the members left
//! instead of dropping the pass (etcd-backup-restore's #782). A hand-over to the new leader's
//! sidecar would need the progress stored somewhere both can read, and a window in which both
//! believe they run it; keeping the pass where it started needs neither. The other side of it:
//! a sidecar that has just *taken* leadership may be watching a pass that a former leader's
//! sidecar still runs, so it starts no automatic pass for a hold-off as long as any pass can
//! still take ([`holdoff`]); two passes at once could defragment two members at once.
//!
//! Every step re-reads every member's status: a member that became unhealthy, a learner that
//! appeared, or the kill switch stops the rest of the pass. An election in the middle of a pass
//! leaves members without a leader for a moment: a pass under way waits that out
//! ([`StopReason::transient`], up to [`ELECTION_GRACE`]) doing nothing, rather than stop.

use std::time::Duration;

/// Leadership moves (the pass's own and spontaneous ones it reacted to) after which a pass stops:
/// leadership that keeps moving means an unstable cluster, not one to defragment.
pub const MAX_MOVES: u32 = 3;

/// How long a pass under way waits for an election to settle (a [transient](StopReason::transient)
/// stop) before it stops; etcd's election timeout is a second by default.
pub const ELECTION_GRACE: Duration = Duration::from_secs(10);

/// How many raft entries a member may be behind the leader and still count as caught up. The
/// members' status is read one after another while writes go on, so an exact match is too
/// strict; a member replaying a snapshot or a long log is far more behind than this.
pub const CAUGHT_UP_LAG: u64 = 1000;

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
    /// The raft index it has committed (its status's `raftIndex`).
    pub raft_index: u64,
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

    /// Whether its raft index is within [`CAUGHT_UP_LAG`] of `leader`'s.
    fn caught_up_with(&self, leader: &MemberState) -> bool {
        self.raft_index.saturating_add(CAUGHT_UP_LAG) >= leader.raft_index
    }
}

/// Which members are worth defragmenting: a database file of at least `min_db_size` bytes of
/// which at least `min_free_fraction` is free.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    /// Bytes of the database file.
    pub min_db_size: u64,
    /// Free fraction of it, 0 to 1.
    pub min_free_fraction: f64,
}

impl Rule {
    /// Whether `m` is over the rule.
    pub fn wants(&self, m: &MemberState) -> bool {
        u64::try_from(m.db_size).unwrap_or(0) >= self.min_db_size
            && m.free_fraction() >= self.min_free_fraction
    }
}

/// Where a pass is, as the sidecar running it knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassState {
    /// Members defragmented in this pass.
    pub done: Vec<u64>,
    /// Leadership moves so far (see [`MAX_MOVES`]).
    pub moves: u32,
    /// No step has been taken yet: this sidecar's member must lead to start the pass.
    pub starting: bool,
    /// The kill switch is on.
    pub disabled: bool,
}

impl PassState {
    /// A pass before its first step.
    pub fn start() -> Self {
        PassState {
            starting: true,
            ..PassState::default()
        }
    }
}

/// Why a pass stops before it is done; the label is the metrics' bounded `reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The kill switch is on.
    Disabled,
    /// A member did not answer, reports an error, or knows no leader.
    Unhealthy,
    /// A learner is catching up (or does not answer).
    Learner,
    /// Not exactly one member leads.
    NoLeader,
    /// This sidecar's member does not lead at the start: the leader's sidecar runs passes.
    NotLeader,
    /// Only the leader is left and no voting follower is healthy and caught up to take over.
    NoTransferee,
    /// Leadership moved [`MAX_MOVES`] times in this pass.
    LeaderUnstable,
}

impl StopReason {
    /// Whether a pass under way waits (up to [`ELECTION_GRACE`]) and plans again instead of
    /// stopping: an election leaves members without a leader, or naming one that has stepped
    /// down, for a moment; a pass must not be dropped for that (etcd-backup-restore's #782).
    /// Nothing is done while it waits, so "only while every member is healthy" still holds.
    pub fn transient(self) -> bool {
        matches!(self, StopReason::NoLeader | StopReason::Unhealthy)
    }

    /// Every reason, for metrics that list each label from the start.
    pub const ALL: [StopReason; 7] = [
        StopReason::Disabled,
        StopReason::Unhealthy,
        StopReason::Learner,
        StopReason::NoLeader,
        StopReason::NotLeader,
        StopReason::NoTransferee,
        StopReason::LeaderUnstable,
    ];

    /// The metrics' `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            StopReason::Disabled => "disabled",
            StopReason::Unhealthy => "unhealthy",
            StopReason::Learner => "learner",
            StopReason::NoLeader => "no_leader",
            StopReason::NotLeader => "not_leader",
            StopReason::NoTransferee => "no_transferee",
            StopReason::LeaderUnstable => "leader_unstable",
        }
    }
}

/// What to do next.
#[derive(Debug, Clone, PartialEq)]
pub enum DefragPlan {
    /// Defragment this member (never the leader of a cluster with other voting members).
    Defragment(u64),
    /// Move leadership from the leader `from` to the caught-up follower `to` (a request to the
    /// leader's endpoint); its defragmentation follows once it no longer leads.
    MoveLeader {
        /// The leader.
        from: u64,
        /// The follower to take over.
        to: u64,
    },
    /// Nothing is left: every member is done or under the rule.
    Done,
    /// Defragment nothing (more).
    Stop {
        /// Why, for metrics.
        reason: StopReason,
        /// Why, in words naming the members at fault.
        detail: String,
    },
}

fn stop(reason: StopReason, detail: String) -> DefragPlan {
    DefragPlan::Stop { reason, detail }
}

fn ids<'a>(ms: impl Iterator<Item = &'a MemberState>) -> String {
    ms.map(|m| format!("{:x}", m.id))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The next step of a pass over `members` (fresh status) run by the sidecar of member `me`.
/// Stops, in this order: the kill switch; a learner that lags or does not answer; an unhealthy
/// voting member (done or not); not exactly one leader; at the start, `me` not leading; too many
/// leadership moves. Then: the next member over `rule` and not done, learners first, then voting
/// followers (by ID); when only the leader is left, a move of leadership to the healthy voting
/// follower with the highest raft index within [`CAUGHT_UP_LAG`] of the leader's. A cluster of
/// one voting member has nobody to hand over to: its leader is defragmented in place.
pub fn plan(members: &[MemberState], me: u64, pass: &PassState, rule: &Rule) -> DefragPlan {
    if pass.disabled {
        return stop(
            StopReason::Disabled,
            "the kill switch (defrag.disable_file) is on".into(),
        );
    }
    if members.is_empty() {
        return stop(StopReason::Unhealthy, "the member list is empty".into());
    }
    let leaders: Vec<&MemberState> = members.iter().filter(|m| m.is_leader).collect();
    let lagging: Vec<&MemberState> = members
        .iter()
        .filter(|m| m.is_learner)
        .filter(|m| !m.healthy || leaders.first().is_some_and(|l| !m.caught_up_with(l)))
        .collect();
    if !lagging.is_empty() {
        return stop(
            StopReason::Learner,
            format!(
                "learners catching up (or not answering): {}",
                ids(lagging.into_iter())
            ),
        );
    }
    let unhealthy: Vec<&MemberState> = members.iter().filter(|m| !m.healthy).collect();
    if !unhealthy.is_empty() {
        return stop(
            StopReason::Unhealthy,
            format!("unhealthy members: {}", ids(unhealthy.into_iter())),
        );
    }
    let [leader] = leaders[..] else {
        return stop(
            StopReason::NoLeader,
            format!("{} members claim to lead; want exactly 1", leaders.len()),
        );
    };
    if pass.starting && leader.id != me {
        return stop(
            StopReason::NotLeader,
            format!(
                "this sidecar's member {me:x} does not lead ({:x} does): its sidecar runs passes",
                leader.id
            ),
        );
    }
    if pass.moves >= MAX_MOVES {
        return stop(
            StopReason::LeaderUnstable,
            format!("leadership moved {} times in this pass", pass.moves),
        );
    }
    let left = |m: &&MemberState| !pass.done.contains(&m.id) && rule.wants(m);
    // Learners, then voting followers; by ID within each, so the order is stable.
    let next = members
        .iter()
        .filter(|m| !m.is_leader)
        .filter(left)
        .min_by_key(|m| (!m.is_learner, m.id));
    if let Some(m) = next {
        return DefragPlan::Defragment(m.id);
    }
    if !left(&leader) {
        return DefragPlan::Done;
    }
    let voters = members.iter().filter(|m| !m.is_learner).count();
    if voters == 1 {
        return DefragPlan::Defragment(leader.id);
    }
    let to = members
        .iter()
        .filter(|m| !m.is_leader && !m.is_learner && m.caught_up_with(leader))
        .max_by_key(|m| (m.raft_index, std::cmp::Reverse(m.id)));
    match to {
        Some(to) => DefragPlan::MoveLeader {
            from: leader.id,
            to: to.id,
        },
        None => stop(
            StopReason::NoTransferee,
            format!(
                "no voting follower is caught up with leader {:x} to take over",
                leader.id
            ),
        ),
    }
}

/// How long a sidecar that has just taken leadership starts no automatic pass: as long as a pass
/// the former leader's sidecar started may still run (each of its steps, every member and every
/// move, is bounded by `step_timeout`).
pub fn holdoff(step_timeout: Duration, cluster_size: u64) -> Duration {
    let steps = u32::try_from(cluster_size)
        .unwrap_or(u32::MAX)
        .saturating_add(MAX_MOVES);
    step_timeout.saturating_mul(steps)
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
            raft_index: 5000,
            healthy: true,
        }
    }

    const TEN: Rule = Rule {
        min_db_size: 0,
        min_free_fraction: 0.1,
    };

    fn pass(done: &[u64]) -> PassState {
        PassState {
            done: done.to_vec(),
            ..PassState::default()
        }
    }

    #[test]
    fn followers_first_then_leadership_moves_then_the_former_leader() {
        let mut ms = vec![
            member(3, false, 100, 10),
            member(1, true, 100, 10),
            member(2, false, 100, 10),
        ];
        assert_eq!(
            plan(&ms, 1, &PassState::start(), &TEN),
            DefragPlan::Defragment(2)
        );
        assert_eq!(plan(&ms, 1, &pass(&[2]), &TEN), DefragPlan::Defragment(3));
        // Only the leader left: leadership goes to the follower furthest ahead (3), not in place.
        ms[0].raft_index = 5001;
        assert_eq!(
            plan(&ms, 1, &pass(&[2, 3]), &TEN),
            DefragPlan::MoveLeader { from: 1, to: 3 }
        );
        // After the move 1 follows and is defragmented, from the sidecar that started the pass.
        ms[1].is_leader = false;
        ms[0].is_leader = true;
        let moved = PassState {
            moves: 1,
            ..pass(&[2, 3])
        };
        assert_eq!(plan(&ms, 1, &moved, &TEN), DefragPlan::Defragment(1));
        let all = PassState {
            moves: 1,
            ..pass(&[1, 2, 3])
        };
        assert_eq!(plan(&ms, 1, &all, &TEN), DefragPlan::Done);
    }

    #[test]
    fn a_spontaneous_election_mid_pass_reorders_the_members_left() {
        let mut ms = vec![
            member(1, true, 100, 10),
            member(2, false, 100, 10),
            member(3, false, 100, 10),
        ];
        // 2 is done; then 3 (not done) is elected: the former leader 1 is a follower now.
        ms[0].is_leader = false;
        ms[2].is_leader = true;
        ms[1].raft_index = 4999;
        assert_eq!(plan(&ms, 1, &pass(&[2]), &TEN), DefragPlan::Defragment(1));
        // Then the new leader's turn: moved away to the follower furthest ahead (1), not 2.
        assert_eq!(
            plan(&ms, 1, &pass(&[2, 1]), &TEN),
            DefragPlan::MoveLeader { from: 3, to: 1 }
        );
        // Elected a done member instead: nothing to move, the rest are followers.
        ms[2].is_leader = false;
        ms[1].is_leader = true;
        assert_eq!(plan(&ms, 1, &pass(&[2]), &TEN), DefragPlan::Defragment(1));
        assert_eq!(
            plan(&ms, 1, &pass(&[2, 1]), &TEN),
            DefragPlan::Defragment(3)
        );
        assert_eq!(plan(&ms, 1, &pass(&[2, 1, 3]), &TEN), DefragPlan::Done);
    }

    #[test]
    fn the_rule_skips_small_or_full_databases() {
        // 5% free is below 10%; exactly 10% is not.
        let full = [
            member(1, true, 100, 95),
            member(2, false, 100, 90),
            member(3, false, 100, 99),
        ];
        assert_eq!(plan(&full, 1, &pass(&[]), &TEN), DefragPlan::Defragment(2));
        assert_eq!(plan(&full, 1, &pass(&[2]), &TEN), DefragPlan::Done);
        // CEO's trigger: 100 MB and 45% free.
        let mb = 1 << 20;
        let rule = Rule {
            min_db_size: 100 * mb as u64,
            min_free_fraction: 0.45,
        };
        let ms = [
            member(1, true, 200 * mb, 100 * mb),
            member(2, false, 99 * mb, 10 * mb),
            member(3, false, 200 * mb, 120 * mb),
        ];
        assert!(rule.wants(&ms[0]));
        assert!(!rule.wants(&ms[1]), "under 100 MB");
        assert!(!rule.wants(&ms[2]), "40% free");
        assert_eq!(
            plan(&ms, 1, &pass(&[]), &rule),
            DefragPlan::MoveLeader { from: 1, to: 2 }
        );
    }

    fn reason(p: DefragPlan) -> StopReason {
        match p {
            DefragPlan::Stop { reason, .. } => reason,
            other => panic!("expected a stop, got {other:?}"),
        }
    }

    #[test]
    fn stops_name_their_reason() {
        let base = vec![
            member(1, true, 100, 10),
            member(2, false, 100, 10),
            member(3, false, 100, 10),
        ];
        let off = PassState {
            disabled: true,
            ..PassState::start()
        };
        assert_eq!(reason(plan(&base, 1, &off, &TEN)), StopReason::Disabled);
        assert_eq!(
            reason(plan(&[], 1, &PassState::start(), &TEN)),
            StopReason::Unhealthy
        );

        let mut ms = base.clone();
        ms[1].healthy = false;
        let p = plan(&ms, 1, &pass(&[]), &TEN);
        assert!(matches!(&p, DefragPlan::Stop { detail, .. } if detail.contains('2')));
        assert_eq!(reason(p), StopReason::Unhealthy);
        // A done member that fails afterwards still stops the rest.
        assert_eq!(
            reason(plan(&ms, 1, &pass(&[2]), &TEN)),
            StopReason::Unhealthy
        );

        // A learner behind the leader, or not answering: the learner is the reason.
        let mut ms = base.clone();
        ms.push(MemberState {
            is_learner: true,
            raft_index: 10,
            ..member(4, false, 100, 10)
        });
        assert_eq!(
            reason(plan(&ms, 1, &PassState::start(), &TEN)),
            StopReason::Learner
        );
        ms[3].healthy = false;
        ms[3].raft_index = 5000;
        assert_eq!(
            reason(plan(&ms, 1, &PassState::start(), &TEN)),
            StopReason::Learner
        );
        // Caught up: defragmented first, it serves no client that matters.
        ms[3].healthy = true;
        assert_eq!(
            plan(&ms, 1, &PassState::start(), &TEN),
            DefragPlan::Defragment(4)
        );

        // Another member leads at the start: its sidecar runs the pass. Later it is a move.
        assert_eq!(
            reason(plan(&base, 2, &PassState::start(), &TEN)),
            StopReason::NotLeader
        );
        assert_eq!(plan(&base, 2, &pass(&[]), &TEN), DefragPlan::Defragment(2));
        let mut ms = base.clone();
        ms[0].is_leader = false;
        assert_eq!(reason(plan(&ms, 1, &pass(&[]), &TEN)), StopReason::NoLeader);
        ms[1].is_leader = true;
        ms[2].is_leader = true;
        assert_eq!(reason(plan(&ms, 1, &pass(&[]), &TEN)), StopReason::NoLeader);

        let unstable = PassState {
            moves: MAX_MOVES,
            ..pass(&[])
        };
        assert_eq!(
            reason(plan(&base, 1, &unstable, &TEN)),
            StopReason::LeaderUnstable
        );

        // Followers too far behind to take over: the leader is not defragmented in place.
        let mut ms = base.clone();
        ms[0].raft_index = 5000 + CAUGHT_UP_LAG + 1;
        assert_eq!(
            reason(plan(&ms, 1, &pass(&[2, 3]), &TEN)),
            StopReason::NoTransferee
        );
        ms[0].raft_index = 5000 + CAUGHT_UP_LAG;
        assert_eq!(
            plan(&ms, 1, &pass(&[2, 3]), &TEN),
            DefragPlan::MoveLeader { from: 1, to: 2 }
        );
        // A learner is never a transferee.
        let ms = [
            member(1, true, 100, 10),
            MemberState {
                is_learner: true,
                ..member(2, false, 100, 10)
            },
        ];
        // One voting member: nobody to hand over to, so in place.
        assert_eq!(plan(&ms, 1, &pass(&[2]), &TEN), DefragPlan::Defragment(1));
    }

    #[test]
    fn only_an_election_is_waited_out() {
        let waited: Vec<StopReason> = StopReason::ALL
            .into_iter()
            .filter(|r| r.transient())
            .collect();
        assert_eq!(waited, [StopReason::Unhealthy, StopReason::NoLeader]);
    }

    #[test]
    fn nonsense_sizes_count_as_no_free_space() {
        assert_eq!(member(1, true, 0, 0).free_fraction(), 0.0);
        assert_eq!(member(1, true, 100, 200).free_fraction(), 0.0);
        assert_eq!(member(1, true, 100, -1).free_fraction(), 0.0);
        assert_eq!(member(1, true, 100, 25).free_fraction(), 0.75);
    }

    #[test]
    fn the_holdoff_outlasts_any_pass() {
        let t = Duration::from_secs(60);
        assert_eq!(holdoff(t, 3), t * (3 + MAX_MOVES));
        assert_eq!(holdoff(Duration::MAX, u64::MAX), Duration::MAX);
    }

    fn cluster() -> impl Strategy<Value = (Vec<MemberState>, u64, Vec<u64>, Rule)> {
        (1usize..7).prop_flat_map(|n| {
            (
                proptest::collection::vec(
                    (
                        any::<bool>(),
                        1i64..1000,
                        0i64..1000,
                        prop::bool::weighted(0.9),
                        0u64..3000,
                    ),
                    n,
                ),
                0..n,
                0..n,
                proptest::collection::vec(any::<bool>(), n),
                (0u64..1000, 0.0f64..1.0),
            )
                .prop_map(|(ms, leader, me, done, (size, frac))| {
                    let members: Vec<MemberState> = ms
                        .into_iter()
                        .enumerate()
                        .map(|(i, (learner, size, in_use, healthy, index))| MemberState {
                            id: i as u64 + 1,
                            client_urls: vec![],
                            is_leader: i == leader,
                            is_learner: learner && i != leader,
                            db_size: size,
                            db_size_in_use: in_use.min(size),
                            raft_index: index,
                            healthy,
                        })
                        .collect();
                    let done = members
                        .iter()
                        .zip(done)
                        .filter(|(_, d)| *d)
                        .map(|(m, _)| m.id)
                        .collect();
                    let rule = Rule {
                        min_db_size: size,
                        min_free_fraction: frac,
                    };
                    (members, me as u64 + 1, done, rule)
                })
        })
    }

    proptest! {
        #[test]
        fn a_step_is_safe((members, me, done, rule) in cluster(), starting: bool) {
            let p = PassState { done: done.clone(), starting, ..PassState::default() };
            let leader = members.iter().find(|m| m.is_leader).unwrap();
            let of = |id: u64| members.iter().find(|m| m.id == id).unwrap();
            let voters = members.iter().filter(|m| !m.is_learner).count();
            let lagging_learner = members
                .iter()
                .any(|m| m.is_learner && (!m.healthy || !m.caught_up_with(leader)));
            match plan(&members, me, &p, &rule) {
                DefragPlan::Stop { .. } => {
                    prop_assert!(
                        members.iter().any(|m| !m.healthy)
                            || lagging_learner
                            || (starting && leader.id != me)
                            || members.iter().any(|m| !done.contains(&m.id) && rule.wants(m))
                    );
                }
                action => {
                    prop_assert!(members.iter().all(|m| m.healthy));
                    prop_assert!(!starting || leader.id == me);
                    match action {
                        DefragPlan::Defragment(id) => {
                            prop_assert!(!done.contains(&id));
                            prop_assert!(rule.wants(of(id)));
                            // Never the leader while another voter could take over.
                            prop_assert!(!of(id).is_leader || voters == 1);
                        }
                        DefragPlan::MoveLeader { from, to } => {
                            prop_assert_eq!(from, leader.id);
                            prop_assert!(!of(to).is_learner && !of(to).is_leader);
                            prop_assert!(of(to).caught_up_with(leader));
                            // Only the leader is left.
                            for m in &members {
                                let left = !done.contains(&m.id) && rule.wants(m);
                                prop_assert_eq!(left, m.is_leader);
                            }
                        }
                        DefragPlan::Done => {
                            for m in &members {
                                prop_assert!(done.contains(&m.id) || !rule.wants(m));
                            }
                        }
                        DefragPlan::Stop { .. } => unreachable!(),
                    }
                }
            }
        }

        /// A whole pass over a healthy model cluster, the steps applied as etcd would: every
        /// member over the rule is defragmented once, none while it leads, and leadership moves
        /// at most once.
        #[test]
        fn a_pass_completes_without_defragmenting_a_leader(
            (mut members, _, _, rule) in cluster()
        ) {
            for m in &mut members {
                m.healthy = true;
                m.raft_index = 5000;
            }
            let me = members.iter().find(|m| m.is_leader).unwrap().id;
            let voters = members.iter().filter(|m| !m.is_learner).count();
            let mut pass = PassState::start();
            let mut defragmented = Vec::new();
            let mut finished = false;
            for _ in 0..(2 * members.len() + 2) {
                match plan(&members, me, &pass, &rule) {
                    DefragPlan::Defragment(id) => {
                        let m = members.iter_mut().find(|m| m.id == id).unwrap();
                        prop_assert!(!m.is_leader || voters == 1);
                        m.db_size_in_use = m.db_size;
                        defragmented.push(id);
                        pass.done.push(id);
                    }
                    DefragPlan::MoveLeader { from, to } => {
                        for m in &mut members {
                            m.is_leader = m.id == to;
                        }
                        prop_assert!(from != to);
                        pass.moves += 1;
                    }
                    DefragPlan::Done => {
                        finished = true;
                        break;
                    }
                    DefragPlan::Stop { reason, detail } => {
                        return Err(TestCaseError::fail(format!("{reason:?}: {detail}")));
                    }
                }
                pass.starting = false;
            }
            prop_assert!(finished);
            prop_assert!(pass.moves <= 1);
            let mut want: Vec<u64> = defragmented.clone();
            want.sort_unstable();
            want.dedup();
            prop_assert_eq!(want.len(), defragmented.len());
            prop_assert_eq!(pass.done.len(), defragmented.len());
        }
    }
}
