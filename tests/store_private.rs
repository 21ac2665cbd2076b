//! `file://` stores readable by their owner alone: every directory 0700 and every object 0600,
//! whichever way it is written (one request, a multipart upload, a copy, a rename), in a new
//! store and in one an earlier release left 0755/0644.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use etcd_warden::config::{StoreConfig, StoreLocation};
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use futures::StreamExt;
use object_store::ObjectStoreExt as _;

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777
}

/// Every directory and file under `root`, itself included.
fn tree(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.to_path_buf()];
    let mut i = 0;
    while i < out.len() {
        if out[i].is_dir() {
            let mut inner: Vec<PathBuf> = std::fs::read_dir(&out[i])
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            inner.sort();
            out.extend(inner);
        }
        i += 1;
    }
    out
}

fn store_at(root: &Path) -> SnapshotStore {
    let config =
        StoreConfig::at(StoreLocation::parse(&format!("file://{}", root.display())).unwrap());
    SnapshotStore::from_config(&config).unwrap()
}

/// Writes one object each way the sidecar and the tools do.
async fn write_each_way(store: &SnapshotStore) {
    let full = store.new_snapshot(Kind::Full, 0, 10, Codec::None, false);
    let payload = futures::stream::iter([Ok(Bytes::from_static(b"a full snapshot"))]).boxed();
    store.put_stream(&full, payload).await.unwrap();
    let delta = store.new_snapshot(Kind::Incr, 11, 12, Codec::None, false);
    store
        .put_bytes(&delta, Bytes::from_static(b"a delta"))
        .await
        .unwrap();
    store.set_aside(&delta, "test").await.unwrap();
    let backend = store.backend();
    let record = object_store::path::Path::from("etcd-warden/drill/latest.json");
    backend.put(&record, b"{}".to_vec().into()).await.unwrap();
    let copied = object_store::path::Path::from("copies/deep/er/full");
    backend.copy(&store.path_of(&full), &copied).await.unwrap();
    let renamed = object_store::path::Path::from("renamed/here");
    backend.rename(&copied, &renamed).await.unwrap();
}

fn assert_private(root: &Path) {
    let all = tree(root);
    assert!(all.len() > 8, "{all:?}");
    for path in all {
        let want = if path.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode(&path), want, "{path:?} is {:o}", mode(&path));
    }
}

#[tokio::test]
async fn a_new_file_store_is_private() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("backups/etcd");
    let store = store_at(&root);
    write_each_way(&store).await;
    assert_private(&root);
}

/// A store an earlier release wrote (0755 directories, 0644 files): the directories are made
/// private at the next write, before anything is written, so its old files become unreachable
/// to others and its new ones are 0600.
#[tokio::test]
async fn an_existing_readable_store_is_made_private_at_the_next_write() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("backups");
    let old = root.join("v2");
    std::fs::create_dir_all(&old).unwrap();
    for d in [&root, &old] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let old_file = old.join("Full-00000000-00000005-1700000000");
    std::fs::write(&old_file, b"old").unwrap();
    std::fs::set_permissions(&old_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let store = store_at(&root);
    write_each_way(&store).await;
    for path in tree(&root) {
        if path.is_dir() {
            assert_eq!(mode(&path), 0o700, "{path:?}");
        } else if path != old_file {
            assert_eq!(mode(&path), 0o600, "{path:?}");
        }
    }
}
