//! etcd 3.6 data in CI, where no etcd 3.6 binary is: `tests/fixtures/etcd36` holds a store
//! (a full snapshot and two deltas) backed up from an etcd 3.6 server and that server's data
//! directory, written by [`write_etcd36_fixtures`] (see the README there). CI restores and
//! validates them with this crate alone; with `$ETCD36_BIN_DIR` the results are also started
//! on etcd 3.6.

use crate::restore::{Workload, dump, dump_at, file_store, revision, workload_of};
use crate::support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use etcd_client::{Client, CompactionOptions};
use etcd_warden::restore::Target;
use etcd_warden::restore::bolt::Reader;
use etcd_warden::restore::datadir::{self, DataDir, Validation};
use etcd_warden::restore::{EtcdTools, MemberParams, Replay, RestoreOptions, RevisionBump};
use etcd_warden::snapshot::delta::{DeltaWriter, Event};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, SnapshotStore};
use support::etcd::{EtcdMember, Release};

/// A key as (key, value, create revision, mod revision, version).
use support::boltdb::{Kv, live_keys};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/etcd36")
}

/// What the 3.6 server served, as `expected.json` records it.
struct Expected {
    full_revision: i64,
    first_delta_revision: i64,
    final_revision: i64,
    at_first_delta: serde_json::Value,
    at_final: serde_json::Value,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A value as `expected.json` keeps it: UTF-8 text as it is, anything else by its SHA-256 (the
/// values spanning several pages would make the file hundreds of KB).
fn value_json(v: &[u8]) -> String {
    match std::str::from_utf8(v) {
        Ok(text) if !text.starts_with("sha256:") => text.to_owned(),
        _ => {
            use sha2::Digest;
            format!("sha256:{}", hex(&sha2::Sha256::digest(v)))
        }
    }
}

fn kvs_json(kvs: &[Kv]) -> serde_json::Value {
    kvs.iter()
        .map(|(k, v, c, m, ver)| {
            serde_json::json!([String::from_utf8_lossy(k), value_json(v), c, m, ver])
        })
        .collect()
}

/// `kvs` with each value as [`value_json`] writes it, to compare with `expected.json`.
fn as_json(kvs: &[Kv]) -> serde_json::Value {
    kvs_json(kvs)
}

fn expected() -> Expected {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    Expected {
        full_revision: v["full_revision"].as_i64().unwrap(),
        first_delta_revision: v["first_delta_revision"].as_i64().unwrap(),
        final_revision: v["final_revision"].as_i64().unwrap(),
        at_first_delta: v["at_first_delta"].clone(),
        at_final: v["at_final"].clone(),
    }
}

/// The fixture's data directory, each file gunzipped into `dir`.
fn unpack_data_dir(dir: &Path) {
    fn walk(from: &Path, to: &Path) {
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            if e.file_type().unwrap().is_dir() {
                std::fs::create_dir_all(to.join(&name)).unwrap();
                walk(&e.path(), &to.join(&name));
            } else if let Some(plain) = name.strip_suffix(".gz") {
                let mut out = Vec::new();
                flate2::read::GzDecoder::new(std::fs::File::open(e.path()).unwrap())
                    .read_to_end(&mut out)
                    .unwrap();
                std::fs::write(to.join(plain), out).unwrap();
            }
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    walk(&fixtures().join("datadir"), dir);
}

/// The fixture's store, copied (a restore writes nothing to it, but a test must not risk the
/// repository's files).
fn copy_store(dir: &Path) -> SnapshotStore {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                copy(&e.path(), &to.join(e.file_name()));
            } else {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    }
    copy(&fixtures().join("store"), dir);
    file_store(dir)
}

/// Restore options into `data_dir` with the etcd this test run has: 3.5 in CI (the member
/// directory is written here either way), 3.6 where `$ETCD36_BIN_DIR` is set and `release`
/// says so.
fn options(data_dir: &Path, release: Release) -> RestoreOptions {
    RestoreOptions {
        data_dir: data_dir.to_path_buf(),
        member: MemberParams::default(),
        etcd_bin: Some(release.bin_dir()),
        force: false,
        parallel_fetch: 2,
        fallback: false,
        must_exceed: None,
        to: None,
        bump: RevisionBump::default(),
    }
}

#[test]
fn a_data_directory_etcd_3_6_wrote_validates_at_its_revision_with_every_key() {
    let want = expected();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.etcd");
    unpack_data_dir(&data);
    for mode in [Validation::Sanity, Validation::Full] {
        match datadir::check(&data, mode) {
            DataDir::Valid { revision, .. } => assert_eq!(revision, want.final_revision),
            other => panic!("{mode:?}: {other:?}"),
        }
    }
    let db = data.join("member/snap/db");
    let len = std::fs::metadata(&db).unwrap().len();
    Reader::open(&db, len).unwrap().check().unwrap();
    assert!(as_json(&live_keys(&db)) == want.at_final, "the keys differ");

    // Cut to its meta pages, it is corrupt: what the sidecar restores over, never starts etcd
    // on (etcd grows the file ahead of its pages, so a cut past them would go unseen).
    let f = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
    f.set_len(8192).unwrap();
    drop(f);
    match datadir::check(&data, Validation::Sanity) {
        DataDir::Corrupt(reason) => assert!(reason.contains("member/snap/db"), "{reason}"),
        other => panic!("a truncated database: {other:?}"),
    }
}

async fn restore_chain(release: Release) {
    let want = expected();
    let dir = tempfile::tempdir().unwrap();
    let store = copy_store(&dir.path().join("store"));
    let chain = store.latest_chain().await.unwrap();
    assert_eq!(
        chain.full_snapshot.as_ref().unwrap().last_revision,
        want.full_revision
    );
    assert_eq!(chain.delta_snapshots.len(), 2);

    let target = dir.path().join("restored.etcd");
    let report = etcd_warden::restore::restore(&store, &options(&target, release))
        .await
        .unwrap();
    assert_eq!(report.revision, want.final_revision);
    assert_eq!(report.deltas, 2);
    assert_eq!(report.replay, Replay::Direct);
    match datadir::check(&target, Validation::Full) {
        DataDir::Valid { revision, .. } => assert_eq!(revision, want.final_revision),
        other => panic!("{other:?}"),
    }
    let db = target.join("member/snap/db");
    let len = std::fs::metadata(&db).unwrap().len();
    Reader::open(&db, len).unwrap().check().unwrap();
    assert!(
        as_json(&live_keys(&db)) == want.at_final,
        "the restored keys differ"
    );

    let pit = dir.path().join("pit.etcd");
    let mut opts = options(&pit, release);
    opts.to = Some(Target::Revision(want.first_delta_revision));
    let report = etcd_warden::restore::restore(&store, &opts).await.unwrap();
    assert_eq!(report.revision, want.first_delta_revision);
    assert!(
        as_json(&live_keys(&pit.join("member/snap/db"))) == want.at_first_delta,
        "the keys at revision {} differ",
        want.first_delta_revision
    );

    let bumped = dir.path().join("bumped.etcd");
    let mut opts = options(&bumped, release);
    opts.bump = RevisionBump {
        by: 1000,
        mark_compacted: true,
    };
    let report = etcd_warden::restore::restore(&store, &opts).await.unwrap();
    assert_eq!(report.etcd_revision, want.final_revision + 1000);
    match datadir::check(&bumped, Validation::Full) {
        DataDir::Valid { revision, .. } => assert_eq!(revision, want.final_revision + 1000),
        other => panic!("{other:?}"),
    }

    if release == Release::V36 {
        for (restored, keys, rev) in [
            (&target, &want.at_final, want.final_revision),
            (&pit, &want.at_first_delta, want.first_delta_revision),
            (&bumped, &want.at_final, want.final_revision + 1000),
        ] {
            let (kvs, served) = dump_restored(release, restored).await;
            assert_eq!(served, rev, "{}", restored.display());
            assert!(
                &as_json(&kvs) == keys,
                "{}: etcd 3.6 serves other keys",
                restored.display()
            );
        }
    }
}

/// Starts `release` on `data_dir` and dumps it.
async fn dump_restored(release: Release, data_dir: &Path) -> (Vec<Kv>, i64) {
    let log = data_dir.with_extension("check.log");
    let etcd = support::etcd::temp_etcd(release, data_dir, "default", log)
        .await
        .unwrap();
    let mut client = Client::connect([&etcd.client_url], None).await.unwrap();
    let d = dump(&mut client).await;
    etcd.stop().await.unwrap();
    d
}

/// In CI with etcd 3.5's tools: the member directory is written here either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_backed_up_from_etcd_3_6_restores_key_for_key_to_any_revision_and_bumped() {
    restore_chain(Release::V35).await;
}

/// Needs `$ETCD36_BIN_DIR` (skipped without it, as in CI): the same restores with etcd 3.6's
/// own binaries, then etcd 3.6 started on each and on the fixture's data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_3_6_fixtures_restore_and_start_on_etcd_3_6() {
    let Some(release) = Release::v36("the_etcd_3_6_fixtures_restore_and_start_on_etcd_3_6") else {
        return;
    };
    restore_chain(release).await;
    let want = expected();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.etcd");
    unpack_data_dir(&data);
    let mut member = EtcdMember::single(release, FIXTURE_MEMBER, data, dir.path().join("log"));
    member.start();
    member
        .wait_healthy(std::time::Duration::from_secs(30))
        .await;
    let mut client = Client::connect([member.client_url()], None).await.unwrap();
    let (kvs, rev) = dump(&mut client).await;
    assert_eq!(rev, want.final_revision);
    assert!(
        as_json(&kvs) == want.at_final,
        "etcd 3.6 serves other keys on its own data directory"
    );
    member.terminate().await;
}

/// A distroless etcd image (MicroShift's too) has no `etcdutl`: with `etcd` alone in the
/// directory, a restore that writes the member directory itself succeeds, and only the step
/// that would run the tool fails, naming it.
async fn restores_without_etcdutl(release: Release) {
    let want = expected();
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // A copy: the tools are also looked for beside a symbolic link's target.
    std::fs::copy(release.bin("etcd"), bin.join("etcd")).unwrap();
    let store = copy_store(&dir.path().join("store"));
    let target = dir.path().join("restored.etcd");
    let mut opts = options(&target, release);
    opts.etcd_bin = Some(bin.clone());
    let report = etcd_warden::restore::restore(&store, &opts)
        .await
        .unwrap_or_else(|e| panic!("a restore with etcd alone: {e}"));
    assert_eq!(report.revision, want.final_revision);
    assert!(as_json(&live_keys(&target.join("member/snap/db"))) == want.at_final);

    let tools = EtcdTools::locate(Some(&bin)).await.unwrap();
    assert_eq!(tools.restorer, None);
    let e = tools
        .restore_db(
            &dir.path().join("nothing.db"),
            etcd_warden::restore::DbHash::Appended,
            &dir.path().join("other.etcd"),
            &MemberParams::default(),
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no etcdutl beside"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_3_5_alone_restores_without_etcdutl() {
    restores_without_etcdutl(Release::V35).await;
}

/// Needs `$ETCD36_BIN_DIR` (skipped without it, as in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_3_6_alone_restores_without_etcdutl() {
    if let Some(release) = Release::v36("etcd_3_6_alone_restores_without_etcdutl") {
        restores_without_etcdutl(release).await;
    }
}

/// The member name the fixture's data directory was written under.
const FIXTURE_MEMBER: &str = "m36";

/// Small phases (keys as the fixture was written with): a value spanning several bbolt pages,
/// not one near etcd's request limit.
const SMALL: Workload = Workload {
    keys: 24,
    key_width: 2,
    overwrites: 8,
    overwrite_width: 0,
    big: 12_000,
};

/// Writes `tests/fixtures/etcd36` afresh from the etcd 3.6 in `$ETCD36_BIN_DIR` into
/// `$ETCD36_FIXTURE_OUT`: by hand; without `$ETCD36_FIXTURE_OUT` (CI) it writes nothing and
/// says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_etcd36_fixtures() {
    if std::env::var_os("ETCD36_FIXTURE_OUT").is_none() {
        println!("ETCD36_FIXTURE_OUT is not set: no fixtures written (see tests/fixtures/etcd36)");
        return;
    }
    let release = Release::v36("write_etcd36_fixtures").expect("$ETCD36_BIN_DIR");
    let out = PathBuf::from(std::env::var_os("ETCD36_FIXTURE_OUT").expect("$ETCD36_FIXTURE_OUT"));
    assert!(!out.exists(), "{} exists", out.display());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.etcd");
    let mut member = EtcdMember::launch(
        release,
        FIXTURE_MEMBER,
        data.clone(),
        dir.path().join("log"),
        &[],
    )
    .await;
    let mut client = Client::connect([member.client_url()], None).await.unwrap();
    let store = file_store(&out.join("store"));

    // The full snapshot after phase 0 and a compaction, then two deltas of a phase each.
    workload_of(&mut client, 0, &SMALL).await;
    let at = revision(&mut client).await;
    client
        .compact(at, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();
    let full = take_full(&client, &store, Codec::Gzip, false)
        .await
        .unwrap();
    let mut writer = DeltaWriter::new(Codec::Gzip, full.last_revision);
    let mut watch = DeltaWatch::open(&client, full.last_revision + 1)
        .await
        .unwrap();
    let mut ends = Vec::new();
    for phase in 1..=2 {
        workload_of(&mut client, phase, &SMALL).await;
        let target = revision(&mut client).await;
        let mut events: Vec<Event> = Vec::new();
        while events.last().map_or(0, Event::revision) < target {
            events.extend(watch.next().await.unwrap());
        }
        writer.push(events, chrono::Utc::now());
        writer.flush(&store).await.unwrap().unwrap();
        ends.push(target);
    }
    let at_first = dump_at(&mut client, Some(ends[0])).await.0;
    let (at_final, final_revision) = dump(&mut client).await;
    assert_eq!(final_revision, ends[1]);
    drop(watch);
    drop(client);
    member.terminate().await;

    // The data directory, each file gzipped (the WAL is preallocated zeros past its records);
    // not etcd's `0.tmp`, the next segment it preallocates and recreates.
    fn pack(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            if e.file_type().unwrap().is_dir() {
                pack(&e.path(), &to.join(&name));
            } else if !name.ends_with(".tmp") {
                let f = std::fs::File::create(to.join(format!("{name}.gz"))).unwrap();
                let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::best());
                gz.write_all(&std::fs::read(e.path()).unwrap()).unwrap();
                gz.finish().unwrap();
            }
        }
    }
    pack(&data, &out.join("datadir"));
    let (major, minor, patch) = release.binaries().version;
    let version = format!("{major}.{minor}.{patch}");
    let expected = serde_json::json!({
        "etcd_version": version,
        "full_revision": full.last_revision,
        "first_delta_revision": ends[0],
        "final_revision": final_revision,
        "at_first_delta": kvs_json(&at_first),
        "at_final": kvs_json(&at_final),
    });
    std::fs::write(
        out.join("expected.json"),
        serde_json::to_string_pretty(&expected).unwrap() + "\n",
    )
    .unwrap();
}
