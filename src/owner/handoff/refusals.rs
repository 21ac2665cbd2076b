//! What an operator's command may do while a store holds a hand-off or after one: a snapshot
//! or final by hand, a reclaim, reviving a member.

use object_store::path::Path;

use super::{HandOffRecord, Key};
use crate::owner::resolve::Verdict;

/// What holds a store in a hand-off ([`HandOffObjects::hold`]).
#[derive(Debug, Clone)]
pub enum Hold {
    /// The hand-off record.
    HandOffRecord(HandOffRecord),
    /// Fence markers (their keys), without a record yet.
    Fenced(Vec<Path>),
}

/// Why an operator's command is refused by the hand-off rules ([`may_take_final_by_hand`],
/// [`may_snapshot_by_hand`], [`may_reclaim`]). `owner_record` is the owner record's name, `said` what
/// it answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A final by hand while the owner record does not name another seed.
    #[error(
        "refusing a final snapshot: the owner record {owner_record} says {said}; a final is only taken once it names another seed or none (the sidecar takes it itself then)"
    )]
    FinalWhileOwned {
        /// The owner record.
        owner_record: String,
        /// Its answer.
        said: String,
    },
    /// Any snapshot by hand while the store holds a hand-off.
    #[error(
        "refusing {what}: the store holds {held}, so a hand-off of owner record {owner_record} is under way or done; the sidecars take its final themselves, and a snapshot taken now would stand in front of it. To serve from this seed again, run `etcd-warden reclaim` while the owner record names it"
    )]
    DuringHandOff {
        /// "a snapshot" or "a final snapshot".
        what: &'static str,
        /// What holds the store, with its location.
        held: String,
        /// The owner record.
        owner_record: String,
    },
    /// A reclaim while the owner record does not name this seed.
    #[error(
        "refusing to reclaim: the owner record {owner_record} says {said}; reclaiming while it does not name this seed ({owner_id}) would leave two seeds serving the same data"
    )]
    ReclaimWhileNotOwner {
        /// The owner record.
        owner_record: String,
        /// Its answer.
        said: String,
        /// This seed's owner ID.
        owner_id: String,
    },
    /// Reviving a member (`quorum-restore`) whose cluster handed off.
    #[error(
        "refusing to revive this member: {held}, so its cluster handed off (owner record {owner_record}); a member revived from it would serve data that now belongs to the seed it was handed to. If the hand-off was a mistake, run `etcd-warden reclaim` while the owner record names this seed, then quorum-restore"
    )]
    ReviveAfterHandOff {
        /// What marks the hand-off, with its location.
        held: String,
        /// The owner record (empty without an [owner] section).
        owner_record: String,
    },
}

/// No member of a cluster that handed off is revived by `quorum-restore`: the store holds
/// the hand-off record or fence markers (`hold`), or the hand-off's final (`final_snapshot`, as
/// [`the_final`] decides it). Reviving it would leave two seeds serving the same data, which the
/// hand-off exists to prevent; `reclaim` undoes a hand-off first. `location` is the store's.
pub fn may_revive(
    hold: Option<&Hold>,
    final_snapshot: Option<&str>,
    location: &str,
    owner_record: &str,
) -> Result<(), Refusal> {
    let held = match (hold, final_snapshot) {
        (Some(Hold::HandOffRecord(r)), _) => format!(
            "the store holds the hand-off record {location}/{} (final {})",
            Key::Record.name(),
            r.final_snapshot
        ),
        (Some(Hold::Fenced(markers)), _) => format!(
            "the store holds {} fence marker(s) under {location}/{}/",
            markers.len(),
            Key::Fences.name()
        ),
        (None, Some(f)) => {
            format!("the store's newest full snapshot {location}/{f} is the hand-off's final")
        }
        (None, None) => return Ok(()),
    };
    Err(Refusal::ReviveAfterHandOff {
        held,
        owner_record: if owner_record.is_empty() {
            "not configured".into()
        } else {
            owner_record.into()
        },
    })
}

/// A final by hand is taken only once the owner record names another seed or none: taken while
/// this seed still owns etcd it would stand in for a hand-off that has not happened (in a store
/// without etcd-warden objects the copy Job takes the newest final). A lookup that failed
/// (`verdict` `None`) or said unresolvable refuses too.
pub fn may_take_final_by_hand(
    owner_record: &str,
    verdict: Option<Verdict>,
    said: &str,
) -> Result<(), Refusal> {
    only_if_said(
        verdict,
        Verdict::NotOwner,
        Refusal::FinalWhileOwned {
            owner_record: owner_record.into(),
            said: said.into(),
        },
    )
}

/// `Ok` when the lookup said `wanted`, else `refusal`: a failed lookup refuses too.
fn only_if_said(
    verdict: Option<Verdict>,
    wanted: Verdict,
    refusal: Refusal,
) -> Result<(), Refusal> {
    if verdict == Some(wanted) {
        Ok(())
    } else {
        Err(refusal)
    }
}

/// No snapshot by hand while the store holds a fence marker or the hand-off record (`hold`):
/// during a hand-off a newer full snapshot would hide its final from `/snapshot/latest` and from
/// the start check's "latest full is final" rule, and a final by hand is not the one every member
/// was fenced for. After it, the hand-off record ends the seed's data; `reclaim` undoes it first.
/// `location` is the store's, for the message.
pub fn may_snapshot_by_hand(
    hold: Option<&Hold>,
    is_final: bool,
    location: &str,
    owner_record: &str,
) -> Result<(), Refusal> {
    let Some(hold) = hold else {
        return Ok(());
    };
    let held = match hold {
        Hold::HandOffRecord(r) => format!(
            "the hand-off record {location}/{} (final {})",
            Key::Record.name(),
            r.final_snapshot
        ),
        Hold::Fenced(markers) => format!(
            "{} fence marker(s) under {location}/{}/",
            markers.len(),
            Key::Fences.name()
        ),
    };
    Err(Refusal::DuringHandOff {
        what: if is_final {
            "a final snapshot"
        } else {
            "a snapshot"
        },
        held,
        owner_record: owner_record.into(),
    })
}

/// A reclaim only while the owner record names this seed: reclaiming while it names another
/// (or cannot be read) would leave two seeds serving the same data.
pub fn may_reclaim(
    owner_record: &str,
    owner_id: &str,
    verdict: Option<Verdict>,
    said: &str,
) -> Result<(), Refusal> {
    only_if_said(
        verdict,
        Verdict::Owner,
        Refusal::ReclaimWhileNotOwner {
            owner_record: owner_record.into(),
            said: said.into(),
            owner_id: owner_id.into(),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

    #[test]
    fn commands_by_hand_follow_the_owner_record_and_the_store() {
        use crate::owner::resolve::Verdict::{NotOwner, Owner, Unresolvable};
        let r = "owner.example";
        // A final by hand: only once the record names another seed or none.
        assert_eq!(may_take_final_by_hand(r, Some(NotOwner), "seed-b"), Ok(()));
        for v in [Some(Owner), Some(Unresolvable), None] {
            let e = may_take_final_by_hand(r, v, "x").unwrap_err().to_string();
            assert!(
                e.starts_with("refusing a final snapshot: the owner record owner.example says x"),
                "{e}"
            );
        }
        // Reclaim: only while the record names this seed.
        assert_eq!(may_reclaim(r, "seed-a", Some(Owner), "seed-a"), Ok(()));
        for v in [Some(NotOwner), Some(Unresolvable), None] {
            let e = may_reclaim(r, "seed-a", v, "seed-b")
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("refusing to reclaim: the owner record owner.example says seed-b"),
                "{e}"
            );
            assert!(e.contains("(seed-a)"), "{e}");
        }
        // Any snapshot by hand while the store holds a hand-off, naming what holds it.
        assert_eq!(may_snapshot_by_hand(None, true, "s3://b/p", r), Ok(()));
        let fenced = Hold::Fenced(vec![Path::from("p/etcd-warden/fence/1.json")]);
        let e = may_snapshot_by_hand(Some(&fenced), false, "s3://b/p", r)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("refusing a snapshot: the store holds 1 fence marker(s) under s3://b/p/etcd-warden/fence/"), "{e}");
        let fin = full(30, true);
        let held = Hold::HandOffRecord(record(&fin));
        let e = may_snapshot_by_hand(Some(&held), true, "s3://b/p", r)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("refusing a final snapshot: the store holds the hand-off record s3://b/p/etcd-warden/handoff.json"), "{e}");
        assert!(
            e.contains(&fin.snap_name) && e.contains("etcd-warden reclaim"),
            "{e}"
        );

        // No member of a cluster that handed off is revived: record, markers or the final.
        assert_eq!(may_revive(None, None, "s3://b/p", r), Ok(()));
        for (hold, the_final, names) in [
            (
                Some(&held),
                None,
                "the hand-off record s3://b/p/etcd-warden/handoff.json",
            ),
            (
                Some(&fenced),
                None,
                "1 fence marker(s) under s3://b/p/etcd-warden/fence/",
            ),
            (
                None,
                Some(fin.snap_name.as_str()),
                "is the hand-off's final",
            ),
        ] {
            let e = may_revive(hold, the_final, "s3://b/p", r)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("refusing to revive this member: "), "{e}");
            assert!(
                e.contains(names) && e.contains("etcd-warden reclaim"),
                "{e}"
            );
        }
    }
}
