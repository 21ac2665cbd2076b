//! `etcd-warden compact` against etcd 3.5 and the S3 server: a full snapshot and 200 deltas fold
//! into one full snapshot at the chain's head revision; a restore then starts from it, replays
//! nothing, and gives the same keys, values, revisions and revision as the chain did.

use crate::support;

use std::time::Instant;

use etcd_warden::compact::{CompactError, CompactOptions, CompactReport, compact};
use etcd_warden::config::EncryptionConfig;
use etcd_warden::owner::handoff::{FenceMarker, HandOffObjects};
use etcd_warden::restore::{self, EtcdTools, TempEtcd};
use etcd_warden::store::{Codec, Kind, SnapshotStore};
use support::etcd::{EtcdCluster, Release};
use support::history::{dump, dump_restored, restore_options};
use support::s3::S3Server;

const BUCKET: &str = "compact";
const PREFIX: &str = "etcd-main";

/// How many full snapshots the store holds.
async fn full_snapshots(store: &SnapshotStore) -> usize {
    let listed = store.list().await.unwrap();
    listed.iter().filter(|s| s.kind == Kind::Full).count()
}

/// A single etcd 3.5, a client of it, the S3 server holding the test bucket, and the bucket's
/// store (not encrypted).
async fn start() -> (EtcdCluster, etcd_client::Client, S3Server, SnapshotStore) {
    let etcd = EtcdCluster::single(Release::V35).await;
    let client = etcd.client().await;
    let s3 = S3Server::start(&[BUCKET]);
    let store = SnapshotStore::new(s3.object_store(BUCKET), PREFIX);
    (etcd, client, s3, store)
}

/// Restores the store's latest chain into `target`; returns the report and how long it took.
async fn timed_restore(
    store: &SnapshotStore,
    target: &std::path::Path,
) -> (restore::RestoreReport, std::time::Duration) {
    let t = Instant::now();
    let report = restore::restore(store, &restore_options(target))
        .await
        .unwrap();
    (report, t.elapsed())
}

/// `compact` exited 1 with `says` in its stderr, and left the work directory `work` empty.
fn assert_failed_clean(out: &std::process::Output, says: &str, work: &std::path::Path) {
    let stderr = support::cli::exited(out, 1);
    assert!(stderr.contains(says), "{stderr}");
    assert_eq!(std::fs::read_dir(work).unwrap().count(), 0, "work dir left");
}

/// `etcd-warden compact` of the test bucket, as the CronJob runs it, working in `work`.
fn compact_command(s3: &S3Server, work: &std::path::Path) -> std::process::Command {
    let store = format!("s3://{BUCKET}/{PREFIX}");
    support::warden::on_s3_store("compact", s3, &store, "--work-dir", work)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_deltas_fold_into_one_full_snapshot_that_restores_the_same_etcd() {
    let (_etcd, mut client, s3, _) = start().await;
    let dir = tempfile::tempdir().unwrap();
    // Encrypted, so compact also shows it reads with the identity and writes to the recipient.
    let (id, key) = new_identity(dir.path());
    let keys = EncryptionConfig {
        recipients: vec![id.to_public()],
        identities: vec![key.clone()],
        ..Default::default()
    };
    let store = SnapshotStore::new(s3.object_store(BUCKET), PREFIX).with_encryption(keys);
    let last = support::history::build(&mut client, &store, 500, 200, 20).await;
    let original = dump(&mut client).await;
    assert_eq!(original.1, last);

    let before_target = dir.path().join("before.etcd");
    let (before, before_time) = timed_restore(&store, &before_target).await;
    assert_eq!((before.deltas, before.revision), (200, last));

    // The binary, as the CronJob runs it, with the keys from the environment.
    let work = dir.path().join("work");
    let t = Instant::now();
    let out = compact_command(&s3, &work)
        .env(
            "ETCD_WARDEN_ENCRYPTION_RECIPIENTS",
            id.to_public().to_string(),
        )
        .env("ETCD_WARDEN_ENCRYPTION_IDENTITIES", &key)
        .output()
        .unwrap();
    let compact_time = t.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("and 200 deltas"), "{stdout}");
    assert_eq!(
        std::fs::read_dir(&work).unwrap().count(),
        0,
        "the work directory is left empty"
    );

    let chain = store.latest_chain().await.unwrap();
    let compacted = chain.full_snapshot.unwrap();
    assert_eq!(compacted.last_revision, last);
    assert!(compacted.encrypted && !compacted.is_final, "{compacted:?}");
    assert!(chain.delta_snapshots.is_empty());
    assert!(stdout.contains(&compacted.snap_name), "{stdout}");

    let after_target = dir.path().join("after.etcd");
    let (after, after_time) = timed_restore(&store, &after_target).await;
    assert_eq!(after.full_snapshot, compacted.snap_name);
    assert_eq!((after.deltas, after.revision), (0, last));
    println!(
        "restore before compact: {:.2}s (200 deltas); compact: {:.2}s; restore after: {:.2}s",
        before_time.as_secs_f64(),
        compact_time.as_secs_f64(),
        after_time.as_secs_f64()
    );
    let restored = dump_restored(&after_target).await;
    assert_eq!(restored.1, last, "revision");
    assert!(
        restored == original,
        "the compacted restore differs from etcd"
    );
    assert!(dump_restored(&before_target).await == original);

    // A second run has nothing to fold, and says so.
    let out = compact_command(&s3, &work)
        .env("ETCD_WARDEN_ENCRYPTION_IDENTITIES", &key)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing to compact"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(full_snapshots(&store).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_that_fails_to_restore_stores_nothing_and_cleans_up() {
    let (_etcd, mut client, s3, store) = start().await;
    support::history::build(&mut client, &store, 50, 3, 10).await;
    // The middle delta is lost: the chain has a gap.
    let lost = support::deltas(&store).await.swap_remove(1);
    store.delete(&lost).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let out = compact_command(&s3, &work).output().unwrap();
    assert_failed_clean(&out, "compact failed", &work);
    assert_eq!(full_snapshots(&store).await, 1, "nothing stored");
}

fn compact_options(work: &std::path::Path) -> CompactOptions {
    CompactOptions {
        work_dir: work.to_path_buf(),
        etcd_bin: Some(Release::V35.bin_dir()),
        codec: Codec::Gzip,
        parallel_fetch: 4,
    }
}

/// A new age identity, written as `age-keygen` writes it; returns it and the key file's path.
fn new_identity(dir: &std::path::Path) -> (age::x25519::Identity, std::path::PathBuf) {
    let id = age::x25519::Identity::generate();
    let key = dir.join("team.key");
    let secret = age::secrecy::ExposeSecret::expose_secret(&id.to_string()).to_string();
    std::fs::write(&key, format!("{secret}\n")).unwrap();
    (id, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encrypted_chain_is_never_compacted_into_a_clear_snapshot() {
    let (_etcd, mut client, s3, _) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let (id, key) = new_identity(dir.path());
    let writer =
        SnapshotStore::new(s3.object_store(BUCKET), PREFIX).with_encryption(EncryptionConfig {
            recipients: vec![id.to_public()],
            ..Default::default()
        });
    support::history::build(&mut client, &writer, 20, 2, 5).await;
    // The key to read the chain, but no recipient to write the result to.
    let reader =
        SnapshotStore::new(s3.object_store(BUCKET), PREFIX).with_encryption(EncryptionConfig {
            identities: vec![key],
            ..Default::default()
        });
    let work = dir.path().join("work");
    let e = compact(&reader, &compact_options(&work)).await.unwrap_err();
    assert!(matches!(e, CompactError::WouldDecrypt { .. }), "{e}");
    assert!(e.to_string().contains("encryption.recipients"), "{e}");
    assert_eq!(full_snapshots(&reader).await, 1, "nothing stored");
    assert!(!work.exists() || std::fs::read_dir(&work).unwrap().count() == 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_in_a_hand_off_is_not_compacted() {
    let (_etcd, mut client, _s3, store) = start().await;
    support::history::build(&mut client, &store, 20, 2, 5).await;
    let objects = HandOffObjects::new(store.clone());
    objects
        .write_fence(
            0xabc,
            &FenceMarker {
                member_id: "abc".into(),
                owner_id: "seed-a".into(),
                reason: "the owner record names seed-b".into(),
                killed: vec![],
                fenced_at: chrono::Utc::now(),
            },
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let e = compact(&store, &compact_options(&dir.path().join("work")))
        .await
        .unwrap_err();
    assert!(matches!(e, CompactError::HandOff { .. }), "{e}");
    assert!(e.to_string().contains("fence marker"), "{e}");
    assert_eq!(full_snapshots(&store).await, 1, "nothing stored");

    // Reclaimed (the markers gone), it compacts.
    etcd_warden::owner::handoff::reclaim(&objects)
        .await
        .unwrap();
    let report = compact(&store, &compact_options(&dir.path().join("work")))
        .await
        .unwrap();
    assert!(
        matches!(report, CompactReport::Compacted { .. }),
        "{report:?}"
    );
}

/// Keys under a short lease in the full snapshot: the temporary etcd counts the lease down from
/// its start, so without renewal it would expire there, delete the keys and move the revision.
/// The compacted snapshot holds exactly the chain's head with the leased keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_keys_survive_compaction_and_the_revision_is_exact() {
    let (_etcd, mut client, _s3, store) = start().await;
    let lease = client.lease_grant(3, None).await.unwrap().id();
    client
        .put(
            "/registry/masterleases/10.0.0.1",
            "endpoint",
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    // The source keeps its lease alive for the whole test.
    let (mut keeper, _responses) = client.lease_keep_alive(lease).await.unwrap();
    let keep = tokio::spawn(async move {
        loop {
            if keeper.keep_alive().await.is_err() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    });
    let head = support::history::build(&mut client, &store, 20, 3, 5).await;
    let original = dump(&mut client).await;

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("restored");
    restore::restore(&store, &restore_options(&data))
        .await
        .unwrap();
    // A temporary etcd on the restored chain, run past the lease's TTL: renewed, nothing moves.
    let tools = EtcdTools::locate(Some(&Release::V35.bin_dir()))
        .await
        .unwrap();
    let temp = TempEtcd::start(&tools, &data, "default", dir.path().join("t.log"))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(7)).await;
    let mut temp_client = etcd_client::Client::connect([&temp.client_url], None)
        .await
        .unwrap();
    assert_eq!(dump(&mut temp_client).await, original, "the lease expired");
    temp.stop().await.unwrap();

    let report = compact(&store, &compact_options(&dir.path().join("work")))
        .await
        .unwrap();
    let CompactReport::Compacted { snapshot, .. } = report else {
        panic!("{report:?}")
    };
    assert_eq!(snapshot.last_revision, head);
    let again = dir.path().join("again");
    restore::restore(&store, &restore_options(&again))
        .await
        .unwrap();
    assert_eq!(dump_restored(&again).await, original);
    keep.abort();
}

/// Processes whose command line mentions `path`.
fn processes_mentioning(path: &std::path::Path) -> Vec<String> {
    let needle = path.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // The scratch directory reaches its children as an inherited descriptor (their
            // command lines say `/proc/self/fd/<n>/…`), so an open descriptor under `path`
            // counts as mentioning it.
            let holds = std::fs::read_dir(entry.path().join("fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .any(|target| target.starts_with(path));
            if (cmdline.contains(&needle) || holds) && !cmdline.contains("compact --store") {
                found.push(cmdline);
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_compaction_with_its_etcd_killed_and_work_directory_removed() {
    let (_etcd, mut client, s3, store) = start().await;
    support::history::build(&mut client, &store, 200, 60, 20).await;
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let mut child = compact_command(&s3, &work)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Signalled while the chain is being restored (a temporary etcd runs under the work dir).
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    while processes_mentioning(&work).is_empty() {
        assert!(Instant::now() < deadline, "no temporary etcd started");
        assert!(child.try_wait().unwrap().is_none(), "compact ended first");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_failed_clean(&out, "stopped by a signal", &work);
    // kill_on_drop reaps asynchronously: allow it a moment.
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while !processes_mentioning(&work).is_empty() {
        assert!(
            Instant::now() < deadline,
            "left running: {:?}",
            processes_mentioning(&work)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(full_snapshots(&store).await, 1, "nothing stored");
}
