//! The [`Machines`] seam on Kubernetes: control-plane `Machine`s selected by a label selector,
//! our pre-drain hook added and released by optimistic-concurrency patches.
//!
//! A hook change reads the Machine, computes the whole new `preDrain` list from what it read,
//! and sends it as a JSON merge patch carrying the `metadata.resourceVersion` it read: the API
//! server applies it only if nobody changed the Machine in between (else 409), so another
//! owner's hook added meanwhile is never overwritten. On 409 it reads again and retries.
//!
//! Nobody can tell, from a Machine, who took a hook off or whether it was ever on. So a deleting
//! Machine without our hook is reported as [`MachineState::hook_removed_by_other`] and the hook
//! is never added to it: seed 000's escape hatch, at the price that a Machine deleted before the
//! operator ever protected it is not protected afterwards either.

use std::fmt::Debug;
use std::time::Duration;

use ::kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tracing::{debug, info};

use super::machine_resource::{CONTROL_PLANE_SELECTOR, LifecycleHook, Machine};
use crate::operator::quorum::execute::{BackendError, Machines};
use crate::operator::quorum::plan::MachineState;

/// The field manager named on every write.
pub const FIELD_MANAGER: &str = "etcd-warden-operator";

/// Merge patches as this operator's field manager.
pub(super) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    }
}

/// Sends `patch` to `name` as a JSON merge patch, as this operator's field manager.
pub(super) async fn send_merge_patch<K>(
    api: &Api<K>,
    name: &str,
    patch: &Value,
) -> ::kube::Result<K>
where
    K: Clone + DeserializeOwned + Debug,
{
    api.patch(name, &patch_params(), &Patch::Merge(patch)).await
}

/// Creates as this operator's field manager.
pub(super) fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    }
}

/// Which Machines, and how their members are reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeMachinesConfig {
    /// Namespace of the Machines.
    pub namespace: String,
    /// Label selector of the control-plane Machines.
    pub selector: String,
    /// Scheme of etcd's peer URLs (`https` on a control plane).
    pub peer_scheme: String,
    /// etcd's peer port.
    pub peer_port: u16,
    /// Attempts at a hook change that meets concurrent changes (409).
    pub conflict_attempts: u32,
}

impl Default for KubeMachinesConfig {
    fn default() -> Self {
        KubeMachinesConfig {
            namespace: "openshift-machine-api".into(),
            selector: CONTROL_PLANE_SELECTOR.into(),
            peer_scheme: "https".into(),
            peer_port: 2380,
            conflict_attempts: 5,
        }
    }
}

/// One failed call to the API server, with what was being done.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct KubeCall {
    /// What was being done.
    pub what: String,
    /// What kube-rs returned.
    #[source]
    pub source: ::kube::Error,
}

impl KubeCall {
    /// Unreachable, throttled, conflicting or failing servers may answer next time; a refusal
    /// (forbidden, invalid, unreadable) will not.
    pub fn is_transient(&self) -> bool {
        match &self.source {
            ::kube::Error::Api(s) => {
                s.code == 409 || s.code == 410 || s.code == 429 || s.code >= 500
            }
            ::kube::Error::HyperError(_)
            | ::kube::Error::Service(_)
            | ::kube::Error::ReadEvents(_) => true,
            _ => false,
        }
    }
}

/// `e` in the seam's terms, transient or permanent as [`KubeCall::is_transient`] judges.
pub fn backend_error(what: impl Into<String>, e: ::kube::Error) -> BackendError {
    let what = what.into();
    let call = Box::new(KubeCall {
        what: what.clone(),
        source: e,
    });
    if call.is_transient() {
        BackendError::Unavailable(call)
    } else {
        BackendError::Rejected { what, source: call }
    }
}

/// Whether `e` is an API answer with HTTP status `code`.
pub fn is_status(e: &::kube::Error, code: u16) -> bool {
    matches!(e, ::kube::Error::Api(s) if s.code == code)
}

/// How many control-plane Machines there are, and how many run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    /// Every Machine the selector picks, deleting and provisioning ones included.
    pub total: usize,
    /// Those in phase `Running`.
    pub running: usize,
}

impl Census {
    /// Seed 000's test of a functional Machine API: at least one control-plane Machine runs.
    pub fn machine_api_functional(&self) -> bool {
        self.running > 0
    }
}

/// The Machines of a Kubernetes cluster.
pub struct KubeMachines {
    api: Api<Machine>,
    config: KubeMachinesConfig,
}

impl KubeMachines {
    /// The Machines `config` selects, through `client`.
    pub fn new(client: ::kube::Client, config: KubeMachinesConfig) -> KubeMachines {
        KubeMachines {
            api: Api::namespaced(client, &config.namespace),
            config,
        }
    }

    /// The peer URL of a member on a host at `ip`.
    pub fn peer_url(&self, ip: &str) -> String {
        let host = if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip.to_owned()
        };
        format!(
            "{}://{host}:{}",
            self.config.peer_scheme, self.config.peer_port
        )
    }

    /// What the planner sees of a Machine; `None` until it has an internal IP (it cannot host
    /// a member before).
    fn state(&self, m: &Machine) -> Option<MachineState> {
        let name = m.metadata.name.clone()?;
        let Some(ip) = m.internal_ip() else {
            debug!(machine = %name, phase = ?m.phase(), "machine without an InternalIP skipped");
            return None;
        };
        let deleting = m.deleting();
        let has_hook = m.has_our_hook();
        Some(MachineState {
            name,
            peer_url: self.peer_url(ip),
            deleting,
            has_hook,
            hook_removed_by_other: deleting && !has_hook,
        })
    }

    /// Every selected Machine, addressed or not: what the quorum guard counts, and whether the
    /// Machine API works at all (seed 000: no Machine `Running` means it does not, and the hooks
    /// protect nothing, so the operator should stay out).
    pub async fn census(&self) -> Result<Census, BackendError> {
        let machines = self.selected().await?;
        Ok(Census {
            total: machines.len(),
            running: machines
                .iter()
                .filter(|m| m.phase() == Some("Running"))
                .count(),
        })
    }

    /// Every Machine the selector picks.
    async fn selected(&self) -> Result<Vec<Machine>, BackendError> {
        // No resourceVersion: a consistent read, not a possibly stale cache.
        let lp = ListParams::default().labels(&self.config.selector);
        let list = self
            .api
            .list(&lp)
            .await
            .map_err(|e| backend_error("listing machines", e))?;
        Ok(list.items)
    }

    async fn get(&self, name: &str) -> Result<Machine, BackendError> {
        match self.api.get(name).await {
            Ok(m) => Ok(m),
            Err(e) if is_status(&e, 404) => Err(BackendError::NotFound(name.to_owned())),
            Err(e) => Err(backend_error(format!("reading machine {name}"), e)),
        }
    }

    /// Reads the Machine, lets `decide` compute its new `preDrain` list (`None`: nothing to
    /// change), and patches it on the version read; reads again after a conflict.
    async fn change_hooks(
        &self,
        name: &str,
        what: &str,
        decide: impl Fn(&Machine) -> Result<Option<Vec<LifecycleHook>>, BackendError>,
    ) -> Result<(), BackendError> {
        let attempts = self.config.conflict_attempts.max(1);
        for attempt in 1..=attempts {
            let m = self.get(name).await?;
            let Some(hooks) = decide(&m)? else {
                return Ok(());
            };
            let patch = json!({
                "metadata": {"resourceVersion": m.metadata.resource_version},
                "spec": {"lifecycleHooks": {"preDrain": hooks}},
            });
            match send_merge_patch(&self.api, name, &patch).await {
                Ok(_) => {
                    info!(machine = %name, "{what}");
                    return Ok(());
                }
                Err(e) if is_status(&e, 409) => {
                    debug!(machine = %name, attempt, "machine changed meanwhile; reading it again");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
                }
                Err(e) if is_status(&e, 404) => {
                    return Err(BackendError::NotFound(name.to_owned()));
                }
                Err(e) => return Err(backend_error(format!("{what} on machine {name}"), e)),
            }
        }
        Err(BackendError::Conflict {
            machine: name.to_owned(),
            attempts,
        })
    }
}

#[async_trait]
impl Machines for KubeMachines {
    async fn list(&self) -> Result<Vec<MachineState>, BackendError> {
        let machines = self.selected().await?;
        Ok(machines.iter().filter_map(|m| self.state(m)).collect())
    }

    async fn add_hook(&self, machine: &str) -> Result<(), BackendError> {
        self.change_hooks(machine, "deletion hook added", |m| {
            if m.has_our_hook() {
                return Ok(None);
            }
            if m.deleting() {
                return Err(BackendError::Deleting(machine.to_owned()));
            }
            let mut hooks = m.spec.lifecycle_hooks.pre_drain.clone();
            hooks.push(LifecycleHook::ours());
            Ok(Some(hooks))
        })
        .await
    }

    async fn release_hook(&self, machine: &str) -> Result<(), BackendError> {
        self.change_hooks(machine, "deletion hook released", |m| {
            if !m.has_our_hook() {
                return Ok(None);
            }
            let hooks = m
                .spec
                .lifecycle_hooks
                .pre_drain
                .iter()
                .filter(|h| !h.is_ours())
                .cloned()
                .collect();
            Ok(Some(hooks))
        })
        .await
    }
}
