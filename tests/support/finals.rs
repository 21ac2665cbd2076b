//! Every final snapshot object in every store, tracked for the whole run (issue 53, item 4).
//!
//! A [`Tracker`] lists each store (the primary, the secondary, the copy Job's destination) every
//! second and keeps every final with when it was first and last seen and when it was first
//! missing from a listing (in the secondary and the destination, which strip `.final` from
//! their copies, every full snapshot, so that a final's copy is known by its name). The judges
//! are pure:
//! - [`two_finals`]: two final names first stored in the primary within one hand-off (from its
//!   flip to the next), even when a reclaim later marks or retention later deletes one; a final
//!   in another store that the primary never held;
//! - [`finals_gone`]: a final missing from a listing when no reclaim of it had started;
//! - [`disagreements`]: the readers of one hand-off (`ls --json`, `verify`, every sidecar's
//!   `/snapshot/latest`) against the final they must name, a non-200 answer included.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::ObjectStore;
use tokio_util::sync::CancellationToken;

use super::invariants::{Violation, list_keys};

/// One final object as the listings saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct FinalObject {
    /// `primary`, `secondary` or `destination`.
    pub store: &'static str,
    pub key: String,
    pub first_seen: Duration,
    pub last_seen: Duration,
    /// The first successful listing it was missing from, after it had been seen.
    pub gone_at: Option<Duration>,
}

impl FinalObject {
    /// The object's file name: the snapshot's name.
    pub fn name(&self) -> &str {
        self.key.rsplit('/').next().unwrap_or(&self.key)
    }
}

/// Whether a key names a final snapshot (not one of etcd-warden's own objects named after one,
/// such as `etcd-warden/reclaimed/<final>`).
pub fn is_final_key(key: &str) -> bool {
    let file = key.rsplit('/').next().unwrap_or(key);
    file.starts_with("Full-")
        && file.ends_with(".final")
        && !key.split('/').any(|segment| segment == "etcd-warden")
}

/// Whether a key in `store` is tracked: a final in the primary; in the secondary and the
/// destination every full snapshot, since both strip `.final` from their copies (which of
/// them are finals is known from the primary, see [`copy_of`]).
pub fn is_tracked(store: &str, key: &str) -> bool {
    if store == "primary" {
        return is_final_key(key);
    }
    let file = key.rsplit('/').next().unwrap_or(key);
    file.starts_with("Full-") && !key.split('/').any(|segment| segment == "etcd-warden")
}

/// The primary final that `o` (in another store) is a copy of, by name with or without
/// `.final`.
pub fn copy_of<'a>(o: &FinalObject, primary: &[&'a str]) -> Option<&'a str> {
    primary
        .iter()
        .find(|p| **p == o.name() || p.strip_suffix(".final") == Some(o.name()))
        .copied()
}

/// Folds one successful listing of `store` at `now` into `seen`.
pub fn fold_listing(
    seen: &mut BTreeMap<(&'static str, String), FinalObject>,
    store: &'static str,
    keys: &[String],
    now: Duration,
) {
    for key in keys.iter().filter(|k| is_tracked(store, k)) {
        let o = seen
            .entry((store, key.clone()))
            .or_insert_with(|| FinalObject {
                store,
                key: key.clone(),
                first_seen: now,
                last_seen: now,
                gone_at: None,
            });
        o.last_seen = now;
    }
    for ((s, key), o) in seen.iter_mut() {
        if *s == store && o.gone_at.is_none() && !keys.contains(key) {
            o.gone_at = Some(now);
        }
    }
}

/// Lists every store every `every` until stopped.
pub struct Tracker {
    pub seen: Arc<Mutex<BTreeMap<(&'static str, String), FinalObject>>>,
    /// Listings that failed, per store (a store under a fault).
    pub failed_listings: Arc<Mutex<BTreeMap<&'static str, u32>>>,
    stop: CancellationToken,
}

impl Tracker {
    /// `stores`: (label, store, prefix listed).
    pub fn start(
        stores: Vec<(&'static str, Arc<dyn ObjectStore>, String)>,
        epoch: Instant,
        every: Duration,
    ) -> Tracker {
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let failed_listings = Arc::new(Mutex::new(BTreeMap::new()));
        let stop = CancellationToken::new();
        let (s, f, st) = (seen.clone(), failed_listings.clone(), stop.clone());
        tokio::spawn(async move {
            while !st.is_cancelled() {
                for (label, store, prefix) in &stores {
                    let listed = tokio::time::timeout(
                        Duration::from_secs(5),
                        list_keys(store.as_ref(), prefix),
                    )
                    .await
                    .ok()
                    .flatten();
                    match listed {
                        Some(keys) => fold_listing(
                            &mut s.lock().unwrap_or_else(|e| e.into_inner()),
                            label,
                            &keys,
                            epoch.elapsed(),
                        ),
                        None => {
                            *f.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .entry(*label)
                                .or_default() += 1
                        }
                    }
                }
                tokio::select! {
                    _ = st.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
            }
        });
        Tracker {
            seen,
            failed_listings,
            stop,
        }
    }

    pub fn objects(&self) -> Vec<FinalObject> {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The hand-off (1-based, by its flip) a moment belongs to: the last flip at or before it; 0
/// before the first flip.
pub fn handoff_of(flips: &[Duration], at: Duration) -> usize {
    flips.iter().filter(|f| **f <= at).count()
}

/// The distinct final names the primary first stored in hand-off `k` (1-based), by first seen.
pub fn primary_finals_of(objects: &[FinalObject], flips: &[Duration], k: usize) -> Vec<String> {
    let mut of: Vec<&FinalObject> = objects
        .iter()
        .filter(|o| o.store == "primary" && handoff_of(flips, o.first_seen) == k)
        .collect();
    of.sort_by_key(|o| o.first_seen);
    let mut names: Vec<String> = Vec::new();
    for o in of {
        if !names.iter().any(|n| n == o.name()) {
            names.push(o.name().to_string());
        }
    }
    names
}

/// Two finals for one hand-off, whatever happened to them later; a final in another store the
/// primary never held.
pub fn two_finals(objects: &[FinalObject], flips: &[Duration]) -> Vec<Violation> {
    let mut v = Vec::new();
    for k in 0..=flips.len() {
        let names = primary_finals_of(objects, flips, k);
        if k == 0 && !names.is_empty() {
            v.push(Violation {
                kind: "two-finals",
                detail: format!("final(s) stored before any hand-off: {}", names.join(", ")),
            });
        } else if names.len() > 1 {
            v.push(Violation {
                kind: "two-finals",
                detail: format!(
                    "hand-off {k} stored {} finals in the primary: {} (seen from {})",
                    names.len(),
                    names.join(", "),
                    objects
                        .iter()
                        .filter(|o| o.store == "primary" && names.iter().any(|n| n == o.name()))
                        .map(|o| format!("{} at {:.1}s", o.name(), o.first_seen.as_secs_f64()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
    }
    let primary: Vec<&str> = objects
        .iter()
        .filter(|o| o.store == "primary")
        .map(FinalObject::name)
        .collect();
    for o in objects.iter().filter(|o| o.store != "primary") {
        if is_final_key(&o.key) && !primary.contains(&o.name()) {
            v.push(Violation {
                kind: "two-finals",
                detail: format!(
                    "the {} store holds final {} (seen at {:.1}s), which the primary never held",
                    o.store,
                    o.key,
                    o.first_seen.as_secs_f64()
                ),
            });
        }
    }
    v
}

/// Finals that disappeared with no reclaim of them started before (`reclaims`: final name →
/// when the reclaim that marked it started).
pub fn finals_gone(
    objects: &[FinalObject],
    reclaims: &BTreeMap<String, Duration>,
) -> Vec<Violation> {
    let primary: Vec<&str> = objects
        .iter()
        .filter(|o| o.store == "primary")
        .map(FinalObject::name)
        .collect();
    objects
        .iter()
        .filter_map(|o| {
            let gone = o.gone_at?;
            // In the secondary and the destination, only the copies of a final are judged.
            let name = if o.store == "primary" {
                o.name()
            } else {
                copy_of(o, &primary)?
            };
            let excused = reclaims.get(name).is_some_and(|at| *at <= gone);
            (!excused).then(|| Violation {
                kind: "final-gone",
                detail: format!(
                    "final {} in the {} store, seen {:.1}s..{:.1}s, was gone at {:.1}s with no \
                     reclaim of it",
                    o.key,
                    o.store,
                    o.first_seen.as_secs_f64(),
                    o.last_seen.as_secs_f64(),
                    gone.as_secs_f64()
                ),
            })
        })
        .collect()
}

/// What the readers of one hand-off answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Answers {
    /// `ls --json`: whether it succeeded, the finals it listed.
    pub ls: (bool, Vec<String>),
    /// `verify`: the final its last line names (`the hand-off's final snapshot: <name>`), or
    /// its last line when it names none.
    pub verify: Result<String, String>,
    /// Each sidecar's `/snapshot/latest`: (status code, full snapshot's name, its `isFinal`);
    /// `None` when it did not answer at all.
    pub latest: Vec<Option<(u16, Option<String>, bool)>>,
}

/// How the answers depart from naming `name` as the one final; empty when they all agree.
pub fn disagreements(name: &str, a: &Answers) -> Vec<String> {
    let mut out = Vec::new();
    if !a.ls.0 || a.ls.1 != [name.to_string()] {
        out.push(format!("`ls` (ok={}) lists finals {:?}", a.ls.0, a.ls.1));
    }
    match &a.verify {
        Ok(n) if n == name => {}
        Ok(n) => out.push(format!("`verify` names {n}")),
        Err(e) => out.push(format!("`verify` names no final: {e}")),
    }
    for (m, l) in a.latest.iter().enumerate() {
        match l {
            Some((200, Some(n), true)) if n == name => {}
            Some((code, n, fin)) => out.push(format!(
                "m{m}'s /snapshot/latest answered {code}: full snapshot {n:?}, final {fin}"
            )),
            None => out.push(format!("m{m}'s /snapshot/latest did not answer")),
        }
    }
    out
}

/// The final `verify`'s output names.
pub fn verify_names(output: &str) -> Result<String, String> {
    const SAYS: &str = "the hand-off's final snapshot: ";
    output
        .lines()
        .rev()
        .find_map(|l| l.split_once(SAYS).map(|(_, n)| n.trim().to_string()))
        .ok_or_else(|| super::faultrun::last_line(output))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: f64) -> Duration {
        Duration::from_secs_f64(x)
    }

    const F1: &str = "v2/Full-00000000-00000100-1.gz.final";
    const F2: &str = "v2/Full-00000000-00000105-2.gz.final";

    fn seen(listings: &[(&'static str, f64, &[&str])]) -> Vec<FinalObject> {
        let mut m = BTreeMap::new();
        for (store, at, keys) in listings {
            let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
            fold_listing(&mut m, store, &keys, s(*at));
        }
        m.into_values().collect()
    }

    #[test]
    fn only_full_final_objects_are_tracked() {
        assert!(is_final_key(F1));
        assert!(!is_final_key("v2/Full-00000000-00000100-1.gz"));
        assert!(!is_final_key("v2/Incr-00000100-00000105-1.gz"));
        assert!(!is_final_key("etcd-warden/handoff/Full-x.final.json"));
        assert!(!is_final_key(
            "etcd/etcd-warden/reclaimed/Full-00000000-00000100-1.gz.final"
        ));
        let o = seen(&[("primary", 1.0, &[F1, "v2/Full-00000000-00000100-1.gz"])]);
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].name(), "Full-00000000-00000100-1.gz.final");
    }

    #[test]
    fn a_second_final_in_one_hand_off_is_two_finals_even_once_removed() {
        // The `fresh-final-name` plant: a retry stored the final under a new name; retention
        // (or a reclaim) removed the first a few seconds later.
        let flips = [s(10.0), s(60.0)];
        let o = seen(&[
            ("primary", 12.0, &[F1]),
            ("primary", 14.0, &[F1, F2]),
            ("primary", 16.0, &[F2]),
        ]);
        let v = two_finals(&o, &flips);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.contains("hand-off 1 stored 2 finals"));
        // One final per hand-off passes, the secondary's copy of it too.
        let o = seen(&[
            ("primary", 12.0, &[F1]),
            ("secondary", 20.0, &[F1]),
            ("primary", 62.0, &[F1, F2]),
        ]);
        assert!(two_finals(&o, &flips).is_empty());
    }

    #[test]
    fn a_final_only_another_store_holds_or_one_before_any_hand_off_is_two_finals() {
        let flips = [s(10.0)];
        let o = seen(&[("primary", 12.0, &[F1]), ("secondary", 20.0, &[F1, F2])]);
        let v = two_finals(&o, &flips);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.contains("never held"));
        let o = seen(&[("primary", 5.0, &[F1])]);
        assert!(
            two_finals(&o, &flips)[0]
                .detail
                .contains("before any hand-off")
        );
    }

    #[test]
    fn the_secondarys_copy_of_a_final_without_its_suffix_is_tracked_and_judged() {
        const COPY: &str = "etcd/v2/Full-00000000-00000100-1.gz";
        const PLAIN: &str = "etcd/v2/Full-00000000-00000090-0.gz";
        assert!(is_tracked("secondary", COPY) && !is_tracked("primary", COPY));
        let o = seen(&[
            ("primary", 12.0, &[F1]),
            ("secondary", 20.0, &[COPY, PLAIN]),
            ("secondary", 30.0, &[]),
        ]);
        // Copies are not second finals; a plain full snapshot gone is retention's business.
        assert!(two_finals(&o, &[s(10.0)]).is_empty());
        let v = finals_gone(&o, &BTreeMap::new());
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.contains("secondary"));
        let reclaimed =
            BTreeMap::from([("Full-00000000-00000100-1.gz.final".to_string(), s(25.0))]);
        assert!(finals_gone(&o, &reclaimed).is_empty());
    }

    #[test]
    fn a_final_gone_without_its_reclaim_is_final_gone() {
        let o = seen(&[("primary", 12.0, &[F1]), ("primary", 30.0, &[])]);
        assert_eq!(o[0].gone_at, Some(s(30.0)));
        let mut reclaims = BTreeMap::new();
        assert_eq!(finals_gone(&o, &reclaims).len(), 1);
        // A reclaim that started before it went excuses it; one after does not.
        reclaims.insert("Full-00000000-00000100-1.gz.final".to_string(), s(31.0));
        assert_eq!(finals_gone(&o, &reclaims).len(), 1);
        reclaims.insert("Full-00000000-00000100-1.gz.final".to_string(), s(25.0));
        assert!(finals_gone(&o, &reclaims).is_empty());
        // Still there: nothing to judge.
        let o = seen(&[("primary", 12.0, &[F1]), ("primary", 30.0, &[F1])]);
        assert!(finals_gone(&o, &BTreeMap::new()).is_empty());
    }

    fn agreeing(name: &str) -> Answers {
        Answers {
            ls: (true, vec![name.to_string()]),
            verify: Ok(name.to_string()),
            latest: vec![Some((200, Some(name.to_string()), true)); 3],
        }
    }

    #[test]
    fn readers_naming_the_final_agree_and_each_departure_is_named() {
        let n = "Full-00000000-00000100-1.gz.final";
        assert!(disagreements(n, &agreeing(n)).is_empty());
        let mut a = agreeing(n);
        a.ls.1.push("Full-00000000-00000050-0.gz.final".into());
        assert_eq!(disagreements(n, &a).len(), 1);
        let mut a = agreeing(n);
        a.verify = Err("FAIL x".into());
        assert!(disagreements(n, &a)[0].contains("names no final"));
        let mut a = agreeing(n);
        a.verify = Ok("other".into());
        assert!(disagreements(n, &a)[0].contains("names other"));
        // The `latest-reclaimed-final` plant: a sidecar names the reclaimed final as final.
        let mut a = agreeing(n);
        a.latest[1] = Some((200, Some("Full-00000000-00000050-0.gz.final".into()), true));
        assert!(disagreements(n, &a)[0].starts_with("m1's"));
        // A non-200 answer or none at all is a disagreement, not a skip.
        let mut a = agreeing(n);
        a.latest[0] = Some((503, None, false));
        a.latest[2] = None;
        assert_eq!(disagreements(n, &a).len(), 2);
        let mut a = agreeing(n);
        a.latest[0] = Some((200, Some(n.into()), false));
        assert_eq!(disagreements(n, &a).len(), 1);
    }

    #[test]
    fn verify_names_the_final_from_its_last_lines() {
        let out = "ok    a\n2 snapshots verified\nthe hand-off's final snapshot: F.final\n";
        assert_eq!(verify_names(out), Ok("F.final".into()));
        assert_eq!(
            verify_names("ok a\nno hand-off final snapshot in this store\n"),
            Err("no hand-off final snapshot in this store".into())
        );
    }
}
