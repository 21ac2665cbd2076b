//! One conformance suite for the [`Machines`] seam, run against every backend: the local one
//! (machines are etcd processes on loopback, a real 3-member etcd 3.5 behind them) and the
//! Kubernetes one (`KubeMachines` over the real kube client, against the API server double of
//! `support::apiserver`, Machines created as the Machine API creates them: control-plane label,
//! the machine controller's finalizer, an InternalIP in the status).
//!
//! Each case is a generic async function over a [`Harness`], which plays whoever else touches
//! machines (the Machine API, an administrator, another hook owner, a concurrent writer).

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use etcd_warden::operator::kube::machine_resource::{HOOK_NAME, HOOK_OWNER, Machine};
use etcd_warden::operator::kube::{KubeMachines, KubeMachinesConfig};
use etcd_warden::operator::local::{LocalCluster, LocalOptions};
use etcd_warden::operator::quorum::execute::{BackendError, Machines};
use etcd_warden::operator::quorum::plan::MachineState;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::json;
use support::apiserver::ApiServer;
use support::etcd::Release;
use support::machine_api::{self, MachineApi, create_machine};
use tempfile::TempDir;

type Hook = (String, String);

fn ours() -> Hook {
    (HOOK_NAME.into(), HOOK_OWNER.into())
}

/// A backend under test and the world around it.
#[async_trait]
trait Harness: Send + Sync {
    /// The backend.
    fn machines(&self) -> &dyn Machines;
    /// Creates a control-plane machine that can host a member; returns its name.
    async fn create(&self) -> String;
    /// Marks a machine for deletion, as a user or a MachineHealthCheck does.
    async fn delete(&self, name: &str);
    /// Takes our hook off, as an administrator does (the escape hatch).
    async fn admin_remove_hook(&self, name: &str);
    /// Puts another owner's pre-drain hook on; `false` where the backend has no such thing.
    async fn add_foreign_hook(&self, name: &str) -> bool;
    /// The machine's pre-drain hooks as (name, owner).
    async fn hooks(&self, name: &str) -> Vec<Hook>;
    /// From now on a concurrent writer changes each machine right before its first write;
    /// `false` where no concurrent writer exists.
    fn inject_conflicts(&self) -> bool;
    /// Writes the backend attempted on a machine, where they can be counted.
    fn write_attempts(&self, name: &str) -> Option<usize>;
}

async fn state(h: &dyn Harness, name: &str) -> Option<MachineState> {
    h.machines()
        .list()
        .await
        .expect("list")
        .into_iter()
        .find(|m| m.name == name)
}

// ---------------------------------------------------------------------------------------------
// The cases

async fn list_reflects_machines(h: &dyn Harness) {
    let before = h.machines().list().await.unwrap();
    let a = h.create().await;
    let b = h.create().await;
    let after = h.machines().list().await.unwrap();
    assert_eq!(after.len(), before.len() + 2, "{after:?}");
    for name in [&a, &b] {
        let m = after.iter().find(|m| &m.name == name).expect("listed");
        assert!(
            !m.deleting && !m.has_hook && !m.hook_removed_by_other,
            "{m:?}"
        );
        assert!(!m.peer_url.is_empty());
    }
    let mut urls: Vec<&str> = after.iter().map(|m| m.peer_url.as_str()).collect();
    urls.sort();
    urls.dedup();
    assert_eq!(urls.len(), after.len(), "peer URLs are unique");

    h.delete(&a).await;
    let m = state(h, &a)
        .await
        .expect("a deleting machine is still listed");
    assert!(m.deleting);
    assert!(!state(h, &b).await.unwrap().deleting);
}

async fn add_hook_is_idempotent(h: &dyn Harness) {
    let a = h.create().await;
    h.machines().add_hook(&a).await.unwrap();
    h.machines().add_hook(&a).await.unwrap();
    assert!(state(h, &a).await.unwrap().has_hook);
    assert_eq!(h.hooks(&a).await, vec![ours()]);
}

async fn a_hook_holds_a_deleting_machine_and_is_released(h: &dyn Harness) {
    let a = h.create().await;
    h.machines().add_hook(&a).await.unwrap();
    h.delete(&a).await;
    let m = state(h, &a).await.unwrap();
    assert!(
        m.deleting && m.has_hook && !m.hook_removed_by_other,
        "{m:?}"
    );
    // Adding it again to a deleting machine that carries it is a no-op, not a refusal.
    h.machines().add_hook(&a).await.unwrap();
    h.machines().release_hook(&a).await.unwrap();
    assert!(h.hooks(&a).await.is_empty());
}

async fn hook_never_re_added_to_a_deleting_machine(h: &dyn Harness) {
    let a = h.create().await;
    h.machines().add_hook(&a).await.unwrap();
    h.delete(&a).await;
    h.admin_remove_hook(&a).await;
    let m = state(h, &a).await.unwrap();
    assert!(
        m.deleting && !m.has_hook && m.hook_removed_by_other,
        "{m:?}"
    );
    match h.machines().add_hook(&a).await {
        Err(BackendError::Deleting(name)) => assert_eq!(name, a),
        other => panic!("expected Deleting, got {other:?}"),
    }
    assert!(!h.hooks(&a).await.contains(&ours()));
    assert!(!state(h, &a).await.unwrap().has_hook);
}

async fn release_hook_removes_only_ours(h: &dyn Harness) {
    let a = h.create().await;
    let foreign = h.add_foreign_hook(&a).await;
    h.machines().add_hook(&a).await.unwrap();
    let b = h.create().await;
    h.machines().add_hook(&b).await.unwrap();

    h.machines().release_hook(&a).await.unwrap();
    h.machines().release_hook(&a).await.unwrap();
    assert!(!state(h, &a).await.unwrap().has_hook);
    let left = h.hooks(&a).await;
    assert!(!left.contains(&ours()));
    if foreign {
        assert_eq!(left.len(), 1, "the other owner's hook stays: {left:?}");
    }
    assert!(
        state(h, &b).await.unwrap().has_hook,
        "other machines keep theirs"
    );
}

async fn a_conflict_on_every_first_write_converges(h: &dyn Harness) {
    let a = h.create().await;
    let b = h.create().await;
    h.machines().add_hook(&b).await.unwrap();
    let conflicts = h.inject_conflicts();
    h.machines().add_hook(&a).await.unwrap();
    h.machines().release_hook(&b).await.unwrap();
    assert!(state(h, &a).await.unwrap().has_hook);
    assert!(!state(h, &b).await.unwrap().has_hook);
    assert_eq!(h.hooks(&a).await, vec![ours()]);
    if conflicts {
        // One refused write, one after reading again.
        assert_eq!(h.write_attempts(&a), Some(2));
        assert_eq!(h.write_attempts(&b), Some(2 + 1));
    }
}

async fn an_unknown_machine_is_not_found(h: &dyn Harness) {
    assert!(matches!(
        h.machines().add_hook("no-such-machine").await,
        Err(BackendError::NotFound(_))
    ));
    assert!(matches!(
        h.machines().release_hook("no-such-machine").await,
        Err(BackendError::NotFound(_))
    ));
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod local {
            $(
                #[tokio::test]
                async fn $case() {
                    let h = super::LocalHarness::start().await;
                    super::$case(&h).await;
                }
            )*
        }
        mod kube_double {
            $(
                #[tokio::test]
                async fn $case() {
                    let h = super::KubeHarness::start().await;
                    super::$case(&h).await;
                }
            )*
        }
    };
}

conformance!(
    list_reflects_machines,
    add_hook_is_idempotent,
    a_hook_holds_a_deleting_machine_and_is_released,
    hook_never_re_added_to_a_deleting_machine,
    release_hook_removes_only_ours,
    a_conflict_on_every_first_write_converges,
    an_unknown_machine_is_not_found,
);

// ---------------------------------------------------------------------------------------------
// The local backend

struct LocalHarness {
    cluster: Arc<LocalCluster>,
    _dir: TempDir,
}

impl LocalHarness {
    async fn start() -> LocalHarness {
        let dir = tempfile::tempdir().unwrap();
        let cluster = LocalCluster::start(LocalOptions {
            members: 3,
            dir: dir.path().join("cluster"),
            etcd: Release::V35.bin("etcd"),
            no_fsync: true,
            set: None,
        })
        .await
        .expect("a local 3-member cluster");
        LocalHarness { cluster, _dir: dir }
    }
}

#[async_trait]
impl Harness for LocalHarness {
    fn machines(&self) -> &dyn Machines {
        &*self.cluster
    }

    async fn create(&self) -> String {
        self.cluster.create_machine().unwrap()
    }

    async fn delete(&self, name: &str) {
        self.cluster.delete_machine(name).unwrap();
    }

    async fn admin_remove_hook(&self, name: &str) {
        self.cluster.remove_hook_as_admin(name).unwrap();
    }

    async fn add_foreign_hook(&self, _name: &str) -> bool {
        false
    }

    async fn hooks(&self, name: &str) -> Vec<Hook> {
        let m = self.cluster.machines().into_iter().find(|m| m.name == name);
        if m.expect("machine").has_hook {
            vec![ours()]
        } else {
            vec![]
        }
    }

    fn inject_conflicts(&self) -> bool {
        false
    }

    fn write_attempts(&self, _name: &str) -> Option<usize> {
        None
    }
}

// ---------------------------------------------------------------------------------------------
// The Kubernetes backend against the API server double

const NAMESPACE: &str = "openshift-machine-api";

struct KubeHarness {
    server: ApiServer,
    api: Api<Machine>,
    raw: Api<DynamicObject>,
    backend: KubeMachines,
    next: AtomicUsize,
}

impl KubeHarness {
    async fn start() -> KubeHarness {
        let server = ApiServer::start().await;
        let client = server.client();
        let backend = KubeMachines::new(client.clone(), KubeMachinesConfig::default());
        KubeHarness {
            raw: machine_api::machines(client.clone(), NAMESPACE),
            api: Api::namespaced(client, NAMESPACE),
            server,
            backend,
            next: AtomicUsize::new(0),
        }
    }

    async fn set_hooks(&self, name: &str, hooks: Vec<serde_json::Value>) {
        let p = json!({"spec": {"lifecycleHooks": {"preDrain": hooks}}});
        self.api
            .patch(name, &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap();
    }
}

#[async_trait]
impl Harness for KubeHarness {
    fn machines(&self) -> &dyn Machines {
        &self.backend
    }

    async fn create(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::SeqCst);
        let name = format!("cp-{n}");
        let ip = format!("10.0.0.{}", n + 10);
        create_machine(&self.raw, &name, "master", Some(&ip)).await;
        name
    }

    async fn delete(&self, name: &str) {
        self.api
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    async fn admin_remove_hook(&self, name: &str) {
        let kept: Vec<serde_json::Value> = self
            .hooks(name)
            .await
            .into_iter()
            .filter(|h| *h != ours())
            .map(|(name, owner)| json!({"name": name, "owner": owner}))
            .collect();
        self.set_hooks(name, kept).await;
    }

    async fn add_foreign_hook(&self, name: &str) -> bool {
        let mut hooks: Vec<serde_json::Value> = self
            .hooks(name)
            .await
            .into_iter()
            .map(|(name, owner)| json!({"name": name, "owner": owner}))
            .collect();
        hooks.push(json!({"name": "MachineDrainGuard", "owner": "someone/else"}));
        self.set_hooks(name, hooks).await;
        true
    }

    async fn hooks(&self, name: &str) -> Vec<Hook> {
        let m = self.api.get(name).await.unwrap();
        m.spec
            .lifecycle_hooks
            .pre_drain
            .into_iter()
            .map(|h| (h.name, h.owner))
            .collect()
    }

    fn inject_conflicts(&self) -> bool {
        self.server.inject_conflicts(true);
        true
    }

    fn write_attempts(&self, name: &str) -> Option<usize> {
        let path = format!(
            "PATCH /apis/machine.openshift.io/v1beta1/namespaces/{NAMESPACE}/machines/{name}"
        );
        Some(
            self.server
                .requests()
                .iter()
                .filter(|r| r.split('?').next() == Some(path.as_str()))
                .count(),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The Kubernetes backend only

#[tokio::test]
async fn kube_lists_only_selected_machines_with_an_address() {
    let h = KubeHarness::start().await;
    create_machine(&h.raw, "cp-a", "master", Some("10.0.0.1")).await;
    create_machine(&h.raw, "worker-a", "worker", Some("10.0.1.1")).await;
    create_machine(&h.raw, "cp-provisioning", "master", None).await;
    create_machine(&h.raw, "cp-v6", "master", Some("fd00::5")).await;
    let mut listed = h.backend.list().await.unwrap();
    listed.sort_by(|a, b| a.name.cmp(&b.name));
    let names: Vec<&str> = listed.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["cp-a", "cp-v6"]);
    assert_eq!(listed[0].peer_url, "https://10.0.0.1:2380");
    assert_eq!(listed[1].peer_url, "https://[fd00::5]:2380");
}

#[tokio::test]
async fn kube_never_hooks_a_machine_deleted_before_it_was_protected() {
    // Nobody can tell "never hooked" from "hook taken off" on a Machine: both stay unhooked.
    let h = KubeHarness::start().await;
    let a = h.create().await;
    h.delete(&a).await;
    let m = state(&h, &a).await.unwrap();
    assert!(m.deleting && !m.has_hook && m.hook_removed_by_other);
    assert!(matches!(
        h.backend.add_hook(&a).await,
        Err(BackendError::Deleting(_))
    ));
}

#[tokio::test]
async fn kube_hook_is_exactly_the_seeds() {
    let h = KubeHarness::start().await;
    let a = h.create().await;
    h.backend.add_hook(&a).await.unwrap();
    let raw = h
        .server
        .get(
            &support::apiserver::Res::new("machine.openshift.io", "v1beta1", "machines"),
            NAMESPACE,
            &a,
        )
        .unwrap();
    assert_eq!(
        raw["spec"]["lifecycleHooks"],
        json!({"preDrain": [{"name": "EtcdQuorumOperator", "owner": "clusteroperator/etcd"}]})
    );
}

#[tokio::test]
async fn kube_api_errors_map_to_transient_or_permanent() {
    use etcd_warden::operator::kube::machines::backend_error;
    let status = |code: u16| {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            ..Default::default()
        }))
    };
    for code in [409, 410, 429, 500, 503] {
        assert!(backend_error("x", status(code)).is_transient(), "{code}");
    }
    for code in [400, 401, 403, 422] {
        assert!(!backend_error("x", status(code)).is_transient(), "{code}");
    }
    // Nothing listens on the double's port once it is gone: unreachable is transient.
    let server = ApiServer::start().await;
    let client = server.client();
    drop(server);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let backend = KubeMachines::new(client, KubeMachinesConfig::default());
    let e = backend.list().await.unwrap_err();
    assert!(e.is_transient(), "{e}");
}

#[tokio::test]
async fn kube_a_deleting_machine_goes_only_once_its_hook_is_released() {
    let h = KubeHarness::start().await;
    let terminated = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let _machine_api = MachineApi::start(h.raw.clone(), {
        let t = terminated.clone();
        move |name| t.lock().unwrap().push(name.to_owned())
    });
    let (a, b) = (h.create().await, h.create().await);
    h.backend.add_hook(&a).await.unwrap();
    h.backend.add_hook(&b).await.unwrap();
    h.delete(&a).await;
    h.delete(&b).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(terminated.lock().unwrap().is_empty(), "hooks hold both");
    assert!(state(&h, &a).await.is_some() && state(&h, &b).await.is_some());

    // The operator releases a's hook; an administrator takes b's off (the escape hatch).
    h.backend.release_hook(&a).await.unwrap();
    h.admin_remove_hook(&b).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while h
        .backend
        .list()
        .await
        .unwrap()
        .iter()
        .any(|m| m.name == a || m.name == b)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "machines not terminated"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut t = terminated.lock().unwrap().clone();
    t.sort();
    assert_eq!(t, vec![a, b]);
}

#[tokio::test]
async fn kube_census_counts_every_selected_machine_and_the_running_ones() {
    let h = KubeHarness::start().await;
    let c = h.backend.census().await.unwrap();
    assert_eq!((c.total, c.running), (0, 0));
    assert!(
        !c.machine_api_functional(),
        "no Machines: the Machine API does not work here"
    );
    create_machine(&h.raw, "cp-a", "master", Some("10.0.0.1")).await;
    create_machine(&h.raw, "cp-new", "master", None).await;
    create_machine(&h.raw, "worker-a", "worker", Some("10.0.1.1")).await;
    h.delete("cp-a").await;
    let c = h.backend.census().await.unwrap();
    assert_eq!((c.total, c.running), (2, 1));
    assert!(c.machine_api_functional());
}
