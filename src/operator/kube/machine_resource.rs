//! `machine.openshift.io/v1beta1` `Machine`, reduced to the fields the operator reads: the
//! pre-drain lifecycle hooks, the phase, the addresses, the labels and the deletion timestamp.
//!
//! The type is for reading only. A Machine carries much more (providerSpec, taints, node
//! reference...) that these structs drop, so a Machine is never written back whole: every
//! change is a merge patch naming only the fields it changes.

use ::kube::CustomResource;
use serde::{Deserialize, Serialize};

/// The hook's name (seed 000).
pub const HOOK_NAME: &str = "EtcdQuorumOperator";
/// The hook's owner (seed 000).
pub const HOOK_OWNER: &str = "clusteroperator/etcd";

/// The label selector of control-plane Machines in OpenShift.
pub const CONTROL_PLANE_SELECTOR: &str = "machine.openshift.io/cluster-api-machine-role=master";

/// The part of a Machine's spec the operator reads.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "machine.openshift.io",
    version = "v1beta1",
    kind = "Machine",
    namespaced,
    status = "MachineStatus",
    schema = "disabled"
)]
pub struct MachineSpec {
    /// Hooks that pause the Machine's deletion.
    #[serde(default, rename = "lifecycleHooks")]
    pub lifecycle_hooks: LifecycleHooks,
}

/// A Machine's lifecycle hooks.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct LifecycleHooks {
    /// Hooks that hold a deleting Machine before its node is drained.
    #[serde(default, rename = "preDrain")]
    pub pre_drain: Vec<LifecycleHook>,
}

/// One lifecycle hook: a name and the owner that will remove it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LifecycleHook {
    /// The hook's name, unique per list.
    pub name: String,
    /// Who put it there and will take it off.
    pub owner: String,
}

impl LifecycleHook {
    /// Our pre-drain hook: `{name: EtcdQuorumOperator, owner: clusteroperator/etcd}`.
    pub fn ours() -> LifecycleHook {
        LifecycleHook {
            name: HOOK_NAME.into(),
            owner: HOOK_OWNER.into(),
        }
    }

    /// Whether this is our hook (name and owner both).
    pub fn is_ours(&self) -> bool {
        self.name == HOOK_NAME && self.owner == HOOK_OWNER
    }
}

/// The part of a Machine's status the operator reads.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct MachineStatus {
    /// `Provisioning`, `Provisioned`, `Running`, `Deleting`, `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The host's addresses as the cloud reports them.
    #[serde(default)]
    pub addresses: Vec<MachineAddress>,
}

/// One address of a Machine's host.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MachineAddress {
    /// `InternalIP`, `ExternalIP`, `InternalDNS`, `ExternalDNS`, `Hostname`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The address.
    pub address: String,
}

impl Machine {
    /// Whether our hook is on the Machine.
    pub fn has_our_hook(&self) -> bool {
        self.spec
            .lifecycle_hooks
            .pre_drain
            .iter()
            .any(LifecycleHook::is_ours)
    }

    /// Marked for deletion.
    pub fn deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    /// The first `InternalIP`, where etcd's peers reach the host.
    pub fn internal_ip(&self) -> Option<&str> {
        self.status
            .as_ref()?
            .addresses
            .iter()
            .find(|a| a.kind == "InternalIP")
            .map(|a| a.address.as_str())
    }

    /// The phase, when the Machine API has reported one.
    pub fn phase(&self) -> Option<&str> {
        self.status.as_ref()?.phase.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_machine_as_the_machine_api_writes_it() {
        let m: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "machine.openshift.io/v1beta1",
            "kind": "Machine",
            "metadata": {
                "name": "cp-0", "namespace": "openshift-machine-api",
                "labels": {"machine.openshift.io/cluster-api-machine-role": "master"},
                "deletionTimestamp": "2026-11-23T10:00:00Z",
                "finalizers": ["machine.machine.openshift.io"]
            },
            "spec": {
                "providerSpec": {"value": {"instanceType": "m6i.xlarge"}},
                "lifecycleHooks": {"preDrain": [
                    {"name": "EtcdQuorumOperator", "owner": "clusteroperator/etcd"},
                    {"name": "Other", "owner": "someone"}
                ], "preTerminate": [{"name": "x", "owner": "y"}]}
            },
            "status": {"phase": "Deleting", "addresses": [
                {"type": "Hostname", "address": "cp-0"},
                {"type": "InternalIP", "address": "10.0.0.7"}
            ]}
        }))
        .unwrap();
        assert!(m.has_our_hook());
        assert!(m.deleting());
        assert_eq!(m.internal_ip(), Some("10.0.0.7"));
        assert_eq!(m.phase(), Some("Deleting"));
    }

    #[test]
    fn a_machine_without_hooks_or_status_reads() {
        let m: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "machine.openshift.io/v1beta1", "kind": "Machine",
            "metadata": {"name": "cp-1"}, "spec": {}
        }))
        .unwrap();
        assert!(!m.has_our_hook());
        assert!(!m.deleting());
        assert_eq!(m.internal_ip(), None);
    }

    #[test]
    fn a_hook_with_our_name_but_another_owner_is_not_ours() {
        let h = LifecycleHook {
            name: HOOK_NAME.into(),
            owner: "someone-else".into(),
        };
        assert!(!h.is_ours());
        assert!(LifecycleHook::ours().is_ours());
    }
}
