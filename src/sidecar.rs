//! `etcd-warden serve`: the snapshot actor, the readiness source and the HTTP API, assembled from
//! the validated configuration and stopped by one cancellation token.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::http::StatusCode;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::copy::secondary::{SecondaryMetrics, Sync};
use crate::health::HealthCheck;
use crate::owner::metrics::OwnerMetrics;
use crate::owner::production::context;
use crate::owner::watchdog::{Watchdog, WatchdogConfig, WatchdogStatus};
use crate::restore::initialize::InitializeMetrics;
use crate::server::{
    self, ApiError, Latest, Liveness, Readiness, ServerState, SnapshotApi, SnapshotRequest,
    StatusSource, StoreVersion,
};
use crate::snapshot::actor::{self, ActorConfig, ActorError, ActorHandle};
use crate::snapshot::engine::EtcdEngine;
use crate::snapshot::gate::Gate;
use crate::snapshot::metrics::SnapshotMetrics;
use crate::store::gc::Retention;
use crate::store::{Codec, Snapshot, SnapshotStore};

/// Why the sidecar could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("etcd: {0}")]
    Etcd(#[from] crate::etcd::EtcdError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    /// `[kubernetes]`'s client could not be built (its kubeconfig, or no service account).
    #[error("kubernetes: {0}")]
    Kubernetes(#[source] crate::kube_client::ClientError),
    /// `[store.secondary]` could not be set up (its URL or credentials).
    #[error("secondary store: {0}")]
    Secondary(String),
    #[error("HTTP server: {0}")]
    Serve(std::io::Error),
    #[error("owner check: {0}")]
    Owner(#[from] crate::owner::resolve::ResolveError),
    #[error("initializing the data directory: {0}")]
    Initialize(#[from] crate::restore::RestoreError),
    #[error("rejoining the cluster: {0}")]
    Rejoin(#[from] crate::restore::rejoin::RejoinError),
    /// `[druid]` asks for Leases and no Kubernetes client can be built (no in-cluster service
    /// account, no kubeconfig).
    #[error("a Kubernetes client for the druid Leases: {0}")]
    Kube(#[source] kube::Error),
    /// A task the sidecar cannot run without ended: readiness went 503 and the process exits so
    /// the kubelet restarts it.
    #[error("critical task {task} {how}; etcd made unready and the sidecar stops")]
    TaskEnded {
        /// Which task.
        task: &'static str,
        /// "panicked: …" or "ended".
        how: String,
    },
}

/// How long shutdown waits for tasks to finish (a snapshot upload in flight, open requests).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// Every metric `serve` exposes, registered in one place, so the docs, the alert rules and the
/// dashboard can be checked against what the binary really exposes.
#[derive(Clone, Debug, Default)]
pub struct SidecarMetrics {
    /// The snapshot actor's (`etcdbr_…`, `etcd_warden_snapshot_…`).
    pub snapshot: SnapshotMetrics,
    /// `restore.initialize`'s validation and restore durations.
    pub initialize: InitializeMetrics,
    /// The store's restore drill record (`etcd_warden_restore_drill_…`).
    pub drill: crate::restore::drill::DrillMetrics,
    /// The ownership watchdog's, with ownership checks (`[owner]`) only.
    pub owner: Option<OwnerMetrics>,
    /// The secondary store's sync, with `[store.secondary]` only.
    pub secondary: Option<SecondaryMetrics>,
    /// The `EtcdSnapshot` inventory's, with `[kubernetes]` only.
    pub kubernetes: Option<crate::kubernetes::InventoryMetrics>,
}

impl SidecarMetrics {
    /// The metrics of a sidecar with or without ownership checks.
    pub fn new(with_owner: bool) -> Self {
        SidecarMetrics {
            owner: with_owner.then(OwnerMetrics::default),
            ..Default::default()
        }
    }

    /// The metrics of a sidecar configured by `config`.
    pub fn for_config(config: &Config) -> Self {
        SidecarMetrics {
            secondary: config
                .secondary
                .as_ref()
                .map(|_| SecondaryMetrics::default()),
            kubernetes: config
                .kubernetes
                .as_ref()
                .map(|_| crate::kubernetes::InventoryMetrics::default()),
            ..Self::new(config.owner.is_some())
        }
    }

    /// Registers all of them.
    pub fn register(&self, registry: &mut Registry) {
        self.snapshot.register(registry);
        self.initialize.register(registry);
        self.drill.register(registry);
        if let Some(owner) = &self.owner {
            owner.register(registry);
        }
        if let Some(secondary) = &self.secondary {
            secondary.register(registry);
        }
        if let Some(kubernetes) = &self.kubernetes {
            kubernetes.register(registry);
        }
    }
}

/// The actor's schedule from configuration.
pub fn actor_config(config: &Config) -> ActorConfig {
    let s = &config.snapshot;
    ActorConfig {
        schedule: s.schedule.clone(),
        delta_period: s.delta_period,
        delta_memory_limit: s.delta_memory_limit,
        gc_period: s.gc_period,
        leader_check_interval: s.leader_check_interval,
        timeout: s.timeout,
        defrag: config.defrag.clone(),
    }
}

/// The snapshot side of the HTTP API: reads from the store, snapshots through the actor, finals
/// only as the ownership watchdog took them.
struct Snapshots {
    actor: ActorHandle,
    store: SnapshotStore,
    gate: watch::Receiver<Gate>,
    owner: Option<watch::Receiver<WatchdogStatus>>,
}

fn actor_error(e: ActorError) -> ApiError {
    match e {
        ActorError::Stopped => ApiError::unavailable("the sidecar is shutting down"),
        ActorError::Refused { gate, reason } => ApiError::new(
            StatusCode::CONFLICT,
            if gate == Gate::Final {
                "deactivated"
            } else {
                "not_active"
            },
            reason,
        ),
        ActorError::Cancelled => ApiError::new(
            StatusCode::CONFLICT,
            "cancelled",
            "ownership changed while the snapshot ran; nothing was stored",
        ),
        ActorError::NoDeltas => ApiError::new(StatusCode::CONFLICT, "no_deltas", e.to_string()),
        ActorError::Unhealthy { .. } => ApiError::unavailable(e.to_string()),
        ActorError::Failed(err) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "snapshot_failed",
            err.to_string(),
        ),
    }
}

impl Snapshots {
    /// `POST /snapshot/full?final=true`: never takes a snapshot itself (the hand-off's final is
    /// the watchdog's, after every member is fenced); answers with the hand-off's final once it
    /// is stored, 409 before.
    async fn hand_off_final(&self) -> Result<Option<Snapshot>, ApiError> {
        if *self.gate.borrow() != Gate::Final {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "not_deactivated",
                "a final snapshot is only taken after ownership is lost (Deactivated)",
            ));
        }
        let status = self.owner.as_ref().map(|o| o.borrow().clone());
        let Some(name) = status.as_ref().and_then(|s| s.final_snapshot.clone()) else {
            let reason = status.map(|s| s.reason).unwrap_or_default();
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "final_pending",
                format!("the hand-off's final snapshot is not stored yet: {reason}"),
            ));
        };
        let list = self.store.list().await.map_err(|e| {
            tracing::warn!(error = %e, "listing the store failed");
            ApiError::unavailable("the store cannot be listed")
        })?;
        list.into_iter()
            .find(|s| s.snap_name == name)
            .map(Some)
            .ok_or_else(|| ApiError::unavailable(format!("{name} is not listed in the store")))
    }
}

#[async_trait]
impl SnapshotApi for Snapshots {
    async fn latest(&self) -> Result<Latest, ApiError> {
        // Planted (`crate::plant`): `isFinal` as the listing's names say, reclaimed or not.
        if crate::plant::active("latest-reclaimed-final") {
            return self.store.latest_chain().await.map_err(|e| {
                tracing::warn!(error = %e, "listing the store failed");
                ApiError::unavailable("the store cannot be listed")
            });
        }
        // `isFinal` as every reader decides it: a reclaimed or superseded final is a plain full
        // snapshot here, so a flow polling for the final never takes an old one.
        crate::owner::handoff::HandOffObjects::new(self.store.clone())
            .latest_chain()
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "listing the store failed");
                ApiError::unavailable("the store cannot be listed")
            })
    }

    fn version(&self) -> StoreVersion {
        // The actor counts what it stored (the final too, before the watchdog hears of it); the
        // watchdog names a final another member's sidecar stored, so a flow that read
        // `owner.finalSnapshot` in `/status` finds it here next.
        StoreVersion {
            changes: self.actor.store_changes(),
            final_snapshot: self
                .owner
                .as_ref()
                .and_then(|o| o.borrow().final_snapshot.clone()),
        }
    }

    async fn take(&self, what: SnapshotRequest) -> Result<Option<Snapshot>, ApiError> {
        match what {
            SnapshotRequest::Full { is_final: true } => self.hand_off_final().await,
            SnapshotRequest::Full { is_final: false } => {
                // Marked as requested by the actor before it answers: retention counts it
                // apart from the scheduled ones, so requests (open to anyone under
                // etcd-druid) cannot push scheduled history out.
                let snap = self.actor.full().await.map_err(actor_error)?;
                Ok(Some(snap))
            }
            // etcd-druid's requested final: once this member is handed off, the hand-off's
            // own final answers it (it holds every acknowledged write, and nothing else may
            // be snapshotted then); before, a full snapshot taken now, marked druid's.
            SnapshotRequest::RequestedFinal if *self.gate.borrow() == Gate::Final => {
                self.hand_off_final().await
            }
            SnapshotRequest::RequestedFinal => self
                .actor
                .requested_final()
                .await
                .map(Some)
                .map_err(actor_error),
            SnapshotRequest::Delta => self.actor.delta().await.map_err(actor_error),
        }
    }
}

struct Status {
    actor: ActorHandle,
    store: String,
    owner: Option<watch::Receiver<WatchdogStatus>>,
}

impl StatusSource for Status {
    fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "store": self.store,
            "owner": self.owner.as_ref().map(|o| o.borrow().clone()),
            "snapshotter": self.actor.status(),
        })
    }
}

/// A task the sidecar cannot do without, by name.
type Critical = (&'static str, tokio::task::JoinHandle<()>);

/// The first critical task to end, and how.
async fn first_to_end(tasks: &mut [Critical]) -> (&'static str, String) {
    let (result, i, _) =
        futures::future::select_all(tasks.iter_mut().map(|(_, handle)| handle)).await;
    (tasks[i].0, ended(result))
}

/// Waits for every critical task (after they were told to stop).
async fn join_all(tasks: &mut [Critical]) {
    for (_, handle) in tasks.iter_mut() {
        if !handle.is_finished() {
            let _ = handle.await;
        }
    }
}

/// A critical task ended: etcd unready and the sidecar not live, with the reason, so probes say
/// why while the process stops.
fn fail_closed(
    readiness: &watch::Sender<Readiness>,
    liveness: &watch::Sender<Liveness>,
    task: &str,
    how: &str,
) {
    tracing::error!(task, %how, "a critical task ended; etcd made unready, stopping");
    let reason = format!("critical task {task} {how}");
    server::set_readiness(readiness, false, server::FAILED, &reason);
    liveness.send_replace(Some(reason));
}

/// Waits (within [`SHUTDOWN_GRACE`]) for the tasks that are not critical after their token was
/// cancelled; a secondary's copy in flight is dropped, and a multipart upload dropped is never
/// completed.
async fn stop_helpers(tasks: Vec<tokio::task::JoinHandle<()>>) {
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, futures::future::join_all(tasks)).await;
}

/// How a critical task ended.
fn ended(result: Result<(), tokio::task::JoinError>) -> String {
    match result {
        Ok(()) => "ended".into(),
        Err(e) if e.is_panic() => {
            let payload = e.into_panic();
            let text = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            format!("panicked: {text}")
        }
        Err(e) => format!("was cancelled: {e}"),
    }
}

/// The operator's `EtcdQuorum` as the sidecar reads it: untyped, by its group, version and
/// kind (deploy/operator/crds.yaml), so that the sidecar never depends on the operator's code.
const QUORUM_GROUP: &str = "etcd-warden.io";
const QUORUM_VERSION: &str = "v1alpha1";
const QUORUM_KIND: &str = "EtcdQuorum";
const QUORUM_PLURAL: &str = "etcdquorums";
/// The one `EtcdQuorum` object's name.
const QUORUM_NAME: &str = "cluster";

/// Whether the `EtcdQuorum` `quorum` (as JSON) asks for this member to be rebuilt now: its spec
/// names `machine` as the survivor and the operator accepted that request (status phase
/// `WaitingForRebuild` for the same survivor: quorum was lost when it judged it). Pure.
pub fn rebuild_requested(quorum: &serde_json::Value, machine: &str) -> bool {
    let asked = quorum["spec"]["quorumRestore"]["survivor"].as_str() == Some(machine);
    let status = &quorum["status"]["quorumRestore"];
    let accepted = status["survivor"].as_str() == Some(machine)
        && status["phase"].as_str() == Some("WaitingForRebuild");
    asked && accepted
}

/// Before etcd starts (`quorum_restore.machine` set, not under druid): carries out the
/// operator's quorum restore request naming this member's Machine on `restore.data_dir`.
/// Returns whether it rebuilt. Not rebuilding is the safe side, so an unreadable request, a
/// refusal or a failure is logged and etcd starts on its directory as it was (a refusal and a
/// failure overwrite nothing); a running etcd makes the rebuild refuse (its lock, its URLs).
async fn rebuild_if_requested(config: &Config, store: &SnapshotStore) -> bool {
    use crate::restore::quorum::{QuorumOptions, StoreCheck, quorum_restore};
    let q = &config.quorum_restore;
    let Some(machine) = q.machine.as_deref() else {
        return false;
    };
    let read = async {
        let client = crate::kube_client::client(q.kubeconfig.as_deref())
            .await
            .map_err(|e| e.to_string())?;
        let gvk = kube::api::GroupVersionKind::gvk(QUORUM_GROUP, QUORUM_VERSION, QUORUM_KIND);
        let resource = kube::api::ApiResource::from_gvk_with_plural(&gvk, QUORUM_PLURAL);
        let found =
            kube::Api::<kube::api::DynamicObject>::namespaced_with(client, &q.namespace, &resource)
                .get_opt(QUORUM_NAME)
                .await
                .map_err(|e| e.to_string())?;
        found
            .map(|o| serde_json::to_value(o).map_err(|e| e.to_string()))
            .transpose()
    };
    let quorum = match read.await {
        Ok(found) => found,
        Err(e) => {
            tracing::error!(error = %e, namespace = %q.namespace, "cannot read the EtcdQuorum for a quorum restore request; starting etcd as it is");
            return false;
        }
    };
    if !quorum.is_some_and(|found| rebuild_requested(&found, machine)) {
        tracing::debug!(%machine, "no accepted quorum restore request names this machine");
        return false;
    }
    let Some(data_dir) = config.restore.data_dir.clone() else {
        tracing::error!(%machine, "a quorum restore is requested for this machine but restore.data_dir is not set; starting etcd as it is");
        return false;
    };
    tracing::warn!(%machine, data_dir = %data_dir.display(), lost_for = ?q.lost_for, "a quorum restore is requested for this machine: rebuilding before etcd starts");
    let opts = QuorumOptions {
        data_dir,
        survivors: Vec::new(),
        name: None,
        initial_advertise_peer_urls: None,
        initial_cluster_token: config.restore.initial_cluster_token.clone(),
        etcd_bin: config.restore.etcd_bin.clone(),
        lost_for: q.lost_for,
        probe_interval: q.probe_interval,
        bump: crate::restore::RevisionBump {
            by: config.restore.bump_revision,
            mark_compacted: config.restore.mark_compacted,
        },
        force: false,
    };
    let check = StoreCheck {
        store,
        location: config.store.location.to_string(),
        owner_record: config
            .owner
            .as_ref()
            .map_or_else(String::new, |o| o.name.clone()),
    };
    match quorum_restore(&opts, Some(check)).await {
        Ok(report) => {
            tracing::warn!(
                %machine,
                member = %report.chosen_member,
                committed = report.committed,
                revision = report.revision,
                dropped = %report.dropped.join(", "),
                kept_at = %report.kept_at.display(),
                store_would_lose = ?report.store_would_lose(),
                "quorum restored: etcd starts as a one-member cluster; the operator grows it back"
            );
            true
        }
        Err(e) => {
            tracing::error!(%machine, error = %e, "the requested quorum restore did not run; nothing changed, etcd starts on its directory as it was");
            false
        }
    }
}

/// Runs the sidecar until `cancel` fires, then shuts down within [`SHUTDOWN_GRACE`]. A critical
/// task (the snapshot actor, the ownership watchdog or the readiness loop, the druid Leases)
/// that ends or panics before that turns `/healthz` and `/livez` 503, stops everything and
/// returns [`SidecarError::TaskEnded`], so the process exits non-zero and is restarted.
///
/// What it starts, in order: the data directory ([`prepare_data_dir`]), the listener, the
/// snapshot actor ([`start_snapshot_actor`]), readiness or the ownership watchdog
/// ([`start_guard`]), the secondary's sync ([`start_secondary_sync`]), the HTTP API
/// ([`api_router`], with etcd-druid's routes and Leases by [`with_druid`]); then it supervises
/// them ([`supervise`]).
pub async fn run(config: Config, cancel: CancellationToken) -> Result<(), SidecarError> {
    let store = SnapshotStore::from_config(&config.store)?
        .with_encryption(config.encryption.clone())
        .with_compression_level(config.snapshot.compression_level)
        .with_read_limits(config.restore.read_limits);
    let metrics = SidecarMetrics::for_config(&config);
    let Prepared::Ready { secondary } =
        prepare_data_dir(&config, &store, &metrics, &cancel).await?
    else {
        return Ok(());
    };
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .map_err(|source| SidecarError::Listen {
            addr: config.server.listen,
            source,
        })?;
    tracing::info!(listen = %listener.local_addr().map_err(SidecarError::Serve)?, store = %config.store.location, "etcd-warden serving");

    // Without ownership checks the gate is open for good; with them the watchdog opens it.
    let (gate_tx, gate_rx) = watch::channel(if config.owner.is_none() {
        Gate::Open
    } else {
        Gate::Closed
    });
    let tasks = cancel.child_token();
    let (actor, actor_task) =
        start_snapshot_actor(&config, &store, gate_rx.clone(), &metrics, &tasks).await?;
    let (readiness_tx, readiness) = watch::channel(Readiness::starting());
    let readiness_tx = Arc::new(readiness_tx);
    let (owner_status, guard_task) = start_guard(
        &config,
        &store,
        &actor,
        &readiness_tx,
        gate_tx,
        &metrics,
        &tasks,
    )?;
    let mut helpers: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    helpers.extend(start_secondary_sync(&config, &metrics, &tasks)?);
    helpers.extend(
        crate::kubernetes::start(
            &config,
            &store,
            actor.watch_status(),
            owner_status.clone(),
            metrics.kubernetes.clone().unwrap_or_default(),
            tasks.child_token(),
        )
        .await
        .map_err(SidecarError::Kubernetes)?,
    );
    let mut critical = vec![("snapshot actor", actor_task), guard_task];

    let (liveness_tx, liveness) = watch::channel::<Liveness>(None);
    let api = Api {
        actor: &actor,
        store: &store,
        gate: gate_rx,
        owner: owner_status,
        readiness,
        liveness,
    };
    let mut router = api_router(&config, &metrics, api);
    if let Some(druid) = &config.druid {
        let leases;
        (router, leases) = with_druid(
            &config,
            druid,
            router,
            (&store, secondary, &actor),
            &metrics,
            &cancel,
            &tasks,
        )
        .await?;
        critical.extend(leases);
    }
    let server_cancel = cancel.child_token();
    let served = serve(&config, listener, router, server_cancel.clone());
    supervise(
        Supervised {
            critical,
            helpers,
            readiness: readiness_tx,
            liveness: liveness_tx,
            tasks,
            server: server_cancel,
            cancel,
        },
        served,
    )
    .await
}

/// How the data directory's preparation ended.
// Made once per run: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Prepared {
    /// Stopped (SIGTERM) during a rejoin: nothing else was started.
    Stopped,
    /// Ready for etcd; `secondary` is `[store.secondary]`'s store, when configured.
    Ready { secondary: Option<SnapshotStore> },
}

/// Before anything talks to etcd: it may be waiting for its data directory. A lost member of a
/// running multi-member cluster rejoins it (restore::rejoin); otherwise the store. A rejoin
/// stops on SIGTERM (its temporary member with it); nothing else has started. Under
/// etcd-druid, etcd-wrapper asks for the initialization over HTTP (crate::druid) before it
/// starts etcd; it does not run here.
async fn prepare_data_dir(
    config: &Config,
    store: &SnapshotStore,
    metrics: &SidecarMetrics,
    cancel: &CancellationToken,
) -> Result<Prepared, SidecarError> {
    // First, an operator's quorum restore request naming this member (etcd is not running yet:
    // it starts after this sidecar answers /livez).
    if config.druid.is_none() {
        rebuild_if_requested(config, store).await;
    }
    let initialize_now = config.restore.initialize && config.druid.is_none();
    let rejoined = if initialize_now {
        match crate::restore::rejoin::rejoin_if_lost(
            &config.restore,
            &metrics.initialize,
            store,
            cancel,
        )
        .await
        {
            Err(crate::restore::rejoin::RejoinError::Cancelled) => return Ok(Prepared::Stopped),
            r => r?,
        }
    } else {
        false
    };
    let secondary = crate::restore::initialize::secondary_store(config)?;
    if initialize_now && !rejoined {
        crate::restore::initialize::initialize_from(
            store,
            secondary.as_ref(),
            &config.restore,
            &metrics.initialize,
        )
        .await?;
    }
    Ok(Prepared::Ready { secondary })
}

/// Retention as `[snapshot]` configures it, for the actor and the secondary alike.
fn retention(config: &Config) -> Retention {
    Retention {
        policy: config.snapshot.gc_policy,
        delta_retention: config.snapshot.delta_retention,
    }
}

/// The snapshot actor (critical), on a client of `[etcd]` that follows certificate rotation.
async fn start_snapshot_actor(
    config: &Config,
    store: &SnapshotStore,
    gate: watch::Receiver<Gate>,
    metrics: &SidecarMetrics,
    tasks: &CancellationToken,
) -> Result<(ActorHandle, tokio::task::JoinHandle<()>), SidecarError> {
    let engine = EtcdEngine::new(
        crate::etcd::RotatingClient::connect(&config.etcd).await?,
        store.clone(),
        Codec::from(config.snapshot.compression),
        retention(config),
    );
    Ok(actor::spawn(
        engine,
        actor_config(config),
        gate,
        metrics.snapshot.clone(),
        tasks.child_token(),
    ))
}

/// What sets readiness (critical): a plain backup sidecar follows etcd's health; with `[owner]`
/// the ownership watchdog does, and opens the snapshot gate. The watchdog's status is returned
/// for the API.
fn start_guard(
    config: &Config,
    store: &SnapshotStore,
    actor: &ActorHandle,
    readiness: &Arc<watch::Sender<Readiness>>,
    gate: watch::Sender<Gate>,
    metrics: &SidecarMetrics,
    tasks: &CancellationToken,
) -> Result<(Option<watch::Receiver<WatchdogStatus>>, Critical), SidecarError> {
    let token = tasks.child_token();
    let Some(owner) = &config.owner else {
        let check = HealthCheck::new(config.etcd.clone(), crate::health::TIMEOUT);
        let tx = readiness.clone();
        let task = tokio::spawn(async move {
            crate::health::follow_etcd(check, &tx, token).await;
        });
        return Ok((None, ("readiness", task)));
    };
    let ctx = context(
        owner,
        &config.kill,
        &config.etcd,
        actor.clone(),
        store.clone(),
        Codec::from(config.snapshot.compression),
        (**readiness).clone(),
        gate,
        config.restore.data_dir.clone(),
    )?;
    tracing::info!(record = %owner.name, id = %owner.id, interval = ?owner.interval, "checking ownership");
    let dog = Watchdog::new(
        WatchdogConfig::from_config(owner, &config.kill),
        ctx,
        metrics.owner.clone().unwrap_or_default(),
    );
    let status = dog.status();
    let task = tokio::spawn(async move {
        let last = dog.run(token).await;
        tracing::info!(state = %last, "ownership watchdog stopped");
    });
    Ok((Some(status), ("ownership watchdog", task)))
}

/// The secondary store's sync, with `[store.secondary]`. Not critical: a failing secondary
/// shows in its metrics and alert, never in readiness, and never stops the sidecar (it would
/// take etcd's readiness and the primary with it). It is still tracked, so shutdown waits for
/// it.
fn start_secondary_sync(
    config: &Config,
    metrics: &SidecarMetrics,
    tasks: &CancellationToken,
) -> Result<Option<tokio::task::JoinHandle<()>>, SidecarError> {
    let Some(secondary) = &config.secondary else {
        return Ok(None);
    };
    let sync = Sync::new(
        &config.store,
        secondary.clone(),
        retention(config),
        metrics.secondary.clone().unwrap_or_default(),
    )
    .map_err(|e| SidecarError::Secondary(e.to_string()))?
    .with_read_limits(config.restore.read_limits);
    let token = tasks.child_token();
    Ok(Some(tokio::spawn(async move { sync.run(token).await })))
}

/// What the HTTP API reads: the actor, the store, the gate, the watchdog's status, and the
/// probes' sources.
struct Api<'a> {
    actor: &'a ActorHandle,
    store: &'a SnapshotStore,
    gate: watch::Receiver<Gate>,
    owner: Option<watch::Receiver<WatchdogStatus>>,
    readiness: watch::Receiver<Readiness>,
    liveness: watch::Receiver<Liveness>,
}

/// The HTTP API's routes, with every metric registered.
fn api_router(config: &Config, metrics: &SidecarMetrics, api: Api<'_>) -> axum::Router {
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let state = ServerState {
        readiness: api.readiness,
        snapshots: Arc::new(Snapshots {
            actor: api.actor.clone(),
            store: api.store.clone(),
            gate: api.gate,
            owner: api.owner.clone(),
        }),
        latest: server::LatestCache::new(server::max_age(config.snapshot.delta_period)),
        status: Arc::new(Status {
            actor: api.actor.clone(),
            store: config.store.location.to_string(),
            owner: api.owner,
        }),
        registry: Arc::new(registry),
        drill: Some((api.store.clone(), metrics.drill.clone())),
        token: config.server.token.clone(),
        unauthenticated_snapshots: config.server.unauthenticated_snapshots,
        client_certs: config.server.client_ca.is_some() && config.server.tls.is_some(),
        ebr_answers: config.druid.is_some(),
        liveness: api.liveness,
        mutating: Arc::new(tokio::sync::Semaphore::new(1)),
    };
    server::router(state)
}

/// Under etcd-druid: etcd-wrapper's initialization endpoints and `/config` beside `router`,
/// snapshot triggers forwarded to the leader's sidecar, and the Leases druid reads (critical,
/// returned with their name).
async fn with_druid(
    config: &Config,
    druid: &crate::config::DruidConfig,
    router: axum::Router,
    (store, secondary, actor): (&SnapshotStore, Option<SnapshotStore>, &ActorHandle),
    metrics: &SidecarMetrics,
    cancel: &CancellationToken,
    tasks: &CancellationToken,
) -> Result<(axum::Router, Vec<Critical>), SidecarError> {
    tracing::info!(etcd_config = %druid.etcd_config.display(), pod = ?druid.pod_name, "serving etcd-wrapper's initialization endpoints and /config (etcd-druid)");
    let api = crate::druid::Druid::new(
        druid.clone(),
        config.restore.clone(),
        store.clone(),
        secondary,
        metrics.initialize.clone(),
        cancel.clone(),
    );
    // Snapshot triggers reaching a follower go to the leader's sidecar (druid calls them
    // through a Service that picks any pod).
    let forwarder = crate::druid::forward::Forwarder {
        leadership: Arc::new(crate::druid::forward::EtcdLeadership {
            etcd: config.etcd.clone(),
        }),
        port: config.server.listen.port(),
        scheme: if config.server.tls.is_some() {
            "https"
        } else {
            "http"
        },
        http: crate::druid::forward::client(
            config.etcd.tls.as_ref().and_then(|t| t.ca_file.as_deref()),
            config.snapshot.timeout,
        )
        .map_err(|e| {
            SidecarError::Serve(std::io::Error::other(format!(
                "a client for the leader's sidecar: {e}"
            )))
        })?,
    };
    let router = router.layer(axum::middleware::from_fn_with_state(
        forwarder,
        crate::druid::forward::forward_to_leader,
    ));
    let callers = server::PodCallers {
        token: config.server.token.clone(),
    };
    let router = crate::druid::routes(api.clone(), callers).merge(router);
    if !(druid.member_lease || druid.snapshot_leases) {
        return Ok((router, Vec::new()));
    }
    let kube = kube::Client::try_default()
        .await
        .map_err(SidecarError::Kube)?;
    let leases = crate::druid::Leases {
        druid: api,
        etcd: config.etcd.clone(),
        kube,
        actor: actor.watch_status(),
        period: if config.snapshot.delta_period.is_zero() {
            Duration::from_secs(60)
        } else {
            config.snapshot.delta_period
        },
    };
    let critical = leases
        .spawn(tasks.child_token())
        .into_iter()
        .map(|t| ("druid Leases", t))
        .collect();
    Ok((router, critical))
}

/// The HTTP server on `listener` with `[server]`'s TLS and limits, until `token` fires.
fn serve(
    config: &Config,
    listener: tokio::net::TcpListener,
    router: axum::Router,
    token: CancellationToken,
) -> impl std::future::Future<Output = std::io::Result<()>> {
    let limits = server::Limits {
        header_read_timeout: config.server.header_read_timeout,
        request_timeout: config.server.request_timeout,
        snapshot_request_timeout: config.snapshot.timeout + Duration::from_secs(60),
        idle_timeout: config.server.idle_timeout,
        max_connections: config.server.max_connections,
        max_body_bytes: config.server.max_body_bytes,
    };
    server::raise_fd_limit(&limits);
    let tls = config
        .server
        .tls
        .clone()
        .map(|(cert, key)| server::ServerTls {
            cert,
            key,
            client_ca: config.server.client_ca.clone(),
        });
    server::serve_with(listener, router, token, limits, tls)
}

/// What [`supervise`] watches and stops.
struct Supervised {
    critical: Vec<Critical>,
    /// Tasks that are not critical (the secondary's sync, the Kubernetes face): waited for at
    /// shutdown, never judged.
    helpers: Vec<tokio::task::JoinHandle<()>>,
    readiness: Arc<watch::Sender<Readiness>>,
    liveness: watch::Sender<Liveness>,
    /// The tasks' parent token.
    tasks: CancellationToken,
    /// The server's token.
    server: CancellationToken,
    /// The sidecar's root token.
    cancel: CancellationToken,
}

/// Runs until the server or a critical task ends. Shutdown (the root token) stops everything
/// within [`SHUTDOWN_GRACE`]; a critical task that ends otherwise fails closed ([`fail_closed`]:
/// readiness 503 before anything else stops) and is returned as [`SidecarError::TaskEnded`].
async fn supervise(
    mut s: Supervised,
    served: impl std::future::Future<Output = std::io::Result<()>>,
) -> Result<(), SidecarError> {
    tokio::pin!(served);
    // Whichever ends first: the server (shutdown, or an error), or a critical task (a failure,
    // unless shutdown was asked for).
    let (task, how) = tokio::select! {
        result = &mut served => {
            s.tasks.cancel();
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, join_all(&mut s.critical)).await;
            stop_helpers(s.helpers).await;
            return result.map_err(SidecarError::Serve);
        }
        died = first_to_end(&mut s.critical) => died,
    };
    if s.cancel.is_cancelled() {
        // Shutting down: the tasks ended because they were told to.
        let _ = tokio::time::timeout(SHUTDOWN_GRACE, served).await;
        stop_helpers(s.helpers).await;
        return Ok(());
    }
    fail_closed(&s.readiness, &s.liveness, task, &how);
    s.tasks.cancel();
    // Let probes see the 503 for a moment while the rest stops.
    let _ = tokio::time::timeout(Duration::from_secs(2), join_all(&mut s.critical)).await;
    s.server.cancel();
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, served).await;
    stop_helpers(s.helpers).await;
    Err(SidecarError::TaskEnded { task, how })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_critical_task_fails_closed() {
        let (readiness_tx, readiness) = watch::channel(Readiness {
            ready: true,
            state: "Active".into(),
            reason: "owner, etcd healthy".into(),
        });
        let (liveness_tx, liveness) = watch::channel::<Liveness>(None);
        let forever = tokio::spawn(std::future::pending::<()>());
        let doomed = tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            panic!("injected failure");
        });
        let mut critical = vec![("snapshot actor", forever), ("ownership watchdog", doomed)];
        let (task, how) = first_to_end(&mut critical).await;
        assert_eq!(task, "ownership watchdog");
        assert_eq!(how, "panicked: injected failure");
        fail_closed(&readiness_tx, &liveness_tx, task, &how);
        assert!(!readiness.borrow().ready);
        assert!(
            readiness
                .borrow()
                .reason
                .contains("ownership watchdog panicked")
        );
        assert_eq!(
            liveness.borrow().as_deref(),
            Some("critical task ownership watchdog panicked: injected failure")
        );
        critical[0].1.abort();
    }

    #[test]
    fn only_an_accepted_request_naming_this_machine_rebuilds() {
        let quorum = |asked: Option<&str>, status: Option<(&str, &str)>| {
            serde_json::json!({
                "apiVersion": "etcd-warden.io/v1alpha1",
                "kind": "EtcdQuorum",
                "metadata": {"name": "cluster"},
                "spec": {"quorumRestore": asked.map(|s| serde_json::json!({"survivor": s}))},
                "status": {"quorumRestore": status.map(|(s, p)| serde_json::json!({"survivor": s, "phase": p}))},
            })
        };
        assert!(rebuild_requested(
            &quorum(Some("cp-0"), Some(("cp-0", "WaitingForRebuild"))),
            "cp-0"
        ));
        // Another machine; not yet judged; refused; already rebuilt; judged for an older
        // request; the request withdrawn.
        for q in [
            quorum(Some("cp-1"), Some(("cp-1", "WaitingForRebuild"))),
            quorum(Some("cp-0"), None),
            quorum(Some("cp-0"), Some(("cp-0", "Refused"))),
            quorum(Some("cp-0"), Some(("cp-0", "GrowingBack"))),
            quorum(Some("cp-0"), Some(("cp-1", "WaitingForRebuild"))),
            quorum(None, Some(("cp-0", "WaitingForRebuild"))),
        ] {
            assert!(!rebuild_requested(&q, "cp-0"), "{q:?}");
        }
    }

    /// The names the sidecar reads the `EtcdQuorum` by are the operator's CRD's, and the status
    /// the operator writes for an accepted request is what the sidecar acts on.
    #[test]
    fn the_untyped_quorum_request_matches_the_operators_resource() {
        use crate::operator::quorum::request::RestorePhase;
        use crate::operator::quorum::resource::{
            EtcdQuorum, EtcdQuorumSpec, EtcdQuorumStatus, NAME, QuorumRestoreSpec,
            QuorumRestoreStatus,
        };
        use kube::Resource;
        assert_eq!(EtcdQuorum::group(&()), QUORUM_GROUP);
        assert_eq!(EtcdQuorum::version(&()), QUORUM_VERSION);
        assert_eq!(EtcdQuorum::kind(&()), QUORUM_KIND);
        assert_eq!(EtcdQuorum::plural(&()), QUORUM_PLURAL);
        assert_eq!(NAME, QUORUM_NAME);
        let mut q = EtcdQuorum::new(
            NAME,
            EtcdQuorumSpec {
                quorum_restore: Some(QuorumRestoreSpec {
                    survivor: "cp-0".into(),
                }),
            },
        );
        q.status = Some(EtcdQuorumStatus {
            quorum_restore: Some(QuorumRestoreStatus::new(
                "cp-0",
                &RestorePhase::WaitingForRebuild,
            )),
            ..EtcdQuorumStatus::default()
        });
        let json = serde_json::to_value(&q).unwrap();
        assert!(rebuild_requested(&json, "cp-0"), "{json}");
    }

    #[tokio::test]
    async fn a_task_that_returns_is_an_ended_critical_task_too() {
        let mut critical = vec![
            ("readiness", tokio::spawn(async {})),
            ("snapshot actor", tokio::spawn(std::future::pending::<()>())),
        ];
        assert_eq!(
            first_to_end(&mut critical).await,
            ("readiness", "ended".into())
        );
        critical[1].1.abort();
    }
}
