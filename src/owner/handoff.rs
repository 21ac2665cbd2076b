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

use std::collections::BTreeSet;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

use crate::owner::resolve::Verdict;
use crate::store::{Kind, Snapshot, SnapshotStore, StoreError};

/// The directory under the store prefix that holds etcd-warden's own objects.
pub const DIR: &str = "etcd-warden";

/// One object (or folder) of the hand-off's layout under `<prefix>/etcd-warden/`: the only
/// place that names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key {
    /// The folder of every hand-off object, `etcd-warden/`.
    All,
    /// The fence markers' folder, `fence/`.
    Fences,
    /// A member's fence marker, `fence/<member id, 16 hex digits>.json`.
    Fence(u64),
    /// The folder of the claims and intents, `final/`.
    Final,
    /// The claim of an epoch, `final/claim-<epoch, 6 digits>.json`.
    Claim(u32),
    /// The final's intent, `final/intent.json`.
    Intent,
    /// The intent that goes after a stale one naming this final, `final/intent-after-<final>.json`.
    IntentAfter(String),
    /// The hand-off record, `handoff.json`.
    Record,
    /// The folder of the reclaimed marks, `reclaimed/`.
    Reclaims,
    /// The mark of a final whose hand-off was undone, `reclaimed/<final name>`.
    Reclaimed(String),
}

impl Key {
    /// The key's name relative to the store prefix, e.g. `etcd-warden/fence/00000000000000a1.json`.
    pub fn name(&self) -> String {
        let inside = match self {
            Key::All => return DIR.to_string(),
            Key::Fences => "fence".to_string(),
            Key::Fence(member) => format!("fence/{member:016x}.json"),
            Key::Final => "final".to_string(),
            Key::Claim(epoch) => format!("final/claim-{epoch:06}.json"),
            Key::Intent => "final/intent.json".to_string(),
            Key::IntentAfter(stale_final) => format!("final/intent-after-{stale_final}.json"),
            Key::Record => "handoff.json".to_string(),
            Key::Reclaims => "reclaimed".to_string(),
            Key::Reclaimed(final_name) => format!("reclaimed/{final_name}"),
        };
        format!("{DIR}/{inside}")
    }

    /// The key's path in a store under `prefix`.
    pub fn path(&self, prefix: &str) -> Path {
        let prefix = prefix.trim_matches('/');
        if prefix.is_empty() {
            Path::from(self.name())
        } else {
            Path::from(format!("{prefix}/{}", self.name()))
        }
    }
}

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

/// What the hand-off check saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterView {
    /// etcd's member list.
    pub members: Vec<Member>,
    /// Members with a fence marker in the store.
    pub fenced: BTreeSet<u64>,
    /// etcd's revision, read (linearizably) only once every member is fenced and no intent fixes
    /// the final yet; `None` otherwise.
    pub revision: Option<i64>,
    /// Final full snapshots in the store that were not reclaimed.
    pub finals: Vec<Snapshot>,
    /// The hand-off record (`handoff.json`), if stored.
    pub handoff_record: Option<HandOffRecord>,
    /// The final's intent, if fixed (and not of a reclaimed hand-off).
    pub intent: Option<FinalIntent>,
    /// The claims, by epoch.
    pub claims: Vec<Claim>,
    /// This sidecar's member.
    pub me: u64,
    /// How long this member has seen the current taker (every member fenced, no final stored).
    pub waited: std::time::Duration,
    /// `owner.takeover_after`.
    pub takeover_after: std::time::Duration,
}

/// What the hand-off check decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A final of this hand-off is stored.
    Done(Snapshot),
    /// These members are not fenced yet (names).
    WaitMembers(Vec<String>),
    /// Every member is fenced and the final is not fixed: read etcd's revision and ask again.
    NeedRevision,
    /// This member claims `epoch` (create-if-absent), then asks again.
    Claim {
        /// The epoch to claim.
        epoch: u32,
    },
    /// This member takes the final and fixes its identity first: create the intent at
    /// `revision` (create-if-absent), then ask again.
    FixIntent {
        /// The frozen revision.
        revision: i64,
    },
    /// This member takes the final the intent names.
    Take(FinalIntent),
    /// Another member takes the final and has not stored it yet.
    WaitTaker {
        /// The taker's name.
        taker: String,
        /// When this member takes over if it is still not stored.
        takeover_in: std::time::Duration,
    },
}

/// The member that takes the final unless another claimed a later epoch: the started member
/// with the lowest ID.
pub fn taker(members: &[Member]) -> Option<&Member> {
    members.iter().filter(|m| m.started).min_by_key(|m| m.id)
}

/// The member taking the final now: the one the newest claim names, else [`taker`]. Its ID and
/// name (a member no longer in the list is named by its hex ID).
pub fn current_taker(members: &[Member], claims: &[Claim]) -> Option<(u64, String)> {
    let newest = claims.iter().max_by_key(|c| c.epoch);
    match newest.and_then(Claim::member) {
        Some(id) => Some((
            id,
            members
                .iter()
                .find(|m| m.id == id)
                .map_or_else(|| format!("{id:x}"), Member::label),
        )),
        None => taker(members).map(|m| (m.id, m.label())),
    }
}

/// Members that must be fenced before the final and are not.
pub fn unfenced(members: &[Member], fenced: &BTreeSet<u64>) -> Vec<String> {
    let mut left: Vec<String> = members
        .iter()
        .filter(|m| m.started && !fenced.contains(&m.id))
        .map(Member::label)
        .collect();
    if members.iter().all(|m| !m.started) {
        left.push("(no started member in etcd's member list)".into());
    }
    left
}

/// The stored final that ends this hand-off: the recorded one, else the intent's, else (a final
/// taken by an older etcd-warden, which fixes no intent) the newest unreclaimed final at or
/// after the frozen revision.
fn stored_final(view: &ClusterView, frozen: Option<i64>) -> Option<Snapshot> {
    let named = |name: &str| view.finals.iter().find(|s| s.snap_name == name).cloned();
    if let Some(found) = view
        .handoff_record
        .as_ref()
        .and_then(|r| named(&r.final_snapshot))
    {
        return Some(found);
    }
    if let Some(found) = view.intent.as_ref().and_then(|i| named(&i.final_snapshot)) {
        return Some(found);
    }
    let frozen = frozen?;
    view.finals
        .iter()
        .filter(|s| s.kind == Kind::Full && s.is_final && s.last_revision >= frozen)
        .max_by(|a, b| crate::store::layout::compare(a, b))
        .cloned()
}

/// The hand-off decision: every started member fenced, then the stored final; else the current
/// taker claims, fixes the intent and takes; the others wait, and take over when the taker has
/// not stored it `takeover_after` × (their rank + 1) after they first saw it.
pub fn decide(view: &ClusterView) -> Decision {
    let left = unfenced(&view.members, &view.fenced);
    if !left.is_empty() {
        return Decision::WaitMembers(left);
    }
    let frozen = view.intent.as_ref().map(|i| i.revision).or(view.revision);
    if let Some(done) = stored_final(view, frozen) {
        return Decision::Done(done);
    }
    let Some(frozen) = frozen else {
        return Decision::NeedRevision;
    };
    let Some((taker_id, taker_name)) = current_taker(&view.members, &view.claims) else {
        return Decision::WaitMembers(vec!["(no started member)".into()]);
    };
    if taker_id == view.me {
        let claimed = view
            .claims
            .iter()
            .max_by_key(|c| c.epoch)
            .is_some_and(|c| c.member() == Some(view.me));
        return match (&view.intent, claimed) {
            (_, false) => Decision::Claim {
                epoch: newest_epoch(&view.claims).map_or(0, |e| e + 1),
            },
            (None, true) => Decision::FixIntent { revision: frozen },
            (Some(intent), true) => Decision::Take(intent.clone()),
        };
    }
    // Not the taker: take over after a bound that grows with this member's rank among the
    // fenced, started members other than the taker, so they do not all claim at once.
    let rank = view
        .members
        .iter()
        .filter(|m| m.started && m.id != taker_id && m.id < view.me)
        .count() as u32;
    let due = view.takeover_after.saturating_mul(rank + 1);
    if view.members.iter().any(|m| m.id == view.me && m.started) && view.waited >= due {
        return Decision::Claim {
            epoch: newest_epoch(&view.claims).map_or(1, |e| e + 1),
        };
    }
    Decision::WaitTaker {
        taker: taker_name,
        takeover_in: due.saturating_sub(view.waited),
    }
}

fn newest_epoch(claims: &[Claim]) -> Option<u32> {
    claims.iter().map(|c| c.epoch).max()
}

/// What a store says of hand-offs, for [`the_final`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreHandOff {
    /// The store holds etcd-warden's own objects (fence markers, a record, an intent, reclaimed
    /// marks): its hand-offs end with a record or an intent.
    pub ours: bool,
    /// The hand-off record (`handoff.json`).
    pub handoff_record: Option<HandOffRecord>,
    /// The final's intent.
    pub intent: Option<FinalIntent>,
    /// Finals `etcd-warden reclaim` marked reclaimed.
    pub reclaimed: BTreeSet<String>,
}

/// **The** hand-off's final in a sorted listing, as every reader decides it (the copy Job,
/// `/snapshot/latest`, `ls`, `verify`, a restarted sidecar): the one the record names, else the
/// one the intent names (stored before its record was written); for a store without any
/// etcd-warden object (etcd-backup-restore's), the newest snapshot when it is a final full one.
/// Never a reclaimed final, and never another `.final` object (an earlier hand-off's, one taken
/// by hand): those are reported as plain full snapshots.
pub fn the_final<'a>(sorted: &'a [Snapshot], store: &StoreHandOff) -> Option<&'a Snapshot> {
    let named = |name: &str| {
        sorted
            .iter()
            .find(|s| s.snap_name == name && s.is_full() && s.is_final)
    };
    let found = match (&store.handoff_record, &store.intent) {
        (Some(r), _) => named(&r.final_snapshot),
        (None, Some(i)) => named(&i.final_snapshot),
        (None, None) if store.ours => None,
        (None, None) => sorted.last().filter(|s| s.is_full() && s.is_final),
    };
    // A record naming a reclaimed final is what an interrupted reclaim leaves (it marks the
    // finals before deleting the record): that hand-off was undone.
    found.filter(|s| !store.reclaimed.contains(&s.snap_name))
}

/// Whether a restarted sidecar's member is still fenced by an earlier hand-off: its marker or the
/// hand-off record is in the store, or the store's latest full snapshot is an unreclaimed final at
/// or after etcd's revision (a hand-off from before fence markers, or one whose markers were
/// removed by hand).
pub fn fenced_at_start(
    own_marker: bool,
    record: bool,
    latest_full: Option<&Snapshot>,
    revision: i64,
) -> bool {
    own_marker || record || latest_full.is_some_and(|s| s.is_final && s.last_revision >= revision)
}

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

/// The hand-off's objects in one store.
#[derive(Clone)]
pub struct HandOffObjects {
    store: SnapshotStore,
}

impl HandOffObjects {
    /// The objects under `store`'s prefix.
    pub fn new(store: SnapshotStore) -> Self {
        HandOffObjects { store }
    }

    /// Where `key` is in this store.
    fn path(&self, key: &Key) -> Path {
        key.path(self.store.prefix())
    }

    /// Where this hand-off's intent is (or goes), and the intent if one is there. An intent
    /// whose final is marked reclaimed belongs to a hand-off that was undone: a reclaim by an
    /// older etcd-warden (which knows no intents) leaves it behind, and so does a reclaim
    /// interrupted after its marks. Create-if-absent cannot replace it, so the next intent goes
    /// beside it, at a name derived from the stale one's final: every member derives the same
    /// name, and one of them wins it as before.
    async fn current_intent(&self) -> Result<(Path, Option<FinalIntent>), HandOffError> {
        let reclaimed = self.reclaimed().await?;
        let mut path = self.path(&Key::Intent);
        // Each stale intent names another reclaimed final, so the walk ends within their count.
        for _ in 0..=reclaimed.len() {
            match self.get_json::<FinalIntent>(&path).await? {
                Some(i) if reclaimed.contains(&i.final_snapshot) => {
                    path = self.path(&Key::IntentAfter(i.final_snapshot));
                }
                found => return Ok((path, found)),
            }
        }
        Err(HandOffError::Intent(format!(
            "more stale intents than reclaimed finals, up to {path}"
        )))
    }

    /// The final's intent, unless it belongs to a hand-off that was reclaimed (see
    /// [`HandOffObjects::create_intent`]).
    pub async fn intent(&self) -> Result<Option<FinalIntent>, HandOffError> {
        Ok(self.current_intent().await?.1)
    }

    /// Creates the final's intent unless one is there (the caller reads it back either way).
    /// A stale intent (its final reclaimed) is left where it is and the new one goes beside it.
    pub async fn create_intent(&self, intent: &FinalIntent) -> Result<Created, HandOffError> {
        let (path, _) = self.current_intent().await?;
        self.create_json(&path, intent).await
    }

    /// The claims, by epoch; an unreadable claim is skipped with a warning (it names no taker).
    pub async fn claims(&self) -> Result<Vec<Claim>, HandOffError> {
        let mut claims = Vec::new();
        for name in self.keys(&Key::Final).await? {
            let Some(epoch) = name
                .strip_prefix("claim-")
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            match self.get_json::<Claim>(&self.path(&Key::Claim(epoch))).await {
                Ok(Some(c)) if c.epoch == epoch && c.member().is_some() => claims.push(c),
                Ok(Some(_)) => {
                    tracing::warn!(epoch, "a hand-off claim does not match its key; ignored")
                }
                Ok(None) => {}
                Err(HandOffError::Unreadable { key, source }) => {
                    tracing::warn!(%key, error = %source, "an unreadable hand-off claim; ignored")
                }
                Err(e) => return Err(e),
            }
        }
        claims.sort_by_key(|c| c.epoch);
        Ok(claims)
    }

    /// Creates the claim of its epoch unless one is there (the caller reads the claims back).
    pub async fn create_claim(&self, claim: &Claim) -> Result<Created, HandOffError> {
        self.create_json(&self.path(&Key::Claim(claim.epoch)), claim)
            .await
    }

    /// Writes `value` at `path` only if nothing is there (S3 `If-None-Match: *`, GCS generation
    /// 0, Azure `If-None-Match: *`, create-new on a file system). A store without conditional
    /// writes gets a plain write ([`Created::Unconditional`]).
    async fn create_json<T: Serialize>(
        &self,
        path: &Path,
        value: &T,
    ) -> Result<Created, HandOffError> {
        let body = Bytes::from(serde_json::to_vec_pretty(value).map_err(|source| {
            HandOffError::Unencodable {
                key: path.to_string(),
                source,
            }
        })?);
        let create = object_store::PutOptions {
            mode: object_store::PutMode::Create,
            ..Default::default()
        };
        match self
            .store
            .backend()
            .put_opts(path, PutPayload::from(body.clone()), create)
            .await
        {
            Ok(_) => Ok(Created::Created),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => Ok(Created::Exists),
            Err(object_store::Error::NotImplemented { .. }) => {
                tracing::warn!(key = %path, "the store has no conditional writes; writing unconditionally (see docs/operations.md)");
                self.store
                    .backend()
                    .put(path, PutPayload::from(body))
                    .await?;
                Ok(Created::Unconditional)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// What the store says of hand-offs, for [`the_final`].
    pub async fn seen(&self) -> Result<StoreHandOff, HandOffError> {
        Ok(StoreHandOff {
            ours: self.any().await?,
            handoff_record: self.record().await?,
            intent: self.intent().await?,
            reclaimed: self.reclaimed().await?,
        })
    }

    /// Stores the hand-off record.
    pub async fn write_record(&self, record: &HandOffRecord) -> Result<(), HandOffError> {
        self.put_json(&self.path(&Key::Record), record).await
    }

    /// The hand-off record, if stored.
    pub async fn record(&self) -> Result<Option<HandOffRecord>, HandOffError> {
        self.get_json(&self.path(&Key::Record)).await
    }

    async fn put_json<T: Serialize>(&self, path: &Path, value: &T) -> Result<(), HandOffError> {
        let body =
            serde_json::to_vec_pretty(value).map_err(|source| HandOffError::Unencodable {
                key: path.to_string(),
                source,
            })?;
        self.store
            .backend()
            .put(path, PutPayload::from(Bytes::from(body)))
            .await?;
        Ok(())
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &Path,
    ) -> Result<Option<T>, HandOffError> {
        match self.store.backend().get(path).await {
            Ok(got) => {
                let bytes = got.bytes().await?;
                serde_json::from_slice(&bytes).map(Some).map_err(|source| {
                    HandOffError::Unreadable {
                        key: path.to_string(),
                        source,
                    }
                })
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Stores this member's marker (overwriting an earlier one of the same member).
    pub async fn write_fence(&self, member: u64, marker: &FenceMarker) -> Result<(), HandOffError> {
        self.put_json(&self.path(&Key::Fence(member)), marker).await
    }

    /// The marker of `member`, if stored.
    pub async fn fence(&self, member: u64) -> Result<Option<FenceMarker>, HandOffError> {
        self.get_json(&self.path(&Key::Fence(member))).await
    }

    /// The members with a marker (by the key's name; a marker's body is for people).
    pub async fn fenced(&self) -> Result<BTreeSet<u64>, HandOffError> {
        Ok(self
            .keys(&Key::Fences)
            .await?
            .iter()
            .filter_map(|name| name.strip_suffix(".json"))
            .filter_map(|id| u64::from_str_radix(id, 16).ok())
            .collect())
    }

    /// Every fence marker's key.
    pub async fn fence_keys(&self) -> Result<Vec<Path>, HandOffError> {
        let dir = self.path(&Key::Fences);
        Ok(self
            .keys(&Key::Fences)
            .await?
            .into_iter()
            .map(|n| dir.clone().join(n))
            .collect())
    }

    /// The names of the objects in `folder`.
    async fn keys(&self, folder: &Key) -> Result<Vec<String>, HandOffError> {
        let dir = self.path(folder);
        let listed = self.store.keys_under(&dir).await?;
        Ok(listed
            .into_iter()
            .filter_map(|key| key.filename().map(str::to_string))
            .collect())
    }

    /// Marks the final `final_name` reclaimed: its hand-off was undone.
    async fn mark_reclaimed(&self, final_name: &str) -> Result<(), HandOffError> {
        self.store
            .backend()
            .put(
                &self.path(&Key::Reclaimed(final_name.to_string())),
                PutPayload::from(Bytes::from_static(b"{}")),
            )
            .await?;
        Ok(())
    }

    /// The names of the finals `etcd-warden reclaim` marked reclaimed.
    pub async fn reclaimed(&self) -> Result<BTreeSet<String>, HandOffError> {
        Ok(self.keys(&Key::Reclaims).await?.into_iter().collect())
    }

    /// Whether the store holds any of etcd-warden's own objects (a fence marker, the hand-off
    /// record, a reclaimed mark): then it is written by etcd-warden's sidecars, whose hand-off
    /// ends with a record, rather than by the reference tool.
    pub async fn any(&self) -> Result<bool, HandOffError> {
        Ok(self.store.any_under(&self.path(&Key::All)).await?)
    }

    /// What marks the store as in a hand-off (or after one): the record, else the fence
    /// markers; `None` when neither is there. A snapshot stored now would stand in front of the
    /// hand-off's final.
    pub async fn hold(&self) -> Result<Option<Hold>, HandOffError> {
        if let Some(record) = self.record().await? {
            return Ok(Some(Hold::HandOffRecord(record)));
        }
        let markers = self.fence_keys().await?;
        Ok((!markers.is_empty()).then_some(Hold::Fenced(markers)))
    }

    /// The final full snapshots in the store that were not reclaimed, oldest first.
    pub async fn finals(&self) -> Result<Vec<Snapshot>, HandOffError> {
        let reclaimed = self.reclaimed().await?;
        Ok(self
            .store
            .list()
            .await?
            .into_iter()
            .filter(|s| s.kind == Kind::Full && s.is_final && !reclaimed.contains(&s.snap_name))
            .collect())
    }

    /// The newest full snapshot as readers see it: `is_final` only when it is [`the_final`] (a
    /// reclaimed or superseded final reads as a plain full snapshot).
    pub async fn latest_full(&self) -> Result<Option<Snapshot>, HandOffError> {
        Ok(self.latest_chain().await?.full_snapshot)
    }

    /// The newest full snapshot and the deltas after it, as every reader reports them
    /// (`/snapshot/latest`): the full snapshot's `is_final` only when it is [`the_final`].
    pub async fn latest_chain(&self) -> Result<crate::store::Chain, HandOffError> {
        let list = self.store.list().await?;
        let seen = self.seen().await?;
        let the = the_final(&list, &seen).map(|s| s.snap_name.clone());
        let mut chain = crate::store::layout::latest_chain(&list);
        if let Some(full) = chain.full_snapshot.as_mut() {
            full.is_final = the.as_deref() == Some(full.snap_name.as_str());
        }
        Ok(chain)
    }
}

/// What [`reclaim`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reclaimed {
    /// Fence markers deleted.
    pub fences_removed: Vec<String>,
    /// Finals marked reclaimed.
    pub finals_reclaimed: Vec<String>,
}

/// Undoes a hand-off in the store: marks every final reclaimed, deletes the hand-off record, then
/// every fence marker, so restarted sidecars of this cluster may become Active again. The markers
/// go last: an interruption leaves members fenced, never unfenced with a hand-off still recorded.
pub async fn reclaim(objects: &HandOffObjects) -> Result<Reclaimed, HandOffError> {
    let mut done = Reclaimed::default();
    let mut names: Vec<String> = objects
        .finals()
        .await?
        .into_iter()
        .map(|f| f.snap_name)
        .collect();
    // The intent's final too, stored or not: an upload still in flight (or completed by the
    // store after its client gave up) must not land as the final of a hand-off that was undone.
    if let Some(intent) = objects.intent().await?
        && !names.contains(&intent.final_snapshot)
    {
        names.push(intent.final_snapshot);
    }
    for name in names {
        objects.mark_reclaimed(&name).await?;
        done.finals_reclaimed.push(name);
    }
    // The record, every intent (stale ones too) and every claim.
    let mut gone = vec![objects.path(&Key::Record)];
    gone.extend(
        objects
            .keys(&Key::Final)
            .await?
            .into_iter()
            .filter(|k| {
                k.ends_with(".json") && (k.starts_with("intent") || k.starts_with("claim-"))
            })
            .map(|k| objects.path(&Key::Final).join(k)),
    );
    for key in gone {
        match objects.store.backend().delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    for key in objects.fence_keys().await? {
        match objects.store.backend().delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        done.fences_removed.push(key.to_string());
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Codec;
    use chrono::TimeZone;
    use std::sync::Arc;

    fn member(id: u64, started: bool) -> Member {
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

    fn full(last: i64, is_final: bool) -> Snapshot {
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

    const BOUND: std::time::Duration = std::time::Duration::from_secs(300);

    fn view(
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

    fn record(of: &Snapshot) -> HandOffRecord {
        HandOffRecord {
            final_snapshot: of.snap_name.clone(),
            revision: of.last_revision,
            members: vec!["m1".into()],
            owner_id: "seed-a".into(),
            recorded_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        }
    }

    fn intent(of: &Snapshot, by: u64) -> FinalIntent {
        FinalIntent {
            final_snapshot: of.snap_name.clone(),
            revision: of.last_revision,
            member_id: format!("{by:x}"),
            owner_id: "seed-a".into(),
            fixed_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        }
    }

    fn claim(epoch: u32, by: u64) -> Claim {
        Claim {
            epoch,
            member_id: format!("{by:x}"),
            claimed_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        }
    }

    #[test]
    fn nothing_happens_until_every_started_member_is_fenced() {
        let members = vec![
            member(3, true),
            member(1, true),
            member(2, true),
            member(9, false),
        ];
        let d = decide(&view(members.clone(), &[1, 3], None, vec![], 1));
        assert_eq!(d, Decision::WaitMembers(vec!["m2".into()]));
        // A member that never started cannot serve: it is not waited for.
        let d = decide(&view(members.clone(), &[1, 2, 3], None, vec![], 1));
        assert_eq!(d, Decision::NeedRevision);
        let d = decide(&view(members, &[1, 2, 3], Some(50), vec![], 1));
        assert_eq!(d, Decision::Claim { epoch: 0 });
    }

    #[test]
    fn the_taker_claims_then_fixes_the_final_then_takes_that_one() {
        let members = vec![member(7, true), member(4, true), member(2, false)];
        assert_eq!(taker(&members).map(|m| m.id), Some(4));
        let mut v = view(members, &[7, 4], Some(10), vec![], 4);
        assert_eq!(decide(&v), Decision::Claim { epoch: 0 });
        v.claims = vec![claim(0, 4)];
        assert_eq!(decide(&v), Decision::FixIntent { revision: 10 });
        let fixed = intent(&full(10, true), 4);
        v.intent = Some(fixed.clone());
        // The intent freezes the revision: a later read (a lease expired) changes nothing.
        v.revision = Some(13);
        assert_eq!(decide(&v), Decision::Take(fixed.clone()));
        v.revision = None;
        assert_eq!(decide(&v), Decision::Take(fixed));
    }

    #[test]
    fn the_others_wait_and_take_over_by_rank_when_the_taker_stores_nothing() {
        let members = vec![member(4, true), member(7, true), member(9, true)];
        let mut v = view(members, &[4, 7, 9], Some(10), vec![], 7);
        let wait = |takeover_in| Decision::WaitTaker {
            taker: "m4".into(),
            takeover_in,
        };
        assert_eq!(decide(&v), wait(BOUND));
        v.waited = BOUND;
        assert_eq!(decide(&v), Decision::Claim { epoch: 1 });
        // The next member in line waits twice as long.
        v.me = 9;
        assert_eq!(decide(&v), wait(BOUND));
        v.waited = BOUND * 2;
        assert_eq!(decide(&v), Decision::Claim { epoch: 1 });
        // Once m7 claimed epoch 1, it is the taker; m4 coming back waits for it.
        v.claims = vec![claim(0, 4), claim(1, 7)];
        v.me = 4;
        v.waited = std::time::Duration::ZERO;
        assert!(matches!(decide(&v), Decision::WaitTaker { taker, .. } if taker == "m7"));
        v.me = 7;
        assert_eq!(decide(&v), Decision::FixIntent { revision: 10 });
        // An intent m4 fixed before it went away is adopted, not replaced.
        let fixed = intent(&full(10, true), 4);
        v.intent = Some(fixed.clone());
        assert_eq!(decide(&v), Decision::Take(fixed));
    }

    #[test]
    fn the_intents_final_ends_the_hand_off_whatever_the_revision_did_since() {
        let members = vec![member(1, true)];
        let fin = full(100, true);
        let mut v = view(members, &[1], Some(104), vec![fin.clone()], 1);
        v.intent = Some(intent(&fin, 1));
        v.claims = vec![claim(0, 1)];
        assert_eq!(decide(&v), Decision::Done(fin.clone()));
        v.handoff_record = Some(record(&fin));
        assert_eq!(decide(&v), Decision::Done(fin.clone()));
        // Without an intent (an older etcd-warden took it) a final at the revision counts, an
        // older one never does, and a non-final never does.
        let mut v = view(
            vec![member(1, true)],
            &[1],
            Some(100),
            vec![full(80, true)],
            1,
        );
        assert_eq!(decide(&v), Decision::Claim { epoch: 0 });
        v.finals.push(fin.clone());
        assert_eq!(decide(&v), Decision::Done(fin));
        let v = view(
            vec![member(1, true)],
            &[1],
            Some(100),
            vec![full(120, false)],
            1,
        );
        assert_eq!(decide(&v), Decision::Claim { epoch: 0 });
    }

    #[test]
    fn a_final_never_counts_before_every_member_is_fenced() {
        let members = vec![member(1, true), member(2, true)];
        let d = decide(&view(members, &[1], Some(100), vec![full(100, true)], 1));
        assert_eq!(d, Decision::WaitMembers(vec!["m2".into()]));
    }

    #[test]
    fn every_reader_names_one_final_and_never_a_reclaimed_or_superseded_one() {
        let old = full(50, true);
        let plain = full(70, false);
        let fin = full(90, true);
        let sorted = vec![old.clone(), plain.clone(), fin.clone()];
        // The reference tool's store: the newest snapshot when it is a final.
        let none = StoreHandOff::default();
        assert_eq!(the_final(&sorted, &none), Some(&fin));
        assert_eq!(the_final(&sorted[..2], &none), None);
        // etcd-warden's: only what the record or the intent names.
        let ours = StoreHandOff {
            ours: true,
            ..Default::default()
        };
        assert_eq!(the_final(&sorted, &ours), None, "a hand-off under way");
        let by_intent = StoreHandOff {
            intent: Some(intent(&fin, 1)),
            ..ours.clone()
        };
        assert_eq!(the_final(&sorted, &by_intent), Some(&fin));
        let by_record = StoreHandOff {
            handoff_record: Some(record(&old)),
            ..ours.clone()
        };
        assert_eq!(the_final(&sorted, &by_record), Some(&old));
        let reclaimed = StoreHandOff {
            reclaimed: BTreeSet::from([fin.snap_name.clone()]),
            ..by_intent
        };
        assert_eq!(the_final(&sorted, &reclaimed), None);
        let reclaimed_ref = StoreHandOff {
            reclaimed: BTreeSet::from([fin.snap_name.clone()]),
            ..none
        };
        assert_eq!(the_final(&sorted, &reclaimed_ref), None);
    }

    /// A model of the take phase: every member fenced, the store holding claims, the intent,
    /// final objects and the record; members that read, decide and write in separate steps
    /// (so any other step can fall between), uploads that complete whenever the store gets to
    /// them (after their member gave up or died), leases that move the revision, members that
    /// die for good, and take-over timers that fire at any moment (a clock that jumps, a taker
    /// that is only slow). Explored exhaustively.
    mod model {
        use super::*;
        use std::collections::{BTreeMap, HashSet, VecDeque};

        const MEMBERS: [u64; 3] = [1, 2, 3];
        const FENCED_AT: i64 = 10;
        const MAX_REVISION: i64 = 11;
        const MAX_EPOCH: u32 = 2;
        const MAX_DEATHS: usize = 2;

        /// A final's name: the revision it was fixed at and the member that fixed it (two
        /// members fixing one would pick different seconds, so different objects).
        type Name = (i64, u64);

        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        enum Pending {
            Claim(u32),
            Intent(i64),
            Upload(Name),
            Record(Name),
        }

        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        struct World {
            revision: i64,
            intent: Option<(Name, i64)>,
            claims: BTreeMap<u32, u64>,
            stored: BTreeSet<Name>,
            in_flight: BTreeSet<Name>,
            record: Option<Name>,
            dead: BTreeSet<u64>,
            timer_fired: BTreeSet<u64>,
            pending: BTreeMap<u64, Pending>,
            /// Every final name ever uploaded or in flight.
            written: BTreeSet<Name>,
        }

        fn snapshot(name: Name) -> Snapshot {
            Snapshot::new(
                "",
                Kind::Full,
                0,
                name.0,
                Utc.timestamp_opt(1_700_000_000 + name.1 as i64, 0).unwrap(),
                Codec::Gzip,
                true,
            )
        }

        fn name_of(snap: &Snapshot) -> Name {
            (
                snap.last_revision,
                (snap.created_on.timestamp() - 1_700_000_000) as u64,
            )
        }

        fn decide_for(w: &World, me: u64) -> Decision {
            let members: Vec<Member> = MEMBERS.iter().map(|&id| member(id, true)).collect();
            let view = ClusterView {
                members,
                fenced: MEMBERS.iter().copied().collect(),
                revision: Some(w.revision),
                finals: w.stored.iter().map(|&n| snapshot(n)).collect(),
                handoff_record: w.record.map(|n| record(&snapshot(n))),
                intent: w.intent.map(|(n, rev)| FinalIntent {
                    revision: rev,
                    ..intent(&snapshot(n), n.1)
                }),
                claims: w.claims.iter().map(|(&e, &m)| claim(e, m)).collect(),
                me,
                waited: if w.timer_fired.contains(&me) {
                    BOUND * 10
                } else {
                    std::time::Duration::ZERO
                },
                takeover_after: BOUND,
            };
            decide(&view)
        }

        /// Every world one step from `w`; `conditional`: the store has create-if-absent; claims
        /// past `max_epoch` are not made (the exploration's bound).
        fn next(w: &World, conditional: bool, max_epoch: u32) -> Vec<World> {
            let mut out = Vec::new();
            for &me in MEMBERS.iter().filter(|m| !w.dead.contains(m)) {
                let mut n = w.clone();
                match n.pending.remove(&me) {
                    // Read and decide; what it writes is a later step.
                    None => {
                        let pending = match decide_for(w, me) {
                            Decision::Claim { epoch } if epoch <= max_epoch => {
                                Some(Pending::Claim(epoch))
                            }
                            Decision::FixIntent { revision } => Some(Pending::Intent(revision)),
                            Decision::Take(i) => Some(Pending::Upload(name_of(
                                &Snapshot::parse_name("", &i.final_snapshot).unwrap(),
                            ))),
                            Decision::Done(s) if w.record.is_none() => {
                                Some(Pending::Record(name_of(&s)))
                            }
                            _ => None,
                        };
                        match pending {
                            Some(p) => {
                                n.pending.insert(me, p);
                            }
                            None => continue,
                        }
                    }
                    Some(Pending::Claim(epoch)) => {
                        if !conditional || !n.claims.contains_key(&epoch) {
                            n.claims.insert(epoch, me);
                        }
                    }
                    Some(Pending::Intent(revision)) => {
                        if !conditional || n.intent.is_none() {
                            n.intent = Some(((revision, me), revision));
                        }
                    }
                    Some(Pending::Upload(name)) => {
                        n.in_flight.insert(name);
                        n.written.insert(name);
                    }
                    Some(Pending::Record(name)) => n.record = Some(name),
                }
                out.push(n);
            }
            // Uploads complete whenever the store gets to them, whoever started them.
            for &name in &w.in_flight {
                let mut n = w.clone();
                n.in_flight.remove(&name);
                n.stored.insert(name);
                out.push(n);
            }
            if w.revision < MAX_REVISION {
                let mut n = w.clone();
                n.revision += 1;
                out.push(n);
            }
            for &me in &MEMBERS {
                if w.dead.len() < MAX_DEATHS && !w.dead.contains(&me) {
                    let mut n = w.clone();
                    n.dead.insert(me);
                    n.pending.remove(&me);
                    out.push(n);
                }
                if !w.timer_fired.contains(&me) {
                    let mut n = w.clone();
                    n.timer_fired.insert(me);
                    out.push(n);
                }
            }
            out
        }

        /// From `w`, with no further fault, do the living members end the hand-off with a
        /// record naming a stored final? Timers fire as they would: one member's, only when
        /// nothing else moves, and they restart when the taker changes.
        fn ends(w: &World, conditional: bool) -> bool {
            let mut w = w.clone();
            w.timer_fired.clear();
            for _ in 0..60 {
                if w.record.is_some_and(|r| w.stored.contains(&r)) {
                    return true;
                }
                let before = w.clone();
                let in_flight: Vec<Name> = w.in_flight.iter().copied().collect();
                for name in in_flight {
                    w.in_flight.remove(&name);
                    w.stored.insert(name);
                }
                let alive: Vec<u64> = MEMBERS
                    .iter()
                    .copied()
                    .filter(|m| !w.dead.contains(m))
                    .collect();
                for &me in &alive {
                    // Two steps: decide, then write.
                    for _ in 0..2 {
                        let moved = next(&w, conditional, u32::MAX).into_iter().find(|n| {
                            n.pending.get(&me) != w.pending.get(&me)
                                && n.dead == w.dead
                                && n.timer_fired == w.timer_fired
                        });
                        if let Some(n) = moved {
                            if n.claims != w.claims {
                                w = World {
                                    timer_fired: BTreeSet::new(),
                                    ..n
                                };
                            } else {
                                w = n;
                            }
                        }
                    }
                }
                if w == before
                    && let Some(&m) = alive.iter().find(|m| !w.timer_fired.contains(m))
                {
                    w.timer_fired.insert(m);
                }
            }
            false
        }

        fn explore(conditional: bool) -> Result<usize, String> {
            let start = World {
                revision: FENCED_AT,
                intent: None,
                claims: BTreeMap::new(),
                stored: BTreeSet::new(),
                in_flight: BTreeSet::new(),
                record: None,
                dead: BTreeSet::new(),
                timer_fired: BTreeSet::new(),
                pending: BTreeMap::new(),
                written: BTreeSet::new(),
            };
            let mut seen = HashSet::from([start.clone()]);
            let mut queue = VecDeque::from([start]);
            while let Some(w) = queue.pop_front() {
                if w.written.len() > 1 {
                    return Err(format!("two finals: {:?} in {w:?}", w.written));
                }
                if let Some(&(rev, _)) = w.written.iter().next()
                    && rev < FENCED_AT
                {
                    return Err(format!("a final short of the fence: {w:?}"));
                }
                if let Some(r) = w.record
                    && !w.stored.contains(&r)
                {
                    return Err(format!("a record naming no stored final: {w:?}"));
                }
                // Liveness from every quiet world (nothing pending, nothing in flight): every
                // other world reaches one by its own steps, which are explored too.
                if w.pending.is_empty()
                    && w.in_flight.is_empty()
                    && w.dead.len() < MEMBERS.len()
                    && !ends(&w, conditional)
                {
                    return Err(format!("no final although a member lives: {w:?}"));
                }
                for n in next(&w, conditional, MAX_EPOCH) {
                    if seen.insert(n.clone()) {
                        queue.push_back(n);
                    }
                }
            }
            Ok(seen.len())
        }

        #[test]
        fn one_final_holding_the_fence_whatever_dies_stalls_or_answers_late() {
            let worlds = explore(true).unwrap_or_else(|e| panic!("{e}"));
            assert!(worlds > 10_000, "explored only {worlds} worlds");
        }

        #[test]
        fn without_create_if_absent_the_model_finds_two_finals() {
            // The check can fail: a store that overwrites lets two members fix two names.
            let found = explore(false).expect_err("a store without conditional writes");
            assert!(found.starts_with("two finals"), "{found}");
        }
    }

    #[test]
    fn a_restarted_member_is_fenced_by_its_marker_or_a_final_at_its_revision() {
        assert!(fenced_at_start(true, false, None, 5));
        assert!(fenced_at_start(false, true, None, 5));
        assert!(fenced_at_start(false, false, Some(&full(5, true)), 5));
        assert!(
            !fenced_at_start(false, false, Some(&full(4, true)), 5),
            "written to since"
        );
        assert!(!fenced_at_start(false, false, Some(&full(9, false)), 5));
        assert!(!fenced_at_start(false, false, None, 5));
    }

    fn objects() -> (tempfile::TempDir, SnapshotStore, HandOffObjects) {
        let dir = tempfile::tempdir().expect("temp dir");
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).expect("fs");
        let store = SnapshotStore::new(Arc::new(fs), "shoot/etcd-main");
        (dir, store.clone(), HandOffObjects::new(store))
    }

    fn marker(id: &str) -> FenceMarker {
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

    #[tokio::test]
    async fn markers_round_trip_outside_the_snapshot_layout_and_reclaim_removes_them() {
        let (dir, store, objects) = objects();
        objects.write_fence(0xabc, &marker("abc")).await.unwrap();
        objects.write_fence(0x1, &marker("1")).await.unwrap();
        assert_eq!(
            objects.fenced().await.unwrap(),
            BTreeSet::from([0x1, 0xabc])
        );
        assert_eq!(objects.fence(0xabc).await.unwrap(), Some(marker("abc")));
        assert_eq!(objects.fence(0x2).await.unwrap(), None);
        assert!(
            dir.path()
                .join("shoot/etcd-main/etcd-warden/fence/0000000000000abc.json")
                .is_file()
        );
        // Not snapshots: the layout's listing never sees them.
        assert!(store.list().await.unwrap().is_empty());

        let fin = full(30, true);
        store
            .put_bytes(&store.adopt(&fin), Bytes::from_static(b"x"))
            .await
            .unwrap();
        assert_eq!(objects.finals().await.unwrap().len(), 1);
        assert!(objects.latest_full().await.unwrap().is_some());

        objects.write_record(&record(&fin)).await.unwrap();
        assert!(objects.record().await.unwrap().is_some());
        let done = reclaim(&objects).await.unwrap();
        assert_eq!(objects.record().await.unwrap(), None);
        assert_eq!(done.fences_removed.len(), 2);
        assert_eq!(done.finals_reclaimed, vec![fin.snap_name.clone()]);
        assert!(objects.fenced().await.unwrap().is_empty());
        assert!(objects.finals().await.unwrap().is_empty());
        // Reclaimed: still the newest full snapshot, no longer read as a final.
        assert_eq!(
            objects.latest_full().await.unwrap().map(|s| s.is_final),
            Some(false)
        );
        // The final itself is kept: reclaiming deletes no snapshot.
        assert_eq!(store.list().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_store_written_before_intents_reads_as_it_did() {
        // What an etcd-warden without intents leaves: fence markers, a final, the record naming
        // it, and nothing under final/.
        let (_dir, store, objects) = objects();
        objects.write_fence(1, &marker("1")).await.unwrap();
        let fin = full(30, true);
        store
            .put_bytes(&store.adopt(&fin), Bytes::from_static(b"x"))
            .await
            .unwrap();
        let record_json = br#"{"finalSnapshot":"Full-00000000-00000030-1700000030.gz.final","revision":30,"members":["m1"],"ownerId":"seed-a","recordedAt":"2023-11-14T22:13:50Z"}"#;
        store
            .backend()
            .put(
                &Path::from("shoot/etcd-main/etcd-warden/handoff.json"),
                PutPayload::from(Bytes::from_static(record_json)),
            )
            .await
            .unwrap();
        let seen = objects.seen().await.unwrap();
        assert_eq!(seen.intent, None);
        let list = store.list().await.unwrap();
        assert_eq!(
            the_final(&list, &seen).map(|s| s.snap_name.as_str()),
            Some(fin.snap_name.as_str())
        );
        assert_eq!(
            objects.latest_full().await.unwrap().map(|s| s.is_final),
            Some(true)
        );
        // A restarted member decides Done from the record, whatever the revision says now.
        let v = ClusterView {
            handoff_record: seen.handoff_record,
            claims: objects.claims().await.unwrap(),
            ..view(
                vec![member(1, true)],
                &[1],
                Some(99),
                objects.finals().await.unwrap(),
                1,
            )
        };
        assert!(matches!(decide(&v), Decision::Done(s) if s.snap_name == fin.snap_name));
    }

    /// An older etcd-warden's reclaim (it knows no intents) marks the final reclaimed and
    /// deletes the record and fences, but leaves `final/intent.json`. Before intents could sit
    /// beside a stale one, every later hand-off found "exists" on create and "none" on read,
    /// forever, and never took its final.
    #[tokio::test]
    async fn a_stale_intent_an_older_reclaim_left_does_not_block_the_next_hand_off() {
        let (_dir, _, objects) = objects();
        let intent = |name: &str, revision: i64| FinalIntent {
            final_snapshot: name.into(),
            revision,
            member_id: "1".into(),
            owner_id: "seed-a".into(),
            fixed_at: Utc.timestamp_opt(1_700_000_000, 0).unwrap(),
        };
        let first = full(30, true);
        assert_eq!(
            objects
                .create_intent(&intent(&first.snap_name, 30))
                .await
                .unwrap(),
            Created::Created
        );
        // What the older reclaim leaves: the mark, and the intent still there.
        objects.mark_reclaimed(&first.snap_name).await.unwrap();
        assert_eq!(objects.intent().await.unwrap(), None);

        // The next hand-off fixes its own, beside the stale one; the first create wins.
        let second = full(80, true);
        let fixed = intent(&second.snap_name, 80);
        assert_eq!(
            objects.create_intent(&fixed).await.unwrap(),
            Created::Created
        );
        assert_eq!(
            objects
                .create_intent(&intent(&full(81, true).snap_name, 81))
                .await
                .unwrap(),
            Created::Exists
        );
        assert_eq!(objects.intent().await.unwrap(), Some(fixed.clone()));
        assert_eq!(objects.seen().await.unwrap().intent, Some(fixed));

        // It is undone too (an older reclaim again), and a third goes beside that one.
        objects.mark_reclaimed(&second.snap_name).await.unwrap();
        let third = intent(&full(99, true).snap_name, 99);
        assert_eq!(
            objects.create_intent(&third).await.unwrap(),
            Created::Created
        );
        assert_eq!(objects.intent().await.unwrap(), Some(third.clone()));

        // This version's reclaim removes every intent, stale or not, and marks the live one's.
        let done = reclaim(&objects).await.unwrap();
        assert!(done.finals_reclaimed.contains(&third.final_snapshot));
        assert!(objects.keys(&Key::Final).await.unwrap().is_empty());
        assert_eq!(objects.intent().await.unwrap(), None);
    }

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

    #[test]
    fn the_layout_is_named_in_one_place() {
        let under = |k: Key| k.path("shoot/etcd-main/").to_string();
        assert_eq!(under(Key::All), "shoot/etcd-main/etcd-warden");
        assert_eq!(
            under(Key::Fence(0xa1)),
            "shoot/etcd-main/etcd-warden/fence/00000000000000a1.json"
        );
        assert_eq!(
            under(Key::Claim(3)),
            "shoot/etcd-main/etcd-warden/final/claim-000003.json"
        );
        assert_eq!(
            under(Key::Intent),
            "shoot/etcd-main/etcd-warden/final/intent.json"
        );
        assert_eq!(
            under(Key::IntentAfter("Full-x.gz.final".into())),
            "shoot/etcd-main/etcd-warden/final/intent-after-Full-x.gz.final.json"
        );
        assert_eq!(
            under(Key::Record),
            "shoot/etcd-main/etcd-warden/handoff.json"
        );
        assert_eq!(
            under(Key::Reclaimed("Full-x.gz.final".into())),
            "shoot/etcd-main/etcd-warden/reclaimed/Full-x.gz.final"
        );
        assert_eq!(Key::Fences.path("").to_string(), "etcd-warden/fence");
    }

    #[tokio::test]
    async fn an_unreadable_marker_is_an_error_naming_its_key() {
        let (_dir, store, objects) = objects();
        let path = Path::from("shoot/etcd-main/etcd-warden/fence/0000000000000001.json");
        store
            .backend()
            .put(&path, PutPayload::from(Bytes::from_static(b"not json")))
            .await
            .unwrap();
        let e = objects.fence(1).await.unwrap_err().to_string();
        assert!(e.contains("fence/0000000000000001.json"), "{e}");
    }
}
