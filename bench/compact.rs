//! Restore time before and after `etcd-warden compact`, on the same store: a full snapshot and
//! N deltas (default 200) written from etcd 3.5 into the S3 server (s3s-fs on loopback).
//!
//! `cargo bench --bench compact -- [deltas] [writes-per-delta]` (defaults 200 and 100). Each
//! restore is the median of three; the compaction runs once (the release `etcd-warden compact`
//! binary). Results go in docs/benchmarks.md.

mod common;
#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{median, numeric_args};
use etcd_warden::restore::RestoreOptions;
use etcd_warden::store::SnapshotStore;
use support::etcd::{EtcdCluster, Release};

async fn timed_restores(store: &SnapshotStore, dir: &std::path::Path) -> (Duration, usize) {
    let mut times = Vec::new();
    let mut deltas = 0;
    for i in 0..3 {
        let target = dir.join(format!("restore-{i}-{}", times.len()));
        let _ = std::fs::remove_dir_all(&target);
        let opts = RestoreOptions::scratch(&target, Some(Release::V35.bin_dir()), 4);
        let t = Instant::now();
        let report = etcd_warden::restore::restore(store, &opts).await.unwrap();
        times.push(t.elapsed());
        deltas = report.deltas;
        std::fs::remove_dir_all(&target).unwrap();
    }
    (median(times), deltas)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let [deltas, per] = numeric_args([200, 100]);
    let etcd = EtcdCluster::single(Release::V35).await;
    let mut client = etcd.client().await;
    let s3 = support::s3::S3Server::start(&["bench-compact"]);
    let store = SnapshotStore::new(s3.object_store("bench-compact"), "etcd");
    let dir = tempfile::tempdir().unwrap();
    let last = support::history::build(&mut client, &store, 5000, deltas, per).await;
    println!(
        "store: a full snapshot of 5000 keys and {deltas} deltas of {per} writes, revision {last}"
    );

    let (before, n) = timed_restores(&store, dir.path()).await;
    println!(
        "restore before compact: {:.3}s ({n} deltas; median of 3)",
        before.as_secs_f64()
    );
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_etcd-warden"))
        .args([
            "compact",
            "--store",
            "s3://bench-compact/etcd",
            "--etcd-bin",
        ])
        .arg(Release::V35.bin_dir())
        .arg("--work-dir")
        .arg(dir.path().join("work"))
        .env("ETCD_WARDEN_LOG_LEVEL", "warn")
        .envs(s3.env("store"))
        .output()
        .unwrap();
    let compact = t.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{}", String::from_utf8_lossy(&out.stdout));
    println!("etcd-warden compact: {:.3}s", compact.as_secs_f64());
    let (after, n) = timed_restores(&store, dir.path()).await;
    println!(
        "restore after compact: {:.3}s ({n} deltas; median of 3), {:.2}x the time before",
        after.as_secs_f64(),
        after.as_secs_f64() / before.as_secs_f64()
    );
}
