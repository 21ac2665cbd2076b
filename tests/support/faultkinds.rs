//! The soak's fault bookkeeping (docs/robustness.md, "Which faults ran"): the stores besides the
//! primary, each behind a fault proxy of its own; the members the seed chooses for the disk-full
//! fault and the partition; the opening round that plays every kind of a profile once; and the
//! check that every kind a profile plays did run (`fault-kind-missing`).
//!
//! Pure where it can be: which kinds a run must play and which it missed are functions over
//! names and counts, tested below without a world.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::faultproxy::{FaultMode, FaultProxy};
use super::invariants::Violation;
use super::schedule::SplitMix64;

/// A store other than the primary (the primary is the world's own proxy, `store-*` kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The sidecars' secondary store (`store.secondary.endpoint`).
    Secondary,
    /// The copy Job's destination, which the destination restore reads too.
    Destination,
    /// The primary store as the Jobs (`compact`, the drill, `ls`, the copy Job's source) reach
    /// it: the same bucket as the sidecars', through a proxy of its own.
    Jobs,
}

/// The proxies in front of the secondary, the destination and the Jobs' view of the primary.
pub struct StoreProxies {
    pub secondary: Arc<FaultProxy>,
    pub destination: Arc<FaultProxy>,
    pub jobs: Arc<FaultProxy>,
}

impl StoreProxies {
    /// The destination's and the Jobs' proxies in front of the S3 server at `s3`; the
    /// secondary's was started before the sidecars (their keys name it).
    pub fn new(s3: SocketAddr, secondary: FaultProxy) -> StoreProxies {
        StoreProxies {
            secondary: Arc::new(secondary),
            destination: Arc::new(FaultProxy::spawn(s3)),
            jobs: Arc::new(FaultProxy::spawn(s3)),
        }
    }

    pub fn of(&self, t: Target) -> &Arc<FaultProxy> {
        match t {
            Target::Secondary => &self.secondary,
            Target::Destination => &self.destination,
            Target::Jobs => &self.jobs,
        }
    }

    /// Every proxy back to `Pass` (a hand-off's heal, the end).
    pub fn heal(&self) {
        for p in [&self.secondary, &self.destination, &self.jobs] {
            p.set(FaultMode::Pass);
        }
    }
}

/// The pseudo-kind counted when two faults held at once (one of them a store's).
pub const PAIR: &str = "two-at-once";

/// The kinds the hand-offs play (on the copy Job's destination and source stores); the first
/// two hand-offs play all four between them (see [`handoff_faults`]).
pub const HANDOFF_KINDS: [&str; 4] = [
    "dest-5xx",
    "dest-loses-answers",
    "jobs-5xx",
    "jobs-loses-answers",
];

/// The kind of a store fault: `store-*` on the primary (`None`), else named for the store.
pub fn store_kind(target: Option<Target>, mode: FaultMode) -> &'static str {
    use FaultMode as M;
    match (target, mode) {
        (None, M::Down) => "store-down",
        (None, M::Slow(_)) => "store-slow",
        (None, M::Blackhole) => "store-hang",
        (None, M::LoseAnswers) => "store-loses-answers",
        (None, M::Late(_)) => "store-late",
        (None, M::Status(_)) => "store-5xx",
        (Some(Target::Secondary), M::Status(_)) => "secondary-5xx",
        (Some(Target::Secondary), M::LoseAnswers) => "secondary-loses-answers",
        (Some(Target::Secondary), M::Down) => "secondary-down",
        (Some(Target::Destination), M::Status(_)) => "dest-5xx",
        (Some(Target::Destination), M::LoseAnswers) => "dest-loses-answers",
        (Some(Target::Jobs), M::Status(_)) => "jobs-5xx",
        (Some(Target::Jobs), M::LoseAnswers) => "jobs-loses-answers",
        (None, _) => "store-other",
        (Some(_), _) => "other-store-other",
    }
}

/// An HTTP error as S3 answers under load: 503 SlowDown or 500 InternalError.
pub fn status_mode(rng: &mut SplitMix64) -> FaultMode {
    FaultMode::Status(if rng.chance(60) { 503 } else { 500 })
}

/// The members the disk-full fault and the partition hit in a run of `seed`, `(disk,
/// partition)`: chosen by the seed (independently, so sometimes the same member), not fixed.
pub fn members_for(seed: u64, members: usize) -> (usize, usize) {
    let mut rng = SplitMix64::new(seed ^ 0xd15c_0ff5_e7ed);
    let top = members as u64 - 1;
    let disk = rng.range(0, top) as usize;
    let partition = rng.range(0, top) as usize;
    (disk, partition)
}

/// `items` in an order drawn from `rng` (the opening round's order).
pub fn shuffled<T>(mut items: Vec<T>, rng: &mut SplitMix64) -> Vec<T> {
    for i in (1..items.len()).rev() {
        let j = rng.range(0, i as u64) as usize;
        items.swap(i, j);
    }
    items
}

/// The faults the copy Job's stores get at hand-off `k`: (destination, Jobs' source). The first
/// two hand-offs play every mode on both between them (each holds two faults at once); later
/// ones play each with a chance.
pub fn handoff_faults(k: u32, rng: &mut SplitMix64) -> (Option<FaultMode>, Option<FaultMode>) {
    match k {
        1 => (Some(status_mode(rng)), Some(FaultMode::LoseAnswers)),
        2 => (Some(FaultMode::LoseAnswers), Some(status_mode(rng))),
        _ => {
            let mut one = || {
                rng.chance(40).then(|| {
                    if rng.chance(50) {
                        status_mode(rng)
                    } else {
                        FaultMode::LoseAnswers
                    }
                })
            };
            let dest = one();
            (dest, one())
        }
    }
}

/// Holds `proxy` in `mode` from `after` for `hold`, then back to `Pass`; the window, from the
/// start of the call. Spawned beside a Job, so that the fault meets its requests.
pub async fn hold_fault(
    proxy: Arc<FaultProxy>,
    mode: FaultMode,
    after: Duration,
    hold: Duration,
) -> (Duration, Duration) {
    tokio::time::sleep(after).await;
    proxy.set(mode);
    tokio::time::sleep(hold).await;
    proxy.set(FaultMode::Pass);
    (after, after + hold)
}

/// The kinds a run must play: the opening round's, the pair, the hand-offs'.
pub fn required(opening: &[&'static str]) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = opening.to_vec();
    out.push(PAIR);
    out.extend(HANDOFF_KINDS);
    out.sort_unstable();
    out.dedup();
    out
}

/// A run at least this long must have played every kind of its profile (the CI profile's
/// length; a shorter run, such as a planted defect's, reports what it missed in its timeline).
pub const JUDGED_FROM: Duration = Duration::from_secs(170);

/// `fault-kind-missing` for each kind in `required` that `ran` never counted.
pub fn missing(required: &[&'static str], ran: &BTreeMap<&'static str, u32>) -> Vec<Violation> {
    required
        .iter()
        .filter(|k| ran.get(*k).copied().unwrap_or(0) == 0)
        .map(|k| Violation {
            kind: "fault-kind-missing",
            detail: format!(
                "the fault kind {k} of this profile never ran (ran: {})",
                ran.iter()
                    .map(|(k, n)| format!("{k}={n}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts as [`missing`] reads them (a helper, so that the import is used where the
    /// `#[test]` functions are not compiled: the benches include `tests/support`).
    fn counts(kinds: &[(&'static str, u32)]) -> BTreeMap<&'static str, u32> {
        kinds.iter().copied().collect()
    }

    #[test]
    fn a_kind_that_never_ran_is_missing_and_one_that_ran_is_not() {
        let required = required(&["etcd-kill", "store-5xx"]);
        let mut ran = counts(&[
            ("etcd-kill", 2),
            (PAIR, 2),
            ("dest-5xx", 2),
            ("dest-loses-answers", 2),
            ("jobs-5xx", 2),
            ("jobs-loses-answers", 0),
        ]);
        let v = missing(&required, &ran);
        let named: Vec<&str> = v
            .iter()
            .map(|v| v.detail.split(' ').nth(3).unwrap())
            .collect();
        assert_eq!(named, ["jobs-loses-answers", "store-5xx"], "{v:?}");
        assert!(v.iter().all(|v| v.kind == "fault-kind-missing"));
        ran.insert("jobs-loses-answers", 1);
        ran.insert("store-5xx", 1);
        assert!(missing(&required, &ran).is_empty());
    }

    #[test]
    fn the_seed_chooses_the_disk_full_and_partition_members() {
        let mut disk = [0; 3];
        let mut partition = [0; 3];
        for seed in 0..60u64 {
            let (d, p) = members_for(seed, 3);
            assert_eq!(members_for(seed, 3), (d, p), "one seed, one choice");
            disk[d] += 1;
            partition[p] += 1;
        }
        assert!(
            disk.iter().all(|n| *n > 5),
            "every member gets the disk: {disk:?}"
        );
        assert!(
            partition.iter().all(|n| *n > 5),
            "every member gets the partition: {partition:?}"
        );
    }

    #[test]
    fn the_first_two_hand_offs_play_every_mode_on_both_stores() {
        let mut rng = SplitMix64::new(7);
        let mut kinds = Vec::new();
        for k in 1..=2 {
            let (d, j) = handoff_faults(k, &mut rng);
            kinds.push(store_kind(Some(Target::Destination), d.unwrap()));
            kinds.push(store_kind(Some(Target::Jobs), j.unwrap()));
        }
        kinds.sort_unstable();
        let mut want = HANDOFF_KINDS.to_vec();
        want.sort_unstable();
        assert_eq!(kinds, want);
    }

    #[test]
    fn the_opening_order_holds_every_item_once() {
        let items: Vec<u32> = (0..20).collect();
        let mut rng = SplitMix64::new(0x40);
        let mut order = shuffled(items.clone(), &mut rng);
        assert_ne!(order, items, "drawn, not as given");
        order.sort_unstable();
        assert_eq!(order, items);
    }
}
