//! The production [`Engine`]: etcd's snapshot and watch APIs on one side, the store on the other.

use crate::etcd::RotatingClient;
use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::actor::{Collected, Engine, EngineError, Membership, Stored};
use super::delta::DeltaWriter;
use super::full::take_full_sized;
use super::watcher::{DeltaWatch, WatchError};
use crate::store::gc::{self, GcReport, Retention};
use crate::store::{Chain, Codec, SnapshotStore};

/// Snapshots of the etcd member `etcd` talks to, stored in `store`.
pub struct EtcdEngine {
    etcd: RotatingClient,
    store: SnapshotStore,
    codec: Codec,
    retention: Retention,
    /// Regular work wants deltas (between `resume` and `pause`).
    want_deltas: bool,
    /// Events since the latest stored snapshot; `None` until a base snapshot exists.
    writer: Option<DeltaWriter>,
    watch: Option<DeltaWatch>,
}

impl EtcdEngine {
    /// An engine over a client of the local member only (leadership is judged by it).
    pub fn new(
        etcd: RotatingClient,
        store: SnapshotStore,
        codec: Codec,
        retention: Retention,
    ) -> Self {
        EtcdEngine {
            etcd,
            store,
            codec,
            retention,
            want_deltas: false,
            writer: None,
            watch: None,
        }
    }

    /// Starts a writer and a watch continuing after revision `last`.
    async fn watch_after(&mut self, last: i64) -> Result<(), EngineError> {
        let client = self.etcd.client().await;
        self.watch = Some(DeltaWatch::open(&client, last + 1).await?);
        self.writer = Some(DeltaWriter::new(self.codec, last));
        tracing::debug!(from_revision = last + 1, "watching etcd for deltas");
        Ok(())
    }
}

#[async_trait]
impl Engine for EtcdEngine {
    async fn full(
        &mut self,
        is_final: bool,
        min_revision: Option<i64>,
    ) -> Result<Stored, EngineError> {
        let client = self.etcd.client().await;
        let (snap, bytes) =
            take_full_sized(&client, &self.store, self.codec, is_final, min_revision).await?;
        match self.writer.as_mut() {
            // The running watch goes on; what the full snapshot covers is dropped.
            Some(w) => w.rebase(snap.last_revision),
            None if self.want_deltas && !is_final => self.watch_after(snap.last_revision).await?,
            None => {}
        }
        Ok(Stored {
            snapshot: snap,
            bytes,
        })
    }

    async fn collect(&mut self) -> Result<Collected, EngineError> {
        let (Some(watch), Some(writer)) = (self.watch.as_mut(), self.writer.as_mut()) else {
            // Nothing to watch until a base snapshot exists: wait for the actor to take one.
            std::future::pending::<()>().await;
            return Ok(Collected::Events);
        };
        match watch.next().await {
            Ok(events) => {
                writer.push(events, Utc::now());
                Ok(Collected::Events)
            }
            Err(WatchError::Compacted { wanted, compacted }) => {
                tracing::warn!(
                    wanted,
                    compacted,
                    "etcd compacted past the delta stream; a full snapshot is needed"
                );
                self.watch = None;
                self.writer = None;
                Ok(Collected::Compacted)
            }
            Err(e) => {
                self.watch = None;
                Err(e.into())
            }
        }
    }

    fn buffered_bytes(&self) -> u64 {
        self.writer
            .as_ref()
            .map_or(0, |w| w.buffered_bytes() as u64)
    }

    async fn flush_delta(&mut self) -> Result<Option<Stored>, EngineError> {
        match self.writer.as_mut() {
            Some(w) => Ok(w
                .flush_sized(&self.store)
                .await?
                .map(|(snapshot, bytes)| Stored { snapshot, bytes })),
            None => Ok(None),
        }
    }

    async fn resume(&mut self) -> Result<(), EngineError> {
        self.want_deltas = true;
        self.watch = None;
        self.writer = None;
        let chain = self.store.latest_chain().await?;
        let last = chain
            .delta_snapshots
            .iter()
            .chain(chain.full_snapshot.iter())
            .map(|s| s.last_revision)
            .max();
        match last {
            Some(last) => self.watch_after(last).await,
            // No base yet: the first full snapshot starts the watch.
            None => Ok(()),
        }
    }

    fn pause(&mut self) {
        self.want_deltas = false;
        self.watch = None;
        self.writer = None;
    }

    async fn membership(&mut self) -> Result<Membership, EngineError> {
        let mut client = self.etcd.client().await;
        let status = client.status().await?;
        let me = status.header().map(|h| h.member_id()).unwrap_or_default();
        // Both are unary calls, bounded by etcd.request_timeout. A learner may be refused the
        // member list; its size is then unknown, which is no reason to doubt the status.
        let cluster_size = match client.member_list().await {
            Ok(list) => Some(list.members().len() as u64),
            Err(error) => {
                tracing::debug!(%error, "reading etcd's member list failed");
                None
            }
        };
        Ok(Membership {
            leader: me != 0 && status.leader() == me,
            learner: status.is_learner(),
            cluster_size,
        })
    }

    async fn latest_chain(&mut self) -> Result<Chain, EngineError> {
        Ok(self.store.latest_chain().await?)
    }

    async fn gc(&mut self, now: DateTime<Utc>) -> Result<GcReport, EngineError> {
        Ok(gc::run(&self.store, now, self.retention).await?)
    }
}
