//! `restore.initialize` validating an existing data directory against etcd 3.5 and the S3
//! server: a truncated database and a damaged page are restored over (the old directory moved
//! aside with its bytes), a directory from an older backup is brought forward, a current one is
//! kept without reading a snapshot; and `restore` falling back past a latest full snapshot that
//! fails verification, or refusing to with `--no-fallback`.

use crate::support;

use std::path::{Path, PathBuf};

use bytes::Bytes;
use etcd_client::Client;
use etcd_warden::config::Validation;
use etcd_warden::restore::direct::revision_key;
use etcd_warden::restore::initialize::{InitializeMetrics, Initialized, Why, initialize_observed};
use etcd_warden::snapshot::delta::{DeltaWriter, Event};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, Snapshot, SnapshotStore};
use futures::StreamExt;
use support::etcd::{EtcdCluster, Release};
use support::history::{
    dump, dump_as_of, dump_restored, initialize_config, restore_options, writes,
};
use support::s3::S3Server;

const BUCKET: &str = "validate";
const PREFIX: &str = "etcd-main";

fn s3_store(s3: &S3Server) -> SnapshotStore {
    SnapshotStore::new(s3.object_store(BUCKET), PREFIX)
}

/// A single etcd 3.5 and a client of it, an S3 server with the store in it, and a temporary
/// directory for data directories: where these tests start.
async fn etcd_and_s3_store() -> (
    EtcdCluster,
    Client,
    S3Server,
    SnapshotStore,
    tempfile::TempDir,
) {
    let etcd = EtcdCluster::single(Release::V35).await;
    let client = etcd.client().await;
    let s3 = S3Server::start(&[BUCKET]);
    let store = s3_store(&s3);
    (etcd, client, s3, store, tempfile::tempdir().unwrap())
}

/// `restore.initialize` of `data` from `store` with `validation`, which must not fail.
async fn initialize_at(
    store: &SnapshotStore,
    data: &Path,
    validation: Validation,
    metrics: &InitializeMetrics,
) -> Initialized {
    initialize_observed(store, &initialize_config(data, validation), metrics)
        .await
        .unwrap()
}

/// A delta of everything etcd wrote after revision `after`, up to now.
async fn delta_after(client: &mut Client, store: &SnapshotStore, after: i64) -> Snapshot {
    let now = dump(client).await.1;
    let mut watch = DeltaWatch::open(client, after + 1).await.unwrap();
    let mut events: Vec<Event> = Vec::new();
    while events.last().map_or(0, Event::revision) < now {
        events.extend(watch.next().await.unwrap());
    }
    let mut writer = DeltaWriter::new(Codec::Gzip, after);
    writer.push(events, chrono::Utc::now());
    writer.flush(store).await.unwrap().unwrap()
}

/// `writes_each` keys, a gzip full snapshot, as many more, and a delta of those.
async fn full_and_delta(
    client: &mut Client,
    store: &SnapshotStore,
    writes_each: usize,
) -> (Snapshot, Snapshot) {
    writes(client, 0, writes_each).await;
    let full = support::stored::gzip_full(client, store).await;
    writes(client, 1, writes_each).await;
    let delta = delta_after(client, store, full.last_revision).await;
    (full, delta)
}

/// Replaces a stored snapshot's payload with itself, a few bytes in the middle flipped.
pub(crate) async fn damage(store: &SnapshotStore, snapshot: &Snapshot) {
    let mut raw: Vec<u8> = Vec::new();
    let mut stream = store.get_stream(snapshot).await.unwrap();
    while let Some(chunk) = stream.next().await {
        raw.extend_from_slice(&chunk.unwrap());
    }
    let mid = raw.len() / 2;
    for b in &mut raw[mid..mid + 8] {
        *b ^= 0xff;
    }
    store.put_bytes(snapshot, Bytes::from(raw)).await.unwrap();
}

/// The directories beside `data` whose names start with its name and `.old-`.
fn moved_aside(data: &Path) -> Vec<PathBuf> {
    let name = format!("{}.old-", data.file_name().unwrap().to_string_lossy());
    std::fs::read_dir(data.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&name))
        .collect()
}

/// How many restores `metrics` counted, successful or not.
fn restorations(metrics: &InitializeMetrics) -> u64 {
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text.lines()
        .filter(|l| l.starts_with("etcdbr_restoration_duration_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn db(data: &Path) -> PathBuf {
    data.join("member/snap/db")
}

/// A truncated database (sanity finds it) and a damaged leaf page (only full finds it) are
/// restored over; the old directory is moved aside byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_or_damaged_database_is_restored_and_moved_aside_intact() {
    let (_etcd, mut client, _s3, store, dir) = etcd_and_s3_store().await;
    // Enough keys for the `key` bucket to span many leaf pages.
    let last = writes(&mut client, 0, 300).await;
    let full = support::stored::gzip_full(&client, &store).await;
    assert_eq!(full.last_revision, last);
    let early = client
        .get("/registry/secrets/p0-0002", None)
        .await
        .unwrap()
        .kvs()[0]
        .mod_revision();
    let original = dump(&mut client).await;
    let metrics = InitializeMetrics::default();

    // Truncated: the meta page counts more pages than the file holds.
    let data = dir.path().join("truncated/data");
    etcd_warden::restore::restore(&store, &restore_options(&data))
        .await
        .unwrap();
    let len = std::fs::metadata(db(&data)).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(db(&data))
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let damaged = std::fs::read(db(&data)).unwrap();
    let done = initialize_at(&store, &data, Validation::Sanity, &metrics).await;
    let Initialized::Restored {
        why,
        revision,
        skipped,
        moved_aside: Some(aside),
    } = done
    else {
        panic!("not restored: {done:?}");
    };
    assert_eq!((why, revision, skipped.len()), (Why::Corrupt, last, 0));
    assert_eq!(std::fs::read(db(&aside)).unwrap(), damaged);
    assert_eq!(moved_aside(&data), vec![aside]);
    assert_eq!(dump_restored(&data).await, original);

    // A leaf page of early revisions, off the path to the last revision, no longer a leaf.
    let data = dir.path().join("flipped/data");
    etcd_warden::restore::restore(&store, &restore_options(&data))
        .await
        .unwrap();
    let mut bytes = std::fs::read(db(&data)).unwrap();
    let needle = revision_key(early, 0, false);
    let pages: Vec<usize> = bytes
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle.as_slice())
        .map(|(at, _)| at / 4096 * 4096)
        .collect();
    assert!(
        !pages.is_empty(),
        "revision {early} not found in the database"
    );
    for page in pages {
        bytes[page + 8] ^= 0x02;
    }
    std::fs::write(db(&data), &bytes).unwrap();
    // Sanity reads the meta pages, the bucket list and the rightmost path only: it keeps this.
    let done = initialize_at(&store, &data, Validation::Sanity, &metrics).await;
    assert_eq!(done, Initialized::Valid);
    assert!(moved_aside(&data).is_empty());
    let done = initialize_at(&store, &data, Validation::Full, &metrics).await;
    let Initialized::Restored {
        why: Why::Corrupt,
        moved_aside: Some(aside),
        ..
    } = done
    else {
        panic!("not restored as corrupt: {done:?}");
    };
    assert_eq!(std::fs::read(db(&aside)).unwrap(), bytes);
    assert_eq!(dump_restored(&data).await, original);
    assert_eq!(restorations(&metrics), 2);
}

/// A directory restored from an older backup is brought forward to the store's latest chain;
/// then, current, it is kept without a snapshot being read (the full snapshot is damaged by then
/// and restorations are not counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_behind_the_store_is_restored_and_a_current_one_kept() {
    let (_etcd, mut client, _s3, store, dir) = etcd_and_s3_store().await;
    let (full, d1) = full_and_delta(&mut client, &store, 50).await;
    let data = dir.path().join("data");
    etcd_warden::restore::restore(&store, &restore_options(&data))
        .await
        .unwrap();
    let old = std::fs::read(db(&data)).unwrap();

    // The store moves on; the directory stays at d1.
    let now = writes(&mut client, 2, 50).await;
    let d2 = delta_after(&mut client, &store, d1.last_revision).await;
    assert_eq!(d2.last_revision, now);
    let original = dump(&mut client).await;
    let metrics = InitializeMetrics::default();
    let cfg = initialize_config(&data, Validation::Full);
    let done = initialize_observed(&store, &cfg, &metrics).await.unwrap();
    let Initialized::Restored {
        why,
        revision,
        moved_aside: Some(aside),
        ..
    } = done
    else {
        panic!("not restored: {done:?}");
    };
    assert_eq!(
        why,
        Why::Behind {
            dir: d1.last_revision,
            store: now
        }
    );
    assert_eq!(revision, now);
    assert_eq!(std::fs::read(db(&aside)).unwrap(), old);
    assert_eq!(dump_restored(&data).await, original);

    // Current now: kept, nothing fetched (a fetch of the damaged full snapshot would fail).
    damage(&store, &full).await;
    let before = std::fs::read(db(&data)).unwrap();
    let done = initialize_observed(&store, &cfg, &metrics).await.unwrap();
    assert_eq!(done, Initialized::Valid);
    assert_eq!(std::fs::read(db(&data)).unwrap(), before);
    assert_eq!(moved_aside(&data).len(), 1);
    assert_eq!(restorations(&metrics), 1);
}

/// `etcd-warden restore` of the test bucket into `target`, as member "default" of etcd 3.5.
fn restore_command(s3: &S3Server, target: &Path) -> std::process::Command {
    let store = format!("s3://{BUCKET}/{PREFIX}");
    support::warden::on_s3_store("restore", s3, &store, "--data-dir", target)
}

/// The latest full snapshot fails verification: `restore` falls back to the previous one and
/// the deltas that continue it (up to the last delta before the skipped snapshot: what was
/// written between that delta and the skipped snapshot is in no delta), says so and exits 3;
/// `--no-fallback` fails naming it and writes nothing; `initialize` falls back too, and does not
/// replace a directory with one no newer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_latest_full_snapshot_falls_back_to_the_previous_one() {
    let (_etcd, mut client, s3, store, dir) = etcd_and_s3_store().await;
    let (f0, d1) = full_and_delta(&mut client, &store, 40).await;
    writes(&mut client, 2, 40).await;
    let d2 = delta_after(&mut client, &store, d1.last_revision).await;
    // Written between the last delta and the next full snapshot: in that snapshot only.
    writes(&mut client, 3, 10).await;
    let f1 = support::stored::gzip_full(&client, &store).await;
    writes(&mut client, 4, 40).await;
    let d3 = delta_after(&mut client, &store, f1.last_revision).await;
    damage(&store, &f1).await;
    let reached = d2.last_revision;
    let expected = dump_as_of(&mut client, Some(reached)).await;

    // --no-fallback: an error naming the snapshot, nothing written.
    let refused = dir.path().join("refused");
    let out = restore_command(&s3, &refused)
        .arg("--no-fallback")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&f1.snap_name) && stderr.contains("fails verification"),
        "{stderr}"
    );
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert!(left.is_empty(), "written: {left:?}");

    // The default: the previous full snapshot and its deltas, up to d2; exit status 3, so a
    // script sees the older state.
    let target = dir.path().join("data");
    let out = restore_command(&s3, &target).output().unwrap();
    let stdout = support::cli::fell_back_past(&out, &f1.snap_name);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains(&format!("from {} and 2 deltas", f0.snap_name))
            && stdout.contains(&format!(
                "reached revision {reached} of the store's {}",
                d3.last_revision
            )),
        "{stdout}"
    );
    assert!(
        stderr.contains("falling back to the previous full snapshot"),
        "{stderr}"
    );
    assert_eq!(dump_restored(&target).await, expected);

    // initialize: a directory no newer than what the fallback reaches is kept, not replaced.
    let metrics = InitializeMetrics::default();
    let before = std::fs::read(db(&target)).unwrap();
    let done = initialize_at(&store, &target, Validation::Sanity, &metrics).await;
    assert_eq!(done, Initialized::Valid);
    assert_eq!(std::fs::read(db(&target)).unwrap(), before);
    assert!(moved_aside(&target).is_empty());
    // A missing directory is restored the same way, the skipped snapshot reported.
    let fresh = dir.path().join("fresh");
    let done = initialize_at(&store, &fresh, Validation::Sanity, &metrics).await;
    assert_eq!(
        done,
        Initialized::Restored {
            why: Why::Missing,
            revision: reached,
            skipped: vec![f1.snap_name.clone()],
            moved_aside: None,
        }
    );
    assert_eq!(dump_restored(&fresh).await, expected);
}

/// `n` writes, a full snapshot of them, and a data directory restored from it (under `dir`).
async fn restored_full(
    client: &mut Client,
    store: &SnapshotStore,
    dir: &Path,
    n: usize,
) -> (Snapshot, PathBuf) {
    writes(client, 0, n).await;
    let full = take_full(client, store, Codec::Gzip, false).await.unwrap();
    let data = dir.join("data");
    etcd_warden::restore::restore(store, &restore_options(&data))
        .await
        .unwrap();
    (full, data)
}

/// etcd 3.5 started on `data` (a temporary member, stopped by the caller).
async fn run_on(data: &Path, log: PathBuf) -> etcd_warden::restore::TempEtcd {
    support::etcd::temp_etcd(Release::V35, data, "default", log)
        .await
        .unwrap()
}

/// A member that crashed before its database's periodic commit: the database is behind the
/// store, but its WAL holds the writes (and more) that etcd applies on start. Kept: a restore
/// would have dropped writes the store does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_lagging_its_own_wal_is_kept_though_the_store_is_ahead() {
    let (_etcd, mut client, _s3, store, dir) = etcd_and_s3_store().await;
    let (full, data) = restored_full(&mut client, &store, dir.path(), 30).await;
    let start = || run_on(&data, dir.path().join("m.log"));
    // The database as committed before the last writes...
    start().await.stop().await.unwrap();
    let committed = std::fs::read(db(&data)).unwrap();
    // ...then writes the WAL records and the database commits, and the database goes back:
    // the shape a crash between the WAL's fsync and the database's commit leaves.
    let member = start().await;
    let mut m = Client::connect([&member.client_url], None).await.unwrap();
    for i in 0..40 {
        m.put(format!("/registry/after-crash/{i:03}"), "v", None)
            .await
            .unwrap();
    }
    let wal_head = dump(&mut m).await;
    member.stop().await.unwrap();
    std::fs::write(db(&data), &committed).unwrap();
    let found = etcd_warden::restore::datadir::check(&data, Validation::Full);
    assert!(
        matches!(found, etcd_warden::restore::datadir::DataDir::Valid { revision, wal_ahead } if revision == full.last_revision && wal_ahead >= 40),
        "{found:?}"
    );

    // The store moves past the database's revision.
    writes(&mut client, 1, 10).await;
    let ahead = delta_after(&mut client, &store, full.last_revision).await;
    assert!(ahead.last_revision > full.last_revision);
    let metrics = InitializeMetrics::default();
    let done = initialize_at(&store, &data, Validation::Full, &metrics).await;
    assert_eq!(done, Initialized::Valid);
    assert!(moved_aside(&data).is_empty());
    assert_eq!(restorations(&metrics), 0);
    // etcd applies its WAL: every write of it is back.
    let member = start().await;
    let mut m = Client::connect([&member.client_url], None).await.unwrap();
    assert_eq!(dump(&mut m).await, wal_head);
    member.stop().await.unwrap();
}

/// This sidecar restarted alone while etcd runs on the directory: however far behind the store
/// the directory is, nothing is checked or moved under the running etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_etcd_runs_on_is_left_alone() {
    let (_etcd, mut client, _s3, store, dir) = etcd_and_s3_store().await;
    let (full, data) = restored_full(&mut client, &store, dir.path(), 20).await;
    // The store moves far past the directory (more revisions than the WAL could hold).
    writes(&mut client, 1, 200).await;
    delta_after(&mut client, &store, full.last_revision).await;
    let running = run_on(&data, dir.path().join("m.log")).await;
    let metrics = InitializeMetrics::default();
    let cfg = initialize_config(&data, Validation::Full);
    let done = initialize_observed(&store, &cfg, &metrics).await.unwrap();
    assert_eq!(done, Initialized::Valid);
    assert!(moved_aside(&data).is_empty());
    assert_eq!(restorations(&metrics), 0);
    // The running etcd still serves the directory it opened.
    let mut m = Client::connect([&running.client_url], None).await.unwrap();
    m.put("/still/here", "yes", None).await.unwrap();
    running.stop().await.unwrap();

    // Stopped, the same directory is behind the store and restored (moved aside).
    let done = initialize_observed(&store, &cfg, &metrics).await.unwrap();
    assert!(matches!(done, Initialized::Restored { .. }), "{done:?}");
    assert_eq!(moved_aside(&data).len(), 1);
}
