//! The operator on Kubernetes, assembled: the planner and executor over [`KubeMachines`],
//! acting only while this replica holds the Lease, woken by watches on the Machines, the
//! `etcd-endpoints` ConfigMap and the quorum-guard PDB, and resyncing periodically to observe
//! etcd (which nothing watches). After each step the ConfigMap and the PDB are brought in step
//! with the fresh member list and machine count; every action becomes an Event.
//!
//! Losing the Lease cancels the reconcile in flight (its future is dropped between two awaits:
//! a membership call already sent completes in etcd, and the next leader observes it).

use std::sync::Arc;
use std::time::Duration;

use ::kube::api::Api;
use ::kube::runtime::events::{Recorder, Reporter};
use ::kube::runtime::watcher;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use super::lease::{LeaseLock, LeaseTiming};
use super::machine::Machine;
use super::machines::{KubeMachines, KubeMachinesConfig};
use super::quorum_guard::QuorumGuard;
use super::sync::SyncError;
use super::{endpoints, events};
use crate::operator::execute::{BackendError, ExecuteError, Operator, Timing};
use crate::operator::plan::Spec;

/// Everything the controller needs besides a client.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Desired voters.
    pub spec: Spec,
    /// Which Machines, and how their members are reached.
    pub machines: KubeMachinesConfig,
    /// etcd client URLs to start from.
    pub etcd_endpoints: Vec<String>,
    /// Client TLS to etcd (a control plane's etcd wants mutual TLS); files re-read on reconnect.
    pub etcd_tls: Option<crate::config::TlsFiles>,
    /// The operator's namespace: the Lease and the `etcd-endpoints` ConfigMap.
    pub namespace: String,
    /// The quorum-guard PDB.
    pub guard: QuorumGuard,
    /// The Lease's name.
    pub lease_name: String,
    /// This replica's identity in the Lease (the pod name).
    pub identity: String,
    /// Lease timings.
    pub lease: LeaseTiming,
    /// Executor timings; `interval` is the resync period.
    pub timing: Timing,
}

/// The kube client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The kubeconfig file could not be read or used.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Neither a kubeconfig nor the in-cluster service account could be used.
    #[error("no Kubernetes configuration (kubeconfig or in-cluster): {0}")]
    Infer(#[source] ::kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("building the Kubernetes client: {0}")]
    Build(#[source] ::kube::Error),
}

/// A client from `kubeconfig` when given (its current context), else from `$KUBECONFIG`,
/// `~/.kube/config` or the in-cluster service account, as kubectl finds them.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<::kube::Client, ClientError> {
    let config = match kubeconfig {
        Some(path) => {
            let err = |e: Box<dyn std::error::Error + Send + Sync>| ClientError::Kubeconfig {
                path: path.to_owned(),
                source: e,
            };
            let kc = ::kube::config::Kubeconfig::read_from(path).map_err(|e| err(Box::new(e)))?;
            ::kube::Config::from_custom_kubeconfig(
                kc,
                &::kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|e| err(Box::new(e)))?
        }
        None => ::kube::Config::infer().await.map_err(ClientError::Infer)?,
    };
    ::kube::Client::try_from(config).map_err(ClientError::Build)
}

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Observing or acting on etcd and the Machines failed.
    #[error(transparent)]
    Execute(#[from] ExecuteError),
    /// Reading the Machines failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Writing the ConfigMap or the PDB failed.
    #[error(transparent)]
    Sync(#[from] SyncError),
}

/// Wakes the loop on every change `api`'s watch reports.
async fn trigger<K>(
    api: Api<K>,
    config: watcher::Config,
    wake: Arc<Notify>,
    cancel: CancellationToken,
) where
    K: ::kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
{
    let mut events = Box::pin(watcher(api, config));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            ev = events.next() => match ev {
                Some(Ok(_)) => wake.notify_one(),
                // The watcher backs off and retries by itself.
                Some(Err(e)) => warn!(error = %e, "watch failed"),
                None => return,
            },
        }
    }
}

struct Parts {
    operator: Arc<Operator<KubeMachines>>,
    machines: Arc<KubeMachines>,
    config_maps: Api<ConfigMap>,
    budgets: Api<PodDisruptionBudget>,
    settings: Settings,
}

impl Parts {
    /// One reconcile: returns whether the plan acted.
    async fn reconcile(&self) -> Result<bool, ReconcileError> {
        let census = self.machines.census().await?;
        if !census.machine_api_functional() {
            warn!(
                machines = census.total,
                "no control-plane Machine is Running: the Machine API does not work here; not acting"
            );
            return Ok(false);
        }
        let plan = self.operator.step().await?;
        // Fresh facts after the actions: a learner just added belongs in the ConfigMap.
        let obs = self.operator.observe().await?;
        endpoints::sync(
            &self.config_maps,
            &self.settings.namespace,
            &obs.observed.members,
        )
        .await?;
        let census = self.machines.census().await?;
        self.settings
            .guard
            .sync(&self.budgets, census.total)
            .await?;
        Ok(!plan.actions.is_empty())
    }
}

/// Runs the controller until `cancel`; then stops acting, releases the Lease and returns
/// within a few seconds.
pub async fn run(client: ::kube::Client, settings: Settings, cancel: CancellationToken) {
    let machines = Arc::new(KubeMachines::new(client.clone(), settings.machines.clone()));
    let operator = Arc::new(
        Operator::new(
            settings.spec,
            Arc::clone(&machines),
            settings.etcd_endpoints.clone(),
            settings.timing,
        )
        .with_tls(settings.etcd_tls.clone()),
    );
    let parts = Parts {
        operator: Arc::clone(&operator),
        machines,
        config_maps: Api::namespaced(client.clone(), &settings.namespace),
        budgets: Api::namespaced(client.clone(), &settings.guard.namespace),
        settings: settings.clone(),
    };

    let tasks = TaskTracker::new();
    let child = cancel.child_token();
    // Dropped (the task aborted) or returned: the tasks stop too. A Lease renewed by an orphaned
    // task while nothing reconciles would keep every other replica from acting.
    let _stop_tasks = child.clone().drop_guard();
    let (leader_tx, mut leader) = watch::channel(false);
    {
        let lock = LeaseLock::new(
            Api::namespaced(client.clone(), &settings.namespace),
            &settings.lease_name,
            &settings.identity,
            settings.lease,
        );
        let c = child.clone();
        tasks.spawn(async move { lock.run(leader_tx, c).await });
    }
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "etcd-warden-operator".into(),
            instance: Some(settings.identity.clone()),
        },
    );
    let fallback = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("ConfigMap".into()),
        name: Some(endpoints::NAME.into()),
        namespace: Some(settings.namespace.clone()),
        ..ObjectReference::default()
    };
    tasks.spawn(events::publish(
        operator.subscribe_actions(),
        recorder,
        settings.machines.namespace.clone(),
        fallback,
        child.clone(),
    ));
    tasks.spawn(crate::operator::control_plane_set::kube::run(
        client.clone(),
        crate::operator::control_plane_set::kube::SetSettings::from_operator(&settings),
        Arc::clone(&operator),
        leader.clone(),
        child.clone(),
    ));
    let wake = Arc::new(Notify::new());
    let machine_api: Api<Machine> = Api::namespaced(client.clone(), &settings.machines.namespace);
    tasks.spawn(trigger(
        machine_api,
        watcher::Config::default().labels(&settings.machines.selector),
        Arc::clone(&wake),
        child.clone(),
    ));
    tasks.spawn(trigger(
        parts.config_maps.clone(),
        watcher::Config::default().fields(&format!("metadata.name={}", endpoints::NAME)),
        Arc::clone(&wake),
        child.clone(),
    ));
    tasks.spawn(trigger(
        parts.budgets.clone(),
        watcher::Config::default().fields(&format!("metadata.name={}", settings.guard.name)),
        Arc::clone(&wake),
        child.clone(),
    ));
    tasks.close();

    let timing = settings.timing;
    let backoff = crate::backoff::Backoff::new(timing.min_backoff, timing.max_backoff);
    let mut failures = 0u32;
    'run: loop {
        while !*leader.borrow_and_update() {
            tokio::select! {
                _ = cancel.cancelled() => break 'run,
                changed = leader.changed() => if changed.is_err() { break 'run },
            }
        }
        info!(identity = %settings.identity, "leading: reconciling");
        loop {
            let result = tokio::select! {
                _ = cancel.cancelled() => break 'run,
                _ = leader.wait_for(|l| !*l) => {
                    warn!("lease lost: reconcile cancelled, not acting");
                    continue 'run;
                }
                r = parts.reconcile() => r,
            };
            let wait = match result {
                Ok(true) => {
                    failures = 0;
                    Duration::from_millis(50)
                }
                Ok(false) => {
                    failures = 0;
                    timing.interval
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let retry_in = backoff.delay(failures);
                    warn!(error = %e, ?retry_in, "reconcile failed");
                    retry_in
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => break 'run,
                _ = leader.wait_for(|l| !*l) => {
                    warn!("lease lost: not acting");
                    continue 'run;
                }
                _ = wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
    child.cancel();
    if tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .is_err()
    {
        warn!("controller tasks did not stop within 5s");
    }
}
