//! The copy job's decisions as pure functions: is the final snapshot there, which snapshots to
//! copy, what each is called at the destination, and which are already there.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::store::Snapshot;
use crate::store::layout::FINAL_SUFFIX;

/// A source snapshot and its stored (compressed) size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The snapshot, as named in its store.
    pub snapshot: Snapshot,
    /// Bytes stored.
    pub size: u64,
}

/// Which snapshots to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Selection {
    /// The newest this many full snapshots and their deltas; 0 for all.
    pub max_backups: u64,
    /// Only snapshots younger than this (plus the full snapshots their deltas need).
    pub max_age: Option<Duration>,
}

/// The snapshots to copy from a sorted listing, in the same order.
///
/// `max_backups` keeps the newest N full snapshots and every delta after the oldest of them;
/// `max_age` keeps snapshots created at or after `now - max_age`, plus the full snapshot each
/// kept delta is based on and the deltas between them (a delta without its base, or after a
/// missing one, restores nothing). With both, a snapshot
/// must pass both. Any full snapshot marked final and the deltas after it are always kept: that
/// is the data the migration moves.
pub fn select(sorted: &[Snapshot], selection: Selection, now: DateTime<Utc>) -> Vec<Snapshot> {
    let n = sorted.len();
    let mut keep = vec![true; n];
    // The base full snapshot of each entry (itself for a full one).
    let mut base = vec![None; n];
    let mut current = None;
    for (i, s) in sorted.iter().enumerate() {
        if s.is_full() {
            current = Some(i);
        }
        base[i] = current;
    }

    if selection.max_backups > 0 {
        let fulls: Vec<usize> = (0..n).filter(|&i| sorted[i].is_full()).collect();
        let skip = fulls.len().saturating_sub(selection.max_backups as usize);
        if let Some(&oldest) = fulls.get(skip) {
            for k in keep.iter_mut().take(oldest) {
                *k = false;
            }
        }
    }

    if let Some(age) = selection.max_age {
        let cutoff = now - chrono::Duration::from_std(age).unwrap_or(chrono::Duration::MAX);
        let young: Vec<bool> = sorted.iter().map(|s| s.created_on >= cutoff).collect();
        let mut needed = young.clone();
        for i in 0..n {
            if young[i]
                && let Some(b) = base[i]
            {
                // The base and every delta between it and this one: an old delta left out
                // would be a revision gap at the destination, and its restore would fail.
                for k in &mut needed[b..i] {
                    *k = true;
                }
            }
        }
        for (k, needed) in keep.iter_mut().zip(needed) {
            *k &= needed;
        }
    }

    for i in 0..n {
        if let Some(b) = base[i]
            && sorted[b].is_final
        {
            keep[i] = true;
        }
    }

    sorted
        .iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(s, _)| s.clone())
        .collect()
}

/// The name a snapshot gets at the destination: the same name without `.final`.
///
/// The destination's own sidecar reads "my latest full snapshot is final" as "I already took my
/// final snapshot" and would never take one again; a copied `.final` would make a fresh
/// destination believe it had been deactivated. The source keeps its `.final` name, so the
/// migration's record of where the source ended is not lost.
pub fn dest_name(snapshot: &Snapshot) -> String {
    snapshot
        .snap_name
        .strip_suffix(FINAL_SUFFIX)
        .unwrap_or(&snapshot.snap_name)
        .to_string()
}

/// The snapshot as it is written at the destination (`.final` stripped, see [`dest_name`]).
pub fn dest_snapshot(snapshot: &Snapshot) -> Snapshot {
    let mut s = Snapshot {
        is_final: false,
        ..snapshot.clone()
    };
    s.snap_name = s.format_name();
    s
}

/// Splits the selection into those to copy and those already at the destination: an object of
/// the same name ignoring `.final` and of the same size is the same snapshot (names carry the
/// revisions and the creation second; a torn copy has another size). `dest` maps destination
/// names to sizes.
pub fn pending(selected: Vec<Listed>, dest: &HashMap<String, u64>) -> (Vec<Listed>, Vec<Listed>) {
    selected.into_iter().partition(|l| {
        let name = dest_name(&l.snapshot);
        let present = dest
            .get(&name)
            .or_else(|| dest.get(&format!("{name}{FINAL_SUFFIX}")));
        present != Some(&l.size)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Codec, Kind};
    use chrono::TimeZone;
    use std::collections::BTreeSet;

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + secs, 0).unwrap()
    }

    fn full(last: i64, at: i64, is_final: bool) -> Snapshot {
        Snapshot::new("p", Kind::Full, 0, last, t(at), Codec::Gzip, is_final)
    }

    fn incr(start: i64, last: i64, at: i64) -> Snapshot {
        Snapshot::new("p", Kind::Incr, start, last, t(at), Codec::Gzip, false)
    }

    fn names(v: &[Snapshot]) -> Vec<i64> {
        v.iter().map(|s| s.last_revision).collect()
    }

    // The copy Job's wait decides with the one function every reader uses.
    use crate::owner::handoff::{HandOffRecord, StoreHandOff, the_final};

    /// A store of the reference tool: no etcd-warden object.
    const NOTHING: fn() -> StoreHandOff = StoreHandOff::default;

    /// etcd-warden objects (fence markers, reclaimed marks) but no record and no intent: a
    /// hand-off under way, or one undone by `etcd-warden reclaim`.
    fn not_recorded() -> StoreHandOff {
        StoreHandOff {
            ours: true,
            ..Default::default()
        }
    }

    /// The hand-off record names `name`.
    fn recorded(name: &str) -> StoreHandOff {
        StoreHandOff {
            ours: true,
            handoff_record: Some(HandOffRecord {
                final_snapshot: name.into(),
                revision: 0,
                members: vec![],
                owner_id: "seed-a".into(),
                recorded_at: t(0),
            }),
            ..Default::default()
        }
    }

    fn reclaiming(mut seen: StoreHandOff, reclaimed: &BTreeSet<String>) -> StoreHandOff {
        seen.reclaimed = reclaimed.clone();
        seen
    }

    fn final_snapshot<'a>(
        sorted: &'a [Snapshot],
        seen: StoreHandOff,
        reclaimed: &BTreeSet<String>,
    ) -> Option<&'a Snapshot> {
        the_final(sorted, &reclaiming(seen, reclaimed))
    }

    /// [`the_final`] with nothing reclaimed.
    fn unreclaimed(sorted: &[Snapshot], seen: StoreHandOff) -> Option<&Snapshot> {
        final_snapshot(sorted, seen, &BTreeSet::new())
    }

    /// F10 d11-12 F20 d21-22 F30 d31-32, one hour apart.
    fn history(final_last: bool) -> Vec<Snapshot> {
        vec![
            full(10, 0, false),
            incr(11, 12, 3600),
            full(20, 7200, false),
            incr(21, 22, 10800),
            full(30, 14400, final_last),
            incr(31, 32, 18000),
        ]
    }

    #[test]
    fn without_a_hand_off_record_the_final_is_the_newest_snapshot_when_marked() {
        let nothing = NOTHING;
        assert!(unreclaimed(&history(false), nothing()).is_none());
        // A final followed by a delta has writes after it: not the end of the source's data.
        assert!(unreclaimed(&history(true), nothing()).is_none());
        let mut h = history(true);
        h.pop();
        assert_eq!(unreclaimed(&h, nothing()).unwrap().last_revision, 30);
        // A final snapshot followed by a newer full one is a leftover.
        let mut h = history(false);
        h[2].is_final = true;
        assert!(unreclaimed(&h, nothing()).is_none());
        assert!(unreclaimed(&[], nothing()).is_none());
    }

    #[test]
    fn a_reclaimed_final_never_counts() {
        let mut h = history(true);
        h.pop();
        let name = h[4].snap_name.clone();
        let reclaimed = BTreeSet::from([name.clone()]);
        assert!(final_snapshot(&h, NOTHING(), &reclaimed).is_none());
        // An interrupted reclaim: the record still names the final it marked.
        assert!(final_snapshot(&h, recorded(&name), &reclaimed).is_none());
        // A later hand-off's final is another object and counts.
        let mut later = h.clone();
        later.push(full(40, 20000, true));
        let next = later[5].snap_name.clone();
        assert_eq!(
            final_snapshot(&later, recorded(&next), &reclaimed)
                .unwrap()
                .last_revision,
            40
        );
    }

    #[test]
    fn with_etcd_warden_objects_the_recorded_final_counts_and_nothing_else() {
        let mut h = history(true);
        h.pop();
        let name = h[4].snap_name.clone();
        assert!(
            unreclaimed(&h, not_recorded()).is_none(),
            "fenced or reclaimed, not recorded: the newest final does not count"
        );
        assert_eq!(unreclaimed(&h, recorded(&name)).unwrap().last_revision, 30);
        assert!(unreclaimed(&h, recorded("Full-00000000-00000099-1.gz.final")).is_none());
    }

    /// The last revisions `select` keeps at t=20000 under these limits (0: no count limit).
    fn kept(h: &[Snapshot], max_backups: u64, max_age_secs: Option<u64>) -> Vec<i64> {
        let selection = Selection {
            max_backups,
            max_age: max_age_secs.map(Duration::from_secs),
        };
        names(&select(h, selection, t(20000)))
    }

    #[test]
    fn selection_by_count_keeps_the_newest_full_snapshots_and_their_deltas() {
        let h = history(false);
        assert_eq!(kept(&h, 0, None), vec![10, 12, 20, 22, 30, 32]);
        assert_eq!(kept(&h, 2, None), vec![20, 22, 30, 32]);
        assert_eq!(kept(&h, 9, None).len(), 6);
    }

    #[test]
    fn selection_by_age_adds_the_base_of_each_young_delta() {
        let h = history(false);
        // Younger than 2.5 h at t=20000: d21-22 (10800), F30, d31-32; d21-22 needs F20.
        assert_eq!(kept(&h, 0, Some(9500)), vec![20, 22, 30, 32]);
        assert!(kept(&h, 0, Some(1)).is_empty());
        // Both limits apply.
        assert_eq!(kept(&h, 1, Some(9500)), vec![30, 32]);
    }

    #[test]
    fn selection_by_age_keeps_the_deltas_between_a_young_delta_and_its_base() {
        // F30 at 0 s, d31-32 at 1 h, d33-34 at 5 h: only d33-34 is younger than 5000 s at
        // t=20000; leaving d31-32 out would leave revisions 31-32 in no copied snapshot.
        let h = vec![full(30, 0, false), incr(31, 32, 3600), incr(33, 34, 18000)];
        let selection = Selection {
            max_backups: 0,
            max_age: Some(Duration::from_secs(5000)),
        };
        let chosen = select(&h, selection, t(20000));
        assert_eq!(names(&chosen), vec![30, 32, 34]);
        let chain = crate::store::layout::latest_chain(&chosen);
        assert_eq!(crate::store::layout::first_gap(&chain), None);
    }

    #[test]
    fn the_final_snapshot_and_its_deltas_are_always_selected() {
        let mut h = history(false);
        h[2].is_final = true;
        assert_eq!(kept(&h, 1, Some(1)), vec![20, 22]);
    }

    #[test]
    fn final_is_stripped_at_the_destination() {
        let f = full(30, 0, true);
        assert_eq!(dest_name(&f), f.snap_name.trim_end_matches(".final"));
        let d = dest_snapshot(&f);
        assert!(!d.is_final);
        assert_eq!(d.snap_name, dest_name(&f));
        let plain = full(31, 0, false);
        assert_eq!(dest_snapshot(&plain), plain);
    }

    #[test]
    fn objects_of_the_same_name_and_size_are_skipped() {
        let f = full(30, 0, true);
        let d = incr(31, 32, 5);
        let listed = vec![
            Listed {
                snapshot: f.clone(),
                size: 100,
            },
            Listed {
                snapshot: d.clone(),
                size: 7,
            },
        ];
        let none = HashMap::new();
        let (todo, done) = pending(listed.clone(), &none);
        assert_eq!((todo.len(), done.len()), (2, 0));
        // Present without .final (as this job writes it) or with it (another tool's copy).
        for name in [dest_name(&f), f.snap_name.clone()] {
            let dest: HashMap<String, u64> = [(name, 100), (d.snap_name.clone(), 7)].into();
            let (todo, done) = pending(listed.clone(), &dest);
            assert_eq!((todo.len(), done.len()), (0, 2));
        }
        // A different size is a torn or different object: copied again.
        let dest: HashMap<String, u64> = [(dest_name(&f), 99)].into();
        let (todo, _) = pending(listed, &dest);
        assert_eq!(todo.len(), 2);
    }
}
