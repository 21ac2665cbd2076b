//! The watchdog's traits over the rest of the crate: DNS through hickory, etcd found in `/proc`,
//! etcd's API through its client, the hand-off's objects in the store, the final snapshot through
//! the one snapshot actor, and readiness into the HTTP server's channel.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::handoff::{HandOffObjects, Member};
use super::resolve::{OwnerResolver, ResolveError};
use super::watchdog::{Context, EtcdView, SeamError, WatchdogStatus};
use crate::config::{EtcdConfig, KillConfig, OwnerConfig};
use crate::health::{Health, HealthCheck};
use crate::kill::ProcKiller;
use crate::server::{Readiness, StatusSource};
use crate::snapshot::actor::ActorHandle;
use crate::snapshot::gate::Gate;
use crate::store::{Codec, SnapshotStore};

/// A key read only to learn the cluster's revision linearizably; it need not exist.
const REVISION_PROBE_KEY: &str = "/etcd-warden/revision-probe";

/// etcd through the health check's client (made again after a failure, so a restarted etcd and
/// its new auth token are picked up), every call bounded by `timeout`.
pub struct EtcdApi {
    check: HealthCheck,
    timeout: Duration,
    /// The member's data directory (`restore.data_dir`), where its write-ahead log names it.
    data_dir: Option<PathBuf>,
}

impl EtcdApi {
    /// The member at `config`'s endpoints.
    pub fn new(config: EtcdConfig, timeout: Duration) -> Self {
        EtcdApi {
            check: HealthCheck::new(config, timeout),
            timeout,
            data_dir: None,
        }
    }

    /// The member's data directory, read for its ID when etcd does not answer.
    pub fn with_data_dir(mut self, data_dir: Option<PathBuf>) -> Self {
        self.data_dir = data_dir;
        self
    }

    async fn call<T, F>(
        &self,
        what: &'static str,
        f: impl FnOnce(etcd_client::Client) -> F,
    ) -> Result<T, SeamError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let client = self
            .check
            .client()
            .await
            .map_err(SeamError::EtcdUnreachable)?;
        match tokio::time::timeout(self.timeout, f(client)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.check.reset().await;
                Err(SeamError::Etcd(e))
            }
            Err(_) => {
                self.check.reset().await;
                Err(SeamError::Timeout {
                    what,
                    after: self.timeout,
                })
            }
        }
    }
}

#[async_trait::async_trait]
impl EtcdView for EtcdApi {
    async fn health(&self) -> Health {
        self.check.check().await
    }

    async fn members(&self) -> Result<Vec<Member>, SeamError> {
        let list = self
            .call("member list", |mut c| async move { c.member_list().await })
            .await?;
        Ok(list
            .members()
            .iter()
            .map(|m| Member {
                id: m.id(),
                name: m.name().to_string(),
                started: !m.client_urls().is_empty(),
            })
            .collect())
    }

    async fn revision(&self) -> Result<i64, SeamError> {
        let got = self
            .call("a linearizable read", |mut c| async move {
                c.get(REVISION_PROBE_KEY, None).await
            })
            .await?;
        Ok(got.header().map_or(0, |h| h.revision()))
    }

    async fn member_on_disk(&self) -> Option<u64> {
        let wal = self.data_dir.as_ref()?.join("member").join("wal");
        let read = tokio::task::spawn_blocking(move || {
            crate::restore::wal::member_id(&wal).map_err(|e| (wal, e))
        })
        .await
        .ok()?;
        match read {
            Ok(id) => id,
            Err((wal, error)) => {
                tracing::debug!(wal = %wal.display(), %error, "the member's write-ahead log does not read");
                None
            }
        }
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

/// The production context: DNS through hickory, etcd found in `/proc`, etcd's API, the store and
/// the actor, readiness into the server's channel, the actor's gate.
#[allow(clippy::too_many_arguments)]
pub fn context(
    owner: &OwnerConfig,
    kill: &KillConfig,
    etcd: &EtcdConfig,
    actor: ActorHandle,
    store: SnapshotStore,
    codec: Codec,
    readiness: watch::Sender<Readiness>,
    gate: watch::Sender<Gate>,
    data_dir: Option<PathBuf>,
) -> Result<Context, ResolveError> {
    Ok(Context {
        lookup: Arc::new(OwnerResolver::new(owner)?),
        process: Arc::new(
            ProcKiller::new(kill)
                .with_client_ports(crate::kill::client_ports(&etcd.endpoints))
                .with_data_dir(data_dir.clone()),
        ),
        etcd: Arc::new(EtcdApi::new(etcd.clone(), crate::health::TIMEOUT).with_data_dir(data_dir)),
        objects: HandOffObjects::new(store),
        codec,
        finals: Arc::new(actor),
        readiness: Arc::new(readiness),
        gate,
    })
}
