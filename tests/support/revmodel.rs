//! The traffic's complete revision history, rebuilt from the recorded watch, and the model state
//! at any revision: every key with its value, create and mod revisions and version.
//!
//! The traffic's watcher follows its prefix from revision 1, and its compactor never compacts past
//! a revision the watcher has delivered (`traffic.rs`), so the union of the recorded streams holds
//! every event of every revision from 1 to the last one delivered. With it every write whose
//! answer was lost is resolved ([`RevModel::resolve`]): a put or transaction whose (unique) value
//! an event carries happened at that event's revision; a delete event that no acknowledged write
//! explains is assigned to a lost delete of that key (or a lost range delete covering every key of
//! the revision); once the history is known to be complete to the end of the run (the traffic's
//! closing write delivered, [`super::traffic::Traffic::complete_history`]), a write no event
//! carries never happened. [`judge`] then checks every acknowledged write, read and transaction
//! against the model with nothing excused.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::kvcheck::{Call, Finding, Op, Ret, Seen, WatchStream};

/// A key as the model holds it at a revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyState {
    pub id: String,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
}

/// One event of the history: a put of value `id`, or a delete (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ev {
    key: String,
    id: Option<String>,
}

/// The revision history as the watch delivered it.
#[derive(Debug, Default)]
pub struct RevModel {
    /// The events of each revision that touched the prefix, in order.
    revisions: BTreeMap<i64, Vec<Ev>>,
    /// Per key: (revision, the key's state after it; None once deleted).
    timelines: HashMap<String, Vec<(i64, Option<KeyState>)>>,
    /// Every revision in `1..=complete_to` was delivered by some stream.
    pub complete_to: i64,
    /// Revision ranges no stream delivered, below the last delivered revision (a compaction past
    /// the watch, which the traffic never does).
    pub gaps: Vec<(i64, i64)>,
}

/// What the history says about each write whose answer was lost (indices into the ops).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Resolution {
    /// Happened at this revision.
    pub happened: HashMap<usize, i64>,
    /// Never happened, or happened with no effect (a delete of an absent key).
    pub not_happened: HashSet<usize>,
    /// Still ambiguous: the history is not complete past their invocation.
    pub unresolved: Vec<usize>,
}

impl Resolution {
    /// Nothing resolved: every lost answer ambiguous (a history without a complete watch).
    pub fn none(ops: &[Op]) -> Resolution {
        Resolution {
            unresolved: (0..ops.len())
                .filter(|i| ops[*i].ret == Ret::Unknown)
                .collect(),
            ..Default::default()
        }
    }
}

impl RevModel {
    /// Rebuilds the history from the recorded streams.
    pub fn build(watches: &[WatchStream]) -> RevModel {
        let mut revisions: BTreeMap<i64, Vec<Ev>> = BTreeMap::new();
        let mut delivered: BTreeMap<i64, i64> = BTreeMap::new();
        for s in watches {
            // Every revision in start..=covered came through this stream (events or none).
            let last = s
                .covered
                .max(s.events.iter().map(|e| e.revision).max().unwrap_or(0));
            if last >= s.start {
                let to = delivered.entry(s.start).or_insert(last);
                *to = (*to).max(last);
            }
            let mut per: BTreeMap<i64, Vec<Ev>> = BTreeMap::new();
            for e in &s.events {
                per.entry(e.revision).or_default().push(Ev {
                    key: e.key.clone(),
                    id: e.id.clone(),
                });
            }
            // Two streams over one revision deliver the same events: keep the first's.
            for (r, evs) in per {
                revisions.entry(r).or_insert(evs);
            }
        }
        let mut complete_to = 0;
        let mut gaps = Vec::new();
        for (from, to) in delivered {
            if from > complete_to + 1 {
                gaps.push((complete_to + 1, from - 1));
            }
            complete_to = complete_to.max(to);
        }
        if !gaps.is_empty() {
            // Complete only up to the first gap.
            complete_to = gaps[0].0 - 1;
        }
        let mut timelines: HashMap<String, Vec<(i64, Option<KeyState>)>> = HashMap::new();
        for (r, evs) in &revisions {
            for e in evs {
                let list = timelines.entry(e.key.clone()).or_default();
                let before = list.last().and_then(|(_, s)| s.clone());
                let after = e.id.as_ref().map(|id| match &before {
                    Some(b) => KeyState {
                        id: id.clone(),
                        create_revision: b.create_revision,
                        mod_revision: *r,
                        version: b.version + 1,
                    },
                    None => KeyState {
                        id: id.clone(),
                        create_revision: *r,
                        mod_revision: *r,
                        version: 1,
                    },
                });
                list.push((*r, after));
            }
        }
        RevModel {
            revisions,
            timelines,
            complete_to,
            gaps,
        }
    }

    /// Whether the model knows every event up to `revision`.
    pub fn knows(&self, revision: i64) -> bool {
        revision <= self.complete_to
    }

    /// The last revision that touched the prefix.
    pub fn last_revision(&self) -> i64 {
        self.revisions.keys().next_back().copied().unwrap_or(0)
    }

    /// `key` at `revision`.
    pub fn key_at(&self, key: &str, revision: i64) -> Option<&KeyState> {
        let list = self.timelines.get(key)?;
        let upto = list.partition_point(|(r, _)| *r <= revision);
        if upto == 0 {
            return None;
        }
        list[upto - 1].1.as_ref()
    }

    /// Every key under `prefix` at `revision`.
    pub fn state_at(&self, prefix: &str, revision: i64) -> BTreeMap<String, KeyState> {
        let mut out = BTreeMap::new();
        for key in self.timelines.keys() {
            if key.starts_with(prefix)
                && let Some(s) = self.key_at(key, revision)
            {
                out.insert(key.clone(), s.clone());
            }
        }
        out
    }

    /// Resolves every write whose answer was lost; `complete` says the history is complete to
    /// the end (no write of the run can still happen after [`RevModel::complete_to`]).
    pub fn resolve(&self, ops: &[Op], complete: bool) -> Resolution {
        let mut res = Resolution::default();
        let acked: HashSet<i64> = ops.iter().filter_map(Op::write_revision).collect();
        let by_id: HashMap<&str, usize> = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| o.ret == Ret::Unknown)
            .filter_map(|(i, o)| match &o.call {
                Call::Put { id, .. } | Call::Txn { id, .. } => Some((id.as_str(), i)),
                _ => None,
            })
            .collect();
        // Lost deletes in the order they were invoked, to be assigned the unexplained deletes.
        let mut deletes: Vec<usize> = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| {
                o.ret == Ret::Unknown
                    && matches!(o.call, Call::Delete { .. } | Call::DeleteRange { .. })
            })
            .map(|(i, _)| i)
            .collect();
        deletes.sort_by_key(|i| ops[*i].invoked);
        let mut assigned: HashSet<usize> = HashSet::new();
        for (r, evs) in &self.revisions {
            for e in evs {
                if let Some(id) = &e.id
                    && let Some(&i) = by_id.get(id.as_str())
                {
                    res.happened.insert(i, *r);
                }
            }
            if acked.contains(r) || evs.iter().any(|e| e.id.is_some()) {
                continue;
            }
            // A revision of deletes only that no acknowledged write explains.
            let keys: Vec<&str> = evs.iter().map(|e| e.key.as_str()).collect();
            let fits = |i: &usize| match &ops[*i].call {
                Call::Delete { key } => keys.len() == 1 && keys[0] == key,
                Call::DeleteRange { prefix } => keys.iter().all(|k| k.starts_with(prefix.as_str())),
                _ => false,
            };
            if let Some(&i) = deletes.iter().find(|i| !assigned.contains(*i) && fits(i)) {
                assigned.insert(i);
                res.happened.insert(i, *r);
            }
        }
        for (i, op) in ops.iter().enumerate() {
            if op.ret != Ret::Unknown || res.happened.contains_key(&i) {
                continue;
            }
            if complete && self.gaps.is_empty() {
                res.not_happened.insert(i);
            } else {
                res.unresolved.push(i);
            }
        }
        res
    }
}

/// Keeps reports short: at most this many findings of one check.
const PER_CHECK: usize = 5;

fn push(out: &mut Vec<Finding>, check: &'static str, detail: String) {
    let n = out.iter().filter(|f| f.check == check).count();
    if n < PER_CHECK {
        out.push(Finding { check, detail });
    } else if n == PER_CHECK {
        out.push(Finding {
            check,
            detail: "… more of this kind left out".into(),
        });
    }
}

/// Judges the history against the model, where the model knows the revision, with nothing
/// excused: every event explained by one write; every acknowledged write in the history at its
/// revision (`lost-write`); every read the model's state at its revision (`lost-write` when the
/// key is missing, `read` otherwise); every transaction's comparison (`txn`).
pub fn judge(model: &RevModel, ops: &[Op], res: &Resolution) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut by_revision: HashMap<i64, usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        if let Some(r) = op.write_revision() {
            by_revision.insert(r, i);
        }
    }
    for (i, r) in &res.happened {
        by_revision.entry(*r).or_insert(*i);
    }
    let ids: HashMap<&str, usize> = ops
        .iter()
        .enumerate()
        .filter_map(|(i, o)| match &o.call {
            Call::Put { id, .. } | Call::Txn { id, .. } => Some((id.as_str(), i)),
            _ => None,
        })
        .collect();
    // Every event comes from the write of its revision.
    for (r, evs) in &model.revisions {
        if !model.knows(*r) {
            break;
        }
        let writer = by_revision.get(r).map(|i| &ops[*i]);
        for e in evs {
            let explained = match (&e.id, writer) {
                (Some(id), _) => {
                    ids.get(id.as_str())
                        .is_some_and(|i| ops[*i].call.writes_key(&e.key))
                        && writer.is_none_or(|w| w.call.id() == Some(id.as_str()))
                }
                (None, Some(w)) => w.call.deletes() && w.call.writes_key(&e.key),
                (None, None) => false,
            };
            if !explained {
                push(
                    &mut out,
                    "watch-event",
                    format!(
                        "revision {r}: {} {} is explained by no write of the history ({:?})",
                        e.key,
                        e.id.as_deref().unwrap_or("deleted"),
                        writer.map(|w| &w.call)
                    ),
                );
            }
        }
    }
    for op in ops {
        match (&op.call, &op.ret) {
            (Call::Get { key }, Ret::Read { revision, kv }) if model.knows(*revision) => {
                let want = model.key_at(key, *revision);
                let same = match (kv, want) {
                    (None, None) => true,
                    (Some(s), Some(w)) => s.id == w.id && s.mod_revision == w.mod_revision,
                    _ => false,
                };
                if !same {
                    let check = if kv.is_none() { "lost-write" } else { "read" };
                    push(
                        &mut out,
                        check,
                        format!(
                            "get {key} at {:.3}s (revision {revision}) saw {kv:?}; the history \
                             holds {want:?}",
                            op.completed.as_secs_f64()
                        ),
                    );
                }
            }
            (
                Call::Txn { key, expect, .. },
                Ret::Write {
                    revision,
                    succeeded,
                },
            ) if model.knows(*revision) => {
                let at = if *succeeded { revision - 1 } else { *revision };
                let current = model.key_at(key, at).map_or(0, |s| s.mod_revision);
                if (current == *expect) != *succeeded {
                    push(
                        &mut out,
                        "txn",
                        format!(
                            "txn on {key} expecting mod revision {expect} (succeeded: \
                             {succeeded}) at revision {revision}; the history's mod revision \
                             there is {current}"
                        ),
                    );
                }
            }
            _ => {}
        }
        if let Some(r) = op.write_revision()
            && model.knows(r)
        {
            let evs = model.revisions.get(&r);
            let present = match &op.call {
                Call::Put { key, id } | Call::Txn { key, id, .. } => evs.is_some_and(|evs| {
                    evs.iter()
                        .any(|e| &e.key == key && e.id.as_deref() == Some(id.as_str()))
                }),
                Call::Delete { key } => {
                    evs.is_some_and(|evs| evs.iter().any(|e| &e.key == key && e.id.is_none()))
                }
                Call::DeleteRange { .. } => {
                    evs.is_some_and(|evs| evs.iter().all(|e| e.id.is_none()))
                }
                Call::Get { .. } => true,
            };
            if !present {
                push(
                    &mut out,
                    "lost-write",
                    format!(
                        "{:?} acknowledged at revision {r} ({:.3}s) is not in the history",
                        op.call,
                        op.completed.as_secs_f64()
                    ),
                );
            }
        }
    }
    out
}

/// Judges a restored cluster's traffic keys (value and mod revision) against the model at
/// `revision`: every key the model holds, and no other.
pub fn judge_contents(
    model: &RevModel,
    prefix: &str,
    revision: i64,
    contents: &BTreeMap<String, Seen>,
) -> Vec<String> {
    let want = model.state_at(prefix, revision);
    let mut out = Vec::new();
    for (k, w) in &want {
        match contents.get(k) {
            None => out.push(format!("{k} missing (the history holds {w:?})")),
            Some(s) if s.id != w.id || s.mod_revision != w.mod_revision => {
                out.push(format!("{k} is {s:?}, the history holds {w:?}"))
            }
            _ => {}
        }
    }
    for (k, s) in contents {
        if !want.contains_key(k) {
            out.push(format!("{k} is {s:?}, absent in the history"));
        }
    }
    out
}

impl Call {
    fn writes_key(&self, key: &str) -> bool {
        match self {
            Call::Put { key: k, .. } | Call::Delete { key: k } | Call::Txn { key: k, .. } => {
                k == key
            }
            Call::DeleteRange { prefix } => key.starts_with(prefix.as_str()),
            Call::Get { .. } => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::kvcheck::WatchEvent;
    use super::*;
    use std::time::Duration;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn op(call: Call, t: (u64, u64), ret: Ret) -> Op {
        Op {
            worker: 0,
            call,
            invoked: ms(t.0),
            completed: ms(t.1),
            ret,
        }
    }

    fn put(id: &str, key: &str, t: (u64, u64), rev: Option<i64>) -> Op {
        op(
            Call::Put {
                key: key.into(),
                id: id.into(),
            },
            t,
            rev.map_or(Ret::Unknown, |revision| Ret::Write {
                revision,
                succeeded: true,
            }),
        )
    }

    fn ev(key: &str, revision: i64, id: Option<&str>) -> WatchEvent {
        WatchEvent {
            key: key.into(),
            revision,
            id: id.map(Into::into),
        }
    }

    fn stream(start: i64, events: Vec<WatchEvent>, covered: i64) -> WatchStream {
        WatchStream {
            start,
            events,
            covered,
            compacted: false,
        }
    }

    #[test]
    fn the_state_at_a_revision_has_create_and_mod_revisions_and_versions() {
        let w = vec![
            stream(1, vec![ev("/k", 2, Some("a")), ev("/k", 3, Some("b"))], 3),
            stream(4, vec![ev("/k", 5, None), ev("/k", 6, Some("c"))], 6),
        ];
        let m = RevModel::build(&w);
        assert_eq!(m.complete_to, 6);
        let s = m.key_at("/k", 4).unwrap();
        assert_eq!(
            (s.id.as_str(), s.create_revision, s.mod_revision, s.version),
            ("b", 2, 3, 2)
        );
        assert_eq!(m.key_at("/k", 5), None);
        let s = m.key_at("/k", 9).unwrap();
        assert_eq!((s.create_revision, s.version), (6, 1));
        assert_eq!(m.state_at("/", 1).len(), 0);
    }

    #[test]
    fn a_stream_that_starts_past_a_gap_stops_the_complete_history() {
        let w = vec![
            stream(1, vec![ev("/k", 2, Some("a"))], 3),
            stream(6, vec![ev("/k", 7, Some("b"))], 8),
        ];
        let m = RevModel::build(&w);
        assert_eq!((m.complete_to, m.gaps.clone()), (3, vec![(4, 5)]));
    }

    #[test]
    fn lost_answers_are_resolved_by_the_history() {
        let del = op(Call::Delete { key: "/k".into() }, (20, 25), Ret::Unknown);
        let ops = vec![
            put("a", "/k", (0, 10), None),
            put("b", "/j", (0, 10), None),
            del,
        ];
        let w = vec![stream(
            1,
            vec![ev("/k", 2, Some("a")), ev("/k", 4, None)],
            9,
        )];
        let m = RevModel::build(&w);
        let done = m.resolve(&ops, true);
        assert_eq!(done.happened, [(0, 2), (2, 4)].into());
        assert_eq!(done.not_happened, [1].into());
        assert!(done.unresolved.is_empty());
        let open = m.resolve(&ops, false);
        assert_eq!(open.unresolved, vec![1]);
        assert!(judge(&m, &ops, &done).is_empty());
    }

    #[test]
    fn an_acknowledged_write_missing_from_the_history_is_a_lost_write() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(2)),
            put("b", "/k", (11, 20), Some(3)),
            op(
                Call::Get { key: "/k".into() },
                (21, 22),
                Ret::Read {
                    revision: 3,
                    kv: Some(Seen {
                        id: "b".into(),
                        mod_revision: 3,
                    }),
                },
            ),
        ];
        let whole = vec![stream(
            1,
            vec![ev("/k", 2, Some("a")), ev("/k", 3, Some("b"))],
            3,
        )];
        let m = RevModel::build(&whole);
        assert!(judge(&m, &ops, &m.resolve(&ops, true)).is_empty());
        let dropped = vec![stream(1, vec![ev("/k", 2, Some("a"))], 3)];
        let m = RevModel::build(&dropped);
        let found: Vec<_> = judge(&m, &ops, &m.resolve(&ops, true))
            .into_iter()
            .map(|f| f.check)
            .collect();
        assert_eq!(found, vec!["lost-write", "read"]);
    }

    #[test]
    fn a_restored_cluster_is_judged_key_by_key() {
        let w = vec![stream(
            1,
            vec![ev("/k", 2, Some("a")), ev("/j", 3, Some("b"))],
            3,
        )];
        let m = RevModel::build(&w);
        let seen = |id: &str, r| Seen {
            id: id.into(),
            mod_revision: r,
        };
        let good: BTreeMap<String, Seen> = [("/k".to_string(), seen("a", 2))].into();
        assert!(judge_contents(&m, "/", 2, &good).is_empty());
        assert_eq!(judge_contents(&m, "/", 3, &good).len(), 1);
    }
}
