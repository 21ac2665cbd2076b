//! The ownership watchdog against a real etcd process: the real process killer SIGTERMs it, a
//! stand-in for the kubelet restarts it, the real health check sees it come back, and only then
//! is the final snapshot requested. DNS is real (hickory-server on loopback); the snapshot side is
//! a fake that takes a real etcd snapshot stream to prove etcd answers.

mod support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_warden::config::{EtcdConfig, KillConfig, OwnerConfig};
use etcd_warden::owner::adapters::{EtcdStatusHealth, OwnerStatus};
use etcd_warden::owner::{
    Backoff, OwnerMetrics, OwnerResolver, SeamError, Seams, Snapshotter, Watchdog, WatchdogConfig,
};
use etcd_warden::process::ProcKiller;
use etcd_warden::server::{Readiness, StatusSource};
use support::dns::DnsServer;
use support::etcd::{EtcdCluster, Release};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NAME: &str = "owner.shoot.warden.test";
const ID: &str = "seed-a";

/// Takes a real snapshot stream from etcd as the "final snapshot", so it fails unless etcd answers.
struct StreamingSnapshotter {
    endpoint: String,
    regular: Mutex<Vec<bool>>,
    finals: AtomicU32,
    bytes: AtomicU32,
}

#[async_trait::async_trait]
impl Snapshotter for StreamingSnapshotter {
    async fn set_regular(&self, on: bool) -> Result<(), SeamError> {
        self.regular.lock().expect("lock").push(on);
        Ok(())
    }

    async fn latest_is_final(&self) -> Result<bool, SeamError> {
        Ok(self.finals.load(Ordering::SeqCst) > 0)
    }

    async fn request_final(&self) -> Result<String, SeamError> {
        let fail = |e: etcd_client::Error| SeamError(e.to_string());
        let mut client = etcd_client::Client::connect([&self.endpoint], None)
            .await
            .map_err(fail)?;
        let mut stream = client.snapshot().await.map_err(fail)?;
        let mut total = 0usize;
        while let Some(chunk) = stream.message().await.map_err(fail)? {
            total += chunk.blob().len();
        }
        self.bytes.store(total as u32, Ordering::SeqCst);
        self.finals.fetch_add(1, Ordering::SeqCst);
        Ok("Full-00000000-00000001-1700000000.gz.final".into())
    }
}

#[tokio::test]
async fn losing_ownership_kills_real_etcd_and_snapshots_it_after_it_comes_back() {
    let cluster = EtcdCluster::single(Release::V35).await;
    let endpoint = cluster.endpoints()[0].clone();
    let data_dir = cluster.members[0].data_dir.display().to_string();
    let first_pid = cluster.members[0].pid().expect("etcd running");
    let cluster = Arc::new(Mutex::new(cluster));

    // The kubelet: restart etcd whenever its process has exited.
    let restarts = Arc::new(AtomicU32::new(0));
    let kubelet_stop = CancellationToken::new();
    let kubelet = tokio::spawn({
        let (cluster, restarts, stop) = (cluster.clone(), restarts.clone(), kubelet_stop.clone());
        async move {
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let mut cluster = cluster.lock().expect("lock");
                let member = &mut cluster.members[0];
                if !member.is_running() {
                    member.kill();
                    member.start();
                    restarts.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    });

    let dns = DnsServer::start().await;
    dns.set_txt(NAME, &[ID]).await;
    let owner = OwnerConfig {
        name: NAME.into(),
        id: ID.into(),
        interval: Duration::from_millis(100),
        timeout: Duration::from_millis(500),
        nameservers: vec![dns.addr()],
        failure_threshold: 2,
        ttl_cap: Duration::ZERO,
    };
    let etcd = EtcdConfig {
        endpoints: vec![endpoint.clone()],
        tls: None,
        username: None,
        password: None,
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(2),
    };
    let snapshotter = Arc::new(StreamingSnapshotter {
        endpoint: endpoint.clone(),
        regular: Mutex::new(Vec::new()),
        finals: AtomicU32::new(0),
        bytes: AtomicU32::new(0),
    });
    let (readiness_tx, mut readiness) = watch::channel(Readiness::starting());
    let seams = Seams {
        lookup: Arc::new(OwnerResolver::new(&owner).expect("resolver")),
        // The data dir is unique to this test's etcd, so no other etcd on the machine matches.
        process: Arc::new(ProcKiller::new(&KillConfig {
            process_name: "etcd".into(),
            cmdline_contains: Some(data_dir),
            grace: Duration::from_secs(10),
        })),
        snapshotter: snapshotter.clone(),
        health: Arc::new(EtcdStatusHealth::new(etcd, Duration::from_secs(1))),
        readiness: Arc::new(readiness_tx),
    };
    let config = WatchdogConfig {
        interval: owner.interval,
        failure_threshold: owner.failure_threshold,
        health_interval: Duration::from_millis(100),
        backoff: Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        },
    };
    let watchdog = Watchdog::new(config, seams, OwnerMetrics::default());
    let mut status = watchdog.status();
    let status_source = OwnerStatus(watchdog.status());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(watchdog.run(cancel.clone()));

    let wait = Duration::from_secs(20);
    tokio::time::timeout(wait, readiness.wait_for(|r| r.ready))
        .await
        .expect("ready as owner with a healthy etcd")
        .expect("readiness channel");
    assert_eq!(readiness.borrow().state, "Active");

    dns.set_txt(NAME, &["seed-b"]).await;
    let stored = tokio::time::timeout(wait, status.wait_for(|s| s.final_snapshot.is_some()))
        .await
        .is_ok();
    assert!(stored, "no final snapshot; status {:?}", *status.borrow());

    assert!(!readiness.borrow().ready);
    assert_eq!(readiness.borrow().state, "Deactivated");
    assert_eq!(
        restarts.load(Ordering::SeqCst),
        1,
        "etcd was killed once and came back"
    );
    let new_pid = cluster.lock().expect("lock").members[0]
        .pid()
        .expect("etcd restarted");
    assert_ne!(new_pid, first_pid);
    assert_eq!(snapshotter.finals.load(Ordering::SeqCst), 1);
    assert!(
        snapshotter.bytes.load(Ordering::SeqCst) > 0,
        "a real snapshot stream"
    );
    assert_eq!(
        *snapshotter.regular.lock().expect("lock"),
        vec![true, false]
    );
    assert_eq!(status_source.status()["state"], "deactivated");

    // Sticky: our ID again changes nothing, and etcd is left alone.
    dns.set_txt(NAME, &[ID]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!readiness.borrow().ready);
    assert_eq!(restarts.load(Ordering::SeqCst), 1);
    assert_eq!(snapshotter.finals.load(Ordering::SeqCst), 1);

    cancel.cancel();
    task.await.expect("watchdog");
    kubelet_stop.cancel();
    kubelet.await.expect("kubelet");
}
