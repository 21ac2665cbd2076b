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

/// The largest watch response accepted, as etcd's own Go client (`math.MaxInt32`). The watch asks
/// etcd to fragment its responses, so a message holds at most `--max-request-bytes` of events or a
/// single event; the bound stays for an etcd that sends a batch whole (a catch-up of up to 1,000
/// revisions, and kube-apiserver stores objects up to 1.5 MiB). With tonic's default of 4 MiB the
/// watch failed on the same batch at every retry and deltas stopped for good.
const MAX_WATCH_MESSAGE: usize = i32::MAX as usize;

/// A watch on every key from a given revision.
pub struct DeltaWatch {
    stream: etcd_client::WatchStream,
    from: i64,
    /// The events of the last revision of a fragment, which the next fragment may continue.
    carry: Vec<Event>,
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
            .with_progress_notify()
            // A catch-up batch (up to 1,000 revisions) comes in messages of at most
            // `--max-request-bytes`, so reading it holds one message at a time, not the batch.
            .with_fragment();
        let stream = client
            .watch_client()
            .max_decoding_message_size(MAX_WATCH_MESSAGE)
            .watch(vec![0u8], Some(opts))
            .await?;
        Ok(DeltaWatch {
            stream,
            from: from_revision,
            carry: Vec::new(),
        })
    }

    /// The next batch of events (possibly empty for a progress notification). A batch holds
    /// whole revisions only: a revision etcd split across fragments comes in one batch, so a
    /// delta never ends inside a revision (the next delta starts after its last revision, and
    /// the writer skips revisions it already holds).
    pub async fn next(&mut self) -> Result<Vec<Event>, WatchError> {
        loop {
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
            if resp.events().is_empty() {
                // A progress notification: a revision held over from a fragment stays held
                // (etcd sends a fragmented response's parts one after another; the last has
                // events).
                return Ok(Vec::new());
            }
            let mut events = std::mem::take(&mut self.carry);
            events.extend(resp.events().iter().map(Event::from));
            if !resp.0.fragment {
                return Ok(events);
            }
            self.carry = hold_last_revision(&mut events);
            if !events.is_empty() {
                return Ok(events);
            }
        }
    }
}

/// Splits off a fragment's last revision, which the next fragment may continue, and returns it;
/// `events` keeps the revisions before it, which are whole (etcd sends events in revision order).
fn hold_last_revision(events: &mut Vec<Event>) -> Vec<Event> {
    let last = events.last().map_or(0, Event::revision);
    let whole = events.partition_point(|e| e.revision() < last);
    events.split_off(whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::delta::KeyValue;

    fn at(revisions: &[i64]) -> Vec<Event> {
        revisions
            .iter()
            .map(|&r| Event {
                kv: Some(KeyValue {
                    mod_revision: r,
                    ..KeyValue::default()
                }),
                ..Event::default()
            })
            .collect()
    }

    fn revisions(events: &[Event]) -> Vec<i64> {
        events.iter().map(Event::revision).collect()
    }

    #[test]
    fn a_fragment_gives_its_whole_revisions_and_holds_its_last() {
        for (fragment, given, held) in [
            (vec![4, 5, 5, 6, 6, 6], vec![4, 5, 5], vec![6, 6, 6]),
            (vec![4, 5], vec![4], vec![5]),
            // One revision (a transaction larger than a fragment): nothing is whole yet.
            (vec![7, 7, 7], vec![], vec![7, 7, 7]),
            (vec![], vec![], vec![]),
        ] {
            let mut events = at(&fragment);
            let carry = hold_last_revision(&mut events);
            assert_eq!(
                (revisions(&events), revisions(&carry)),
                (given, held),
                "{fragment:?}"
            );
        }
    }
}
