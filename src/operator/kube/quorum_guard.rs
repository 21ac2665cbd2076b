//! The quorum-guard `PodDisruptionBudget` (seed 000): `minAvailable` = current control-plane
//! machines − 1, so a voluntary disruption (a drain by the machine config operator, say) can take
//! down one etcd guard pod at most, and none while a replacement is not yet healthy: during a
//! replacement there is one more machine, and the budget grows with it.
//!
//! The count is every Machine the selector picks, deleting ones included (a deleting Machine
//! keeps its member until its hook is released) and those not yet running (the new Machine of a
//! replacement counts from the moment it exists, as seed 000's flow has it: "the etcd operator
//! notices the new Machine and adjusts the etcd quorum guard").

use std::collections::BTreeMap;

use ::kube::api::Api;
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// Where the budget lives and which pods it guards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumGuard {
    /// The budget's name.
    pub name: String,
    /// Its namespace (the etcd pods' namespace).
    pub namespace: String,
    /// Labels of the etcd guard pods.
    pub pod_labels: BTreeMap<String, String>,
}

impl Default for QuorumGuard {
    fn default() -> Self {
        QuorumGuard {
            name: "etcd-guard-pdb".into(),
            namespace: "openshift-etcd".into(),
            pod_labels: [("app".to_string(), "guard".to_string())].into(),
        }
    }
}

/// Seed 000's `minAvailable` for `machines` control-plane machines (0 for none).
pub fn min_available(machines: usize) -> i32 {
    i32::try_from(machines.saturating_sub(1)).unwrap_or(i32::MAX)
}

impl QuorumGuard {
    /// The budget for `machines` control-plane machines.
    pub fn budget(&self, machines: usize) -> PodDisruptionBudget {
        PodDisruptionBudget {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(PodDisruptionBudgetSpec {
                min_available: Some(IntOrString::Int(min_available(machines))),
                selector: Some(LabelSelector {
                    match_labels: Some(self.pod_labels.clone()),
                    ..LabelSelector::default()
                }),
                ..PodDisruptionBudgetSpec::default()
            }),
            status: None,
        }
    }

    /// Whether `current` already says what [`budget`](Self::budget) for `machines` says.
    pub fn is_current(&self, current: &PodDisruptionBudget, machines: usize) -> bool {
        let want = self.budget(machines);
        let spec = |p: &PodDisruptionBudget| {
            p.spec.as_ref().map(|s| {
                (
                    s.min_available.clone(),
                    s.max_unavailable.clone(),
                    s.selector.clone(),
                )
            })
        };
        spec(current) == spec(&want)
    }
}

impl QuorumGuard {
    /// Makes the budget in `api`'s namespace the one for `machines`; returns whether it wrote.
    pub async fn sync(
        &self,
        api: &Api<PodDisruptionBudget>,
        machines: usize,
    ) -> Result<bool, super::sync::SyncError> {
        super::sync::upsert(
            api,
            &self.name,
            || self.budget(machines),
            |current| {
                if self.is_current(current, machines) {
                    return None;
                }
                Some(serde_json::json!({
                    "metadata": {"resourceVersion": current.metadata.resource_version},
                    "spec": {
                        "minAvailable": min_available(machines),
                        "maxUnavailable": null,
                        "selector": {"matchLabels": self.pod_labels, "matchExpressions": null},
                    },
                }))
            },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_available_is_machines_minus_one() {
        assert_eq!(min_available(0), 0);
        assert_eq!(min_available(1), 0);
        assert_eq!(min_available(3), 2);
        // A replacement under way: the new machine counts, one disruption still allowed.
        assert_eq!(min_available(4), 3);
        assert_eq!(min_available(5), 4);
    }

    #[test]
    fn the_budget_selects_the_guard_pods_and_follows_the_machine_count() {
        let g = QuorumGuard::default();
        let pdb = g.budget(4);
        assert_eq!(pdb.metadata.name.as_deref(), Some("etcd-guard-pdb"));
        assert_eq!(pdb.metadata.namespace.as_deref(), Some("openshift-etcd"));
        let spec = pdb.spec.clone().unwrap();
        assert_eq!(spec.min_available, Some(IntOrString::Int(3)));
        assert_eq!(spec.max_unavailable, None);
        assert_eq!(
            spec.selector.unwrap().match_labels.unwrap()["app"],
            "guard".to_string()
        );
        assert!(g.is_current(&pdb, 4));
        assert!(!g.is_current(&pdb, 3));
        let mut other = pdb.clone();
        other.spec.as_mut().unwrap().max_unavailable = Some(IntOrString::Int(1));
        assert!(!g.is_current(&other, 4));
    }
}
