//! The watch behind delta snapshots: every key, from the revision after the previous snapshot.
//! The snapshot actor flushes what it collects every `delta_period` or when the buffer reaches
//! `delta_memory_limit`.

use super::delta::{DeltaError, Event};

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

/// The largest watch response accepted, as etcd's own Go client (`math.MaxInt32`). etcd sends a
/// batch of events whole (up to 1,000 revisions, each up to `--max-request-bytes`), so a catch-up
/// over a few large values (kube-apiserver stores objects up to 1.5 MiB) is far beyond tonic's
/// default of 4 MiB; with that default the watch failed on the same batch at every retry and
/// deltas stopped for good.
const MAX_WATCH_MESSAGE: usize = i32::MAX as usize;

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
        let stream = client
            .watch_client()
            .max_decoding_message_size(MAX_WATCH_MESSAGE)
            .watch(vec![0u8], Some(opts))
            .await?;
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
