//! The hand-off's objects in the store: their layout ([`Key`], one name per object) and the only
//! API over them ([`HandOffObjects`]), over any `ObjectStore`.

use std::collections::BTreeSet;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use serde::Serialize;

use super::decide::{StoreHandOff, the_final};
use super::refusals::Hold;
use super::{Claim, Created, FenceMarker, FinalIntent, HandOffError, HandOffRecord};
use crate::store::{Kind, Snapshot, SnapshotStore};

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

    /// The store the objects are in.
    pub fn store(&self) -> &SnapshotStore {
        &self.store
    }

    /// The name of a final full snapshot at `revision` taken now, as an intent fixes it (named
    /// as the snapshot actor names a final).
    pub fn final_name(&self, revision: i64, codec: crate::store::Codec) -> Snapshot {
        self.store
            .new_snapshot(crate::store::Kind::Full, 0, revision, codec, true)
    }

    /// The final snapshot `intent` names, in this store.
    pub fn final_of(&self, intent: &FinalIntent) -> Result<Snapshot, HandOffError> {
        Snapshot::parse_name(self.store.prefix(), &intent.final_snapshot)
            .map_err(|e| HandOffError::Intent(e.to_string()))
    }

    /// Where `key` is in this store.
    pub(super) fn path(&self, key: &Key) -> Path {
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
    pub(super) async fn keys(&self, folder: &Key) -> Result<Vec<String>, HandOffError> {
        let dir = self.path(folder);
        let listed = self.store.keys_under(&dir).await?;
        Ok(listed
            .into_iter()
            .filter_map(|key| key.filename().map(str::to_string))
            .collect())
    }

    /// Marks the final `final_name` reclaimed: its hand-off was undone.
    pub(super) async fn mark_reclaimed(&self, final_name: &str) -> Result<(), HandOffError> {
        self.store
            .backend()
            .put(
                &self.path(&Key::Reclaimed(final_name.to_string())),
                PutPayload::from(Bytes::from_static(b"{}")),
            )
            .await?;
        Ok(())
    }

    /// Deletes the object at `path`; one already gone is no error.
    pub(super) async fn delete(&self, path: &Path) -> Result<(), HandOffError> {
        match self.store.backend().delete(path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
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

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{ClusterView, Decision, decide};
    use super::*;

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
