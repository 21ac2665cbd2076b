//! Restores Kubernetes can trust, against real etcd: a point-in-time restore (`--to-revision`,
//! `--to-time`) gives exactly what etcd served at that point, and a revision bump with the
//! compaction mark makes a watch from any revision the source served fail as compacted, with
//! every new revision above everything the source ever handed out.

use crate::restore::{
    build_store, dump, dump_at, dump_restored, file_store, options, restore_command, revision,
    source, workload,
};
use crate::support;

use std::path::Path;
use std::time::Duration;

use etcd_client::{Client, GetOptions, WatchOptions};
use etcd_warden::restore::{EtcdTools, RestoreError, RevisionBump, Target, TempEtcd};
use etcd_warden::snapshot::delta::{DeltaWriter, Event};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use support::etcd::{EtcdCluster, Release};

/// Restores `store` into `target` with `release`'s tools, to `to` (`None`: the latest), bumped
/// by `bump`.
async fn restore_bumped(
    store: &SnapshotStore,
    target: &Path,
    to: Option<Target>,
    bump: RevisionBump,
    release: Release,
) -> Result<etcd_warden::restore::RestoreReport, RestoreError> {
    let mut opts = options(target, release);
    opts.to = to;
    opts.bump = bump;
    etcd_warden::restore::restore(store, &opts).await
}

/// Restores `store` into `target` with etcd 3.5's tools, to `to`, without a bump.
async fn restore_to(
    store: &SnapshotStore,
    target: &Path,
    to: Target,
) -> Result<etcd_warden::restore::RestoreReport, RestoreError> {
    restore_bumped(
        store,
        target,
        Some(to),
        RevisionBump::default(),
        Release::V35,
    )
    .await
}

/// Restores to several revisions (the full snapshot's own, inside a delta, a transaction's
/// revision with its three operations, a delta's last, the newest) and compares every key,
/// value, create and mod revision and version with what etcd answered at that revision; then the
/// errors: before the oldest full snapshot, after the newest event, behind a lost delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_to_a_revision_is_what_etcd_served_at_it() {
    let release = Release::V35;
    let mut src = source(release).await;
    let (client, store, dir) = (&mut src.client, &src.store, &src.dir);
    let last = build_store(client, store, 3).await;
    let list = store.list().await.unwrap();
    let full = list.iter().find(|s| s.kind == Kind::Full).unwrap().clone();
    let first_delta = list.iter().find(|s| s.kind == Kind::Incr).unwrap().clone();
    let txn = client.get("/txn/2/a", None).await.unwrap().kvs()[0].mod_revision();
    let targets = [
        full.last_revision,
        full.last_revision + 30,
        txn,
        first_delta.last_revision,
        last,
    ];
    for (i, r) in targets.into_iter().enumerate() {
        let expected = dump_at(client, Some(r)).await;
        let target = dir.path().join(format!("at-{r}.etcd"));
        let report = restore_to(store, &target, Target::Revision(r))
            .await
            .unwrap_or_else(|e| panic!("target {i}, revision {r}: {e}"));
        assert_eq!(
            (report.revision, report.etcd_revision),
            (r, r),
            "target {i}"
        );
        let restored = dump_restored(release, &target, "default").await;
        assert_eq!(restored.1, r, "target {i}: revision");
        assert_eq!(
            restored.0.len(),
            expected.0.len(),
            "target {i}, revision {r}: key count"
        );
        assert!(
            restored.0 == expected.0,
            "target {i}, revision {r}: keys, values and revisions differ"
        );
    }
    // The transaction's three operations are one revision: all of them are in.
    let at_txn = dump_restored(
        release,
        &dir.path().join(format!("at-{txn}.etcd")),
        "default",
    )
    .await;
    let keys: Vec<&[u8]> = at_txn.0.iter().map(|kv| kv.0.as_slice()).collect();
    assert!(keys.contains(&b"/txn/2/a".as_slice()) && keys.contains(&b"/txn/2/b".as_slice()));
    assert!(!keys.contains(&b"/registry/shared/k006".as_slice()));

    let refused = |to, what: &'static str| {
        let store = &store;
        let target = dir.path().join("refused.etcd");
        async move {
            let e = restore_to(store, &target, to)
                .await
                .expect_err(what)
                .to_string();
            assert!(!target.exists(), "{what}: nothing is written");
            e
        }
    };
    let e = refused(Target::Revision(full.last_revision - 1), "before the full").await;
    assert!(e.contains("before the oldest full snapshot"), "{e}");
    let e = refused(Target::Revision(last + 1), "after the newest").await;
    assert!(e.contains("is after the newest snapshot"), "{e}");
    // A lost delta: a target behind it fails naming the gap; one before it still restores.
    store.delete(&first_delta).await.unwrap();
    let e = refused(Target::Revision(last), "behind a lost delta").await;
    assert!(
        e.contains(&format!(
            "revisions {} to {} are in no snapshot",
            full.last_revision + 1,
            first_delta.last_revision
        )),
        "{e}"
    );
    let report = restore_to(
        store,
        &dir.path().join("before-gap.etcd"),
        Target::Revision(full.last_revision),
    )
    .await
    .unwrap();
    assert_eq!(report.revision, full.last_revision);
}

/// A store whose deltas are written two seconds apart: a time between two deltas restores
/// exactly the events received before it (the state etcd served at the last of them), a time
/// before the full snapshot or after the newest snapshot is refused naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_to_a_time_holds_the_events_received_before_it() {
    let release = Release::V35;
    let mut src = source(release).await;
    let (client, store, dir) = (&mut src.client, &src.store, &src.dir);
    workload(client, 0).await;
    let full = take_full(client, store, Codec::Gzip, false).await.unwrap();
    let mut writer = DeltaWriter::new(Codec::Gzip, full.last_revision);
    let mut watch = DeltaWatch::open(client, full.last_revision + 1)
        .await
        .unwrap();
    let mut ends = Vec::new();
    let mut received = Vec::new();
    for phase in 1..=2 {
        // A whole second after the full snapshot's name, and between the deltas' names.
        tokio::time::sleep(Duration::from_millis(2100)).await;
        workload(client, phase).await;
        let end = revision(client).await;
        let mut events: Vec<Event> = Vec::new();
        while events.last().map_or(0, Event::revision) < end {
            events.extend(watch.next().await.unwrap());
        }
        let now = chrono::Utc::now();
        writer.push(events, now);
        writer.flush(store).await.unwrap().unwrap();
        ends.push(end);
        received.push(now);
    }
    let between = received[0] + chrono::Duration::milliseconds(500);
    let expected = dump_at(client, Some(ends[0])).await;
    let target = dir.path().join("between.etcd");
    let report = restore_to(store, &target, Target::Time(between))
        .await
        .unwrap();
    assert_eq!(report.revision, ends[0]);
    assert_eq!(report.last_event_time, Some(received[0]));
    let restored = dump_restored(release, &target, "default").await;
    assert!(restored == expected, "the state at the time differs");

    for (when, want) in [
        (
            full.created_on - chrono::Duration::seconds(5),
            "before the oldest full snapshot",
        ),
        (
            received[1] + chrono::Duration::seconds(10),
            "is after the newest snapshot",
        ),
    ] {
        let e = restore_to(store, &dir.path().join("refused.etcd"), Target::Time(when))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
}

/// The source goes on past its last backup; the restore bumps by more than it went and marks
/// the bump compacted. On the restored etcd a watch and a read at the source's last revision
/// fail as compacted, and the next write lands above every revision the source served.
async fn a_bumped_restore_is_compacted_past_the_source(release: Release) {
    let mut src = source(release).await;
    let (client, store, dir) = (&mut src.client, &src.store, &src.dir);
    let backed_up = build_store(client, store, 1).await;
    // Writes the backups never saw: the revisions a watch cache may hold.
    workload(client, 2).await;
    let served = revision(client).await;
    assert!(served > backed_up);

    let target = dir.path().join("bumped.etcd");
    let bump = RevisionBump {
        by: 10_000,
        mark_compacted: true,
    };
    let report = restore_bumped(store, &target, None, bump, release)
        .await
        .unwrap();
    assert_eq!(report.revision, backed_up);
    assert_eq!(report.etcd_revision, backed_up + 10_000);

    let tools = EtcdTools::locate(Some(&release.bin_dir())).await.unwrap();
    let log = target.with_extension("check.log");
    let restored = TempEtcd::start(&tools, &target, "default", log)
        .await
        .unwrap();
    let mut c = Client::connect([&restored.client_url], None).await.unwrap();
    assert_eq!(revision(&mut c).await, backed_up + 10_000);
    let mut stream = c
        .watch(
            "/registry/",
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(served),
            ),
        )
        .await
        .unwrap();
    // The first answer may only confirm the watch was created; the cancel follows.
    let cancel = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let resp = stream.message().await.unwrap().expect("a response");
            if resp.canceled() || !resp.events().is_empty() {
                return resp;
            }
        }
    })
    .await
    .expect("the watch answers");
    assert!(
        cancel.canceled() && cancel.compact_revision() == backed_up + 10_000,
        "a watch from revision {served} must fail as compacted at {}, got canceled={} \
         compact_revision={} events={}",
        backed_up + 10_000,
        cancel.canceled(),
        cancel.compact_revision(),
        cancel.events().len()
    );
    let read = c
        .get("/registry/", Some(GetOptions::new().with_revision(served)))
        .await
        .expect_err("a read at a revision the source served");
    assert!(read.to_string().contains("compacted"), "{read}");
    // Every key the backups hold is there, at its own revisions.
    let keys = dump(&mut c).await;
    assert!(
        keys.0 == dump_at(client, Some(backed_up)).await.0,
        "the restored keys differ from the source's at revision {backed_up}"
    );
    let put = c.put("/after/restore", "x", None).await.unwrap();
    let new_rev = put.header().unwrap().revision();
    assert_eq!(new_rev, backed_up + 10_001);
    assert!(new_rev > served);
    restored.stop().await.unwrap();
}

/// On etcd 3.5 (etcdutl restores) and 3.4 (etcdctl restores, which has no bump of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bumped_restore_is_compacted_past_the_source_on_etcd_3_5_and_3_4() {
    for release in [Release::V35, Release::V34] {
        a_bumped_restore_is_compacted_past_the_source(release).await;
    }
}

/// Needs `$ETCD36_BIN_DIR` (skipped without it, as in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bumped_restore_is_compacted_past_the_source_on_etcd_3_6() {
    if let Some(release) = Release::v36("a_bumped_restore_is_compacted_past_the_source_on_etcd_3_6")
    {
        a_bumped_restore_is_compacted_past_the_source(release).await;
    }
}

/// The binary: `restore --help` lists the new flags, `--mark-compacted` without a bump is bad
/// configuration naming the key (64), a time that is not RFC 3339 is refused naming the flag,
/// and `--to-revision` with `--bump-revision` restores and says where etcd starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restore_command_takes_a_target_and_a_bump() {
    let help = support::warden::command()
        .args(["restore", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let missing: Vec<&str> = [
        "--to-revision",
        "--to-time",
        "--bump-revision",
        "--mark-compacted",
    ]
    .into_iter()
    .filter(|flag| !help.contains(flag))
    .collect();
    assert!(
        missing.is_empty(),
        "missing from restore --help: {missing:?}\n{help}"
    );
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let store = file_store(&store_dir);
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let last = build_store(&mut client, &store, 1).await;

    let out = restore_command(&store_dir, &dir.path().join("a"))
        .arg("--mark-compacted")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("restore.mark_compacted"), "{err}");

    let out = restore_command(&store_dir, &dir.path().join("b"))
        .args(["--to-time", "yesterday"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--to-time") && err.contains("RFC 3339"),
        "{err}"
    );

    let out = restore_command(&store_dir, &dir.path().join("c"))
        .args(["--to-revision", &(last - 5).to_string()])
        .args(["--bump-revision", "1000000000", "--mark-compacted"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("the state at revision {}", last - 5)),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "etcd starts at revision {} (bumped by 1000000000, marked compacted)",
            last - 5 + 1_000_000_000
        )),
        "{stdout}"
    );
}
