//! Full snapshots: etcd's snapshot stream, checked against its trailing SHA-256, compressed and
//! uploaded as a multipart upload, never buffered whole and never written to a temporary file.
//!
//! The payload is etcd's stream as is (the bbolt file with etcd's 32-byte SHA-256 appended), so
//! `etcdutl snapshot restore` and etcd-backup-restore accept it. The hash is checked as the bytes
//! pass; a mismatch ends the stream with an error, which aborts the upload before it completes.

use std::io;

use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};

use crate::store::compression::{self, ByteStream, Codec};
use crate::store::{Kind, Snapshot, SnapshotStore, StoreError};

/// etcd messages read ahead (etcd sends 32 KiB each, so ~1 MiB, one gzip block).
const PREFETCH_MESSAGES: usize = 32;

/// Length of etcd's trailing hash.
pub const HASH_LEN: usize = 32;

/// Full snapshot errors.
#[derive(Debug, thiserror::Error)]
pub enum FullError {
    /// etcd refused or broke the snapshot.
    #[error("etcd snapshot failed: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// Storing failed (or the payload failed its hash check; nothing was stored).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The codec cannot write.
    #[error(transparent)]
    Codec(#[from] crate::store::compression::CodecError),
    /// The member is behind the revision the snapshot must reach (a final after a hand-off);
    /// nothing was stored.
    #[error("the member is at revision {have}; this snapshot must reach {need}")]
    Behind {
        /// The member's revision.
        have: i64,
        /// The revision asked for.
        need: i64,
    },
    /// The requested-final marker could not be written before the upload; nothing was stored.
    #[error("cannot mark the snapshot as etcd-druid's requested final (nothing was stored): {0}")]
    Mark(StoreError),
    /// The member was not at exactly the revision the snapshot must hold, before or after its
    /// stream (a write, or a lease expiring, moved it); nothing was stored.
    #[error(
        "the member was at revision {found} while this snapshot must hold exactly revision {expected}; nothing was stored"
    )]
    Moved {
        /// The revision the snapshot must hold.
        expected: i64,
        /// The revision the member reported.
        found: i64,
    },
}

/// Takes a full snapshot of the member `client` talks to and stores it. The snapshot is named
/// with the revision etcd reported just before the stream started (as the reference does).
pub async fn take_full(
    client: &etcd_client::Client,
    store: &SnapshotStore,
    codec: Codec,
    is_final: bool,
) -> Result<Snapshot, FullError> {
    let (snapshot, _) = take(client, store, codec, is_final, Reach::Any, None).await?;
    Ok(snapshot)
}

/// A full snapshot with a condition on what it holds, for [`take_full_as`].
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// A regular snapshot, as [`take_full`] takes it.
    Regular(Codec),
    /// Exactly `revision`: the member must report it before the stream starts and still report
    /// it after the stream ends (revisions only grow, so the stream is of that revision);
    /// otherwise the upload is aborted with [`FullError::Moved`]. For a member no client writes
    /// to (`compact`'s temporary etcd), where only an expiring lease can move it.
    Exactly {
        /// How the payload is compressed.
        codec: Codec,
        /// The revision it must hold.
        revision: i64,
    },
    /// etcd-druid's requested final (`POST /snapshot/full?final=true` under `[druid]`): a
    /// snapshot taken now and named `.final` as etcd-backup-restore names it, its
    /// requested-final marker written before the upload ([`crate::store::gc`]'s notes), so no
    /// reader takes it for a hand-off's final.
    RequestedFinal(Codec),
    /// The hand-off's final as the object `name` (fixed before the first attempt, so a retry
    /// writes the same object), holding at least `min_revision`: refused before anything is
    /// streamed when the member is below it. `name`'s revision is a lower bound of what it holds
    /// (an expiring lease may have moved etcd on since the name was fixed), as the reference
    /// tool's names are.
    Final {
        /// The object, as the intent names it.
        name: &'a Snapshot,
        /// The revision every member's fence froze.
        min_revision: i64,
    },
}

/// A full snapshot as `target` asks, with the bytes stored (compressed).
pub async fn take_full_as(
    client: &etcd_client::Client,
    store: &SnapshotStore,
    target: Target<'_>,
) -> Result<(Snapshot, u64), FullError> {
    match target {
        Target::Regular(codec) => take(client, store, codec, false, Reach::Any, None).await,
        Target::RequestedFinal(codec) => {
            take(
                client,
                store,
                codec,
                true,
                Reach::Any,
                Some(Naming::RequestedFinal),
            )
            .await
        }
        Target::Exactly { codec, revision } => {
            take(client, store, codec, false, Reach::Exactly(revision), None).await
        }
        Target::Final { name, min_revision } => {
            let object = store.adopt(name);
            take(
                client,
                store,
                object.compression,
                object.is_final,
                Reach::AtLeast(min_revision),
                Some(Naming::Object(object)),
            )
            .await
        }
    }
}

/// How a snapshot is named other than fresh from the revision (`None`).
enum Naming {
    /// Exactly this object (the hand-off's final, fixed by its intent).
    Object(Snapshot),
    /// Fresh and final, marked as etcd-druid's requested final before the upload.
    RequestedFinal,
}

/// Which revisions a snapshot may hold.
#[derive(Clone, Copy, Debug)]
enum Reach {
    Any,
    AtLeast(i64),
    Exactly(i64),
}

async fn take(
    client: &etcd_client::Client,
    store: &SnapshotStore,
    codec: Codec,
    is_final: bool,
    reach: Reach,
    named: Option<Naming>,
) -> Result<(Snapshot, u64), FullError> {
    let mut maintenance = client.maintenance_client();
    let revision = status_revision(&mut maintenance).await?;
    match reach {
        Reach::AtLeast(need) if revision < need => {
            return Err(FullError::Behind {
                have: revision,
                need,
            });
        }
        Reach::Exactly(expected) if revision != expected => {
            return Err(FullError::Moved {
                expected,
                found: revision,
            });
        }
        _ => {}
    }
    let started = std::time::Instant::now();
    let stream = maintenance.snapshot().await?;
    let raw = futures::stream::unfold(stream, |mut s| async move {
        match s.message().await {
            Ok(Some(msg)) => Some((Ok(Bytes::copy_from_slice(msg.blob())), s)),
            Ok(None) => None,
            Err(e) => Some((Err(io::Error::other(e)), s)),
        }
    })
    .boxed();
    // For an exact revision, the member is asked again once etcd has sent the last byte; a
    // moved revision ends the payload with an error, which aborts the upload.
    let moved = std::sync::Arc::new(std::sync::Mutex::new(None));
    let raw = match reach {
        Reach::Exactly(expected) => {
            let mut maintenance = client.maintenance_client();
            let moved = moved.clone();
            let check = futures::stream::once(async move {
                match status_revision(&mut maintenance).await {
                    Ok(found) if found == expected => None,
                    Ok(found) => {
                        *moved.lock().unwrap_or_else(|p| p.into_inner()) = Some(found);
                        Some(Err(io::Error::other(format!(
                            "the member moved to revision {found} during the snapshot of revision {expected}"
                        ))))
                    }
                    Err(e) => Some(Err(io::Error::other(e))),
                }
            })
            .filter_map(futures::future::ready);
            raw.chain(check).boxed()
        }
        _ => raw,
    };
    // etcd keeps streaming while compression or the upload is momentarily behind.
    let raw = compression::prefetch(raw, PREFETCH_MESSAGES);
    let (snapshot, requested_final) = match named {
        Some(Naming::Object(object)) => (object, false),
        Some(Naming::RequestedFinal) => (
            store.new_snapshot(Kind::Full, 0, revision, codec, true),
            true,
        ),
        None => (
            store.new_snapshot(Kind::Full, 0, revision, codec, is_final),
            false,
        ),
    };
    if requested_final {
        crate::store::gc::mark_requested_final(store, &snapshot)
            .await
            .map_err(FullError::Mark)?;
    }
    let stored = store_payload(store, &snapshot, raw, codec).await;
    if let Some(found) = *moved.lock().unwrap_or_else(|p| p.into_inner()) {
        return Err(FullError::Moved {
            expected: revision,
            found,
        });
    }
    let size = stored?;
    tracing::info!(
        snapshot = %snapshot.snap_name,
        revision,
        stored_bytes = size,
        seconds = started.elapsed().as_secs_f64(),
        "full snapshot stored"
    );
    Ok((snapshot, size))
}

/// The revision the member reports.
async fn status_revision(
    maintenance: &mut etcd_client::MaintenanceClient,
) -> Result<i64, etcd_client::Error> {
    Ok(maintenance
        .status()
        .await?
        .header()
        .map_or(0, |h| h.revision()))
}

/// Verifies, compresses, encrypts (when the store encrypts) and uploads a raw etcd snapshot stream under `snapshot`'s name.
/// Returns the stored (compressed) size. Nothing appears in the store on any failure.
pub async fn store_payload(
    store: &SnapshotStore,
    snapshot: &Snapshot,
    raw: ByteStream,
    codec: Codec,
) -> Result<u64, FullError> {
    let parallelism = std::thread::available_parallelism().map_or(2, |n| n.get());
    let compressed = codec.encode(verify_sha256(raw), parallelism, store.compression_level())?;
    let sealed = store.seal(snapshot, compressed)?;
    Ok(store.put_stream(snapshot, sealed).await?)
}

/// Passes a stream through unchanged while hashing all but its last 32 bytes; at the end the
/// hash must equal those bytes, else the stream ends with an `InvalidData` error.
pub fn verify_sha256(input: ByteStream) -> ByteStream {
    struct State {
        input: ByteStream,
        hasher: Sha256,
        tail: Vec<u8>,
        total: u64,
        done: bool,
    }
    let state = State {
        input,
        hasher: Sha256::new(),
        tail: Vec::with_capacity(HASH_LEN * 2),
        total: 0,
        done: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        match st.input.next().await {
            Some(Ok(chunk)) => {
                st.total += chunk.len() as u64;
                if chunk.len() >= HASH_LEN {
                    st.hasher.update(&st.tail);
                    st.hasher.update(&chunk[..chunk.len() - HASH_LEN]);
                    st.tail.clear();
                    st.tail.extend_from_slice(&chunk[chunk.len() - HASH_LEN..]);
                } else {
                    st.tail.extend_from_slice(&chunk);
                    if st.tail.len() > HASH_LEN {
                        let excess = st.tail.len() - HASH_LEN;
                        st.hasher.update(&st.tail[..excess]);
                        st.tail.drain(..excess);
                    }
                }
                Some((Ok(chunk), st))
            }
            Some(Err(e)) => {
                st.done = true;
                Some((Err(e), st))
            }
            None => {
                st.done = true;
                let ok = st.tail.len() == HASH_LEN
                    && st.hasher.clone().finalize().as_slice() == st.tail.as_slice();
                if ok {
                    None
                } else {
                    let msg = format!(
                        "etcd snapshot of {} bytes failed its SHA-256 check; not stored",
                        st.total
                    );
                    Some((Err(io::Error::new(io::ErrorKind::InvalidData, msg)), st))
                }
            }
        }
    })
    .boxed()
}

/// A stand-in for etcd's snapshot stream (tests): `len` bytes, then their SHA-256.
#[cfg(test)]
pub(crate) fn sealed_payload(len: usize) -> Vec<u8> {
    let mut db: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    let h = Sha256::digest(&db);
    db.extend_from_slice(&h);
    db
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::compression::{chunked, collect};
    use std::sync::Arc;

    #[tokio::test]
    async fn verification_passes_bytes_through_for_any_chunking() {
        let p = sealed_payload(10_000);
        for size in [1, 7, 31, 32, 33, 4096, 20_000] {
            let out = collect(verify_sha256(chunked(&p, size))).await.unwrap();
            assert_eq!(out, p, "chunk size {size}");
        }
        let mut bad = p.clone();
        bad[5000] ^= 1;
        for size in [1, 32, 4096] {
            let e = collect(verify_sha256(chunked(&bad, size)))
                .await
                .unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        }
        assert!(collect(verify_sha256(chunked(&p[..20], 5))).await.is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_stream_never_appears_in_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let backend =
            Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap());
        let store = SnapshotStore::new(backend, "");
        let good = sealed_payload(3 << 20);
        let snap = store.new_snapshot(Kind::Full, 0, 42, Codec::Gzip, false);
        store_payload(&store, &snap, chunked(&good, 65536), Codec::Gzip)
            .await
            .unwrap();
        let back = collect(store.get_decoded(&snap).await.unwrap())
            .await
            .unwrap();
        assert!(back == good);

        let mut bad = good.clone();
        bad[1 << 20] ^= 1;
        let snap2 = store.new_snapshot(Kind::Full, 0, 43, Codec::Gzip, true);
        let e = store_payload(&store, &snap2, chunked(&bad, 65536), Codec::Gzip).await;
        assert!(
            matches!(e, Err(FullError::Store(StoreError::Payload(_)))),
            "{e:?}"
        );
        assert_eq!(store.list().await.unwrap(), vec![snap]);
        // No temporary file is left behind either.
        let files: Vec<_> = walk(dir.path());
        assert_eq!(files.len(), 1, "{files:?}");
    }

    fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(p).unwrap() {
            let e = e.unwrap().path();
            if e.is_dir() {
                out.extend(walk(&e));
            } else {
                out.push(e);
            }
        }
        out
    }
}
