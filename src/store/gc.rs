//! Retention: which snapshots to delete, as a pure function of (snapshots, now, policy).
//!
//! The rules follow etcd-backup-restore's garbage collector:
//! - the snapshots are cut into *streams*: a full snapshot and the deltas after it;
//! - `LimitBased` keeps the newest `max_backups` full snapshots;
//! - `Exponential` keeps every full snapshot of the current hour, the last one of each hour for
//!   the rest of the last 24 hours, the last one of each day for a week, the last one of each
//!   week up to 5 weeks, and nothing older (hour/day/week windows counted back from the end of
//!   today, UTC, exactly as the reference counts them);
//! - deltas of a stream other than the newest are deleted once older than `delta_retention`
//!   (zero keeps them as long as their full snapshot), and always with their full snapshot.
//!
//! Beyond the reference: the newest stream is never touched, a final snapshot's stream is never
//! deleted, and deltas before the first full snapshot (unrestorable) are deleted.
//!
//! Triggered full snapshots (taken on request over HTTP, `/snapshot/full`, which etcd-druid
//! calls without a token) are judged apart from the scheduled ones, under either policy: the
//! policy runs over the scheduled full snapshots as if no request existed, each heading a chain
//! (its deltas up to the next scheduled one, through the requests in between: the delta writer
//! goes on through a request), and the requests have a bounded keep of their own (`LimitBased`:
//! the newest `max_backups`; `Exponential`: one per window, the current hour included). No
//! number of requests deletes a scheduled full snapshot or a delta of its chain. A request the
//! chain needs (its deltas continue it, not the chain) stays with the chain. A triggered full is
//! known by an empty marker object `<prefix>/etcd-warden/triggered/<name>` beside the layout
//! directory, where etcd-backup-restore does not look, so the snapshot names stay the
//! reference's; a marker whose snapshot is gone is deleted by retention.
//!
//! A triggered full may be etcd-druid's *requested final* (`POST /snapshot/full?final=true`
//! under `[druid]`): named `.final` as etcd-backup-restore names it, and judged as a request,
//! never kept as a hand-off's final is. It carries a second marker,
//! `<prefix>/etcd-warden/requested-final/<name>`, written *before* the upload (so a `.final`
//! object from a request never exists without an etcd-warden object beside it, and no reader
//! that falls back to etcd-backup-restore's rule, "the newest snapshot is a final full one",
//! takes it for a hand-off's final: [`crate::owner::handoff::the_final`]); retention deletes
//! it with its snapshot, and one left by an upload that never finished once it is a day old.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Timelike, Utc};

use super::layout::{Kind, Link, Snapshot, compare, link};
use crate::config::GcPolicy;

/// What retention keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Which full snapshots to keep.
    pub policy: GcPolicy,
    /// Deltas of older streams are deleted once older than this; zero keeps them with their
    /// full snapshot.
    pub delta_retention: Duration,
}

/// The snapshots to delete, deltas before the full snapshot they depend on; every full snapshot
/// counted as scheduled.
pub fn plan(snapshots: &[Snapshot], now: DateTime<Utc>, retention: Retention) -> Vec<Snapshot> {
    plan_with(snapshots, &HashSet::new(), now, retention)
}

/// [`plan`], with the full snapshots named in `triggered` (taken on request) judged apart from
/// the scheduled ones: the policy runs over the scheduled full snapshots as if no requested one
/// existed, and the requested ones have a bounded keep of their own (the newest `max_backups`
/// under `LimitBased`; one per window, the current hour included, under `Exponential`).
pub fn plan_with(
    snapshots: &[Snapshot],
    triggered: &HashSet<String>,
    now: DateTime<Utc>,
    retention: Retention,
) -> Vec<Snapshot> {
    let mut sorted = snapshots.to_vec();
    sorted.sort_by(compare);
    let fulls: Vec<usize> = sorted
        .iter()
        .enumerate()
        .filter(|(_, s)| s.kind == Kind::Full)
        .map(|(i, _)| i)
        .collect();
    let Some(&newest) = fulls.last() else {
        // No full snapshot: nothing is restorable and nothing is safe to judge.
        return Vec::new();
    };
    // The stream of the full snapshot at sorted[fulls[k]]: its deltas are up to the next full.
    let stream_end = |k: usize| fulls.get(k + 1).copied().unwrap_or(sorted.len());
    let roles = roles(&sorted, &fulls, triggered);
    let (scheduled, requested): (Vec<usize>, Vec<usize>) =
        (0..fulls.len()).partition(|&k| matches!(roles[k], Role::Scheduled));

    let mut delete_full = vec![false; fulls.len()];
    match retention.policy {
        GcPolicy::LimitBased { max_backups } => {
            let keep = usize::try_from(max_backups).unwrap_or(usize::MAX).max(1);
            for group in [&scheduled, &requested] {
                let excess = group.len().saturating_sub(keep);
                group[..excess].iter().for_each(|&k| delete_full[k] = true);
            }
        }
        GcPolicy::Exponential => {
            exponential(&sorted, &fulls, &scheduled, now, true, &mut delete_full);
            // Requests keep no more than one per window: a caller who can reach the open
            // trigger adds at most one full snapshot per hour, day and week it fills.
            exponential(&sorted, &fulls, &requested, now, false, &mut delete_full);
        }
    }
    for (k, &start) in fulls.iter().enumerate() {
        if start == newest
            || (sorted[start].is_final && !triggered.contains(&sorted[start].snap_name))
        {
            delete_full[k] = false;
        }
    }
    // A requested full snapshot that a kept scheduled chain runs through (its deltas continue
    // it and not the chain before it) stays with that chain.
    for &k in &requested {
        if let Role::Requested {
            head: Some(h),
            bridge: true,
        } = roles[k]
            && !delete_full[h]
        {
            delete_full[k] = false;
        }
    }

    let cutoff = now - TimeDelta::from_std(retention.delta_retention).unwrap_or(TimeDelta::MAX);
    let mut out = Vec::new();
    // Deltas before the first full snapshot can never be restored.
    out.extend(
        sorted[..fulls[0]]
            .iter()
            .rev()
            .filter(|s| s.kind == Kind::Incr)
            .cloned(),
    );
    for (k, &start) in fulls.iter().enumerate() {
        if start == newest
            || (sorted[start].is_final && !triggered.contains(&sorted[start].snap_name))
        {
            continue;
        }
        // The deltas after a requested full snapshot continue its scheduled chain too: they
        // go only when neither is kept.
        let head_kept = match roles[k] {
            Role::Scheduled => !delete_full[k],
            Role::Requested { head, .. } => {
                !delete_full[k] || head.is_some_and(|h| !delete_full[h])
            }
        };
        let deltas = sorted[start + 1..stream_end(k)].iter().rev();
        if !head_kept {
            out.extend(deltas.cloned());
        } else if !retention.delta_retention.is_zero() {
            out.extend(deltas.filter(|d| d.created_on < cutoff).cloned());
        }
        if delete_full[k] {
            out.push(sorted[start].clone());
        }
    }
    out
}

/// How retention counts a full snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Taken on schedule (or a final, or unmarked): it heads a chain, the deltas up to the next
    /// scheduled full snapshot.
    Scheduled,
    /// Taken on request, inside the chain of the scheduled full snapshot `head` (an index into
    /// the fulls; `None` before the first). `bridge`: the deltas after it continue it and not
    /// that chain (the delta writer restarted at it), so the chain needs it.
    Requested { head: Option<usize>, bridge: bool },
}

/// The role of each full snapshot of `sorted` (at the indices `fulls`), walking the chains the
/// scheduled ones head and passing over each requested one its chain does not need.
fn roles(sorted: &[Snapshot], fulls: &[usize], triggered: &HashSet<String>) -> Vec<Role> {
    let mut roles = Vec::with_capacity(fulls.len());
    // How far the current scheduled chain reaches, requested full snapshots passed over.
    let mut reach: Option<i64> = None;
    let mut head = None;
    let mut next = 0;
    for (k, &start) in fulls.iter().enumerate() {
        for d in &sorted[next..start] {
            if let Some(r) = reach
                && link(r, d) != Link::Covered
            {
                reach = Some(d.last_revision);
            }
        }
        next = start + 1;
        let full = &sorted[start];
        // A triggered full is a request even when named final (etcd-druid's requested final);
        // a hand-off's final is never marked triggered.
        if !triggered.contains(&full.snap_name) {
            roles.push(Role::Scheduled);
            head = Some(k);
            reach = Some(full.last_revision);
            continue;
        }
        let end = fulls.get(k + 1).copied().unwrap_or(sorted.len());
        let first = sorted[start + 1..end]
            .iter()
            .find(|d| link(full.last_revision, d) != Link::Covered);
        let bridge = first.is_some_and(|d| match reach {
            None => true,
            Some(r) => link(r, d) == Link::Gap && link(full.last_revision, d) != Link::Gap,
        });
        if bridge {
            reach = Some(full.last_revision);
        }
        roles.push(Role::Requested { head, bridge });
    }
    roles
}

/// The reference's exponential rule over the full snapshots `group` (indices into `fulls`,
/// oldest first): walks from the newest back, comparing each with the next newer one in hour,
/// day and week windows counted from the end of today, and marks in `delete` those it drops.
/// `whole_current_hour`: every one of the current hour is kept (the reference's rule);
/// otherwise only the newest of it.
fn exponential(
    sorted: &[Snapshot],
    fulls: &[usize],
    group: &[usize],
    now: DateTime<Utc>,
    whole_current_hour: bool,
    delete: &mut [bool],
) {
    let day = TimeDelta::hours(24);
    let start_of_day = now
        .with_hour(0)
        .and_then(|t| t.with_minute(0))
        .and_then(|t| t.with_second(0))
        .and_then(|t| t.with_nanosecond(0))
        .unwrap_or(now);
    let mut eod = start_of_day + TimeDelta::seconds(24 * 3600 - 1);
    let mut tracking_week = false;
    // Whole hours from a time back to `eod`, truncated toward zero as Go's int(float) does.
    let hours = |eod: DateTime<Utc>, t: DateTime<Utc>| (eod - t).num_seconds() as f64 / 3600.0;
    for pair in group.windows(2).rev() {
        let (older_k, newer_k) = (pair[0], pair[1]);
        let newer = &sorted[fulls[newer_k]];
        let older = &sorted[fulls[older_k]];
        let age = eod - older.created_on;
        let threshold: i64 = if age < day {
            if whole_current_hour && older.created_on.hour() == now.hour() {
                0
            } else {
                1
            }
        } else if age < day * 8 {
            24
        } else if age < day * 35 {
            if !tracking_week {
                // The week ends yesterday: shift the windows' end by a day once.
                eod -= day;
                tracking_week = true;
            }
            24 * 7
        } else {
            i64::from(i32::MAX)
        };
        let (h_old, h_new) = (hours(eod, older.created_on), hours(eod, newer.created_on));
        let hour_change = h_old as i64 - h_new as i64;
        let day_change = (h_old / 24.0) as i64 - (h_new / 24.0) as i64;
        let week_change = (h_old / 168.0) as i64 - (h_new / 168.0) as i64;
        let keep = threshold == 0
            || hour_change / threshold != 0
            || day_change * 24 / threshold != 0
            || week_change * 168 / threshold != 0;
        delete[older_k] = !keep;
    }
}

/// What one garbage collection did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Snapshots deleted.
    pub deleted: Vec<Snapshot>,
    /// Snapshots whose deletion failed (retried at the next run).
    pub failed: Vec<Snapshot>,
    /// Snapshots the plan deletes but the store keeps under retention or a legal hold: kept,
    /// listed and restorable, and deleted by a later run once released.
    pub locked: Vec<Snapshot>,
}

/// What stopped a delete in a stream: its full snapshot is then kept too, so none of the
/// stream's deltas is left without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Failed,
    Locked,
}

/// Lists the store, plans with [`plan`], and deletes. A failed delete is logged and skipped,
/// except that a full snapshot is not deleted after one of its deltas failed (no orphans).
///
/// A snapshot the store keeps under retention or a legal hold (S3 Object Lock, read before
/// the delete: on a versioned bucket a plain delete would succeed by hiding it behind a delete
/// marker; GCS and Azure refuse the delete) is skipped: logged once per process, reported in
/// [`GcReport::locked`], never an error. Its full snapshot stays with it. The plan is made
/// from the listing, so a locked snapshot that stays is only ever an older one kept longer:
/// no newer snapshot is deleted in its place.
pub async fn run(
    store: &super::SnapshotStore,
    now: DateTime<Utc>,
    retention: Retention,
) -> Result<GcReport, super::StoreError> {
    // Markers first: a marker is written after its snapshot is stored, so every marker listed
    // here has its snapshot in the listing below, and only a marker whose snapshot is gone is
    // an orphan.
    let triggered = triggered_names(store).await?;
    let compacted = compacted_names(store).await?;
    let list = store.list().await?;
    let listed: HashSet<&str> = list.iter().map(|s| s.snap_name.as_str()).collect();
    let orphans: Vec<&String> = triggered
        .iter()
        .filter(|n| !listed.contains(n.as_str()))
        .collect();
    for name in orphans {
        TRIGGERED.delete(store, name).await;
    }
    for name in compacted {
        if !listed.contains(name.as_str()) {
            COMPACTED.delete(store, &name).await;
        }
    }
    // A requested final's marker is written before its upload: one whose snapshot is not
    // listed may be of an upload under way, so only a day-old one is an orphan. Listed after
    // the snapshots, so every requested final in the listing is known as one (and judged as a
    // request even when its triggered marker was never written).
    let mut triggered = triggered;
    for (name, written) in REQUESTED_FINAL.list(store).await? {
        if !listed.contains(name.as_str()) && now - written > TimeDelta::days(1) {
            REQUESTED_FINAL.delete(store, &name).await;
        }
        triggered.insert(name);
    }
    let planned = plan_with(&list, &triggered, now, retention);
    Ok(delete(store, planned, &triggered).await)
}

/// Deletes `planned` (a plan's order: each stream's deltas before its full snapshot) from
/// `store`, with the marker of each deleted snapshot named in `triggered`. A failed delete is
/// logged and skipped, except that a full snapshot is not deleted after one of its deltas failed
/// or was kept under a lock (no orphans).
pub async fn delete(
    store: &super::SnapshotStore,
    planned: Vec<Snapshot>,
    triggered: &HashSet<String>,
) -> GcReport {
    let mut report = GcReport::default();
    let mut held: Option<Held> = None;
    for s in planned {
        if s.kind == Kind::Full {
            match held.take() {
                Some(Held::Failed) => {
                    report.failed.push(s);
                    continue;
                }
                Some(Held::Locked) => {
                    // Kept whatever its own lock; counted when it has one.
                    match store.lock(&s).await {
                        Ok(Some(lock)) => kept_locked(store, &s, &lock, &mut report),
                        _ => tracing::debug!(
                            snapshot = %s.snap_name,
                            "retention: kept with its locked deltas"
                        ),
                    }
                    continue;
                }
                None => {}
            }
        }
        match delete_unless_locked(store, &s).await {
            Ok(None) => {
                tracing::info!(snapshot = %s.snap_name, "retention: deleted");
                if triggered.contains(&s.snap_name) {
                    TRIGGERED.delete(store, &s.snap_name).await;
                    if s.is_final {
                        REQUESTED_FINAL.delete(store, &s.snap_name).await;
                    }
                }
                store.unlocked(&s);
                report.deleted.push(s);
            }
            Ok(Some(lock)) => {
                if s.kind == Kind::Incr {
                    held.get_or_insert(Held::Locked);
                }
                kept_locked(store, &s, &lock, &mut report);
            }
            Err(e) => {
                tracing::warn!(snapshot = %s.snap_name, error = %e, "retention: delete failed");
                if s.kind == Kind::Incr {
                    held = Some(Held::Failed);
                }
                report.failed.push(s);
            }
        }
    }
    report
}

/// Empty marker objects, one per snapshot name, in a folder under the store's prefix (beside
/// the layout directory, where etcd-backup-restore does not look).
#[derive(Debug, Clone, Copy)]
struct Markers {
    /// The folder, relative to the prefix.
    dir: &'static str,
    /// What a marker says, for the log.
    what: &'static str,
}

/// The markers of triggered (requested) full snapshots.
const TRIGGERED: Markers = Markers {
    dir: "etcd-warden/triggered",
    what: "triggered",
};

/// The markers of full snapshots `etcd-warden compact` wrote.
const COMPACTED: Markers = Markers {
    dir: "etcd-warden/compacted",
    what: "compacted",
};

/// The markers of etcd-druid's requested finals.
const REQUESTED_FINAL: Markers = Markers {
    dir: "etcd-warden/requested-final",
    what: "requested-final",
};

impl Markers {
    fn dir(self, store: &super::SnapshotStore) -> object_store::path::Path {
        let prefix = store.prefix().trim_matches('/');
        if prefix.is_empty() {
            object_store::path::Path::from(self.dir)
        } else {
            object_store::path::Path::from(format!("{prefix}/{}", self.dir))
        }
    }

    fn path(self, store: &super::SnapshotStore, name: &str) -> object_store::path::Path {
        object_store::path::Path::from(format!("{}/{name}", self.dir(store)))
    }

    async fn put(self, store: &super::SnapshotStore, name: &str) -> Result<(), super::StoreError> {
        use object_store::ObjectStoreExt;
        store
            .backend()
            .put(&self.path(store, name), bytes::Bytes::new().into())
            .await?;
        Ok(())
    }

    /// Each marker's snapshot name and when the marker was written.
    async fn list(
        self,
        store: &super::SnapshotStore,
    ) -> Result<Vec<(String, DateTime<Utc>)>, super::StoreError> {
        use futures::StreamExt;
        let dir = self.dir(store);
        let mut listed = store.backend().list(Some(&dir));
        let mut markers = Vec::new();
        while let Some(meta) = listed.next().await {
            let meta = meta?;
            if let Some(name) = meta.location.filename() {
                markers.push((name.to_owned(), meta.last_modified));
            }
        }
        Ok(markers)
    }

    async fn names(
        self,
        store: &super::SnapshotStore,
    ) -> Result<HashSet<String>, super::StoreError> {
        Ok(self
            .list(store)
            .await?
            .into_iter()
            .map(|(n, _)| n)
            .collect())
    }

    /// Deletes the marker of `name`; one that stays is deleted by a later run.
    async fn delete(self, store: &super::SnapshotStore, name: &str) {
        use object_store::ObjectStoreExt;
        if let Err(e) = store.backend().delete(&self.path(store, name)).await {
            tracing::debug!(snapshot = %name, marker = self.what, error = %e, "retention: a marker stays");
        }
    }
}

/// Records that the full snapshot `snapshot` (named final) is etcd-druid's requested final,
/// not a hand-off's. Written **before** its upload starts: see the module's notes.
pub async fn mark_requested_final(
    store: &super::SnapshotStore,
    snapshot: &Snapshot,
) -> Result<(), super::StoreError> {
    REQUESTED_FINAL.put(store, &snapshot.snap_name).await
}

/// The names of etcd-druid's requested finals (markers whose upload may not have finished
/// included).
pub async fn requested_finals(
    store: &super::SnapshotStore,
) -> Result<HashSet<String>, super::StoreError> {
    REQUESTED_FINAL.names(store).await
}

/// Records that the full snapshot `snapshot` was taken on request (not on schedule), so that
/// retention counts it apart ([`plan_with`]). Written after the snapshot is stored.
pub async fn mark_triggered(
    store: &super::SnapshotStore,
    snapshot: &Snapshot,
) -> Result<(), super::StoreError> {
    TRIGGERED.put(store, &snapshot.snap_name).await
}

/// The names of the full snapshots marked as triggered.
pub async fn triggered_names(
    store: &super::SnapshotStore,
) -> Result<HashSet<String>, super::StoreError> {
    TRIGGERED.names(store).await
}

/// Records that the full snapshot `snapshot` was written by `etcd-warden compact` (for the
/// inventory's kind). Written after the snapshot is stored; retention deletes it with it.
pub async fn mark_compacted(
    store: &super::SnapshotStore,
    snapshot: &Snapshot,
) -> Result<(), super::StoreError> {
    COMPACTED.put(store, &snapshot.snap_name).await
}

/// The names of the full snapshots marked as compacted.
pub async fn compacted_names(
    store: &super::SnapshotStore,
) -> Result<HashSet<String>, super::StoreError> {
    COMPACTED.names(store).await
}

/// Reports a snapshot the store keeps: in the log the first time this process finds it locked.
fn kept_locked(
    store: &super::SnapshotStore,
    snapshot: &Snapshot,
    lock: &super::Lock,
    report: &mut GcReport,
) {
    if store.first_seen_locked(snapshot) {
        tracing::info!(
            snapshot = %snapshot.snap_name,
            lock = %lock,
            "retention: kept, the store holds it under retention or a legal hold (deleted once \
             released)"
        );
    }
    report.locked.push(snapshot.clone());
}

/// Deletes `snapshot` unless the store keeps it, in which case the lock is returned: read
/// ahead where it can be (S3), or the store's refusal recognised.
async fn delete_unless_locked(
    store: &super::SnapshotStore,
    snapshot: &Snapshot,
) -> Result<Option<super::Lock>, super::StoreError> {
    if let Some(lock) = store.lock(snapshot).await? {
        return Ok(Some(lock));
    }
    match store.delete(snapshot).await {
        Ok(()) => Ok(None),
        Err(super::StoreError::Backend(e)) if super::object_lock::is_lock_refusal(&e) => {
            Ok(Some(super::Lock {
                retain_until: None,
                legal_hold: false,
                refusal: Some(e.to_string()),
            }))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::compression::Codec;
    use chrono::TimeZone;

    fn t(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    /// A full snapshot at time `at` with last revision `rev`.
    fn full(rev: i64, at: DateTime<Utc>) -> Snapshot {
        Snapshot::new("", Kind::Full, 0, rev, at, Codec::Gzip, false)
    }
    fn incr(start: i64, last: i64, at: DateTime<Utc>) -> Snapshot {
        Snapshot::new("", Kind::Incr, start, last, at, Codec::Gzip, false)
    }
    fn names(v: &[Snapshot]) -> Vec<(Kind, i64)> {
        v.iter().map(|s| (s.kind, s.last_revision)).collect()
    }
    fn limit(n: u64, delta: u64) -> Retention {
        Retention {
            policy: GcPolicy::LimitBased { max_backups: n },
            delta_retention: Duration::from_secs(delta),
        }
    }
    const EXP: Retention = Retention {
        policy: GcPolicy::Exponential,
        delta_retention: Duration::ZERO,
    };

    #[test]
    fn limit_based_keeps_the_newest_n_and_deletes_deltas_with_their_full() {
        let now = t("2024-05-10T12:00:00Z");
        let h = |n| now - TimeDelta::hours(n);
        let snaps = vec![
            incr(1, 5, h(10)), // before any full: unrestorable
            full(10, h(9)),
            incr(11, 15, h(8)),
            full(20, h(7)),
            incr(21, 25, h(6)),
            full(30, h(5)),
            incr(31, 35, h(4)),
        ];
        let del = plan(&snaps, now, limit(2, 0));
        assert_eq!(
            names(&del),
            vec![(Kind::Incr, 5), (Kind::Incr, 15), (Kind::Full, 10)]
        );
        // Delta retention removes old deltas of kept streams, never of the newest one.
        let del = plan(&snaps, now, limit(2, 3600 * 5));
        assert!(names(&del).contains(&(Kind::Incr, 25)));
        assert!(!names(&del).contains(&(Kind::Incr, 35)));
        let del = plan(&snaps, now, limit(10, 0));
        assert_eq!(names(&del), vec![(Kind::Incr, 5)]);
    }

    #[test]
    fn encrypted_snapshots_are_kept_and_deleted_like_plain_ones() {
        let now = t("2024-05-10T12:00:00Z");
        let h = |n| now - TimeDelta::hours(n);
        let plain = vec![
            full(10, h(9)),
            incr(11, 15, h(8)),
            full(20, h(7)),
            incr(21, 25, h(6)),
            full(30, h(5)),
        ];
        // Encryption switched on after the first full snapshot: a mixed store.
        let mixed: Vec<Snapshot> = plain
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, s)| s.with_encryption(i > 0))
            .collect();
        for r in [limit(2, 0), limit(1, 0), EXP] {
            assert_eq!(names(&plan(&mixed, now, r)), names(&plan(&plain, now, r)));
        }
    }

    #[test]
    fn never_deletes_the_newest_full_or_a_final_chain() {
        let now = t("2024-05-10T12:00:00Z");
        let mut fin = full(10, now - TimeDelta::days(100));
        fin = Snapshot::new("", Kind::Full, 0, 10, fin.created_on, Codec::Gzip, true);
        let snaps = vec![
            fin,
            incr(11, 12, now - TimeDelta::days(99)),
            full(20, now - TimeDelta::days(60)),
            full(30, now - TimeDelta::days(50)),
        ];
        for r in [limit(1, 0), limit(1, 1), EXP] {
            let del = plan(&snaps, now, r);
            assert_eq!(names(&del), vec![(Kind::Full, 20)], "{r:?}");
        }
        assert!(plan(&[], now, EXP).is_empty());
        assert!(plan(&[incr(1, 2, now)], now, EXP).is_empty());
    }

    #[test]
    fn exponential_keeps_hourly_daily_weekly() {
        let now = t("2024-05-10T12:30:00Z");
        // Every 20 minutes for 50 days.
        let mut snaps = Vec::new();
        let mut at = now;
        let mut rev = 100_000;
        while at > now - TimeDelta::days(50) {
            snaps.push(full(rev, at));
            rev -= 1;
            at -= TimeDelta::minutes(20);
        }
        let del = plan(&snaps, now, EXP);
        let deleted: std::collections::HashSet<_> = del.iter().map(|s| s.last_revision).collect();
        let kept: Vec<DateTime<Utc>> = snaps
            .iter()
            .filter(|s| !deleted.contains(&s.last_revision))
            .map(|s| s.created_on)
            .collect();
        // Current hour: all (12:00, 12:20 — and 12:30 is now).
        let this_hour = kept
            .iter()
            .filter(|k| **k >= t("2024-05-10T12:00:00Z"))
            .count();
        assert_eq!(this_hour, 2);
        // Earlier today: one per hour (hours 0..=11).
        let today = kept
            .iter()
            .filter(|k| **k >= t("2024-05-10T00:00:00Z") && **k < t("2024-05-10T12:00:00Z"))
            .count();
        assert_eq!(today, 12);
        // Each of the 7 days before: exactly one.
        for d in 1..=7 {
            let from = t("2024-05-10T00:00:00Z") - TimeDelta::days(d);
            let n = kept
                .iter()
                .filter(|k| **k >= from && **k < from + TimeDelta::days(1))
                .count();
            assert_eq!(n, 1, "day -{d}");
        }
        // Older than 5 weeks: none.
        assert!(kept.iter().all(|k| *k > now - TimeDelta::days(36)));
        // Between a week and 5 weeks: at most one a week.
        let weekly = kept
            .iter()
            .filter(|k| **k < t("2024-05-03T00:00:00Z"))
            .count();
        assert!((3..=5).contains(&weekly), "{weekly} weekly snapshots");
        // The newest is kept.
        assert!(kept.contains(&now));
    }

    #[tokio::test]
    async fn run_deletes_what_the_plan_says() {
        let store = crate::store::SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "p",
        );
        let now = t("2024-05-10T12:00:00Z");
        let h = |n| now - TimeDelta::hours(n);
        let snaps = [full(10, h(3)), incr(11, 12, h(2)), full(20, h(1))];
        for s in &snaps {
            store
                .put_bytes(s, bytes::Bytes::from_static(b"x"))
                .await
                .unwrap();
        }
        let report = run(&store, now, limit(1, 0)).await.unwrap();
        assert_eq!(
            names(&report.deleted),
            vec![(Kind::Incr, 12), (Kind::Full, 10)]
        );
        assert!(report.failed.is_empty());
        assert_eq!(names(&store.list().await.unwrap()), vec![(Kind::Full, 20)]);
    }

    /// Issue 45, item 5: three unauthenticated `POST /snapshot/full` after three scheduled
    /// full snapshots deleted the three scheduled ones under `LimitBased` (max 3). Requested
    /// fulls, marked as the sidecar marks them, are counted apart: the scheduled ones stay, and
    /// requests never hold more than `max_backups` of their own. A marker whose snapshot is
    /// gone is deleted; so is a deleted triggered snapshot's.
    #[tokio::test]
    async fn requested_full_snapshots_cannot_push_scheduled_ones_out_of_retention() {
        let store = crate::store::SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "p",
        );
        let now = t("2024-05-10T12:00:00Z");
        let h = |n| now - TimeDelta::hours(n);
        let scheduled = [full(10, h(30)), full(20, h(20)), full(30, h(10))];
        let requested: Vec<Snapshot> = (0..5).map(|i| full(31 + i, h(5 - i))).collect();
        for s in scheduled.iter().chain(&requested) {
            store
                .put_bytes(s, bytes::Bytes::from_static(b"x"))
                .await
                .unwrap();
        }
        for s in &requested {
            mark_triggered(&store, s).await.unwrap();
        }
        // A marker left by a snapshot deleted by hand.
        mark_triggered(&store, &full(5, h(40))).await.unwrap();

        let report = run(&store, now, limit(3, 0)).await.unwrap();
        assert_eq!(
            names(&report.deleted),
            vec![(Kind::Full, 31), (Kind::Full, 32)],
            "only the oldest requested fulls beyond max_backups go"
        );
        assert_eq!(
            names(&store.list().await.unwrap()),
            vec![
                (Kind::Full, 10),
                (Kind::Full, 20),
                (Kind::Full, 30),
                (Kind::Full, 33),
                (Kind::Full, 34),
                (Kind::Full, 35)
            ]
        );
        let mut marked: Vec<String> = triggered_names(&store).await.unwrap().into_iter().collect();
        marked.sort();
        let mut want: Vec<String> = requested[2..].iter().map(|s| s.snap_name.clone()).collect();
        want.sort();
        assert_eq!(marked, want);

        // Unmarked (today's plan), the same store would lose its scheduled history.
        let all: Vec<Snapshot> = scheduled.iter().chain(&requested[2..]).cloned().collect();
        assert_eq!(
            names(&plan(&all, now, limit(3, 0))),
            vec![(Kind::Full, 10), (Kind::Full, 20), (Kind::Full, 30)]
        );
    }

    /// etcd-druid's requested finals are named final but judged as requests: beyond
    /// `max_backups` the oldest goes with both its markers, a hand-off's final (no marker)
    /// never does, and one whose triggered marker was never written (the sidecar stopped after
    /// the upload) is still a request. A requested-final marker whose snapshot is not listed may
    /// be of an upload under way: kept for a day, then deleted.
    #[tokio::test]
    async fn druids_requested_finals_are_judged_as_requests_and_their_markers_go_with_them() {
        let store = crate::store::SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "p",
        );
        // The markers' times are the store's (now): the plan's clock is now too.
        let now = Utc::now();
        let h = |n| now - TimeDelta::hours(n);
        let fin = |rev, at| Snapshot::new("", Kind::Full, 0, rev, at, Codec::Gzip, true);
        let hand_off = fin(5, h(50));
        let scheduled = [full(10, h(30)), full(20, h(20)), full(30, h(10))];
        let druids: Vec<Snapshot> = (0..5).map(|i| fin(31 + i, h(5 - i))).collect();
        for s in scheduled.iter().chain(&druids).chain([&hand_off]) {
            store
                .put_bytes(s, bytes::Bytes::from_static(b"x"))
                .await
                .unwrap();
        }
        for (i, s) in druids.iter().enumerate() {
            mark_requested_final(&store, s).await.unwrap();
            if i != 0 {
                mark_triggered(&store, s).await.unwrap();
            }
        }
        // The marker of an upload under way (its snapshot not stored yet).
        let uploading = fin(36, now);
        mark_requested_final(&store, &uploading).await.unwrap();

        let report = run(&store, now, limit(3, 0)).await.unwrap();
        assert_eq!(
            names(&report.deleted),
            vec![(Kind::Full, 31), (Kind::Full, 32)],
            "the oldest requested finals beyond max_backups go, the hand-off's final stays"
        );
        let mut marked: Vec<String> = requested_finals(&store)
            .await
            .unwrap()
            .into_iter()
            .collect();
        marked.sort();
        let mut want: Vec<String> = druids[2..]
            .iter()
            .chain([&uploading])
            .map(|s| s.snap_name.clone())
            .collect();
        want.sort();
        assert_eq!(
            marked, want,
            "a deleted request's marker goes, an upload's stays"
        );
        assert!(
            !triggered_names(&store)
                .await
                .unwrap()
                .contains(&druids[1].snap_name)
        );

        // A day later the upload's marker is an orphan.
        run(&store, now + TimeDelta::hours(25), limit(3, 0))
            .await
            .unwrap();
        assert!(
            !requested_finals(&store)
                .await
                .unwrap()
                .contains(&uploading.snap_name)
        );
        // Unmarked, they would be finals: never deleted, every one kept.
        let all: Vec<Snapshot> = scheduled.iter().chain(&druids).cloned().collect();
        assert!(plan(&all, now, limit(3, 0)).iter().all(|s| !s.is_final));
    }

    /// A backend whose deletes of some keys are refused as Azure refuses a blob under an
    /// immutability policy (GCS's and S3's refusals are told apart in `object_lock`).
    #[derive(Debug)]
    struct Immutable {
        inner: object_store::memory::InMemory,
        locked: std::sync::Mutex<std::collections::HashSet<String>>,
    }

    impl std::fmt::Display for Immutable {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Immutable")
        }
    }

    #[async_trait::async_trait]
    impl object_store::ObjectStore for Immutable {
        async fn put_opts(
            &self,
            location: &object_store::path::Path,
            payload: object_store::PutPayload,
            opts: object_store::PutOptions,
        ) -> object_store::Result<object_store::PutResult> {
            self.inner.put_opts(location, payload, opts).await
        }
        async fn put_multipart_opts(
            &self,
            location: &object_store::path::Path,
            opts: object_store::PutMultipartOptions,
        ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
            self.inner.put_multipart_opts(location, opts).await
        }
        async fn get_opts(
            &self,
            location: &object_store::path::Path,
            options: object_store::GetOptions,
        ) -> object_store::Result<object_store::GetResult> {
            self.inner.get_opts(location, options).await
        }
        fn delete_stream(
            &self,
            locations: futures::stream::BoxStream<
                'static,
                object_store::Result<object_store::path::Path>,
            >,
        ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>>
        {
            use futures::StreamExt;
            // A refused key becomes an error item, which the in-memory backend passes through.
            let locked = self.locked.lock().unwrap().clone();
            let checked = locations.map(move |p| match p {
                Ok(p) if locked.contains(p.as_ref()) => Err(object_store::Error::AlreadyExists {
                    path: p.to_string(),
                    source: "Server returned non-2xx status code: 409 Conflict: <Error><Code>\
                             BlobImmutableDueToPolicy</Code></Error>"
                        .into(),
                }),
                other => other,
            });
            self.inner.delete_stream(checked.boxed())
        }
        fn list(
            &self,
            prefix: Option<&object_store::path::Path>,
        ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>
        {
            self.inner.list(prefix)
        }
        async fn list_with_delimiter(
            &self,
            prefix: Option<&object_store::path::Path>,
        ) -> object_store::Result<object_store::ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }
        async fn copy_opts(
            &self,
            from: &object_store::path::Path,
            to: &object_store::path::Path,
            options: object_store::CopyOptions,
        ) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }

    /// Locked snapshots stay (a locked delta keeps its full snapshot), the pass succeeds, each
    /// is reported once per process, no newer snapshot goes in their place, and the next pass
    /// after their release deletes them.
    #[tokio::test]
    async fn locked_snapshots_are_kept_and_deleted_once_released() {
        let backend = std::sync::Arc::new(Immutable {
            inner: object_store::memory::InMemory::new(),
            locked: Default::default(),
        });
        let store = crate::store::SnapshotStore::new(backend.clone(), "p");
        let now = t("2024-05-10T12:00:00Z");
        let h = |n| now - TimeDelta::hours(n);
        let snaps = [
            full(10, h(6)),
            incr(11, 12, h(5)), // locked: keeps full 10
            full(20, h(4)),     // locked
            incr(21, 22, h(3)),
            full(30, h(2)),
            full(40, h(1)),
        ];
        for s in &snaps {
            store
                .put_bytes(s, bytes::Bytes::from_static(b"x"))
                .await
                .unwrap();
        }
        for s in [&snaps[1], &snaps[2]] {
            let key = store.path_of(s).to_string();
            backend.locked.lock().unwrap().insert(key);
        }
        let report = run(&store, now, limit(1, 0)).await.unwrap();
        assert_eq!(
            names(&report.deleted),
            vec![(Kind::Incr, 22), (Kind::Full, 30)]
        );
        assert_eq!(
            names(&report.locked),
            vec![(Kind::Incr, 12), (Kind::Full, 20)]
        );
        assert!(report.failed.is_empty());
        assert_eq!(
            names(&store.list().await.unwrap()),
            vec![
                (Kind::Full, 10),
                (Kind::Incr, 12),
                (Kind::Full, 20),
                (Kind::Full, 40)
            ]
        );
        // Reported already: the next pass does not log them again.
        let again = run(&store, now, limit(1, 0)).await.unwrap();
        assert_eq!(again.locked, report.locked);
        assert!(!store.first_seen_locked(&snaps[2]));

        backend.locked.lock().unwrap().clear();
        let released = run(&store, now, limit(1, 0)).await.unwrap();
        assert_eq!(
            names(&released.deleted),
            vec![(Kind::Incr, 12), (Kind::Full, 10), (Kind::Full, 20)]
        );
        assert!(released.locked.is_empty() && released.failed.is_empty());
        assert_eq!(names(&store.list().await.unwrap()), vec![(Kind::Full, 40)]);
        assert!(store.first_seen_locked(&snaps[2]), "forgotten once deleted");
    }

    /// The reference's own exponential GC scenario (snapshotter_test.go, "should garbage collect
    /// exponentially"): a snapshot every 10 minutes for 36 days, Full/Incr/Incr in turn, all at
    /// one revision; deltas of older streams removed. What must remain is listed exactly as the
    /// reference's `prepareExpectedSnapshotsList` builds it.
    #[test]
    fn exponential_matches_the_reference_scenario() {
        for now in [
            "2024-05-10T12:45:00Z",
            "2024-05-10T00:05:00Z",
            "2024-05-10T00:40:00Z",
            "2024-05-10T23:59:59Z",
            "2024-02-29T07:30:00Z",
        ] {
            reference_scenario(t(now));
        }
    }

    fn reference_scenario(now: DateTime<Utc>) {
        let midnight = now
            .with_hour(0)
            .and_then(|t| t.with_minute(0))
            .and_then(|t| t.with_second(0))
            .unwrap();
        let mut snaps = Vec::new();
        let mut at = midnight - TimeDelta::days(36);
        let mut count = 0;
        while at <= now {
            let kind = if count == 0 { Kind::Full } else { Kind::Incr };
            count = (count + 1) % 3;
            snaps.push(Snapshot::new("", kind, 0, 1001, at, Codec::Gzip, false));
            at += TimeDelta::minutes(10);
        }
        let doomed = plan(
            &snaps,
            now,
            Retention {
                policy: GcPolicy::Exponential,
                // The reference's zero retention: every delta of an older stream goes.
                delta_retention: Duration::from_secs(1),
            },
        );
        let doomed: std::collections::HashSet<String> =
            doomed.into_iter().map(|s| s.snap_name).collect();
        let kept: Vec<(Kind, DateTime<Utc>)> = snaps
            .iter()
            .filter(|s| !doomed.contains(&s.snap_name))
            .map(|s| (s.kind, s.created_on))
            .collect();

        let mut expected = Vec::new();
        let mut at = midnight - TimeDelta::days(35) - TimeDelta::minutes(30);
        for _ in 0..4 {
            at += TimeDelta::days(7);
            expected.push((Kind::Full, at));
        }
        for _ in 0..7 {
            at += TimeDelta::days(1);
            expected.push((Kind::Full, at));
        }
        at += TimeDelta::hours(1);
        let this_hour = now.with_minute(0).and_then(|t| t.with_second(0)).unwrap();
        while at < this_hour {
            expected.push((Kind::Full, at));
            at += TimeDelta::hours(1);
        }
        let mut at = this_hour;
        while at <= now {
            expected.push((Kind::Full, at));
            at += TimeDelta::minutes(30);
        }
        at += TimeDelta::minutes(-30 + 10);
        while at <= now {
            expected.push((Kind::Incr, at));
            at += TimeDelta::minutes(10);
        }
        assert_eq!(kept, expected, "now = {now}");
    }

    #[test]
    fn exponential_on_a_sparse_history_deletes_nothing_recent() {
        let now = Utc.with_ymd_and_hms(2024, 5, 10, 12, 0, 0).unwrap();
        let snaps = vec![
            full(1, now - TimeDelta::hours(3)),
            full(2, now - TimeDelta::hours(2)),
            full(3, now - TimeDelta::hours(1)),
        ];
        assert!(plan(&snaps, now, EXP).is_empty());
    }

    /// A store's history as the sidecar writes it: a scheduled full snapshot every hour on the
    /// hour, a delta every 20 minutes, one write a minute (revision = minutes since `from`),
    /// and a requested full snapshot at each time of `requested`, marked as the sidecar marks
    /// it. `rebased`: the delta writer restarts at each requested full (as it did up to issue
    /// 54), so the next delta continues the requested full and not the chain before it.
    /// A request at the very second of a scheduled full and at its revision has the scheduled
    /// one's name: the store holds one object, and its marker.
    struct History {
        snapshots: Vec<Snapshot>,
        triggered: HashSet<String>,
    }

    fn history(
        from: DateTime<Utc>,
        now: DateTime<Utc>,
        requested: &[DateTime<Utc>],
        rebased: bool,
    ) -> History {
        let mut snapshots = Vec::new();
        let mut triggered = HashSet::new();
        let mut reach: Option<i64> = None;
        let mut at = from;
        let mut rev = 1;
        let mut sorted_requests = requested.to_vec();
        sorted_requests.sort();
        let mut pending = sorted_requests.into_iter().peekable();
        while at <= now {
            let minute = at.minute();
            if minute == 0 {
                snapshots.push(full(rev, at));
                reach = Some(rev);
            } else if minute.is_multiple_of(20)
                && let Some(r) = reach
                && r < rev
            {
                snapshots.push(incr(r + 1, rev, at));
                reach = Some(rev);
            }
            while let Some(&when) = pending.peek()
                && when < at + TimeDelta::minutes(1)
            {
                pending.next();
                let s = full(rev, when);
                triggered.insert(s.snap_name.clone());
                if !snapshots.contains(&s) {
                    snapshots.push(s);
                }
                if rebased {
                    reach = Some(rev);
                }
            }
            at += TimeDelta::minutes(1);
            rev += 1;
        }
        History {
            snapshots,
            triggered,
        }
    }

    fn kept(h: &History, now: DateTime<Utc>, r: Retention) -> Vec<Snapshot> {
        let doomed: HashSet<String> = plan_with(&h.snapshots, &h.triggered, now, r)
            .into_iter()
            .map(|s| s.snap_name)
            .collect();
        h.snapshots
            .iter()
            .filter(|s| !doomed.contains(&s.snap_name))
            .cloned()
            .collect()
    }

    /// What retention keeps of the scheduled history (every snapshot not requested).
    fn kept_scheduled(h: &History, now: DateTime<Utc>, r: Retention) -> Vec<String> {
        kept(h, now, r)
            .into_iter()
            .filter(|s| !h.triggered.contains(&s.snap_name))
            .map(|s| s.snap_name)
            .collect()
    }

    /// Issue 54, item 12: a requested full snapshot at HH:58 made `Exponential` retention delete
    /// the scheduled HH:00 full snapshot and both of its deltas (the last full snapshot of each
    /// past hour is kept, and the requested one was the last): the hour's point-in-time history
    /// was gone. The scheduled history is now kept exactly as without the request, and the
    /// request is kept beside it.
    #[test]
    fn a_requested_full_at_hh58_leaves_the_scheduled_chain_of_its_hour_alone() {
        let now = t("2024-05-10T12:30:00Z");
        let from = now - TimeDelta::days(40);
        let baseline = history(from, now, &[], false);
        let lost = |at: &str, r: Retention| {
            let h = history(from, now, &[t(at)], false);
            let want = kept_scheduled(&baseline, now, r);
            let got = kept_scheduled(&h, now, r);
            let gone: Vec<String> = want.iter().filter(|s| !got.contains(s)).cloned().collect();
            let requested_kept = kept(&h, now, r)
                .iter()
                .any(|s| h.triggered.contains(&s.snap_name));
            (gone, got.len() == want.len(), requested_kept)
        };
        for (at, r) in [
            ("2024-05-10T10:58:00Z", EXP),
            // Earlier today, on another day of the week before, in an older week.
            ("2024-05-10T03:58:30Z", EXP),
            ("2024-05-07T23:58:00Z", EXP),
            ("2024-04-20T17:58:00Z", EXP),
            // The current hour.
            ("2024-05-10T12:29:00Z", EXP),
            ("2024-05-10T10:58:00Z", limit(3, 0)),
        ] {
            let (gone, same, requested_kept) = lost(at, r);
            assert!(gone.is_empty(), "a request at {at} ({r:?}) cost {gone:?}");
            assert!(
                same,
                "a request at {at} ({r:?}) changed the scheduled history"
            );
            assert!(requested_kept, "the request at {at} is kept");
        }
        // The finding itself, by name: 10:00 and its 10:20 and 10:40 deltas stay.
        let h = history(from, now, &[t("2024-05-10T10:58:00Z")], false);
        let kept: Vec<DateTime<Utc>> = kept(&h, now, EXP).iter().map(|s| s.created_on).collect();
        for at in ["10:00", "10:20", "10:40", "10:58"] {
            let at = t(&format!("2024-05-10T{at}:00Z"));
            assert!(kept.contains(&at), "{at} deleted");
        }
    }

    /// Many requests (one every 7 minutes for 40 days, 8,000 full snapshots): the scheduled
    /// history is kept exactly as without them, and the requests keep at most one full snapshot
    /// per window of their own (each hour of today, each day of the week before, each week up
    /// to 5 weeks), whenever retention runs.
    #[test]
    fn many_requested_fulls_keep_a_bounded_number_and_displace_nothing() {
        for now in [
            "2024-05-10T12:30:00Z",
            "2024-05-10T23:59:00Z",
            "2024-05-10T00:10:00Z",
        ] {
            let now = t(now);
            let from = now - TimeDelta::days(40);
            let mut requested = Vec::new();
            let mut at = from + TimeDelta::seconds(3);
            while at <= now {
                requested.push(at);
                at += TimeDelta::minutes(7);
            }
            let baseline = history(from, now, &[], false);
            let h = history(from, now, &requested, false);
            assert!(h.triggered.len() > 8000);
            assert_eq!(
                kept_scheduled(&h, now, EXP),
                kept_scheduled(&baseline, now, EXP),
                "now = {now}"
            );
            let kept_requested: Vec<DateTime<Utc>> = kept(&h, now, EXP)
                .iter()
                .filter(|s| h.triggered.contains(&s.snap_name))
                .map(|s| s.created_on)
                .collect();
            let this_hour = now.with_minute(0).unwrap();
            assert!(
                kept_requested.len() <= REQUESTED_BOUND,
                "now = {now}: {} requested kept",
                kept_requested.len()
            );
            assert_eq!(
                kept_requested.iter().filter(|k| **k >= this_hour).count(),
                1,
                "now = {now}: the current hour keeps its newest request only"
            );
            assert!(
                kept_requested
                    .iter()
                    .all(|k| *k > now - TimeDelta::days(36))
            );
            // Under LimitBased, the newest max_backups of them.
            assert_eq!(
                kept_scheduled(&h, now, limit(5, 0)),
                kept_scheduled(&baseline, now, limit(5, 0))
            );
            let n = kept(&h, now, limit(5, 0))
                .iter()
                .filter(|s| h.triggered.contains(&s.snap_name))
                .count();
            assert_eq!(n, 5);
        }
    }

    /// The most requested full snapshots `Exponential` keeps: the newest of each hour of today
    /// (24), of each of the 7 days before, of each week up to 5 weeks (5), and one more where a
    /// week window straddles the day windows' end.
    const REQUESTED_BOUND: usize = 37;

    /// A request in the same second as a scheduled full snapshot: after it (a write between,
    /// so another revision and name), before it, and at its very revision (the same name: the
    /// store holds one object, marked). The scheduled history loses nothing in any of them.
    #[test]
    fn a_requested_full_in_the_same_second_as_a_scheduled_one_displaces_nothing() {
        let now = t("2024-05-10T12:30:00Z");
        let from = now - TimeDelta::days(40);
        let baseline = history(from, now, &[], false);
        for r in [EXP, limit(3, 0), limit(1, 0)] {
            let want = kept_scheduled(&baseline, now, r);
            for at in [
                "2024-05-10T10:00:00Z",
                "2024-05-07T23:00:00Z",
                "2024-04-20T00:00:00Z",
            ] {
                // The same name: every full snapshot the baseline keeps is still there.
                let h = history(from, now, &[t(at)], false);
                assert_eq!(h.snapshots.len(), baseline.snapshots.len());
                let got: Vec<String> = kept(&h, now, r).into_iter().map(|s| s.snap_name).collect();
                let gone: Vec<&String> = want.iter().filter(|s| !got.contains(s)).collect();
                assert!(gone.is_empty(), "{at} ({r:?}): {gone:?}");
            }
            // Another revision in the same second, ordered after and before the scheduled one.
            let mut snaps = baseline.snapshots.clone();
            let s10 = full(0, t("2024-05-10T10:00:00Z"));
            let s10 = snaps
                .iter()
                .find(|s| s.kind == Kind::Full && s.created_on == s10.created_on)
                .cloned()
                .expect("the 10:00 full snapshot");
            let mut triggered = HashSet::new();
            for rev in [s10.last_revision - 1, s10.last_revision + 1] {
                let req = full(rev, s10.created_on);
                triggered.insert(req.snap_name.clone());
                snaps.push(req);
            }
            let doomed: HashSet<String> = plan_with(&snaps, &triggered, now, r)
                .into_iter()
                .map(|s| s.snap_name)
                .collect();
            let gone: Vec<&String> = want.iter().filter(|n| doomed.contains(*n)).collect();
            assert!(gone.is_empty(), "{r:?}: {gone:?}");
        }
    }

    /// The deltas after a requested full snapshot continue the scheduled chain it is in: a
    /// request beyond `max_backups` goes alone, its deltas stay (before, they went with it, and
    /// the scheduled chain ended at it). A request kept when its scheduled chain is not keeps
    /// the deltas after it.
    #[test]
    fn a_requested_full_goes_alone_and_its_deltas_stay_with_the_scheduled_chain() {
        let now = t("2024-05-10T12:00:00Z");
        let h = |n: i64| now - TimeDelta::minutes(n);
        let requested = [full(20, h(100)), full(40, h(80)), full(47, h(70))];
        let snaps = vec![
            full(10, h(120)),
            incr(11, 15, h(110)),
            requested[0].clone(),
            incr(16, 25, h(95)), // overlaps the request: the writer went on through it
            incr(26, 35, h(90)),
            requested[1].clone(),
            incr(36, 45, h(75)),
            requested[2].clone(),
            incr(46, 49, h(65)),
            full(50, h(60)),
            incr(51, 55, h(50)),
        ];
        let triggered: HashSet<String> = requested.iter().map(|s| s.snap_name.clone()).collect();
        for (r, want) in [
            (limit(3, 0), vec![]),
            // One request per hour: the newest of the three.
            (EXP, vec![(Kind::Full, 20), (Kind::Full, 40)]),
            (limit(2, 0), vec![(Kind::Full, 20)]),
            (
                limit(1, 0),
                vec![
                    (Kind::Incr, 15),
                    (Kind::Full, 10),
                    (Kind::Incr, 35),
                    (Kind::Incr, 25),
                    (Kind::Full, 20),
                    (Kind::Incr, 45),
                    (Kind::Full, 40),
                ],
            ),
        ] {
            assert_eq!(names(&plan_with(&snaps, &triggered, now, r)), want, "{r:?}");
        }
        // Past 5 weeks: everything but the newest scheduled chain and the newest request.
        let del = plan_with(&snaps, &triggered, now + TimeDelta::days(60), EXP);
        assert_eq!(
            names(&del),
            vec![
                (Kind::Incr, 15),
                (Kind::Full, 10),
                (Kind::Incr, 35),
                (Kind::Incr, 25),
                (Kind::Full, 20),
                (Kind::Incr, 45),
                (Kind::Full, 40),
            ]
        );
        // The newest request is always kept (one, whatever its age), with its deltas.
    }

    /// A requested full snapshot the scheduled chain cannot do without (the delta writer
    /// restarted at it, as it did up to issue 54, or because its watch was lost): kept as long
    /// as its scheduled chain, whatever the requests' own keep says.
    #[test]
    fn a_requested_full_the_scheduled_chain_runs_through_stays_with_it() {
        let now = t("2024-05-10T12:30:00Z");
        let from = now - TimeDelta::days(40);
        let requested: Vec<DateTime<Utc>> = ["2024-05-10T10:58:00Z", "2024-05-10T11:30:00Z"]
            .iter()
            .map(|s| t(s))
            .collect();
        let h = history(from, now, &requested, true);
        let baseline = history(from, now, &[], false);
        for r in [EXP, limit(1, 0), limit(3, 0)] {
            let kept = kept(&h, now, r);
            // Every delta kept continues a kept full snapshot or kept delta: no chain is cut.
            let mut sorted = kept.clone();
            sorted.sort_by(compare);
            let mut reach: Option<i64> = None;
            for s in &sorted {
                match s.kind {
                    Kind::Full => {
                        reach = Some(reach.map_or(s.last_revision, |r| r.max(s.last_revision)))
                    }
                    Kind::Incr => {
                        let r = reach.expect("a delta before every full snapshot kept");
                        assert!(
                            link(r, s) != Link::Gap,
                            "{r:?}: {} is cut from its chain",
                            s.snap_name
                        );
                        reach = Some(s.last_revision);
                    }
                }
            }
            // The scheduled full snapshots the baseline keeps are all there.
            let want: Vec<String> = kept_scheduled(&baseline, now, r)
                .into_iter()
                .filter(|n| n.starts_with("Full"))
                .collect();
            let got: Vec<&String> = kept.iter().map(|s| &s.snap_name).collect();
            for w in &want {
                assert!(got.contains(&w), "{r:?}: {w} deleted");
            }
        }
    }
}
