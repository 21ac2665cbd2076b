//! Delta replay throughput against round length, and the ceiling: the same transactions sent
//! unguarded with many in flight (order, and so every key's modification revision, not kept).
//!
//! `cargo bench --bench replay -- [N …]`: for each N < 1000, a replay of 20,000 revisions (1 KiB
//! puts over 15,000 keys, every tenth a delete) in rounds of up to N; for N ≥ 1000, the
//! unguarded ceiling with N - 1000 in flight. One etcd 3.5 without fsync, as the restore's
//! temporary etcd runs. Results go in docs/benchmarks.md.
#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;
use etcd_warden::restore::replay::{self, ReplayOp, RevisionGroup};
use std::time::Instant;
use support::etcd::EtcdMember;

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdMember::launch_bulk("x", dir.path().join("data")).await;
    let mut client = etcd_client::Client::connect([etcd.client_url()], None)
        .await
        .unwrap();
    let windows: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = 20000usize;
    let value = vec![b'x'; 1024];
    for (run, w) in windows.iter().enumerate() {
        let mut current = client.status().await.unwrap().header().unwrap().revision();
        let groups: Vec<RevisionGroup> = (0..n)
            .map(|i| {
                let op = if i % 10 == 9 && i > 101 {
                    ReplayOp::Delete {
                        key: format!("r{run}/k{:06}", (i - 101) % 15000).into_bytes(),
                    }
                } else {
                    ReplayOp::Put {
                        key: format!("r{run}/k{:06}", i % 15000).into_bytes(),
                        value: value.clone(),
                    }
                };
                RevisionGroup {
                    revision: current + 1 + i as i64,
                    ops: vec![op],
                }
            })
            .collect();
        let kv = client.kv_client();
        let t = Instant::now();
        if *w >= 1000 {
            // Ceiling: unguarded, order not kept, w-1000 in flight.
            let t = Instant::now();
            use futures::StreamExt;
            futures::stream::iter(groups.iter())
                .for_each_concurrent(*w - 1000, |g| {
                    let mut kv = kv.clone();
                    async move {
                        kv.txn(replay::transaction(g, None)).await.unwrap();
                    }
                })
                .await;
            println!(
                "unordered, {} in flight: {:.0} events/s",
                w - 1000,
                n as f64 / t.elapsed().as_secs_f64()
            );
            continue;
        }
        let done = replay::apply_rounds(&kv, &groups, &mut current, *w)
            .await
            .unwrap();
        let s = t.elapsed().as_secs_f64();
        println!(
            "window {w}: {:.0} events/s, rounds {}",
            done.events as f64 / s,
            done.rounds
        );
    }
    drop(etcd);
}
