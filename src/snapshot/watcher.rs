//! The watch behind delta snapshots: every key, from the revision after the previous snapshot,
//! flushed every `delta_period` or when the buffer reaches `delta_memory_limit`.

use std::future::Future;
use std::time::Duration;

use chrono::Utc;

use super::delta::{DeltaError, DeltaWriter, Event};
use crate::store::{Snapshot, SnapshotStore};

/// Watch errors.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// etcd failed or closed the watch.
    #[error("etcd watch failed: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// The revision to continue from was compacted: a new full snapshot is needed.
    #[error("revision {wanted} is compacted (oldest kept: {compacted}); take a full snapshot")]
    Compacted {
        /// The revision the watch asked for.
        wanted: i64,
        /// etcd's compaction revision.
        compacted: i64,
    },
    /// etcd canceled the watch.
    #[error("etcd canceled the watch: {0}")]
    Canceled(String),
    /// The stream ended.
    #[error("etcd closed the watch stream")]
    Closed,
    /// Storing a delta failed.
    #[error(transparent)]
    Delta(#[from] DeltaError),
}

/// A watch on every key from a given revision.
pub struct DeltaWatch {
    stream: etcd_client::WatchStream,
    from: i64,
}

impl DeltaWatch {
    /// Watches every key from `from_revision` (inclusive).
    pub async fn open(
        client: &etcd_client::Client,
        from_revision: i64,
    ) -> Result<DeltaWatch, WatchError> {
        let opts = etcd_client::WatchOptions::new()
            .with_all_keys()
            .with_start_revision(from_revision)
            .with_progress_notify();
        let stream = client.watch_client().watch(vec![0u8], Some(opts)).await?;
        Ok(DeltaWatch {
            stream,
            from: from_revision,
        })
    }

    /// The next batch of events (possibly empty for a progress notification).
    pub async fn next(&mut self) -> Result<Vec<Event>, WatchError> {
        let resp = self.stream.message().await?.ok_or(WatchError::Closed)?;
        if resp.compact_revision() != 0 {
            return Err(WatchError::Compacted {
                wanted: self.from,
                compacted: resp.compact_revision(),
            });
        }
        if resp.canceled() {
            return Err(WatchError::Canceled(resp.cancel_reason().to_string()));
        }
        Ok(resp.events().iter().map(Event::from).collect())
    }
}

/// Runs deltas until `stop` resolves: events go into `writer`, which is flushed every `period`,
/// whenever it holds `memory_limit` bytes, and once more at the end. `on_stored` is told about
/// each stored delta. Returns the error that ended it, or `Ok` when stopped.
pub async fn run_deltas<F>(
    client: &etcd_client::Client,
    store: &SnapshotStore,
    writer: &mut DeltaWriter,
    period: Duration,
    memory_limit: u64,
    stop: F,
    mut on_stored: impl FnMut(&Snapshot),
) -> Result<(), WatchError>
where
    F: Future<Output = ()>,
{
    let mut watch = DeltaWatch::open(client, writer.next_revision()).await?;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => {
                if let Some(s) = writer.flush(store).await? {
                    on_stored(&s);
                }
                return Ok(());
            }
            _ = tick.tick() => {
                if let Some(s) = writer.flush(store).await? {
                    on_stored(&s);
                }
            }
            events = watch.next() => {
                writer.push(events?, Utc::now());
                if writer.buffered_bytes() as u64 >= memory_limit
                    && let Some(s) = writer.flush(store).await?
                {
                    on_stored(&s);
                }
            }
        }
    }
}
