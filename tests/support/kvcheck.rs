//! The recorded KV history of a robustness run, judged against etcd's model.
//!
//! Every write carries a value that names it (`<id>:<len>|<padding>`), so a read tells which write
//! it saw; etcd answers every request with a revision, which makes the check close to
//! deterministic instead of a search over orders (as Jepsen's Knossos or etcd's porcupine model
//! must do without one). What is judged, and on which operations:
//!
//! - **unique revisions**: no two acknowledged writes (puts, deletes, range deletes, successful
//!   transactions) carry the same revision;
//! - **real time**: an operation invoked after another completed sees a revision at least as new
//!   (a write gets a greater one; a read's header revision is not smaller), so reads after a
//!   rejoin, a restore or a defragmentation never go back in time;
//! - **reads see the latest write**: a linearizable read of a key at header revision `H` returns
//!   the write with the greatest revision `<= H` to that key: the value named by its mod
//!   revision, no acknowledged write to the key in `(mod_revision, H]`, and absent only when the
//!   latest such write deleted it (or a delete whose answer was lost may have);
//! - **transactions**: a compare on the mod revision that succeeded at revision `R` saw no
//!   acknowledged write to the key in `(expected, R)`;
//! - **the watch**: events come in revision order, each matches the acknowledged write of its
//!   revision, and every acknowledged write in the revisions a stream covered is among its events;
//! - **a restored cluster** (the hand-off's destination) holds the state at the final's revision:
//!   each key as a linearizable read at that revision would see it.
//!
//! Writes whose answer was lost (an error or a timeout) may or may not have happened: their
//! revision is learnt when a read or the watch sees their value, and they excuse nothing else.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use serde::Serialize;

use super::revmodel::Resolution;

/// What a client asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Call {
    Put {
        key: String,
        id: String,
    },
    Delete {
        key: String,
    },
    /// Deletes every key starting with `prefix`.
    DeleteRange {
        prefix: String,
    },
    /// `if mod_revision(key) == expect then put(key, id)`.
    Txn {
        key: String,
        expect: i64,
        id: String,
    },
    Get {
        key: String,
    },
}

impl Call {
    fn writes(&self, key: &str) -> bool {
        match self {
            Call::Put { key: k, .. } | Call::Delete { key: k } | Call::Txn { key: k, .. } => {
                k == key
            }
            Call::DeleteRange { prefix } => key.starts_with(prefix.as_str()),
            Call::Get { .. } => false,
        }
    }

    /// The value id this call may write.
    pub fn id(&self) -> Option<&str> {
        match self {
            Call::Put { id, .. } | Call::Txn { id, .. } => Some(id),
            _ => None,
        }
    }

    /// Whether this call deletes.
    pub fn deletes(&self) -> bool {
        matches!(self, Call::Delete { .. } | Call::DeleteRange { .. })
    }
}

/// A key as a read saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Seen {
    pub id: String,
    pub mod_revision: i64,
}

/// What etcd answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Ret {
    /// No answer (error or timeout): a write may have happened.
    Unknown,
    /// A write's revision (a transaction's: whether it succeeded; a failed one's is the header's).
    Write { revision: i64, succeeded: bool },
    /// A read: the header revision and the key, if present.
    Read { revision: i64, kv: Option<Seen> },
}

/// One operation of the history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Op {
    pub worker: u32,
    pub call: Call,
    pub invoked: Duration,
    pub completed: Duration,
    pub ret: Ret,
}

impl Op {
    /// The revision of an acknowledged write that changed something.
    pub fn write_revision(&self) -> Option<i64> {
        match (&self.call, &self.ret) {
            (Call::Get { .. }, _) => None,
            (
                _,
                Ret::Write {
                    revision,
                    succeeded,
                },
            ) if *succeeded => Some(*revision),
            _ => None,
        }
    }

    fn revision(&self) -> Option<i64> {
        match &self.ret {
            Ret::Write { revision, .. } | Ret::Read { revision, .. } => Some(*revision),
            Ret::Unknown => None,
        }
    }
}

/// One event a watch stream delivered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WatchEvent {
    pub key: String,
    pub revision: i64,
    /// The put's value id; None for a delete.
    pub id: Option<String>,
}

/// One watch stream: from `start` (the first revision it asked for) over its events, until it
/// ended; `covered` is the last revision it is known to have delivered everything up to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WatchStream {
    pub start: i64,
    pub events: Vec<WatchEvent>,
    /// Progress: every revision `< covered` was delivered (events or none).
    pub covered: i64,
    /// The stream ended because etcd compacted `start` away.
    pub compacted: bool,
}

/// A broken promise of the KV history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub check: &'static str,
    pub detail: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.check, self.detail)
    }
}

/// Keeps reports short: at most this many findings of one check.
const PER_CHECK: usize = 5;

struct Model<'a> {
    ops: &'a [Op],
    /// Acknowledged writes per revision.
    by_revision: BTreeMap<i64, usize>,
    /// Acknowledged writes to one key (puts, deletes, transactions), by revision, per key.
    by_key: HashMap<&'a str, Vec<(i64, usize)>>,
    /// Acknowledged range deletes: (revision, op).
    ranges: Vec<(i64, usize)>,
    /// Value id → the op that wrote it.
    by_id: HashMap<&'a str, usize>,
    /// Revisions learnt for writes whose answer was lost (from reads and the watch), per key.
    learnt: HashMap<&'a str, Vec<(i64, usize)>>,
    /// The earliest invocation of a delete of each key whose answer was lost.
    lost_deletes: HashMap<&'a str, Duration>,
    /// The earliest invocation of any write to each key whose answer was lost.
    lost_writes: HashMap<&'a str, Duration>,
    /// Range deletes whose answer was lost: (prefix, invoked).
    lost_ranges: Vec<(&'a str, Duration)>,
}

impl<'a> Model<'a> {
    /// The model with what `res` resolved: a lost answer resolved as happened is a write at its
    /// revision, one resolved as never happened is nothing; only the unresolved ones may excuse.
    fn new(ops: &'a [Op], res: &Resolution) -> Model<'a> {
        let unresolved: std::collections::HashSet<usize> = res.unresolved.iter().copied().collect();
        let mut m = Model {
            ops,
            by_revision: BTreeMap::new(),
            by_key: HashMap::new(),
            ranges: Vec::new(),
            by_id: HashMap::new(),
            learnt: HashMap::new(),
            lost_deletes: HashMap::new(),
            lost_writes: HashMap::new(),
            lost_ranges: Vec::new(),
        };
        for (i, op) in ops.iter().enumerate() {
            if let Some(r) = op.write_revision().or(res.happened.get(&i).copied()) {
                m.by_revision.entry(r).or_insert(i);
                match &op.call {
                    Call::DeleteRange { .. } => m.ranges.push((r, i)),
                    Call::Put { key, .. } | Call::Delete { key } | Call::Txn { key, .. } => {
                        m.by_key.entry(key).or_default().push((r, i))
                    }
                    Call::Get { .. } => {}
                }
            }
            if let Some(id) = op.call.id() {
                m.by_id.insert(id, i);
            }
            if op.ret == Ret::Unknown && unresolved.contains(&i) {
                if let Call::Put { key, .. } | Call::Txn { key, .. } | Call::Delete { key } =
                    &op.call
                {
                    let t = m.lost_writes.entry(key).or_insert(op.invoked);
                    *t = (*t).min(op.invoked);
                }
                match &op.call {
                    Call::Delete { key } => {
                        let t = m.lost_deletes.entry(key).or_insert(op.invoked);
                        *t = (*t).min(op.invoked);
                    }
                    Call::DeleteRange { prefix } => m.lost_ranges.push((prefix, op.invoked)),
                    _ => {}
                }
            }
        }
        for list in m.by_key.values_mut() {
            list.sort_unstable();
        }
        m.ranges.sort_unstable();
        m
    }

    /// What reads and the watch teach about writes whose answer was lost.
    fn learn(&mut self, ops: &'a [Op], watches: &[WatchStream]) {
        let mut learnt: Vec<(usize, i64)> = Vec::new();
        for op in ops {
            if let Ret::Read { kv: Some(s), .. } = &op.ret
                && let Some(&w) = self.by_id.get(s.id.as_str())
                && ops[w].ret == Ret::Unknown
            {
                learnt.push((w, s.mod_revision));
            }
        }
        for stream in watches {
            for e in &stream.events {
                if let Some(id) = &e.id
                    && let Some(&w) = self.by_id.get(id.as_str())
                    && ops[w].ret == Ret::Unknown
                {
                    learnt.push((w, e.revision));
                }
            }
        }
        for (w, r) in learnt {
            if let Call::Put { key, .. } | Call::Txn { key, .. } = &ops[w].call {
                let list = self.learnt.entry(key).or_default();
                if !list.contains(&(r, w)) {
                    list.push((r, w));
                }
            }
        }
    }

    /// Acknowledged writes to `key` with a revision in `(lo, hi]`.
    fn acked_writes_between(&self, key: &str, lo: i64, hi: i64) -> Vec<(i64, &'a Op)> {
        if hi <= lo {
            return Vec::new();
        }
        let mut out: Vec<(i64, &'a Op)> = Vec::new();
        if let Some(list) = self.by_key.get(key) {
            let from = list.partition_point(|(r, _)| *r <= lo);
            out.extend(
                list[from..]
                    .iter()
                    .take_while(|(r, _)| *r <= hi)
                    .map(|(r, i)| (*r, &self.ops[*i])),
            );
        }
        let from = self.ranges.partition_point(|(r, _)| *r <= lo);
        out.extend(
            self.ranges[from..]
                .iter()
                .take_while(|(r, _)| *r <= hi)
                .map(|(r, i)| (*r, &self.ops[*i]))
                .filter(|(_, op)| op.call.writes(key)),
        );
        out.sort_by_key(|(r, _)| *r);
        out
    }

    /// The latest write to `key` at or below `rev` (acknowledged, or learnt).
    fn latest_write(&self, key: &str, rev: i64) -> Option<(i64, &'a Op)> {
        let mut best: Option<(i64, &'a Op)> = None;
        let mut consider = |r: i64, i: usize| {
            if r <= rev && best.is_none_or(|(b, _)| r > b) {
                best = Some((r, &self.ops[i]));
            }
        };
        if let Some(list) = self.by_key.get(key) {
            let upto = list.partition_point(|(r, _)| *r <= rev);
            if upto > 0 {
                consider(list[upto - 1].0, list[upto - 1].1);
            }
        }
        let upto = self.ranges.partition_point(|(r, _)| *r <= rev);
        if let Some((r, i)) = self.ranges[..upto]
            .iter()
            .rev()
            .find(|(_, i)| self.ops[*i].call.writes(key))
        {
            consider(*r, *i);
        }
        for (r, i) in self.learnt.get(key).into_iter().flatten() {
            consider(*r, *i);
        }
        best
    }

    /// Whether any write to `key` whose answer was lost was invoked before `before`.
    fn lost_write(&self, key: &str, before: Duration) -> bool {
        self.lost_writes.get(key).is_some_and(|t| *t < before)
            || self
                .lost_ranges
                .iter()
                .any(|(p, t)| key.starts_with(p) && *t < before)
    }

    /// Whether a delete of `key` whose answer was lost was invoked before `before`.
    fn lost_delete(&self, key: &str, before: Duration) -> bool {
        self.lost_deletes.get(key).is_some_and(|t| *t < before)
            || self
                .lost_ranges
                .iter()
                .any(|(p, t)| key.starts_with(p) && *t < before)
    }
}

/// Judges the history; `reads` adds reads that are not operations (a restored cluster's
/// contents, as reads at its revision: see [`restored_state`]).
pub fn check(ops: &[Op], watches: &[WatchStream]) -> Vec<Finding> {
    check_resolved(ops, watches, &Resolution::none(ops))
}

/// As [`check`], with the lost answers `res` resolved from the revision history: only the
/// unresolved ones excuse anything (and those keys go to the linearizability search).
pub fn check_resolved(ops: &[Op], watches: &[WatchStream], res: &Resolution) -> Vec<Finding> {
    let mut model = Model::new(ops, res);
    let mut out = Vec::new();
    let push = |out: &mut Vec<Finding>, check: &'static str, detail: String| {
        if out.iter().filter(|f| f.check == check).count() < PER_CHECK {
            out.push(Finding { check, detail });
        } else if out.iter().filter(|f| f.check == check).count() == PER_CHECK {
            out.push(Finding {
                check,
                detail: "… more of this kind left out".into(),
            });
        }
    };

    // Unique revisions.
    let mut seen: HashMap<i64, usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        if let Some(r) = op.write_revision()
            && let Some(j) = seen.insert(r, i)
        {
            push(
                &mut out,
                "unique-revision",
                format!(
                    "{:?} and {:?} both acknowledged at revision {r}",
                    ops[j], op
                ),
            );
        }
    }

    model.learn(ops, watches);

    // Real time: sweep the operations in the order they were invoked, with the greatest revision
    // of those completed before.
    let mut by_completion: Vec<&Op> = ops.iter().filter(|o| o.revision().is_some()).collect();
    by_completion.sort_by_key(|o| o.completed);
    let mut by_invocation: Vec<&Op> = ops.iter().filter(|o| o.revision().is_some()).collect();
    by_invocation.sort_by_key(|o| o.invoked);
    let mut before: Option<&Op> = None;
    let mut k = 0;
    for op in by_invocation {
        while k < by_completion.len() && by_completion[k].completed < op.invoked {
            let c = by_completion[k];
            if before.is_none_or(|b| c.revision() > b.revision()) {
                before = Some(c);
            }
            k += 1;
        }
        let (Some(b), Some(r)) = (before, op.revision()) else {
            continue;
        };
        let br = b.revision().unwrap_or(0);
        let stale = if op.write_revision().is_some() {
            r <= br
        } else {
            r < br
        };
        if stale {
            push(
                &mut out,
                "real-time",
                format!(
                    "{:?} invoked at {:.3}s got revision {r}, older than {br} of {:?} completed at \
                     {:.3}s",
                    op.call,
                    op.invoked.as_secs_f64(),
                    b.call,
                    b.completed.as_secs_f64()
                ),
            );
        }
    }

    // Reads.
    for op in ops {
        let (Call::Get { key }, Ret::Read { revision, kv }) = (&op.call, &op.ret) else {
            continue;
        };
        if let Some(f) = judge_read(&model, key, *revision, kv.as_ref(), op.completed) {
            push(
                &mut out,
                "read",
                format!(
                    "get {key} at {:.3}s (header revision {revision}) saw {kv:?}: {f}",
                    op.completed.as_secs_f64()
                ),
            );
        }
    }

    // Transactions that succeeded: the key's mod revision just before was the one expected (0:
    // absent). Writes whose answer was lost excuse a mismatch (their revision may be unknown).
    for op in ops {
        let (Call::Txn { key, expect, .. }, Some(r)) = (&op.call, op.write_revision()) else {
            continue;
        };
        let before = model.latest_write(key, r - 1);
        let holds = match before {
            None => *expect == 0,
            Some((_, w)) if w.call.deletes() => *expect == 0,
            Some((wr, _)) => wr == *expect,
        };
        if !holds && !model.lost_write(key, op.completed) {
            push(
                &mut out,
                "txn",
                format!(
                    "txn on {key} expecting mod revision {expect} succeeded at {r}, yet the \
                     latest write before it was {:?}",
                    before.map(|(wr, w)| (wr, &w.call))
                ),
            );
        }
    }

    // The watch.
    for (n, stream) in watches.iter().enumerate() {
        let mut last = 0;
        for e in &stream.events {
            if e.revision < last {
                push(
                    &mut out,
                    "watch-order",
                    format!(
                        "stream {n}: event {} at revision {} after revision {last}",
                        e.key, e.revision
                    ),
                );
            }
            last = e.revision;
            if let Some(&i) = model.by_revision.get(&e.revision) {
                let w = &ops[i];
                let matches = w.call.writes(&e.key)
                    && match (&w.call, &e.id) {
                        (Call::Put { id, .. } | Call::Txn { id, .. }, Some(e_id)) => id == e_id,
                        (Call::Delete { .. } | Call::DeleteRange { .. }, None) => true,
                        _ => false,
                    };
                if !matches {
                    push(
                        &mut out,
                        "watch-event",
                        format!(
                            "stream {n}: event {e:?} does not match {:?} acknowledged at that \
                             revision",
                            w.call
                        ),
                    );
                }
            }
        }
        let delivered: std::collections::HashSet<i64> =
            stream.events.iter().map(|e| e.revision).collect();
        // A stream that delivered nothing covers `start - 1`.
        for (r, i) in model
            .by_revision
            .range(stream.start..stream.covered.max(stream.start))
        {
            if !delivered.contains(r) && !matches!(ops[*i].call, Call::DeleteRange { .. }) {
                push(
                    &mut out,
                    "watch-missed",
                    format!(
                        "stream {n} (revisions {}..{}) never delivered {:?} acknowledged at {r}",
                        stream.start, stream.covered, ops[*i].call
                    ),
                );
            }
        }
    }
    out
}

/// Why a read of `key` at header revision `at` that saw `kv` breaks the model, if it does.
fn judge_read(
    model: &Model<'_>,
    key: &str,
    at: i64,
    kv: Option<&Seen>,
    completed: Duration,
) -> Option<String> {
    match kv {
        Some(s) => {
            if s.mod_revision > at {
                return Some(format!(
                    "mod revision {} above the header revision",
                    s.mod_revision
                ));
            }
            match model.by_id.get(s.id.as_str()) {
                None => return Some(format!("value {} was never written", s.id)),
                Some(&w) => {
                    let op = &model.ops[w];
                    if !op.call.writes(key) {
                        return Some(format!("value {} was written to another key", s.id));
                    }
                    if let Some(r) = op.write_revision()
                        && r != s.mod_revision
                    {
                        return Some(format!(
                            "value {} was acknowledged at revision {r}, not {}",
                            s.id, s.mod_revision
                        ));
                    }
                }
            }
            let newer = model.acked_writes_between(key, s.mod_revision, at);
            newer.first().map(|(r, w)| {
                format!(
                    "{:?} was acknowledged at revision {r}, after the value read and not after \
                     the read's revision",
                    w.call
                )
            })
        }
        None => match model.latest_write(key, at) {
            Some((r, w)) if !w.call.deletes() && !model.lost_delete(key, completed) => {
                Some(format!(
                    "absent, yet {:?} at revision {r} is the latest write at or below it",
                    w.call
                ))
            }
            _ => None,
        },
    }
}

/// Judges a restored cluster's contents under the prefixes the history wrote: each key as a
/// read at `revision` (the final's) would see it, and every key the history leaves present at
/// that revision is there.
pub fn restored_state(
    ops: &[Op],
    watches: &[WatchStream],
    revision: i64,
    contents: &BTreeMap<String, Seen>,
) -> Vec<Finding> {
    let mut model = Model::new(ops, &Resolution::none(ops));
    model.learn(ops, watches);
    let mut keys: std::collections::BTreeSet<&str> = contents.keys().map(String::as_str).collect();
    for op in ops {
        if let Call::Put { key, .. } | Call::Txn { key, .. } = &op.call
            && op.write_revision().is_some_and(|r| r <= revision)
        {
            keys.insert(key);
        }
    }
    let mut out = Vec::new();
    for key in keys {
        if let Some(f) = judge_read(&model, key, revision, contents.get(key), Duration::MAX) {
            if out.len() >= 2 * PER_CHECK {
                out.push(Finding {
                    check: "restored",
                    detail: "… more left out".into(),
                });
                break;
            }
            out.push(Finding {
                check: "restored",
                detail: format!("{key} at revision {revision}: {f}"),
            });
        }
    }
    out
}

/// A value that names its write: `<id>:<len>|` and padding to `len` bytes in all.
pub fn value_of(id: &str, len: usize) -> String {
    let head = format!("{id}:{len}|");
    let pad = len.saturating_sub(head.len());
    let mut v = String::with_capacity(head.len() + pad);
    v.push_str(&head);
    v.extend(std::iter::repeat_n('v', pad));
    v
}

/// The id a value names; None when the value is not one [`value_of`] made whole (a torn or
/// foreign value: the read check then says it was never written).
pub fn id_of(value: &[u8]) -> Option<String> {
    let bar = value.iter().position(|b| *b == b'|')?;
    let head = std::str::from_utf8(&value[..bar]).ok()?;
    let (id, len) = head.rsplit_once(':')?;
    let len: usize = len.parse().ok()?;
    (value.len() == len.max(bar + 1)).then(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn put(id: &str, key: &str, t: (u64, u64), rev: Option<i64>) -> Op {
        Op {
            worker: 0,
            call: Call::Put {
                key: key.into(),
                id: id.into(),
            },
            invoked: ms(t.0),
            completed: ms(t.1),
            ret: rev.map_or(Ret::Unknown, |revision| Ret::Write {
                revision,
                succeeded: true,
            }),
        }
    }

    fn get(key: &str, t: (u64, u64), rev: i64, kv: Option<(&str, i64)>) -> Op {
        Op {
            worker: 1,
            call: Call::Get { key: key.into() },
            invoked: ms(t.0),
            completed: ms(t.1),
            ret: Ret::Read {
                revision: rev,
                kv: kv.map(|(id, m)| Seen {
                    id: id.into(),
                    mod_revision: m,
                }),
            },
        }
    }

    fn checks(ops: &[Op]) -> Vec<&'static str> {
        check(ops, &[]).into_iter().map(|f| f.check).collect()
    }

    #[test]
    fn a_consistent_history_passes() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(2)),
            get("/k", (11, 12), 2, Some(("a", 2))),
            put("b", "/k", (13, 20), Some(3)),
            get("/k", (15, 16), 2, Some(("a", 2))), // concurrent with b: may miss it
            get("/k", (21, 22), 3, Some(("b", 3))),
        ];
        assert_eq!(checks(&ops), Vec::<&str>::new());
    }

    #[test]
    fn a_stale_read_is_found() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(2)),
            put("b", "/k", (11, 20), Some(3)),
            get("/k", (21, 22), 3, Some(("a", 2))),
        ];
        assert_eq!(checks(&ops), vec!["read"]);
    }

    #[test]
    fn a_read_going_back_in_time_is_found() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(5)),
            get("/other", (11, 12), 4, None),
        ];
        assert_eq!(checks(&ops), vec!["real-time"]);
    }

    #[test]
    fn a_lost_acknowledged_write_is_found_absent() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(2)),
            get("/k", (11, 12), 2, None),
        ];
        assert_eq!(checks(&ops), vec!["read"]);
    }

    #[test]
    fn a_write_with_a_lost_answer_may_be_seen_or_not() {
        let seen = vec![
            put("a", "/k", (0, 10), None),
            get("/k", (11, 12), 7, Some(("a", 7))),
        ];
        assert_eq!(checks(&seen), Vec::<&str>::new());
        let unseen = vec![put("a", "/k", (0, 10), None), get("/k", (11, 12), 7, None)];
        assert_eq!(checks(&unseen), Vec::<&str>::new());
    }

    #[test]
    fn duplicate_revisions_and_foreign_values_are_found() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(2)),
            put("b", "/j", (0, 10), Some(2)),
        ];
        assert!(checks(&ops).contains(&"unique-revision"));
        let ops = vec![get("/k", (0, 1), 3, Some(("zz", 2)))];
        assert_eq!(checks(&ops), vec!["read"]);
    }

    #[test]
    fn a_range_delete_covers_its_keys() {
        let mut ops = vec![put("a", "/r/1/x", (0, 10), Some(2))];
        ops.push(Op {
            worker: 0,
            call: Call::DeleteRange {
                prefix: "/r/1/".into(),
            },
            invoked: ms(11),
            completed: ms(12),
            ret: Ret::Write {
                revision: 3,
                succeeded: true,
            },
        });
        ops.push(get("/r/1/x", (13, 14), 3, None));
        assert_eq!(checks(&ops), Vec::<&str>::new());
        ops.push(get("/r/1/x", (15, 16), 3, Some(("a", 2))));
        assert_eq!(checks(&ops), vec!["read"]);
    }

    #[test]
    fn the_watch_must_deliver_every_acknowledged_write_in_order() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(2)),
            put("b", "/k", (11, 20), Some(3)),
        ];
        let ok = WatchStream {
            start: 1,
            events: vec![
                WatchEvent {
                    key: "/k".into(),
                    revision: 2,
                    id: Some("a".into()),
                },
                WatchEvent {
                    key: "/k".into(),
                    revision: 3,
                    id: Some("b".into()),
                },
            ],
            covered: 4,
            compacted: false,
        };
        assert!(check(&ops, std::slice::from_ref(&ok)).is_empty());
        // A stream that delivered nothing yet covers the revision before its start.
        let empty = WatchStream {
            start: 5,
            events: Vec::new(),
            covered: 4,
            compacted: false,
        };
        assert!(check(&ops, &[empty]).is_empty());
        let mut missed = ok.clone();
        missed.events.remove(0);
        let found: Vec<_> = check(&ops, &[missed])
            .into_iter()
            .map(|f| f.check)
            .collect();
        assert_eq!(found, vec!["watch-missed"]);
        let mut wrong = ok.clone();
        wrong.events[1].id = Some("a".into());
        let found: Vec<_> = check(&ops, &[wrong]).into_iter().map(|f| f.check).collect();
        assert_eq!(found, vec!["watch-event"]);
    }

    #[test]
    fn a_restored_cluster_must_hold_the_state_at_the_final() {
        let ops = vec![
            put("a", "/k", (0, 10), Some(2)),
            put("b", "/j", (11, 20), Some(3)),
            put("c", "/k", (21, 30), Some(4)),
        ];
        let at3: BTreeMap<String, Seen> = [
            (
                "/k".to_string(),
                Seen {
                    id: "a".into(),
                    mod_revision: 2,
                },
            ),
            (
                "/j".to_string(),
                Seen {
                    id: "b".into(),
                    mod_revision: 3,
                },
            ),
        ]
        .into();
        assert!(restored_state(&ops, &[], 3, &at3).is_empty());
        let mut lost = at3.clone();
        lost.remove("/j");
        assert_eq!(restored_state(&ops, &[], 3, &lost).len(), 1);
        // At revision 4 the older value of /k is stale.
        assert_eq!(restored_state(&ops, &[], 4, &at3).len(), 1);
    }

    #[test]
    fn a_transaction_must_see_the_revision_it_compared() {
        let txn = |expect: i64, rev: i64, t: u64| Op {
            worker: 0,
            call: Call::Txn {
                key: "/k".into(),
                expect,
                id: format!("t{rev}"),
            },
            invoked: ms(t),
            completed: ms(t + 1),
            ret: Ret::Write {
                revision: rev,
                succeeded: true,
            },
        };
        let del = Op {
            worker: 0,
            call: Call::Delete { key: "/k".into() },
            invoked: ms(20),
            completed: ms(21),
            ret: Ret::Write {
                revision: 4,
                succeeded: true,
            },
        };
        let good = vec![txn(0, 2, 0), txn(2, 3, 10), del.clone(), txn(0, 5, 30)];
        assert_eq!(checks(&good), Vec::<&str>::new());
        let bad = vec![txn(0, 2, 0), txn(0, 3, 10)];
        assert_eq!(checks(&bad), vec!["txn"]);
        let stale = vec![txn(0, 2, 0), txn(2, 3, 10), txn(2, 4, 20)];
        assert_eq!(checks(&stale), vec!["txn"]);
    }

    #[test]
    fn values_name_their_write() {
        let v = value_of("w1-7", 100);
        assert_eq!(v.len(), 100);
        assert_eq!(id_of(v.as_bytes()).as_deref(), Some("w1-7"));
        assert_eq!(id_of(&v.as_bytes()[..50]), None);
        let short = value_of("w1-8", 3);
        assert_eq!(id_of(short.as_bytes()).as_deref(), Some("w1-8"));
    }
}
