//! The Kubernetes face (`[kubernetes]`): backups a user sees with `kubectl`.
//!
//! - [`resource`]: `EtcdSnapshot`, one object per full snapshot (in the operator's API group;
//!   `etcd-warden-operator crdgen` prints its definition with the operator's).
//! - [`inventory`]: the snapshot leader keeps those objects in step with the store.
//! - [`events`]: Events on the pod (and on an `EtcdSnapshot`) from the statuses the snapshot
//!   actor and the ownership watchdog publish, and from the Jobs.
//!
//! **Never on the safety path.** The face runs in its own task beside the sidecar's, reads what
//! the actor and the watchdog publish (watch channels, never waited on by them), and bounds
//! every request by `kubernetes.request_timeout`. The API down, slow or refusing delays no
//! snapshot, ownership check, kill or final; the inventory catches up at its next round. It is
//! not critical: its end is logged and never changes readiness.

pub mod events;
pub mod inventory;
pub mod resource;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::owner::watchdog::WatchdogStatus;
use crate::snapshot::actor::ActorStatus;
use crate::store::SnapshotStore;

pub use inventory::InventoryMetrics;

/// Starts the face configured by `[kubernetes]` (nothing without it): one task running the
/// inventory, the Events' derivation and their publisher, each until `cancel`.
pub async fn start(
    config: &Config,
    store: &SnapshotStore,
    actor: watch::Receiver<ActorStatus>,
    owner: Option<watch::Receiver<WatchdogStatus>>,
    metrics: InventoryMetrics,
    cancel: CancellationToken,
) -> Result<Option<tokio::task::JoinHandle<()>>, crate::kube_client::ClientError> {
    let Some(k) = &config.kubernetes else {
        return Ok(None);
    };
    // Building the client reads files only (kubeconfig, service account): nothing waits on the
    // API here.
    let client = crate::kube_client::client(k.kubeconfig.as_deref()).await?;
    let (notices, rx) = if k.events {
        let (n, rx) = events::channel();
        (n, Some(rx))
    } else {
        (events::Notices::off(), None)
    };
    let publisher = rx.map(|rx| {
        events::publish(
            rx,
            events::recorder(client.clone(), "etcd-warden", k),
            events::pod_reference(k),
            k.request_timeout,
            cancel.clone(),
        )
    });
    let follow = events::follow(actor.clone(), owner, notices.clone(), cancel.clone());
    let inventory = k.inventory.then(|| inventory::Inventory {
        api: kube::Api::namespaced(client.clone(), &k.namespace),
        config: k.clone(),
        store: store.clone(),
        retention: crate::store::gc::Retention {
            policy: config.snapshot.gc_policy,
            delta_retention: config.snapshot.delta_retention,
        },
        marks: inventory::Marks {
            recipients: inventory::fingerprints(
                &config
                    .encryption
                    .load_recipients()
                    .map(|rs| rs.iter().map(ToString::to_string).collect::<Vec<_>>())
                    .unwrap_or_default(),
            ),
            location: config.store.location.to_string(),
            ..inventory::Marks::default()
        },
        notices,
        metrics,
    });
    tracing::info!(namespace = %k.namespace, owner = %k.owner, inventory = k.inventory, events = k.events, "Kubernetes face: EtcdSnapshot inventory and Events");
    let token = cancel.clone();
    Ok(Some(tokio::spawn(async move {
        let inventory = async {
            if let Some(i) = inventory {
                i.run(actor, token.clone()).await;
            }
        };
        let publisher = async {
            if let Some(p) = publisher {
                p.await;
            }
        };
        tokio::join!(inventory, follow, publisher);
    })))
}
