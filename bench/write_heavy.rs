//! Write-heavy deltas (issue 58, item 2): a sustained load of 1 KiB writes with lease churn, as
//! kube-apiserver's Events make, against one etcd 3.5 (fsync on), with `etcd-warden serve`
//! taking a delta snapshot every second to an S3 server (s3s-fs) on loopback. Measured each
//! second: how far the newest stored delta is behind etcd (revisions, seconds), the sidecar's
//! delta buffer, RSS and CPU, and its requests to the store (counted by a proxy in front of it).
//! Then the store is made slow (every chunk of its traffic held 20 ms, each way) for a while:
//! the delta buffer must stay within `snapshot.delta_memory_limit` and catch up after. At the
//! end the load stops, every lease expires, and `etcd-warden restore` of the chain (full +
//! deltas) must equal the source key by key (value, create and mod revision, version).
//!
//! `cargo build --release --example s3s_fs && cargo bench --bench write_heavy -- [SECONDS]
//! [RATE] [SLOW_SECONDS]` (defaults 60, 5000, 20): SECONDS of load at RATE writes per second
//! (7 in 10 are Events on a lease granted every second with a 10 s TTL, 3 in 10 update one of
//! 5,000 pod keys), the last SLOW_SECONDS of them with the store slow, then 10 s at full speed.
//! The full snapshot schedule is off (one full at start), so what is measured is the deltas.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{GetOptions, PutOptions};
use etcd_warden::store::{Kind, SnapshotStore};
use support::etcd::EtcdMember;
use support::faultproxy::{FaultMode, FaultProxy};
use support::s3::{ACCOUNT, S3Server};
use support::warden::Warden;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

mod common;

const MEMORY_LIMIT: u64 = 16 << 20;
const WORKERS: usize = 64;

/// One second's sample.
struct Sample {
    at: f64,
    revision: i64,
    stored: i64,
    buffered: u64,
    rss_kib: u64,
    cpu_ticks: u64,
    requests: u64,
    slow: bool,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let [seconds, rate, slow_seconds] = common::numeric_args([60, 5000, 20]);
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&["bench"]);
    let counter = RequestCounter::start(s3.endpoint().trim_start_matches("http://")).await;
    let slow = FaultProxy::start(counter.addr).await;
    let etcd = EtcdMember::launch_bulk("wh", dir.path().join("data")).await;
    let mut keys: Vec<(&str, String)> = vec![
        ("etcd.endpoints", etcd.client_url()),
        ("snapshot.delta_period", "1s".into()),
        ("snapshot.delta_memory_limit", format!("{MEMORY_LIMIT}")),
        ("snapshot.schedule", "0 0 1 1 *".into()),
    ];
    let overrides = ACCOUNT.config_overrides("store", &slow.endpoint(), "bench", "wh");
    for (k, v) in &overrides {
        keys.push((k.as_str(), v.clone()));
    }
    let w = Warden::start(&keys);
    let pid = w.pid().unwrap();
    let store = SnapshotStore::new(Arc::new(ACCOUNT.client(&s3.endpoint(), "bench")), "wh");
    let started = support::eventually(Duration::from_secs(60), || async {
        store
            .list()
            .await
            .is_ok_and(|l| l.iter().any(|s| s.kind == Kind::Full))
    })
    .await;
    assert!(started, "no full snapshot:\n{}", w.log_text());

    // The load.
    let client = etcd_client::Client::connect([etcd.client_url()], None)
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let lease = Arc::new(AtomicI64::new(0));
    let permits = Arc::new(Semaphore::new(0));
    let mut tasks = Vec::new();
    {
        let (stop, permits) = (stop.clone(), permits.clone());
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                if permits.available_permits() < rate / 10 {
                    permits.add_permits(rate / 100);
                }
            }
            permits.close();
        }));
    }
    {
        let (stop, lease, mut c) = (stop.clone(), lease.clone(), client.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let granted = c.lease_grant(10, None).await.unwrap();
                lease.store(granted.id(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }));
    }
    while lease.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for _ in 0..WORKERS {
        let (permits, written, lease, mut c) = (
            permits.clone(),
            written.clone(),
            lease.clone(),
            client.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while let Ok(p) = permits.acquire().await {
                p.forget();
                let i = written.fetch_add(1, Ordering::Relaxed);
                let mut value = format!("{i:016}").into_bytes();
                value.resize(1024, b'v');
                let (key, options) = if i % 10 < 7 {
                    let key = format!("/registry/events/ns-{}/ev-{i}", i % 50);
                    let lease = lease.load(Ordering::Relaxed);
                    (key, Some(PutOptions::new().with_lease(lease)))
                } else {
                    (
                        format!("/registry/pods/ns-{}/pod-{}", i % 50, i % 5000),
                        None,
                    )
                };
                c.put(key, value, options).await.unwrap();
            }
        }));
    }

    // Samples, one a second, until the load has run its time.
    let mut status = client.clone();
    let t0 = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let slow_from = seconds.saturating_sub(slow_seconds) as f64;
    let slow_until = seconds as f64;
    let run_for = seconds as f64 + 10.0;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let at = t0.elapsed().as_secs_f64();
        let is_slow = at >= slow_from && at < slow_until;
        let want = if is_slow {
            FaultMode::Slow(Duration::from_millis(20))
        } else {
            FaultMode::Pass
        };
        if slow.mode() != want {
            slow.set(want);
        }
        samples.push(sample(&mut status, &store, &w, pid, &counter, at, is_slow).await);
        if at >= run_for {
            break;
        }
    }
    let writes = written.load(Ordering::Relaxed);
    let load_seconds = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    // Every lease expires (10 s TTL), then the newest delta must reach etcd's revision.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let end = status.status().await.unwrap().header().unwrap().revision();
    let settle = Instant::now();
    loop {
        let s = sample(
            &mut status,
            &store,
            &w,
            pid,
            &counter,
            t0.elapsed().as_secs_f64(),
            false,
        )
        .await;
        let done = s.stored >= end;
        samples.push(s);
        if done {
            break;
        }
        assert!(
            settle.elapsed() < Duration::from_secs(300),
            "the deltas never reached revision {end}:\n{}",
            w.log_text()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let caught_up = settle.elapsed().as_secs_f64();

    report(
        &samples,
        writes,
        load_seconds,
        slow_from,
        slow_until,
        caught_up,
        end,
    );

    // The chain restored equals the source.
    let listed = store.list().await.unwrap();
    let deltas = listed.iter().filter(|s| s.kind == Kind::Incr).count();
    let bytes: u64 = store
        .list_sized()
        .await
        .unwrap()
        .iter()
        .map(|(_, size)| size)
        .sum();
    let target = dir.path().join("restored");
    let mut restore = support::warden::command();
    for (k, v) in ACCOUNT.config_overrides("store", &s3.endpoint(), "bench", "wh") {
        restore.env(
            format!("ETCD_WARDEN_{}", k.replace('.', "_").to_ascii_uppercase()),
            v,
        );
    }
    restore
        .args(["restore", "--data-dir"])
        .arg(target.join("d.etcd"));
    restore
        .arg("--etcd-bin")
        .arg(support::etcd::Release::V35.bin_dir());
    let t = Instant::now();
    common::run(&mut restore);
    let restore_seconds = t.elapsed().as_secs_f64();
    let restored = support::boltdb::live_keys(&target.join("d.etcd/member/snap/db"));
    let mut source = client.clone();
    let resp = source
        .get(vec![0u8], Some(GetOptions::new().with_from_key()))
        .await
        .unwrap();
    let want: Vec<support::boltdb::Kv> = resp
        .kvs()
        .iter()
        .map(|kv| {
            (
                kv.key().to_vec(),
                kv.value().to_vec(),
                kv.create_revision(),
                kv.mod_revision(),
                kv.version(),
            )
        })
        .collect();
    println!(
        "restore: {} snapshots ({} deltas, {:.1} MiB stored) to revision {end} in {restore_seconds:.1} s; \
         {} keys, {}",
        listed.len(),
        deltas,
        bytes as f64 / 1048576.0,
        restored.len(),
        if restored == want {
            "equal to the source key by key".to_string()
        } else {
            format!("DIFFERENT from the source's {} keys", want.len())
        }
    );
    assert!(restored == want, "the restore differs from the source");
}

#[allow(clippy::too_many_arguments)]
async fn sample(
    status: &mut etcd_client::Client,
    store: &SnapshotStore,
    w: &Warden,
    pid: u32,
    counter: &RequestCounter,
    at: f64,
    slow: bool,
) -> Sample {
    let revision = status.status().await.unwrap().header().unwrap().revision();
    let stored = store
        .list()
        .await
        .map(|l| l.iter().map(|s| s.last_revision).max().unwrap_or(0))
        .unwrap_or(0);
    let buffered = match reqwest::get(w.url("/metrics")).await {
        Ok(r) => r
            .text()
            .await
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("etcd_warden_delta_buffered_bytes "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64,
        Err(_) => 0,
    };
    let status_file = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kib = status_file
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Sample {
        at,
        revision,
        stored,
        buffered,
        rss_kib,
        cpu_ticks: ticks(11) + ticks(12),
        requests: counter.requests.load(Ordering::Relaxed),
        slow,
    }
}

/// The time at which etcd's revision first reached `revision`, from the samples.
fn reached(samples: &[Sample], revision: i64) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.revision >= revision)
        .map(|s| s.at)
}

fn report(
    samples: &[Sample],
    writes: u64,
    load_seconds: f64,
    slow_from: f64,
    slow_until: f64,
    caught_up: f64,
    end: i64,
) {
    let phase = |name: &str, pick: &dyn Fn(&Sample) -> bool| {
        let picked: Vec<&Sample> = samples.iter().filter(|s| pick(s)).collect();
        if picked.len() < 2 {
            return;
        }
        let mut rev_lag: Vec<i64> = picked.iter().map(|s| s.revision - s.stored).collect();
        let mut time_lag: Vec<f64> = picked
            .iter()
            .map(|s| s.at - reached(samples, s.stored.max(1)).unwrap_or(0.0))
            .collect();
        rev_lag.sort();
        time_lag.sort_by(f64::total_cmp);
        let (first, last) = (picked[0], picked[picked.len() - 1]);
        let secs = last.at - first.at;
        let revs_per_s = (last.revision - first.revision) as f64 / secs;
        let cpu = (last.cpu_ticks - first.cpu_ticks) as f64 / 100.0 / secs;
        let req_per_s = (last.requests - first.requests) as f64 / secs;
        let buffered = picked.iter().map(|s| s.buffered).max().unwrap_or(0);
        let rss = picked.iter().map(|s| s.rss_kib).max().unwrap_or(0);
        let pct = |v: &[f64], p: f64| v[((v.len() - 1) as f64 * p) as usize];
        println!(
            "| {name} | {secs:.0} | {revs_per_s:.0} | {} / {} | {:.1} / {:.1} / {:.1} | {:.1} | {:.1} | {cpu:.2} | {req_per_s:.1} |",
            rev_lag[rev_lag.len() / 2],
            rev_lag[rev_lag.len() - 1],
            pct(&time_lag, 0.5),
            pct(&time_lag, 0.99),
            time_lag[time_lag.len() - 1],
            buffered as f64 / 1048576.0,
            rss as f64 / 1024.0,
        );
    };
    println!(
        "load: {writes} writes in {load_seconds:.1} s ({:.0}/s), end revision {end}; the deltas caught up {caught_up:.1} s after the lease expiries",
        writes as f64 / load_seconds
    );
    println!(
        "| phase | s | revisions/s | lag, revisions (median / max) | lag, s (median / p99 / max) | delta buffer max, MiB (limit {}) | RSS max, MiB | CPU, cores | store requests/s |",
        MEMORY_LIMIT >> 20
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    phase("store at full speed", &|s| s.at >= 5.0 && s.at < slow_from);
    phase("store slow (20 ms a chunk)", &|s| s.slow);
    phase("after the store is fast again", &|s| {
        s.at >= slow_until && s.at < slow_until + 10.0
    });
    let _ = slow_until;
}

/// A TCP proxy counting the HTTP requests sent through it (request lines ending `HTTP/1.1`).
struct RequestCounter {
    addr: std::net::SocketAddr,
    requests: Arc<AtomicU64>,
}

impl RequestCounter {
    async fn start(target: &str) -> RequestCounter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(AtomicU64::new(0));
        let target = target.to_string();
        let counted = requests.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let (target, counted) = (target.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let up = async move {
                        let mut buf = vec![0u8; 64 << 10];
                        let mut tail: Vec<u8> = Vec::new();
                        loop {
                            let n = match ri.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            tail.extend_from_slice(&buf[..n]);
                            let pattern = b" HTTP/1.1\r\n";
                            let found =
                                tail.windows(pattern.len()).filter(|w| w == pattern).count();
                            counted.fetch_add(found as u64, Ordering::Relaxed);
                            let keep = tail.len().min(pattern.len() - 1);
                            tail.drain(..tail.len() - keep);
                            if wo.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = wo.shutdown().await;
                    };
                    let down = async move {
                        let _ = tokio::io::copy(&mut ro, &mut wi).await;
                        let _ = wi.shutdown().await;
                    };
                    tokio::join!(up, down);
                });
            }
        });
        RequestCounter { addr, requests }
    }
}
