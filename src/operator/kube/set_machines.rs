//! [`KubeSetMachines`], the ControlPlaneSet's [`SetMachines`] backend over
//! `machine.openshift.io` Machines: the set's Machines listed, adopted, created and deleted
//! (the loop that drives it is [`super::set_controller`]).
//!
//! A Machine belongs to the set by the label [`SET_LABEL`] (the set's uid), never by an owner
//! reference: an owner reference makes the Machine a dependent the garbage collector deletes
//! when the set is deleted in the foreground (or after it, in the background, should the
//! finalizer ever be taken off first), and no finalizer or orphaning patch can win that race
//! (docs/operator.md, "Deleting the set"). Owner references to the set written by earlier
//! versions are taken off when the Machine is adopted again.
//!
//! Machines are read untyped (`DynamicObject`): the set compares and copies the provider spec,
//! which the typed `Machine` drops. Every write is a merge patch naming only what it changes,
//! carrying the resourceVersion read when it replaces a list (owner references).

use std::collections::BTreeMap;
use std::time::Duration;

use ::kube::ResourceExt as _;
use ::kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use ::kube::core::{ApiResource, GroupVersionKind};
use async_trait::async_trait;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde_json::{Value, json};
use tracing::debug;

use super::machines::{backend_error, is_status, post_params, send_merge_patch};
use crate::operator::control_plane_set::controller::{SetMachine, SetMachines};
use crate::operator::control_plane_set::resource::{self, Valid};
use crate::operator::quorum::execute::BackendError;

/// Attempts at a list-replacing patch that meets concurrent changes (409).
pub(super) const ATTEMPTS: u32 = 5;

pub fn machine_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "machine.openshift.io",
        "v1beta1",
        "Machine",
    ))
}

/// The label that makes a Machine the set's: the set's uid.
pub const SET_LABEL: &str = "etcd-warden.io/control-plane-set";

/// Whether `m` carries the set's label for the set with `uid`.
pub(super) fn labelled(m: &DynamicObject, uid: &str) -> bool {
    m.labels().get(SET_LABEL).is_some_and(|v| v == uid)
}

/// Whether `m` carries an owner reference to the set with `uid` (written by earlier versions).
pub(super) fn referenced(m: &DynamicObject, uid: &str) -> bool {
    m.owner_references().iter().any(|o| o.uid == uid)
}

/// Whether `m` is the set's as this version keeps it: labelled, no owner reference to it.
fn owned_by(m: &DynamicObject, uid: &str) -> bool {
    labelled(m, uid) && !referenced(m, uid)
}

/// `m`'s owner references without those to the set with `uid`.
pub(super) fn other_owners(m: &DynamicObject, uid: &str) -> Vec<OwnerReference> {
    m.owner_references()
        .iter()
        .filter(|o| o.uid != uid)
        .cloned()
        .collect()
}

/// The set a Machine belongs to: name and uid.
#[derive(Debug, Clone)]
struct SetRef {
    name: String,
    uid: String,
}

/// The Machines of one ControlPlaneSet.
pub struct KubeSetMachines {
    api: Api<DynamicObject>,
    nodes: Api<k8s_openapi::api::core::v1::Node>,
    selector: String,
    owner: SetRef,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    peer_scheme: String,
    peer_port: u16,
}

impl KubeSetMachines {
    /// The Machines `valid`'s selector picks in `namespace`, owned by `set`; their members'
    /// peer URLs are `peer_scheme://<InternalIP>:peer_port`.
    pub fn new(
        client: ::kube::Client,
        namespace: &str,
        (peer_scheme, peer_port): (&str, u16),
        set: &DynamicObject,
        valid: &Valid,
    ) -> KubeSetMachines {
        KubeSetMachines {
            nodes: Api::all(client.clone()),
            api: Api::namespaced_with(client, namespace, &machine_resource()),
            selector: valid.selector.clone(),
            owner: SetRef {
                name: set.name_any(),
                uid: set.uid().unwrap_or_default(),
            },
            labels: valid.metadata.labels.clone(),
            annotations: valid.metadata.annotations.clone(),
            peer_scheme: peer_scheme.to_owned(),
            peer_port,
        }
    }

    fn peer_url(&self, m: &DynamicObject) -> String {
        let ip = m
            .data
            .pointer("/status/addresses")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|a| a.get("type").and_then(Value::as_str) == Some("InternalIP"))
            .and_then(|a| a.get("address").and_then(Value::as_str));
        match ip {
            None => String::new(),
            Some(ip) if ip.contains(':') => {
                format!("{}://[{ip}]:{}", self.peer_scheme, self.peer_port)
            }
            Some(ip) => format!("{}://{ip}:{}", self.peer_scheme, self.peer_port),
        }
    }

    fn view(&self, m: &DynamicObject) -> SetMachine {
        let phase = m.data.pointer("/status/phase").and_then(Value::as_str);
        let provider = m
            .data
            .pointer("/spec/providerSpec/value")
            .cloned()
            .unwrap_or(Value::Null);
        SetMachine {
            name: m.name_any(),
            spec: resource::template_spec(&provider),
            peer_url: self.peer_url(m),
            ready: phase == Some("Running")
                && m.data
                    .pointer("/status/nodeRef")
                    .is_some_and(Value::is_object),
            failed: phase == Some("Failed"),
            deleting: m.metadata.deletion_timestamp.is_some(),
            owned: owned_by(m, &self.owner.uid),
            node: m
                .data
                .pointer("/status/nodeRef/name")
                .and_then(Value::as_str)
                .map(str::to_owned),
        }
    }
}

/// The labels a control-plane Node carries: `control-plane`, and the deprecated `master` that
/// older clusters (and OpenShift, beside the other) still set; a Node with either counts.
pub const CONTROL_PLANE_NODES: [&str; 2] = [
    "node-role.kubernetes.io/control-plane",
    "node-role.kubernetes.io/master",
];

#[async_trait]
impl SetMachines for KubeSetMachines {
    async fn control_plane_nodes(&self) -> Result<Vec<String>, BackendError> {
        // A label selector cannot say "either": one list per label, merged.
        let mut names = std::collections::BTreeSet::new();
        for label in CONTROL_PLANE_NODES {
            let list = self
                .nodes
                .list(&ListParams::default().labels(label))
                .await
                .map_err(|e| backend_error("listing the control-plane nodes", e))?;
            names.extend(list.items.iter().map(|n| n.name_any()));
        }
        Ok(names.into_iter().collect())
    }

    async fn list_set(&self) -> Result<Vec<SetMachine>, BackendError> {
        let list = self
            .api
            .list(&ListParams::default().labels(&self.selector))
            .await
            .map_err(|e| backend_error("listing the set's machines", e))?;
        Ok(list.items.iter().map(|m| self.view(m)).collect())
    }

    async fn adopt(&self, machine: &str) -> Result<(), BackendError> {
        for attempt in 1..=ATTEMPTS {
            let m = match self.api.get(machine).await {
                Ok(m) => m,
                Err(e) if is_status(&e, 404) => {
                    return Err(BackendError::NotFound(machine.to_owned()));
                }
                Err(e) => return Err(backend_error(format!("reading machine {machine}"), e)),
            };
            if owned_by(&m, &self.owner.uid) {
                return Ok(());
            }
            if let Some(other) = m
                .owner_references()
                .iter()
                .find(|o| o.controller == Some(true) && o.uid != self.owner.uid)
            {
                return Err(BackendError::Rejected {
                    what: format!("adopting machine {machine}"),
                    source: format!(
                        "it is controlled by {} {}; remove that owner reference to let the set adopt it",
                        other.kind, other.name
                    )
                    .into(),
                });
            }
            // The label, and an owner reference an earlier version wrote taken off, on the
            // version read (the owner references are a list, replaced whole).
            let mut meta = json!({
                "labels": {SET_LABEL: self.owner.uid},
                "resourceVersion": m.metadata.resource_version,
            });
            if referenced(&m, &self.owner.uid) {
                meta["ownerReferences"] = json!(other_owners(&m, &self.owner.uid));
            }
            let patch = json!({"metadata": meta});
            match send_merge_patch(&self.api, machine, &patch).await {
                Ok(_) => return Ok(()),
                Err(e) if is_status(&e, 409) => {
                    debug!(
                        machine,
                        attempt, "machine changed meanwhile; reading it again"
                    );
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
                }
                Err(e) => return Err(backend_error(format!("adopting machine {machine}"), e)),
            }
        }
        Err(BackendError::Conflict {
            machine: machine.to_owned(),
            attempts: ATTEMPTS,
        })
    }

    async fn create(&self, spec: &Value) -> Result<String, BackendError> {
        let mut labels = self.labels.clone();
        labels.insert(SET_LABEL.into(), self.owner.uid.clone());
        let m: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "machine.openshift.io/v1beta1",
            "kind": "Machine",
            "metadata": {
                "generateName": format!("{}-control-plane-", self.owner.name),
                "labels": labels,
                "annotations": self.annotations,
            },
            "spec": spec,
        }))
        .map_err(|e| BackendError::Rejected {
            what: "building a machine from the template".into(),
            source: Box::new(e),
        })?;
        let pp = post_params();
        let created = self
            .api
            .create(&pp, &m)
            .await
            .map_err(|e| backend_error("creating a machine", e))?;
        Ok(created.name_any())
    }

    async fn delete(&self, machine: &str) -> Result<(), BackendError> {
        match self.api.delete(machine, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(backend_error(format!("deleting machine {machine}"), e)),
        }
    }
}
