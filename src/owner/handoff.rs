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
//! - **one member takes it**: the started member with the lowest ID ([`taker`]). Every sidecar
//!   computes the same one from etcd's member list, so leadership moving during the upload (every
//!   member was just restarted) never makes two sidecars take a final. The others poll the store
//!   until it is there. A taker whose sidecar never comes back leaves the hand-off without a final;
//!   the copy Job's timeout covers that, as it covers an unreachable store;
//! - a final **counts** for the hand-off only if its revision is at least that frozen revision, so
//!   an older final (an earlier hand-off, a manual one) never stands in for it. Once stored, the
//!   taker writes the **hand-off record** `<prefix>/etcd-warden/handoff.json` naming it: from then
//!   on the record, not the revision, says the hand-off is done. (etcd's revision keeps moving
//!   after a hand-off when leases expire, e.g. kube-apiserver's; comparing revisions again later
//!   would take a second final for the same hand-off.) A restarted sidecar finding the record
//!   stays handed off;
//!
//! Undoing a hand-off is an operator's deliberate act (`etcd-warden reclaim`, [`reclaim`]): it
//! marks the existing finals reclaimed (`<prefix>/etcd-warden/reclaimed/<final name>`), deletes
//! the hand-off record and the fence markers, so they no longer fence a restarted sidecar.
//! Nothing here is under `<prefix>/v2/`, so etcd-backup-restore, `ls` and retention never take
//! these objects for snapshots. The copy Job reads them: the record names the final it waits
//! for, a reclaimed mark rules a final out, and any of them at all means "this store's hand-offs
//! end with a record".

use std::collections::BTreeSet;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

use crate::store::{Kind, Snapshot, SnapshotStore, StoreError};

/// The directory under the store prefix that holds etcd-warden's own objects.
pub const DIR: &str = "etcd-warden";

/// Why reading or writing the hand-off's objects failed.
#[derive(Debug, thiserror::Error)]
pub enum HandOffError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A fence marker is not the JSON this module writes.
    #[error("fence marker {key} is unreadable: {source}")]
    Marker {
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

/// What the hand-off check saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterView {
    /// etcd's member list.
    pub members: Vec<Member>,
    /// Members with a fence marker in the store.
    pub fenced: BTreeSet<u64>,
    /// etcd's revision read (linearizably) after every member was seen fenced; `None` when it was
    /// not read because some member is not fenced.
    pub revision: Option<i64>,
    /// Final full snapshots in the store that were not reclaimed.
    pub finals: Vec<Snapshot>,
    /// The hand-off record, if stored.
    pub record: Option<HandOffRecord>,
    /// This sidecar's member.
    pub me: u64,
}

/// What the hand-off check decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A final of this hand-off is stored.
    Done(Snapshot),
    /// This member takes the final, at `min_revision` or later.
    Take {
        /// The frozen revision.
        min_revision: i64,
    },
    /// These members are not fenced yet (names).
    WaitMembers(Vec<String>),
    /// Every member is fenced; `taker` takes the final and has not stored it yet.
    WaitTaker {
        /// The taker's name.
        taker: String,
    },
    /// Every member is fenced but the revision was not read (a caller's mistake): ask again.
    NeedRevision,
}

/// The member that takes the final: the started member with the lowest ID.
pub fn taker(members: &[Member]) -> Option<&Member> {
    members.iter().filter(|m| m.started).min_by_key(|m| m.id)
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

/// The hand-off decision: every started member fenced, then the recorded final or one at the
/// frozen revision, else the taker takes it.
pub fn decide(view: &ClusterView) -> Decision {
    let left = unfenced(&view.members, &view.fenced);
    if !left.is_empty() {
        return Decision::WaitMembers(left);
    }
    if let Some(record) = &view.record
        && let Some(recorded) = view
            .finals
            .iter()
            .find(|s| s.snap_name == record.final_snapshot)
    {
        return Decision::Done(recorded.clone());
    }
    let Some(revision) = view.revision else {
        return Decision::NeedRevision;
    };
    if let Some(done) = view
        .finals
        .iter()
        .filter(|s| s.kind == Kind::Full && s.is_final && s.last_revision >= revision)
        .max_by(|a, b| crate::store::layout::compare(a, b))
    {
        return Decision::Done(done.clone());
    }
    match taker(&view.members) {
        Some(t) if t.id == view.me => Decision::Take {
            min_revision: revision,
        },
        Some(t) => Decision::WaitTaker { taker: t.label() },
        None => Decision::WaitMembers(vec!["(no started member)".into()]),
    }
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
    Record(HandOffRecord),
    /// Fence markers (their keys), without a record yet.
    Fenced(Vec<Path>),
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

    fn dir(&self, sub: &str) -> Path {
        let prefix = self.store.prefix().trim_matches('/');
        if prefix.is_empty() {
            Path::from(format!("{DIR}/{sub}"))
        } else {
            Path::from(format!("{prefix}/{DIR}/{sub}"))
        }
    }

    fn fence_path(&self, member: u64) -> Path {
        self.dir("fence").join(format!("{member:016x}.json"))
    }

    fn reclaimed_path(&self, final_name: &str) -> Path {
        self.dir("reclaimed").join(final_name)
    }

    fn record_path(&self) -> Path {
        let prefix = self.store.prefix().trim_matches('/');
        if prefix.is_empty() {
            Path::from(format!("{DIR}/handoff.json"))
        } else {
            Path::from(format!("{prefix}/{DIR}/handoff.json"))
        }
    }

    /// Stores the hand-off record.
    pub async fn write_record(&self, record: &HandOffRecord) -> Result<(), HandOffError> {
        self.put_json(&self.record_path(), record).await
    }

    /// The hand-off record, if stored.
    pub async fn record(&self) -> Result<Option<HandOffRecord>, HandOffError> {
        self.get_json(&self.record_path()).await
    }

    async fn put_json<T: Serialize>(&self, path: &Path, value: &T) -> Result<(), HandOffError> {
        let body = serde_json::to_vec_pretty(value).map_err(|source| HandOffError::Marker {
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
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|source| HandOffError::Marker {
                        key: path.to_string(),
                        source,
                    })
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Stores this member's marker (overwriting an earlier one of the same member).
    pub async fn write_fence(&self, member: u64, marker: &FenceMarker) -> Result<(), HandOffError> {
        self.put_json(&self.fence_path(member), marker).await
    }

    /// The marker of `member`, if stored.
    pub async fn fence(&self, member: u64) -> Result<Option<FenceMarker>, HandOffError> {
        self.get_json(&self.fence_path(member)).await
    }

    /// The members with a marker (by the key's name; a marker's body is for people).
    pub async fn fenced(&self) -> Result<BTreeSet<u64>, HandOffError> {
        Ok(self
            .keys("fence")
            .await?
            .iter()
            .filter_map(|name| name.strip_suffix(".json"))
            .filter_map(|id| u64::from_str_radix(id, 16).ok())
            .collect())
    }

    /// Every fence marker's key.
    pub async fn fence_keys(&self) -> Result<Vec<Path>, HandOffError> {
        let dir = self.dir("fence");
        Ok(self
            .keys("fence")
            .await?
            .into_iter()
            .map(|n| dir.clone().join(n))
            .collect())
    }

    async fn keys(&self, sub: &str) -> Result<Vec<String>, HandOffError> {
        let dir = self.dir(sub);
        let listed: Vec<_> = self.store.backend().list(Some(&dir)).try_collect().await?;
        Ok(listed
            .into_iter()
            .filter_map(|m| m.location.filename().map(str::to_string))
            .collect())
    }

    /// The names of the finals `etcd-warden reclaim` marked reclaimed.
    pub async fn reclaimed(&self) -> Result<BTreeSet<String>, HandOffError> {
        Ok(self.keys("reclaimed").await?.into_iter().collect())
    }

    /// Whether the store holds any of etcd-warden's own objects (a fence marker, the hand-off
    /// record, a reclaimed mark): then it is written by etcd-warden's sidecars, whose hand-off
    /// ends with a record, rather than by the reference tool.
    pub async fn any(&self) -> Result<bool, HandOffError> {
        let prefix = self.store.prefix().trim_matches('/');
        let dir = if prefix.is_empty() {
            Path::from(DIR)
        } else {
            Path::from(format!("{prefix}/{DIR}"))
        };
        // One object answers the question; the listing is not read further.
        let first = self.store.backend().list(Some(&dir)).try_next().await?;
        Ok(first.is_some())
    }

    /// What marks the store as in a hand-off (or after one): the record, else the fence
    /// markers; `None` when neither is there. A snapshot stored now would stand in front of the
    /// hand-off's final.
    pub async fn hold(&self) -> Result<Option<Hold>, HandOffError> {
        if let Some(record) = self.record().await? {
            return Ok(Some(Hold::Record(record)));
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

    /// The newest full snapshot, unless it is a reclaimed final.
    pub async fn latest_unreclaimed_full(&self) -> Result<Option<Snapshot>, HandOffError> {
        let latest = self.store.latest_chain().await?.full_snapshot;
        match latest {
            Some(s) if s.is_final => {
                let reclaimed = self.reclaimed().await?;
                Ok((!reclaimed.contains(&s.snap_name)).then_some(s))
            }
            other => Ok(other),
        }
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
    for f in objects.finals().await? {
        let path = objects.reclaimed_path(&f.snap_name);
        objects
            .store
            .backend()
            .put(&path, PutPayload::from(Bytes::from_static(b"{}")))
            .await?;
        done.finals_reclaimed.push(f.snap_name);
    }
    match objects.store.backend().delete(&objects.record_path()).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => return Err(e.into()),
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
            record: None,
            me,
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
        let d = decide(&view(members, &[1, 2, 3], Some(50), vec![], 1));
        assert_eq!(d, Decision::Take { min_revision: 50 });
    }

    #[test]
    fn the_lowest_started_member_takes_the_final_and_the_others_wait() {
        let members = vec![member(7, true), member(4, true), member(2, false)];
        assert_eq!(taker(&members).map(|m| m.id), Some(4));
        let d = decide(&view(members.clone(), &[7, 4], Some(10), vec![], 7));
        assert_eq!(d, Decision::WaitTaker { taker: "m4".into() });
        let d = decide(&view(members, &[7, 4], Some(10), vec![], 4));
        assert_eq!(d, Decision::Take { min_revision: 10 });
    }

    #[test]
    fn only_a_final_at_or_after_the_frozen_revision_counts() {
        let members = vec![member(1, true)];
        let stale = full(80, true);
        let d = decide(&view(
            members.clone(),
            &[1],
            Some(100),
            vec![stale.clone()],
            1,
        ));
        assert_eq!(
            d,
            Decision::Take { min_revision: 100 },
            "a stale final never stands in"
        );
        let good = full(100, true);
        let d = decide(&view(
            members.clone(),
            &[1],
            Some(100),
            vec![stale, good.clone()],
            1,
        ));
        assert_eq!(d, Decision::Done(good));
        // A non-final at the revision does not count either.
        let d = decide(&view(members, &[1], Some(100), vec![full(120, false)], 1));
        assert_eq!(d, Decision::Take { min_revision: 100 });
    }

    #[test]
    fn the_recorded_final_stays_done_when_leases_move_the_revision_on() {
        let members = vec![member(1, true)];
        let fin = full(100, true);
        let mut v = view(members, &[1], Some(104), vec![fin.clone()], 1);
        assert_eq!(decide(&v), Decision::Take { min_revision: 104 });
        v.record = Some(record(&fin));
        assert_eq!(decide(&v), Decision::Done(fin.clone()));
        // A record naming a final that is not (or no longer) in the store does not count.
        v.finals.clear();
        assert_eq!(decide(&v), Decision::Take { min_revision: 104 });
    }

    #[test]
    fn a_final_never_counts_before_every_member_is_fenced() {
        let members = vec![member(1, true), member(2, true)];
        let d = decide(&view(members, &[1], Some(100), vec![full(100, true)], 1));
        assert_eq!(d, Decision::WaitMembers(vec!["m2".into()]));
    }

    #[test]
    fn exhaustive_small_clusters_take_at_most_one_final_and_only_when_all_are_fenced() {
        // Every cluster of up to 3 members (started or not), every fenced subset, every "me",
        // with and without a counting final: at most one member decides Take, and only when all
        // started members are fenced and no counting final exists.
        for n in 1..=3u64 {
            for started_mask in 0..(1u32 << n) {
                let members: Vec<Member> = (0..n)
                    .map(|i| member(i + 1, started_mask & (1 << i) != 0))
                    .collect();
                for fenced_mask in 0..(1u32 << n) {
                    let fenced: Vec<u64> = (0..n)
                        .filter(|i| fenced_mask & (1 << i) != 0)
                        .map(|i| i + 1)
                        .collect();
                    for finals in [vec![], vec![full(5, true)], vec![full(10, true)]] {
                        let all_fenced = members
                            .iter()
                            .filter(|m| m.started)
                            .all(|m| fenced.contains(&m.id));
                        let revision = all_fenced.then_some(10);
                        let takers: Vec<u64> = members
                            .iter()
                            .map(|m| m.id)
                            .filter(|&me| {
                                matches!(
                                    decide(&view(
                                        members.clone(),
                                        &fenced,
                                        revision,
                                        finals.clone(),
                                        me
                                    )),
                                    Decision::Take { .. }
                                )
                            })
                            .collect();
                        assert!(takers.len() <= 1, "{members:?} {fenced:?}: {takers:?}");
                        if !takers.is_empty() {
                            assert!(all_fenced && started_mask != 0);
                            assert!(finals.iter().all(|f| f.last_revision < 10));
                        }
                    }
                }
            }
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
        assert!(objects.latest_unreclaimed_full().await.unwrap().is_some());

        objects.write_record(&record(&fin)).await.unwrap();
        assert!(objects.record().await.unwrap().is_some());
        let done = reclaim(&objects).await.unwrap();
        assert_eq!(objects.record().await.unwrap(), None);
        assert_eq!(done.fences_removed.len(), 2);
        assert_eq!(done.finals_reclaimed, vec![fin.snap_name.clone()]);
        assert!(objects.fenced().await.unwrap().is_empty());
        assert!(objects.finals().await.unwrap().is_empty());
        assert_eq!(objects.latest_unreclaimed_full().await.unwrap(), None);
        // The final itself is kept: reclaiming deletes no snapshot.
        assert_eq!(store.list().await.unwrap().len(), 1);
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
