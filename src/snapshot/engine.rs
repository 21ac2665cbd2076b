//! The production [`Engine`]: etcd's snapshot and watch APIs on one side, the store on the other.

use crate::etcd::RotatingClient;
use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::actor::{Collected, Engine, EngineError};
use super::delta::DeltaWriter;
use super::full::take_full_from;
use super::watcher::{DeltaWatch, WatchError};
use crate::store::gc::{self, GcReport, Retention};
use crate::store::{Codec, Kind, Snapshot, SnapshotStore};

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
    ) -> Result<Snapshot, EngineError> {
        let client = self.etcd.client().await;
        let snap = take_full_from(&client, &self.store, self.codec, is_final, min_revision).await?;
        match self.writer.as_mut() {
            // The running watch goes on; what the full snapshot covers is dropped.
            Some(w) => w.rebase(snap.last_revision),
            None if self.want_deltas && !is_final => self.watch_after(snap.last_revision).await?,
            None => {}
        }
        Ok(snap)
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

    async fn flush_delta(&mut self) -> Result<Option<Snapshot>, EngineError> {
        match self.writer.as_mut() {
            Some(w) => Ok(w.flush(&self.store).await?),
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

    async fn is_leader(&mut self) -> Result<bool, EngineError> {
        let status = self.etcd.client().await.status().await?;
        let me = status.header().map(|h| h.member_id()).unwrap_or_default();
        Ok(me != 0 && status.leader() == me)
    }

    async fn latest_full(&mut self) -> Result<Option<Snapshot>, EngineError> {
        let list = self.store.list().await?;
        Ok(list.into_iter().rev().find(|s| s.kind == Kind::Full))
    }

    async fn gc(&mut self, now: DateTime<Utc>) -> Result<GcReport, EngineError> {
        Ok(gc::run(&self.store, now, self.retention).await?)
    }
}
