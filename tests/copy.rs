//! The copy job against real stores: two buckets of a real S3 server (s3s-fs), one bucket under
//! two prefixes (server-side copy), and file:// directories; plus the `copy` subcommand.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use chrono::{TimeZone, Utc};
use etcd_warden::config::{Config, CopyConfig, Override, Sources};
use etcd_warden::copy::{self, CopyError, Stores};
use etcd_warden::owner::handoff;
use etcd_warden::snapshot::verify::verify;
use etcd_warden::store::compression::collect;
use etcd_warden::store::{Codec, Kind, Snapshot, SnapshotStore};
use support::cli::span;
use support::s3::S3Server;
use support::stored::{db_payload, put_delta, put_full};

const SRC: &str = "source-bkt";
const DST: &str = "dest-bkt";

/// F(10) d(11-12) F(20) d(21-22) F(30, final when asked) d(31-32), an hour apart, ending now.
async fn history(store: &SnapshotStore, final_last: bool) -> Vec<Snapshot> {
    let now = Utc::now().timestamp();
    let h = |n: i64| now - (5 - n) * 3600;
    vec![
        put_full(store, 10, h(0), 200_000, Codec::Gzip, false).await,
        put_delta(store, 11, 12, h(1)).await,
        put_full(store, 20, h(2), 300_000, Codec::Zlib, false).await,
        put_delta(store, 21, 22, h(3)).await,
        put_full(store, 30, h(4), 400_000, Codec::Gzip, final_last).await,
        put_delta(store, 31, 32, h(5)).await,
    ]
}

fn load(keys: Vec<(String, String)>) -> Config {
    let env: HashMap<String, String> = HashMap::new();
    let overrides = keys
        .iter()
        .map(|(k, v)| Override::flag(k, v, "test"))
        .collect();
    Config::load(&Sources {
        file: None,
        env: &env,
        overrides,
    })
    .expect("valid configuration")
    .0
}

/// The stores of a configuration with these keys (`[source_store]` to `[store]`).
pub(crate) fn stores_from(keys: Vec<(String, String)>) -> Stores {
    let c = load(keys);
    Stores::from_config(c.source_store.as_ref().unwrap(), &c.store).unwrap()
}

fn s3_stores(s3: &S3Server, src: (&str, &str), dst: (&str, &str)) -> Stores {
    let mut keys = s3.config_overrides("source_store", src.0, src.1);
    keys.extend(s3.config_overrides("store", dst.0, dst.1));
    stores_from(keys)
}

/// Stores in two directories of `dir` (`src` to `dst`), and their URLs.
fn file_stores(dir: &tempfile::TempDir) -> (Stores, [String; 2]) {
    let urls = ["src", "dst"].map(|sub| format!("file://{}", dir.path().join(sub).display()));
    let keys = vec![
        ("source_store.url".into(), urls[0].clone()),
        ("store.url".into(), urls[1].clone()),
    ];
    (stores_from(keys), urls)
}

pub(crate) fn options() -> CopyConfig {
    CopyConfig {
        wait_for_final: false,
        druid_final: false,
        final_timeout: Duration::from_secs(30),
        poll_interval: Duration::from_millis(100),
        max_backups: 0,
        max_age: None,
        parallel: 4,
    }
}

/// Destination names; every one verifies.
async fn verified_names(store: &SnapshotStore) -> Vec<String> {
    let mut names = Vec::new();
    for s in store.list().await.unwrap() {
        verify(store, &s)
            .await
            .unwrap_or_else(|e| panic!("copied snapshot does not verify: {e}"));
        names.push(s.snap_name);
    }
    names
}

fn dest_names(source: &[Snapshot]) -> Vec<String> {
    source
        .iter()
        .map(|s| s.snap_name.trim_end_matches(".final").to_string())
        .collect()
}

/// A final full snapshot up to `revision` in `store`, taken `seconds_later` than now.
async fn put_final(store: &SnapshotStore, revision: i64, seconds_later: i64) -> Snapshot {
    put_full(
        store,
        revision,
        Utc::now().timestamp() + seconds_later,
        100_000,
        Codec::Gzip,
        true,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_to_bucket_copies_verified_without_final_and_a_rerun_uploads_nothing() {
    let s3 = S3Server::start(&[SRC, DST]);
    let stores = s3_stores(&s3, (SRC, "shoot/old"), (DST, "shoot/new"));
    assert!(!stores.server_side);
    let src = history(&stores.source, true).await;

    let report = copy::run(&stores, &options()).await.unwrap();
    assert_eq!((report.selected, report.copied, report.skipped), (6, 6, 0));
    let copied = verified_names(&stores.dest).await;
    assert_eq!(copied, dest_names(&src));
    assert!(copied.iter().all(|n| !n.ends_with(".final")), "{copied:?}");
    // The destination's sidecar must not see a final snapshot of its own.
    let chain = stores.dest.latest_chain().await.unwrap();
    assert!(!chain.full_snapshot.unwrap().is_final);
    // The source keeps its final marker.
    assert!(stores.source.list().await.unwrap()[4].is_final);

    // Overwrite one destination object with same-size bytes: a re-run that uploaded anything
    // would restore it.
    let victim = stores.dest.list().await.unwrap()[0].clone();
    let size = collect(stores.dest.get_stream(&victim).await.unwrap())
        .await
        .unwrap()
        .len();
    let marker = Bytes::from(vec![b'x'; size]);
    stores
        .dest
        .put_bytes(&victim, marker.clone())
        .await
        .unwrap();
    let report = copy::run(&stores, &options()).await.unwrap();
    assert_eq!((report.copied, report.skipped, report.bytes), (0, 6, 0));
    let after = collect(stores.dest.get_stream(&victim).await.unwrap())
        .await
        .unwrap();
    assert_eq!(
        after,
        marker.to_vec(),
        "the re-run uploaded an existing object"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_object_fails_the_job_by_name_and_leaves_nothing_at_the_destination() {
    let s3 = S3Server::start(&[SRC, DST]);
    let stores = s3_stores(&s3, (SRC, "old"), (DST, "new"));
    let good = put_full(
        &stores.source,
        10,
        1_700_000_000,
        100_000,
        Codec::Gzip,
        false,
    )
    .await;
    // Uncompressed and 12 MiB, so the upload has sent most of it before the hash check fails at
    // the end: the single PUT must stay short of its length, the multipart upload be aborted.
    let bad = Snapshot::new(
        stores.source.prefix(),
        Kind::Full,
        0,
        20,
        Utc.timestamp_opt(1_700_000_100, 0).unwrap(),
        Codec::None,
        true,
    );
    let mut raw = db_payload(12 << 20, 3);
    raw[11 << 20] ^= 0x40;
    stores
        .source
        .put_bytes(&bad, Bytes::from(raw))
        .await
        .unwrap();

    // Both upload paths: one streamed PUT (the default for objects of known size on S3) and a
    // multipart upload (objects over the single-PUT limit).
    let multipart = s3_stores(&s3, (SRC, "old"), (DST, "multipart"));
    let multipart = Stores {
        dest: multipart.dest.clone().with_single_put(None),
        ..multipart
    };
    for stores in [&stores, &multipart] {
        let e = copy::run(stores, &options()).await.unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, CopyError::Incomplete { total: 2, .. }), "{e:?}");
        assert!(msg.contains(&bad.snap_name), "{msg}");
        assert!(msg.contains("SHA-256"), "{msg}");
        assert!(
            msg.starts_with("1 of 2 selected snapshots not copied"),
            "{msg}"
        );
        // Only the good one arrived.
        assert_eq!(
            verified_names(&stores.dest).await,
            dest_names(std::slice::from_ref(&good))
        );
    }
    // Nothing else is in the destination bucket: one object under each prefix.
    let bucket = s3.root.path().join(DST);
    let files: Vec<_> = walk(&bucket);
    assert_eq!(files.len(), 2, "{files:?}");
    // s3s-fs keeps parts of open multipart uploads at its root until completed or aborted.
    let parts: Vec<_> = std::fs::read_dir(s3.root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".upload"))
        .collect();
    assert!(parts.is_empty(), "multipart upload not aborted: {parts:?}");

    // Same through the binary: exit 1 with one line naming the object.
    let out = support::warden::command()
        .args(["copy", "--source-store", &format!("s3://{SRC}/old")])
        .args([
            "--dest-store",
            &format!("s3://{DST}/new"),
            "--parallel",
            "2",
        ])
        .envs(s3_env(&s3))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap();
    assert!(
        last.starts_with("etcd-warden: copy failed") && last.contains(&bad.snap_name),
        "{last}"
    );
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

/// Environment for the binary: both stores on the test server, the source through the
/// `[source_store]` variables.
fn s3_env(s3: &S3Server) -> Vec<(String, String)> {
    let mut env = s3.env("store");
    env.extend(s3.env("source_store"));
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_copies_between_buckets_and_reports_a_rerun() {
    let s3 = S3Server::start(&[SRC, DST]);
    let stores = s3_stores(&s3, (SRC, "a"), (DST, "b"));
    let src = history(&stores.source, false).await;
    let run = || {
        support::warden::command()
            .args(["copy", "--source-store", &format!("s3://{SRC}/a")])
            .args(["--dest-store", &format!("s3://{DST}/b")])
            .args(["--max-backups", "2", "--parallel", "3"])
            .envs(s3_env(&s3))
            .output()
            .unwrap()
    };
    let out = run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("copied 4 snapshots, 0 already there"),
        "{stderr}"
    );
    assert_eq!(verified_names(&stores.dest).await, dest_names(&src[2..]));
    let out = run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("copied 0 snapshots, 4 already there"),
        "{stderr}"
    );

    // Without a source: bad configuration.
    let out = support::warden::command()
        .args(["copy", "--dest-store", &format!("s3://{DST}/b")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("source_store.url"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_a_final_snapshot_that_appears_then_copies_it() {
    let s3 = S3Server::start(&[SRC, DST]);
    let stores = s3_stores(&s3, (SRC, "old"), (DST, "new"));
    let mut src = history(&stores.source, false).await;
    let opts = CopyConfig {
        wait_for_final: true,
        ..options()
    };
    let job = {
        let stores = stores.clone();
        tokio::spawn(async move { copy::run(&stores, &opts).await })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!job.is_finished(), "the job did not wait");
    assert!(
        stores.dest.list().await.unwrap().is_empty(),
        "copied before the final snapshot"
    );
    let fin = put_final(&stores.source, 40, 0).await;
    let report = tokio::time::timeout(Duration::from_secs(20), job)
        .await
        .expect("the job ends once the final snapshot is there")
        .unwrap()
        .unwrap();
    assert_eq!(
        report.final_snapshot.as_deref(),
        Some(fin.snap_name.as_str())
    );
    src.push(fin);
    assert_eq!(verified_names(&stores.dest).await, dest_names(&src));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_final_snapshot_the_wait_times_out_and_copies_the_latest() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, _) = file_stores(&dir);
    let src = history(&stores.source, false).await;
    let opts = CopyConfig {
        wait_for_final: true,
        final_timeout: Duration::from_millis(400),
        max_backups: 1,
        ..options()
    };
    let started = std::time::Instant::now();
    let report = copy::run(&stores, &opts).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert!(report.final_snapshot.is_none());
    assert_eq!(verified_names(&stores.dest).await, dest_names(&src[4..]));
}

fn hand_off_record(of: &Snapshot) -> handoff::HandOffRecord {
    handoff::HandOffRecord {
        final_snapshot: of.snap_name.clone(),
        revision: of.last_revision,
        members: vec!["m1".into()],
        owner_id: "seed-a".into(),
        recorded_at: Utc::now(),
    }
}

fn fence_marker() -> handoff::FenceMarker {
    handoff::FenceMarker {
        member_id: "1".into(),
        owner_id: "seed-a".into(),
        reason: "owned by seed-b".into(),
        killed: vec![],
        fenced_at: Utc::now(),
    }
}

/// The copy Job's wait over a source of these stores, with `timeout`: what it found, how long.
async fn wait(stores: &Stores, timeout: Duration) -> (Option<Snapshot>, Duration) {
    wait_as(stores, timeout, false).await
}

/// [`wait`], with etcd-druid's requested final ending it or not (`copy.druid_final`).
async fn wait_as(
    stores: &Stores,
    timeout: Duration,
    druid_final: bool,
) -> (Option<Snapshot>, Duration) {
    let started = std::time::Instant::now();
    let wait = copy::Wait {
        timeout,
        poll: Duration::from_millis(100),
        druid_final,
    };
    let found = copy::wait_for_final(&stores.source, wait).await;
    (found, started.elapsed())
}

/// etcd-druid's requested final (named `.final`, marked before its upload) never ends the copy
/// Job's wait for a hand-off's final: that source was never fenced. etcdbrctl's copy
/// (`copy.druid_final`, etcd-backup-restore's "one of the newest four full snapshots is
/// final") ends at it, deltas after it or not, and no longer once four newer full snapshots
/// stand before it. The same `.final` name in a store of etcd-backup-restore's own (no marker)
/// ends both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn druids_requested_final_ends_only_etcdbrctls_wait() {
    let s3 = S3Server::start(&[SRC, DST]);
    let stores = s3_stores(&s3, (SRC, "old"), (DST, "new"));
    history(&stores.source, false).await;
    let fin = put_final(&stores.source, 40, 0).await;
    etcd_warden::store::gc::mark_requested_final(&stores.source, &fin)
        .await
        .unwrap();
    let (found, waited) = wait(&stores, Duration::from_millis(600)).await;
    assert_eq!(found, None, "druid's final stood in for a hand-off's");
    assert!(waited >= Duration::from_millis(600), "{waited:?}");
    let (found, _) = wait_as(&stores, Duration::from_secs(5), true).await;
    assert_eq!(found.map(|s| s.snap_name), Some(fin.snap_name.clone()));
    // A delta after it (the source took writes since), as etcd-backup-restore counts it.
    put_delta(&stores.source, 41, 45, Utc::now().timestamp() + 1).await;
    let (found, _) = wait_as(&stores, Duration::from_secs(5), true).await;
    assert_eq!(found.map(|s| s.snap_name), Some(fin.snap_name.clone()));
    // Four newer full snapshots: an earlier request's, not this wait's.
    for i in 0..4 {
        put_full(
            &stores.source,
            50 + i,
            Utc::now().timestamp() + 2 + i,
            1000,
            Codec::Gzip,
            false,
        )
        .await;
    }
    let (found, _) = wait_as(&stores, Duration::from_millis(600), true).await;
    assert_eq!(
        found, None,
        "a requested final behind four newer full snapshots ended the wait"
    );

    // etcd-backup-restore's store: its newest `.final` is the final for both readers.
    let ebr = s3_stores(&s3, (SRC, "ebr"), (DST, "ebr-dst"));
    history(&ebr.source, false).await;
    let theirs = put_final(&ebr.source, 40, 0).await;
    for druid_final in [false, true] {
        let (found, _) = wait_as(&ebr, Duration::from_secs(5), druid_final).await;
        assert_eq!(found.map(|s| s.snap_name), Some(theirs.snap_name.clone()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reclaim_the_wait_times_out_instead_of_taking_the_stale_final() {
    let s3 = S3Server::start(&[SRC, DST]);
    let stores = s3_stores(&s3, (SRC, "old"), (DST, "new"));
    let mut src = history(&stores.source, false).await;
    let fin = put_final(&stores.source, 40, 0).await;
    src.push(fin.clone());
    let objects = handoff::HandOffObjects::new(stores.source.clone());
    objects.write_fence(1, &fence_marker()).await.unwrap();
    objects.write_record(&hand_off_record(&fin)).await.unwrap();
    // The hand-off as recorded: its final counts.
    let (found, _) = wait(&stores, Duration::from_secs(5)).await;
    assert_eq!(found.map(|s| s.snap_name), Some(fin.snap_name.clone()));

    // Undone: the final stays the newest snapshot, marked reclaimed, without record or markers.
    let done = handoff::reclaim(&objects).await.unwrap();
    assert_eq!(done.finals_reclaimed, vec![fin.snap_name.clone()]);
    let newest = stores
        .source
        .list()
        .await
        .unwrap()
        .pop()
        .map(|s| s.snap_name);
    assert_eq!(newest, Some(fin.snap_name.clone()));
    let (found, waited) = wait(&stores, Duration::from_millis(600)).await;
    assert_eq!(found, None, "the reclaimed final stood in for a hand-off");
    assert!(waited >= Duration::from_millis(600), "{waited:?}");

    // A final taken by hand afterwards (`etcd-warden snapshot --final`) does not count either:
    // this store's hand-offs end with a record.
    let by_hand = put_final(&stores.source, 50, 1).await;
    src.push(by_hand.clone());
    let (found, _) = wait(&stores, Duration::from_millis(400)).await;
    assert_eq!(
        found, None,
        "a final without a record stood in for a hand-off"
    );

    // The Job then copies what is there and says no final was found.
    let opts = CopyConfig {
        wait_for_final: true,
        final_timeout: Duration::from_millis(400),
        ..options()
    };
    let report = copy::run(&stores, &opts).await.unwrap();
    assert_eq!(report.final_snapshot, None);
    assert_eq!(verified_names(&stores.dest).await, dest_names(&src));

    // The next hand-off's recorded final counts again.
    objects
        .write_record(&hand_off_record(&by_hand))
        .await
        .unwrap();
    let (found, _) = wait(&stores, Duration::from_secs(5)).await;
    assert_eq!(found.map(|s| s.snap_name), Some(by_hand.snap_name));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_tool_store_keeps_the_newest_final_rule() {
    // No etcd-warden/ object at all: the newest snapshot, a final full one, is the final.
    let s3 = S3Server::start(&[SRC, DST]);
    let stores = s3_stores(&s3, (SRC, "old"), (DST, "new"));
    history(&stores.source, false).await;
    let fin = put_final(&stores.source, 40, 0).await;
    let (found, _) = wait(&stores, Duration::from_secs(5)).await;
    assert_eq!(found.map(|s| s.snap_name), Some(fin.snap_name));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_log_shows_a_copy_object_span_per_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, [src_url, dst_url]) = file_stores(&dir);
    let src = history(&stores.source, false).await;
    let out = support::cli::succeeds(
        support::warden::command()
            .args(["copy", "--source-store", &src_url, "--dest-store", &dst_url])
            .args(["--log-format", "json"]),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines = support::cli::json_lines(&stderr);
    let copied = verified_names(&stores.dest).await;
    assert_eq!(copied, dest_names(&src));
    for s in &src {
        let of_object = |l: &&serde_json::Value| {
            span(l, "copy_object").is_some_and(|o| o["snapshot"] == s.snap_name)
        };
        let line = lines
            .iter()
            .find(of_object)
            .unwrap_or_else(|| panic!("no copy_object span for {}:\n{stderr}", s.snap_name));
        let object = span(line, "copy_object").unwrap();
        assert_eq!(object["kind"], s.kind.as_str(), "{object}");
        assert_eq!(object["revision"], s.last_revision, "{object}");
        assert!(object["size"].as_u64().is_some_and(|n| n > 0), "{object}");
        // The event inside says what happened; the span says to which snapshot.
        assert!(line["snapshot"].is_null(), "{line}");
        assert!(span(line, "copy").is_some(), "{line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selection_by_count_age_and_the_final_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let source = SnapshotStore::new(
        std::sync::Arc::new(
            object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap(),
        ),
        "src",
    );
    let mut src = history(&source, false).await;
    // An old final snapshot between F10 and F20's chain is not "latest"; mark F20 final by
    // renaming (the store is a directory).
    let f20 = src[2].clone();
    let f20_final = Snapshot::new(
        source.prefix(),
        Kind::Full,
        0,
        20,
        f20.created_on,
        f20.compression,
        true,
    );
    std::fs::rename(
        dir.path().join(source.path_of(&f20).as_ref()),
        dir.path().join(source.path_of(&f20_final).as_ref()),
    )
    .unwrap();
    src[2] = f20_final;

    let cases: [(u64, Option<u64>, &[usize]); 4] = [
        (0, None, &[0, 1, 2, 3, 4, 5]),
        // Newest full only, plus the final F20 and its delta.
        (1, None, &[2, 3, 4, 5]),
        // Younger than 1.5 h: d31-32 needs F30; F20 (final) and d21-22 always.
        (0, Some(5400), &[2, 3, 4, 5]),
        (0, Some(12 * 3600), &[0, 1, 2, 3, 4, 5]),
    ];
    for (i, (max_backups, max_age, want)) in cases.into_iter().enumerate() {
        let dest = SnapshotStore::new(source.backend().clone(), &format!("dst{i}"));
        let stores = Stores {
            source: source.clone(),
            dest: dest.clone(),
            server_side: false,
        };
        let opts = CopyConfig {
            max_backups,
            max_age: max_age.map(Duration::from_secs),
            ..options()
        };
        copy::run(&stores, &opts).await.unwrap();
        let want: Vec<Snapshot> = want.iter().map(|&j| src[j].clone()).collect();
        assert_eq!(
            verified_names(&dest).await,
            dest_names(&want),
            "max_backups {max_backups}, max_age {max_age:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bucket_two_prefixes_copies_server_side_and_still_verifies() {
    let s3 = S3Server::start(&["one-bkt"]);
    let stores = s3_stores(&s3, ("one-bkt", "cluster/old"), ("one-bkt", "cluster/new"));
    assert!(stores.server_side);
    let src = history(&stores.source, true).await;
    let report = copy::run(&stores, &options()).await.unwrap();
    assert_eq!(report.copied, 6);
    assert_eq!(verified_names(&stores.dest).await, dest_names(&src));

    let bad = Snapshot::new(
        stores.source.prefix(),
        Kind::Full,
        0,
        50,
        Utc::now(),
        Codec::None,
        false,
    );
    let mut raw = db_payload(10_000, 1);
    raw[0] ^= 1;
    stores
        .source
        .put_bytes(&bad, Bytes::from(raw))
        .await
        .unwrap();
    let e = copy::run(&stores, &options())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains(&bad.snap_name), "{e}");
    assert_eq!(stores.dest.list().await.unwrap().len(), 6);
}

#[test]
fn source_store_variables_reach_their_own_section() {
    let env: HashMap<String, String> = [
        ("ETCD_WARDEN_SOURCE_STORE_URL", "s3://old/p"),
        ("ETCD_WARDEN_STORE_URL", "s3://new/p"),
        ("ETCD_WARDEN_COPY_MAX_AGE", "7d"),
        ("ETCD_WARDEN_COPY_PARALLEL", "3"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let (c, raw) = Config::load(&Sources {
        file: None,
        env: &env,
        overrides: vec![],
    })
    .unwrap();
    assert_eq!(c.source_store.unwrap().location.to_string(), "s3://old/p");
    assert_eq!(c.store.location.to_string(), "s3://new/p");
    assert_eq!(c.copy.max_age, Some(Duration::from_secs(7 * 86400)));
    assert_eq!(c.copy.parallel, 3);
    assert!(raw.to_redacted_toml().contains("[source_store]"));
    // Without the section there is no source, and the defaults copy everything.
    let (c, _) = Config::load(&Sources {
        file: None,
        env: &HashMap::<String, String>::new(),
        overrides: vec![],
    })
    .unwrap();
    assert!(c.source_store.is_none());
    assert_eq!((c.copy.max_backups, c.copy.max_age), (0, None));
}

fn copy_command(urls: &[String; 2]) -> std::process::Command {
    let mut c = support::warden::command();
    c.args(["copy", "--source-store", &urls[0], "--dest-store", &urls[1]]);
    c
}

/// A delta lost after the newest full snapshot: the copy still copies every selected snapshot
/// (the destination loses nothing the source has), then fails naming the gap, so the Job never
/// reports a destination whose restore would fail as done. A rerun copies nothing and fails the
/// same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_with_a_revision_gap_is_copied_whole_and_fails_naming_the_gap() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, urls) = file_stores(&dir);
    let now = Utc::now().timestamp();
    let source = vec![
        put_full(&stores.source, 30, now - 300, 10_000, Codec::Gzip, false).await,
        put_delta(&stores.source, 31, 32, now - 200).await,
        put_delta(&stores.source, 35, 40, now - 100).await,
    ];
    let e = copy::run(&stores, &options()).await.unwrap_err();
    match &e {
        CopyError::Unrestorable {
            copied: 3,
            skipped: 0,
            gap,
        } => {
            assert_eq!((gap.first, gap.last), (33, 34), "{e}");
            assert_eq!(
                (&gap.after, &gap.delta),
                (&source[1].snap_name, &source[2].snap_name)
            );
        }
        other => panic!("{other}"),
    }
    assert_eq!(verified_names(&stores.dest).await, dest_names(&source));

    let out = copy_command(&urls).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.trim().lines().last().unwrap();
    assert!(
        last.starts_with(
            "etcd-warden: copy failed: every selected snapshot is at the destination (0 copied \
             now, 3 already there), but the destination cannot be restored: revision gap in the \
             latest chain: revisions 33 to 34 are in no snapshot"
        ),
        "{stderr}"
    );
}

/// Objects in the source whose names are not snapshot names: the copy warns naming each (they
/// are not copied) and succeeds with the snapshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_that_are_not_snapshots_are_named_and_not_copied() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, urls) = file_stores(&dir);
    let source = history(&stores.source, false).await;
    let bad = ["Full-00000000-0000001x-1700000000.gz", "Full-xyz"];
    for name in bad {
        std::fs::write(dir.path().join("src/v2").join(name), b"x").unwrap();
    }
    let out = support::cli::succeeds(&mut copy_command(&urls));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "not copied: 2 object(s) in the source whose names are not snapshot names: {}",
            bad.join(", ")
        )),
        "{stderr}"
    );
    assert!(
        stderr.lines().any(|l| l.contains("WARN")
            && bad.iter().all(|b| l.contains(b))
            && l.contains("not copied")),
        "{stderr}"
    );
    assert_eq!(verified_names(&stores.dest).await, dest_names(&source));
    for name in bad {
        assert!(!dir.path().join("dst/v2").join(name).exists(), "{name}");
    }
}
