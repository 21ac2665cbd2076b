//! Restore drills against real etcd: `verify --restore` restores the newest chain, checks the
//! restored etcd key by key against the chain and records the outcome in the store; a corrupt
//! full snapshot fails the drill (no fallback) and is counted; a sidecar on the store shows the
//! record as metrics.

use crate::restore::{build_store, dump, source};
use crate::restore_datadir::damage;
use crate::support;

use std::path::Path;
use std::time::Duration;

use etcd_warden::restore::drill::{self, DrillRecord};
use support::etcd::Release;

/// `verify --restore` of the file store at `store_dir` with etcd 3.5's tools, scratch in `work`.
fn drill_command(store_dir: &Path, work: &Path) -> std::process::Command {
    let mut c = support::warden::command();
    c.args(["verify", "--restore", "--store"])
        .arg(format!("file://{}", store_dir.display()))
        .arg("--work-dir")
        .arg(work)
        .arg("--etcd-bin")
        .arg(Release::V35.bin_dir());
    c
}

fn run(c: &mut std::process::Command) -> (Option<i32>, String) {
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// A drill passes on a good store, naming the revision and the key count etcd served (the
/// source's), and leaves nothing in its scratch directory; with the newest full snapshot
/// corrupted it fails rather than fall back, and the record keeps the last success, counts the
/// failure and says why. A sidecar on the store shows both as metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drill_checks_the_restored_etcd_and_records_its_outcome() {
    let mut src = source(Release::V35).await;
    let (client, store, dir) = (&mut src.client, &src.store, &src.dir);
    let store_dir = dir.path().join("store");
    let last = build_store(client, store, 2).await;
    let source = dump(client).await;
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();

    let (code, out) = run(&mut drill_command(&store_dir, &work));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!(
            "etcd serves revision {last}, {} keys, sha256 ",
            source.0.len()
        )),
        "{out}"
    );
    assert_eq!(
        std::fs::read_dir(&work).unwrap().count(),
        0,
        "the scratch directory is removed"
    );
    let passed = drill::read_record(store).await.unwrap();
    let report = passed.last_report.clone().expect("a report");
    assert_eq!(
        (report.revision, report.keys),
        (last, source.0.len() as u64)
    );
    assert_eq!(passed.consecutive_failures, 0);
    assert!(passed.last_success.is_some());

    // The newest full snapshot's payload damaged in the store.
    let full = store.latest_chain().await.unwrap().full_snapshot.unwrap();
    damage(store, &full).await;
    let (code, out) = run(&mut drill_command(&store_dir, &work));
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("FAIL  restore drill: the restore failed"),
        "{out}"
    );
    let failed: DrillRecord = drill::read_record(store).await.unwrap();
    assert_eq!(failed.last_success, passed.last_success);
    assert_eq!((failed.consecutive_failures, failed.failures_total), (1, 1));
    assert!(
        failed
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains(&full.snap_name)),
        "{failed:?}"
    );

    let w = support::warden::Warden::start(&[
        ("store.url", format!("file://{}", store_dir.display())),
        ("etcd.endpoints", src._etcd.endpoints()[0].clone()),
    ]);
    w.wait_up().await;
    let success = passed.last_success.unwrap().timestamp_millis() as f64 / 1e3;
    let shown = support::eventually(Duration::from_secs(20), || async {
        let Some((_, m)) = w.get("/metrics").await else {
            return false;
        };
        let m = m.as_str().unwrap_or_default().to_string();
        let shown_success = m
            .lines()
            .find_map(|l| {
                l.strip_prefix("etcd_warden_restore_drill_last_success_timestamp_seconds ")
            })
            .and_then(|v| v.parse::<f64>().ok());
        shown_success.is_some_and(|v| (v - success).abs() < 1e-3)
            && m.contains("etcd_warden_restore_drill_consecutive_failures 1")
    })
    .await;
    assert!(
        shown,
        "the drill record is not in /metrics\n{}",
        w.log_text()
    );
}

/// Values of a megabyte and more, as kube-apiserver stores (objects up to 1.5 MiB): a delta watch
/// catching up over six of them gets them in one message of about 7 MiB, and the drill reads them
/// back a page at a time. Both went beyond gRPC's default limit of 4 MiB: the watch failed on
/// the same batch at every retry (deltas stopped for good; the robustness harness found it) and
/// the drill failed on a good store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_of_a_megabyte_pass_through_deltas_and_the_drill() {
    use etcd_warden::snapshot::delta::{DeltaWriter, Event};
    use etcd_warden::snapshot::take_full;
    use etcd_warden::snapshot::watcher::DeltaWatch;
    use etcd_warden::store::Codec;

    let mut src = source(Release::V35).await;
    let (client, store, dir) = (&mut src.client, &src.store, &src.dir);
    let store_dir = dir.path().join("store");
    let full = take_full(client, store, Codec::Gzip, false).await.unwrap();
    let mut last = 0;
    for i in 0..6u8 {
        let r = client
            .put(
                format!("/registry/configmaps/big-{i}"),
                vec![b'a' + i; 1_200_000],
                None,
            )
            .await
            .unwrap();
        last = r.header().unwrap().revision();
    }
    let mut watch = DeltaWatch::open(client, full.last_revision + 1)
        .await
        .unwrap();
    let mut events: Vec<Event> = Vec::new();
    while events.last().map_or(0, Event::revision) < last {
        events.extend(watch.next().await.expect("the catch-up batch of 7 MiB"));
    }
    assert_eq!(events.len(), 6);
    let mut writer = DeltaWriter::new(Codec::Gzip, full.last_revision);
    writer.push(events, chrono::Utc::now());
    writer.flush(store).await.unwrap().unwrap();

    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let (code, out) = run(&mut drill_command(&store_dir, &work));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!("etcd serves revision {last}, 6 keys")),
        "{out}"
    );
}

/// etcd's snapshot stream can hold a revision after the one a full snapshot is named by (a
/// lease that expires between the revision read and the stream, as kube-apiserver's do), so a
/// final's database may reach past its name. The drill checks the chain the restore used, by
/// name; it took the chain by the restored revision, found no snapshot reaching it and failed a
/// good store (`revision 2968 is after the newest snapshot …-00002965….gz.final`, found by the
/// robustness harness).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_snapshot_whose_database_passed_its_name_passes_the_drill() {
    use etcd_warden::snapshot::take_full;
    use etcd_warden::store::{Codec, Kind, compression::collect};

    let mut src = source(Release::V35).await;
    let (client, store, dir) = (&mut src.client, &src.store, &src.dir);
    let store_dir = dir.path().join("store");
    for i in 0..5 {
        client
            .put(format!("/registry/leases/l{i}"), "v", None)
            .await
            .unwrap();
    }
    let taken = take_full(client, store, Codec::Gzip, false).await.unwrap();
    let reached = taken.last_revision;
    // The same database, named two revisions earlier.
    let raw = collect(store.get_stream(&taken).await.unwrap())
        .await
        .unwrap();
    let named = store.new_snapshot(Kind::Full, 0, reached - 2, Codec::Gzip, false);
    store.put_bytes(&named, raw.into()).await.unwrap();
    store.delete(&taken).await.unwrap();

    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let (code, out) = run(&mut drill_command(&store_dir, &work));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!("etcd serves revision {reached}, ")),
        "{out}"
    );
}

/// A drill Job beside a sidecar whose retention expires an old chain while the Job reads it
/// (the robustness harness's v34 run: `15 of 117 snapshots failed verification` with no fault
/// active, each a delta the sidecars' retention deleted during the drill). A snapshot that
/// fails to read and is no longer listed is gone, not bad; one still listed stays failed.
#[tokio::test]
async fn a_snapshot_deleted_after_the_listing_is_gone_not_failed() {
    use etcd_warden::snapshot::verify::{gone_since_listed, verify};
    use etcd_warden::store::{Codec, Kind};

    let dir = tempfile::tempdir().unwrap();
    let store = support::file_store(&dir.path().join("store"));
    let bad = store.new_snapshot(Kind::Full, 0, 10, Codec::Gzip, false);
    store
        .put_bytes(&bad, bytes::Bytes::from_static(b"not gzip"))
        .await
        .unwrap();
    let expired = store.new_snapshot(Kind::Incr, 11, 20, Codec::Gzip, false);
    store
        .put_bytes(&expired, bytes::Bytes::from_static(b"x"))
        .await
        .unwrap();
    let listed = store.list().await.unwrap();
    assert_eq!(listed.len(), 2);
    store.delete(&expired).await.unwrap();

    let mut failed = Vec::new();
    for s in &listed {
        if verify(&store, s).await.is_err() {
            failed.push(s);
        }
    }
    assert_eq!(failed.len(), 2, "both fail to read");
    let gone = gone_since_listed(&store, &failed).await.unwrap();
    assert_eq!(gone, vec![expired.snap_name.clone()]);
    assert!(gone_since_listed(&store, &[]).await.unwrap().is_empty());
}
