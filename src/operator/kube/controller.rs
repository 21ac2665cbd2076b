//! The operator on Kubernetes, assembled: the planner and executor over [`KubeMachines`],
//! acting only while this replica holds the Lease, woken by watches on the Machines, the
//! `etcd-endpoints` ConfigMap and the quorum-guard PDB, and resyncing periodically to observe
//! etcd (which nothing watches). After each step the ConfigMap and the PDB are brought in step
//! with the fresh member list and machine count, and the `EtcdQuorum` status with the
//! conditions derived from it; every action becomes an Event.
//!
//! With an owner record configured (seed 001's controller watchdog, [`OwnerGuard`]), acting also
//! needs the record to name us. Losing the Lease or ownership cancels the reconcile in flight (its future is dropped between two awaits:
//! a membership call already sent completes in etcd, and the next leader observes it).

use std::sync::Arc;
use std::time::Duration;

use ::kube::api::{Api, Patch};
use ::kube::runtime::events::{Recorder, Reporter};
use ::kube::runtime::watcher;
use futures::{FutureExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::health::{self, HealthState, TaskHealth};
use super::lease::{LeaseLock, LeaseMetrics, LeaseTiming};
use super::machine_resource::Machine;
use super::machines::{
    KubeCall, KubeMachines, KubeMachinesConfig, is_status, patch_params, post_params,
};
use super::quorum_guard::QuorumGuard;
use super::sync::{ATTEMPTS, SyncError};
use super::{endpoints, events};
use crate::operator::quorum::execute::{BackendError, ExecuteError, Observation, Operator, Timing};
use crate::operator::quorum::plan::Spec;
use crate::operator::quorum::resource::{self, EtcdQuorum, EtcdQuorumSpec, EtcdQuorumStatus, NAME};
use crate::owner::guard::{GuardSettings, OwnerGuard};

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
    /// The owner record to check (seed 001's controller watchdog): nothing acts unless it names
    /// us, and losing it cancels the reconcile in flight. `None`: no owner record.
    pub owner: Option<GuardSettings>,
}

pub use crate::kube_client::{ClientError, client};

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
    /// Computing or writing the etcd-endpoints ConfigMap failed.
    #[error(transparent)]
    Endpoints(#[from] endpoints::SyncEndpointsError),
}

/// Wakes the loop on every change `api`'s watch reports; `synced` after each full listing.
async fn trigger<K>(
    api: Api<K>,
    config: watcher::Config,
    wake: Arc<Notify>,
    synced: impl Fn() + Send + 'static,
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
                Some(Ok(e)) => {
                    if matches!(e, watcher::Event::InitDone) {
                        synced();
                    }
                    wake.notify_one();
                }
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
    quorums: Api<EtcdQuorum>,
    learner: std::sync::Mutex<resource::LearnerProgress>,
    settings: Settings,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Parts {
    /// One reconcile: returns whether an action changed something.
    async fn reconcile(&self) -> Result<bool, ReconcileError> {
        let census = self.machines.census().await?;
        if !census.machine_api_functional() {
            warn!(
                machines = census.total,
                "no control-plane Machine is Running: the Machine API does not work here; not acting"
            );
            // Observing changes nothing; the status says why nothing happens.
            let obs = self.operator.observe().await?;
            self.write_status(&obs, false).await?;
            return Ok(false);
        }
        let (_, acted) = self.operator.step_acted().await?;
        // Fresh facts after the actions: a learner just added belongs in the ConfigMap.
        let obs = self.operator.observe().await?;
        endpoints::sync(
            &self.config_maps,
            &self.settings.namespace,
            &obs.observed.members,
        )
        .await?;
        // Only our own actions changed the Machines since the first count; anyone else's change
        // is a watch event that wakes the next reconcile.
        let census = if acted {
            self.machines.census().await?
        } else {
            census
        };
        self.settings
            .guard
            .sync(&self.budgets, census.total)
            .await?;
        self.write_status(&obs, census.machine_api_functional())
            .await?;
        Ok(acted)
    }

    /// Says in the EtcdQuorum's status that reconciles keep failing with `error`.
    async fn write_failure(&self, error: &ReconcileError) {
        let text = error.to_string();
        let written = sync_status(&self.quorums, |_, previous, generation| {
            resource::failed(previous, &text, generation, chrono::Utc::now())
        })
        .await;
        if let Err(e) = written {
            warn!(error = %e, "could not report the failure in the EtcdQuorum status");
        }
    }

    /// Brings the EtcdQuorum's status in step with `obs` (nothing written when it already is).
    async fn write_status(
        &self,
        obs: &Observation,
        machine_api_functional: bool,
    ) -> Result<(), SyncError> {
        let stalled = lock(&self.learner).stalled(&obs.observed, std::time::Instant::now());
        let facts = resource::Facts {
            spec: self.settings.spec,
            observed: &obs.observed,
            machine_api_functional,
            stalled_learner: stalled.as_deref(),
        };
        let last = self.operator.status().last_action;
        sync_status(&self.quorums, |spec, previous, generation| {
            let mut st = resource::status(
                &facts,
                &obs.members,
                last.as_ref(),
                previous,
                generation,
                chrono::Utc::now(),
            );
            st.quorum_restore = resource::restore_status(
                spec.quorum_restore.as_ref(),
                previous.and_then(|p| p.quorum_restore.as_ref()),
                &obs.observed,
                self.settings.spec.desired_voters,
            );
            st
        })
        .await?;
        Ok(())
    }
}

/// Makes sure `namespace/cluster` exists and its status is what `make(spec, previous, generation)`
/// returns, writing through `/status` only when that differs. Returns whether it wrote.
async fn sync_status(
    api: &Api<EtcdQuorum>,
    make: impl Fn(&EtcdQuorumSpec, Option<&EtcdQuorumStatus>, Option<i64>) -> EtcdQuorumStatus,
) -> Result<bool, SyncError> {
    let call = |what: &str, source| KubeCall {
        what: format!("{what} EtcdQuorum {NAME}"),
        source,
    };
    let params = patch_params();
    for attempt in 1..=ATTEMPTS {
        let current = match api.get_opt(NAME).await.map_err(|e| call("reading", e))? {
            Some(c) => c,
            None => {
                let pp = post_params();
                match api
                    .create(&pp, &EtcdQuorum::new(NAME, EtcdQuorumSpec::default()))
                    .await
                {
                    Ok(created) => created,
                    Err(e) if is_status(&e, 409) => continue,
                    Err(e) => return Err(call("creating", e).into()),
                }
            }
        };
        let desired = make(
            &current.spec,
            current.status.as_ref(),
            current.metadata.generation,
        );
        if current.status.as_ref() == Some(&desired) {
            return Ok(false);
        }
        // On the version read: a write in between is read again, not overwritten.
        let mut status = serde_json::to_value(&desired).unwrap_or_else(|_| json!({}));
        // A merge patch keeps what it leaves out: a request's status goes with the request.
        if desired.quorum_restore.is_none()
            && let Some(o) = status.as_object_mut()
        {
            o.insert("quorumRestore".into(), serde_json::Value::Null);
        }
        let patch = json!({
            "metadata": {"resourceVersion": current.metadata.resource_version},
            "status": status,
        });
        match api.patch_status(NAME, &params, &Patch::Merge(&patch)).await {
            Ok(_) => return Ok(true),
            Err(e) if is_status(&e, 409) || is_status(&e, 404) => {
                debug!(attempt, error = %e, "EtcdQuorum changed meanwhile; reading again");
                tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
            }
            Err(e) => return Err(call("writing the status of", e).into()),
        }
    }
    Err(SyncError::Conflict {
        what: format!("EtcdQuorum {NAME}"),
        attempts: ATTEMPTS,
    })
}

/// Keeps `tx` at "holds the Lease and owns" until `cancel` or the guard stops (then `false`).
async fn may_act(
    mut leader: watch::Receiver<bool>,
    mut guard: OwnerGuard,
    tx: watch::Sender<bool>,
    cancel: CancellationToken,
) {
    loop {
        let now = *leader.borrow_and_update() && guard.standing().owns();
        tx.send_if_modified(|v| std::mem::replace(v, now) != now);
        tokio::select! {
            _ = cancel.cancelled() => break,
            r = leader.changed() => if r.is_err() { break },
            alive = guard.changed() => if !alive { break },
        }
    }
    tx.send_replace(false);
}

/// Runs the controller until `cancel`; then stops acting, releases the Lease and returns
/// within a few seconds.
pub async fn run(client: ::kube::Client, settings: Settings, cancel: CancellationToken) {
    run_serving(client, settings, None, cancel).await;
}

/// [`run`], serving `/healthz`, `/readyz` and `/metrics` on `http` when given (see
/// [`super::health`]).
pub async fn run_serving(
    client: ::kube::Client,
    settings: Settings,
    http: Option<tokio::net::TcpListener>,
    cancel: CancellationToken,
) {
    let parts = assemble(&client, &settings);
    let operator = Arc::clone(&parts.operator);
    let lease_metrics = LeaseMetrics::default();
    let event_metrics = events::EventMetrics::default();
    let mut registry = Registry::default();
    operator.metrics().register(&mut registry);
    lease_metrics.register(&mut registry);
    event_metrics.register(&mut registry);

    let tasks = Tasks {
        tracker: TaskTracker::new(),
        health: TaskHealth::new(),
        cancel: cancel.child_token(),
    };
    // Dropped (the task aborted) or returned: the tasks stop too. A Lease renewed by an orphaned
    // task while nothing reconciles would keep every other replica from acting.
    let _stop_tasks = tasks.cancel.clone().drop_guard();
    let acting = tasks.spawn_acting_gate(&client, &settings, lease_metrics);
    tasks.spawn_events(&client, &settings, &operator, event_metrics);
    tasks.spawn_control_plane_set(&client, &settings, &operator, &acting);
    let wake = tasks.spawn_watches(&client, &settings, &parts);
    tasks.spawn(
        "reconcile",
        false,
        reconcile_loop(parts, acting, wake, tasks.cancel.clone()),
    );
    if let Some(listener) = http {
        tasks.serve_health(listener, registry);
    }
    tasks.tracker.close();

    cancel.cancelled().await;
    tasks.cancel.cancel();
    if tokio::time::timeout(Duration::from_secs(5), tasks.tracker.wait())
        .await
        .is_err()
    {
        warn!("controller tasks did not stop within 5s");
    }
}

/// The planner and executor over [`KubeMachines`], and the API handles a reconcile writes
/// through.
fn assemble(client: &::kube::Client, settings: &Settings) -> Parts {
    let machines = Arc::new(KubeMachines::new(client.clone(), settings.machines.clone()));
    let operator = Operator::new(
        settings.spec,
        Arc::clone(&machines),
        settings.etcd_endpoints.clone(),
        settings.timing,
    )
    .with_tls(settings.etcd_tls.clone());
    Parts {
        operator: Arc::new(operator),
        machines,
        config_maps: Api::namespaced(client.clone(), &settings.namespace),
        budgets: Api::namespaced(client.clone(), &settings.guard.namespace),
        quorums: Api::namespaced(client.clone(), &settings.namespace),
        learner: std::sync::Mutex::default(),
        settings: settings.clone(),
    }
}

/// The controller's tasks: tracked, each shown on `/healthz`, all stopped by one token.
struct Tasks {
    tracker: TaskTracker,
    health: TaskHealth,
    cancel: CancellationToken,
}

impl Tasks {
    /// Spawns `fut` as the health-checked task `name` (`gated`: `/readyz` waits for it).
    fn spawn<F>(&self, name: &'static str, gated: bool, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.health.spawn(&self.tracker, name, gated, fut);
    }

    /// Starts leader election (and, with an owner record configured, the owner guard); the
    /// receiver says whether this replica may act: it holds the Lease and, when an owner record
    /// is configured, ownership.
    fn spawn_acting_gate(
        &self,
        client: &::kube::Client,
        settings: &Settings,
        metrics: LeaseMetrics,
    ) -> watch::Receiver<bool> {
        let (leader_tx, leader) = watch::channel(false);
        let lock = LeaseLock::new(
            Api::namespaced(client.clone(), &settings.namespace),
            &settings.lease_name,
            &settings.identity,
            settings.lease,
        )
        .with_metrics(metrics);
        let c = self.cancel.clone();
        self.spawn("lease", false, async move { lock.run(leader_tx, c).await });
        let Some(owner) = &settings.owner else {
            return leader;
        };
        let (guard, _) = OwnerGuard::start(owner.lookup.clone(), owner.timing, self.cancel.clone());
        let (tx, rx) = watch::channel(false);
        // Ends when the guard stops: acting goes false for good, and the reconcile loop,
        // seeing its sender gone, ends too (both show on /healthz).
        self.spawn(
            "owner",
            false,
            may_act(leader, guard, tx, self.cancel.clone()),
        );
        rx
    }

    /// Publishes every action the executor records as a Kubernetes Event.
    fn spawn_events(
        &self,
        client: &::kube::Client,
        settings: &Settings,
        operator: &Operator<KubeMachines>,
        metrics: events::EventMetrics,
    ) {
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
        self.spawn(
            "events",
            false,
            events::publish(
                operator.subscribe_actions(),
                recorder,
                settings.machines.namespace.clone(),
                fallback,
                // Ten retry caps (30 s with the defaults): past etcd's few seconds of "unhealthy
                // cluster" after a membership change.
                events::Streaks::new(settings.timing.max_backoff.saturating_mul(10)),
                metrics,
                self.cancel.clone(),
            ),
        );
    }

    /// The ControlPlaneSet's loop, acting on the same "holds the Lease and owns" as the quorum
    /// operator; what it waits for shows on `/healthz`.
    fn spawn_control_plane_set(
        &self,
        client: &::kube::Client,
        settings: &Settings,
        operator: &Arc<Operator<KubeMachines>>,
        acting: &watch::Receiver<bool>,
    ) {
        let health = self.health.clone();
        self.spawn(
            "control-plane-set",
            false,
            super::set_controller::run(
                client.clone(),
                set_settings(settings),
                Arc::clone(operator),
                acting.clone(),
                self.cancel.clone(),
                move |detail: Option<&str>| health.detail("control-plane-set", detail),
            ),
        );
    }

    /// Watches on the Machines, the `etcd-endpoints` ConfigMap and the quorum-guard PDB, each
    /// gating readiness until its first full listing; returns what they wake.
    fn spawn_watches(
        &self,
        client: &::kube::Client,
        settings: &Settings,
        parts: &Parts,
    ) -> Arc<Notify> {
        let wake = Arc::new(Notify::new());
        let machine_api: Api<Machine> =
            Api::namespaced(client.clone(), &settings.machines.namespace);
        let watch = |name: &'static str| (Arc::clone(&wake), synced(&self.health, name));
        let watches = [
            ("watch-machines", {
                let (wake, synced) = watch("watch-machines");
                let config = watcher::Config::default().labels(&settings.machines.selector);
                trigger(machine_api, config, wake, synced, self.cancel.clone()).boxed()
            }),
            ("watch-configmap", {
                let (wake, synced) = watch("watch-configmap");
                let config = watcher::Config::default()
                    .fields(&format!("metadata.name={}", endpoints::NAME));
                let api = parts.config_maps.clone();
                trigger(api, config, wake, synced, self.cancel.clone()).boxed()
            }),
            ("watch-pdb", {
                let (wake, synced) = watch("watch-pdb");
                let config = watcher::Config::default()
                    .fields(&format!("metadata.name={}", settings.guard.name));
                let api = parts.budgets.clone();
                trigger(api, config, wake, synced, self.cancel.clone()).boxed()
            }),
        ];
        for (name, fut) in watches {
            self.spawn(name, true, fut);
        }
        wake
    }

    /// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until the tasks stop; not a
    /// health-checked task: it is what answers the checks.
    fn serve_health(&self, listener: tokio::net::TcpListener, registry: Registry) {
        let state = HealthState {
            tasks: self.health.clone(),
            registry: Arc::new(registry),
        };
        let c = self.cancel.clone();
        self.tracker.spawn(async move {
            // The sidecar's server, limits included: a client holding connections open cannot
            // starve the kubelet's probes.
            let served = crate::server::serve(listener, health::router(state), c.clone()).await;
            if let Err(e) = served {
                warn!(error = %e, "serving health and metrics failed");
            }
        });
    }
}

/// Opens `name`'s readiness gate.
fn synced(health: &TaskHealth, name: &'static str) -> impl Fn() + Send + 'static {
    let health = health.clone();
    move || health.ready(name)
}

/// Resolves when this replica stops leading; `true` when the Lease task is gone (it will never
/// lead again).
async fn lost(leader: &mut watch::Receiver<bool>) -> bool {
    leader.wait_for(|l| !*l).await.is_err()
}

/// How a leader's wait was cut short.
enum Interrupted {
    /// Cancelled, or the Lease task is gone: the loop ends.
    Stop,
    /// The lease or ownership was lost: wait to lead again.
    Lost,
}

/// Resolves when `cancel` fires or this replica stops leading, warning with `undone` (what
/// losing the lease leaves undone).
async fn interrupted(
    cancel: &CancellationToken,
    leader: &mut watch::Receiver<bool>,
    undone: &str,
) -> Interrupted {
    tokio::select! {
        _ = cancel.cancelled() => Interrupted::Stop,
        gone = lost(leader) => {
            if gone {
                warn!("the Lease task is gone: not acting");
                Interrupted::Stop
            } else {
                warn!("lease or ownership lost: {undone}");
                Interrupted::Lost
            }
        }
    }
}

/// Reconciles while this replica leads, woken by `wake` or the resync period, until `cancel`
/// or until the Lease task is gone.
async fn reconcile_loop(
    parts: Parts,
    mut leader: watch::Receiver<bool>,
    wake: Arc<Notify>,
    cancel: CancellationToken,
) {
    let settings = &parts.settings;
    let timing = settings.timing;
    let backoff = crate::backoff::Backoff::new(timing.min_backoff, timing.max_backoff);
    let mut failures = 0u32;
    let mut failing_since = None;
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
                i = interrupted(&cancel, &mut leader, "reconcile cancelled, not acting") => match i {
                    Interrupted::Stop => break 'run,
                    Interrupted::Lost => continue 'run,
                },
                r = parts.reconcile() => r,
            };
            let wait = match result {
                Ok(true) => {
                    failures = 0;
                    failing_since = None;
                    Duration::from_millis(50)
                }
                Ok(false) => {
                    failures = 0;
                    failing_since = None;
                    timing.interval
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let retry_in = backoff.delay(failures);
                    warn!(error = %e, ?retry_in, "reconcile failed");
                    let since = *failing_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= resource::failures_reported_after(timing.max_backoff)
                        && *leader.borrow()
                    {
                        parts.write_failure(&e).await;
                    }
                    retry_in
                }
            };
            tokio::select! {
                i = interrupted(&cancel, &mut leader, "not acting") => match i {
                    Interrupted::Stop => break 'run,
                    Interrupted::Lost => continue 'run,
                },
                _ = wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// The ControlPlaneSet's settings taken from the quorum operator's (same namespace as its
/// Machines). Here rather than beside `SetSettings`, so the set's loop needs nothing of this
/// controller.
fn set_settings(s: &Settings) -> super::set_controller::SetSettings {
    super::set_controller::SetSettings {
        namespace: s.machines.namespace.clone(),
        peer_scheme: s.machines.peer_scheme.clone(),
        peer_port: s.machines.peer_port,
        interval: s.timing.interval,
        min_backoff: s.timing.min_backoff,
        max_backoff: s.timing.max_backoff,
        identity: s.identity.clone(),
        replacement: s.spec.replacement,
        // 20 times the retry cap: a minute with the defaults, a few seconds in tests.
        missing_type_max_wait: s.timing.max_backoff.saturating_mul(20),
    }
}
