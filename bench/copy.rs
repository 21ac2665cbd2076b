//! Copy speed and memory: `etcd-warden copy` from one S3 bucket to another against
//! `rclone copy --transfers 10 --disable copy`, both at parallelism 10, against one `s3s-fs` on
//! loopback, alternating in the same run.
//!
//! `cargo bench --bench copy -- [runs] [KEY=VALUE …]` (default 3 runs). `KEY=VALUE` arguments
//! are added to etcd-warden's environment, e.g. `AWS_UNSIGNED_PAYLOAD=true`, to
//! measure a variant. Needs `s3s-fs` (./scripts/setup), `rclone` (`apt-get install -y rclone`)
//! and GNU time at `/usr/bin/time`. Results go in docs/benchmarks.md.
//!
//! Data: 50 uncompressed full snapshots, 5 of 150 MiB and 45 of 1–5 MiB, random bytes followed by
//! their SHA-256 (as etcd streams a snapshot), written straight into the source bucket's
//! directory under `cluster/v2/`. Each run empties the destination buckets first, so every run
//! copies everything.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};
use support::s3::{ACCESS_KEY, REGION, S3Server, SECRET_KEY};

const SRC: &str = "bench-src";
/// etcd-warden's destination.
const DST: &str = "bench-dst";
/// rclone's destination: copying into a prefix makes rclone HEAD the prefix as an object, which
/// s3s-fs answers with a 500 that rclone retries for ~100 s, so rclone copies bucket root to
/// bucket root.
const RCL: &str = "bench-rcl";
const PREFIX: &str = "cluster";
const PARALLEL: &str = "10";
const MIB: usize = 1 << 20;

/// xorshift64*: incompressible enough, and fast enough to write 886 MiB in a few seconds.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Writes the snapshots into the source bucket's directory; returns (count, bytes).
fn write_source(root: &Path) -> (usize, u64) {
    let dir = root.join(SRC).join(PREFIX).join("v2");
    std::fs::create_dir_all(&dir).expect("create the source directory");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let now = chrono::Utc::now().timestamp();
    let mut total = 0u64;
    for i in 1..=50usize {
        // Every tenth is large, so the large ones start at different points of the copy.
        let len = if i % 10 == 1 {
            150 * MIB
        } else {
            MIB + (rng.next() % (4 * MIB as u64)) as usize
        };
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        let hash = Sha256::digest(&data);
        data.extend_from_slice(&hash);
        let name = format!("Full-00000000-{i:08}-{}", now - (50 - i as i64) * 60);
        std::fs::write(dir.join(name), &data).expect("write a source object");
        total += data.len() as u64;
    }
    (50, total)
}

/// Empties a destination bucket: its objects and s3s-fs's metadata files for them.
fn clear_bucket(root: &Path, bucket: &str) {
    let dir = root.join(bucket);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("recreate the bucket directory");
    let meta = format!(".bucket-{bucket}.");
    for entry in std::fs::read_dir(root)
        .expect("list the s3s-fs root")
        .flatten()
    {
        if entry.file_name().to_string_lossy().starts_with(&meta) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Objects and bytes under a directory (recursively), ignoring nothing: s3s-fs keeps its
/// metadata outside the bucket directories.
fn tally(dir: &Path) -> (usize, u64) {
    let mut out = (0, 0);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("list a bucket").flatten() {
            let meta = entry.metadata().expect("stat an object");
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                out.0 += 1;
                out.1 += meta.len();
            }
        }
    }
    out
}

/// One measured process: wall seconds and peak RSS in MiB (GNU time's `%e %M`), and the load
/// average when it ended.
struct Measured {
    wall: f64,
    rss_mib: f64,
    load: String,
}

fn timed(cmd: Command, dir: &Path, what: &str) -> Measured {
    let time_out = dir.join(format!("{what}.time"));
    let log = dir.join(format!("{what}.log"));
    let log_file = std::fs::File::create(&log).expect("create a log file");
    let program = cmd.get_program().to_owned();
    let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
    let mut timed = Command::new("/usr/bin/time");
    timed
        .args(["-f", "%e %M", "-o"])
        .arg(&time_out)
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("clone the log file"))
        .stderr(log_file);
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => timed.env(k, v),
            None => timed.env_remove(k),
        };
    }
    let status = timed
        .status()
        .expect("run /usr/bin/time (GNU time: apt-get install -y time)");
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{what} failed ({status}):\n{log_text}");
    let text = std::fs::read_to_string(&time_out).expect("GNU time's output");
    let fields: Vec<f64> = text
        .lines()
        .last()
        .unwrap_or("")
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    assert_eq!(fields.len(), 2, "unexpected GNU time output: {text:?}");
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    Measured {
        wall: fields[0],
        rss_mib: fields[1] / 1024.0,
        load,
    }
}

fn rclone_config(dir: &Path, endpoint: &str) -> PathBuf {
    let mut text = String::new();
    // Two remotes on one server, so rclone cannot copy server side; with `--disable copy` it
    // streams every byte through itself as etcd-warden must between buckets.
    for remote in ["a", "s"] {
        let _ = write!(
            text,
            "[{remote}]\ntype = s3\nprovider = Other\naccess_key_id = {ACCESS_KEY}\n\
             secret_access_key = {SECRET_KEY}\nendpoint = {endpoint}\nregion = {REGION}\n\
             force_path_style = true\n\n"
        );
    }
    let path = dir.join("rclone.conf");
    std::fs::write(&path, text).expect("write rclone.conf");
    path
}

fn main() {
    let mut runs = 3usize;
    let mut extra_env: Vec<(String, String)> = Vec::new();
    for arg in std::env::args().skip(1) {
        if let Some((k, v)) = arg.split_once('=') {
            extra_env.push((k.to_string(), v.to_string()));
        } else if let Ok(n) = arg.parse() {
            runs = n;
        }
    }
    let rclone = support::on_path("rclone").expect("rclone not found: apt-get install -y rclone");
    let warden = support::warden::binary();
    let s3 = S3Server::start(&[SRC, DST, RCL]);
    let root = s3.root.path().to_path_buf();
    let work = tempfile::tempdir().expect("temp dir");
    let (objects, bytes) = write_source(&root);
    println!(
        "{objects} objects, {:.0} MiB in s3://{SRC}/{PREFIX}; s3s-fs at {}",
        bytes as f64 / MIB as f64,
        s3.endpoint()
    );
    let conf = rclone_config(work.path(), &s3.endpoint());

    let mut rows = Vec::new();
    for run in 1..=runs {
        clear_bucket(&root, DST);
        let mut cmd = Command::new(&warden);
        cmd.args(["copy", "--source-store", &format!("s3://{SRC}/{PREFIX}")])
            .args(["--dest-store", &format!("s3://{DST}/{PREFIX}")])
            .args(["--parallel", PARALLEL]);
        for (k, _) in std::env::vars() {
            if k.starts_with("ETCD_WARDEN_") || k.starts_with("AWS_") {
                cmd.env_remove(k);
            }
        }
        for section in ["STORE", "SOURCE_STORE"] {
            cmd.env(format!("ETCD_WARDEN_{section}_ENDPOINT"), s3.endpoint())
                .env(format!("ETCD_WARDEN_{section}_REGION"), REGION)
                .env(format!("ETCD_WARDEN_{section}_ACCESS_KEY_ID"), ACCESS_KEY)
                .env(
                    format!("ETCD_WARDEN_{section}_SECRET_ACCESS_KEY"),
                    SECRET_KEY,
                );
        }
        cmd.envs(extra_env.iter().map(|(k, v)| (k, v)));
        let ours = timed(cmd, work.path(), &format!("warden-{run}"));
        let got = tally(&root.join(DST));
        assert_eq!(got, (objects, bytes), "etcd-warden's destination");

        clear_bucket(&root, RCL);
        let mut cmd = Command::new(&rclone);
        cmd.arg("--config")
            .arg(&conf)
            .args(["copy", &format!("a:{SRC}"), &format!("s:{RCL}")])
            .args(["--transfers", PARALLEL, "--disable", "copy"])
            // rclone fails to set up its S3 client with the AWS_CA_BUNDLE this machine's
            // environment sets; loopback plain HTTP needs no CA anyway.
            .env_remove("AWS_CA_BUNDLE");
        let theirs = timed(cmd, work.path(), &format!("rclone-{run}"));
        let got = tally(&root.join(RCL));
        assert_eq!(got, (objects, bytes), "rclone's destination");

        println!(
            "run {run}: etcd-warden {:.2} s {:.0} MiB (load {}), rclone {:.2} s {:.0} MiB (load {})",
            ours.wall, ours.rss_mib, ours.load, theirs.wall, theirs.rss_mib, theirs.load
        );
        let _ = std::io::stdout().flush();
        rows.push((ours, theirs));
    }

    println!();
    println!(
        "| run | etcd-warden wall | peak RSS | rclone wall | peak RSS | wall ratio | load after |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, (ours, theirs)) in rows.iter().enumerate() {
        println!(
            "| {} | {:.2} s | {:.0} MiB | {:.2} s | {:.0} MiB | {:.2}× | {} / {} |",
            i + 1,
            ours.wall,
            ours.rss_mib,
            theirs.wall,
            theirs.rss_mib,
            ours.wall / theirs.wall,
            ours.load,
            theirs.load
        );
    }
}
