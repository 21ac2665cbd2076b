//! The ControlPlaneSet on Kubernetes (`operator::kube::set_controller`, spawned by the quorum
//! operator's `operator::kube::controller::run`, in process) against the API server double and a
//! real 3-member etcd 3.5. The test plays the Machine API: a new Machine is "provisioned" (the
//! machine controller's finalizer, the next loopback address, phase `Running` and a node
//! reference); a deleting Machine goes once no pre-drain hook holds it, its etcd killed
//! (`support::machine_api`); and the platform starts etcd for a learner added on a Machine's
//! address. The quorum operator runs with `Replacement::Surge`, as a RollingUpdate needs.
//!
//! Scenarios: a template change rolls the 3 Machines one at a time under a live writer; a
//! failure domain added moves one Machine into it; a new set for 5 over 3 Machines, a change of
//! `spec.replicas` or `spec.selector` and a set not named `cluster` are refused with a Degraded
//! condition naming the field, a Machine another controller owns is a Degraded condition
//! (`MachineActionRefused`) until freed, and deleting the set leaves every Machine, owner references
//! removed; while another replica holds the Lease the set is not touched; OnDelete (the quorum
//! operator ordering by deletion) replaces only the Machine deleted by hand, and a RollingUpdate
//! set over that quorum operator is refused; Recreate (the quorum operator shrinking first) rolls
//! the 3 Machines under a writer, never more than 3 Machines, never fewer than 2 voters.
//!
//! What the double does NOT check: it evaluates no CEL rule, no OpenAPI enum and no default of
//! the CRD (no CRD is installed: any JSON is stored), and it garbage-collects nothing by owner
//! reference. So the refusals seen here are the controller's own checks
//! (`control_plane_set::resource::validate`), and "deleting the set leaves the Machines" shows
//! the owner references gone, not a garbage collector held back. The etcd harness mirrors
//! tests/operator_kube.rs (loopback "hosts", one member each).

use crate::support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_warden::operator::control_plane_set::resource::{
    ControlPlaneSet, ControlPlaneSetSpec, FINALIZER as SET_FINALIZER, FailureDomains,
    MachineTemplate, Platform, ProviderSpec, TemplateMachineSpec, TemplateMetadata, UpdateStrategy,
};
use etcd_warden::operator::kube::controller::{self, Settings};
use etcd_warden::operator::kube::set_machines::SET_LABEL;
use etcd_warden::operator::quorum::plan::Replacement;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime};
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::apiserver::ApiServer;
use support::hosts::{Bounds, Load, eventually, ip};
use support::kube_world::{ETCD_NS, KubeWorld, MACHINES_NS};
use support::machine_api::{self, FINALIZER, MachineApi, ROLE_LABEL, create_machine};
use tokio_util::sync::CancellationToken;

/// The machine controller: a Machine nobody has provisioned yet gets the machine controller's
/// finalizer, the next free loopback address (recorded in `names`, so the platform and the
/// writer find its member), phase `Running` and a node reference.
async fn provisioner(
    raw: Api<DynamicObject>,
    names: Arc<Mutex<BTreeMap<String, String>>>,
    mut next: usize,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        if let Ok(list) = raw.list(&ListParams::default()).await {
            for m in list.items {
                if m.data.pointer("/status/phase").is_some()
                    || m.metadata.deletion_timestamp.is_some()
                {
                    continue;
                }
                let name = m.name_any();
                let addr = ip(next);
                next += 1;
                names.lock().unwrap().insert(addr.clone(), name.clone());
                let mut finalizers = m.finalizers().to_vec();
                finalizers.push(FINALIZER.into());
                let p = json!({"metadata": {
                    "finalizers": finalizers,
                    "resourceVersion": m.metadata.resource_version,
                }});
                raw.patch(&name, &PatchParams::default(), &Patch::Merge(&p))
                    .await
                    .expect("the machine controller's finalizer");
                let p = json!({"status": {
                    "phase": "Running",
                    "addresses": [{"type": "InternalIP", "address": addr}],
                    "nodeRef": {"kind": "Node", "name": name},
                }});
                raw.patch_status(&name, &PatchParams::default(), &Patch::Merge(&p))
                    .await
                    .expect("report the machine running");
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`KubeWorld`] with the Machine API, a provisioner and the operator (whose controller runs
/// the set's loop).
struct World {
    kube: KubeWorld,
    sets: Api<ControlPlaneSet>,
    /// How the quorum operator orders membership changes (Surge unless a test says otherwise).
    replacement: Replacement,
    _machine_api: MachineApi,
}

impl std::ops::Deref for World {
    type Target = KubeWorld;
    fn deref(&self) -> &KubeWorld {
        &self.kube
    }
}

impl World {
    /// cp-0..cp-2 running etcd, their Machines Running with a node (in `zones`' availability
    /// zones when given), and the operator leading.
    async fn start(zones: &[&str]) -> World {
        let w = World::build(zones).await;
        w.run_operator();
        w
    }

    /// As [`World::start`] (no zones), the quorum operator ordering membership changes by
    /// `replacement`.
    async fn start_ordered(replacement: Replacement) -> World {
        let mut w = World::build(&[]).await;
        w.replacement = replacement;
        w.run_operator();
        w
    }

    /// As [`World::start`], the operator not started.
    async fn build(zones: &[&str]) -> World {
        let kube = KubeWorld::start(None).await;
        for (i, n) in ["cp-0", "cp-1", "cp-2"].into_iter().enumerate() {
            let p = json!({"status": {"nodeRef": {"kind": "Node", "name": n}}});
            machine_api::merge_status(&kube.raw, n, &p).await;
            if let Some(z) = zones.get(i) {
                let p = json!({"spec": {"providerSpec": {"value": {"placement": {"availabilityZone": z}}}}});
                machine_api::merge(&kube.raw, n, &p).await;
            }
        }
        tokio::spawn(provisioner(
            kube.raw.clone(),
            Arc::clone(&kube.names),
            3,
            kube.stop.clone(),
        ));
        World {
            sets: Api::namespaced(kube.kc.clone(), MACHINES_NS),
            replacement: Replacement::Surge,
            _machine_api: kube.machine_api(),
            kube,
        }
    }

    /// Starts the quorum operator (and so the set's loop) as replica `op-0`.
    fn run_operator(&self) {
        tokio::spawn(controller::run(
            self.server.client_as(support::rbac::OPERATOR),
            self.settings(),
            self.stop.child_token(),
        ));
    }

    /// As [`World::run_operator`], serving `/healthz`, `/readyz` and `/metrics`; returns their
    /// base URL.
    fn run_operator_serving(&self) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(controller::run_serving(
            self.server.client_as(support::rbac::OPERATOR),
            self.settings(),
            Some(tokio::net::TcpListener::from_std(listener).unwrap()),
            self.stop.child_token(),
        ));
        base
    }

    fn settings(&self) -> Settings {
        self.kube.settings("op-0", self.replacement)
    }

    /// Creates the set `name` over the role=master Machines, at the harness's provider spec.
    async fn create_set(&self, name: &str, domains: Option<&[&str]>) {
        self.create_set_of(name, domains, 3).await;
    }

    /// As [`World::create_set`], for `replicas`.
    async fn create_set_of(&self, name: &str, domains: Option<&[&str]>, replicas: i32) {
        let labels = BTreeMap::from([(ROLE_LABEL.to_owned(), "master".to_owned())]);
        let spec = ControlPlaneSetSpec {
            state: Default::default(),
            replicas,
            strategy: UpdateStrategy::default(),
            failure_domains: domains.map(|d| FailureDomains {
                platform: Platform::AWS,
                domains: d.iter().map(|s| s.to_string()).collect(),
            }),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                match_expressions: None,
            },
            template: MachineTemplate {
                metadata: TemplateMetadata {
                    labels,
                    annotations: BTreeMap::new(),
                },
                spec: TemplateMachineSpec {
                    provider_spec: ProviderSpec {
                        value: json!({"instanceType": "test"}),
                    },
                },
            },
        };
        self.sets
            .create(&PostParams::default(), &ControlPlaneSet::new(name, spec))
            .await
            .unwrap();
    }

    async fn patch_set(&self, spec: Value) {
        self.sets
            .patch(
                "cluster",
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": spec})),
            )
            .await
            .unwrap();
    }

    async fn machines(&self) -> Vec<DynamicObject> {
        self.raw.list(&ListParams::default()).await.unwrap().items
    }

    /// Waits until the set has seen its latest generation and `done` holds of its status.
    async fn status_until(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        eventually(what, timeout, async || {
            let set = self.sets.get_opt("cluster").await.ok().flatten()?;
            let status = serde_json::to_value(set.status.as_ref()?).ok()?;
            (status["observedGeneration"].as_i64() == set.metadata.generation && done(&status))
                .then_some(status)
        })
        .await
    }

    /// Waits until the three Machines are adopted and the set settled at its template.
    async fn settled(&self) -> Value {
        let uid = self.sets.get("cluster").await.unwrap().uid().unwrap();
        eventually(
            "every machine adopted",
            Duration::from_secs(30),
            async || {
                let ms = self.machines().await;
                (ms.len() == 3
                    && ms.iter().all(|m| {
                        m.labels().get(SET_LABEL) == Some(&uid)
                            && m.owner_references().iter().all(|o| o.uid != uid)
                    }))
                .then_some(())
            },
        )
        .await;
        self.status_until("the set settled", Duration::from_secs(60), |s| {
            s["updatedReplicas"] == 3
                && s["readyReplicas"] == 3
                && condition(s, "Progressing").0 == "False"
        })
        .await
    }

    /// Deletes the set `cluster` with `policy` (the server's default without one) and waits
    /// until it is gone.
    async fn delete_set(&self, policy: Option<kube::api::PropagationPolicy>) {
        let dp = DeleteParams {
            propagation_policy: policy,
            ..DeleteParams::default()
        };
        self.sets.delete("cluster", &dp).await.unwrap();
        eventually("the set gone", Duration::from_secs(20), async || {
            self.sets
                .get_opt("cluster")
                .await
                .ok()?
                .is_none()
                .then_some(())
        })
        .await;
    }

    /// Waits until the set `cluster` is Degraded (`what`), and checks the condition's reason is
    /// `reason` and its message starts with `message`; returns the status.
    async fn refused(&self, what: &str, reason: &str, message: &str) -> Value {
        let status = self
            .status_until(what, Duration::from_secs(20), |s| {
                condition(s, "Degraded").0 == "True"
            })
            .await;
        let (_, got_reason, got_message) = condition(&status, "Degraded");
        assert_eq!(got_reason, reason);
        assert!(got_message.starts_with(message), "{got_message}");
        status
    }

    /// Patches the set's template to a new instance type (`big`), for a roll.
    async fn change_template(&self) {
        self.patch_set(
            json!({"template": {"spec": {"providerSpec": {"value": {"instanceType": "big"}}}}}),
        )
        .await;
    }

    /// Starts a [`Load`] and a sampler of the most Machines seen at once (stopping with the
    /// load), and once they run, changes the template; returns both.
    async fn roll_under_load(&self) -> (Load, tokio::task::JoinHandle<usize>) {
        let load = Load::start(&self.hosts, &self.names);
        let peak = tokio::spawn(machine_peak(self.raw.clone(), load.token()));
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.change_template().await;
        (load, peak)
    }

    /// Checks the Machines are still `before`, none of them deleting (`context` heads each
    /// message); returns them.
    async fn all_left_in_place(&self, before: &[String], context: &str) -> Vec<DynamicObject> {
        let ms = self.machines().await;
        let names: Vec<String> = ms.iter().map(|m| m.name_any()).collect();
        assert_eq!(names, before, "{context}every machine left in place");
        for m in &ms {
            assert!(
                m.metadata.deletion_timestamp.is_none(),
                "{context}{} deleted",
                m.name_any()
            );
        }
        ms
    }

    /// Reasons of the Events on the set, once per occurrence.
    async fn set_events(&self) -> Vec<String> {
        self.machine_events()
            .await
            .into_iter()
            .filter(|e| {
                e.regarding
                    .as_ref()
                    .is_some_and(|r| r.kind.as_deref() == Some("ControlPlaneSet"))
            })
            // The recorder folds repeats of one reason into a series.
            .flat_map(|e| {
                let n = e.series.as_ref().map_or(1, |s| s.count.max(1)) as usize;
                std::iter::repeat_n(e.reason.unwrap_or_default(), n)
            })
            .collect()
    }
}

/// (status, reason, message) of the condition `kind`.
fn condition(status: &Value, kind: &str) -> (String, String, String) {
    let c = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == kind);
    let s = |k: &str| c.and_then(|c| c[k].as_str()).unwrap_or_default().to_owned();
    (s("status"), s("reason"), s("message"))
}

/// The string at `pointer` in the Machine's provider spec (empty when there is none).
fn provider_spec_str(m: &DynamicObject, pointer: &str) -> String {
    m.data
        .pointer(&format!("/spec/providerSpec/value{pointer}"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn zone(m: &DynamicObject) -> String {
    provider_spec_str(m, "/placement/availabilityZone")
}

fn instance_type(m: &DynamicObject) -> String {
    provider_spec_str(m, "/instanceType")
}

/// The most Machines (deleting ones included) seen at once, sampled until `stop`.
async fn machine_peak(raw: Api<DynamicObject>, stop: CancellationToken) -> usize {
    let mut peak = 0;
    while !stop.is_cancelled() {
        if let Ok(l) = raw.list(&ListParams::default()).await {
            peak = peak.max(l.items.len());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    peak
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_change_rolls_three_machines_one_at_a_time_under_writes() {
    let w = World::start(&[]).await;
    w.create_set("cluster", None).await;
    w.settled().await;
    assert!(w.set_events().await.iter().all(|r| r == "MachineAdopted"));

    let (load, peak) = w.roll_under_load().await;

    // Every Machine replaced: three new ones at the new spec, the old ones gone, their members
    // the three voters.
    let final_machines = eventually("the rollout", Duration::from_secs(180), async || {
        let ms = w.machines().await;
        let names: Vec<String> = ms.iter().map(|m| m.name_any()).collect();
        let done = ms.len() == 3
            && ms
                .iter()
                .all(|m| instance_type(m) == "big" && m.metadata.deletion_timestamp.is_none())
            && !names.iter().any(|n| n.starts_with("cp-"));
        if !done {
            return None;
        }
        let list = w.members().await?;
        let mut voters: Vec<String> = list.iter().filter(|m| !m.3).map(|m| m.1.clone()).collect();
        voters.sort();
        let mut want = names.clone();
        want.sort();
        (voters == want && list.len() == 3).then_some(names)
    })
    .await;
    w.status_until(
        "the set's status at the new template",
        Duration::from_secs(30),
        |s| {
            s["updatedReplicas"] == 3
                && s["replicas"] == 3
                && condition(s, "Progressing").0 == "False"
        },
    )
    .await;
    let bounds = Bounds {
        min_voters: 3,
        max_voters: None,
        max_learners: None,
    };
    load.finish_within(bounds, &w.client_urls()).await;
    let peak = peak.await.unwrap();
    assert!(peak <= 4, "{peak} machines at once (replicas + 1 at most)");
    for m in &final_machines {
        assert!(
            m.starts_with("cluster-control-plane-"),
            "{m} made from the template"
        );
    }
    let reasons = w.set_events().await;
    let count = |r: &str| reasons.iter().filter(|x| *x == r).count();
    assert_eq!(
        (count("MachineCreated"), count("MachineDeleted")),
        (3, 3),
        "{reasons:?}"
    );
    support::rbac::assert_operator_allowed(&w.server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_domain_added_moves_one_machine_into_it() {
    let w = World::start(&["a", "b", "a"]).await;
    w.create_set("cluster", Some(&["a", "b"])).await;
    w.settled().await;
    let peak = tokio::spawn(machine_peak(w.raw.clone(), w.stop.clone()));
    w.patch_set(json!({"failureDomains": {"platform": "AWS", "domains": ["a", "b", "c"]}}))
        .await;
    let ms = eventually(
        "one machine moved to c",
        Duration::from_secs(120),
        async || {
            let ms = w.machines().await;
            let mut zones: Vec<String> = ms.iter().map(zone).collect();
            zones.sort();
            (zones == ["a", "b", "c"] && ms.iter().all(|m| m.metadata.deletion_timestamp.is_none()))
                .then_some(ms)
        },
    )
    .await;
    let names: Vec<String> = ms.iter().map(|m| m.name_any()).collect();
    // The crowded domain gave up its last Machine by name; the others stayed.
    assert!(
        names.contains(&"cp-0".to_owned()) && names.contains(&"cp-1".to_owned()),
        "{names:?}"
    );
    let moved = ms.iter().find(|m| zone(m) == "c").unwrap();
    assert!(moved.name_any().starts_with("cluster-control-plane-"));
    assert_eq!(
        instance_type(moved),
        "test",
        "the template's spec, the domain injected"
    );
    w.status_until("the set balanced", Duration::from_secs(30), |s| {
        s["updatedReplicas"] == 3 && condition(s, "Progressing").0 == "False"
    })
    .await;
    w.stop.cancel();
    assert!(peak.await.unwrap() <= 4);
    let reasons = w.set_events().await;
    assert_eq!(
        reasons.iter().filter(|r| *r == "MachineCreated").count(),
        1,
        "{reasons:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_the_field_and_deleting_the_set_leaves_every_machine() {
    let w = World::start(&[]).await;
    let before: Vec<String> = w.machines().await.iter().map(|m| m.name_any()).collect();
    // A new set for 5 over a control plane of 3: it takes over, never resizes.
    w.create_set_of("cluster", None, 5).await;
    let status = w
        .refused(
            "the resize refused",
            "InvalidSpec",
            "spec.replicas: is 5 but 3 control-plane Machines",
        )
        .await;
    assert!(status["accepted"].is_null(), "nothing accepted: {status}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let now: Vec<String> = w.machines().await.iter().map(|m| m.name_any()).collect();
    assert_eq!(now, before, "nothing created while refused");
    // cp-2 is controlled by something else: the set says so and adopts it once that is gone.
    let foreign = json!({"metadata": {"ownerReferences": [{
        "apiVersion": "machine.openshift.io/v1beta1", "kind": "MachineSet",
        "name": "workers", "uid": "ms-uid", "controller": true,
    }]}});
    machine_api::merge(&w.raw, "cp-2", &foreign).await;
    w.patch_set(json!({"replicas": 3})).await;
    let status = w
        .status_until("the adoption refused", Duration::from_secs(20), |s| {
            condition(s, "Degraded").1 == "MachineActionRefused"
        })
        .await;
    let message = condition(&status, "Degraded").2;
    assert!(message.contains("MachineSet workers"), "{message}");
    let p = json!({"metadata": {"ownerReferences": null}});
    machine_api::merge(&w.raw, "cp-2", &p).await;
    w.settled().await;

    // A second set, not named cluster: refused, never acted on.
    w.create_set("other", None).await;
    eventually(
        "the other set refused",
        Duration::from_secs(20),
        async || {
            let set = w.sets.get("other").await.ok()?;
            let status = serde_json::to_value(set.status?).ok()?;
            let (s, reason, message) = condition(&status, "Degraded");
            (s == "True" && reason == "InvalidSpec" && message.starts_with("metadata.name:"))
                .then_some(())
        },
    )
    .await;
    assert!(w.sets.get("other").await.unwrap().finalizers().is_empty());

    // replicas is immutable: the controller refuses the change (the double runs no CEL).
    w.patch_set(json!({"replicas": 5})).await;
    let status = w
        .refused(
            "the replicas change refused",
            "InvalidSpec",
            "spec.replicas: is immutable",
        )
        .await;
    assert_eq!(status["accepted"]["replicas"], 3);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let now: Vec<String> = w.machines().await.iter().map(|m| m.name_any()).collect();
    assert_eq!(now, before, "nothing acted on while refused");

    // The selector too.
    w.patch_set(
        json!({"replicas": 3, "selector": {"matchLabels": {ROLE_LABEL: "master", "x": "y"}}}),
    )
    .await;
    let status = w
        .status_until(
            "the selector change refused",
            Duration::from_secs(20),
            |s| {
                condition(s, "Degraded")
                    .2
                    .starts_with("spec.selector: is immutable")
            },
        )
        .await;
    assert_eq!(condition(&status, "Degraded").1, "InvalidSpec");

    // Deleting the set orphans the Machines, then the set goes.
    let set = w.sets.get("cluster").await.unwrap();
    assert!(set.finalizers().iter().any(|f| f == SET_FINALIZER));
    let uid = set.uid().unwrap();
    w.delete_set(None).await;
    for m in &w.all_left_in_place(&before, "").await {
        assert!(
            m.owner_references().iter().all(|o| o.uid != uid)
                && !m.labels().contains_key(SET_LABEL),
            "{} still the set's",
            m.name_any()
        );
    }
    assert!(w.set_events().await.iter().any(|r| r == "MachineOrphaned"));
    support::rbac::assert_operator_allowed(&w.server);
}

/// Renews a Lease held by `someone-else` until `stop`, as a live replica would.
async fn hold_lease(kc: kube::Client, stop: CancellationToken) {
    let leases: Api<Lease> = Api::namespaced(kc, ETCD_NS);
    let now = || MicroTime(k8s_openapi::jiff::Timestamp::now());
    let lease = Lease {
        metadata: kube::api::ObjectMeta {
            name: Some("etcd-warden-operator".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("someone-else".into()),
            lease_duration_seconds: Some(2),
            acquire_time: Some(now()),
            renew_time: Some(now()),
            ..Default::default()
        }),
    };
    leases.create(&PostParams::default(), &lease).await.unwrap();
    while !stop.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let p = json!({"spec": {"renewTime": now()}});
        let _ = leases
            .patch(
                "etcd-warden-operator",
                &PatchParams::default(),
                &Patch::Merge(&p),
            )
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_lease_holder_acts_on_the_set() {
    let w = World::build(&[]).await;
    let other = CancellationToken::new();
    let held = tokio::spawn(hold_lease(w.kc.clone(), other.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.run_operator();
    w.create_set("cluster", None).await;
    // Many resyncs later: another replica leads, so no finalizer, no status, nothing adopted.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let set = w.sets.get("cluster").await.unwrap();
    assert!(set.finalizers().is_empty(), "{:?}", set.finalizers());
    assert!(set.status.is_none(), "{:?}", set.status);
    assert!(
        w.machines()
            .await
            .iter()
            .all(|m| m.owner_references().is_empty() && !m.labels().contains_key(SET_LABEL))
    );
    // The other replica stops renewing: this one takes over and acts.
    other.cancel();
    held.await.unwrap();
    w.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_delete_replaces_a_machine_only_once_someone_deletes_it() {
    let w = World::start_ordered(Replacement::OnDeletion).await;
    // A RollingUpdate set over a quorum operator ordering by deletion would stall: refused.
    w.create_set("cluster", None).await;
    w.refused(
        "the mismatch refused",
        "QuorumOperatorMismatch",
        "spec.strategy.type: ",
    )
    .await;
    w.patch_set(json!({"strategy": {"type": "OnDelete"}})).await;
    w.settled().await;

    w.change_template().await;
    let status = w
        .status_until("waiting for a deletion", Duration::from_secs(20), |s| {
            condition(s, "Progressing").1 == "WaitingForDeletion"
        })
        .await;
    assert_eq!(status["updatedReplicas"], 0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        w.machines().await.len(),
        3,
        "nothing replaced before a deletion"
    );

    w.raw
        .delete("cp-1", &DeleteParams::default())
        .await
        .unwrap();
    let ms = eventually("cp-1 replaced", Duration::from_secs(60), async || {
        let ms = w.machines().await;
        let names: Vec<String> = ms.iter().map(|m| m.name_any()).collect();
        (ms.len() == 3 && !names.contains(&"cp-1".to_owned())).then_some(ms)
    })
    .await;
    for m in &ms {
        let want = if m.name_any().starts_with("cp-") {
            "test"
        } else {
            "big"
        };
        assert_eq!(instance_type(m), want, "{}", m.name_any());
    }
    w.status_until("one machine updated", Duration::from_secs(30), |s| {
        s["updatedReplicas"] == 1 && s["readyReplicas"] == 3
    })
    .await;
    let list = w.members().await.unwrap();
    assert_eq!(list.iter().filter(|m| !m.3).count(), 3, "{list:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recreate_rolls_three_machines_deleting_first_under_writes() {
    let w = World::start_ordered(Replacement::ShrinkFirst).await;
    w.create_set("cluster", None).await;
    w.patch_set(json!({"strategy": {"type": "Recreate"}})).await;
    w.settled().await;

    let (load, peak) = w.roll_under_load().await;
    eventually("the rollout", Duration::from_secs(180), async || {
        let ms = w.machines().await;
        let done = ms.len() == 3
            && ms.iter().all(|m| {
                instance_type(m) == "big"
                    && m.metadata.deletion_timestamp.is_none()
                    && !m.name_any().starts_with("cp-")
            });
        if !done {
            return None;
        }
        let list = w.members().await?;
        (list.len() == 3 && list.iter().all(|m| !m.3)).then_some(())
    })
    .await;
    // Recreate shrinks first: one voter fewer at a time, never more Machines than replicas.
    let bounds = Bounds {
        min_voters: 2,
        max_voters: Some(3),
        max_learners: None,
    };
    load.finish_within(bounds, &w.client_urls()).await;
    let peak = peak.await.unwrap();
    assert!(peak <= 3, "{peak} machines at once (Recreate never surges)");
}

/// Seed 004: a control-plane Node no Machine backs stops every change. The set says
/// `Degraded/NoMachineForNode` naming it and rolls nothing; once the Node is gone the roll goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_node_without_a_machine_stops_every_change() {
    use k8s_openapi::api::core::v1::Node;
    let w = World::start(&[]).await;
    w.create_set("cluster", None).await;
    w.settled().await;
    let nodes: Api<Node> = Api::all(w.kc.clone());
    // The Machines' own nodes (their nodeRefs) and one more; a worker Node does not count.
    for (name, role) in [
        ("cp-0", "master"),
        ("cp-1", "master"),
        ("cp-2", "master"),
        // The deprecated label and its successor both make a control-plane Node.
        ("stray", "control-plane"),
        ("worker-0", "worker"),
    ] {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {format!("node-role.kubernetes.io/{role}"): ""}}
        }))
        .unwrap();
        nodes.create(&PostParams::default(), &node).await.unwrap();
    }
    w.change_template().await;
    let status = w
        .status_until("NoMachineForNode", Duration::from_secs(30), |s| {
            let (st, reason, _) = condition(s, "Degraded");
            st == "True" && reason == "NoMachineForNode"
        })
        .await;
    let (_, _, message) = condition(&status, "Degraded");
    assert!(
        message.contains("stray") && !message.contains("worker-0") && !message.contains("cp-0"),
        "{message}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let names: Vec<String> = w.machines().await.iter().map(|m| m.name_any()).collect();
    assert_eq!(names, ["cp-0", "cp-1", "cp-2"], "nothing rolled meanwhile");

    nodes
        .delete("stray", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the roll to start", Duration::from_secs(30), async || {
        let ms = w.machines().await;
        ms.iter()
            .any(|m| m.name_any().starts_with("cluster-control-plane-"))
            .then_some(())
    })
    .await;
}

/// No way of deleting the set deletes a Machine: with OpenShift's
/// `OwnerReferencesPermissionEnforcement` judging the operator's writes by the shipped
/// rbac.yaml and a garbage collector that always wins the race (it runs inside the write that
/// deletes the set), the set is deleted with each propagation policy in turn (and created again
/// in between). The first set also meets a Machine carrying the owner reference an earlier
/// version wrote (`controller`, `blockOwnerDeletion`), which it takes off on adoption.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_propagation_policy_deletes_a_machine_under_openshift_admission_and_the_gc() {
    let w = World::build(&[]).await;
    let rbac = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/operator/rbac.yaml");
    w.server.enforce_owner_references(
        support::rbac::Policy::load(&[&rbac]),
        &[(support::rbac::OPERATOR, (ETCD_NS, "etcd-warden-operator"))],
    );
    w.server.collect_garbage();
    let before: Vec<String> = w.machines().await.iter().map(|m| m.name_any()).collect();
    w.create_set("cluster", None).await;
    let uid = w.sets.get("cluster").await.unwrap().uid().unwrap();
    let legacy = json!({"metadata": {"ownerReferences": [{
        "apiVersion": "etcd-warden.io/v1alpha1", "kind": "ControlPlaneSet",
        "name": "cluster", "uid": uid, "controller": true, "blockOwnerDeletion": true,
    }]}});
    machine_api::merge(&w.raw, "cp-0", &legacy).await;
    w.run_operator();
    for policy in [
        kube::api::PropagationPolicy::Foreground,
        kube::api::PropagationPolicy::Background,
        kube::api::PropagationPolicy::Orphan,
    ] {
        if w.sets.get_opt("cluster").await.unwrap().is_none() {
            w.create_set("cluster", None).await;
        }
        w.settled().await;
        w.delete_set(Some(policy.clone())).await;
        // The collector has seen the set go; anything it was to delete is deleted by now.
        tokio::time::sleep(Duration::from_millis(500)).await;
        w.all_left_in_place(&before, &format!("{policy:?}: ")).await;
        assert!(
            w.server.collected().is_empty(),
            "{policy:?}: the garbage collector deleted {:?}",
            w.server.collected()
        );
    }
    support::rbac::assert_operator_allowed(&w.server);
}

/// A real kube-controller-manager takes its `foregroundDeletion` (or `orphan`) finalizer off a
/// deleting set between the operator's read and its patch: every such delete used to fail a
/// reconcile (logged as a warning saying "still conflicting after 5 attempts" after one). Now
/// a 409 on the set's finalizer is answered by reading the set again. Here every first write to
/// each set and Machine is refused with a 409; the set still goes, its Machines stay, every
/// Machine's adoption and orphaning is an Event related to it, and no reconcile fails. (The double's collector removes its finalizer at once rather than racing; the
/// injected conflicts stand in for the race.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_set_while_it_changes_fails_no_reconcile() {
    let w = World::build(&[]).await;
    w.server.collect_garbage();
    let base = w.run_operator_serving();
    let before: Vec<String> = w.machines().await.iter().map(|m| m.name_any()).collect();
    w.create_set("cluster", None).await;
    w.settled().await;
    // Not on the Lease: a 409 on its renewal ends the lead for a moment, which cancels the
    // reconcile in flight (an event may be lost with it, the change never is).
    w.server
        .inject_conflicts_on(true, &["controlplanesets", "machines"]);
    w.delete_set(Some(kube::api::PropagationPolicy::Foreground))
        .await;
    let names: Vec<String> = w.machines().await.iter().map(|m| m.name_any()).collect();
    assert_eq!(names, before, "every machine left in place");
    // Each Machine's adoption and orphaning is an Event of its own, related to that Machine
    // (one series per reason kept only the first Machine's name).
    let events = w.machine_events().await;
    for reason in ["MachineAdopted", "MachineOrphaned"] {
        let mut related: Vec<String> = events
            .iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .filter_map(|e| e.related.as_ref()?.name.clone())
            .collect();
        related.sort();
        let all: Vec<_> = events
            .iter()
            .map(|e| {
                (
                    &e.reason,
                    e.related.as_ref().map(|r| &r.name),
                    &e.note,
                    &e.series,
                )
            })
            .collect();
        assert_eq!(related, before, "{reason} events: {all:#?}");
    }
    let metrics = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let failures = metrics
        .lines()
        .find(|l| l.starts_with("etcd_warden_control_plane_set_reconcile_failures_total "))
        .unwrap_or_else(|| panic!("no reconcile failure counter in\n{metrics}"));
    assert_eq!(
        failures, "etcd_warden_control_plane_set_reconcile_failures_total 0",
        "a reconcile failed"
    );
}

/// Without the CRD (issue 29: two 404 LISTs a second for as long as it ran), the set's loop
/// looks for its type with a backoff doubling from the resync period, says so once on
/// `/healthz`, and starts when the type appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_crd_the_set_waits_quietly_and_starts_when_it_appears() {
    use etcd_warden::operator::kube::set_controller::WAITING_FOR_TYPE;
    let w = World::build(&[]).await;
    w.server.uninstall("etcd-warden.io", "controlplanesets");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health = format!("http://{}/healthz", listener.local_addr().unwrap());
    tokio::spawn(controller::run_serving(
        w.server.client_as(support::rbac::OPERATOR),
        w.settings(),
        Some(listener),
        w.stop.child_token(),
    ));
    tokio::time::sleep(Duration::from_secs(8)).await;
    let asked: Vec<String> = w
        .server
        .requests_of(support::rbac::OPERATOR)
        .into_iter()
        .filter(|r| r.contains("/controlplanesets"))
        .collect();
    // Looks at 0, 0.2, 0.6, 1.4, 3.0 and 6.2 s (the resync period, 200 ms, doubling): six in
    // 8 s, where one a resync period would be forty.
    assert!(
        (1..=6).contains(&asked.len()),
        "{} requests: {asked:#?}",
        asked.len()
    );
    let body = reqwest::get(&health).await.unwrap().text().await.unwrap();
    assert!(
        body.contains(&format!("control-plane-set: {WAITING_FOR_TYPE}")),
        "{body}"
    );
    w.server.install("etcd-warden.io", "controlplanesets");
    w.create_set("cluster", None).await;
    w.settled().await;
    let body = reqwest::get(&health).await.unwrap().text().await.unwrap();
    assert!(
        body.starts_with("ok: ") && !body.contains(WAITING_FOR_TYPE),
        "{body}"
    );
}

/// An Inactive set observes and reports (counts, conditions, what it would do) but never
/// creates, deletes or patches a Machine, adoption included; set Active, it acts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inactive_set_reports_but_never_touches_a_machine_until_activated() {
    let w = World::build(&[]).await;
    w.create_set("cluster", None).await;
    w.patch_set(json!({
        "state": "Inactive",
        "template": {"spec": {"providerSpec": {"value": {"instanceType": "big"}}}},
    }))
    .await;
    w.run_operator();
    let status = w
        .status_until("the inactive set reported", Duration::from_secs(30), |s| {
            condition(s, "Progressing").1 == "Inactive" && s["replicas"] == 3
        })
        .await;
    let message = condition(&status, "Progressing").2;
    assert!(message.contains("would"), "{message}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ms = w.machines().await;
    let names: Vec<String> = ms.iter().map(|m| m.name_any()).collect();
    assert_eq!(
        names,
        ["cp-0", "cp-1", "cp-2"],
        "nothing created or deleted"
    );
    assert!(
        ms.iter().all(|m| !m.labels().contains_key(SET_LABEL)),
        "nothing adopted"
    );
    // (The quorum operator patches its deletion hooks onto the Machines; the set's only patch
    // is the adoption, which the label would show.)
    let machine_writes: Vec<String> = w
        .server
        .requests_of(support::rbac::OPERATOR)
        .into_iter()
        .filter(|r| r.contains("/machines") && (r.starts_with("POST ") || r.starts_with("DELETE ")))
        .collect();
    assert!(machine_writes.is_empty(), "{machine_writes:#?}");
    assert!(w.set_events().await.is_empty());
    // Activated: it adopts and rolls.
    w.patch_set(json!({"state": "Active"})).await;
    eventually("the roll to start", Duration::from_secs(30), async || {
        w.machines()
            .await
            .iter()
            .any(|m| m.name_any().starts_with("cluster-control-plane-"))
            .then_some(())
    })
    .await;
}

/// A status the controller cannot read (a field of the wrong shape, written by hand or by
/// another version of the operator) is a Degraded condition naming the field, and the set is not
/// accepted again: read as empty, `accepted` would be dropped and the next reconcile would accept
/// whatever the spec says now. (The double stores any status; a real API server validates it
/// against the CRD's schema, which makes such a status rarer, not impossible: an older CRD.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_status_is_degraded_and_never_accepted_again() {
    let w = World::start(&[]).await;
    w.create_set("cluster", None).await;
    w.settled().await;
    let raw: Api<DynamicObject> = Api::namespaced_with(
        w.kc.clone(),
        MACHINES_NS,
        &kube::core::ApiResource::erase::<ControlPlaneSet>(&()),
    );
    let broken = json!({"status": {"accepted": {"replicas": "three"}}});
    raw.patch_status("cluster", &PatchParams::default(), &Patch::Merge(&broken))
        .await
        .unwrap();
    let status = eventually(
        "the unreadable status reported",
        Duration::from_secs(20),
        async || {
            let set = raw.get("cluster").await.ok()?;
            let status = set.data.get("status")?.clone();
            (condition(&status, "Degraded").0 == "True").then_some(status)
        },
    )
    .await;
    let (_, reason, message) = condition(&status, "Degraded");
    assert_eq!(reason, "StatusUnreadable");
    assert!(
        message.starts_with("status.accepted.replicas:"),
        "{message}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let set = raw.get("cluster").await.unwrap();
    assert_eq!(
        set.data["status"]["accepted"]["replicas"], "three",
        "the accepted fields were replaced: {}",
        set.data["status"]
    );
}

/// `etcd-warden-operator generate-controlplaneset`, pointed at the double by a kubeconfig,
/// prints an Inactive set drawn from the Machines: their provider spec without the zone, their
/// zones as failure domains; the controller accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_controlplaneset_prints_an_inactive_set_from_the_machines() {
    let server = ApiServer::start().await;
    let raw = machine_api::machines(server.client(), MACHINES_NS);
    for (i, zone) in ["us-east-1b", "us-east-1a", "us-east-1c"]
        .iter()
        .enumerate()
    {
        let name = format!("cp-{i}");
        create_machine(&raw, &name, "master", None).await;
        let p = json!({"spec": {"providerSpec": {"value": {
            "kind": "AWSMachineProviderConfig", "instanceType": "m6i.xlarge",
            "placement": {"region": "us-east-1", "availabilityZone": zone},
        }}}});
        raw.patch(&name, &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, MACHINES_NS);
    let bin = env!("CARGO_BIN_EXE_etcd-warden-operator");
    let out = tokio::process::Command::new(bin)
        .arg("generate-controlplaneset")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--selector")
        .arg(format!("{ROLE_LABEL}=master"))
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let set: Value = serde_yaml::from_slice(&out.stdout).unwrap();
    assert_eq!(set["kind"], "ControlPlaneSet");
    assert_eq!(set["metadata"]["name"], "cluster");
    assert_eq!(set["metadata"]["namespace"], MACHINES_NS);
    assert_eq!(set["spec"]["state"], "Inactive");
    assert_eq!(set["spec"]["replicas"], 3);
    assert_eq!(
        set["spec"]["failureDomains"],
        json!({"platform": "AWS", "domains": ["us-east-1a", "us-east-1b", "us-east-1c"]})
    );
    let value = &set["spec"]["template"]["spec"]["providerSpec"]["value"];
    assert_eq!(value["placement"], json!({"region": "us-east-1"}));
    assert_eq!(value["instanceType"], "m6i.xlarge");
    assert_eq!(
        set["spec"]["template"]["metadata"]["labels"][ROLE_LABEL],
        "master"
    );
    let v = etcd_warden::operator::control_plane_set::resource::validate(&set, None)
        .expect("the controller accepts the generated set");
    assert!(!v.active);
    // Fewer than three Machines: refused, naming why.
    raw.delete("cp-2", &DeleteParams::default()).await.unwrap();
    let p = json!({"metadata": {"finalizers": null}});
    let _ = raw
        .patch("cp-2", &PatchParams::default(), &Patch::Merge(&p))
        .await;
    let out = tokio::process::Command::new(bin)
        .args(["generate-controlplaneset", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("2 control-plane Machines"), "{stderr}");
}
