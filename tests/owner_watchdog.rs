//! The ownership watchdog end to end: real DNS (hickory-server on loopback) and the real resolver,
//! in-memory fakes for the etcd process, etcd's API, the store's hand-off objects and readiness.
//! The fakes record every call, so each test checks the order of what the watchdog did.
//! (What the fakes do not check: real signals and `/proc` — tests/process_kill.rs and
//! tests/ownership.rs; a real store and snapshot actor — tests/ownership.rs.)

#[path = "support/dns.rs"]
mod dns;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dns::{DnsServer, Mode};
use etcd_warden::backoff::Backoff;
use etcd_warden::config::OwnerConfig;
use etcd_warden::health::Health;
use etcd_warden::owner::handoff::{FenceMarker, HandOffRecord, Member};
use etcd_warden::owner::metrics::OwnerMetrics;
use etcd_warden::owner::protocol::State;
use etcd_warden::owner::resolve::OwnerResolver;
use etcd_warden::owner::watchdog::{
    Context, EtcdView, ReadinessSink, SeamError, Snapshots, Watchdog, WatchdogConfig,
    WatchdogStatus,
};
use etcd_warden::process::{KillReport, Outcome, ProcessControl, ProcessError, ProcessId};
use etcd_warden::snapshot::gate::Gate;
use etcd_warden::store::{Codec, Kind, Snapshot};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NAME: &str = "owner.shoot.warden.test";
const ID: &str = "seed-a";
const ME: u64 = 0xa1;

/// Everything the fakes saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Ready(bool),
    Gate(Gate),
    Kill,
    Fence,
    Final(i64),
}

/// How the fake kill ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillMode {
    /// The process goes away (and comes back shortly, as the kubelet restarts it).
    Works,
    /// No process matches.
    NotFound,
    /// The signal is refused (EPERM).
    Refused,
}

struct World {
    calls: Mutex<Vec<Call>>,
    healthy: AtomicBool,
    ready: AtomicBool,
    visible: AtomicBool,
    kill: Mutex<KillMode>,
    revision: AtomicI64,
    fences: Mutex<BTreeSet<u64>>,
    finals: Mutex<Vec<Snapshot>>,
    record: Mutex<Option<HandOffRecord>>,
    members: Mutex<Vec<Member>>,
    /// How many final snapshot requests fail before one succeeds.
    final_failures: AtomicU32,
    gate: watch::Sender<Gate>,
    /// The gate as last logged: a change is logged before the next call, which is the order
    /// the watchdog set it in (it never waits between setting the gate and its next action).
    seen_gate: Mutex<Gate>,
}

impl World {
    fn new() -> Arc<World> {
        Arc::new(World {
            calls: Mutex::new(Vec::new()),
            healthy: AtomicBool::new(true),
            ready: AtomicBool::new(false),
            visible: AtomicBool::new(true),
            kill: Mutex::new(KillMode::Works),
            revision: AtomicI64::new(42),
            fences: Mutex::new(BTreeSet::new()),
            finals: Mutex::new(Vec::new()),
            record: Mutex::new(None),
            members: Mutex::new(vec![member(ME)]),
            final_failures: AtomicU32::new(0),
            gate: watch::channel(Gate::Closed).0,
            seen_gate: Mutex::new(Gate::Closed),
        })
    }

    fn log(&self, call: Call) {
        let gate = *self.gate.borrow();
        let mut calls = self.calls.lock().expect("lock");
        let mut seen = self.seen_gate.lock().expect("lock");
        if *seen != gate {
            *seen = gate;
            calls.push(Call::Gate(gate));
        }
        calls.push(call);
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }

    fn count(&self, f: impl Fn(&Call) -> bool) -> usize {
        self.calls().iter().filter(|c| f(c)).count()
    }
}

fn member(id: u64) -> Member {
    Member {
        id,
        name: format!("m{id:x}"),
        started: true,
    }
}

fn final_at(revision: i64) -> Snapshot {
    Snapshot::new(
        "",
        Kind::Full,
        0,
        revision,
        chrono::Utc::now(),
        Codec::Gzip,
        true,
    )
}

struct Fake(Arc<World>);

const PROCESS: ProcessId = ProcessId {
    pid: 4242,
    start_time: 7,
};

#[async_trait::async_trait]
impl ProcessControl for Fake {
    async fn probe(&self) -> Result<Vec<ProcessId>, ProcessError> {
        if self.0.visible.load(Ordering::SeqCst) {
            Ok(vec![PROCESS])
        } else {
            Err(ProcessError::NotFound {
                name: "etcd-wrapper".into(),
                cmdline: String::new(),
            })
        }
    }

    async fn kill_etcd(&self, earlier: &[ProcessId]) -> Result<KillReport, ProcessError> {
        self.0.log(Call::Kill);
        let mode = *self.0.kill.lock().expect("lock");
        let _ = earlier;
        Ok(match mode {
            KillMode::NotFound => KillReport::default(),
            KillMode::Refused => KillReport {
                processes: vec![(
                    PROCESS,
                    Outcome::Refused {
                        signal: nix::sys::signal::Signal::SIGTERM,
                        errno: nix::Error::EPERM,
                    },
                )],
            },
            KillMode::Works => {
                // A real kill takes etcd down; the kubelet brings it back a little later.
                let world = self.0.clone();
                world.healthy.store(false, Ordering::SeqCst);
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    world.healthy.store(true, Ordering::SeqCst);
                });
                KillReport {
                    processes: vec![(PROCESS, Outcome::Terminated)],
                }
            }
        })
    }
}

#[async_trait::async_trait]
impl EtcdView for Fake {
    async fn health(&self) -> Health {
        let healthy = self.0.healthy.load(Ordering::SeqCst);
        Health {
            healthy,
            member_id: healthy.then_some(ME),
            detail: if healthy { "healthy" } else { "down" }.into(),
        }
    }

    async fn members(&self) -> Result<Vec<Member>, SeamError> {
        Ok(self.0.members.lock().expect("lock").clone())
    }

    async fn revision(&self) -> Result<i64, SeamError> {
        if !self.0.healthy.load(Ordering::SeqCst) {
            return Err(SeamError::Timeout {
                what: "a linearizable read",
                after: Duration::from_millis(1),
            });
        }
        Ok(self.0.revision.load(Ordering::SeqCst))
    }
}

#[async_trait::async_trait]
impl Snapshots for Fake {
    async fn write_fence(&self, member: u64, _marker: &FenceMarker) -> Result<(), SeamError> {
        self.0.log(Call::Fence);
        self.0.fences.lock().expect("lock").insert(member);
        Ok(())
    }
    async fn fence(&self, member: u64) -> Result<Option<FenceMarker>, SeamError> {
        Ok(self
            .0
            .fences
            .lock()
            .expect("lock")
            .contains(&member)
            .then(|| FenceMarker {
                member_id: format!("{member:x}"),
                owner_id: ID.into(),
                reason: "earlier".into(),
                killed: vec![],
                fenced_at: chrono::Utc::now(),
            }))
    }
    async fn fenced(&self) -> Result<BTreeSet<u64>, SeamError> {
        Ok(self.0.fences.lock().expect("lock").clone())
    }
    async fn finals(&self) -> Result<Vec<Snapshot>, SeamError> {
        Ok(self.0.finals.lock().expect("lock").clone())
    }
    async fn latest_full(&self) -> Result<Option<Snapshot>, SeamError> {
        Ok(self.0.finals.lock().expect("lock").last().cloned())
    }
    async fn record(&self) -> Result<Option<HandOffRecord>, SeamError> {
        Ok(self.0.record.lock().expect("lock").clone())
    }
    async fn write_record(&self, record: &HandOffRecord) -> Result<(), SeamError> {
        *self.0.record.lock().expect("lock") = Some(record.clone());
        Ok(())
    }
    async fn take_final(&self, min_revision: i64) -> Result<Snapshot, SeamError> {
        self.0.log(Call::Final(min_revision));
        let left = self.0.final_failures.load(Ordering::SeqCst);
        if left > 0 {
            self.0.final_failures.store(left - 1, Ordering::SeqCst);
            return Err(SeamError::Timeout {
                what: "the store",
                after: Duration::from_millis(1),
            });
        }
        let snap = final_at(self.0.revision.load(Ordering::SeqCst));
        self.0.finals.lock().expect("lock").push(snap.clone());
        Ok(snap)
    }
}

impl ReadinessSink for Fake {
    fn set_ready(&self, ready: bool, _state: &str, _reason: &str) {
        if self.0.ready.swap(ready, Ordering::SeqCst) != ready {
            self.0.log(Call::Ready(ready));
        }
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
            owner_id: ID.into(),
            interval: owner.interval,
            failure_threshold: owner.failure_threshold,
            health_interval: Duration::from_millis(20),
            backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(80)),
        };
        let fake = Arc::new(Fake(world.clone()));
        let ctx = Context {
            lookup: Arc::new(OwnerResolver::new(&owner).expect("resolver")),
            process: fake.clone(),
            etcd: fake.clone(),
            snapshots: fake.clone(),
            readiness: fake,
            gate: world.gate.clone(),
        };
        let metrics = OwnerMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let watchdog = Watchdog::new(config, ctx, metrics);
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

#[tokio::test]
async fn owner_then_other_owner_deactivates_for_good_with_one_final_snapshot() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let mut run = Running::start(&server, World::new()).await;
    run.until("active and ready", |s| s.state == "active" && s.ready)
        .await;
    assert_eq!(
        run.world.calls(),
        vec![Call::Gate(Gate::Open), Call::Ready(true)]
    );

    server.set_txt(NAME, &["seed-b"]).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(
        run.world.calls()[2..],
        [
            Call::Ready(false),
            Call::Gate(Gate::Final),
            Call::Kill,
            Call::Fence,
            Call::Final(42),
        ]
    );
    let record = run.world.record.lock().unwrap().clone().expect("recorded");
    assert_eq!(record.revision, 42);
    assert_eq!(
        Some(record.final_snapshot),
        run.status.borrow().final_snapshot
    );

    // Back to our ID: Deactivated is sticky, nothing more happens.
    server.set_txt(NAME, &[ID]).await;
    let checks_before = run.status.borrow().last_check_at;
    run.until("more checks", |s| s.last_check_at > checks_before)
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!run.world.ready.load(Ordering::SeqCst));
    assert_eq!(run.world.count(|c| matches!(c, Call::Final(_))), 1);
    assert_eq!(run.world.count(|c| *c == Call::Kill), 1);
    let metrics = run.metrics();
    for line in [
        "etcd_warden_owner_state{state=\"deactivated\"} 1",
        "etcd_warden_owner_final_snapshot_taken 1",
        "etcd_warden_owner_kill_attempts_total{result=\"verified\"} 1",
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
    let mut run = Running::start(&server, World::new()).await;
    run.until("ready", |s| s.ready).await;
    server.remove_txt(NAME).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(run.world.count(|c| matches!(c, Call::Final(_))), 1);
    assert!(!run.world.ready.load(Ordering::SeqCst));
    run.stop().await;
}

#[tokio::test]
async fn an_unresolvable_record_suspends_without_final_snapshot_and_resumes() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let mut run = Running::start(&server, World::new()).await;
    run.until("ready", |s| s.ready).await;

    server.set_mode(Mode::ServFail);
    run.until("suspended", |s| s.state == "suspended").await;
    assert!(!run.world.ready.load(Ordering::SeqCst));
    // Several more failed checks: still one kill, never a fence or final snapshot.
    let failures = run.status.borrow().consecutive_failures;
    run.until("more failures", |s| s.consecutive_failures >= failures + 3)
        .await;
    assert_eq!(run.world.count(|c| *c == Call::Kill), 1);
    assert_eq!(run.world.count(|c| *c == Call::Fence), 0);
    assert_eq!(run.world.count(|c| matches!(c, Call::Final(_))), 0);

    server.set_mode(Mode::Silent);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(run.status.borrow().state, "suspended");

    server.set_mode(Mode::Normal);
    run.until("active and ready again", |s| s.state == "active" && s.ready)
        .await;
    assert_eq!(run.world.count(|c| *c == Call::Gate(Gate::Open)), 2);
    assert_eq!(run.world.count(|c| matches!(c, Call::Final(_))), 0);
    run.stop().await;
}

#[tokio::test]
async fn one_failed_lookup_below_the_threshold_changes_nothing() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let mut run = Running::start(&server, World::new()).await;
    run.until("ready", |s| s.ready).await;
    server.set_mode(Mode::ServFail);
    run.until("one failure", |s| s.consecutive_failures == 1)
        .await;
    server.set_mode(Mode::Normal);
    run.until("recovered", |s| s.consecutive_failures == 0)
        .await;
    assert_eq!(run.status.borrow().state, "active");
    assert_eq!(run.world.count(|c| *c == Call::Kill), 0);
    assert!(run.world.ready.load(Ordering::SeqCst));
    run.stop().await;
}

#[tokio::test]
async fn a_restart_after_the_hand_off_stays_fenced_and_takes_no_second_final() {
    let server = DnsServer::start().await;
    // The record names us again (the migration was rolled back by hand, or DNS is stale), but
    // this member's fence marker and the hand-off's record are in the store.
    server.set_txt(NAME, &[ID]).await;
    let world = World::new();
    world.fences.lock().unwrap().insert(ME);
    let fin = final_at(40);
    world.finals.lock().unwrap().push(fin.clone());
    *world.record.lock().unwrap() = Some(HandOffRecord {
        final_snapshot: fin.snap_name.clone(),
        revision: 40,
        members: vec!["ma1".into()],
        owner_id: ID.into(),
        recorded_at: chrono::Utc::now(),
    });
    let mut run = Running::start(&server, world).await;
    run.until("final found in store", |s| {
        s.final_snapshot.as_deref() == Some(fin.snap_name.as_str())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Leases expired meanwhile (revision 42 > 40): the recorded final still counts.
    assert_eq!(
        run.world.calls(),
        vec![Call::Gate(Gate::Final), Call::Kill, Call::Fence]
    );
    assert_eq!(run.status.borrow().state, "deactivated");
    assert!(!run.world.ready.load(Ordering::SeqCst));
    run.stop().await;
}

#[tokio::test]
async fn a_stale_final_never_stands_in_for_the_hand_offs_final() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &["seed-b"]).await;
    let world = World::new();
    // A final from earlier (20 revisions behind etcd), with no hand-off record.
    world.finals.lock().unwrap().push(final_at(22));
    let mut run = Running::start(&server, world).await;
    run.until("final snapshot stored", |s| {
        s.final_snapshot.is_some() && s.state == "deactivated"
    })
    .await;
    assert_eq!(run.world.count(|c| *c == Call::Final(42)), 1);
    let record = run.world.record.lock().unwrap().clone().expect("recorded");
    assert!(record.final_snapshot.contains("-00000042-"), "{record:?}");
    run.stop().await;
}

#[tokio::test]
async fn a_failing_store_is_retried_until_the_final_snapshot_is_stored() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &["seed-b"]).await;
    let world = World::new();
    world.final_failures.store(3, Ordering::SeqCst);
    let started = Instant::now();
    let mut run = Running::start(&server, world).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(
        run.world.count(|c| matches!(c, Call::Final(_))),
        4,
        "three failures, then stored"
    );
    // Backoff 20 + 40 + 80 ms before the last attempt.
    assert!(started.elapsed() >= Duration::from_millis(140));
    assert!(!run.world.ready.load(Ordering::SeqCst));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        run.world.count(|c| matches!(c, Call::Final(_))),
        4,
        "nothing after it is stored"
    );
    run.stop().await;
}

#[tokio::test]
async fn readiness_follows_etcd_health_while_active() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let world = World::new();
    let mut run = Running::start(&server, world.clone()).await;
    run.until("ready", |s| s.state == "active" && s.ready).await;
    world.healthy.store(false, Ordering::SeqCst);
    run.until("not ready", |s| !s.ready).await;
    assert_eq!(run.status.borrow().state, "active");
    world.healthy.store(true, Ordering::SeqCst);
    run.until("ready again", |s| s.ready).await;
    run.stop().await;
}

/// Deactivated with a kill that never happens: no fence, no final, and `/status` says why.
async fn unverified_kill(mode: KillMode, expect_in_reason: &str, metric: &str) {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let world = World::new();
    let mut run = Running::start(&server, world.clone()).await;
    run.until("ready", |s| s.ready).await;
    *world.kill.lock().unwrap() = mode;
    server.set_txt(NAME, &["seed-b"]).await;
    run.until("three kill attempts", |s| {
        s.kill.as_ref().is_some_and(|k| k.attempts >= 3)
    })
    .await;
    let status = run.status.borrow().clone();
    assert_eq!(status.state, "deactivated");
    assert!(!status.ready);
    assert!(!status.kill.as_ref().unwrap().verified);
    assert!(
        status.reason.contains("not verified") && status.reason.contains(expect_in_reason),
        "{}",
        status.reason
    );
    assert_eq!(
        world.count(|c| *c == Call::Fence),
        0,
        "no fence before a verified kill"
    );
    assert_eq!(world.count(|c| matches!(c, Call::Final(_))), 0, "no final");
    let metrics = run.metrics();
    assert!(metrics.contains(metric), "missing {metric} in\n{metrics}");

    // The kill starts working (the name fixed, the UID changed): the hand-off completes.
    *world.kill.lock().unwrap() = KillMode::Works;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(world.count(|c| matches!(c, Call::Final(_))), 1);
    run.stop().await;
}

#[tokio::test]
async fn no_etcd_process_found_means_no_final_and_retries() {
    unverified_kill(
        KillMode::NotFound,
        "no etcd process found",
        "etcd_warden_owner_kill_attempts_total{result=\"not_found\"}",
    )
    .await;
}

#[tokio::test]
async fn a_refused_signal_means_no_final_and_retries() {
    unverified_kill(
        KillMode::Refused,
        "EPERM",
        "etcd_warden_owner_kill_attempts_total{result=\"refused\"}",
    )
    .await;
}

#[tokio::test]
async fn never_active_while_the_etcd_process_cannot_be_seen() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let world = World::new();
    world.visible.store(false, Ordering::SeqCst);
    let mut run = Running::start(&server, world.clone()).await;
    run.until("several checks", |s| s.last_check.is_some())
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = run.status.borrow().clone();
    assert_eq!(status.state, "starting");
    assert!(!status.ready);
    assert!(
        status.reason.contains("not visible") && status.reason.contains("etcd-wrapper"),
        "{}",
        status.reason
    );
    assert_eq!(world.count(|c| *c == Call::Gate(Gate::Open)), 0);
    assert!(
        run.metrics()
            .contains("etcd_warden_owner_etcd_process_visible 0")
    );

    world.visible.store(true, Ordering::SeqCst);
    run.until("active", |s| s.state == "active" && s.ready)
        .await;
    run.stop().await;
}

#[tokio::test]
async fn in_a_cluster_the_final_waits_for_every_member_and_only_the_lowest_takes_it() {
    let server = DnsServer::start().await;
    server.set_txt(NAME, &["seed-b"]).await;
    let world = World::new();
    // Another member with a lower ID: it takes the final; we only fence and wait.
    *world.members.lock().unwrap() = vec![member(ME), member(0x01)];
    let mut run = Running::start(&server, world.clone()).await;
    run.until("waiting for the other member", |s| {
        s.waiting_for.iter().any(|w| w == "m1")
    })
    .await;
    assert!(run.status.borrow().reason.contains("waiting for m1"));
    // The other member is fenced now: we wait for it to take the final.
    world.fences.lock().unwrap().insert(0x01);
    run.until("waiting for the taker", |s| {
        s.waiting_for.iter().any(|w| w.contains("takes the final"))
    })
    .await;
    assert_eq!(world.count(|c| matches!(c, Call::Final(_))), 0);
    // It stores the final and its record.
    let fin = final_at(42);
    world.finals.lock().unwrap().push(fin.clone());
    *world.record.lock().unwrap() = Some(HandOffRecord {
        final_snapshot: fin.snap_name.clone(),
        revision: 42,
        members: vec!["m1".into(), "ma1".into()],
        owner_id: ID.into(),
        recorded_at: chrono::Utc::now(),
    });
    run.until("final found", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(
        world.count(|c| matches!(c, Call::Final(_))),
        0,
        "never two takers"
    );
    run.stop().await;
}
