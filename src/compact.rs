//! `etcd-warden compact`: folds the latest full snapshot and its deltas into one new full
//! snapshot, so later restores start from it instead of replaying a long delta chain, and
//! retention can drop the chain before it.
//!
//! The chain is restored into a temporary data directory (the restore's own checks: hashes,
//! revisions that follow on, decryption with the configured identities), a temporary etcd is
//! started on it, compacted at its head revision and defragmented, and a full snapshot of it is
//! stored (encrypted when the store encrypts). The new full snapshot has the head revision of the
//! chain, so it orders after the chain's last delta and becomes the store's latest full snapshot;
//! deltas written meanwhile by a running sidecar start after that revision and stay in the chain.
//!
//! Disk: the temporary directory holds the restored database about twice while it is built
//! (the snapshot and the database written from it), then once; memory is the restore's and the
//! snapshot stream's (bounded, independent of the database size).

use std::path::PathBuf;
use std::time::Instant;

use crate::owner::handoff::{HandOffError, HandOffObjects, Hold};
use crate::restore::{self, EtcdTools, MemberParams, RestoreError, RestoreOptions, TempEtcd};
use crate::scratch::ScratchDir;
use crate::snapshot::full::{FullError, Target, take_full_as};
use crate::store::{Codec, Snapshot, SnapshotStore, StoreError};

/// Why compaction failed; nothing was stored.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// Listing the store failed.
    #[error("listing the store: {0}")]
    Store(#[source] StoreError),
    /// Restoring the chain failed.
    #[error("restoring the chain: {0}")]
    Restore(#[source] RestoreError),
    /// The temporary etcd refused a request.
    #[error("{what} on the temporary etcd: {source}")]
    Etcd {
        /// Which request.
        what: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// Taking or storing the compacted snapshot failed.
    #[error("storing the compacted snapshot: {0}")]
    Snapshot(#[source] FullError),
    /// The chain is encrypted but the store has no recipients: the compacted snapshot would be
    /// stored in clear.
    #[error(
        "{snapshot} is encrypted but encryption.recipients is empty: the compacted snapshot would be stored unencrypted; configure the recipients the sidecar encrypts to"
    )]
    WouldDecrypt {
        /// The first encrypted snapshot of the chain.
        snapshot: String,
    },
    /// The store is in a hand-off (or after one): a new full snapshot would hide its final.
    #[error(
        "the store is in a hand-off ({what}); a compacted full snapshot would stand in front of its final; nothing was stored"
    )]
    HandOff {
        /// What was found.
        what: String,
    },
    /// The hand-off objects could not be read.
    #[error("reading the store's hand-off objects: {0}")]
    HandOffObjects(#[source] HandOffError),
    /// The work directory could not be prepared or cleaned.
    #[error("work directory {}: {source}", path.display())]
    WorkDir {
        /// The directory.
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How to compact.
#[derive(Debug, Clone)]
pub struct CompactOptions {
    /// Where the work directory goes: a new private subdirectory (0700, an unpredictable name
    /// that must not exist yet) holds the temporary data directory and is removed.
    pub work_dir: PathBuf,
    /// Where etcd's binaries are; `None` searches as a restore does.
    pub etcd_bin: Option<PathBuf>,
    /// Compression of the new full snapshot.
    pub codec: Codec,
    /// Deltas fetched ahead during the restore.
    pub parallel_fetch: usize,
}

/// What compaction did.
#[derive(Debug, Clone)]
pub enum CompactReport {
    /// The latest full snapshot has no deltas after it: nothing to fold.
    NothingToDo {
        /// The latest full snapshot, if any.
        latest_full: Option<String>,
    },
    /// A new full snapshot holds the chain.
    Compacted {
        /// The full snapshot the chain started from.
        from_full: String,
        /// Deltas folded in.
        deltas: usize,
        /// The new full snapshot (at the chain's head revision).
        snapshot: Snapshot,
        /// Database size before and after compaction and defragmentation, bytes.
        db_size_before: i64,
        db_size_after: i64,
        /// Wall time of the whole run, seconds.
        seconds: f64,
    },
}

/// Folds the store's latest chain into a new full snapshot.
#[tracing::instrument(name = "compact", skip_all, fields(work_dir = %opts.work_dir.display()))]
pub async fn compact(
    store: &SnapshotStore,
    opts: &CompactOptions,
) -> Result<CompactReport, CompactError> {
    let started = Instant::now();
    let chain = store.latest_chain().await.map_err(CompactError::Store)?;
    let Some(full) = chain.full_snapshot.as_ref() else {
        return Ok(CompactReport::NothingToDo { latest_full: None });
    };
    if chain.delta_snapshots.is_empty() {
        return Ok(CompactReport::NothingToDo {
            latest_full: Some(full.snap_name.clone()),
        });
    }
    if !store.encrypts()
        && let Some(encrypted) = std::iter::once(full)
            .chain(&chain.delta_snapshots)
            .find(|s| s.encrypted)
    {
        return Err(CompactError::WouldDecrypt {
            snapshot: encrypted.snap_name.clone(),
        });
    }
    let head = chain.delta_snapshots.last().map_or(0, |d| d.last_revision);
    refuse_during_hand_off(store, head).await?;
    // The restored database is plaintext even from an encrypted store: the work directory is
    // new, private and unpredictable, and removed on every way out (also when this future is
    // dropped by a signal).
    let work = ScratchDir::new_in(&opts.work_dir, "etcd-warden-compact-").map_err(|source| {
        CompactError::WorkDir {
            path: opts.work_dir.clone(),
            source,
        }
    })?;
    let data_dir = work.path().join("data");
    let restored = restore::restore(
        store,
        // No fallback: folding an older chain would name a new full snapshot below the one
        // that failed, which stays the latest: compaction must fail instead.
        &RestoreOptions::scratch(&data_dir, opts.etcd_bin.clone(), opts.parallel_fetch),
    )
    .await
    .map_err(CompactError::Restore)?;
    tracing::info!(
        from = %restored.full_snapshot,
        deltas = restored.deltas,
        revision = restored.revision,
        "chain restored; compacting"
    );
    // The store changed between the listing and the restore: a sidecar stored a newer full
    // snapshot, so the chain restored is that one alone and there is nothing to fold.
    if restored.deltas == 0 {
        return Ok(CompactReport::NothingToDo {
            latest_full: Some(restored.full_snapshot),
        });
    }

    let tools = EtcdTools::locate(opts.etcd_bin.as_deref())
        .await
        .map_err(CompactError::Restore)?;
    let etcd = TempEtcd::start(
        &tools,
        &data_dir,
        &MemberParams::default().name,
        work.path().join("etcd.log"),
    )
    .await
    .map_err(CompactError::Restore)?;
    let result = compact_and_store(store, &etcd.client_url, restored.revision, opts.codec).await;

    if let Err(e) = etcd.stop().await {
        tracing::warn!(error = %e, "stopping the temporary etcd failed");
    }
    let (snapshot, db_size_before, db_size_after) = result?;
    // Only the inventory's kind depends on it: the snapshot is stored either way.
    if let Err(e) = crate::store::gc::mark_compacted(store, &snapshot).await {
        tracing::warn!(snapshot = %snapshot.snap_name, error = %e, "the compacted snapshot is stored; its marker (the inventory's kind) is not");
    }
    let report = CompactReport::Compacted {
        from_full: restored.full_snapshot,
        deltas: restored.deltas,
        snapshot,
        db_size_before,
        db_size_after,
        seconds: started.elapsed().as_secs_f64(),
    };
    tracing::info!(?report, "compacted");
    Ok(report)
}

/// Compacts the temporary etcd at `revision`, defragments it and stores its full snapshot,
/// which must reach `revision`. Returns it with the database size before and after.
async fn compact_and_store(
    store: &SnapshotStore,
    url: &str,
    revision: i64,
    codec: Codec,
) -> Result<(Snapshot, i64, i64), CompactError> {
    let etcd = |what| move |source| CompactError::Etcd { what, source };
    let client = etcd_client::Client::connect([url], None)
        .await
        .map_err(etcd("connecting"))?;
    // The temporary etcd renews its restored leases while it runs; should one expire anyway,
    // the exact-revision snapshot below fails rather than store a later revision.
    let mut maintenance = client.maintenance_client();
    let before = maintenance
        .status()
        .await
        .map_err(etcd("status"))?
        .db_size();
    let mut kv = client.kv_client();
    match kv
        .compact(
            revision,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await
    {
        Ok(_) => {}
        // Already compacted at this revision (the full snapshot was taken after a compaction
        // and no delta followed): nothing older to drop.
        Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("compacted") => {}
        Err(e) => return Err(etcd("compacting")(e)),
    }
    maintenance
        .defragment()
        .await
        .map_err(etcd("defragmenting"))?;
    let after = maintenance
        .status()
        .await
        .map_err(etcd("status"))?
        .db_size();
    // A hand-off that began while the chain was restored must not get a newer full snapshot in
    // front of its final.
    refuse_during_hand_off(store, revision).await?;
    let (snapshot, _) = take_full_as(&client, store, Target::Exactly { codec, revision })
        .await
        .map_err(CompactError::Snapshot)?;
    Ok((snapshot, before, after))
}

/// Refuses while the store holds the hand-off record or a fence marker, or an unreclaimed final
/// at or after `revision`: a compacted full snapshot stored after it would become the latest
/// full snapshot and hide the final from the sidecars' start check and from `/snapshot/latest`.
async fn refuse_during_hand_off(store: &SnapshotStore, revision: i64) -> Result<(), CompactError> {
    let objects = HandOffObjects::new(store.clone());
    match objects.hold().await.map_err(CompactError::HandOffObjects)? {
        Some(Hold::HandOffRecord(record)) => {
            return Err(CompactError::HandOff {
                what: format!("a hand-off record, final {}", record.final_snapshot),
            });
        }
        Some(Hold::Fenced(markers)) => {
            return Err(CompactError::HandOff {
                what: format!("fence marker {}", markers[0]),
            });
        }
        None => {}
    }
    let finals = objects
        .finals()
        .await
        .map_err(CompactError::HandOffObjects)?;
    if let Some(last) = finals.iter().rev().find(|f| f.last_revision >= revision) {
        return Err(CompactError::HandOff {
            what: format!(
                "final {} at revision {}, not reclaimed",
                last.snap_name, last.last_revision
            ),
        });
    }
    Ok(())
}
