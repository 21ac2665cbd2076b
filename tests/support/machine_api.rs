//! Plays OpenShift's Machine API against the API server double (`support::apiserver`), for
//! tests of the operator on Kubernetes:
//! - [`create_machine`] creates a Machine as the installer or a MachineSet does (role label, the
//!   machine controller's finalizer) and, when given an IP, reports it `Running` at that address;
//! - [`MachineApi`] watches the Machines and, once a deleting Machine's `preDrain` hooks are all
//!   gone, "drains and terminates" it: calls the test's `terminate` (which kills that member's
//!   etcd, say), then removes the finalizer so the Machine goes.
//!
//! What it does not play: providers, nodes, drains of real pods, `preTerminate` hooks, phases
//! other than `Running`, the Machine API's admission webhooks.
#![allow(dead_code)]

use std::sync::Arc;

use futures::TryStreamExt as _;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The machine controller's finalizer.
pub const FINALIZER: &str = "machine.machine.openshift.io";
/// The role label the control-plane selector matches.
pub const ROLE_LABEL: &str = "machine.openshift.io/cluster-api-machine-role";

/// Machines as untyped objects: the test sees every field, not only those the operator reads.
pub fn machines(client: kube::Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("machine.openshift.io", "v1beta1", "Machine");
    Api::namespaced_with(client, namespace, &ApiResource::from_gvk(&gvk))
}

/// Creates a Machine with `role`; with `ip`, reports it `Running` at that InternalIP.
pub async fn create_machine(api: &Api<DynamicObject>, name: &str, role: &str, ip: Option<&str>) {
    let m: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "machine.openshift.io/v1beta1",
        "kind": "Machine",
        "metadata": {
            "name": name,
            "labels": {ROLE_LABEL: role},
            "finalizers": [FINALIZER],
        },
        "spec": {"providerSpec": {"value": {"instanceType": "test"}}},
    }))
    .expect("a Machine");
    api.create(&PostParams::default(), &m)
        .await
        .expect("create the Machine");
    if let Some(ip) = ip {
        let p = json!({"status": {"phase": "Running", "addresses": [
            {"type": "Hostname", "address": name},
            {"type": "InternalIP", "address": ip},
        ]}});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&p))
            .await
            .expect("report the Machine running");
    }
}

/// Merge-patches the Machine `name` with `patch`.
pub async fn merge(api: &Api<DynamicObject>, name: &str, patch: &serde_json::Value) {
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("patch the Machine");
}

/// Merge-patches the status of the Machine `name` with `patch`.
pub async fn merge_status(api: &Api<DynamicObject>, name: &str, patch: &serde_json::Value) {
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("patch the Machine's status");
}

/// The Machine's `preDrain` hooks as (name, owner).
pub fn pre_drain(m: &DynamicObject) -> Vec<(String, String)> {
    m.data
        .pointer("/spec/lifecycleHooks/preDrain")
        .and_then(Value::as_array)
        .map(|hooks| {
            hooks
                .iter()
                .map(|h| {
                    let s = |k: &str| h.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                    (s("name"), s("owner"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The Machine API's deletion loop, running until dropped.
pub struct MachineApi {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Drop for MachineApi {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl MachineApi {
    /// Watches the Machines of `api`; calls `terminate(name)` once per Machine that is deleting
    /// with no `preDrain` hook left, then lets it go.
    pub fn start(
        api: Api<DynamicObject>,
        terminate: impl Fn(&str) + Send + Sync + 'static,
    ) -> MachineApi {
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let terminate = Arc::new(terminate);
        let task = tokio::spawn(async move {
            let mut terminated = std::collections::HashSet::new();
            let mut events = Box::pin(watcher(api.clone(), watcher::Config::default()));
            loop {
                let ev = tokio::select! {
                    _ = stop.cancelled() => return,
                    ev = events.try_next() => ev,
                };
                let m = match ev {
                    Ok(Some(watcher::Event::Apply(m) | watcher::Event::InitApply(m))) => m,
                    Ok(Some(_)) => continue,
                    Ok(None) => return,
                    // The watcher retries on its own after an error.
                    Err(_) => continue,
                };
                let deleting = m.metadata.deletion_timestamp.is_some();
                let holds = m
                    .metadata
                    .finalizers
                    .as_ref()
                    .is_some_and(|f| f.iter().any(|f| f == FINALIZER));
                if !deleting || !holds || !pre_drain(&m).is_empty() {
                    continue;
                }
                let name = m.metadata.name.clone().unwrap_or_default();
                if terminated.insert(name.clone()) {
                    terminate(&name);
                }
                let rest: Vec<String> = m
                    .metadata
                    .finalizers
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|f| f != FINALIZER)
                    .collect();
                let p = json!({"metadata": {
                    "finalizers": rest,
                    "resourceVersion": m.metadata.resource_version,
                }});
                // A conflict means the Machine changed: the next event brings it back here.
                let _ = api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&p))
                    .await;
            }
        });
        MachineApi {
            cancel,
            task: Some(task),
        }
    }
}
