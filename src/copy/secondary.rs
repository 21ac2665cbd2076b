//! The secondary store (`[store.secondary]`): every snapshot the primary holds is copied there
//! by a background task of `serve`, with the copy job's streamed, hash-checked [`copy_one`].
//!
//! - **Off the primary's path**: the task only reads the primary's listing and objects; the
//!   snapshot actor, the ownership watchdog and the final never wait for it. Its failures are
//!   backed off ([`Backoff`]) and show in metrics and the `EtcdWardenSecondaryBehind` alert,
//!   never in readiness: etcd serving is not less safe because a second copy is late.
//! - **Order** ([`plan`]): final full snapshots first (the data a hand-off moves), then oldest
//!   first, one at a time. The secondary then always holds a prefix of the primary's history,
//!   so its latest chain restores (no delta before its predecessor), and the lag is one number:
//!   the age of the oldest primary snapshot not yet copied ([`lag`]).
//! - **Retention** ([`expiring`]): one judgement for both stores. The primary's policy is
//!   applied to the snapshots of both listings at once, each as the primary knows it (a final
//!   stays final though the secondary names it without `.final`; a requested full is counted
//!   apart by its marker on the primary); the sync leaves out what it expires, and the
//!   secondary deletes what it expires after each pass. Copy and delete never chase each
//!   other: judged on the secondary's own listing, the secondary used to delete a final's
//!   stream (a plain full there) that the next pass copied again.
//! - **Only snapshots**: the hand-off record and fence markers stay on the primary. They are the
//!   ownership protocol's linearization point (create-if-absent on one store); a second copy
//!   could disagree with the first and name two finals. `.final` is stripped at the secondary
//!   as by the copy job ([`super::plan::dest_name`]), so a secondary promoted to a primary
//!   never believes it already took its final.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::plan::{Listed, dest_name};
use super::progress::Progress;
use super::{CopyError, Stores, copy_one, list_sized, store_error};
use crate::backoff::Backoff;
use crate::config::SecondaryConfig;
use crate::store::Snapshot;
use crate::store::gc::{self, Retention};
use crate::store::layout::FINAL_SUFFIX;

/// Retry delays after failed passes: the secondary being down is retried quickly at first,
/// then no more than every two minutes.
const BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(120));

/// The secondary's metrics (`etcd_warden_secondary_…`); cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct SecondaryMetrics {
    lag_seconds: Gauge<f64, AtomicU64>,
    lag_revisions: Gauge<i64, AtomicI64>,
    max_lag_seconds: Gauge<f64, AtomicU64>,
    copied: Counter,
    failures: Counter,
    last_sync: Gauge<f64, AtomicU64>,
}

impl SecondaryMetrics {
    /// Registers the metrics.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "etcd_warden_secondary_lag_seconds",
            "Age of the oldest primary snapshot not yet on the secondary store (0 when in sync)",
            self.lag_seconds.clone(),
        );
        registry.register(
            "etcd_warden_secondary_lag_revisions",
            "Revisions the secondary store's restorable history is behind the primary's",
            self.lag_revisions.clone(),
        );
        registry.register(
            "etcd_warden_secondary_max_lag_seconds",
            "store.secondary.max_lag: the lag above which EtcdWardenSecondaryBehind fires",
            self.max_lag_seconds.clone(),
        );
        registry.register(
            "etcd_warden_secondary_copied",
            "Snapshots copied to the secondary store",
            self.copied.clone(),
        );
        registry.register(
            "etcd_warden_secondary_sync_failures",
            "Sync passes to the secondary store that failed (retried with backoff)",
            self.failures.clone(),
        );
        registry.register(
            "etcd_warden_secondary_last_sync_timestamp_seconds",
            "Unix time of the last pass that left the secondary holding every primary snapshot",
            self.last_sync.clone(),
        );
    }

    fn set_lag(&self, lag: Lag) {
        self.lag_seconds.set(lag.seconds);
        self.lag_revisions.set(lag.revisions);
    }
}

/// How far the secondary is behind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lag {
    /// Age of the oldest primary snapshot not on the secondary; 0 when none is missing.
    pub seconds: f64,
    /// The primary's newest revision minus the newest revision the secondary holds without a
    /// gap before it (with oldest-first copies, what a restore from it reaches).
    pub revisions: i64,
}

/// Whether the secondary holds `l` (the same name ignoring `.final`, the same size).
fn held(l: &Listed, secondary: &HashMap<String, u64>) -> bool {
    let name = dest_name(&l.snapshot);
    secondary
        .get(&name)
        .or_else(|| secondary.get(&format!("{name}{FINAL_SUFFIX}")))
        == Some(&l.size)
}

/// What retention expires, by the names the secondary gives them (`.final` stripped), in the
/// order to delete them (each stream's deltas before its full snapshot): the primary's policy
/// judged once over the snapshots of both stores, each as the primary knows it when it holds it
/// (a final stays final, a requested full named in `triggered`, the primary's markers, is
/// counted apart), and as the secondary holds it otherwise (one the primary already deleted).
/// [`plan`] copies none of these and the secondary's retention deletes those it holds, so the
/// union the judgement reads is the same before and after a pass's copies.
pub fn expiring(
    primary: &[Listed],
    secondary: &[Listed],
    triggered: &HashSet<String>,
    now: DateTime<Utc>,
    retention: Retention,
) -> Vec<String> {
    let mut both: HashMap<String, Snapshot> = secondary
        .iter()
        .map(|l| (dest_name(&l.snapshot), l.snapshot.clone()))
        .collect();
    for l in primary {
        both.insert(dest_name(&l.snapshot), l.snapshot.clone());
    }
    let all: Vec<Snapshot> = both.into_values().collect();
    gc::plan_with(&all, triggered, now, retention)
        .iter()
        .map(dest_name)
        .collect()
}

/// What to copy, in order: the snapshots of the sorted primary listing that the secondary does
/// not hold and retention does not expire (`expiring`, from [`expiring`]), final full snapshots
/// first, then oldest first.
pub fn plan(
    primary: &[Listed],
    secondary: &HashMap<String, u64>,
    expiring: &HashSet<String>,
) -> Vec<Listed> {
    let mut todo: Vec<Listed> = primary
        .iter()
        .filter(|l| !held(l, secondary) && !expiring.contains(&dest_name(&l.snapshot)))
        .cloned()
        .collect();
    // Stable: finals first, each group keeps the listing's oldest-first order.
    todo.sort_by_key(|l| !(l.snapshot.is_final && l.snapshot.is_full()));
    todo
}

/// How far `secondary` is behind the sorted `primary` listing at `now`.
pub fn lag(primary: &[Listed], secondary: &HashMap<String, u64>, now: DateTime<Utc>) -> Lag {
    let newest = primary
        .iter()
        .map(|l| l.snapshot.last_revision)
        .max()
        .unwrap_or(0);
    let Some(first_missing) = primary.iter().position(|l| !held(l, secondary)) else {
        return Lag {
            seconds: 0.0,
            revisions: 0,
        };
    };
    let reached = primary[..first_missing]
        .iter()
        .map(|l| l.snapshot.last_revision)
        .max()
        .unwrap_or(0);
    let age = now - primary[first_missing].snapshot.created_on;
    Lag {
        seconds: age.num_milliseconds().max(0) as f64 / 1000.0,
        revisions: newest - reached,
    }
}

/// The background task that keeps the secondary in step with the primary.
pub struct Sync {
    stores: Stores,
    config: SecondaryConfig,
    retention: Retention,
    metrics: SecondaryMetrics,
    /// The secondary's objects as last listed, plus what was copied since: the lag is still
    /// known (and grows) while the secondary cannot be listed, or a pass hangs on it
    /// ([`watch_lag`] reads it then).
    known: Arc<Mutex<HashMap<String, u64>>>,
}

impl Sync {
    /// A sync from `primary` (the sidecar's store) to the secondary `config` describes, whose
    /// provider variables may carry a `SECONDARY_` prefix (`SECONDARY_AWS_ACCESS_KEY_ID`).
    pub fn new(
        primary: &crate::config::StoreConfig,
        config: SecondaryConfig,
        retention: Retention,
        metrics: SecondaryMetrics,
    ) -> Result<Sync, CopyError> {
        let stores = Stores::build(primary, None, &config.store, Some("SECONDARY_"))?;
        metrics.max_lag_seconds.set(config.max_lag.as_secs_f64());
        Ok(Sync {
            stores,
            config,
            retention,
            metrics,
            known: Arc::default(),
        })
    }

    /// Bounds what the primary's snapshots may decompress to while they are checked.
    pub fn with_read_limits(mut self, limits: crate::store::ReadLimits) -> Self {
        self.stores.source = self.stores.source.with_read_limits(limits);
        self
    }

    /// Syncs every `sync_interval` (after a failure, after the backoff) until `cancel`.
    pub async fn run(mut self, cancel: CancellationToken) {
        tracing::info!(
            secondary = %self.stores.dest.prefix(),
            interval = ?self.config.sync_interval,
            max_lag = ?self.config.max_lag,
            "copying every snapshot to the secondary store"
        );
        let mut failed = 0;
        loop {
            let watch = watch_lag(
                self.stores.source.clone(),
                self.known.clone(),
                self.metrics.clone(),
                self.config.sync_interval,
            );
            let pause = tokio::select! {
                _ = cancel.cancelled() => return,
                // Never ends: it only updates the lag while the pass runs.
                () = watch => continue,
                r = self.pass() => match r {
                    Ok(()) => {
                        failed = 0;
                        self.config.sync_interval
                    }
                    Err(e) => {
                        failed += 1;
                        self.metrics.failures.inc();
                        let delay = BACKOFF.delay(failed);
                        tracing::warn!(
                            error = %e,
                            failed,
                            retry_in = ?delay,
                            "secondary store sync failed; the primary is unaffected"
                        );
                        delay
                    }
                },
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_lag(&self, primary: &[Listed]) {
        let lag = lag(primary, &self.known(), Utc::now());
        self.metrics.set_lag(lag);
    }

    /// One pass: list both, copy what is missing in [`plan`]'s order, then delete from the
    /// secondary what [`expiring`] names. The lag is updated before and after every copy.
    async fn pass(&mut self) -> Result<(), CopyError> {
        // The primary's markers before its listing, as its own retention reads them: a marker
        // is written after its snapshot is stored.
        let triggered = gc::triggered_names(&self.stores.source)
            .await
            .map_err(store_error("primary", &self.stores.source))?;
        let primary = list_sized(&self.stores.source)
            .await
            .map_err(store_error("primary", &self.stores.source))?;
        let listed = list_sized(&self.stores.dest).await;
        let listed = match listed {
            Ok(l) => l,
            Err(e) => {
                self.set_lag(&primary);
                return Err(store_error("secondary", &self.stores.dest)(e));
            }
        };
        *self.known() = listed
            .iter()
            .map(|l| (l.snapshot.snap_name.clone(), l.size))
            .collect();
        self.set_lag(&primary);
        let expired = expiring(&primary, &listed, &triggered, Utc::now(), self.retention);
        let todo = plan(&primary, &self.known(), &expired.iter().cloned().collect());
        let progress = Progress::new(todo.len(), todo.iter().map(|l| l.size).sum());
        for item in &todo {
            let s = &item.snapshot;
            let result = copy_one(&self.stores, item, &progress).await;
            match result {
                Ok(_) => {
                    tracing::info!(snapshot = %s.snap_name, revision = s.last_revision, "copied to the secondary store");
                    self.known().insert(dest_name(s), item.size);
                    self.metrics.copied.inc();
                    self.set_lag(&primary);
                }
                Err(source) => {
                    return Err(CopyError::Incomplete {
                        total: todo.len(),
                        failures: vec![(s.snap_name.clone(), source)],
                    });
                }
            }
        }
        self.metrics.last_sync.set(Utc::now().timestamp() as f64);
        // As the secondary lists them, in the judgement's order (deltas before their full).
        let mut on_secondary: HashMap<&str, &Listed> = listed
            .iter()
            .map(|l| (l.snapshot.snap_name.as_str(), l))
            .collect();
        let doomed: Vec<Snapshot> = expired
            .iter()
            .filter_map(|name| on_secondary.remove(name.as_str()))
            .map(|l| l.snapshot.clone())
            .collect();
        let report = gc::delete(&self.stores.dest, doomed, &HashSet::new()).await;
        for s in &report.deleted {
            self.known().remove(&s.snap_name);
        }
        Ok(())
    }
}

/// While a pass runs: every `interval` (at least a second), the lag from a fresh listing of the
/// primary and what the secondary is known to hold. A secondary that hangs holds a pass for as
/// long as the store client retries (minutes); the lag, and `EtcdWardenSecondaryBehind` on it,
/// must grow meanwhile, not stay at the last pass's value. Never ends.
async fn watch_lag(
    primary: crate::store::SnapshotStore,
    known: Arc<Mutex<HashMap<String, u64>>>,
    metrics: SecondaryMetrics,
    interval: Duration,
) {
    let interval = interval.max(Duration::from_secs(1));
    loop {
        tokio::time::sleep(interval).await;
        if let Ok(Ok(listed)) = tokio::time::timeout(interval, list_sized(&primary)).await {
            let known = known.lock().unwrap_or_else(|e| e.into_inner()).clone();
            metrics.set_lag(lag(&listed, &known, Utc::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GcPolicy;
    use crate::store::compression::Codec;
    use crate::store::{Kind, Snapshot};
    use chrono::TimeZone;

    fn at(minute: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 26, 12, minute, 0).unwrap()
    }
    fn listed(kind: Kind, start: i64, last: i64, minute: u32, is_final: bool) -> Listed {
        Listed {
            snapshot: Snapshot::new("", kind, start, last, at(minute), Codec::Gzip, is_final),
            size: 100 + last as u64,
        }
    }
    fn holding(items: &[&Listed]) -> HashMap<String, u64> {
        items
            .iter()
            .map(|l| (dest_name(&l.snapshot), l.size))
            .collect()
    }

    #[test]
    fn the_final_goes_first_then_oldest_first_and_lag_is_the_oldest_missing() {
        let full = listed(Kind::Full, 0, 10, 0, false);
        let d1 = listed(Kind::Incr, 11, 20, 1, false);
        let d2 = listed(Kind::Incr, 21, 30, 2, false);
        let fin = listed(Kind::Full, 0, 30, 3, true);
        let primary = vec![full.clone(), d1.clone(), d2.clone(), fin.clone()];
        let secondary = holding(&[&full]);

        let order: Vec<i64> = plan(&primary, &secondary, &HashSet::new())
            .iter()
            .map(|l| l.snapshot.last_revision)
            .collect();
        assert_eq!(order, vec![30, 20, 30]);
        assert!(
            plan(&primary, &secondary, &HashSet::new())[0]
                .snapshot
                .is_final
        );

        assert_eq!(
            lag(&primary, &secondary, at(5)),
            Lag {
                seconds: 240.0,
                revisions: 20
            }
        );
        // The final is held without `.final`, as the copy job names it.
        let all = holding(&[&full, &d1, &d2, &fin]);
        assert!(all.keys().all(|k| !k.ends_with(FINAL_SUFFIX)));
        assert!(plan(&primary, &all, &HashSet::new()).is_empty());
        assert_eq!(lag(&primary, &all, at(5)).seconds, 0.0);
    }

    #[test]
    fn a_torn_copy_of_another_size_is_not_held() {
        let full = listed(Kind::Full, 0, 10, 0, false);
        let mut torn = holding(&[&full]);
        torn.values_mut().for_each(|v| *v -= 1);
        assert_eq!(
            plan(std::slice::from_ref(&full), &torn, &HashSet::new()),
            vec![full]
        );
    }

    #[test]
    fn what_retention_would_delete_is_not_copied() {
        let old = listed(Kind::Full, 0, 10, 0, false);
        let new = listed(Kind::Full, 0, 20, 1, false);
        let one = Retention {
            policy: GcPolicy::LimitBased { max_backups: 1 },
            delta_retention: Duration::ZERO,
        };
        let primary = [old, new.clone()];
        let expired = expiring(&primary, &[], &HashSet::new(), at(2), one)
            .into_iter()
            .collect();
        let todo = plan(&primary, &HashMap::new(), &expired);
        assert_eq!(todo, vec![new]);
    }

    /// One sync pass as `Sync::pass` makes it, on listings: copy [`plan`]'s snapshots, then
    /// delete what [`expiring`] names. Returns the secondary after it, and what was copied and
    /// deleted.
    fn pass(
        primary: &[Listed],
        secondary: &[Listed],
        triggered: &HashSet<String>,
        now: DateTime<Utc>,
        retention: Retention,
    ) -> (Vec<Listed>, Vec<String>, Vec<String>) {
        let known: HashMap<String, u64> = secondary
            .iter()
            .map(|l| (l.snapshot.snap_name.clone(), l.size))
            .collect();
        let expired = expiring(primary, secondary, triggered, now, retention);
        let copied: Vec<Listed> = plan(primary, &known, &expired.iter().cloned().collect())
            .into_iter()
            .map(|l| Listed {
                snapshot: crate::copy::plan::dest_snapshot(&l.snapshot),
                size: l.size,
            })
            .collect();
        let deleted: Vec<String> = expired
            .iter()
            .filter(|n| known.contains_key(*n))
            .cloned()
            .collect();
        let after: Vec<Listed> = secondary
            .iter()
            .chain(&copied)
            .filter(|l| !deleted.contains(&l.snapshot.snap_name))
            .cloned()
            .collect();
        let names = |v: &[Listed]| v.iter().map(|l| l.snapshot.snap_name.clone()).collect();
        (after, names(&copied), deleted)
    }

    /// The robustness harness's finding (druid profile, seed 0x41): the secondary's retention
    /// judged its own listing, where a final is a plain full snapshot (`.final` stripped) and no
    /// requested full is marked, so it deleted a final's stream and requested fulls that the
    /// primary keeps, and every pass copied them again (and a drill reading the secondary
    /// meanwhile found snapshots gone). Now a pass reaches a fixed point: the second copies and
    /// deletes nothing, and what the primary keeps stays on the secondary.
    #[test]
    fn the_sync_and_the_secondarys_retention_agree_and_stop() {
        let one = Retention {
            policy: GcPolicy::LimitBased { max_backups: 1 },
            delta_retention: Duration::ZERO,
        };
        // An old hand-off's final with a delta after it, scheduled fulls, a requested one.
        let fin = listed(Kind::Full, 0, 10, 0, true);
        let d1 = listed(Kind::Incr, 11, 20, 1, false);
        let f2 = listed(Kind::Full, 0, 30, 2, false);
        let requested = listed(Kind::Full, 0, 40, 3, false);
        let f4 = listed(Kind::Full, 0, 50, 4, false);
        let d2 = listed(Kind::Incr, 51, 60, 5, false);
        let triggered: HashSet<String> = [requested.snapshot.snap_name.clone()].into();
        // The primary's own retention already deleted f2, the scheduled full before f4.
        let primary = vec![
            fin.clone(),
            d1.clone(),
            requested.clone(),
            f4.clone(),
            d2.clone(),
        ];
        let on_primary = gc::plan_with(
            &primary
                .iter()
                .map(|l| l.snapshot.clone())
                .collect::<Vec<_>>(),
            &triggered,
            at(6),
            one,
        );
        assert!(on_primary.is_empty(), "{on_primary:?}");

        // The secondary still holds f2 and holds nothing newer.
        let secondary = vec![
            Listed {
                snapshot: crate::copy::plan::dest_snapshot(&fin.snapshot),
                size: fin.size,
            },
            d1.clone(),
            f2.clone(),
        ];
        let (after, copied, deleted) = pass(&primary, &secondary, &triggered, at(6), one);
        assert_eq!(deleted, vec![f2.snapshot.snap_name.clone()]);
        let mut want = vec![
            requested.snapshot.snap_name.clone(),
            f4.snapshot.snap_name.clone(),
            d2.snapshot.snap_name.clone(),
        ];
        want.sort();
        let mut got = copied.clone();
        got.sort();
        assert_eq!(got, want);

        let (again, copied, deleted) = pass(&primary, &after, &triggered, at(7), one);
        assert!(copied.is_empty(), "copied again: {copied:?}");
        assert!(deleted.is_empty(), "deleted again: {deleted:?}");
        let mut held: Vec<String> = again.iter().map(|l| l.snapshot.snap_name.clone()).collect();
        held.sort();
        let mut kept: Vec<String> = primary.iter().map(|l| dest_name(&l.snapshot)).collect();
        kept.sort();
        assert_eq!(held, kept, "the secondary holds what the primary keeps");
    }

    /// A pass held by a secondary that hangs (an endpoint that accepts and never answers; the
    /// store client waits and retries for minutes) still raises the lag every sync interval,
    /// from the primary's listing, so `EtcdWardenSecondaryBehind` can fire. Before, the lag
    /// stayed where the last pass left it (here never set: 0) for as long as the pass hung: seen
    /// under load as a flaky lag check in tests/secondary.rs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_held_by_a_hanging_secondary_still_raises_the_lag() {
        use crate::snapshot::delta::{Event, EventType, KeyValue, TimedEvent, encode_compressed};
        let primary =
            crate::store::SnapshotStore::new(Arc::new(object_store::memory::InMemory::new()), "p");
        let delta = primary.new_snapshot(Kind::Incr, 11, 11, Codec::Gzip, false);
        let event = TimedEvent {
            event: Event {
                kind: EventType::Put,
                kv: Some(KeyValue {
                    key: b"k".to_vec(),
                    create_revision: 11,
                    mod_revision: 11,
                    version: 1,
                    value: b"v".to_vec(),
                    lease: 0,
                }),
                prev_kv: None,
            },
            time: Utc::now(),
        };
        let bytes = encode_compressed(&[event], Codec::Gzip, primary.compression_level()).unwrap();
        primary.put_bytes(&delta, bytes.into()).await.unwrap();
        // An S3 endpoint that accepts connections and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let mut connections = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                connections.push(c);
            }
        });
        let location = crate::config::StoreLocation::parse("s3://secondary/p").unwrap();
        let dest = crate::store::SnapshotStore::from_config(&crate::config::StoreConfig {
            endpoint: Some(endpoint),
            region: Some("us-east-1".into()),
            allow_http: true,
            access_key_id: Some(crate::config::Secret::Value("key".into())),
            secret_access_key: Some(crate::config::Secret::Value("secret".into())),
            ..crate::config::StoreConfig::at(location.clone())
        })
        .unwrap();
        let metrics = SecondaryMetrics::default();
        let sync = Sync {
            stores: Stores {
                source: primary,
                dest,
                server_side: false,
            },
            config: SecondaryConfig {
                store: crate::config::StoreConfig::at(location),
                max_lag: Duration::from_secs(60),
                sync_interval: Duration::from_secs(1),
            },
            retention: Retention {
                policy: GcPolicy::LimitBased { max_backups: 10 },
                delta_retention: Duration::ZERO,
            },
            metrics: metrics.clone(),
            known: Arc::default(),
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(sync.run(cancel.clone()));
        tokio::time::sleep(Duration::from_millis(3500)).await;
        let seconds = metrics.lag_seconds.get();
        let copied = metrics.copied.get();
        cancel.cancel();
        task.await.unwrap();
        held.abort();
        assert_eq!(copied, 0, "the secondary hung: nothing was copied");
        assert!(
            seconds >= 2.5,
            "the lag grew while the pass hung: {seconds} s, 3.5 s after the delta was stored"
        );
        assert_eq!(metrics.lag_revisions.get(), 11);
    }
}
