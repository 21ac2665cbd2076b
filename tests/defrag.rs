//! Scheduled defragmentation against a real 3-member etcd 3.5: the actor next to the leader
//! defragments every member, one at a time, while a writer keeps writing.

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, CompactionOptions};
use etcd_warden::config::{EtcdConfig, GcPolicy};
use etcd_warden::etcd::RotatingClient;
use etcd_warden::snapshot::actor;
use etcd_warden::snapshot::engine::EtcdEngine;
use etcd_warden::snapshot::gate::Gate;
use etcd_warden::snapshot::metrics::SnapshotMetrics;
use etcd_warden::store::gc::Retention;
use etcd_warden::store::{Codec, Kind};
use prometheus_client::registry::Registry;
use support::etcd::{EtcdCluster, Release};
use tokio_util::sync::CancellationToken;

/// Each member's database size and the part in use by ID, from its own status; and which
/// member leads.
async fn sizes(endpoints: &[String]) -> (HashMap<u64, (i64, i64)>, u64) {
    let mut out = HashMap::new();
    let mut leader = 0;
    for url in endpoints {
        let mut c = Client::connect([url.as_str()], None).await.unwrap();
        let s = c.status().await.unwrap();
        let id = s.header().unwrap().member_id();
        out.insert(id, (s.db_size(), s.raft_used_db_size()));
        leader = s.leader();
    }
    (out, leader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defragmentation_shrinks_every_member_while_a_writer_goes_on() {
    let etcd = EtcdCluster::start(3, Release::V35).await;
    let endpoints = etcd.endpoints();
    let mut client = etcd.client().await;

    // Fragmentation: ~20 MiB of values, most deleted, history compacted away.
    let value = "x".repeat(100 * 1024);
    for i in 0..200 {
        client
            .put(format!("/bulk/{i:04}"), value.clone(), None)
            .await
            .unwrap();
    }
    for i in 0..190 {
        client.delete(format!("/bulk/{i:04}"), None).await.unwrap();
    }
    let rev = support::etcd::revision(&mut client, "/bulk/0199").await;
    client
        .compact(rev, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();

    // A writer over every member, throughout.
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let failed = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = CancellationToken::new();
    let writer = tokio::spawn({
        let (acked, failed, stop) = (acked.clone(), failed.clone(), stop.clone());
        let mut c = etcd.client().await;
        async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                let key = format!("/writer/{n:06}");
                match tokio::time::timeout(Duration::from_secs(5), c.put(key.clone(), "v", None))
                    .await
                {
                    Ok(Ok(_)) => acked.lock().unwrap().push(key),
                    Ok(Err(e)) => failed.lock().unwrap().push(e.to_string()),
                    Err(_) => failed.lock().unwrap().push("timed out".into()),
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    // A member counts the pages the compaction freed as free only once a later write
    // transaction releases them (bbolt keeps them pending until then): the writer's puts do.
    let mut waited = 0;
    let (before, leader) = loop {
        let (s, leader) = sizes(&endpoints).await;
        if s.values().all(|(size, in_use)| *in_use < size / 2) {
            break (s, leader);
        }
        waited += 1;
        assert!(waited < 100, "the compaction never freed the pages: {s:x?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(before.len(), 3);
    for (id, (size, _)) in &before {
        assert!(*size > 15 << 20, "member {id:x}: {size} bytes before");
    }

    // The sidecar next to the leader: its etcd endpoint is the leader's alone.
    let list = client.member_list().await.unwrap();
    let leader_url = list
        .members()
        .iter()
        .find(|m| m.id() == leader)
        .map(|m| m.client_urls()[0].clone())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = support::file_store(dir.path());
    let engine = EtcdEngine::new(
        RotatingClient::connect(&EtcdConfig {
            endpoints: vec![leader_url],
            tls: None,
            username: None,
            password: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
        })
        .await
        .unwrap(),
        store.clone(),
        Codec::Gzip,
        Retention {
            policy: GcPolicy::LimitBased { max_backups: 100 },
            delta_retention: Duration::ZERO,
        },
    );
    let metrics = SnapshotMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let config = support::quiet_actor_config(Duration::ZERO, u64::MAX, Duration::from_secs(60));
    let cancel = CancellationToken::new();
    let (_gate, gate_rx) = tokio::sync::watch::channel(Gate::Open);
    let (actor, task) = actor::spawn(engine, config, gate_rx, metrics, cancel.clone());
    let mut status = actor.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.leader))
        .await
        .expect("the actor sees its member lead")
        .unwrap();
    // Its first full snapshot (the store is empty) comes first; the pass after it.
    drop(status);

    tokio::time::sleep(Duration::from_millis(300)).await;
    let acked_before = acked.lock().unwrap().len();

    let report = actor.defrag().await.expect("defragmentation pass");

    let acked_during = acked.lock().unwrap().len() - acked_before;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    writer.await.unwrap();

    // Every member, one at a time, the leader last.
    assert_eq!(report.defragmented.len(), 3, "{report:?}");
    assert_eq!(report.defragmented.last(), Some(&leader), "{report:?}");
    let (after, _) = sizes(&endpoints).await;
    for (id, (size, _)) in &after {
        let was = before[id].0;
        assert!(
            *size < was / 2,
            "member {id:x}: {was} bytes before, {size} after"
        );
    }

    // A full snapshot after the pass, the newest in the store.
    let snap = report.snapshot.expect("a full snapshot follows");
    assert_eq!(snap.kind, Kind::Full);
    let chain = store.latest_chain().await.unwrap();
    assert_eq!(chain.full_snapshot.as_ref(), Some(&snap));

    // The writer went on: no put failed, and every acknowledged key is there.
    let failed = failed.lock().unwrap().clone();
    assert!(failed.is_empty(), "failed puts: {failed:?}");
    assert!(acked_during > 0, "no put was acknowledged during the pass");
    let acked = acked.lock().unwrap().clone();
    let got = client
        .get(
            "/writer/",
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    let present: std::collections::HashSet<&[u8]> = got.kvs().iter().map(|kv| kv.key()).collect();
    for key in &acked {
        assert!(
            present.contains(key.as_bytes()),
            "{key} acknowledged but lost"
        );
    }

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.lines()
            .any(|l| l == r#"etcdbr_defragmentation_duration_seconds_count{succeeded="true"} 3"#),
        "{text}"
    );

    cancel.cancel();
    task.await.unwrap();
}
