//! The ownership watchdog against a real etcd process: the real process killer SIGTERMs it, a
//! stand-in for the kubelet restarts it, the real etcd API (health, members, a linearizable
//! revision) sees it come back, and only then is the final snapshot requested. DNS is real
//! (hickory-server on loopback); the store side is in memory and its "final snapshot" takes a real
//! etcd snapshot stream, to prove etcd answers.

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_warden::backoff::Backoff;
use etcd_warden::config::{EtcdConfig, KillConfig, OwnerConfig};
use etcd_warden::owner::handoff::{FenceMarker, HandOffRecord};
use etcd_warden::owner::metrics::OwnerMetrics;
use etcd_warden::owner::production::{EtcdApi, OwnerStatus};
use etcd_warden::owner::resolve::OwnerResolver;
use etcd_warden::owner::watchdog::{Context, SeamError, Snapshots, Watchdog, WatchdogConfig};
use etcd_warden::process::ProcKiller;
use etcd_warden::server::{Readiness, StatusSource};
use etcd_warden::snapshot::gate::Gate;
use etcd_warden::store::{Codec, Kind, Snapshot};
use support::dns::DnsServer;
use support::etcd::{EtcdCluster, Release};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NAME: &str = "owner.shoot.warden.test";
const ID: &str = "seed-a";

/// In-memory hand-off objects; the final is a real etcd snapshot stream, counted.
struct StreamingSnapshots {
    endpoint: String,
    fences: Mutex<BTreeSet<u64>>,
    finals: Mutex<Vec<Snapshot>>,
    record: Mutex<Option<HandOffRecord>>,
    taken: AtomicU32,
    bytes: AtomicU32,
}

#[async_trait::async_trait]
impl Snapshots for StreamingSnapshots {
    async fn write_fence(&self, member: u64, _: &FenceMarker) -> Result<(), SeamError> {
        self.fences.lock().expect("lock").insert(member);
        Ok(())
    }
    async fn fence(&self, member: u64) -> Result<Option<FenceMarker>, SeamError> {
        assert!(!self.fences.lock().expect("lock").contains(&member));
        Ok(None)
    }
    async fn fenced(&self) -> Result<BTreeSet<u64>, SeamError> {
        Ok(self.fences.lock().expect("lock").clone())
    }
    async fn finals(&self) -> Result<Vec<Snapshot>, SeamError> {
        Ok(self.finals.lock().expect("lock").clone())
    }
    async fn latest_full(&self) -> Result<Option<Snapshot>, SeamError> {
        Ok(self.finals.lock().expect("lock").last().cloned())
    }
    async fn record(&self) -> Result<Option<HandOffRecord>, SeamError> {
        Ok(self.record.lock().expect("lock").clone())
    }
    async fn write_record(&self, record: &HandOffRecord) -> Result<(), SeamError> {
        *self.record.lock().expect("lock") = Some(record.clone());
        Ok(())
    }
    async fn take_final(&self, min_revision: i64) -> Result<Snapshot, SeamError> {
        let mut client = etcd_client::Client::connect([&self.endpoint], None).await?;
        let revision = client.status().await?.header().map_or(0, |h| h.revision());
        assert!(revision >= min_revision, "{revision} < {min_revision}");
        let mut stream = client.snapshot().await?;
        let mut total = 0usize;
        while let Some(chunk) = stream.message().await? {
            total += chunk.blob().len();
        }
        self.bytes.store(total as u32, Ordering::SeqCst);
        self.taken.fetch_add(1, Ordering::SeqCst);
        let snap = Snapshot::new(
            "",
            Kind::Full,
            0,
            revision,
            chrono::Utc::now(),
            Codec::Gzip,
            true,
        );
        self.finals.lock().expect("lock").push(snap.clone());
        Ok(snap)
    }
}

#[tokio::test]
async fn losing_ownership_kills_real_etcd_and_snapshots_it_after_it_comes_back() {
    let cluster = EtcdCluster::single(Release::V35).await;
    let endpoint = cluster.endpoints()[0].clone();
    let data_dir = cluster.members[0].data_dir.display().to_string();
    let first_pid = cluster.members[0].pid().expect("etcd running");
    let mut writer = cluster.client().await;
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
    let snapshots = Arc::new(StreamingSnapshots {
        endpoint: endpoint.clone(),
        fences: Mutex::new(BTreeSet::new()),
        finals: Mutex::new(Vec::new()),
        record: Mutex::new(None),
        taken: AtomicU32::new(0),
        bytes: AtomicU32::new(0),
    });
    let (readiness_tx, mut readiness) = watch::channel(Readiness::starting());
    let (gate, gates) = watch::channel(Gate::Closed);
    let ctx = Context {
        lookup: Arc::new(OwnerResolver::new(&owner).expect("resolver")),
        // The data dir is unique to this test's etcd, so no other etcd on the machine matches.
        process: Arc::new(ProcKiller::new(&KillConfig {
            process_name: "etcd".into(),
            cmdline_contains: Some(data_dir),
            grace: Duration::from_secs(10),
        })),
        etcd: Arc::new(EtcdApi::new(etcd, Duration::from_secs(1))),
        snapshots: snapshots.clone(),
        readiness: Arc::new(readiness_tx),
        gate,
    };
    let config = WatchdogConfig {
        owner_id: ID.into(),
        interval: owner.interval,
        failure_threshold: owner.failure_threshold,
        health_interval: Duration::from_millis(100),
        backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(1)),
    };
    let watchdog = Watchdog::new(config, ctx, OwnerMetrics::default());
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
    assert_eq!(*gates.borrow(), Gate::Open);
    let acknowledged = writer
        .put("/before/flip", "v", None)
        .await
        .expect("put")
        .header()
        .expect("header")
        .revision();

    dns.set_txt(NAME, &["seed-b"]).await;
    let stored = tokio::time::timeout(wait, status.wait_for(|s| s.final_snapshot.is_some()))
        .await
        .is_ok();
    assert!(stored, "no final snapshot; status {:?}", *status.borrow());

    assert!(!readiness.borrow().ready);
    assert_eq!(readiness.borrow().state, "Deactivated");
    assert_eq!(*gates.borrow(), Gate::Final);
    assert_eq!(
        restarts.load(Ordering::SeqCst),
        1,
        "etcd was killed once and came back"
    );
    let new_pid = cluster.lock().expect("lock").members[0]
        .pid()
        .expect("etcd restarted");
    assert_ne!(new_pid, first_pid);
    assert_eq!(snapshots.taken.load(Ordering::SeqCst), 1);
    assert!(
        snapshots.bytes.load(Ordering::SeqCst) > 0,
        "a real snapshot stream"
    );
    let fin = snapshots.finals.lock().expect("lock")[0].clone();
    assert!(
        fin.last_revision >= acknowledged,
        "{fin:?} misses {acknowledged}"
    );
    let s = status.borrow().clone();
    assert_eq!(
        snapshots.fences.lock().expect("lock").len(),
        1,
        "one member fenced"
    );
    assert!(s.kill.as_ref().is_some_and(|k| k.verified), "{s:?}");
    assert!(s.member_id.is_some(), "{s:?}");
    assert_eq!(status_source.status()["state"], "deactivated");

    // Sticky: our ID again changes nothing, and etcd is left alone.
    dns.set_txt(NAME, &[ID]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!readiness.borrow().ready);
    assert_eq!(restarts.load(Ordering::SeqCst), 1);
    assert_eq!(snapshots.taken.load(Ordering::SeqCst), 1);

    cancel.cancel();
    task.await.expect("watchdog");
    kubelet_stop.cancel();
    kubelet.await.expect("kubelet");
}

/// The owner lookup, remembering when it first said "someone else".
struct TimedLookup {
    inner: OwnerResolver,
    not_owner_at: Mutex<Option<std::time::Instant>>,
}

#[async_trait::async_trait]
impl etcd_warden::owner::resolve::OwnerLookup for TimedLookup {
    async fn check(&self) -> etcd_warden::owner::resolve::CheckResult {
        let result = self.inner.check().await;
        if result.verdict() == Some(etcd_warden::owner::protocol::Verdict::NotOwner) {
            self.not_owner_at
                .lock()
                .expect("lock")
                .get_or_insert_with(std::time::Instant::now);
        }
        result
    }
}

/// The real killer, remembering when the kill began (SIGTERM follows within microseconds: a
/// /proc scan and the signal).
struct TimedKiller {
    inner: ProcKiller,
    first_kill_at: Mutex<Option<std::time::Instant>>,
}

#[async_trait::async_trait]
impl etcd_warden::process::ProcessControl for TimedKiller {
    async fn probe(
        &self,
    ) -> Result<Vec<etcd_warden::process::ProcessId>, etcd_warden::process::ProcessError> {
        self.inner.probe().await
    }
    async fn kill_etcd(
        &self,
        earlier: &[etcd_warden::process::ProcessId],
    ) -> Result<etcd_warden::process::KillReport, etcd_warden::process::ProcessError> {
        self.first_kill_at
            .lock()
            .expect("lock")
            .get_or_insert_with(std::time::Instant::now);
        self.inner.kill_etcd(earlier).await
    }
}

/// An S3 endpoint that accepts connections and never answers.
async fn blackhole() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    (format!("http://{addr}"), task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kill_never_waits_behind_snapshots_queued_against_a_store_that_does_not_answer() {
    use etcd_warden::snapshot::actor::{self, ActorConfig};
    use etcd_warden::snapshot::engine::EtcdEngine;
    use etcd_warden::snapshot::metrics::SnapshotMetrics;
    use etcd_warden::store::SnapshotStore;

    let cluster = EtcdCluster::single(Release::V35).await;
    let endpoint = cluster.endpoints()[0].clone();
    let data_dir = cluster.members[0].data_dir.display().to_string();
    let mut writer = cluster.client().await;
    for i in 0..200 {
        writer
            .put(format!("/bulk/{i}"), vec![b'v'; 4096], None)
            .await
            .expect("put");
    }
    let cluster = Arc::new(Mutex::new(cluster));
    let kubelet_stop = CancellationToken::new();
    let kubelet = tokio::spawn({
        let (cluster, stop) = (cluster.clone(), kubelet_stop.clone());
        async move {
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let mut cluster = cluster.lock().expect("lock");
                if !cluster.members[0].is_running() {
                    cluster.members[0].kill();
                    cluster.members[0].start();
                }
            }
        }
    });

    let etcd = EtcdConfig {
        endpoints: vec![endpoint.clone()],
        tls: None,
        username: None,
        password: None,
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(2),
    };
    // The snapshot actor writes to an S3 endpoint that never answers; the hand-off's own objects
    // go to a local directory, so the watchdog gets as far as the kill and its fence.
    let (s3_endpoint, hole) = blackhole().await;
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&s3_endpoint)
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_bucket_name("backups")
        .with_access_key_id("k")
        .with_secret_access_key("s")
        .build()
        .expect("s3 client");
    let hanging = SnapshotStore::new(Arc::new(s3), "etcd");
    let dir = tempfile::tempdir().expect("temp dir");
    let local = SnapshotStore::new(
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir.path()).expect("fs")),
        "etcd",
    );
    let (gate, gate_rx) = watch::channel(Gate::Closed);
    let engine = EtcdEngine::new(
        etcd_warden::etcd::RotatingClient::connect(&etcd)
            .await
            .expect("client"),
        hanging,
        Codec::Gzip,
        etcd_warden::store::gc::Retention {
            policy: etcd_warden::config::GcPolicy::LimitBased { max_backups: 10 },
            delta_retention: Duration::ZERO,
        },
    );
    let cancel = CancellationToken::new();
    let (actor, actor_task) = actor::spawn(
        engine,
        ActorConfig {
            schedule: std::str::FromStr::from_str("0 0 1 1 *").expect("cron"),
            delta_period: Duration::ZERO,
            delta_memory_limit: 1 << 20,
            gc_period: Duration::from_secs(3600),
            leader_check_interval: Duration::from_millis(100),
        },
        gate_rx,
        SnapshotMetrics::default(),
        cancel.child_token(),
    );

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
    let lookup = Arc::new(TimedLookup {
        inner: OwnerResolver::new(&owner).expect("resolver"),
        not_owner_at: Mutex::new(None),
    });
    let killer = Arc::new(TimedKiller {
        inner: ProcKiller::new(&KillConfig {
            process_name: "etcd".into(),
            cmdline_contains: Some(data_dir),
            grace: Duration::from_secs(10),
        }),
        first_kill_at: Mutex::new(None),
    });
    let (readiness_tx, mut readiness) = watch::channel(Readiness::starting());
    let ctx = Context {
        lookup: lookup.clone(),
        process: killer.clone(),
        etcd: Arc::new(EtcdApi::new(etcd, Duration::from_secs(1))),
        snapshots: Arc::new(etcd_warden::owner::production::StoreSnapshots::new(
            local,
            actor.clone(),
        )),
        readiness: Arc::new(readiness_tx),
        gate,
    };
    let config = WatchdogConfig {
        owner_id: ID.into(),
        interval: owner.interval,
        failure_threshold: owner.failure_threshold,
        health_interval: Duration::from_millis(100),
        backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(1)),
    };
    let watchdog = Watchdog::new(config, ctx, OwnerMetrics::default());
    let mut status = watchdog.status();
    let task = tokio::spawn(watchdog.run(cancel.child_token()));
    tokio::time::timeout(Duration::from_secs(20), readiness.wait_for(|r| r.ready))
        .await
        .expect("active")
        .expect("readiness");

    // Three full snapshots queued: the first streams etcd into a store that never answers.
    let queued: Vec<_> = (0..3)
        .map(|_| {
            let actor = actor.clone();
            tokio::spawn(async move { actor.full().await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        queued.iter().all(|q| !q.is_finished()),
        "the store must hang them"
    );

    dns.set_txt(NAME, &["seed-b"]).await;
    let killed = tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.kill.is_some()),
    )
    .await
    .is_ok();
    assert!(killed, "no kill; status {:?}", *status.borrow());
    let verdict_at = lookup
        .not_owner_at
        .lock()
        .expect("lock")
        .expect("verdict seen");
    let kill_at = killer
        .first_kill_at
        .lock()
        .expect("lock")
        .expect("kill begun");
    let latency = kill_at.saturating_duration_since(verdict_at);
    assert!(
        latency < Duration::from_millis(200),
        "verdict -> SIGTERM took {latency:?}"
    );
    // The queued snapshots were dropped or refused, not left waiting on the store.
    for q in queued {
        let answer = tokio::time::timeout(Duration::from_secs(2), q)
            .await
            .expect("answered at once")
            .expect("task");
        assert!(
            matches!(
                answer,
                Err(etcd_warden::snapshot::actor::ActorError::Cancelled
                    | etcd_warden::snapshot::actor::ActorError::Refused { .. })
            ),
            "{answer:?}"
        );
    }
    println!("verdict -> SIGTERM: {latency:?}");

    cancel.cancel();
    let _ = task.await;
    let _ = actor_task.await;
    hole.abort();
    kubelet_stop.cancel();
    kubelet.await.expect("kubelet");
}
