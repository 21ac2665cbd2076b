//! The ownership watchdog end to end, with real DNS (hickory-server on loopback) and the real
//! resolver:
//! - with in-memory fakes for the etcd process, etcd's API, the final snapshot and readiness,
//!   which record every call, so each test checks the order of what the watchdog did, and the
//!   production hand-off objects over `object_store`'s in-memory store (create-if-absent as S3
//!   does it), behind a thin wrapper that logs fence markers and fails the reads and writes a
//!   test names (what they do not check: real signals and `/proc`, a remote store and its
//!   latency, the snapshot actor);
//! - against a real etcd process: the real process killer SIGTERMs it, a stand-in for the kubelet
//!   restarts it, the real etcd API (health, members, a linearizable revision) sees it come back,
//!   and only then is the final snapshot requested; and against the real snapshot actor with a
//!   store that never answers, to bound verdict -> SIGTERM.

use crate::support;

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, MultipartUpload, ObjectStore, ObjectStoreExt, PutMultipartOptions,
    PutOptions, PutPayload, PutResult,
};

use etcd_warden::backoff::Backoff;
use etcd_warden::config::OwnerConfig;
use etcd_warden::config::{EtcdConfig, KillConfig};
use etcd_warden::health::Health;
use etcd_warden::kill::ProcKiller;
use etcd_warden::kill::{KillReport, Outcome, ProcessControl, ProcessError, ProcessId};
use etcd_warden::owner::handoff::{FenceMarker, HandOffObjects, HandOffRecord, Key, Member};
use etcd_warden::owner::metrics::OwnerMetrics;
use etcd_warden::owner::production::{EtcdApi, OwnerStatus};
use etcd_warden::owner::protocol::State;
use etcd_warden::owner::resolve::OwnerResolver;
use etcd_warden::owner::watchdog::{
    Context, EtcdView, FinalTaker, ReadinessSink, SeamError, Watchdog, WatchdogConfig,
    WatchdogStatus,
};
use etcd_warden::server::{Readiness, StatusSource};
use etcd_warden::snapshot::actor::{self, ActorHandle};
use etcd_warden::snapshot::engine::EtcdEngine;
use etcd_warden::snapshot::gate::Gate;
use etcd_warden::snapshot::metrics::SnapshotMetrics;
use etcd_warden::store::{Codec, Kind, Snapshot, SnapshotStore};
use prometheus_client::registry::Registry;
use support::dns::{DnsServer, Mode};
use support::etcd::{EtcdCluster, Release};
use support::losing::{LosingStore, Loss};
use support::s3::S3Server;
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
    /// Reads of fence markers fail (the store cannot be reached).
    fence_reads_fail: AtomicBool,
    /// The hand-off objects as the watchdog reaches them: the in-memory store behind [`Hooked`].
    objects: HandOffObjects,
    /// The same objects, reached directly: what a test puts there beforehand or reads back.
    direct: HandOffObjects,
    healthy: AtomicBool,
    /// etcd never comes back after a kill (a full data disk, a crash loop).
    stays_down: AtomicBool,
    /// The member ID its write-ahead log records (0: none to read).
    on_disk: AtomicU64,
    ready: AtomicBool,
    visible: AtomicBool,
    kill: Mutex<KillMode>,
    revision: AtomicI64,
    members: Mutex<Vec<Member>>,
    /// How many final snapshot requests fail before one succeeds.
    final_failures: AtomicU32,
    /// How many hand-off record writes fail before one succeeds; each failure also moves etcd's
    /// revision on, as lease expiry does after every member was fenced.
    record_failures: AtomicU32,
    gate: watch::Sender<Gate>,
    /// The gate as last logged: a change is logged before the next call, which is the order
    /// the watchdog set it in (it never waits between setting the gate and its next action).
    seen_gate: Mutex<Gate>,
}

impl World {
    fn new() -> Arc<World> {
        let memory: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        Arc::new_cyclic(|world| World {
            calls: Mutex::new(Vec::new()),
            fence_reads_fail: AtomicBool::new(false),
            objects: HandOffObjects::new(Hooked::store(memory.clone(), {
                let world: Weak<World> = world.clone();
                Box::new(move |access, location| {
                    world.upgrade().map_or(Ok(()), |w| w.hook(access, location))
                })
            })),
            direct: HandOffObjects::new(SnapshotStore::new(memory, "")),
            healthy: AtomicBool::new(true),
            stays_down: AtomicBool::new(false),
            on_disk: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            visible: AtomicBool::new(true),
            kill: Mutex::new(KillMode::Works),
            revision: AtomicI64::new(42),
            members: Mutex::new(vec![member(ME)]),
            final_failures: AtomicU32::new(0),
            record_failures: AtomicU32::new(0),
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

    /// The members with a fence marker in the store.
    async fn fenced(&self) -> BTreeSet<u64> {
        self.direct.fenced().await.expect("fence markers")
    }

    /// The final full snapshots in the store.
    async fn finals(&self) -> Vec<Snapshot> {
        self.direct.finals().await.expect("finals")
    }

    /// The hand-off record in the store.
    async fn record(&self) -> Option<HandOffRecord> {
        self.direct.record().await.expect("the hand-off record")
    }

    /// Puts `member`'s fence marker in the store, as its sidecar does.
    async fn put_fence(&self, member: u64) {
        let marker = FenceMarker {
            member_id: format!("{member:x}"),
            owner_id: ID.into(),
            reason: "earlier".into(),
            killed: vec![],
            fenced_at: chrono::Utc::now(),
        };
        self.direct
            .write_fence(member, &marker)
            .await
            .expect("a fence marker");
    }

    /// Puts the final `fin` and a hand-off record naming it in the store, as the member taking
    /// the final does.
    async fn put_final_and_record(&self, fin: &Snapshot, members: &[&str]) {
        self.direct
            .store()
            .put_bytes(fin, bytes::Bytes::new())
            .await
            .expect("a final");
        let record = HandOffRecord {
            final_snapshot: fin.snap_name.clone(),
            revision: fin.last_revision,
            members: members.iter().map(|m| m.to_string()).collect(),
            owner_id: ID.into(),
            recorded_at: chrono::Utc::now(),
        };
        self.direct
            .write_record(&record)
            .await
            .expect("a hand-off record");
    }
}

fn store_error(what: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "Hooked",
        source: what.to_string().into(),
    }
}

/// What a [`Hooked`] store is asked to do with an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Put,
    Get,
}

/// What a test's store does before a put or get: `Err` fails it (nothing stored).
type Hook = Box<dyn Fn(Access, &Path) -> object_store::Result<()> + Send + Sync>;

/// A store (`object_store`'s in-memory one here) whose puts and gets a test sees first and may
/// fail; everything else passes through.
struct Hooked {
    inner: Arc<dyn ObjectStore>,
    hook: Hook,
}

impl Hooked {
    /// `inner` as a snapshot store under no prefix, behind `hook`.
    fn store(inner: Arc<dyn ObjectStore>, hook: Hook) -> SnapshotStore {
        SnapshotStore::new(Arc::new(Hooked { inner, hook }), "")
    }
}

impl World {
    /// The world's store hook: every fence marker written is logged as [`Call::Fence`]; fence
    /// reads fail while `fence_reads_fail`; the record's writes fail while `record_failures`
    /// lasts, each failure moving etcd's revision on (as leases expiring after every member was
    /// fenced do).
    fn hook(&self, access: Access, location: &Path) -> object_store::Result<()> {
        let key = location.as_ref();
        let fence = key.starts_with(&Key::Fences.name());
        match access {
            Access::Put if fence => self.log(Call::Fence),
            Access::Put
                if key == Key::Record.name()
                    && self
                        .record_failures
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok() =>
            {
                self.revision.fetch_add(3, Ordering::SeqCst);
                return Err(store_error("the record's write timed out"));
            }
            Access::Get if fence && self.fence_reads_fail.load(Ordering::SeqCst) => {
                return Err(store_error("the store cannot be reached"));
            }
            _ => {}
        }
        Ok(())
    }
}

impl fmt::Debug for Hooked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hooked({})", self.inner)
    }
}

impl fmt::Display for Hooked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hooked({})", self.inner)
    }
}

support::forward::object_store_passing_the_rest!(Hooked, inner, {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        (self.hook)(Access::Put, location)?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        (self.hook)(Access::Put, location)?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        (self.hook)(Access::Get, location)?;
        self.inner.get_opts(location, options).await
    }
});

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
                ignored: String::new(),
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
                    if !world.stays_down.load(Ordering::SeqCst) {
                        world.healthy.store(true, Ordering::SeqCst);
                    }
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

    async fn member_on_disk(&self) -> Option<u64> {
        Some(self.0.on_disk.load(Ordering::SeqCst)).filter(|&id| id != 0)
    }
}

/// The final as the snapshot actor stores it: the object the intent names (empty here), in the
/// world's store; `final_failures` attempts fail first.
#[async_trait::async_trait]
impl FinalTaker for Fake {
    async fn take_final(&self, name: Snapshot, min_revision: i64) -> Result<Snapshot, SeamError> {
        self.0.log(Call::Final(min_revision));
        if self
            .0
            .final_failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(SeamError::Timeout {
                what: "the store",
                after: Duration::from_millis(1),
            });
        }
        assert!(self.0.revision.load(Ordering::SeqCst) >= min_revision);
        self.0
            .objects
            .store()
            .put_bytes(&name, bytes::Bytes::new())
            .await
            .map_err(|e| SeamError::HandOff(e.into()))?;
        Ok(name)
    }
}

impl ReadinessSink for Fake {
    fn set_ready(&self, ready: bool, _state: &str, _reason: &str) {
        if self.0.ready.swap(ready, Ordering::SeqCst) != ready {
            self.0.log(Call::Ready(ready));
        }
    }
}

/// A DNS server whose owner record holds `record`, and a watchdog over `world` checking it.
async fn running(record: &[&str], world: Arc<World>) -> (DnsServer, Running) {
    let server = DnsServer::start().await;
    server.set_txt(NAME, record).await;
    let run = Running::start(&server, world).await;
    (server, run)
}

/// [`running`] naming us, once the watchdog is Active and ready.
async fn running_ready(world: Arc<World>) -> (DnsServer, Running) {
    let (server, mut run) = running(&[ID], world).await;
    run.until("active and ready", |s| s.state == "active" && s.ready)
        .await;
    (server, run)
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
        Running::start_with(server, world, Duration::ZERO).await
    }

    /// [`Running::start`] with `kill.settle` = `settle`.
    async fn start_with(server: &DnsServer, world: Arc<World>, settle: Duration) -> Running {
        let owner = owner_config(
            server,
            Duration::from_millis(50),
            Duration::from_millis(200),
        );
        let config = watchdog_config(
            &owner,
            Duration::from_millis(20),
            Backoff::new(Duration::from_millis(20), Duration::from_millis(80)),
            settle,
        );
        let fake = Arc::new(Fake(world.clone()));
        let ctx = Context {
            lookup: Arc::new(OwnerResolver::new(&owner).expect("resolver")),
            process: fake.clone(),
            etcd: fake.clone(),
            objects: world.objects.clone(),
            codec: Codec::Gzip,
            finals: fake.clone(),
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

    /// Final snapshots requested.
    fn finals(&self) -> usize {
        self.world.count(|c| matches!(c, Call::Final(_)))
    }

    /// Kills requested.
    fn kills(&self) -> usize {
        self.world.count(|c| *c == Call::Kill)
    }

    /// What readiness says now.
    fn ready(&self) -> bool {
        self.world.ready.load(Ordering::SeqCst)
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
    let (server, mut run) = running(&[ID], World::new()).await;
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
    let record = run.world.record().await.expect("recorded");
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
    assert!(!run.ready());
    assert_eq!(run.finals(), 1);
    assert_eq!(run.kills(), 1);
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

/// A sidecar started while its etcd is down and stays down (the soak's member on a full disk)
/// never heard its member ID from etcd. It fences itself by the ID its write-ahead log records,
/// so the other members are not left waiting for its marker; before, it retried "etcd's member
/// ID is not known yet" for as long as etcd stayed down.
#[tokio::test]
async fn a_member_whose_etcd_stays_down_is_fenced_by_the_id_on_its_disk() {
    let world = World::new();
    world.healthy.store(false, Ordering::SeqCst);
    world.stays_down.store(true, Ordering::SeqCst);
    world.on_disk.store(ME, Ordering::SeqCst);
    let (_server, mut run) = running(&["seed-b"], world).await;
    run.until("fenced by its own ID", |s| {
        s.member_id == Some(format!("{ME:x}"))
    })
    .await;
    support::eventually(Duration::from_secs(10), || async {
        run.world.fenced().await.contains(&ME)
    })
    .await
    .then_some(())
    .expect("the fence marker stored under the ID on disk");
    run.stop().await;
}

#[tokio::test]
async fn a_removed_record_deactivates_and_takes_the_final_snapshot() {
    let (server, mut run) = running_ready(World::new()).await;
    server.remove_txt(NAME).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(run.finals(), 1);
    assert!(!run.ready());
    run.stop().await;
}

#[tokio::test]
async fn an_unresolvable_record_suspends_without_final_snapshot_and_resumes() {
    let (server, mut run) = running_ready(World::new()).await;

    server.set_mode(Mode::ServFail);
    run.until("suspended", |s| s.state == "suspended").await;
    assert!(!run.ready());
    // Several more failed checks: still one kill, never a fence or final snapshot.
    let failures = run.status.borrow().consecutive_failures;
    run.until("more failures", |s| s.consecutive_failures >= failures + 3)
        .await;
    assert_eq!(run.kills(), 1);
    assert_eq!(run.world.count(|c| *c == Call::Fence), 0);
    assert_eq!(run.finals(), 0);

    server.set_mode(Mode::Silent);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(run.status.borrow().state, "suspended");

    server.set_mode(Mode::Normal);
    run.until("active and ready again", |s| s.state == "active" && s.ready)
        .await;
    assert_eq!(run.world.count(|c| *c == Call::Gate(Gate::Open)), 2);
    assert_eq!(run.finals(), 0);
    run.stop().await;
}

#[tokio::test]
async fn one_failed_lookup_below_the_threshold_changes_nothing() {
    let (server, mut run) = running_ready(World::new()).await;
    server.set_mode(Mode::ServFail);
    run.until("one failure", |s| s.consecutive_failures == 1)
        .await;
    server.set_mode(Mode::Normal);
    run.until("recovered", |s| s.consecutive_failures == 0)
        .await;
    assert_eq!(run.status.borrow().state, "active");
    assert_eq!(run.kills(), 0);
    assert!(run.ready());
    run.stop().await;
}

#[tokio::test]
async fn a_restart_after_the_hand_off_stays_fenced_and_takes_no_second_final() {
    // The record names us again (the migration was rolled back by hand, or DNS is stale), but
    // this member's fence marker and the hand-off's record are in the store.
    let world = World::new();
    world.put_fence(ME).await;
    let fin = final_at(40);
    world.put_final_and_record(&fin, &["ma1"]).await;
    let (_server, mut run) = running(&[ID], world).await;
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
    assert!(!run.ready());
    run.stop().await;
}

#[tokio::test]
async fn a_stale_final_never_stands_in_for_the_hand_offs_final() {
    let world = World::new();
    // A final from earlier (20 revisions behind etcd), with no hand-off record.
    world
        .direct
        .store()
        .put_bytes(&final_at(22), bytes::Bytes::new())
        .await
        .expect("an old final");
    let (_server, mut run) = running(&["seed-b"], world).await;
    run.until("final snapshot stored", |s| {
        s.final_snapshot.is_some() && s.state == "deactivated"
    })
    .await;
    assert_eq!(run.world.count(|c| *c == Call::Final(42)), 1);
    let record = run.world.record().await.expect("recorded");
    assert!(record.final_snapshot.contains("-00000042-"), "{record:?}");
    run.stop().await;
}

#[tokio::test]
async fn a_failing_store_is_retried_until_the_final_snapshot_is_stored() {
    let world = World::new();
    world.final_failures.store(3, Ordering::SeqCst);
    let started = Instant::now();
    let (_server, mut run) = running(&["seed-b"], world).await;
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(run.finals(), 4, "three failures, then stored");
    // Backoff 20 + 40 + 80 ms before the last attempt.
    assert!(started.elapsed() >= Duration::from_millis(140));
    assert!(!run.ready());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(run.finals(), 4, "nothing after it is stored");
    run.stop().await;
}

#[tokio::test]
async fn a_failed_record_write_records_the_stored_final_and_takes_no_second() {
    let world = World::new();
    world.record_failures.store(2, Ordering::SeqCst);
    let (_server, mut run) = running(&["seed-b"], world.clone()).await;
    run.until("final snapshot stored and recorded", |s| {
        s.final_snapshot.is_some() && s.state == "deactivated" && s.detail.contains("Done")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Leases moved the revision on (42 -> 48) while the record could not be written: the final
    // stored at 42 still is the hand-off's, and the record names it.
    assert_eq!(world.revision.load(Ordering::SeqCst), 48);
    assert_eq!(run.finals(), 1, "{:?}", world.calls());
    let finals = world.finals().await;
    assert_eq!(finals.len(), 1);
    let record = world.record().await.expect("recorded");
    assert_eq!(record.final_snapshot, finals[0].snap_name);
    assert_eq!(record.revision, 42);
    assert_eq!(
        run.status.borrow().final_snapshot.as_deref(),
        Some(finals[0].snap_name.as_str())
    );
    run.stop().await;
}

#[tokio::test]
async fn with_a_settle_etcd_is_killed_again_before_the_fence() {
    let world = World::new();
    let server = DnsServer::start().await;
    server.set_txt(NAME, &[ID]).await;
    let settle = Duration::from_millis(400);
    let mut run = Running::start_with(&server, world.clone(), settle).await;
    run.until("active and ready", |s| s.state == "active" && s.ready)
        .await;
    server.set_txt(NAME, &["seed-b"]).await;
    run.until("not ready", |s| !s.ready).await;
    let unready_at = Instant::now();
    run.until("killed", |s| s.kill.is_some()).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(run.kills(), 1, "one kill until the settle ends");
    assert_eq!(world.count(|c| *c == Call::Fence), 0, "no fence during it");
    run.until("final snapshot stored", |s| s.final_snapshot.is_some())
        .await;
    assert!(unready_at.elapsed() >= settle - Duration::from_millis(50));
    assert_eq!(
        world.calls()[2..],
        [
            Call::Ready(false),
            Call::Gate(Gate::Final),
            Call::Kill,
            Call::Kill,
            Call::Fence,
            Call::Final(42),
        ]
    );
    run.stop().await;
}

#[tokio::test]
async fn readiness_follows_etcd_health_while_active() {
    let world = World::new();
    let (_server, mut run) = running(&[ID], world.clone()).await;
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
    let world = World::new();
    let (server, mut run) = running(&[ID], world.clone()).await;
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
    let world = World::new();
    world.visible.store(false, Ordering::SeqCst);
    let (_server, mut run) = running(&[ID], world.clone()).await;
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
    let world = World::new();
    // Another member with a lower ID: it takes the final; we only fence and wait.
    *world.members.lock().unwrap() = vec![member(ME), member(0x01)];
    let (_server, mut run) = running(&["seed-b"], world.clone()).await;
    run.until("waiting for the other member", |s| {
        s.waiting_for.iter().any(|w| w == "m1")
    })
    .await;
    assert!(run.status.borrow().reason.contains("waiting for m1"));
    // The other member is fenced now: we wait for it to take the final.
    world.put_fence(0x01).await;
    run.until("waiting for the taker", |s| {
        s.waiting_for.iter().any(|w| w.contains("takes the final"))
    })
    .await;
    assert_eq!(world.count(|c| matches!(c, Call::Final(_))), 0);
    // It stores the final and its record.
    let fin = final_at(42);
    world.put_final_and_record(&fin, &["m1", "ma1"]).await;
    run.until("final found", |s| s.final_snapshot.is_some())
        .await;
    assert_eq!(
        world.count(|c| matches!(c, Call::Final(_))),
        0,
        "never two takers"
    );
    run.stop().await;
}

#[tokio::test]
async fn a_start_check_that_keeps_failing_never_starves_a_not_owner_verdict() {
    let world = World::new();
    world.fence_reads_fail.store(true, Ordering::SeqCst);
    let (server, mut run) = running(&[ID], world.clone()).await;
    run.until("the start check failing", |s| {
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("start check"))
    })
    .await;
    // Checks go on while the start check keeps failing (it is retried, not looped on).
    let checks_before = run.status.borrow().last_check_at;
    run.until("more owner checks", |s| s.last_check_at > checks_before)
        .await;
    assert_eq!(run.status.borrow().state, "starting");
    assert!(!run.ready());

    server.set_txt(NAME, &["seed-b"]).await;
    run.until("deactivated and killed", |s| {
        s.state == "deactivated" && s.kill.as_ref().is_some_and(|k| k.verified)
    })
    .await;
    assert_eq!(run.kills(), 1);
    assert!(!run.ready());
    run.stop().await;
}

#[tokio::test]
async fn an_unreadable_fence_marker_of_this_member_counts_as_fenced() {
    let world = World::new();
    // Truncated, or edited by hand: there, but not JSON.
    world
        .direct
        .store()
        .backend()
        .put(
            &Key::Fence(ME).path(""),
            PutPayload::from_static(b"not json"),
        )
        .await
        .expect("a marker");
    let (_server, mut run) = running(&[ID], world.clone()).await;
    run.until("deactivated", |s| s.state == "deactivated").await;
    assert_eq!(world.count(|c| *c == Call::Gate(Gate::Open)), 0);
    assert!(!run.ready());
    run.until("killed", |s| s.kill.as_ref().is_some_and(|k| k.verified))
        .await;
    run.stop().await;
}

// ---- Against a real etcd process. ----

/// The owner section for a record on `dns`, checked every `interval`.
fn owner_config(dns: &DnsServer, interval: Duration, timeout: Duration) -> OwnerConfig {
    OwnerConfig {
        name: NAME.into(),
        id: ID.into(),
        interval,
        timeout,
        nameservers: vec![dns.addr()],
        failure_threshold: 2,
        ttl_cap: Duration::ZERO,
        takeover_after: Duration::from_secs(300),
    }
}

/// The watchdog's timing for `owner`, with a faster health poll and backoff than production.
fn watchdog_config(
    owner: &OwnerConfig,
    health: Duration,
    backoff: Backoff,
    settle: Duration,
) -> WatchdogConfig {
    let kill = KillConfig {
        process_name: "etcd".into(),
        cmdline_contains: None,
        grace: Duration::from_secs(1),
        settle,
    };
    WatchdogConfig {
        health_interval: health,
        backoff,
        ..WatchdogConfig::from_config(owner, &kill)
    }
}

/// The production hand-off objects over `store`, the final taken by `actor` (gzip).
fn store_snapshots(store: SnapshotStore, actor: &ActorHandle) -> Seam {
    Seam {
        objects: HandOffObjects::new(store),
        finals: Arc::new(actor.clone()),
    }
}

/// The hand-off's objects and the final, as a [`RealEtcd::watchdog`] reaches them.
struct Seam {
    objects: HandOffObjects,
    finals: Arc<dyn FinalTaker>,
}

/// Runs `watchdog` until `cancel` and waits until `readiness` says ready (`what`, when it does
/// not); returns the watchdog's status and its task.
async fn run_until_ready(
    watchdog: Watchdog,
    readiness: &mut watch::Receiver<Readiness>,
    cancel: CancellationToken,
    what: &str,
) -> (
    watch::Receiver<WatchdogStatus>,
    tokio::task::JoinHandle<State>,
) {
    let status = watchdog.status();
    let task = tokio::spawn(watchdog.run(cancel));
    tokio::time::timeout(Duration::from_secs(20), readiness.wait_for(|r| r.ready))
        .await
        .expect(what)
        .expect("readiness");
    (status, task)
}

/// One real member as the watchdog reaches it, a killer that matches only it (its data dir is
/// unique on the machine), and a kubelet that restarts it whenever it died, counting restarts.
struct RealEtcd {
    cluster: Arc<Mutex<EtcdCluster>>,
    config: EtcdConfig,
    killer: ProcKiller,
    restarts: Arc<AtomicU32>,
    stop: CancellationToken,
    kubelet: tokio::task::JoinHandle<()>,
    /// `kill.settle` of the watchdogs made by [`RealEtcd::watchdog`] (zero unless a test sets it).
    settle: Duration,
}

impl RealEtcd {
    async fn start() -> RealEtcd {
        let cluster = EtcdCluster::single(Release::V35).await;
        let config = EtcdConfig {
            endpoints: vec![cluster.endpoints()[0].clone()],
            tls: None,
            username: None,
            password: None,
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(2),
        };
        let killer = ProcKiller::new(&KillConfig {
            process_name: "etcd".into(),
            cmdline_contains: Some(cluster.members[0].data_dir.display().to_string()),
            grace: Duration::from_secs(10),
            settle: Duration::ZERO,
        });
        let cluster = Arc::new(Mutex::new(cluster));
        let restarts = Arc::new(AtomicU32::new(0));
        let stop = CancellationToken::new();
        let kubelet = tokio::spawn({
            let (cluster, restarts, stop) = (cluster.clone(), restarts.clone(), stop.clone());
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
        RealEtcd {
            cluster,
            config,
            killer,
            restarts,
            stop,
            kubelet,
            settle: Duration::ZERO,
        }
    }

    fn endpoint(&self) -> String {
        self.config.endpoints[0].clone()
    }

    async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], None)
            .await
            .expect("connect")
    }

    fn pid(&self) -> Option<u32> {
        self.cluster.lock().expect("lock").members[0].pid()
    }

    async fn stop(self) {
        self.stop.cancel();
        self.kubelet.await.expect("kubelet");
    }

    /// A watchdog over this member with `owner`'s record and a fast health poll and backoff.
    fn watchdog(
        &self,
        owner: &OwnerConfig,
        lookup: Arc<dyn etcd_warden::owner::resolve::OwnerLookup>,
        process: Arc<dyn ProcessControl>,
        seam: Seam,
        readiness: watch::Sender<Readiness>,
        gate: watch::Sender<Gate>,
    ) -> Watchdog {
        let ctx = Context {
            lookup,
            process,
            etcd: Arc::new(EtcdApi::new(self.config.clone(), Duration::from_secs(1))),
            objects: seam.objects,
            codec: Codec::Gzip,
            finals: seam.finals,
            readiness: Arc::new(readiness),
            gate,
        };
        let config = watchdog_config(
            owner,
            Duration::from_millis(100),
            Backoff::new(Duration::from_millis(100), Duration::from_secs(1)),
            self.settle,
        );
        Watchdog::new(config, ctx, OwnerMetrics::default())
    }
    /// [`RealEtcd::watchdog`] resolving `owner`'s record for real, killing this member.
    fn resolving_watchdog(
        &self,
        owner: &OwnerConfig,
        seam: Seam,
        readiness: watch::Sender<Readiness>,
        gate: watch::Sender<Gate>,
    ) -> Watchdog {
        self.watchdog(
            owner,
            Arc::new(OwnerResolver::new(owner).expect("resolver")),
            Arc::new(self.killer.clone()),
            seam,
            readiness,
            gate,
        )
    }
}

/// The final as a real etcd snapshot stream, counted, then stored (empty) under the intent's
/// name in `objects`' store.
struct StreamingFinal {
    endpoint: String,
    objects: HandOffObjects,
    taken: AtomicU32,
    bytes: AtomicU32,
}

impl StreamingFinal {
    /// Finals streamed from `endpoint`, stored in `store`.
    fn new(endpoint: String, store: SnapshotStore) -> Arc<StreamingFinal> {
        Arc::new(StreamingFinal {
            endpoint,
            objects: HandOffObjects::new(store),
            taken: AtomicU32::new(0),
            bytes: AtomicU32::new(0),
        })
    }

    /// The hand-off objects in the same store, and this as the final.
    fn seam(self: &Arc<Self>) -> Seam {
        Seam {
            objects: self.objects.clone(),
            finals: self.clone(),
        }
    }
}

#[async_trait::async_trait]
impl FinalTaker for StreamingFinal {
    async fn take_final(&self, name: Snapshot, min_revision: i64) -> Result<Snapshot, SeamError> {
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
        self.objects
            .store()
            .put_bytes(&name, bytes::Bytes::new())
            .await
            .map_err(|e| SeamError::HandOff(e.into()))?;
        Ok(name)
    }
}

#[tokio::test]
async fn losing_ownership_kills_real_etcd_and_snapshots_it_after_it_comes_back() {
    let etcd = RealEtcd::start().await;
    let endpoint = etcd.endpoint();
    let first_pid = etcd.pid().expect("etcd running");
    let mut writer = etcd.client().await;
    let dns = DnsServer::start().await;
    dns.set_txt(NAME, &[ID]).await;
    let owner = owner_config(&dns, Duration::from_millis(100), Duration::from_millis(500));
    let snapshots = StreamingFinal::new(
        endpoint.clone(),
        SnapshotStore::new(Arc::new(InMemory::new()), ""),
    );
    let (readiness_tx, mut readiness) = watch::channel(Readiness::starting());
    let (gate, gates) = watch::channel(Gate::Closed);
    let watchdog = etcd.resolving_watchdog(&owner, snapshots.seam(), readiness_tx, gate);
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
        etcd.restarts.load(Ordering::SeqCst),
        1,
        "etcd was killed once and came back"
    );
    let new_pid = etcd.pid().expect("etcd restarted");
    assert_ne!(new_pid, first_pid);
    assert_eq!(snapshots.taken.load(Ordering::SeqCst), 1);
    assert!(
        snapshots.bytes.load(Ordering::SeqCst) > 0,
        "a real snapshot stream"
    );
    let fin = snapshots.objects.finals().await.expect("finals")[0].clone();
    assert!(
        fin.last_revision >= acknowledged,
        "{fin:?} misses {acknowledged}"
    );
    let s = status.borrow().clone();
    assert_eq!(
        snapshots.objects.fenced().await.expect("fences").len(),
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
    assert_eq!(etcd.restarts.load(Ordering::SeqCst), 1);
    assert_eq!(snapshots.taken.load(Ordering::SeqCst), 1);

    cancel.cancel();
    task.await.expect("watchdog");
    etcd.stop().await;
}

/// When the fence marker was written: the kubelet's restarts of etcd so far, and the etcd
/// processes alive.
type AtFence = (u32, Vec<i32>);

#[tokio::test]
async fn an_etcd_restarted_after_the_first_kill_is_killed_again_before_the_fence() {
    let mut etcd = RealEtcd::start().await;
    let settle = Duration::from_secs(3);
    etcd.settle = settle;
    let first_pid = etcd.pid().expect("etcd running");
    let dns = DnsServer::start().await;
    dns.set_txt(NAME, &[ID]).await;
    let owner = owner_config(&dns, Duration::from_millis(100), Duration::from_millis(500));
    // When the fence marker is written: how often the kubelet restarted etcd so far, and which
    // etcd processes are alive.
    let at_fence: Arc<Mutex<Option<AtFence>>> = Arc::default();
    let hook: Hook = {
        let (killer, restarts, at_fence) =
            (etcd.killer.clone(), etcd.restarts.clone(), at_fence.clone());
        Box::new(move |access, location| {
            if access == Access::Put && location.as_ref().starts_with(&Key::Fences.name()) {
                let alive = killer.find().expect("proc").iter().map(|p| p.pid).collect();
                at_fence
                    .lock()
                    .expect("lock")
                    .get_or_insert((restarts.load(Ordering::SeqCst), alive));
            }
            Ok(())
        })
    };
    let streaming = StreamingFinal::new(
        etcd.endpoint(),
        Hooked::store(Arc::new(InMemory::new()), hook),
    );
    let (readiness_tx, mut readiness) = watch::channel(Readiness::starting());
    let (gate, _gates) = watch::channel(Gate::Closed);
    let watchdog = etcd.resolving_watchdog(&owner, streaming.seam(), readiness_tx, gate);
    let cancel = CancellationToken::new();
    let (mut status, task) =
        run_until_ready(watchdog, &mut readiness, cancel.clone(), "ready as owner").await;

    dns.set_txt(NAME, &["seed-b"]).await;
    let unready_at = tokio::time::Instant::now();
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.kill.as_ref().is_some_and(|k| k.verified)),
    )
    .await
    .expect("first kill verified")
    .expect("status");
    // The kubelet restarts etcd while the Service may still route to it: a new process a client
    // could have connected to.
    let restarted = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match etcd.pid() {
                Some(pid) if pid != first_pid => return pid,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await
    .expect("etcd restarted within the settle");
    assert!(
        unready_at.elapsed() < settle,
        "the restart must come before the settle ends"
    );
    assert!(
        at_fence.lock().expect("lock").is_none(),
        "no fence during the settle"
    );

    let stored = support::seen_within(&mut status, Duration::from_secs(30), |s| {
        s.final_snapshot.is_some()
    })
    .await;
    assert!(stored, "no final snapshot; status {:?}", *status.borrow());
    assert!(
        unready_at.elapsed() >= settle,
        "fenced before the settle ended"
    );
    let (restarts_at_fence, alive_at_fence) =
        at_fence.lock().expect("lock").clone().expect("fenced");
    assert!(restarts_at_fence >= 1, "{restarts_at_fence}");
    assert!(
        !alive_at_fence.contains(&(restarted as i32)),
        "pid {restarted} (the etcd restarted after the first kill) alive at the fence: {alive_at_fence:?}"
    );
    assert_eq!(streaming.taken.load(Ordering::SeqCst), 1);
    // Killed twice: the first etcd and the one restarted after it.
    assert!(etcd.restarts.load(Ordering::SeqCst) >= 2);
    let kill = status.borrow().kill.clone().expect("kill status");
    assert!(
        kill.verified && kill.last.contains(&format!("pid {restarted} ")),
        "{kill:?}"
    );

    cancel.cancel();
    task.await.expect("watchdog");
    etcd.stop().await;
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
impl etcd_warden::kill::ProcessControl for TimedKiller {
    async fn probe(
        &self,
    ) -> Result<Vec<etcd_warden::kill::ProcessId>, etcd_warden::kill::ProcessError> {
        self.inner.probe().await
    }
    async fn kill_etcd(
        &self,
        earlier: &[etcd_warden::kill::ProcessId],
    ) -> Result<etcd_warden::kill::KillReport, etcd_warden::kill::ProcessError> {
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
    let etcd = RealEtcd::start().await;
    let mut writer = etcd.client().await;
    for i in 0..200 {
        writer
            .put(format!("/bulk/{i}"), vec![b'v'; 4096], None)
            .await
            .expect("put");
    }
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
    let cancel = CancellationToken::new();
    let client = etcd_warden::etcd::RotatingClient::connect(&etcd.config)
        .await
        .expect("client");
    let (actor, actor_task) =
        actor_over(client, hanging, Duration::from_secs(60), gate_rx, &cancel);

    let dns = DnsServer::start().await;
    dns.set_txt(NAME, &[ID]).await;
    let owner = owner_config(&dns, Duration::from_millis(100), Duration::from_millis(500));
    let lookup = Arc::new(TimedLookup {
        inner: OwnerResolver::new(&owner).expect("resolver"),
        not_owner_at: Mutex::new(None),
    });
    let killer = Arc::new(TimedKiller {
        inner: etcd.killer.clone(),
        first_kill_at: Mutex::new(None),
    });
    let (readiness_tx, mut readiness) = watch::channel(Readiness::starting());
    let watchdog = etcd.watchdog(
        &owner,
        lookup.clone(),
        killer.clone(),
        store_snapshots(local, &actor),
        readiness_tx,
        gate,
    );
    let (mut status, task) =
        run_until_ready(watchdog, &mut readiness, cancel.child_token(), "active").await;

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
    let killed =
        support::seen_within(&mut status, Duration::from_secs(10), |s| s.kill.is_some()).await;
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
    etcd.stop().await;
}

/// The snapshot actor over `etcd`, writing to `store`, each snapshot bounded by `timeout`.
fn actor_over(
    client: etcd_warden::etcd::RotatingClient,
    store: SnapshotStore,
    timeout: Duration,
    gate: watch::Receiver<Gate>,
    cancel: &CancellationToken,
) -> (ActorHandle, tokio::task::JoinHandle<()>) {
    let engine = EtcdEngine::new(
        client,
        store,
        Codec::Gzip,
        etcd_warden::store::gc::Retention {
            policy: etcd_warden::config::GcPolicy::LimitBased { max_backups: 10 },
            delta_retention: Duration::ZERO,
        },
    );
    actor::spawn(
        engine,
        support::quiet_actor_config(Duration::ZERO, 1 << 20, timeout),
        gate,
        SnapshotMetrics::default(),
        cancel.child_token(),
    )
}

/// The final snapshots `store` lists.
async fn finals_in(store: &SnapshotStore) -> Vec<Snapshot> {
    store
        .list()
        .await
        .expect("list")
        .into_iter()
        .filter(|s| s.is_final)
        .collect()
}

/// One member, its store on a real S3 server behind [`LosingStore`] (finals only); keys on
/// short leases so the revision moves after the kill without any client write, as
/// kube-apiserver's 15 s leases do. Plays the flip and returns the finals in the store once
/// the hand-off is done and `linger` more has passed (for a late completion to land).
async fn hand_off_losing(loss: Loss, snapshot_timeout: Duration, linger: Duration) {
    let etcd = RealEtcd::start().await;
    let mut writer = etcd.client().await;
    let s3 = S3Server::start(&["backups"]);
    let losing = Arc::new(LosingStore::new(
        s3.object_store("backups"),
        ".final",
        loss,
        1,
    ));
    let store = SnapshotStore::new(losing.clone(), "etcd");
    let (gate, gate_rx) = watch::channel(Gate::Closed);
    let cancel = CancellationToken::new();
    let client = etcd_warden::etcd::RotatingClient::connect(&etcd.config)
        .await
        .expect("client");
    let (actor, actor_task) = actor_over(client, store.clone(), snapshot_timeout, gate_rx, &cancel);
    let dns = DnsServer::start().await;
    dns.set_txt(NAME, &[ID]).await;
    let owner = owner_config(&dns, Duration::from_millis(100), Duration::from_millis(500));
    let (readiness_tx, mut readiness) = watch::channel(Readiness::starting());
    let watchdog = etcd.resolving_watchdog(
        &owner,
        store_snapshots(store.clone(), &actor),
        readiness_tx,
        gate,
    );
    let (mut status, task) =
        run_until_ready(watchdog, &mut readiness, cancel.child_token(), "active").await;

    let lease = writer.lease_grant(2, None).await.expect("lease").id();
    for i in 0..20 {
        let opts = etcd_client::PutOptions::new().with_lease(lease);
        writer
            .put(format!("/leased/{i}"), "x", Some(opts))
            .await
            .expect("put on a lease");
    }
    let mut acknowledged = 0;
    for i in 0..50 {
        acknowledged = writer
            .put(format!("/k/{i}"), "v", None)
            .await
            .expect("put")
            .header()
            .map_or(0, |h| h.revision());
    }

    dns.set_txt(NAME, &["seed-b"]).await;
    let done = support::seen_within(&mut status, Duration::from_secs(60), |s| {
        s.final_snapshot.is_some() && s.state == "deactivated"
    })
    .await;
    assert!(done, "no final; status {:?}", *status.borrow());
    tokio::time::sleep(linger).await;
    assert_eq!(losing.lost(), 1, "the fault was not injected");

    let finals = finals_in(&store).await;
    assert_eq!(finals.len(), 1, "one final for the hand-off: {finals:?}");
    assert!(finals[0].last_revision >= acknowledged);
    let objects = etcd_warden::owner::handoff::HandOffObjects::new(store.clone());
    let record = objects.record().await.expect("record").expect("recorded");
    assert_eq!(record.final_snapshot, finals[0].snap_name);
    let seen = objects.seen().await.expect("hand-off objects");
    assert_eq!(
        etcd_warden::owner::handoff::the_final(&store.list().await.expect("list"), &seen),
        Some(&finals[0])
    );
    // The premise: the leases expired, so etcd's revision moved past the last client write
    // without any client writing. A final judged by a revision read again after that would not
    // have counted one stored before it.
    // A restarted etcd extends its leases by an election and a TTL before they expire, longer
    // on a loaded machine: waited for, up to 20 s, then the finals are read again below.
    let mut now = 0;
    for _ in 0..100 {
        now = etcd
            .client()
            .await
            .status()
            .await
            .expect("status")
            .header()
            .map_or(0, |h| h.revision());
        if now > acknowledged {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        now > acknowledged,
        "the leases did not move the revision: etcd at {now}, last write {acknowledged}"
    );
    let again = finals_in(&store).await;
    assert_eq!(again, finals, "a final after the leases moved the revision");
    println!(
        "final {} at {}, etcd now at {now}",
        finals[0].snap_name, finals[0].last_revision
    );

    cancel.cancel();
    let _ = task.await;
    let _ = actor_task.await;
    etcd.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_for_the_final_while_leases_move_the_revision_leaves_one_final() {
    hand_off_losing(
        Loss::Answer,
        Duration::from_secs(30),
        Duration::from_secs(3),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_lands_after_the_timeout_is_the_same_one_final() {
    // The first completion stalls past the snapshot timeout and lands 6 s later, after the
    // retry stored the final: both write the object the intent named.
    hand_off_losing(
        Loss::Late(Duration::from_secs(6)),
        Duration::from_secs(2),
        Duration::from_secs(7),
    )
    .await;
}

/// The production seam reads the member ID from a real etcd's write-ahead log once etcd is
/// down, on 3.4 and 3.5 alike: the ID the member answered with while it served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_member_id_on_disk_is_the_one_etcd_answered_with() {
    for release in [Release::V34, Release::V35] {
        let mut etcd = EtcdCluster::single(release).await;
        let answered = etcd.client().await.status().await.unwrap();
        let id = answered.header().unwrap().member_id();
        let config = EtcdConfig {
            endpoints: vec![etcd.endpoints()[0].clone()],
            tls: None,
            username: None,
            password: None,
            connect_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(2),
        };
        let member = &mut etcd.members[0];
        let api = EtcdApi::new(config.clone(), Duration::from_secs(1))
            .with_data_dir(Some(member.data_dir.clone()));
        member.kill();
        assert_eq!(
            api.health().await.member_id,
            None,
            "{release:?}: etcd is down"
        );
        assert_eq!(api.member_on_disk().await, Some(id), "{release:?}");
        let none = EtcdApi::new(config, Duration::from_secs(1));
        assert_eq!(none.member_on_disk().await, None, "no data directory named");
    }
}
