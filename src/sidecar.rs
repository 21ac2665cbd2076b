//! `etcd-warden serve`: the snapshot actor, the readiness source and the HTTP API, assembled from
//! the validated configuration and stopped by one cancellation token.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::http::StatusCode;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Compression, Config};
use crate::owner::adapters::production_seams;
use crate::owner::metrics::OwnerMetrics;
use crate::owner::watchdog::{Watchdog, WatchdogConfig, WatchdogStatus};
use crate::server::{
    self, ApiError, Latest, Readiness, ServerState, SnapshotApi, StatusSource, Take,
};
use crate::snapshot::actor::{self, ActorConfig, ActorError, ActorHandle};
use crate::snapshot::engine::EtcdEngine;
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
    #[error("HTTP server: {0}")]
    Serve(std::io::Error),
    #[error("owner check: {0}")]
    Owner(#[from] crate::owner::resolve::ResolveError),
    #[error("initializing the data directory: {0}")]
    Initialize(#[from] crate::restore::RestoreError),
}

/// How long shutdown waits for tasks to finish (a snapshot upload in flight, open requests).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// The codec new snapshots are written with.
pub fn codec(c: Compression) -> Codec {
    match c {
        Compression::None => Codec::None,
        Compression::Gzip => Codec::Gzip,
        Compression::Zlib => Codec::Zlib,
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
        regular_at_start: config.owner.is_none(),
    }
}

/// The snapshot side of the HTTP API: reads from the store, snapshots through the actor.
struct Snapshots {
    actor: ActorHandle,
    store: SnapshotStore,
}

fn actor_error(e: ActorError) -> ApiError {
    match e {
        ActorError::Stopped => ApiError::unavailable("the sidecar is shutting down"),
        ActorError::Failed(m) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "snapshot_failed", m)
        }
    }
}

#[async_trait]
impl SnapshotApi for Snapshots {
    async fn latest(&self) -> Result<Latest, ApiError> {
        self.store.latest_chain().await.map_err(|e| {
            tracing::warn!(error = %e, "listing the store failed");
            ApiError::unavailable("the store cannot be listed")
        })
    }

    async fn take(&self, what: Take) -> Result<Option<Snapshot>, ApiError> {
        match what {
            Take::Full { is_final } => self
                .actor
                .full(is_final)
                .await
                .map(Some)
                .map_err(actor_error),
            Take::Delta => self.actor.delta().await.map_err(actor_error),
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

/// Keeps readiness at "etcd answers and has a leader" (a plain backup sidecar: no owner check).
async fn etcd_readiness(
    mut etcd: crate::etcd::RotatingClient,
    tx: watch::Sender<Readiness>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let mut client = etcd.client().await;
        let r = match tokio::time::timeout(Duration::from_secs(2), client.status()).await {
            Ok(Ok(s)) if s.leader() != 0 => Readiness {
                ready: true,
                state: "Active".into(),
                reason: "etcd is healthy".into(),
            },
            Ok(Ok(_)) => Readiness {
                ready: false,
                state: "Active".into(),
                reason: "etcd has no leader".into(),
            },
            Ok(Err(e)) => Readiness {
                ready: false,
                state: "Active".into(),
                reason: format!("etcd unreachable: {e}"),
            },
            Err(_) => Readiness {
                ready: false,
                state: "Active".into(),
                reason: "etcd did not answer within 2s".into(),
            },
        };
        tx.send_if_modified(|cur| {
            let changed = *cur != r;
            if changed {
                tracing::info!(ready = r.ready, reason = %r.reason, "readiness changed");
                *cur = r.clone();
            }
            changed
        });
    }
}

/// Runs the sidecar until `cancel` fires, then shuts down within [`SHUTDOWN_GRACE`].
pub async fn run(config: Config, cancel: CancellationToken) -> Result<(), SidecarError> {
    let store = SnapshotStore::from_config(&config.store)?;
    if config.restore.initialize {
        // Before anything talks to etcd: it may be waiting for its data directory.
        crate::restore::initialize::initialize(&store, &config.restore).await?;
    }
    let etcd = || crate::etcd::RotatingClient::connect(&config.etcd);
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .map_err(|source| SidecarError::Listen {
            addr: config.server.listen,
            source,
        })?;
    tracing::info!(listen = %listener.local_addr().map_err(SidecarError::Serve)?, store = %config.store.location, "etcd-warden serving");

    let mut registry = Registry::default();
    let actor_metrics = SnapshotMetrics::default();
    actor_metrics.register(&mut registry);

    let tasks = TaskTracker::new();
    let retention = Retention {
        policy: config.snapshot.gc_policy,
        delta_retention: config.snapshot.delta_retention,
    };
    let engine = EtcdEngine::new(
        etcd().await?,
        store.clone(),
        codec(config.snapshot.compression),
        retention,
    );
    let (actor, actor_task) = actor::spawn(
        engine,
        actor_config(&config),
        actor_metrics,
        cancel.child_token(),
    );

    let (readiness_tx, readiness) = watch::channel(Readiness::starting());
    let owner_status = match &config.owner {
        // A plain backup sidecar: ready while etcd is healthy.
        None => {
            tasks.spawn(etcd_readiness(
                etcd().await?,
                readiness_tx,
                cancel.child_token(),
            ));
            None
        }
        Some(owner) => {
            let owner_metrics = OwnerMetrics::default();
            owner_metrics.register(&mut registry);
            let seams = production_seams(
                owner,
                &config.kill,
                &config.etcd,
                actor.clone(),
                store.clone(),
                readiness_tx,
            )?;
            tracing::info!(record = %owner.name, id = %owner.id, interval = ?owner.interval, "checking ownership");
            let dog = Watchdog::new(WatchdogConfig::from_owner(owner), seams, owner_metrics);
            let status = dog.status();
            let token = cancel.child_token();
            tasks.spawn(async move {
                let last = dog.run(token).await;
                tracing::info!(state = %last, "ownership watchdog stopped");
            });
            Some(status)
        }
    };

    let state = ServerState {
        readiness,
        snapshots: Arc::new(Snapshots {
            actor: actor.clone(),
            store: store.clone(),
        }),
        status: Arc::new(Status {
            actor: actor.clone(),
            store: config.store.location.to_string(),
            owner: owner_status,
        }),
        registry: Arc::new(registry),
        token: config.server.token.clone(),
    };
    let router = server::router(state);
    let served = match config.server.tls.clone() {
        None => server::serve(listener, router, cancel.child_token()).await,
        Some((cert, key)) => {
            server::serve_tls(listener, router, cancel.child_token(), cert, key).await
        }
    };
    tasks.close();
    cancel.cancel();
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        let _ = actor_task.await;
        tasks.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "shutdown grace passed with tasks still running");
    }
    served.map_err(SidecarError::Serve)
}
