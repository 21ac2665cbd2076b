//! Owner change → 503 latency: how long after the owner TXT record names another seed the
//! sidecar's `/healthz` answers 503, over repeated flips.
//!
//! `cargo bench --bench owner_flip -- [FLIPS] [INTERVAL_MS]` (defaults 20 and 1000). Real parts:
//! the test DNS server in this process, one etcd 3.5 member, `etcd-warden serve` as a child. A
//! Deactivated sidecar stays deactivated for the life of its process, so each flip runs a fresh
//! sidecar: the record is set back to our ID, the sidecar started and waited for until Active.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::dns::DnsServer;
use support::etcd::{EtcdCluster, Release};
use support::eventually;
use support::warden::Warden;

const RECORD: &str = "owner.shoot.warden.test";

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let flips: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(20);
    let interval_ms: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1000);

    let dns = DnsServer::start().await;
    let etcd = EtcdCluster::single(Release::V35).await;
    let store = tempfile::tempdir().expect("temp dir");
    let mut latencies = Vec::new();
    for flip in 0..flips {
        dns.set_txt(RECORD, &["seed-a"]).await;
        let w = Warden::start(&[
            ("etcd.endpoints", etcd.endpoints()[0].clone()),
            (
                "store.url",
                format!("file://{}/backups", store.path().display()),
            ),
            ("owner.name", RECORD.into()),
            ("owner.id", "seed-a".into()),
            ("owner.interval", format!("{interval_ms}ms")),
            ("owner.ttl_cap", "0s".into()),
            ("owner.nameservers", dns.addr().to_string()),
            // Nothing to kill: the latency of interest ends at the 503.
            ("kill.process_name", "no-such-proc".into()),
            ("snapshot.delta_period", "0s".into()),
        ]);
        let active = eventually(Duration::from_secs(30), || async {
            w.get("/healthz").await.map(|(c, _)| c) == Some(200)
        })
        .await;
        assert!(
            active,
            "flip {flip}: sidecar never became Active:\n{}",
            w.log_text()
        );
        // Flip at a random point of the check cycle, as a real migration does.
        tokio::time::sleep(Duration::from_millis(fastrand(flip as u64) % interval_ms)).await;
        let t0 = Instant::now();
        dns.set_txt(RECORD, &["seed-b"]).await;
        loop {
            if w.get("/healthz").await.map(|(c, _)| c) == Some(503) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = t0.elapsed();
        println!("flip {:>2}: 503 after {:>5} ms", flip + 1, took.as_millis());
        latencies.push(took);
    }
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mean = latencies.iter().map(|d| ms(*d)).sum::<f64>() / latencies.len() as f64;
    let p95 = latencies[(latencies.len() * 95).div_ceil(100).saturating_sub(1)];
    println!(
        "owner flip → 503 over {} flips, interval {interval_ms} ms: min {:.0} ms, median {:.0} ms, mean {mean:.0} ms, p95 {:.0} ms, max {:.0} ms",
        latencies.len(),
        ms(latencies[0]),
        ms(latencies[latencies.len() / 2]),
        ms(p95),
        ms(*latencies.last().expect("at least one flip"))
    );
}

/// A small deterministic spread of flip moments (no rand dependency).
fn fastrand(seed: u64) -> u64 {
    let mut x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0xD1B5_4A32_D192_ED03);
    x ^= x >> 31;
    x.wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 7
}
