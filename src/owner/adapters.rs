//! The watchdog's seams implemented over the rest of the crate: the snapshot actor and store,
//! the etcd client, and the HTTP server's readiness and status.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, watch};

use super::resolve::{OwnerResolver, ResolveError};
use super::watchdog::{EtcdHealth, ReadinessSink, SeamError, Seams, Snapshotter, WatchdogStatus};
use crate::config::{EtcdConfig, KillConfig, OwnerConfig};
use crate::process::ProcKiller;
use crate::server::{Readiness, StatusSource};
use crate::snapshot::actor::ActorHandle;
use crate::store::SnapshotStore;

/// The snapshot side: regular work and final snapshots through the one snapshot actor, the
/// "already final?" question answered from the store.
#[derive(Clone)]
pub struct ActorSnapshotter {
    actor: ActorHandle,
    store: SnapshotStore,
}

impl ActorSnapshotter {
    /// Uses `actor` for snapshots and `store` to look for an existing final one.
    pub fn new(actor: ActorHandle, store: SnapshotStore) -> Self {
        ActorSnapshotter { actor, store }
    }
}

/// Whether the newest full snapshot in `store` is marked final (false when there is none).
pub async fn latest_full_is_final(store: &SnapshotStore) -> Result<bool, SeamError> {
    let chain = store
        .latest_chain()
        .await
        .map_err(|e| SeamError(e.to_string()))?;
    Ok(chain.full_snapshot.is_some_and(|s| s.is_final))
}

#[async_trait::async_trait]
impl Snapshotter for ActorSnapshotter {
    async fn set_regular(&self, on: bool) -> Result<(), SeamError> {
        self.actor
            .set_regular(on)
            .await
            .map_err(|e| SeamError(e.to_string()))
    }

    async fn latest_is_final(&self) -> Result<bool, SeamError> {
        latest_full_is_final(&self.store).await
    }

    async fn request_final(&self) -> Result<String, SeamError> {
        self.actor
            .full(true)
            .await
            .map(|s| s.snap_name)
            .map_err(|e| SeamError(e.to_string()))
    }
}

/// etcd health as "the member answers a status request and knows a leader", each check bounded
/// by `timeout`. The client is made on first use and again after a failure, so a restarted etcd
/// is found without waiting for the old connection's backoff.
pub struct EtcdStatusHealth {
    config: EtcdConfig,
    timeout: Duration,
    client: Mutex<Option<etcd_client::Client>>,
}

impl EtcdStatusHealth {
    /// Checks the member at `config`'s endpoints.
    pub fn new(config: EtcdConfig, timeout: Duration) -> Self {
        EtcdStatusHealth {
            config,
            timeout,
            client: Mutex::new(None),
        }
    }

    async fn client(&self) -> Option<etcd_client::Client> {
        let mut slot = self.client.lock().await;
        if slot.is_none() {
            let connect = tokio::time::timeout(self.timeout, crate::etcd::connect(&self.config));
            match connect.await {
                Ok(Ok(client)) => *slot = Some(client),
                Ok(Err(error)) => tracing::debug!(%error, "etcd not reachable"),
                Err(_) => tracing::debug!("etcd connect timed out"),
            }
        }
        slot.clone()
    }
}

#[async_trait::async_trait]
impl EtcdHealth for EtcdStatusHealth {
    async fn healthy(&self) -> bool {
        let Some(mut client) = self.client().await else {
            return false;
        };
        match tokio::time::timeout(self.timeout, client.status()).await {
            Ok(Ok(status)) => status.leader() != 0,
            _ => {
                *self.client.lock().await = None;
                false
            }
        }
    }
}

/// Readiness into the HTTP server's `/healthz` channel.
impl ReadinessSink for watch::Sender<Readiness> {
    fn set_ready(&self, ready: bool, state: &str, reason: &str) {
        // The server shows state names capitalised (`Active`); the watchdog's are lower case.
        let mut chars = state.chars();
        let state = chars
            .next()
            .map(|c| c.to_uppercase().chain(chars).collect())
            .unwrap_or_default();
        self.send_replace(Readiness {
            ready,
            state,
            reason: reason.to_string(),
        });
    }
}

/// The watchdog's status for `GET /status`.
#[derive(Debug, Clone)]
pub struct OwnerStatus(pub watch::Receiver<WatchdogStatus>);

impl StatusSource for OwnerStatus {
    fn status(&self) -> serde_json::Value {
        serde_json::to_value(&*self.0.borrow()).unwrap_or(serde_json::Value::Null)
    }
}

/// How long one etcd health check may take.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// The production seams: DNS through hickory, etcd found in `/proc`, snapshots through the actor,
/// health from etcd's status, readiness into the server's channel.
pub fn production_seams(
    owner: &OwnerConfig,
    kill: &KillConfig,
    etcd: &EtcdConfig,
    actor: ActorHandle,
    store: SnapshotStore,
    readiness: watch::Sender<Readiness>,
) -> Result<Seams, ResolveError> {
    Ok(Seams {
        lookup: Arc::new(OwnerResolver::new(owner)?),
        process: Arc::new(ProcKiller::new(kill)),
        snapshotter: Arc::new(ActorSnapshotter::new(actor, store)),
        health: Arc::new(EtcdStatusHealth::new(etcd.clone(), HEALTH_TIMEOUT)),
        readiness: Arc::new(readiness),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Codec, Kind};

    fn store() -> (tempfile::TempDir, SnapshotStore) {
        let dir = tempfile::tempdir().expect("temp dir");
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).expect("fs");
        (dir, SnapshotStore::new(Arc::new(fs), "backups"))
    }

    #[tokio::test]
    async fn latest_final_is_read_from_the_store() {
        let (_dir, store) = store();
        assert!(!latest_full_is_final(&store).await.expect("empty store"));

        let full = store.new_snapshot(Kind::Full, 0, 10, Codec::Gzip, false);
        store
            .put_bytes(&full, bytes::Bytes::from_static(b"x"))
            .await
            .expect("put");
        assert!(!latest_full_is_final(&store).await.expect("regular full"));

        let last = store.new_snapshot(Kind::Full, 0, 20, Codec::Gzip, true);
        store
            .put_bytes(&last, bytes::Bytes::from_static(b"x"))
            .await
            .expect("put");
        assert!(latest_full_is_final(&store).await.expect("final full"));

        let later = store.new_snapshot(Kind::Full, 0, 30, Codec::Gzip, false);
        store
            .put_bytes(&later, bytes::Bytes::from_static(b"x"))
            .await
            .expect("put");
        assert!(
            !latest_full_is_final(&store).await.expect("newer regular"),
            "only the latest full snapshot counts"
        );
    }

    #[test]
    fn readiness_goes_to_the_server_channel() {
        let (tx, rx) = watch::channel(Readiness::starting());
        tx.set_ready(true, "active", "owner, etcd healthy");
        assert_eq!(
            *rx.borrow(),
            Readiness {
                ready: true,
                state: "Active".into(),
                reason: "owner, etcd healthy".into()
            }
        );
    }

    #[tokio::test]
    async fn unreachable_etcd_is_unhealthy() {
        let config = EtcdConfig {
            endpoints: vec!["http://127.0.0.1:1".into()],
            tls: None,
            username: None,
            password: None,
            connect_timeout: Duration::from_millis(200),
            request_timeout: Duration::from_millis(200),
        };
        let health = EtcdStatusHealth::new(config, Duration::from_millis(300));
        assert!(!health.healthy().await);
    }
}
