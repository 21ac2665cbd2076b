//! The fallback for deltas [`super::direct`] cannot write into the database (puts without
//! their create revision and version).
//!
//! Replays delta events into a temporary etcd: events sharing a revision in one transaction,
//! in revision order, each transaction checked to land on exactly the revision it had at the
//! source, so a gap or a double-applied event is caught at once rather than silently diverging.
//!
//! One transaction at a time is bound by the round trip to etcd (~2,500 revisions a second
//! here), and transactions sent together are taken in whatever order etcd's request goroutines
//! reach raft, which on a busy machine is rarely the order sent. So transactions go in rounds:
//! a round of `n` revisions sends one transaction `n` times at once, and that transaction (a
//! [`chain`]) applies whichever of the `n` is due when etcd takes it. Each revision's branch
//! sits behind a [`Guard`]: for revision R it compares `mod_revision(w) == j` for a key `w`
//! that revision j puts, where every revision between j and R only deletes, and checks that
//! each key those revisions delete is gone. Each deleted key existed until its delete (a delete
//! of a missing key makes no event) and nothing but deletes happens after j, so the guard holds
//! once R - 1 is applied and never before; the branches are nested highest revision first, so
//! the first guard that holds is the one for the revision due. The `n` copies therefore apply
//! the round's revisions in order, each exactly once, whatever order they arrive in, and every
//! response is checked to have done so. A chain carries a round's payload `n` times, so rounds
//! are short ([`ROUND`], [`ROUND_BYTES`]); a revision without a guard (a run of deletes longer
//! than [`MAX_ABSENT`] keys, or one that deletes the witness, or deletes from the start) begins
//! a round of its own.

use etcd_client::{Compare, CompareOp, KvClient, Txn, TxnOp, TxnOpResponse, TxnResponse};

use super::RestoreError;

/// Revisions in one round, at most. Measured (docs/benchmarks.md): a longer chain costs etcd
/// more than the concurrency gains.
pub const ROUND: usize = 6;

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

/// Keys a guard may check gone, at most: beyond it a round ends instead.
pub const MAX_ABSENT: usize = 64;

/// What the transaction for a revision compares so that it lands only right after the revision
/// before it (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard<'a> {
    /// A key and the revision that put it: `mod_revision(key) == revision`.
    pub witness: (&'a [u8], i64),
    /// Keys deleted by the revisions after the witness's, each compared `version == 0`.
    pub absent: Vec<&'a [u8]>,
}

/// The guard for the revision that follows `before` (the groups before it, in order), or `None`
/// when none can be built.
pub fn guard(before: &[RevisionGroup]) -> Option<Guard<'_>> {
    let mut absent: Vec<&[u8]> = Vec::new();
    for g in before.iter().rev() {
        let put = g.ops.iter().find_map(|op| match op {
            ReplayOp::Put { key, .. } => Some(key.as_slice()),
            ReplayOp::Delete { .. } => None,
        });
        match put {
            // A later delete of the witness would leave it without a modification revision.
            Some(key) if absent.contains(&key) => return None,
            Some(key) => {
                return Some(Guard {
                    witness: (key, g.revision),
                    absent,
                });
            }
            None => {
                for op in &g.ops {
                    if let ReplayOp::Delete { key } = op {
                        absent.push(key);
                    }
                }
                if absent.len() > MAX_ABSENT {
                    return None;
                }
            }
        }
    }
    None
}

/// The transaction for `group`, checked by `guard` when given.
pub fn transaction(group: &RevisionGroup, guard: Option<&Guard>) -> Txn {
    let mut compares = Vec::new();
    if let Some(g) = guard {
        let (key, rev) = g.witness;
        compares.push(Compare::mod_revision(key, CompareOp::Equal, rev));
        compares.extend(
            g.absent
                .iter()
                .map(|k| Compare::version(*k, CompareOp::Equal, 0)),
        );
    }
    let ops: Vec<TxnOp> = group
        .ops
        .iter()
        .map(|op| match op {
            ReplayOp::Put { key, value } => TxnOp::put(key.clone(), value.clone(), None),
            ReplayOp::Delete { key } => TxnOp::delete(key.clone(), None),
        })
        .collect();
    Txn::new().when(compares).and_then(ops)
}

/// What a replay did besides applying events.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Events applied.
    pub events: u64,
    /// Rounds of transactions sent (see [`apply_rounds`]).
    pub rounds: u64,
}

/// Applies groups in order into the etcd behind `kv`, whose current revision is `*current`;
/// groups at or below it are skipped (already in the full snapshot). Rounds of up to
/// [`ROUND`] revisions (see [`apply_rounds`]).
pub async fn apply(
    kv: &KvClient,
    groups: &[RevisionGroup],
    current: &mut i64,
) -> Result<Applied, RestoreError> {
    apply_rounds(kv, groups, current, ROUND).await
}

/// Bytes of keys and values one round's transaction carries at most: a round's transaction is
/// sent once per revision in it. A single revision may exceed it, and then goes alone.
pub const ROUND_BYTES: usize = 64 << 10;

fn bytes_of(group: &RevisionGroup) -> usize {
    group
        .ops
        .iter()
        .map(|op| match op {
            ReplayOp::Put { key, value } => key.len() + value.len(),
            ReplayOp::Delete { key } => key.len(),
        })
        .sum()
}

/// How many of `groups[from..]` one round takes: at most `max` and [`ROUND_BYTES`] (but at least
/// one), and every revision after the first needs a [`guard`] (which may reach back before
/// `from`).
pub fn round_len(groups: &[RevisionGroup], from: usize, max: usize) -> usize {
    let left = groups.len().saturating_sub(from).min(max.max(1));
    let mut n = left.min(1);
    let mut bytes = groups.get(from).map_or(0, bytes_of);
    while n < left {
        bytes += bytes_of(&groups[from + n]);
        if bytes > ROUND_BYTES || guard(&groups[..from + n]).is_none() {
            break;
        }
        n += 1;
    }
    n
}

fn ops_of(group: &RevisionGroup) -> Vec<TxnOp> {
    group
        .ops
        .iter()
        .map(|op| match op {
            ReplayOp::Put { key, value } => TxnOp::put(key.clone(), value.clone(), None),
            ReplayOp::Delete { key } => TxnOp::delete(key.clone(), None),
        })
        .collect()
}

/// The transaction that applies whichever of `groups[from..from + n]` comes next: one branch a
/// revision, nested in else-branches with the highest revision outermost, each behind its
/// [`guard`]. A guard holds only once everything before its revision is applied, so in state
/// `s` the outermost guard that holds is the one for `s + 1`. The innermost, `from`, is
/// unguarded: it is reached only when no revision after it is due, which in a round (see
/// [`apply_rounds`]) means it is.
pub fn chain(groups: &[RevisionGroup], from: usize, n: usize) -> Txn {
    let mut txn = Txn::new().and_then(ops_of(&groups[from]));
    for i in from + 1..from + n {
        let guard = guard(&groups[..i]).expect("round_len admits only guarded revisions");
        txn = transaction(&groups[i], Some(&guard)).or_else(vec![TxnOp::txn(txn)]);
    }
    txn
}

/// Which branch of a [`chain`] of `n` applied (0 for the lowest revision), if any.
pub fn branch_taken(resp: &TxnResponse, n: usize) -> Option<usize> {
    let mut level = n.checked_sub(1)?;
    let mut resp = resp.clone();
    loop {
        if resp.succeeded() {
            return Some(level);
        }
        level = level.checked_sub(1)?;
        match resp.op_responses().into_iter().next() {
            Some(TxnOpResponse::Txn(inner)) => resp = inner,
            _ => return None,
        }
    }
}

/// [`apply`] in rounds of up to `max` revisions: a round's [`chain`] is sent once per revision
/// in it, all at once. Whatever order etcd takes them in, each applies exactly the next
/// revision: the first the lowest, the next the one after, and so on, so a round of `n` moves
/// etcd exactly `n` revisions on and nothing is sent twice. Every response is checked to have
/// taken a different branch and to have landed on that branch's revision.
pub async fn apply_rounds(
    kv: &KvClient,
    groups: &[RevisionGroup],
    current: &mut i64,
    max: usize,
) -> Result<Applied, RestoreError> {
    let mut from = groups.partition_point(|g| g.revision <= *current);
    for (g, expected) in groups[from..].iter().zip(*current + 1..) {
        if g.revision != expected {
            return Err(RestoreError::Deltas(format!(
                "gap in the deltas: revision {} follows {}",
                g.revision,
                expected - 1
            )));
        }
    }
    let mut done = Applied::default();
    while from < groups.len() {
        let n = round_len(groups, from, max);
        let round = &groups[from..from + n];
        let txn = chain(groups, from, n);
        let sent = (0..n).map(|_| {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        });
        let responses = futures::future::join_all(sent).await;
        let mut taken = vec![false; n];
        for resp in responses {
            let resp = resp.map_err(|cause| RestoreError::Replay {
                first: round[0].revision,
                last: round[n - 1].revision,
                cause,
            })?;
            let landed = resp.header().map(|h| h.revision()).unwrap_or_default();
            let branch = branch_taken(&resp, n)
                .filter(|&b| !taken[b])
                .ok_or_else(|| {
                    RestoreError::Deltas(format!(
                        "replaying revisions {} to {}: a transaction applied none of them or one \
                     already applied (etcd at revision {landed})",
                        round[0].revision,
                        round[n - 1].revision
                    ))
                })?;
            taken[branch] = true;
            if landed != round[branch].revision {
                // A delete of a key the snapshot does not have changes nothing and bumps
                // nothing.
                return Err(RestoreError::Deltas(format!(
                    "revision {} replayed as {landed}: the deltas do not match the full snapshot",
                    round[branch].revision
                )));
            }
        }
        done.events += round.iter().map(|g| g.ops.len() as u64).sum::<u64>();
        done.rounds += 1;
        *current = round[n - 1].revision;
        from += n;
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
    fn a_run_of_deletes_is_guarded_by_the_put_before_it_and_the_keys_gone() {
        let g = groups(vec![
            vec![put("a")],
            vec![del("x"), put("b")],
            vec![del("c")],
            vec![del("d"), del("e")],
            vec![put("f")],
        ]);
        assert_eq!(guard(&g[..0]), None);
        assert_eq!(
            guard(&g[..1]),
            Some(Guard {
                witness: (&b"a"[..], 10),
                absent: vec![],
            })
        );
        // A revision that deletes and puts is its own witness.
        assert_eq!(guard(&g[..2]).unwrap().witness, (&b"b"[..], 11));
        assert_eq!(
            guard(&g[..4]),
            Some(Guard {
                witness: (&b"b"[..], 11),
                absent: vec![&b"d"[..], &b"e"[..], &b"c"[..]],
            })
        );
        assert_eq!(guard(&g[..5]).unwrap().absent, Vec::<&[u8]>::new());
    }

    #[test]
    fn no_guard_without_a_put_before_the_deletes_or_with_the_witness_deleted() {
        // Deletes from the start: nothing put to compare against.
        let only_deletes = groups(vec![vec![del("a")], vec![del("b")], vec![put("c")]]);
        assert_eq!(guard(&only_deletes[..1]), None);
        assert_eq!(guard(&only_deletes[..2]), None);
        // The witness deleted later: it has no modification revision any more.
        let witness_deleted = groups(vec![vec![put("a")], vec![del("a")], vec![put("b")]]);
        assert_eq!(guard(&witness_deleted[..2]), None);
        // Too many keys to check gone.
        let mut long: Vec<Vec<ReplayOp>> = vec![vec![put("w")]];
        long.extend((0..=MAX_ABSENT).map(|i| vec![del(&format!("d{i}"))]));
        let long = groups(long);
        assert_eq!(
            guard(&long[..MAX_ABSENT + 1]).unwrap().absent.len(),
            MAX_ABSENT
        );
        assert_eq!(guard(&long[..MAX_ABSENT + 2]), None);
    }

    #[test]
    fn a_round_ends_at_its_length_its_bytes_or_a_revision_without_a_guard() {
        assert_eq!(round_len(&[], 0, ROUND), 0);
        let many = groups((0..20).map(|i| vec![put(&format!("k{i}"))]).collect());
        assert_eq!(round_len(&many, 0, ROUND), ROUND);
        assert_eq!(round_len(&many, 18, ROUND), 2, "the end of the groups");
        assert_eq!(round_len(&many, 0, 0), 1, "at least one");
        // Deletes from the start: the second has no guard, so the first goes alone.
        let g = groups(vec![
            vec![del("a")],
            vec![del("b")],
            vec![put("c")],
            vec![put("d")],
        ]);
        assert_eq!(round_len(&g, 0, ROUND), 1);
        assert_eq!(round_len(&g, 1, ROUND), 1);
        assert_eq!(round_len(&g, 2, ROUND), 2);
        // Bytes: values of a third of the limit fit three to a round; one larger than the
        // limit goes alone.
        let value = |n: usize| ReplayOp::Put {
            key: b"k".to_vec(),
            value: vec![0; n],
        };
        let big = groups(vec![
            vec![value(ROUND_BYTES / 3 - 1)],
            vec![value(ROUND_BYTES / 3 - 1)],
            vec![value(ROUND_BYTES / 3 - 1)],
            vec![value(ROUND_BYTES / 3 - 1)],
            vec![value(ROUND_BYTES * 2)],
            vec![put("x")],
        ]);
        assert_eq!(round_len(&big, 0, ROUND), 3);
        assert_eq!(round_len(&big, 3, ROUND), 1);
        assert_eq!(round_len(&big, 4, ROUND), 1);
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
