//! Checks a stored snapshot end to end: decompress, and check the hash etcd (full) or the
//! writer (delta) appended, streaming with bounded memory for full snapshots.

use futures::StreamExt;

use super::delta;
use super::full::verify_sha256;
use crate::store::{Kind, Snapshot, SnapshotStore, StoreError};

/// Why a snapshot failed verification.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("{name}: {reason}")]
    Corrupt { name: String, reason: String },
}

/// What verification found in a good snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Bytes after decompression (the etcd database with its hash, or the delta payload).
    pub payload_bytes: u64,
    /// Events in a delta; 0 for a full snapshot.
    pub events: usize,
}

/// Verifies one snapshot.
pub async fn verify(store: &SnapshotStore, snapshot: &Snapshot) -> Result<Verified, VerifyError> {
    let corrupt = |reason: String| VerifyError::Corrupt {
        name: snapshot.snap_name.clone(),
        reason,
    };
    match snapshot.kind {
        Kind::Full => {
            let stream = store
                .get_decoded(snapshot)
                .await
                .map_err(|e| corrupt(e.to_string()))?;
            let mut checked = verify_sha256(stream);
            let mut bytes = 0u64;
            while let Some(chunk) = checked.next().await {
                bytes += chunk.map_err(|e| corrupt(e.to_string()))?.len() as u64;
            }
            Ok(Verified {
                payload_bytes: bytes,
                events: 0,
            })
        }
        Kind::Incr => {
            // Counted as parsed, not kept: verifying a delta holds one event at a time.
            let summary = delta::summarize(store, snapshot)
                .await
                .map_err(|e| corrupt(e.to_string()))?;
            let Some((first, last)) = summary.span else {
                return Err(corrupt("no events".into()));
            };
            if first < snapshot.start_revision || last != snapshot.last_revision {
                return Err(corrupt(format!(
                    "events span revisions {first}..={last} but the name says {}..={}",
                    snapshot.start_revision, snapshot.last_revision
                )));
            }
            Ok(Verified {
                payload_bytes: 0,
                events: summary.events,
            })
        }
    }
}

/// Of the snapshots that failed to read, those no longer listed: deleted since the listing they
/// were read from (the sidecar's retention runs beside a drill Job and expires an old chain's
/// deltas), so not bad ones. A snapshot still listed stays failed; when the store cannot be
/// listed again, so do they all.
pub async fn gone_since_listed(
    store: &SnapshotStore,
    failed: &[&Snapshot],
) -> Result<Vec<String>, StoreError> {
    if failed.is_empty() {
        return Ok(Vec::new());
    }
    let now: std::collections::HashSet<String> = store
        .list()
        .await?
        .into_iter()
        .map(|s| s.snap_name)
        .collect();
    Ok(failed
        .iter()
        .filter(|s| !now.contains(&s.snap_name))
        .map(|s| s.snap_name.clone())
        .collect())
}
