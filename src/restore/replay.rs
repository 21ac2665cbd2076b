//! Replays delta events into a temporary etcd: events sharing a revision in one transaction,
//! in revision order, each transaction checked to land on exactly the revision it had at the
//! source, so a gap or a double-applied event is caught at once rather than silently diverging.
//!
//! One transaction at a time would be bound by the round trip to etcd (~2,500 revisions a
//! second here). So transactions are pipelined, up to [`WINDOW`] in flight, and each carries a
//! guard that makes order a precondition instead of an assumption: the transaction for revision
//! R compares `mod_revision(k) == R - 1` for a key `k` that revision R - 1 puts. That holds
//! exactly when R - 1 has been applied and nothing after it has (nothing else writes to the
//! temporary etcd, and by induction no later transaction can land before R). A transaction that
//! etcd happens to take before its predecessor fails its compare, changes nothing and takes no
//! revision; so does every one after it, and the replay resumes from the first that failed.
//! A revision that only deletes leaves no key to compare against, so its successor waits for
//! everything before it to be confirmed and goes unguarded.

use etcd_client::{Compare, CompareOp, KvClient, Txn, TxnOp};

use super::RestoreError;

/// Transactions in flight at once.
pub const WINDOW: usize = 256;

/// One change to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayOp {
    Put { key: Vec<u8>, value: Vec<u8> },
    Delete { key: Vec<u8> },
}

/// Everything that happened at one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevisionGroup {
    pub revision: i64,
    pub ops: Vec<ReplayOp>,
}

/// Groups events (already in revision order) by revision.
pub fn group(
    events: impl IntoIterator<Item = (i64, ReplayOp)>,
) -> Result<Vec<RevisionGroup>, RestoreError> {
    let mut groups: Vec<RevisionGroup> = Vec::new();
    for (rev, op) in events {
        match groups.last_mut() {
            Some(g) if g.revision == rev => g.ops.push(op),
            Some(g) if g.revision > rev => {
                return Err(RestoreError::Deltas(format!(
                    "events out of order: revision {rev} after {}",
                    g.revision
                )));
            }
            _ => groups.push(RevisionGroup {
                revision: rev,
                ops: vec![op],
            }),
        }
    }
    Ok(groups)
}

/// The key whose modification revision shows that `group` has been applied: one it puts.
fn witness(group: &RevisionGroup) -> Option<&[u8]> {
    group.ops.iter().find_map(|op| match op {
        ReplayOp::Put { key, .. } => Some(key.as_slice()),
        ReplayOp::Delete { .. } => None,
    })
}

/// How many of `groups` (at most [`WINDOW`]) can be sent together: the first goes unguarded
/// (everything before it is confirmed), each later one is guarded by its predecessor's witness,
/// so a predecessor without one ends the batch.
pub fn batch_len(groups: &[RevisionGroup]) -> usize {
    let mut n = groups.len().min(1);
    while n < groups.len().min(WINDOW) && witness(&groups[n - 1]).is_some() {
        n += 1;
    }
    n
}

/// The transaction for `group`, guarded by `after` (the group before it) when given.
pub fn transaction(group: &RevisionGroup, after: Option<&RevisionGroup>) -> Txn {
    let guard: Vec<Compare> = after
        .and_then(|prev| witness(prev).map(|k| (k, prev.revision)))
        .map(|(k, rev)| Compare::mod_revision(k, CompareOp::Equal, rev))
        .into_iter()
        .collect();
    let ops: Vec<TxnOp> = group
        .ops
        .iter()
        .map(|op| match op {
            ReplayOp::Put { key, value } => TxnOp::put(key.clone(), value.clone(), None),
            ReplayOp::Delete { key } => TxnOp::delete(key.clone(), None),
        })
        .collect();
    Txn::new().when(guard).and_then(ops)
}

/// What a replay did besides applying events.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Events applied.
    pub events: u64,
    /// Transactions etcd took out of order (failed their guard, were sent again).
    pub resent: u64,
}

/// Applies groups in order into the etcd behind `kv`, whose current revision is `*current`;
/// groups at or below it are skipped (already in the full snapshot).
pub async fn apply(
    kv: &KvClient,
    groups: &[RevisionGroup],
    current: &mut i64,
) -> Result<Applied, RestoreError> {
    let skip = groups.partition_point(|g| g.revision <= *current);
    let todo = &groups[skip..];
    for (g, expected) in todo.iter().zip(*current + 1..) {
        if g.revision != expected {
            return Err(RestoreError::Deltas(format!(
                "gap in the deltas: revision {} follows {}",
                g.revision,
                expected - 1
            )));
        }
    }
    let mut done = Applied::default();
    let mut next = 0;
    while next < todo.len() {
        let start = next;
        let batch = &todo[start..start + batch_len(&todo[start..])];
        let sent = batch.iter().enumerate().map(|(i, g)| {
            let txn = transaction(g, i.checked_sub(1).map(|p| &batch[p]));
            let mut kv = kv.clone();
            async move { kv.txn(txn).await }
        });
        let responses = futures::future::join_all(sent).await;
        let mut out_of_order = None;
        for (g, resp) in batch.iter().zip(responses) {
            let resp = resp.map_err(|e| {
                RestoreError::Etcd(format!("replaying revision {}: {e}", g.revision))
            })?;
            match (resp.succeeded(), out_of_order) {
                (false, None) => out_of_order = Some(g.revision),
                (false, Some(_)) => {}
                (true, Some(first)) => {
                    return Err(RestoreError::Deltas(format!(
                        "revision {} was applied although revision {first} before it was not",
                        g.revision
                    )));
                }
                (true, None) => {
                    let landed = resp.header().map(|h| h.revision()).unwrap_or_default();
                    if landed != g.revision {
                        // A delete of a key the snapshot does not have changes nothing and
                        // bumps nothing.
                        return Err(RestoreError::Deltas(format!(
                            "revision {} replayed as {landed}: the deltas do not match the full snapshot",
                            g.revision
                        )));
                    }
                    *current = landed;
                    done.events += g.ops.len() as u64;
                    next += 1;
                }
            }
        }
        done.resent += (start + batch.len() - next) as u64;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &str) -> ReplayOp {
        ReplayOp::Put {
            key: k.into(),
            value: b"v".to_vec(),
        }
    }

    fn del(k: &str) -> ReplayOp {
        ReplayOp::Delete { key: k.into() }
    }

    fn groups(ops: Vec<Vec<ReplayOp>>) -> Vec<RevisionGroup> {
        ops.into_iter()
            .zip(10..)
            .map(|(ops, revision)| RevisionGroup { revision, ops })
            .collect()
    }

    #[test]
    fn a_batch_ends_after_a_revision_that_only_deletes() {
        assert_eq!(batch_len(&[]), 0);
        let g = groups(vec![
            vec![put("a")],
            vec![del("x"), put("b")],
            vec![del("c")],
            vec![put("d")],
        ]);
        // 10 and 11 leave a key to compare against; 12 does not, so 13 waits for it.
        assert_eq!(batch_len(&g), 3);
        assert_eq!(batch_len(&g[2..]), 1);
        assert_eq!(batch_len(&g[3..]), 1);
        let only_deletes = groups(vec![vec![del("a")], vec![del("b")]]);
        assert_eq!(batch_len(&only_deletes), 1);
    }

    #[test]
    fn a_batch_holds_at_most_the_window() {
        let many = groups(
            (0..WINDOW + 5)
                .map(|i| vec![put(&format!("k{i}"))])
                .collect(),
        );
        assert_eq!(batch_len(&many), WINDOW);
        assert_eq!(batch_len(&many[WINDOW..]), 5);
    }

    #[test]
    fn the_witness_is_a_key_the_revision_puts() {
        let g = groups(vec![vec![del("x"), put("b")], vec![del("c")]]);
        assert_eq!(witness(&g[0]), Some(&b"b"[..]));
        assert_eq!(witness(&g[1]), None);
    }

    #[test]
    fn groups_by_revision_and_rejects_disorder() {
        let g = group([(5, put("a")), (5, put("b")), (6, put("c"))]).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].ops.len(), 2);
        assert_eq!(g[1].revision, 6);
        assert!(group([(6, put("a")), (5, put("b"))]).is_err());
    }
}
