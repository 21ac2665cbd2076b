//! The ownership watchdog end to end: real DNS (hickory-server on loopback) and the real resolver,
//! in-memory fakes for etcd health, the process killer and the snapshot side.

#[path = "support/dns.rs"]
mod dns;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dns::{DnsServer, Mode};
use etcd_warden::config::OwnerConfig;
use etcd_warden::owner::{
    Backoff, EtcdHealth, OwnerMetrics, OwnerResolver, ReadinessSink, SeamError, Seams, Snapshotter,
    State, Watchdog, WatchdogConfig, WatchdogStatus,
};
use etcd_warden::process::{KillReport, ProcessControl, ProcessError};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NAME: &str = "owner.shoot.warden.test";
const ID: &str = "seed-a";

/// Everything the fakes saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Ready(bool),
    Regular(bool),
    Kill,
    CheckStore,
    Final,
}

#[derive(Default)]
struct World {
    calls: Mutex<Vec<Call>>,
    healthy: AtomicBool,
    ready: AtomicBool,
    latest_is_final: AtomicBool,
    /// How many final snapshot requests fail before one succeeds.
    final_failures: AtomicU32,
}

impl World {
    fn log(&self, call: Call) {
        self.calls.lock().expect("lock").push(call);
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }

    fn count(&self, call: &Call) -> usize {
        self.calls().iter().filter(|c| *c == call).count()
    }
}

struct Fake(Arc<World>);

#[async_trait::async_trait]
impl Snapshotter for Fake {
    async fn set_regular(&self, on: bool) -> Result<(), SeamError> {
        self.0.log(Call::Regular(on));
        Ok(())
    }
    async fn latest_is_final(&self) -> Result<bool, SeamError> {
        self.0.log(Call::CheckStore);
        Ok(self.0.latest_is_final.load(Ordering::SeqCst))
    }
    async fn request_final(&self) -> Result<String, SeamError> {
        self.0.log(Call::Final);
        let left = self.0.final_failures.load(Ordering::SeqCst);
        if left > 0 {
            self.0.final_failures.store(left - 1, Ordering::SeqCst);
            return Err(SeamError("store unreachable".into()));
        }
        self.0.latest_is_final.store(true, Ordering::SeqCst);
        Ok("Full-00000000-00000042-1700000000.gz.final".into())
    }
}

#[async_trait::async_trait]
impl EtcdHealth for Fake {
    async fn healthy(&self) -> bool {
        self.0.healthy.load(Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl ProcessControl for Fake {
    async fn kill_etcd(&self) -> Result<KillReport, ProcessError> {
        self.0.log(Call::Kill);
        // A real kill takes etcd down; the kubelet brings it back a little later.
        let world = self.0.clone();
        world.healthy.store(false, Ordering::SeqCst);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            world.healthy.store(true, Ordering::SeqCst);
        });
        Ok(KillReport::default())
    }
}

impl ReadinessSink for Fake {
    fn set_ready(&self, ready: bool, _state: &str, _reason: &str) {
        self.0.log(Call::Ready(ready));
        self.0.ready.store(ready, Ordering::SeqCst);
    }
}

struct Running {
    world: Arc<World>,
    registry: Registry,
    status: watch::Receiver<WatchdogStatus>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<State>,
}

impl Running {
    async fn start(server: &DnsServer, world: Arc<World>) -> Running {
        let owner = OwnerConfig {
            name: NAME.into(),
            id: ID.into(),
            interval: Duration::from_millis(50),
            timeout: Duration::from_millis(200),
            nameservers: vec![server.addr()],
            failure_threshold: 2,
            ttl_cap: Duration::ZERO,
        };
        let config = WatchdogConfig {
            interval: owner.interval,
            failure_threshold: owner.failure_threshold,
            health_interval: Duration::from_millis(20),
            backoff: Backoff {
                initial: Duration::from_millis(20),
                max: Duration::from_millis(80),
            },
        };
        let seams = Seams {
            lookup: Arc::new(OwnerResolver::new(&owner).expect("resolver")),
            process: Arc::new(Fake(world.clone())),
            snapshotter: Arc::new(Fake(world.clone())),
            health: Arc::new(Fake(world.clone())),
            readiness: Arc::new(Fake(world.clone())),
        };
        let metrics = OwnerMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let watchdog = Watchdog::new(config, seams, metrics);
        let status = watchdog.status();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(watchdog.run(cancel.clone()));
        Running {
            world,
            registry,
            status,
            cancel,
            task,
        }
    }

    /// Waits until the status satisfies `done`.
    async fn until(&mut self, what: &str, done: impl Fn(&WatchdogStatus) -> bool) {
        let waited =
            tokio::time::timeout(Duration::from_secs(5), self.status.wait_for(|s| done(s)))
                .await
                .map(|r| r.is_ok())
                .unwrap_or(false);
        if !waited {
            panic!(
                "timed out waiting for {what}; status {:?}, calls {:?}",
                *self.status.borrow(),
                self.world.calls()
            );
        }
    }

    fn metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("encode");
        out
    }

    async fn stop(self) -> State {
        self.cancel.cancel();
        self.task.await.expect("watchdog task")
    }
}

fn healthy_world() -> Arc<World> {
    let world = Arc::new(World::default());
    world.healthy.store(true, Ordering::SeqCst);
    world
}

#[tokio::test]
async fn owner_then_other_owner_deactivates_for_good_with_one_final_snapshot() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let mut run = Running::start(&server, healthy_world()).await;
    run.until("active and ready", |s| s.state == "active" && s.ready)
        .await;
    assert_eq!(
        run.world.calls(),
        vec![Call::Ready(false), Call::Regular(true), Call::Ready(true)]
    );

    server.set_txt(NAME, &["seed-b"]).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(
        run.world.calls()[3..],
        [
            Call::Ready(false),
            Call::Regular(false),
            Call::Kill,
            Call::CheckStore,
            Call::Final
        ]
    );

    // Back to our ID: Deactivated is sticky, nothing more happens.
    server.set_txt(NAME, &[ID]).await;
    let checks_before = run.status.borrow().last_check_at;
    run.until("two more checks", |s| s.last_check_at > checks_before)
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!run.world.ready.load(Ordering::SeqCst));
    assert_eq!(run.world.count(&Call::Final), 1);
    assert_eq!(run.world.count(&Call::Kill), 1);
    let metrics = run.metrics();
    for line in [
        "etcd_warden_owner_state{state=\"deactivated\"} 1",
        "etcd_warden_owner_final_snapshot_taken 1",
        "etcd_warden_owner_checks_total{result=\"other_owner\"} ",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    assert!(matches!(run.stop().await, State::Deactivated(_)));
}

#[tokio::test]
async fn a_removed_record_deactivates_and_takes_the_final_snapshot() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let mut run = Running::start(&server, healthy_world()).await;
    run.until("ready", |s| s.ready).await;
    server.remove_txt(NAME).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(run.world.count(&Call::Final), 1);
    assert!(!run.world.ready.load(Ordering::SeqCst));
    run.stop().await;
}

#[tokio::test]
async fn an_unresolvable_record_suspends_without_final_snapshot_and_resumes() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let mut run = Running::start(&server, healthy_world()).await;
    run.until("ready", |s| s.ready).await;

    server.set_mode(Mode::ServFail);
    run.until("suspended", |s| s.state == "suspended").await;
    assert!(!run.world.ready.load(Ordering::SeqCst));
    // Several more failed checks: still one kill, never a final snapshot.
    let failures = run.status.borrow().consecutive_failures;
    run.until("more failures", |s| s.consecutive_failures >= failures + 3)
        .await;
    assert_eq!(run.world.count(&Call::Kill), 1);
    assert_eq!(run.world.count(&Call::Final), 0);
    assert_eq!(run.world.count(&Call::CheckStore), 0);

    server.set_mode(Mode::Silent);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(run.status.borrow().state, "suspended");

    server.set_mode(Mode::Normal);
    run.until("active and ready again", |s| s.state == "active" && s.ready)
        .await;
    assert_eq!(run.world.count(&Call::Regular(true)), 2);
    assert_eq!(run.world.count(&Call::Final), 0);
    run.stop().await;
}

#[tokio::test]
async fn one_failed_lookup_below_the_threshold_changes_nothing() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let mut run = Running::start(&server, healthy_world()).await;
    run.until("ready", |s| s.ready).await;
    server.set_mode(Mode::ServFail);
    run.until("one failure", |s| s.consecutive_failures == 1)
        .await;
    server.set_mode(Mode::Normal);
    run.until("recovered", |s| s.consecutive_failures == 0)
        .await;
    assert_eq!(run.status.borrow().state, "active");
    assert_eq!(run.world.count(&Call::Kill), 0);
    assert!(run.world.ready.load(Ordering::SeqCst));
    run.stop().await;
}

#[tokio::test]
async fn a_restart_after_the_final_snapshot_takes_no_second_one() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &["seed-b"]).await;
    let world = healthy_world();
    world.latest_is_final.store(true, Ordering::SeqCst);
    let mut run = Running::start(&server, world).await;
    run.until("final found in store", |s| {
        s.final_snapshot.as_deref() == Some("found in store")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        run.world.calls(),
        vec![Call::Ready(false), Call::Kill, Call::CheckStore]
    );
    run.stop().await;
}

#[tokio::test]
async fn a_failing_store_is_retried_until_the_final_snapshot_is_stored() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &["seed-b"]).await;
    let world = healthy_world();
    world.final_failures.store(3, Ordering::SeqCst);
    let started = Instant::now();
    let mut run = Running::start(&server, world).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(
        run.world.count(&Call::Final),
        4,
        "three failures, then stored"
    );
    // Backoff 20 + 40 + 80 ms before the last attempt.
    assert!(started.elapsed() >= Duration::from_millis(140));
    assert!(!run.world.ready.load(Ordering::SeqCst));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        run.world.count(&Call::Final),
        4,
        "nothing after it is stored"
    );
    run.stop().await;
}

#[tokio::test]
async fn readiness_follows_etcd_health_while_active() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let world = Arc::new(World::default());
    let mut run = Running::start(&server, world.clone()).await;
    run.until("active", |s| s.state == "active").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !world.ready.load(Ordering::SeqCst),
        "etcd unhealthy: not ready"
    );
    world.healthy.store(true, Ordering::SeqCst);
    run.until("ready", |s| s.ready).await;
    world.healthy.store(false, Ordering::SeqCst);
    run.until("not ready", |s| !s.ready).await;
    run.stop().await;
}
