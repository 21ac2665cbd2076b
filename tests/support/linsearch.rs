//! A linearizability search per key (Wing & Gong's algorithm with Lowe's memoization) for what the
//! revision history leaves ambiguous: the operations on one key, each with its invocation and
//! completion (a lost answer completes never: it may take effect at any point after its
//! invocation, or not at all), against a register whose value names its write.
//!
//! The search linearizes, one at a time, an operation that no other pending operation completed
//! before (a minimal one), applies it to the model and backtracks when the model refuses; a
//! (set of linearized operations, model state) pair seen before is not explored again. It is
//! bounded: past `budget` explored states it answers [`Verdict::Undecided`].

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use super::kvcheck::{Call, Finding, Op, Ret};
use super::revmodel::Resolution;

/// One operation on the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Puts the value `id`; the revision it got, if known (for transactions comparing it).
    Put { id: String, revision: Option<i64> },
    /// Deletes the key; `existed`: what etcd answered (None: no answer).
    Delete { existed: Option<bool> },
    /// `if mod_revision == expect then put id`; `succeeded`: None when no answer.
    Txn {
        expect: i64,
        id: String,
        revision: Option<i64>,
        succeeded: Option<bool>,
    },
    /// A read that saw this value (id and mod revision) or nothing.
    Read { seen: Option<(String, i64)> },
}

/// An operation with its real-time window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinOp {
    pub action: Action,
    pub invoked: Duration,
    /// None: the answer was lost (optional, unbounded).
    pub completed: Option<Duration>,
}

/// The search's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    /// No order fits; the longest prefix of completed operations that could be linearized.
    NotLinearizable {
        linearized: usize,
    },
    /// The budget ran out.
    Undecided,
}

/// The register: the value's id and its mod revision (None when the write's revision is unknown,
/// which makes a comparison on it unknowable: both outcomes are accepted).
type State = Option<(String, Option<i64>)>;

fn apply(state: &State, a: &Action) -> Option<State> {
    let mod_rev = |s: &State| s.as_ref().map(|(_, r)| *r);
    match a {
        Action::Put { id, revision } => Some(Some((id.clone(), *revision))),
        Action::Delete { existed } => match existed {
            Some(true) if state.is_none() => None,
            Some(false) if state.is_some() => None,
            _ => Some(None),
        },
        Action::Txn {
            expect,
            id,
            revision,
            succeeded,
        } => {
            // Some(Some(r)): known; Some(None): unknown revision; None: absent (mod revision 0).
            let holds = match mod_rev(state) {
                None => Some(*expect == 0),
                Some(Some(r)) => Some(r == *expect),
                Some(None) => None,
            };
            let put = Some(Some((id.clone(), *revision)));
            match (succeeded, holds) {
                (Some(true), Some(false)) | (Some(false), Some(true)) => None,
                (Some(true), _) => put,
                (Some(false), _) => Some(state.clone()),
                // No answer: it took effect if the comparison held.
                (None, Some(true)) => put,
                (None, Some(false)) => Some(state.clone()),
                (None, None) => put,
            }
        }
        Action::Read { seen } => {
            let fits = match (seen, state) {
                (None, None) => true,
                (Some((id, r)), Some((sid, sr))) => id == sid && sr.is_none_or(|sr| sr == *r),
                _ => false,
            };
            fits.then(|| state.clone())
        }
    }
}

/// Searches for a linearization of `ops` from `initial`, exploring at most `budget` states.
pub fn check(ops: &[LinOp], initial: State, budget: usize) -> Verdict {
    let n = ops.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|i| ops[*i].invoked);
    let ops: Vec<&LinOp> = order.iter().map(|i| &ops[*i]).collect();
    let must: usize = ops.iter().filter(|o| o.completed.is_some()).count();
    let words = n.div_ceil(64).max(1);
    let mut seen: HashSet<(Vec<u64>, State)> = HashSet::new();
    // Depth-first: (linearized set, state, completed ones linearized, next candidate to try).
    let mut stack: Vec<(Vec<u64>, State, usize, usize)> = vec![(vec![0; words], initial, 0, 0)];
    let mut best = 0;
    let mut explored = 0usize;
    while let Some(top) = stack.last_mut() {
        let (done, state, count, next) = (top.0.clone(), top.1.clone(), top.2, top.3);
        if count == must {
            return Verdict::Linearizable;
        }
        best = best.max(count);
        // The earliest completion among pending completed operations bounds the candidates.
        let bound = (0..n)
            .filter(|i| done[i / 64] & (1 << (i % 64)) == 0)
            .filter_map(|i| ops[i].completed)
            .min()
            .unwrap_or(Duration::MAX);
        let mut chosen = None;
        for (i, op) in ops.iter().enumerate().skip(next) {
            if op.invoked > bound {
                break;
            }
            if done[i / 64] & (1 << (i % 64)) != 0 {
                continue;
            }
            if let Some(s) = apply(&state, &op.action) {
                chosen = Some((i, s));
                break;
            }
        }
        let Some((i, s)) = chosen else {
            stack.pop();
            continue;
        };
        stack.last_mut().expect("top").3 = i + 1;
        let mut d = done;
        d[i / 64] |= 1 << (i % 64);
        let c = count + usize::from(ops[i].completed.is_some());
        if seen.insert((d.clone(), s.clone())) {
            explored += 1;
            if explored > budget {
                return Verdict::Undecided;
            }
            stack.push((d, s, c, 0));
        }
    }
    Verdict::NotLinearizable { linearized: best }
}

/// The search over every key a write with a lost answer left ambiguous ([`Resolution`]): the
/// key's operations from the start of the run, writes resolved as happened kept (optional, at
/// their revision), writes resolved as never happened left out. Findings are
/// `not-linearizable`; keys the budget could not decide are counted, not excused silently: the
/// caller reports them. Returns (findings, keys searched, keys undecided).
pub fn judge_keys(ops: &[Op], res: &Resolution, budget: usize) -> (Vec<Finding>, usize, usize) {
    let mut keys: BTreeSet<&str> = BTreeSet::new();
    for &i in &res.unresolved {
        match &ops[i].call {
            Call::Put { key, .. } | Call::Txn { key, .. } | Call::Delete { key } => {
                keys.insert(key);
            }
            // A lost range delete touches batch keys, which every read of the hot keys ignores:
            // its keys are the ones read back under it.
            Call::DeleteRange { prefix } => {
                for o in ops {
                    if let Call::Get { key } = &o.call
                        && key.starts_with(prefix.as_str())
                    {
                        keys.insert(key);
                    }
                }
            }
            Call::Get { .. } => {}
        }
    }
    let (mut out, mut undecided) = (Vec::new(), 0);
    for key in &keys {
        let mut lin = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            if res.not_happened.contains(&i) {
                continue;
            }
            let lost = op.ret == Ret::Unknown;
            let completed = (!lost).then_some(op.completed);
            let revision = op.write_revision().or(res.happened.get(&i).copied());
            let action = match (&op.call, &op.ret) {
                (Call::Put { key: k, id }, _) if k == key => Action::Put {
                    id: id.clone(),
                    revision,
                },
                (Call::Txn { key: k, expect, id }, ret) if k == key => Action::Txn {
                    expect: *expect,
                    id: id.clone(),
                    revision,
                    succeeded: match ret {
                        Ret::Write { succeeded, .. } => Some(*succeeded),
                        _ if res.happened.contains_key(&i) => Some(true),
                        _ => None,
                    },
                },
                (Call::Delete { key: k }, ret) if k == key => Action::Delete {
                    existed: match ret {
                        Ret::Write { succeeded, .. } => Some(*succeeded),
                        _ => None,
                    },
                },
                (Call::DeleteRange { prefix }, _) if key.starts_with(prefix.as_str()) => {
                    Action::Delete { existed: None }
                }
                (Call::Get { key: k }, Ret::Read { kv, .. }) if k == key => Action::Read {
                    seen: kv.as_ref().map(|s| (s.id.clone(), s.mod_revision)),
                },
                _ => continue,
            };
            lin.push(LinOp {
                action,
                invoked: op.invoked,
                completed,
            });
        }
        match check(&lin, None, budget) {
            Verdict::Linearizable => {}
            Verdict::Undecided => undecided += 1,
            Verdict::NotLinearizable { linearized } => out.push(Finding {
                check: "not-linearizable",
                detail: format!(
                    "{key}: no order of its {} operations fits a register (at most {linearized} \
                     of the answered ones linearize)",
                    lin.len()
                ),
            }),
        }
    }
    (out, keys.len(), undecided)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn put(id: &str, rev: i64, t: (u64, u64)) -> LinOp {
        LinOp {
            action: Action::Put {
                id: id.into(),
                revision: Some(rev),
            },
            invoked: ms(t.0),
            completed: Some(ms(t.1)),
        }
    }

    fn lost_put(id: &str, t: u64) -> LinOp {
        LinOp {
            action: Action::Put {
                id: id.into(),
                revision: None,
            },
            invoked: ms(t),
            completed: None,
        }
    }

    fn read(seen: Option<(&str, i64)>, t: (u64, u64)) -> LinOp {
        LinOp {
            action: Action::Read {
                seen: seen.map(|(i, r)| (i.into(), r)),
            },
            invoked: ms(t.0),
            completed: Some(ms(t.1)),
        }
    }

    #[test]
    fn concurrent_reads_may_see_either_side_of_a_write() {
        let ops = vec![
            put("a", 2, (0, 10)),
            put("b", 3, (20, 40)),
            read(Some(("a", 2)), (25, 30)),
            read(Some(("b", 3)), (26, 35)),
        ];
        assert_eq!(check(&ops, None, 10_000), Verdict::Linearizable);
    }

    #[test]
    fn a_read_of_an_overwritten_value_after_the_overwrite_completed_is_not_linearizable() {
        let ops = vec![
            put("a", 2, (0, 10)),
            put("b", 3, (20, 30)),
            read(Some(("a", 2)), (40, 50)),
        ];
        assert!(matches!(
            check(&ops, None, 10_000),
            Verdict::NotLinearizable { .. }
        ));
        // Reads that go back and forth between two values are not either.
        let flip = vec![
            put("a", 2, (0, 10)),
            put("b", 3, (20, 100)),
            read(Some(("b", 3)), (30, 40)),
            read(Some(("a", 2)), (50, 60)),
        ];
        assert!(matches!(
            check(&flip, None, 10_000),
            Verdict::NotLinearizable { .. }
        ));
    }

    #[test]
    fn a_lost_write_may_take_effect_late_or_never() {
        let late = vec![
            put("a", 2, (0, 10)),
            lost_put("x", 5),
            read(Some(("a", 2)), (20, 30)),
            read(Some(("x", 9)), (40, 50)),
        ];
        assert_eq!(check(&late, None, 10_000), Verdict::Linearizable);
        let never = vec![lost_put("x", 5), read(None, (20, 30))];
        assert_eq!(check(&never, None, 10_000), Verdict::Linearizable);
        // But not before it was invoked.
        let early = vec![read(Some(("x", 9)), (0, 3)), lost_put("x", 5)];
        assert!(matches!(
            check(&early, None, 10_000),
            Verdict::NotLinearizable { .. }
        ));
    }

    #[test]
    fn transactions_and_deletes_are_checked_against_the_register() {
        let txn = |expect, id: &str, rev, ok, t: (u64, u64)| LinOp {
            action: Action::Txn {
                expect,
                id: id.into(),
                revision: Some(rev),
                succeeded: Some(ok),
            },
            invoked: ms(t.0),
            completed: Some(ms(t.1)),
        };
        let del = |existed, t: (u64, u64)| LinOp {
            action: Action::Delete {
                existed: Some(existed),
            },
            invoked: ms(t.0),
            completed: Some(ms(t.1)),
        };
        let good = vec![
            put("a", 2, (0, 10)),
            txn(2, "b", 3, true, (20, 30)),
            txn(2, "c", 3, false, (40, 50)),
            del(true, (60, 70)),
            del(false, (80, 90)),
        ];
        assert_eq!(check(&good, None, 10_000), Verdict::Linearizable);
        let bad = vec![put("a", 2, (0, 10)), txn(0, "b", 3, true, (20, 30))];
        assert!(matches!(
            check(&bad, None, 10_000),
            Verdict::NotLinearizable { .. }
        ));
    }

    #[test]
    fn the_search_is_bounded() {
        // Many concurrent writes and one impossible read: the budget runs out first.
        let mut ops: Vec<LinOp> = (0..40).map(|i| lost_put(&format!("x{i}"), i)).collect();
        ops.push(read(Some(("never", 1)), (100, 200)));
        assert_eq!(check(&ops, None, 1_000), Verdict::Undecided);
    }
}
