//! The hand-off between seeds across every member of the cluster: fence markers in the store, and
//! the pure decision of when the final snapshot is taken and by whom.
//!
//! **Why markers in the store.** Each sidecar checks DNS on its own schedule and kills only its own
//! etcd, so the sidecar that takes the final cannot know from its own verdict that the other
//! members stopped serving. The store is the one thing every sidecar of a cluster already shares
//! and can write while etcd is down; etcd itself cannot hold the fence (writing to it would change
//! the revision the final must cover, and it is the thing being fenced). Asking the peers' sidecars
//! over HTTP would need their addresses and would fail closed whenever one is restarting. So:
//!
//! - after its **verified** kill, each sidecar stores `<prefix>/etcd-warden/fence/<member id>.json`
//!   ([`FenceMarker`]). A marker means "this member's etcd was killed and its readiness stays
//!   503": a sidecar never becomes Active while its member's marker exists (the start check);
//! - the final is taken only when every started member of the cluster has a marker; then etcd's
//!   revision is frozen (nothing can reach a member to write), and the revision read at that
//!   moment is what the final must reach;
//! - **the final's identity is fixed once**, before its first upload attempt: the member that
//!   takes it reads etcd's revision (every member is fenced, so only an expiring lease can move
//!   it) and creates the **intent** `<prefix>/etcd-warden/final/intent.json` ([`FinalIntent`])
//!   *if absent*: the final's object name and the revision it must hold. Whoever finds an intent
//!   adopts it; the revision is never read again for this hand-off. Every attempt, by any member,
//!   uploads that one object name, so a retry after a lost answer, a completion the store performs
//!   after the client gave up, or a second taker all write the same object: there is never a
//!   second final. Its content holds at least the intent's revision (the name's revision is a
//!   lower bound, as in the reference tool, whose name is the revision read before the stream);
//! - **one member takes it**: the started member with the lowest ID ([`taker`]) claims epoch 0
//!   (`final/claim-000000.json`); every sidecar computes the same one from etcd's member list.
//!   If no final is stored `owner.takeover_after` after a member first saw the current taker
//!   (times its rank among the others, so they do not all move at once), that member claims the
//!   next epoch; claims are created *if absent*, so one member wins each epoch, and the newest
//!   claim names the taker ([`current_taker`]). A taker that comes back late sees a newer claim
//!   and waits; if it was mid-upload, it writes the same object. Safety never rests on the
//!   claims or the clocks: the intent's one name does that. On a store without conditional
//!   writes the create is a plain write followed by a read-back ([`Created::Unconditional`]):
//!   two members fixing the intent at the same moment could each read back their own, so the
//!   takeover is staggered by `owner.takeover_after` to keep that window apart;
//! - the hand-off is **done** once the final is stored ([`the_final`] of the store, or a final
//!   at or after the intent's revision written by an older etcd-warden); the member that sees it
//!   first writes the **hand-off record** `<prefix>/etcd-warden/handoff.json` naming it. A
//!   restarted sidecar finding the record or its marker stays handed off.
//!
//! Undoing a hand-off is an operator's deliberate act (`etcd-warden reclaim`, [`reclaim`]): it
//! marks the existing finals (and the intent's, stored or not) reclaimed
//! (`<prefix>/etcd-warden/reclaimed/<final name>`), deletes the hand-off record, the intents, the
//! claims and the fence markers, so they no longer fence a restarted sidecar. An intent whose
//! final is marked reclaimed (left by an older etcd-warden's reclaim, which knows no intents, or
//! by an interrupted one) is stale: the next hand-off fixes its intent beside it, at
//! `final/intent-after-<stale final>.json`.
//! Nothing here is under `<prefix>/v2/`, so etcd-backup-restore, `ls` and retention never take
//! these objects for snapshots. Every reader decides "the hand-off's final" with [`the_final`]:
//! the copy Job, `/snapshot/latest`, `ls`, `verify` and a restarted sidecar.
//!
//! The module by job: [`decide`] (the pure rules: who takes the final, when the hand-off is done,
//! which final every reader names), [`objects`] (the store layout and the only API over it),
//! [`refusals`] (what an operator's command may do during or after a hand-off) and [`reclaim`]
//! (undoing a hand-off).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::store::StoreError;

pub mod decide;
pub mod objects;
pub mod reclaim;
pub mod refusals;

pub use decide::{
    ClusterView, Decision, StoreHandOff, current_taker, decide, fenced_at_start, taker, the_final,
    unfenced,
};
pub use objects::{DIR, HandOffObjects, Key};
pub use reclaim::{Reclaimed, reclaim};
pub use refusals::{
    Hold, Refusal, may_reclaim, may_revive, may_snapshot_by_hand, may_take_final_by_hand,
};

/// Why reading or writing the hand-off's objects failed.
#[derive(Debug, thiserror::Error)]
pub enum HandOffError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The store did not keep what the hand-off check wrote (a claim or the intent read back
    /// missing), or the check went round too often; it is retried.
    #[error("the store did not show the hand-off's claim or intent after writing it")]
    Unsettled,
    /// The intent names no snapshot this layout can write.
    #[error("the hand-off's intent names no valid snapshot: {0}")]
    Intent(String),
    /// A hand-off object (a fence marker, a claim, the intent, the hand-off record) is not the
    /// JSON this module writes.
    #[error("hand-off object {key} is unreadable: {source}")]
    Unreadable {
        /// Its key.
        key: String,
        /// Why.
        source: serde_json::Error,
    },
    /// A hand-off object could not be encoded as JSON before writing it.
    #[error("hand-off object {key} cannot be encoded: {source}")]
    Unencodable {
        /// Its key.
        key: String,
        /// Why.
        source: serde_json::Error,
    },
}

impl From<object_store::Error> for HandOffError {
    fn from(e: object_store::Error) -> Self {
        HandOffError::Store(StoreError::Backend(e))
    }
}

/// A process killed by the fencing member's sidecar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KilledProcess {
    /// PID in the pod's PID namespace.
    pub pid: i32,
    /// Start time in clock ticks after boot.
    pub start_time: u64,
}

/// What a member's sidecar stores once its etcd is verified killed for a hand-off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceMarker {
    /// etcd's member ID, hex (as `etcdctl member list` shows it).
    pub member_id: String,
    /// This seed's owner ID (`owner.id`).
    pub owner_id: String,
    /// Why the member was fenced (the verdict).
    pub reason: String,
    /// The etcd processes killed.
    pub killed: Vec<KilledProcess>,
    /// When the marker was written.
    pub fenced_at: DateTime<Utc>,
}

/// What the member that took the final stores once it is in the store: the hand-off is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HandOffRecord {
    /// The final snapshot's name (under `<prefix>/v2/`).
    pub final_snapshot: String,
    /// The revision every member's fence froze, which the final reaches.
    pub revision: i64,
    /// The members fenced (names).
    pub members: Vec<String>,
    /// This seed's owner ID.
    pub owner_id: String,
    /// When the record was written.
    pub recorded_at: DateTime<Utc>,
}

/// A member of the etcd cluster as the hand-off needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// etcd's member ID.
    pub id: u64,
    /// Its name (empty until it started).
    pub name: String,
    /// It has started (it has client URLs): it could serve clients.
    pub started: bool,
}

impl Member {
    /// The name, or the hex ID for a member that has none yet.
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            format!("{:x}", self.id)
        } else {
            self.name.clone()
        }
    }
}

/// The hand-off's final, fixed before its first upload attempt and never changed: every attempt
/// by any member writes `final_snapshot`, holding at least `revision`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FinalIntent {
    /// The final snapshot's name (under `<prefix>/v2/`).
    pub final_snapshot: String,
    /// etcd's revision read once every member was fenced: the final holds at least this.
    pub revision: i64,
    /// The member (hex ID) that fixed it.
    pub member_id: String,
    /// This seed's owner ID.
    pub owner_id: String,
    /// When it was fixed.
    pub fixed_at: DateTime<Utc>,
}

/// A member's claim to take the final in an epoch; the newest epoch's claim names the taker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    /// The epoch: 0 for the designated taker, then one more per takeover.
    pub epoch: u32,
    /// The claiming member (hex ID).
    pub member_id: String,
    /// When it was claimed.
    pub claimed_at: DateTime<Utc>,
}

impl Claim {
    /// The claiming member's ID, when the claim names one.
    pub fn member(&self) -> Option<u64> {
        u64::from_str_radix(&self.member_id, 16).ok()
    }
}

/// What a create-if-absent write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Created {
    /// The object was created by this call.
    Created,
    /// An object was already there (another writer's, or this writer's own whose answer was
    /// lost); the caller reads it.
    Exists,
    /// The store has no conditional writes: it was written unconditionally (the caller reads
    /// it back, and the last writer wins).
    Unconditional,
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Hand-off objects for the tests of every part of the module.
    use super::*;
    use crate::store::{Codec, Kind, Snapshot, SnapshotStore};
    use chrono::TimeZone;
    use std::sync::Arc;

    pub(crate) fn member(id: u64, started: bool) -> Member {
        Member {
            id,
            name: if started {
                format!("m{id}")
            } else {
                String::new()
            },
            started,
        }
    }

    pub(crate) fn full(last: i64, is_final: bool) -> Snapshot {
        Snapshot::new(
            "",
            Kind::Full,
            0,
            last,
            Utc.timestamp_opt(1_700_000_000 + last, 0).unwrap(),
            Codec::Gzip,
            is_final,
        )
    }

    pub(crate) const BOUND: std::time::Duration = std::time::Duration::from_secs(300);

    pub(crate) fn view(
        members: Vec<Member>,
        fenced: &[u64],
        revision: Option<i64>,
        finals: Vec<Snapshot>,
        me: u64,
    ) -> ClusterView {
        ClusterView {
            members,
            fenced: fenced.iter().copied().collect(),
            revision,
            finals,
            handoff_record: None,
            intent: None,
            claims: Vec::new(),
            me,
            waited: std::time::Duration::ZERO,
            takeover_after: BOUND,
        }
    }

    pub(crate) fn record(of: &Snapshot) -> HandOffRecord {
        HandOffRecord {
            final_snapshot: of.snap_name.clone(),
            revision: of.last_revision,
            members: vec!["m1".into()],
            owner_id: "seed-a".into(),
            recorded_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        }
    }

    pub(crate) fn intent(of: &Snapshot, by: u64) -> FinalIntent {
        FinalIntent {
            final_snapshot: of.snap_name.clone(),
            revision: of.last_revision,
            member_id: format!("{by:x}"),
            owner_id: "seed-a".into(),
            fixed_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        }
    }

    pub(crate) fn claim(epoch: u32, by: u64) -> Claim {
        Claim {
            epoch,
            member_id: format!("{by:x}"),
            claimed_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        }
    }

    pub(crate) fn objects() -> (tempfile::TempDir, SnapshotStore, HandOffObjects) {
        let dir = tempfile::tempdir().expect("temp dir");
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).expect("fs");
        let store = SnapshotStore::new(Arc::new(fs), "shoot/etcd-main");
        (dir, store.clone(), HandOffObjects::new(store))
    }

    pub(crate) fn marker(id: &str) -> FenceMarker {
        FenceMarker {
            member_id: id.into(),
            owner_id: "seed-a".into(),
            reason: "owned by [\"seed-b\"]".into(),
            killed: vec![KilledProcess {
                pid: 7,
                start_time: 99,
            }],
            fenced_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        }
    }
}
