//! `restore` against real etcd: a full snapshot and several deltas of a mixed workload restore
//! into a directory on which etcd starts with every key, value and the revision of the original.

use crate::support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{Client, CompactionOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};
use etcd_warden::etcd::process::{self, Bootstrap, ClusterState, MemberSpec};
use etcd_warden::restore::replay::{self, ReplayOp, RevisionGroup};
use etcd_warden::restore::{MemberParams, Replay, RestoreError, RestoreOptions};
use etcd_warden::snapshot::delta::{DeltaWriter, Event};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use support::etcd::{EtcdCluster, Release};
use support::{eventually, free_port};

/// A running etcd, a client of it, and a file store in a temporary directory: where a restore
/// test starts.
pub(crate) struct Source {
    /// Held so etcd runs as long as the test does.
    pub _etcd: EtcdCluster,
    pub client: Client,
    pub dir: tempfile::TempDir,
    pub store: SnapshotStore,
}

/// A single etcd of `release` and an empty file store under `dir/store`.
pub(crate) async fn source(release: Release) -> Source {
    let etcd = EtcdCluster::single(release).await;
    let client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir.path().join("store"));
    Source {
        _etcd: etcd,
        client,
        dir,
        store,
    }
}

pub(crate) fn file_store(dir: &Path) -> SnapshotStore {
    std::fs::create_dir_all(dir).unwrap();
    let backend = Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir).unwrap());
    SnapshotStore::new(backend, "")
}

/// Every key as (key, value, create revision, mod revision, version), and the revision.
pub(crate) type Dump = (Vec<(Vec<u8>, Vec<u8>, i64, i64, i64)>, i64);

pub(crate) async fn dump(client: &mut Client) -> Dump {
    dump_at(client, None).await
}

/// [`dump`] as etcd served it at revision `at` (before any compaction of it); `None`: now.
pub(crate) async fn dump_at(client: &mut Client, at: Option<i64>) -> Dump {
    let options = GetOptions::new().with_from_key();
    let options = match at {
        Some(rev) => options.with_revision(rev),
        None => options,
    };
    let resp = client.get(vec![0u8], Some(options)).await.unwrap();
    let rev = at.unwrap_or(resp.header().unwrap().revision());
    let kvs = resp
        .kvs()
        .iter()
        .map(|kv| {
            (
                kv.key().to_vec(),
                kv.value().to_vec(),
                kv.create_revision(),
                kv.mod_revision(),
                kv.version(),
            )
        })
        .collect();
    (kvs, rev)
}

pub(crate) async fn revision(client: &mut Client) -> i64 {
    client
        .get("x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision()
}

/// How large one phase of [`workload_of`] is, and how its keys are spelled (`{i:0width$}`; a
/// width of 0 pads nothing).
pub(crate) struct Workload {
    /// Keys put under `/registry/p{phase}/`.
    pub keys: u32,
    pub key_width: usize,
    /// Keys put again under `/registry/shared/` (the 5th deleted, the 6th deleted in a txn).
    pub overwrites: u32,
    pub overwrite_width: usize,
    /// Bytes of the one large value.
    pub big: u32,
}

impl Workload {
    /// The restore tests' phase: a value near etcd's request limit.
    pub(crate) const RESTORE: Workload = Workload {
        keys: 60,
        key_width: 3,
        overwrites: 20,
        overwrite_width: 3,
        big: 900_000,
    };
}

/// Puts, overwrites, deletes, a prefix delete and a multi-op transaction (several events at one
/// revision), a key under a lease, and a value near etcd's request limit.
pub(crate) async fn workload(client: &mut Client, phase: usize) {
    workload_of(client, phase, &Workload::RESTORE).await;
}

/// One phase of what a restore must get right, sized by `size`: puts, overwrites, a delete, a
/// prefix delete, a transaction of several events at one revision, a value spanning several bbolt
/// pages, and a key under a lease.
pub(crate) async fn workload_of(client: &mut Client, phase: usize, size: &Workload) {
    let (kw, ow) = (size.key_width, size.overwrite_width);
    for i in 0..size.keys {
        client
            .put(
                format!("/registry/p{phase}/k{i:0kw$}"),
                format!("v{i}-{phase}"),
                None,
            )
            .await
            .unwrap();
    }
    for i in 0..size.overwrites {
        client
            .put(
                format!("/registry/shared/k{i:0ow$}"),
                format!("overwritten-{phase}"),
                None,
            )
            .await
            .unwrap();
    }
    client
        .delete(format!("/registry/shared/k{:0ow$}", 5), None)
        .await
        .unwrap();
    if phase > 0 {
        client
            .delete(
                format!("/registry/p{}/", phase - 1),
                Some(DeleteOptions::new().with_prefix()),
            )
            .await
            .unwrap();
    }
    client
        .txn(Txn::new().and_then([
            TxnOp::put(format!("/txn/{phase}/a"), "a", None),
            TxnOp::put(format!("/txn/{phase}/b"), "b", None),
            TxnOp::delete(format!("/registry/shared/k{:0ow$}", 6), None),
        ]))
        .await
        .unwrap();
    let big: Vec<u8> = (0..size.big).map(|i| (i % 251) as u8).collect();
    client
        .put(format!("/big/{phase}"), big, None)
        .await
        .unwrap();
    let lease = client.lease_grant(3600, None).await.unwrap().id();
    client
        .put(
            format!("/leased/{phase}"),
            "l",
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
}

/// A full snapshot after phase 0 and a compaction, then `deltas` deltas of one phase each,
/// taken from a watch. The compaction removes phase 0's last revision (a delete) from the
/// database, so the snapshot's revision is known only from the compaction.
pub(crate) async fn build_store(client: &mut Client, store: &SnapshotStore, deltas: usize) -> i64 {
    workload(client, 0).await;
    client.delete("/registry/shared/k000", None).await.unwrap();
    let at = revision(client).await;
    client
        .compact(at, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();
    let full = take_full(client, store, Codec::Gzip, false).await.unwrap();
    let mut writer = DeltaWriter::new(Codec::Gzip, full.last_revision);
    let mut watch = DeltaWatch::open(client, full.last_revision + 1)
        .await
        .unwrap();
    for phase in 1..=deltas {
        workload(client, phase).await;
        let target = revision(client).await;
        let mut events: Vec<Event> = Vec::new();
        while events.last().map_or(0, Event::revision) < target {
            events.extend(watch.next().await.unwrap());
        }
        writer.push(events, chrono::Utc::now());
        writer.flush(store).await.unwrap().unwrap();
    }
    revision(client).await
}

pub(crate) fn options(data_dir: &Path, release: Release) -> RestoreOptions {
    RestoreOptions {
        data_dir: data_dir.to_path_buf(),
        member: MemberParams::default(),
        etcd_bin: Some(release.bin_dir()),
        force: false,
        parallel_fetch: 3,
        fallback: false,
        must_exceed: None,
        to: None,
        bump: Default::default(),
    }
}

/// Starts etcd on a restored directory and dumps it.
pub(crate) async fn dump_restored(release: Release, data_dir: &Path, name: &str) -> Dump {
    let log = data_dir.with_extension("check.log");
    let etcd = support::etcd::temp_etcd(release, data_dir, name, log)
        .await
        .unwrap();
    let mut client = Client::connect([&etcd.client_url], None).await.unwrap();
    let d = dump(&mut client).await;
    etcd.stop().await.unwrap();
    d
}

async fn full_and_deltas_restore(release: Release, deltas: usize) {
    let etcd = EtcdCluster::single(release).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir.path().join("store"));
    let last = build_store(&mut client, &store, deltas).await;
    let original = dump(&mut client).await;
    assert_eq!(original.1, last);

    let target = dir.path().join("restored.etcd");
    let report = etcd_warden::restore::restore(&store, &options(&target, release))
        .await
        .unwrap();
    assert_eq!(report.deltas, deltas);
    assert_eq!(report.revision, last);
    assert!(report.events_applied > 0);
    assert_eq!(report.replay, Replay::Direct);
    assert!(!dir.path().join("restored.etcd.part").exists());
    assert!(!dir.path().join("restored.etcd.restore-work").exists());
    // The snapshot patched in place is consistent as `bbolt check` sees it: every page used by
    // one tree or free, never both (etcd, below, stops on a page reached twice when it walks
    // the trees to find the free pages; it does not see a page lost).
    let db = target.join("member/snap/db");
    let len = std::fs::metadata(&db).unwrap().len();
    let check = etcd_warden::restore::bolt::Reader::open(&db, len)
        .unwrap()
        .check()
        .unwrap_or_else(|e| panic!("{}: {e}", db.display()));
    assert!(check.free > 0, "the replaced pages are free: {check:?}");

    let restored = dump_restored(release, &target, "default").await;
    assert_eq!(restored.1, original.1, "revision");
    assert_eq!(restored.0.len(), original.0.len(), "key count");
    assert!(
        restored.0 == original.0,
        "keys, values and revisions differ"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_and_deltas_restore_exactly_on_etcd_3_5() {
    full_and_deltas_restore(Release::V35, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_and_deltas_restore_exactly_on_etcd_3_4() {
    full_and_deltas_restore(Release::V34, 2).await;
}

/// Needs `$ETCD36_BIN_DIR` (skipped without it, as in CI): 3.6 restores with its `etcdutl`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_snapshot_and_deltas_restore_exactly_on_etcd_3_6() {
    if let Some(release) = Release::v36("full_snapshot_and_deltas_restore_exactly_on_etcd_3_6") {
        full_and_deltas_restore(release, 3).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_delta_fails_and_leaves_the_target_untouched() {
    let (_etcd, mut client, dir, store) = support::etcd_and_file_store().await;
    build_store(&mut client, &store, 2).await;
    // Flip one byte inside the first delta's JSON; the stored hash no longer matches.
    let first = support::deltas(&store).await.remove(0);
    let raw = etcd_warden::store::compression::collect(store.get_decoded(&first).await.unwrap())
        .await
        .unwrap();
    let mut bad = raw.clone();
    bad[10] ^= 0x01;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&bad).unwrap();
    store
        .put_bytes(&first, Bytes::from(gz.finish().unwrap()))
        .await
        .unwrap();

    let target = dir.path().join("data");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(target.join("precious"), b"keep me").unwrap();
    // Non-empty and no --force: refused before anything is fetched.
    let e = etcd_warden::restore::restore(&store, &options(&target, Release::V35))
        .await
        .unwrap_err();
    assert!(matches!(e, RestoreError::TargetNotEmpty(_)), "{e}");

    let mut opts = options(&target, Release::V35);
    opts.force = true;
    let e = etcd_warden::restore::restore(&store, &opts)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("fetching and verifying deltas"), "{e}");
    assert!(e.contains(&first.snap_name) && e.contains("hash"), "{e}");
    assert_eq!(std::fs::read(target.join("precious")).unwrap(), b"keep me");
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(
        names,
        vec!["data", "store"],
        "nothing left beside the target"
    );

    // The binary says which step failed, exits 1, and leaves the target alone too.
    let out = support::warden::command()
        .args(["restore", "--force", "--store"])
        .arg(format!("file://{}", dir.path().join("store").display()))
        .arg("--data-dir")
        .arg(&target)
        .arg("--etcd-bin")
        .arg(Release::V35.bin_dir())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("fetching and verifying deltas"), "{stderr}");
    assert_eq!(std::fs::read(target.join("precious")).unwrap(), b"keep me");
}

/// `etcd-warden restore` of the file store at `store_dir` into `target`, as member m1 of etcd 3.5.
pub(crate) fn restore_command(store_dir: &Path, target: &Path) -> std::process::Command {
    let mut c = support::warden::command();
    c.args(["restore", "--store"])
        .arg(format!("file://{}", store_dir.display()))
        .arg("--data-dir")
        .arg(target)
        .arg("--etcd-bin")
        .arg(Release::V35.bin_dir())
        .args(["--name", "m1"]);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_log_shows_each_restore_step_in_its_span() {
    let (_etcd, mut client, dir, store) = support::etcd_and_file_store().await;
    let last = build_store(&mut client, &store, 2).await;
    let chain = store.latest_chain().await.unwrap();
    let full = chain.full_snapshot.unwrap();
    let out = support::cli::succeeds(
        restore_command(&dir.path().join("store"), &dir.path().join("data"))
            .args(["--log-format", "json"]),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines = support::cli::json_lines(&stderr);
    // The span of this name around the first event inside one.
    let span = |name: &str| {
        lines
            .iter()
            .find_map(|l| support::cli::span(l, name))
            .unwrap_or_else(|| panic!("no {name} span:\n{stderr}"))
    };
    assert!(span("restore")["store"].is_string(), "{stderr}");
    let fetch = span("fetch_full_snapshot");
    assert_eq!(fetch["snapshot"], full.snap_name, "{fetch}");
    assert_eq!(fetch["revision"], full.last_revision, "{fetch}");
    let write = span("write_deltas");
    assert_eq!(
        write["first_revision"], chain.delta_snapshots[0].start_revision,
        "{write}"
    );
    assert_eq!(write["last_revision"], last, "{write}");
    assert_eq!(span("check_written_revision")["expected"], last, "{stderr}");
    // etcd 3.5's member directory is written without its tool or a temporary etcd.
    for absent in ["temp_etcd_check", "etcd_restore_tool"] {
        assert!(
            !lines
                .iter()
                .any(|l| support::cli::span(l, absent).is_some()),
            "a {absent} span:\n{stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_moves_the_old_directory_aside_via_the_binary() {
    let (_etcd, mut client, dir, store) = support::etcd_and_file_store().await;
    let last = build_store(&mut client, &store, 1).await;
    let original = dump(&mut client).await;
    let target = dir.path().join("data");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(target.join("old"), b"old").unwrap();
    let restore = || restore_command(&dir.path().join("store"), &target);
    let out = restore().output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--force"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    support::cli::succeeds(restore().arg("--force"));
    let aside: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("data.old-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(std::fs::read(aside[0].join("old")).unwrap(), b"old");
    let restored = dump_restored(Release::V35, &target, "m1").await;
    assert_eq!(restored.1, last);
    assert!(restored.0 == original.0);
}

/// A snapshot of an etcd that never had a key is at revision 1 with no record of it: the deltas
/// continue from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_an_empty_etcd_and_its_deltas_restore() {
    let (_etcd, mut client, dir, store) = support::etcd_and_file_store().await;
    let full = support::stored::gzip_full(&client, &store).await;
    assert_eq!(full.last_revision, 1);
    let mut writer = DeltaWriter::new(Codec::Gzip, 1);
    let mut watch = DeltaWatch::open(&client, 2).await.unwrap();
    client.put("/a", "1", None).await.unwrap();
    client.put("/b", "2", None).await.unwrap();
    client.delete("/a", None).await.unwrap();
    let mut events: Vec<Event> = Vec::new();
    while events.last().map_or(0, Event::revision) < 4 {
        events.extend(watch.next().await.unwrap());
    }
    writer.push(events, chrono::Utc::now());
    writer.flush(&store).await.unwrap().unwrap();
    let original = dump(&mut client).await;

    let target = dir.path().join("data");
    let report = etcd_warden::restore::restore(&store, &options(&target, Release::V35))
        .await
        .unwrap();
    assert_eq!((report.replay, report.revision), (Replay::Direct, 4));
    assert_eq!(
        dump_restored(Release::V35, &target, "default").await,
        original
    );
}

/// A delta written as etcd-backup-restore writes it, built here from the documented format,
/// restores by writing the events into the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_backup_restore_delta_restores() {
    etcd_backup_restore_fixture(true, Replay::Direct).await;
}

/// Without the create revisions and versions etcd records for a put, the events cannot be
/// written as etcd would have: they are replayed through a temporary etcd instead, same result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_without_their_revisions_are_replayed_through_etcd() {
    etcd_backup_restore_fixture(false, Replay::ThroughEtcd).await;
}

async fn etcd_backup_restore_fixture(complete: bool, replay: Replay) {
    use base64::Engine;
    use sha2::Digest;
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    client.put("/a", "1", None).await.unwrap();
    client.put("/b", "2", None).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir.path().join("store"));
    let full = support::stored::gzip_full(&client, &store).await;
    let r = full.last_revision;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    // Go's encoding: PUT has no "type", zero fields omitted, bytes base64; a txn's two events
    // share a revision.
    let mut array = serde_json::json!([
        {"etcdEvent": {"kv": {"key": b64("/a"), "create_revision": 2, "mod_revision": r + 1, "version": 2, "value": b64("one")}}, "time": "2024-01-02T03:04:05.123456789Z"},
        {"etcdEvent": {"type": 1, "kv": {"key": b64("/b"), "mod_revision": r + 2}}, "time": "2024-01-02T03:04:06Z"},
        {"etcdEvent": {"kv": {"key": b64("/c"), "create_revision": r + 3, "mod_revision": r + 3, "version": 1, "value": b64("x")}}, "time": "2024-01-02T03:04:07.5Z"},
        {"etcdEvent": {"kv": {"key": b64("/d"), "create_revision": r + 3, "mod_revision": r + 3, "version": 1}}, "time": "2024-01-02T03:04:07.5Z"}
    ]);
    if !complete {
        for e in array.as_array_mut().unwrap() {
            let kv = e["etcdEvent"]["kv"].as_object_mut().unwrap();
            kv.remove("create_revision");
            kv.remove("version");
        }
    }
    let mut payload = serde_json::to_vec(&array).unwrap();
    let hash = sha2::Sha256::digest(&payload);
    payload.extend_from_slice(&hash);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&payload).unwrap();
    let delta = store.new_snapshot(Kind::Incr, r + 1, r + 3, Codec::Gzip, false);
    store
        .put_bytes(&delta, Bytes::from(gz.finish().unwrap()))
        .await
        .unwrap();

    let target = dir.path().join("data");
    let report = etcd_warden::restore::restore(&store, &options(&target, Release::V35))
        .await
        .unwrap();
    assert_eq!(report.replay, replay);
    assert_eq!(report.revision, r + 3);
    assert_eq!(report.events_applied, 4);
    let (kvs, rev) = dump_restored(Release::V35, &target, "default").await;
    assert_eq!(rev, r + 3);
    let kv = |k: &str, v: &str, create: i64, modified: i64, version: i64| {
        (
            k.as_bytes().to_vec(),
            v.as_bytes().to_vec(),
            create,
            modified,
            version,
        )
    };
    assert_eq!(
        kvs,
        vec![
            kv("/a", "one", 2, r + 1, 2),
            kv("/c", "x", r + 3, r + 3, 1),
            kv("/d", "", r + 3, r + 3, 1)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_restored_members_form_a_new_cluster() {
    let release = Release::V35;
    let etcd = EtcdCluster::single(release).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir.path().join("store"));
    let last = build_store(&mut client, &store, 2).await;
    let original = dump(&mut client).await;
    drop(etcd);

    // The restored data names the peer URLs: the ports are chosen first, and kept.
    let port = || process::pick_port().unwrap();
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (port(), port())).collect();
    let cluster = ports
        .iter()
        .enumerate()
        .map(|(i, (_, p))| format!("r{i}=http://127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut specs = Vec::new();
    for (i, (c, p)) in ports.iter().enumerate() {
        let data = dir.path().join(format!("r{i}.etcd"));
        let mut opts = options(&data, release);
        opts.member = MemberParams {
            name: format!("r{i}"),
            initial_cluster: cluster.clone(),
            initial_cluster_token: "restored".into(),
            initial_advertise_peer_urls: format!("http://127.0.0.1:{p}"),
        };
        let report = etcd_warden::restore::restore(&store, &opts).await.unwrap();
        assert_eq!(report.revision, last);
        assert_eq!(report.replay, Replay::Direct);
        specs.push(MemberSpec {
            client_port: *c,
            peer_port: *p,
            bootstrap: Some(Bootstrap {
                initial_cluster: Some(cluster.clone()),
                state: ClusterState::New,
                token: "restored".into(),
            }),
            no_fsync: true,
            log: Some(dir.path().join(format!("r{i}.log"))),
            ..MemberSpec::new(format!("r{i}"), data)
        });
    }
    let members = process::start_cluster(release.binaries(), &mut specs, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| {
            let logs: String = (0..3)
                .map(|i| {
                    std::fs::read_to_string(dir.path().join(format!("r{i}.log")))
                        .unwrap_or_default()
                })
                .collect();
            panic!("restored members not healthy: {e}; logs:\n{logs}")
        });
    let urls: Vec<String> = specs.iter().map(MemberSpec::client_url).collect();
    let mut c = Client::connect(urls.clone(), None).await.unwrap();
    assert_eq!(c.member_list().await.unwrap().members().len(), 3);
    let restored = dump(&mut c).await;
    assert_eq!(restored.1, original.1);
    assert!(restored.0 == original.0);
    // The new cluster takes writes.
    c.put("/after", "restore", None).await.unwrap();
    for u in &urls {
        let mut one = Client::connect([u], None).await.unwrap();
        let got = one
            .get("/after", Some(GetOptions::new().with_serializable()))
            .await;
        let ok = eventually(Duration::from_secs(5), || {
            let u = u.clone();
            async move {
                let mut one = Client::connect([u], None).await.unwrap();
                one.get("/after", Some(GetOptions::new().with_serializable()))
                    .await
                    .map(|r| r.kvs().len() == 1)
                    .unwrap_or(false)
            }
        })
        .await;
        assert!(ok && got.is_ok(), "{u} did not see the write");
    }
    drop(members);
}

/// `serve` with `restore.initialize` restores a missing data directory before it starts, and a
/// guard file naming another etcd stops it with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_initializes_a_missing_data_directory_from_the_store() {
    let (etcd, mut client, dir, store) = support::etcd_and_file_store().await;
    let store_dir = dir.path().join("store");
    let last = build_store(&mut client, &store, 1).await;
    let original = dump(&mut client).await;
    drop(etcd);

    let keys = |data: &Path, guard: &str| {
        vec![
            ("store.url", format!("file://{}", store_dir.display())),
            (
                "etcd.endpoints",
                format!("http://127.0.0.1:{}", free_port()),
            ),
            ("restore.initialize", "true".to_string()),
            ("restore.data_dir", data.display().to_string()),
            (
                "restore.etcd_bin",
                Release::V35.bin_dir().display().to_string(),
            ),
            ("restore.guard", guard.to_string()),
            // A single-member cluster restores from the store even with cluster endpoints.
            (
                "restore.cluster_endpoints",
                format!("http://127.0.0.1:{}", free_port()),
            ),
        ]
    };
    let data = dir.path().join("vol/data");
    let warden = support::warden::Warden::start(&keys(&data, "ns-a"));
    let done = eventually(Duration::from_secs(60), || async {
        warden.log_text().contains("restore complete")
    })
    .await;
    assert!(done, "no restore; log:\n{}", warden.log_text());
    // The sidecar serves once the data directory is there; /metrics shows the validation and
    // the restore, under the reference's names.
    let scraped = eventually(Duration::from_secs(20), || async {
        matches!(warden.get("/metrics").await, Some((200, _)))
    })
    .await;
    assert!(scraped, "no /metrics; log:\n{}", warden.log_text());
    let metrics = match warden.get("/metrics").await {
        Some((200, serde_json::Value::String(text))) => text,
        other => panic!("/metrics: {other:?}"),
    };
    for line in [
        r#"etcdbr_validation_duration_seconds_count{succeeded="true"} 1"#,
        r#"etcdbr_validation_duration_seconds_count{succeeded="false"} 0"#,
        r#"etcdbr_restoration_duration_seconds_count{restore="single_node",succeeded="true"} 1"#,
        r#"etcdbr_restoration_duration_seconds_count{restore="single_node",succeeded="false"} 0"#,
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no {line} in\n{metrics}"
        );
    }
    drop(warden);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("vol/.etcd-warden-guard")).unwrap(),
        "ns-a\n"
    );
    let restored = dump_restored(Release::V35, &data, "default").await;
    assert_eq!(restored.1, last);
    assert!(restored.0 == original.0);

    // Another namespace's sidecar on this volume refuses (the data dir is invalid again).
    std::fs::remove_dir_all(data.join("member/wal")).unwrap();
    let warden = support::warden::Warden::start(&keys(&data, "ns-b"));
    let refused = eventually(Duration::from_secs(20), || async {
        warden.log_text().contains("another etcd")
    })
    .await;
    assert!(refused, "no guard error; log:\n{}", warden.log_text());
    assert!(!data.join("member/wal").exists(), "nothing restored");
    assert!(!dir.path().join("vol/data.part").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initialize_starts_fresh_on_an_empty_store_and_refuses_what_it_cannot_restore() {
    use etcd_warden::restore::initialize::{InitializeMetrics, Initialized, initialize_observed};
    let metrics = InitializeMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let initialize = |store, config| initialize_observed(store, config, &metrics);
    let count = |succeeded: &str| {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let series =
            format!(r#"etcdbr_validation_duration_seconds_count{{succeeded="{succeeded}"}} "#);
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str())?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir.path().join("store"));
    let data = dir.path().join("data");
    let config =
        support::history::initialize_config(&data, etcd_warden::config::Validation::Sanity);
    assert_eq!(
        initialize(&store, &config).await.unwrap(),
        Initialized::Fresh
    );
    assert!(!data.exists());
    // A directory etcd cannot start on and nothing to restore: refuse, touch nothing.
    std::fs::create_dir_all(data.join("member/snap")).unwrap();
    std::fs::create_dir_all(data.join("member/wal")).unwrap();
    let e = initialize(&store, &config).await.unwrap_err().to_string();
    assert!(e.contains("corrupt") && e.contains("WAL"), "{e}");
    assert!(data.join("member/snap").is_dir());
    assert_eq!((count("true"), count("false")), (1, 1));
    // Deltas without a full snapshot: refuse rather than start empty.
    std::fs::remove_dir_all(&data).unwrap();
    let d = store.new_snapshot(Kind::Incr, 1, 2, Codec::None, false);
    store.put_bytes(&d, Bytes::from_static(b"x")).await.unwrap();
    let e = initialize(&store, &config).await.unwrap_err().to_string();
    assert!(e.contains("no full snapshot"), "{e}");
    assert_eq!((count("true"), count("false")), (1, 2));
}

fn put(key: &str, value: &str) -> ReplayOp {
    ReplayOp::Put {
        key: key.into(),
        value: value.into(),
    }
}

fn del(key: &str) -> ReplayOp {
    ReplayOp::Delete { key: key.into() }
}

/// A single etcd holding key `a` at revision `r`, and `ops` as the revision groups after it
/// (r+1, r+2, …).
async fn replay_fixture(ops: Vec<Vec<ReplayOp>>) -> (EtcdCluster, Client, i64, Vec<RevisionGroup>) {
    let cluster = EtcdCluster::single(Release::V35).await;
    let mut client = cluster.client().await;
    client.put("a", "0", None).await.unwrap();
    let r = revision(&mut client).await;
    let groups = ops
        .into_iter()
        .zip(r + 1..)
        .map(|(ops, revision)| RevisionGroup { revision, ops })
        .collect();
    (cluster, client, r, groups)
}

/// The replay's ordering guard against real etcd: a transaction that etcd takes before its
/// predecessor changes nothing and takes no revision, and a pipelined replay with revisions that
/// only delete lands every revision exactly where it was at the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_transactions_taken_out_of_order_change_nothing() {
    let (_cluster, mut client, r, groups) = replay_fixture(vec![
        vec![put("b", "1")],
        vec![put("c", "2"), del("a")],
        vec![del("b")],
        vec![put("d", "4")],
        vec![put("c", "5")],
    ])
    .await;

    let mut kv = client.kv_client();
    let early = kv
        .txn(replay::transaction(
            &groups[1],
            replay::guard(&groups[..1]).as_ref(),
        ))
        .await
        .unwrap();
    assert!(
        !early.succeeded(),
        "a transaction ahead of its predecessor must fail its guard"
    );
    assert_eq!(
        revision(&mut client).await,
        r,
        "a failed guard takes no revision"
    );
    assert!(client.get("c", None).await.unwrap().kvs().is_empty());

    let mut current = r;
    let gap = replay::apply(&kv, &groups[1..], &mut current).await;
    assert!(
        matches!(&gap, Err(RestoreError::Deltas(m)) if m.contains("gap")),
        "{gap:?}"
    );
    assert_eq!(current, r);

    // Past a revision that only deletes, the guard also needs the deleted key gone: with r+1
    // and r+2 applied but not r+3 (which deletes b), r+4 must not land.
    replay::apply(&kv, &groups[..2], &mut current)
        .await
        .unwrap();
    assert_eq!(current, r + 2);
    let guard = replay::guard(&groups[..3]).expect("c, put at r+2, with b gone");
    assert_eq!(guard.absent, vec![&b"b"[..]]);
    let early = kv
        .txn(replay::transaction(&groups[3], Some(&guard)))
        .await
        .unwrap();
    assert!(
        !early.succeeded(),
        "a transaction after a delete not yet applied must fail its guard"
    );
    assert_eq!(revision(&mut client).await, r + 2);
    assert!(client.get("d", None).await.unwrap().kvs().is_empty());

    let done = replay::apply(&kv, &groups, &mut current).await.unwrap();
    assert_eq!(done.events, 3);
    assert_eq!(current, r + 5);
    assert_eq!(revision(&mut client).await, r + 5);
    let mod_rev = |kvs: &[etcd_client::KeyValue]| kvs.first().map(|kv| kv.mod_revision());
    assert_eq!(
        mod_rev(client.get("c", None).await.unwrap().kvs()),
        Some(r + 5)
    );
    assert_eq!(
        mod_rev(client.get("d", None).await.unwrap().kvs()),
        Some(r + 4)
    );
    assert!(client.get("a", None).await.unwrap().kvs().is_empty());
    assert!(client.get("b", None).await.unwrap().kvs().is_empty());
    // Applying the same groups again skips them all: they are at or below the revision.
    let again = replay::apply(&kv, &groups, &mut current).await.unwrap();
    assert_eq!(again.events, 0);
    assert_eq!(revision(&mut client).await, r + 5);
}

/// A round's chain against real etcd: sent once per revision, each copy applies the revision
/// due when etcd takes it, lowest first, each on its own revision; a revision that only deletes
/// in the middle is passed in order too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_applies_whichever_revision_is_due() {
    let (_cluster, mut client, r, groups) = replay_fixture(vec![
        vec![put("b", "1")],
        vec![del("a")],
        vec![put("b", "3")],
        vec![put("c", "4")],
    ])
    .await;
    assert_eq!(replay::round_len(&groups, 0, 8), 4);
    let chain = replay::chain(&groups, 0, 4);
    let mut kv = client.kv_client();
    for (branch, group) in groups.iter().enumerate() {
        let resp = kv.txn(chain.clone()).await.unwrap();
        assert_eq!(replay::branch_taken(&resp, 4), Some(branch));
        assert_eq!(resp.header().map(|h| h.revision()), Some(group.revision));
    }
    let kvs = client.get("b", None).await.unwrap();
    assert_eq!(kvs.kvs()[0].value(), b"3");
    assert_eq!(kvs.kvs()[0].mod_revision(), r + 3);
    assert!(client.get("a", None).await.unwrap().kvs().is_empty());
    assert_eq!(
        client.get("c", None).await.unwrap().kvs()[0].mod_revision(),
        r + 4
    );
}

/// The latest full snapshot fails verification: `restore` falls back to the previous one, puts
/// the directory in place, and exits 3, not 0, naming the skipped snapshot, so a script cannot
/// take the older state for a clean restore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_that_falls_back_exits_3_naming_the_skipped_snapshot() {
    let (_etcd, mut client, dir, store) = support::etcd_and_file_store().await;
    let store_dir = dir.path().join("store");
    client.put("before", "1", None).await.unwrap();
    let older = support::stored::gzip_full(&client, &store).await;
    client.put("after", "2", None).await.unwrap();
    let newest = support::stored::gzip_full(&client, &store).await;
    // Cut short in the store: its gzip stream ends early.
    let object = store_dir.join("v2").join(&newest.snap_name);
    let bytes = std::fs::read(&object).unwrap();
    std::fs::write(&object, &bytes[..bytes.len() / 2]).unwrap();

    let target = dir.path().join("data");
    let out = restore_command(&store_dir, &target).output().unwrap();
    support::cli::fell_back_past(&out, &newest.snap_name);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.trim().lines().last().unwrap();
    assert!(
        last.starts_with(&format!(
            "etcd-warden: restored {} from an older full snapshot, {}, at revision {}",
            target.display(),
            older.snap_name,
            older.last_revision
        )) && last.contains(&newest.snap_name),
        "{stderr}"
    );
    // The older state is in place: "before" is there, "after" is not.
    let (kvs, revision) = dump_restored(Release::V35, &target, "m1").await;
    let keys: Vec<&[u8]> = kvs.iter().map(|kv| kv.0.as_slice()).collect();
    assert_eq!(keys, [b"before".as_slice()]);
    assert_eq!(revision, older.last_revision);
}

/// A point-in-time restore whose full snapshot fails verification, where the earlier chain
/// that would stand in for it has a gap before the target: the restore fails naming both, the
/// skipped full snapshot and the gap. Before the fix only the gap was named ("while choosing
/// the snapshots to fall back to"), which read as a delta missing from the chain asked for
/// (robustness finding 8's message).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_stopped_by_a_gap_names_the_skipped_full_snapshot_too() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let store = file_store(&store_dir);
    support::stored::put_full(&store, 10, 1_700_000_000, 10_000, Codec::Gzip, false).await;
    let before = support::stored::put_delta(&store, 11, 12, 1_700_000_100).await;
    let newest =
        support::stored::put_full(&store, 20, 1_700_000_200, 10_000, Codec::Gzip, false).await;
    let after = support::stored::put_delta(&store, 21, 25, 1_700_000_300).await;
    // Cut short in the store: its gzip stream ends early.
    let object = store_dir.join("v2").join(&newest.snap_name);
    let bytes = std::fs::read(&object).unwrap();
    std::fs::write(&object, &bytes[..bytes.len() / 2]).unwrap();

    let target = dir.path().join("data");
    let out = restore_command(&store_dir, &target)
        .args(["--to-revision", "22"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.trim().lines().last().unwrap();
    assert!(
        last.contains(&format!("snapshot {} fails verification", newest.snap_name))
            && last.contains(&format!(
                "falling back to an earlier full snapshot failed: revision gap in the latest \
                 chain: revisions 13 to 20 are in no snapshot ({} ends at 12, the next delta {} \
                 starts at 21)",
                before.snap_name, after.snap_name
            )),
        "{stderr}"
    );
    assert!(!target.exists(), "nothing restored: {stderr}");
}

/// A delta lost after the newest full snapshot: `restore` fails before it fetches anything,
/// naming the missing revisions and the snapshots around them (as `verify` and `copy` do), and
/// warns naming the objects whose names are not snapshot names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_in_the_chain_fails_the_restore_before_anything_is_fetched() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let store = file_store(&store_dir);
    support::stored::put_full(&store, 10, 1_700_000_000, 10_000, Codec::Gzip, false).await;
    let before = support::stored::put_delta(&store, 11, 12, 1_700_000_100).await;
    let after = support::stored::put_delta(&store, 15, 20, 1_700_000_200).await;
    std::fs::write(store_dir.join("v2/Full-xyz"), b"x").unwrap();

    let target = dir.path().join("data");
    let out = restore_command(&store_dir, &target).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "restore failed while checking the chain: revision gap in the latest chain: \
             revisions 13 to 14 are in no snapshot ({} ends at 12, the next delta {} starts at 15)",
            before.snap_name, after.snap_name
        )),
        "{stderr}"
    );
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("WARN") && l.contains("Full-xyz") && l.contains("not restored")),
        "{stderr}"
    );
    assert!(!stderr.contains("fetching"), "nothing fetched: {stderr}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["store"], "nothing written beside the target");
}

/// gzip of `len` zeros: a small object that decompresses far beyond its size.
fn gzip_zeros(len: usize) -> Bytes {
    gzip_after(&[], len)
}

/// `head`, then `len` zero bytes, gzip'd.
fn gzip_after(head: &[u8], len: usize) -> Bytes {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(head).unwrap();
    let block = vec![0u8; 1 << 20];
    for _ in 0..len / block.len() {
        gz.write_all(&block).unwrap();
    }
    Bytes::from(gz.finish().unwrap())
}

/// bbolt's two meta pages (4 KiB pages) declaring a database of `pages` pages: what a full
/// snapshot must start with to be read past its first pages.
fn bbolt_head(pages: u64) -> Vec<u8> {
    let mut head = Vec::new();
    for (id, txid) in [(0u64, 2u64), (1, 1)] {
        let mut page = vec![0u8; 4096];
        page[..8].copy_from_slice(&id.to_le_bytes());
        page[8..10].copy_from_slice(&4u16.to_le_bytes());
        let fields: [u64; 7] = [
            u64::from(0xED0C_DAEDu32) | (2 << 32), // magic, version 2
            4096,                                  // page size, flags 0
            3,                                     // root bucket page
            0,                                     // sequence
            u64::MAX,                              // no freelist stored
            pages,
            txid,
        ];
        for (i, f) in fields.iter().enumerate() {
            page[16 + 8 * i..24 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        let sum = page[16..72].iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        page[72..80].copy_from_slice(&sum.to_le_bytes());
        head.extend_from_slice(&page);
    }
    head
}

/// Decompression bombs beside a real chain (the review's `Incr-…gz` of 10 MB inflating to
/// 10 GiB aborted restore and `initialize`): each is read only up to its bound and fails as a
/// named error giving the bound and the key that sets it. A full snapshot beyond its bound is
/// skipped for the previous one as a corrupt one is; a delta beyond it fails the restore (and
/// `initialize`) as a corrupt delta does, leaving nothing behind; `verify` names it and goes
/// on. The store also holds two files whose names are no object keys, which stop nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decompression_bombs_fail_by_name_and_restore_falls_back_past_a_full_one() {
    use etcd_warden::config::{StoreConfig, Validation};
    use etcd_warden::restore::initialize::initialize;
    use etcd_warden::snapshot::verify::verify;
    use etcd_warden::store::{ReadLimits, Snapshot, StoreLocation};
    use std::os::unix::ffi::OsStrExt;

    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let url = format!("file://{}", store_dir.display());
    // Small bounds, so the bombs stay small: the real full snapshot decodes to ~2 MiB (under
    // the 8 MiB floor), the real delta to ~1.2 MiB.
    let limits = ReadLimits {
        max_delta_size: 3 << 20,
        max_inflation_ratio: 10,
        min_full_bound: 8 << 20,
    };
    let store = SnapshotStore::from_config(&StoreConfig::at(StoreLocation::parse(&url).unwrap()))
        .unwrap()
        .with_read_limits(limits);
    let last = build_store(&mut client, &store, 1).await;
    let real = store.list().await.unwrap();
    let v2 = store_dir.join("v2");
    std::fs::write(v2.join(std::ffi::OsStr::from_bytes(b"Incr-\xfe")), b"x").unwrap();
    std::fs::write(v2.join("two\nlines"), b"x").unwrap();

    // A full snapshot newer than the chain that inflates 24 MiB from ~25 KiB: bbolt's meta
    // pages declaring 4 GiB, then zeros (zeros alone are refused by their meta pages, below).
    let full_bomb = Snapshot::new(
        store.prefix(),
        Kind::Full,
        0,
        last + 100,
        chrono::Utc::now(),
        Codec::Gzip,
        false,
    );
    store
        .put_bytes(&full_bomb, gzip_after(&bbolt_head(1 << 20), 24 << 20))
        .await
        .unwrap();
    // Newer still: zeros, no bbolt database at all, refused by its first pages (it wrote its
    // whole size into the data directory's volume before its hash failed).
    let zeros = Snapshot::new(
        store.prefix(),
        Kind::Full,
        0,
        last + 200,
        chrono::Utc::now(),
        Codec::Gzip,
        false,
    );
    store.put_bytes(&zeros, gzip_zeros(24 << 20)).await.unwrap();
    let mut opts = options(&dir.path().join("restored"), Release::V35);
    opts.fallback = true;
    let report = etcd_warden::restore::restore(&store, &opts).await.unwrap();
    assert_eq!(report.skipped.len(), 2, "{:?}", report.skipped);
    assert_eq!(report.skipped[0].snapshot, zeros.snap_name);
    let reason = &report.skipped[0].reason;
    assert!(
        reason.contains("meta page") && reason.contains("not a bbolt database"),
        "{reason}"
    );
    assert_eq!(report.skipped[1].snapshot, full_bomb.snap_name);
    let reason = &report.skipped[1].reason;
    assert!(
        reason.contains("more than 8388608 bytes")
            && reason.contains("restore.max_inflation_ratio"),
        "{reason}"
    );
    store.delete(&zeros).await.unwrap();
    assert_eq!((report.revision, report.deltas), (last, 1));
    let e = verify(&store, &full_bomb).await.unwrap_err().to_string();
    assert!(
        e.starts_with(&full_bomb.snap_name) && e.contains("restore.max_inflation_ratio"),
        "{e}"
    );
    for s in &real {
        verify(&store, s).await.unwrap();
    }
    store.delete(&full_bomb).await.unwrap();

    // A delta continuing the chain that inflates 16 MiB: restore and initialize stop at 3 MiB.
    let delta_bomb = Snapshot::new(
        store.prefix(),
        Kind::Incr,
        last + 1,
        last + 5,
        chrono::Utc::now(),
        Codec::Gzip,
        false,
    );
    store
        .put_bytes(&delta_bomb, gzip_zeros(16 << 20))
        .await
        .unwrap();
    let target = dir.path().join("from-bomb");
    let e = etcd_warden::restore::restore(&store, &options(&target, Release::V35))
        .await
        .unwrap_err();
    let said = e.to_string();
    assert!(
        said.contains(&delta_bomb.snap_name)
            && said.contains("more than 3145728 bytes")
            && said.contains("restore.max_delta_size"),
        "{said}"
    );
    assert!(!target.exists());
    let data = dir.path().join("initialized");
    let e = initialize(
        &store,
        &support::history::initialize_config(&data, Validation::Sanity),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&delta_bomb.snap_name) && e.contains("restore.max_delta_size"),
        "{e}"
    );
    assert!(!data.join("member").exists());

    // The command line reads the bound from the configuration: `verify` fails the bomb by name
    // and passes the rest; `restore` exits 1 (not an abort) naming it.
    let bound = [("ETCD_WARDEN_RESTORE_MAX_DELTA_SIZE", "3MiB")];
    let out = support::warden::command()
        .args(["verify", "--store", &url])
        .envs(bound)
        .output()
        .unwrap();
    let said = support::cli::printed(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    let line = said
        .lines()
        .find(|l| l.contains(&delta_bomb.snap_name))
        .unwrap_or_else(|| panic!("{said}"));
    assert!(
        line.starts_with("FAIL") && line.contains("restore.max_delta_size"),
        "{said}"
    );
    for s in &real {
        assert!(said.contains(&format!("ok    {}", s.snap_name)), "{said}");
    }
    assert!(
        said.contains("Incr-\\xfe") && said.contains("two\\nlines"),
        "{said}"
    );
    let out = restore_command(&store_dir, &dir.path().join("cli"))
        .envs(bound)
        .output()
        .unwrap();
    let said = support::cli::exited(&out, 1);
    assert!(
        said.contains(&delta_bomb.snap_name) && said.contains("restore.max_delta_size"),
        "{said}"
    );
}
