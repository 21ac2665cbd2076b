//! The ControlPlaneSet controller: observes the Machines and etcd, asks [`super::plan`], and
//! applies the one change it returns, over any [`SetMachines`] backend.
//!
//! etcd is observed through the quorum operator's own observation (a linearizable member list
//! and each member's status), so the set and the quorum operator judge "this member votes" from
//! the same facts. Each step starts from a fresh observation, like the quorum operator's.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::plan::{
    Action, Condition, Counts, DomainField, MachineView, MemberRole, Observed, Plan, SetSpec,
    Strategy, plan, spec_hash,
};
use crate::operator::quorum::execute::{BackendError, ExecuteError, Machines, Operator};
use crate::operator::quorum::plan::same_url;

/// One Machine as a backend lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SetMachine {
    /// Machine name.
    pub name: String,
    /// Its spec (the provider spec and everything the template sets), as JSON.
    pub spec: Value,
    /// The peer URL its etcd member advertises (links it to the member).
    pub peer_url: String,
    /// Its node is Ready.
    pub ready: bool,
    /// Provisioning failed.
    pub failed: bool,
    /// Marked for deletion.
    pub deleting: bool,
    /// Carries the set's owner reference.
    pub owned: bool,
    /// The node it backs (`status.nodeRef`), once it has one.
    pub node: Option<String>,
}

/// What the controller needs from the Machines' home (Kubernetes, or local processes).
#[async_trait]
pub trait SetMachines: Send + Sync + 'static {
    /// The Machines matching the set's selector.
    async fn list_set(&self) -> Result<Vec<SetMachine>, BackendError>;
    /// Puts the set's owner reference on a Machine.
    async fn adopt(&self, machine: &str) -> Result<(), BackendError>;
    /// Creates a Machine with `spec`; returns its name.
    async fn create(&self, spec: &Value) -> Result<String, BackendError>;
    /// Marks a Machine for deletion (its hooks hold it until its member is gone).
    async fn delete(&self, machine: &str) -> Result<(), BackendError>;
    /// The control-plane nodes, by name: a node no Machine backs stops every change (seed 004).
    /// A backend without nodes (the local one) has none.
    async fn control_plane_nodes(&self) -> Result<Vec<String>, BackendError> {
        Ok(Vec::new())
    }
}

/// The set's desired state, as a user writes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SetConfig {
    /// 3 or 5.
    pub replicas: usize,
    /// How outdated Machines are replaced.
    pub strategy: Strategy,
    /// Failure domains (empty: one).
    pub failure_domains: Vec<String>,
    /// The Machine spec new Machines get (the failure domain injected).
    pub template: Value,
}

/// What `GET /controlplaneset` shows.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SetStatus {
    /// The desired state.
    pub spec: SetConfig,
    /// Bumped by every change of the desired state.
    pub generation: u64,
    /// The generation the last step planned for (the counts and conditions are of it).
    pub observed_generation: u64,
    /// Status counts.
    #[serde(flatten)]
    pub counts: Counts,
    /// Available, Progressing, Degraded.
    pub conditions: Vec<super::plan::Condition>,
    /// The Machines at the last step.
    pub machines: Vec<SetMachineStatus>,
    /// Changes applied, oldest first (the last 100).
    pub history: Vec<String>,
    /// The last step's error, cleared by a successful step.
    pub last_error: Option<String>,
}

/// One Machine in the status.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SetMachineStatus {
    /// Machine name.
    pub name: String,
    /// Its failure domain.
    pub failure_domain: Option<String>,
    /// Its spec matches the template.
    pub updated: bool,
    /// Ready.
    pub ready: bool,
    /// Marked for deletion.
    pub deleting: bool,
    /// Its etcd member.
    pub member: MemberRole,
}

/// Errors of one controller step.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// Observing etcd failed.
    #[error("observing etcd: {0}")]
    Etcd(#[from] ExecuteError),
    /// The Machines' backend failed.
    #[error("machines: {0}")]
    Backend(#[from] BackendError),
}

const HISTORY: usize = 100;

/// The controller over `S` (the set's Machines) with `Q`'s quorum operator as the eyes on etcd.
pub struct Controller<S: SetMachines, Q: Machines> {
    /// The desired state and its generation.
    config: Mutex<(SetConfig, u64)>,
    field: DomainField,
    machines: Arc<S>,
    operator: Arc<Operator<Q>>,
    status: Arc<Mutex<SetStatus>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<S: SetMachines, Q: Machines> Controller<S, Q> {
    /// A controller keeping `machines` at `config`, with the failure domain at `field`.
    pub fn new(
        config: SetConfig,
        field: DomainField,
        machines: Arc<S>,
        operator: Arc<Operator<Q>>,
    ) -> Self {
        let status = SetStatus {
            spec: config.clone(),
            generation: 1,
            observed_generation: 0,
            counts: Counts::default(),
            conditions: Vec::new(),
            machines: Vec::new(),
            history: Vec::new(),
            last_error: None,
        };
        Controller {
            config: Mutex::new((config, 1)),
            field,
            machines,
            operator,
            status: Arc::new(Mutex::new(status)),
        }
    }

    /// A shared handle on the status.
    pub fn status_handle(&self) -> Arc<Mutex<SetStatus>> {
        Arc::clone(&self.status)
    }

    /// A copy of the status.
    pub fn status(&self) -> SetStatus {
        lock(&self.status).clone()
    }

    /// The desired state now.
    pub fn config(&self) -> SetConfig {
        lock(&self.config).0.clone()
    }

    /// Changes the template and the failure domains (replicas and strategy are immutable).
    pub fn update(&self, template: Value, failure_domains: Vec<String>) {
        let mut guard = lock(&self.config);
        let (c, generation) = &mut *guard;
        c.template = template;
        c.failure_domains = failure_domains;
        *generation += 1;
        let mut status = lock(&self.status);
        status.spec = c.clone();
        status.generation = *generation;
        info!(template = %c.template, domains = ?c.failure_domains, generation = *generation, "control plane set updated");
    }

    /// Observes, plans and applies one step.
    pub async fn step(&self) -> Result<Plan, ControllerError> {
        self.plan_and_maybe_act(true).await
    }

    /// Observes and plans as [`Self::step`] does, acting on nothing (an Inactive set): the
    /// plan's actions are what a step would have done.
    pub async fn observe(&self) -> Result<Plan, ControllerError> {
        self.plan_and_maybe_act(false).await
    }

    async fn plan_and_maybe_act(&self, act: bool) -> Result<Plan, ControllerError> {
        let (config, generation) = lock(&self.config).clone();
        let etcd = self.operator.observe().await?;
        let listed = self.machines.list_set().await?;
        let member_of = |peer_url: &str| -> MemberRole {
            match etcd
                .observed
                .members
                .iter()
                .find(|m| m.peer_urls.iter().any(|u| same_url(u, peer_url)))
            {
                None => MemberRole::None,
                Some(m) if m.is_learner => MemberRole::Learner,
                Some(m) => MemberRole::Voter { healthy: m.healthy },
            }
        };
        let template_hash = spec_hash(&config.template, self.field);
        let views: Vec<MachineView> = listed
            .iter()
            .map(|m| MachineView {
                name: m.name.clone(),
                spec_hash: spec_hash(&m.spec, self.field),
                failure_domain: self.field.get(&m.spec),
                ready: m.ready,
                failed: m.failed,
                deleting: m.deleting,
                owned: m.owned,
                member: member_of(&m.peer_url),
            })
            .collect();
        let spec = SetSpec {
            replicas: config.replicas,
            strategy: config.strategy,
            failure_domains: config.failure_domains.clone(),
            template_hash: template_hash.clone(),
        };
        let backed: std::collections::BTreeSet<&str> =
            listed.iter().filter_map(|m| m.node.as_deref()).collect();
        let mut nodes_without_machine: Vec<String> = self
            .machines
            .control_plane_nodes()
            .await?
            .into_iter()
            .filter(|n| !backed.contains(n.as_str()))
            .collect();
        nodes_without_machine.sort();
        let p = plan(
            &spec,
            &Observed {
                machines: views.clone(),
                nodes_without_machine,
            },
        );
        let mut applied = Vec::new();
        for action in p.actions.iter().filter(|_| act) {
            match action {
                Action::Adopt { machine } => self.machines.adopt(machine).await?,
                Action::Create { failure_domain, .. } => {
                    let spec = match failure_domain {
                        Some(d) => self.field.inject(&config.template, d),
                        None => config.template.clone(),
                    };
                    let name = self.machines.create(&spec).await?;
                    info!(machine = %name, "{action}");
                }
                Action::Delete { machine, .. } => {
                    self.machines.delete(machine).await?;
                    info!(machine = %machine, "{action}");
                }
            }
            applied.push(action.to_string());
        }
        let mut status = lock(&self.status);
        status.observed_generation = generation;
        status.counts = p.counts;
        status.conditions = p.conditions.clone();
        status.machines = views
            .iter()
            .map(|v| SetMachineStatus {
                name: v.name.clone(),
                failure_domain: v.failure_domain.clone(),
                updated: v.spec_hash == template_hash,
                ready: v.ready,
                deleting: v.deleting,
                member: v.member,
            })
            .collect();
        status.history.extend(applied);
        let excess = status.history.len().saturating_sub(HISTORY);
        status.history.drain(..excess);
        status.last_error = None;
        Ok(p)
    }

    /// Runs steps until cancelled: again soon after a step that acted, every `interval`
    /// otherwise, and after `interval` following a failure.
    pub async fn run(&self, interval: Duration, cancel: CancellationToken) {
        let mut degraded: Option<String> = None;
        loop {
            let result = tokio::select! {
                () = cancel.cancelled() => return,
                r = self.step() => r,
            };
            let wait = match result {
                Ok(p) => {
                    let now = p
                        .conditions
                        .iter()
                        .find(|c| c.kind == "Degraded" && c.status)
                        .map(|c: &Condition| format!("{}: {}", c.reason, c.message));
                    if now != degraded {
                        if let Some(text) = &now {
                            warn!(condition = %text, "control plane set degraded");
                        }
                        degraded = now;
                    }
                    if p.actions.is_empty() {
                        interval
                    } else {
                        Duration::from_millis(100)
                    }
                }
                Err(e) => {
                    warn!(error = %e, "control plane set step failed");
                    lock(&self.status).last_error = Some(e.to_string());
                    interval
                }
            };
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// The quorum operator's replacement order for a set's strategy.
pub fn replacement_for(strategy: Strategy) -> crate::operator::quorum::plan::Replacement {
    use crate::operator::quorum::plan::Replacement;
    match strategy {
        Strategy::RollingUpdate => Replacement::Surge,
        Strategy::Recreate => Replacement::ShrinkFirst,
        Strategy::OnDelete => Replacement::OnDeletion,
    }
}
