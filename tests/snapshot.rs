//! Full and delta snapshots against a real single-member etcd.

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use etcd_warden::snapshot::delta::{self, DeltaWriter, EventType};
use etcd_warden::snapshot::watcher::run_deltas;
use etcd_warden::snapshot::{full, take_full};
use etcd_warden::store::compression::collect;
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use support::etcd::{EtcdCluster, Release};

fn file_store(dir: &Path) -> SnapshotStore {
    std::fs::create_dir_all(dir).unwrap();
    let backend = Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap());
    SnapshotStore::new(backend, "")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_is_a_valid_etcd_3_5_snapshot() {
    full_snapshot_is_valid(Release::V35).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_is_a_valid_etcd_3_4_snapshot() {
    full_snapshot_is_valid(Release::V34).await;
}

async fn full_snapshot_is_valid(release: Release) {
    let etcd = EtcdCluster::single(release).await;
    let mut client = etcd.client().await;
    let value = "v".repeat(2000);
    for i in 0..1500 {
        client
            .put(format!("/registry/k{i:05}"), value.clone(), None)
            .await
            .unwrap();
    }
    let revision = client
        .get("warmup", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir.path().join("store"));

    let snap = take_full(&client, &store, Codec::Gzip, false)
        .await
        .unwrap();
    assert_eq!(snap.kind, Kind::Full);
    assert_eq!(snap.last_revision, revision);
    assert!(snap.snap_name.ends_with(".gz"), "{}", snap.snap_name);
    let fin = take_full(&client, &store, Codec::Zlib, true).await.unwrap();
    assert!(fin.snap_name.ends_with(".zlib.final"), "{}", fin.snap_name);
    assert_eq!(store.list().await.unwrap().len(), 2);

    // The stored payload is etcd's snapshot as is: etcdutl checks its hash and restores it.
    for s in [&snap, &fin] {
        let db = collect(store.get_decoded(s).await.unwrap()).await.unwrap();
        assert!(db.len() > 1500 * 2000, "{} bytes", db.len());
        let stored = std::fs::metadata(dir.path().join("store").join(s.key()))
            .unwrap()
            .len();
        assert!(
            stored < db.len() as u64 / 4,
            "{stored} stored for {}",
            db.len()
        );
        let file = dir.path().join(format!("{}.db", s.snap_name));
        std::fs::write(&file, &db).unwrap();
        // etcd 3.4 has no etcdutl; its etcdctl restores (and checks the hash) the same way.
        let tool = match release {
            Release::V35 => release.bin("etcdutl"),
            Release::V34 => release.bin("etcdctl"),
        };
        let out = Command::new(tool)
            .env("ETCDCTL_API", "3")
            .args(["snapshot", "restore"])
            .arg(&file)
            .arg("--data-dir")
            .arg(dir.path().join(format!("restored-{}", s.snap_name)))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "etcdutl restore failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // A corrupted stream (one flipped byte) is refused and never stored.
    let mut db = collect(store.get_decoded(&snap).await.unwrap())
        .await
        .unwrap();
    let mid = db.len() / 2;
    db[mid] ^= 0x40;
    let bad = store.new_snapshot(Kind::Full, 0, revision + 1, Codec::Gzip, false);
    let e = full::store_payload(
        &store,
        &bad,
        etcd_warden::store::compression::once(db),
        Codec::Gzip,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("SHA-256"), "{e}");
    assert_eq!(store.list().await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_follow_the_watch_from_the_full_snapshot() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    client.put("before", "x", None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path());
    let base = take_full(&client, &store, Codec::Gzip, false)
        .await
        .unwrap();

    // Changes made while no watcher runs are still picked up: the watch starts at base + 1.
    client.put("a", "1", None).await.unwrap();
    let mut writer = DeltaWriter::new(Codec::Gzip, base.last_revision);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut stored = Vec::new();
    let runner = {
        let client = client.clone();
        let store = store.clone();
        tokio::spawn(async move {
            let r = run_deltas(
                &client,
                &store,
                &mut writer,
                Duration::from_millis(300),
                u64::MAX,
                async {
                    let _ = stop_rx.await;
                },
                |s| stored.push(s.clone()),
            )
            .await;
            (r, stored)
        })
    };
    client.put("b", "2", None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    client.delete("a", None).await.unwrap();
    client
        .txn(etcd_client::Txn::new().and_then([
            etcd_client::TxnOp::put("c", "3", None),
            etcd_client::TxnOp::put("d", "4", None),
        ]))
        .await
        .unwrap();
    let last = client
        .get("c", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_tx.send(()).unwrap();
    let (result, stored) = runner.await.unwrap();
    result.unwrap();

    assert!(stored.len() >= 2, "periodic flushes: {stored:?}");
    let list = store.list().await.unwrap();
    let chain = etcd_warden::store::layout::latest_chain(&list);
    assert_eq!(chain.full_snapshot.as_ref(), Some(&base));
    assert_eq!(chain.delta_snapshots, stored);
    // Contiguous: each delta starts right after the previous snapshot.
    let mut prev = base.last_revision;
    let mut events = Vec::new();
    for d in &chain.delta_snapshots {
        assert_eq!(d.start_revision, prev + 1, "{}", d.snap_name);
        prev = d.last_revision;
        events.extend(delta::read(&store, d).await.unwrap());
    }
    assert_eq!(prev, last);
    let seen: Vec<(EventType, String, i64)> = events
        .iter()
        .map(|e| {
            let kv = e.event.kv.as_ref().unwrap();
            (
                e.event.kind,
                String::from_utf8(kv.key.clone()).unwrap(),
                kv.mod_revision,
            )
        })
        .collect();
    let r = base.last_revision;
    assert_eq!(
        seen,
        vec![
            (EventType::Put, "a".into(), r + 1),
            (EventType::Put, "b".into(), r + 2),
            (EventType::Delete, "a".into(), r + 3),
            (EventType::Put, "c".into(), r + 4),
            (EventType::Put, "d".into(), r + 4),
        ]
    );
    assert_eq!(events[3].event.kv.as_ref().unwrap().value, b"3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_flushes_early() {
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(dir.path());
    let base = take_full(&client, &store, Codec::None, false)
        .await
        .unwrap();
    let mut writer = DeltaWriter::new(Codec::None, base.last_revision);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let runner = {
        let client = client.clone();
        let store = store.clone();
        tokio::spawn(async move {
            let mut n = 0;
            let r = run_deltas(
                &client,
                &store,
                &mut writer,
                Duration::from_secs(3600),
                1,
                async {
                    let _ = stop_rx.await;
                },
                |_| n += 1,
            )
            .await;
            (r, n)
        })
    };
    for i in 0..3 {
        client.put(format!("k{i}"), "v", None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_tx.send(()).unwrap();
    let (r, n) = runner.await.unwrap();
    r.unwrap();
    // The period is an hour: only the limit can have flushed each write on its own.
    assert_eq!(n, 3);
    let deltas = store.latest_chain().await.unwrap().delta_snapshots;
    assert_eq!(deltas.len(), 3);
    assert!(deltas.iter().all(|d| d.start_revision == d.last_revision));
}
