//! Restore drills: a backup that has never been restored is a hope.
//!
//! [`drill`] restores the store's newest chain into a scratch directory exactly as `restore`
//! would (no fallback: a drill that quietly used an older snapshot would pass for a good one),
//! starts etcd on the result and checks it against what the chain implies, derived a second,
//! independent way: the full snapshot's database read record by record (every revision of every
//! key, in order) with the deltas' events applied on top, in memory, one digest per key. etcd
//! must report the chain's revision and serve exactly those keys with those values, create and
//! mod revisions and versions. The full snapshot is fetched twice (once for the restore, once
//! for the expectation) so that nothing the restore wrote is trusted by the check.
//!
//! Each drill's outcome is kept in the store at `<prefix>/etcd-warden/drill/latest.json`
//! ([`DrillRecord`]), so every sidecar on the store can show it as metrics
//! (`etcd_warden_restore_drill_…`) and an alert can fire when none has succeeded for a day.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use etcd_client::{GetOptions, SortOrder, SortTarget};
use object_store::ObjectStoreExt as _;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::sync::atomic::AtomicU64;

use super::bolt::Reader;
use super::direct::{self, DecodedKv};
use super::{EtcdTools, RestoreError, RestoreOptions, TempEtcd};
use crate::scratch::ScratchDir;
use crate::snapshot::delta::{self, EventType};
use crate::store::{Snapshot, SnapshotStore, StoreError, layout};

/// Keys read from etcd per request while checking: a page of values at etcd's largest
/// (`--max-request-bytes`, 1.5 MiB by default; kube-apiserver's objects reach it) stays within
/// [`MAX_PAGE_MESSAGE`].
const PAGE: i64 = 100;

/// The largest page accepted (tonic's default of 4 MiB failed the drill on three large values).
const MAX_PAGE_MESSAGE: usize = 256 * 1024 * 1024;

/// What can fail a drill.
#[derive(Debug, thiserror::Error)]
pub enum DrillError {
    /// The restore itself failed: the backups do not restore.
    #[error("the restore failed: {0}")]
    Restore(RestoreError),
    /// Deriving what the chain implies failed (the full snapshot or a delta could not be read).
    #[error("reading what the chain implies: {0}")]
    Expected(RestoreError),
    /// The restored etcd differs from what the chain implies.
    #[error("the restored etcd differs from the chain: {0}")]
    Mismatch(String),
    /// The restored etcd could not be read.
    #[error("reading the restored etcd: {0}")]
    Etcd(etcd_client::Error),
    /// The scratch directory could not be made or removed.
    #[error("{path}: {cause}")]
    Io { path: String, cause: std::io::Error },
}

/// Where and how a drill runs.
#[derive(Debug, Clone)]
pub struct DrillOptions {
    /// Where the drill's scratch directory goes: it works in a new private subdirectory
    /// (0700, an unpredictable name that must not exist yet) and removes it.
    pub work_dir: PathBuf,
    /// Where etcd's binaries are; `None` means `PATH`.
    pub etcd_bin: Option<PathBuf>,
    /// Deltas fetched ahead.
    pub parallel_fetch: usize,
}

/// What a successful drill checked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrillReport {
    /// The full snapshot restored.
    pub full_snapshot: String,
    /// Deltas restored after it.
    pub deltas: usize,
    /// The revision etcd reported, equal to the chain's.
    pub revision: i64,
    /// Keys etcd served, equal to the chain's.
    pub keys: u64,
    /// SHA-256 over every key with its value, create and mod revision and version, in key
    /// order: the same for the chain and for etcd.
    pub hash: String,
    /// Seconds the restore took.
    pub restore_seconds: f64,
    /// Seconds the check took (deriving the expectation, starting etcd, reading every key).
    pub check_seconds: f64,
}

/// The outcome of the drills so far, kept in the store.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrillRecord {
    /// When the last drill ended, whatever its outcome.
    pub last_attempt: Option<DateTime<Utc>>,
    /// When the last successful drill ended.
    pub last_success: Option<DateTime<Utc>>,
    /// Seconds the last drill took.
    pub last_duration_seconds: f64,
    /// Failed drills since the last success.
    pub consecutive_failures: u64,
    /// Failed drills ever recorded.
    pub failures_total: u64,
    /// Why the last drill failed, while it is the last one.
    pub last_error: Option<String>,
    /// What the last successful drill checked.
    pub last_report: Option<DrillReport>,
}

impl DrillRecord {
    /// The record after a drill that ended at `now` taking `took`.
    pub fn after(
        mut self,
        outcome: Result<&DrillReport, &str>,
        now: DateTime<Utc>,
        took: Duration,
    ) -> Self {
        self.last_attempt = Some(now);
        self.last_duration_seconds = took.as_secs_f64();
        match outcome {
            Ok(report) => {
                self.last_success = Some(now);
                self.consecutive_failures = 0;
                self.last_error = None;
                self.last_report = Some(report.clone());
            }
            Err(e) => {
                self.consecutive_failures += 1;
                self.failures_total += 1;
                self.last_error = Some(e.to_owned());
            }
        }
        self
    }
}

/// The object holding the [`DrillRecord`] of `store`.
fn record_path(store: &SnapshotStore) -> object_store::path::Path {
    let prefix = store.prefix().trim_matches('/');
    let name = "etcd-warden/drill/latest.json";
    object_store::path::Path::from(if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}/{name}")
    })
}

/// The store's drill record; the default (no drill yet) when there is none.
pub async fn read_record(store: &SnapshotStore) -> Result<DrillRecord, StoreError> {
    let got = match store.backend().get(&record_path(store)).await {
        Ok(got) => got,
        Err(object_store::Error::NotFound { .. }) => return Ok(DrillRecord::default()),
        Err(e) => return Err(e.into()),
    };
    let bytes = got.bytes().await?;
    serde_json::from_slice(&bytes).map_err(|e| {
        StoreError::from(object_store::Error::Generic {
            store: "drill record",
            source: Box::new(e),
        })
    })
}

/// Writes the store's drill record.
pub async fn write_record(store: &SnapshotStore, record: &DrillRecord) -> Result<(), StoreError> {
    let body = serde_json::to_vec_pretty(record).map_err(|e| {
        StoreError::from(object_store::Error::Generic {
            store: "drill record",
            source: Box::new(e),
        })
    })?;
    store
        .backend()
        .put(&record_path(store), body.into())
        .await?;
    Ok(())
}

/// Restores the newest chain of `store` into a scratch directory, starts etcd on it and checks
/// it against what the chain implies. The scratch directory is removed whatever the outcome.
#[tracing::instrument(name = "restore_drill", skip_all, fields(store = %store.prefix()))]
pub async fn drill(store: &SnapshotStore, opts: &DrillOptions) -> Result<DrillReport, DrillError> {
    // The restored database is plaintext even from an encrypted store: the scratch directory
    // is new, private and unpredictable ([`ScratchDir`]), and removed on every way out.
    let scratch = ScratchDir::new_in(&opts.work_dir, "etcd-warden-drill-").map_err(|cause| {
        DrillError::Io {
            path: opts.work_dir.display().to_string(),
            cause,
        }
    })?;
    tracing::info!(scratch = %scratch.shown().display(), "drill: scratch directory created");
    drill_in(store, opts, scratch.path()).await
}

async fn drill_in(
    store: &SnapshotStore,
    opts: &DrillOptions,
    scratch: &Path,
) -> Result<DrillReport, DrillError> {
    let data_dir = scratch.join("restored.etcd");
    let restore_opts =
        RestoreOptions::scratch(&data_dir, opts.etcd_bin.clone(), opts.parallel_fetch);
    let started = Instant::now();
    let restored = super::restore(store, &restore_opts)
        .await
        .map_err(DrillError::Restore)?;
    let restore_seconds = started.elapsed().as_secs_f64();
    tracing::info!(
        full_snapshot = %restored.full_snapshot,
        revision = restored.revision,
        seconds = restore_seconds,
        "drill: restored; checking it against the chain"
    );

    let checked = Instant::now();
    let chain = chain_of(store, &restored).await?;
    let expected = expected_state(
        store,
        &chain,
        &scratch.join("expected.db"),
        restored.revision,
    )
    .await?;
    if expected.revision != restored.revision {
        return Err(DrillError::Mismatch(format!(
            "the chain ends at revision {}, the restore at {}",
            expected.revision, restored.revision
        )));
    }
    let tools = EtcdTools::locate(opts.etcd_bin.as_deref())
        .await
        .map_err(DrillError::Restore)?;
    let temp = TempEtcd::start(&tools, &data_dir, "default", scratch.join("etcd.log"))
        .await
        .map_err(DrillError::Restore)?;
    let served = read_served(&temp.client_url).await;
    let _ = temp.stop().await;
    let served = served?;
    // Planted (`crate::plant`): what etcd serves compared with itself.
    let (keys, hash) = if crate::plant::active("drill-no-compare") {
        compare(&served, &served)?
    } else {
        compare(&expected, &served)?
    };
    let check_seconds = checked.elapsed().as_secs_f64();
    let report = DrillReport {
        full_snapshot: restored.full_snapshot,
        deltas: restored.deltas,
        revision: restored.revision,
        keys,
        hash,
        restore_seconds,
        check_seconds,
    };
    tracing::info!(
        revision = report.revision,
        keys = report.keys,
        hash = %report.hash,
        check_seconds,
        "drill: the restored etcd serves exactly what the chain holds"
    );
    Ok(report)
}

/// The chain the restore used: its full snapshot, by name, and as many deltas after it as it
/// read. Snapshots written while the drill ran (a new full snapshot, later deltas) do not
/// change it. A full snapshot's database may reach past the revision in its name (etcd's
/// snapshot stream can hold a lease's expiry after the revision it was named by), so the chain
/// is found by name, not by the restored revision. Only when retention deleted that full
/// snapshot in the meantime is it the chain that holds the state at the restored revision: the
/// newest full snapshot at or before it and the deltas up to it imply the same state.
async fn chain_of(
    store: &SnapshotStore,
    restored: &super::RestoreReport,
) -> Result<layout::Chain, DrillError> {
    let list = store
        .list()
        .await
        .map_err(|e| DrillError::Expected(RestoreError::Store(e)))?;
    match list
        .iter()
        .position(|s| s.snap_name == restored.full_snapshot)
    {
        Some(at) => {
            let mut chain = layout::chain_from(&list, Some(at));
            chain.delta_snapshots.truncate(restored.deltas);
            Ok(chain)
        }
        None => layout::chain_to(&list, layout::Target::Revision(restored.revision), &[])
            .map_err(|e| DrillError::Expected(RestoreError::Target(e))),
    }
}

/// What a chain implies: its revision and one digest per live key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub revision: i64,
    pub keys: BTreeMap<Vec<u8>, [u8; 32]>,
}

/// The digest of one key's state as etcd serves it.
fn digest(kv: &DecodedKv) -> [u8; 32] {
    let mut h = Sha256::new();
    for n in [kv.create_revision, kv.mod_revision, kv.version] {
        h.update(n.to_be_bytes());
    }
    h.update((kv.value.len() as u64).to_be_bytes());
    h.update(&kv.value);
    h.finalize().into()
}

/// The full snapshot's database read record by record, then every delta event after it.
async fn expected_state(
    store: &SnapshotStore,
    chain: &layout::Chain,
    db: &Path,
    until: i64,
) -> Result<Expected, DrillError> {
    let full = chain
        .full_snapshot
        .as_ref()
        .ok_or(DrillError::Expected(RestoreError::NoFullSnapshot))?;
    let bytes = super::fetch_full(store, full, db, false)
        .await
        .map_err(DrillError::Expected)?;
    let len = bytes.saturating_sub(delta::HASH_LEN as u64);
    let path = db.to_path_buf();
    let mut expected = tokio::task::spawn_blocking(move || database_state(&path, len))
        .await
        .map_err(|cause| {
            DrillError::Expected(RestoreError::Task {
                what: "reading the full snapshot's database",
                cause,
            })
        })??;
    let _ = std::fs::remove_file(db);
    for d in &chain.delta_snapshots {
        apply_delta(store, d, until, &mut expected).await?;
    }
    Ok(expected)
}

/// Every key's latest state in the database at `path` (`len` bytes of it), and its revision.
fn database_state(path: &Path, len: u64) -> Result<Expected, DrillError> {
    let corrupt = |e: super::bolt::BoltError| {
        DrillError::Expected(RestoreError::Deltas(format!(
            "reading the full snapshot's database: {e}"
        )))
    };
    let reader = Reader::open(path, len).map_err(corrupt)?;
    let buckets = reader.buckets().map_err(corrupt)?;
    let revision = direct::database_revision(&reader, &buckets).map_err(corrupt)?;
    let key_bucket = buckets
        .iter()
        .find(|b| b.name == direct::KEY_BUCKET)
        .ok_or_else(|| {
            corrupt(super::bolt::BoltError::Unsupported(
                "no `key` bucket".into(),
            ))
        })?;
    let mut keys = BTreeMap::new();
    reader
        .visit(&key_bucket.root, &mut |_, rev, value| {
            let kv = direct::decode_kv(value)?;
            // A tombstone's revision key ends in `t`; an empty key is a revision bump's mark.
            if rev.last() == Some(&b't') && rev.len() == 18 {
                keys.remove(&kv.key);
            } else if !kv.key.is_empty() {
                keys.insert(kv.key.clone(), digest(&kv));
            }
            Ok(())
        })
        .map_err(corrupt)?;
    Ok(Expected { revision, keys })
}

/// Applies delta `d`'s events after `expected.revision`, up to revision `until`.
async fn apply_delta(
    store: &SnapshotStore,
    d: &Snapshot,
    until: i64,
    expected: &mut Expected,
) -> Result<(), DrillError> {
    let events = delta::read(store, d).await.map_err(|cause| {
        DrillError::Expected(RestoreError::Delta {
            name: d.snap_name.clone(),
            cause,
        })
    })?;
    let floor = expected.revision;
    for event in events.views() {
        let Some(kv) = event.kv else {
            continue;
        };
        if kv.mod_revision <= floor || kv.mod_revision > until {
            continue;
        }
        match event.kind {
            EventType::Put => {
                let state = DecodedKv {
                    key: kv.key.to_vec(),
                    create_revision: kv.create_revision,
                    mod_revision: kv.mod_revision,
                    version: kv.version,
                    value: kv.value.to_vec(),
                };
                expected.keys.insert(kv.key.to_vec(), digest(&state));
            }
            EventType::Delete => {
                expected.keys.remove(kv.key);
            }
        }
        expected.revision = expected.revision.max(kv.mod_revision);
    }
    Ok(())
}

/// What the etcd at `url` serves: its revision and every key's digest, read a page at a time at
/// one revision.
async fn read_served(url: &str) -> Result<Expected, DrillError> {
    let client = etcd_client::Client::connect([url], None)
        .await
        .map_err(DrillError::Etcd)?;
    let mut kv = client
        .kv_client()
        .max_decoding_message_size(MAX_PAGE_MESSAGE);
    let mut served = Expected::default();
    let mut from = vec![0u8];
    loop {
        let mut options = GetOptions::new()
            .with_from_key()
            .with_limit(PAGE)
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        if served.revision > 0 {
            options = options.with_revision(served.revision);
        }
        let resp = kv
            .get(from.clone(), Some(options))
            .await
            .map_err(DrillError::Etcd)?;
        if served.revision == 0 {
            served.revision = resp.header().map_or(0, |h| h.revision());
        }
        for kv in resp.kvs() {
            let state = DecodedKv {
                key: kv.key().to_vec(),
                create_revision: kv.create_revision(),
                mod_revision: kv.mod_revision(),
                version: kv.version(),
                value: kv.value().to_vec(),
            };
            served.keys.insert(state.key.clone(), digest(&state));
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    Ok(served)
}

/// Compares what etcd serves with what the chain implies; on success the key count and the
/// hash over every key in order.
pub fn compare(expected: &Expected, served: &Expected) -> Result<(u64, String), DrillError> {
    if served.revision != expected.revision {
        return Err(DrillError::Mismatch(format!(
            "etcd reports revision {}, the chain ends at {}",
            served.revision, expected.revision
        )));
    }
    let mut hash = Sha256::new();
    let mut theirs = served.keys.iter();
    for (key, want) in &expected.keys {
        let shown = String::from_utf8_lossy(key);
        match theirs.next() {
            Some((k, got)) if k == key && got == want => {}
            Some((k, _)) if k == key => {
                return Err(DrillError::Mismatch(format!(
                    "key {shown:?} has another value, revision or version than the chain's"
                )));
            }
            Some((k, _)) if k < key => {
                return Err(DrillError::Mismatch(format!(
                    "etcd serves key {:?}, which the chain does not hold",
                    String::from_utf8_lossy(k)
                )));
            }
            _ => {
                return Err(DrillError::Mismatch(format!(
                    "key {shown:?} of the chain is missing in etcd"
                )));
            }
        }
        hash.update((key.len() as u64).to_be_bytes());
        hash.update(key);
        hash.update(want);
    }
    if let Some((k, _)) = theirs.next() {
        return Err(DrillError::Mismatch(format!(
            "etcd serves key {:?}, which the chain does not hold",
            String::from_utf8_lossy(k)
        )));
    }
    let hex: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((expected.keys.len() as u64, hex))
}

/// The drill record as metrics: read from the store when `/metrics` is scraped, at most once a
/// minute whatever the outcome. A scrape waits a second for the read at the most; a slower read
/// goes on (bounded) and its values show at the next scrape, so a store that hangs or refuses
/// never slows a scrape past Prometheus's timeout, and a sidecar needs no task of its own for it
/// (nothing to die silently). A record that cannot be read leaves the last values and is logged.
#[derive(Clone)]
pub struct DrillMetrics {
    read_at: std::sync::Arc<tokio::sync::Mutex<Option<Instant>>>,
    last_success: Gauge<f64, AtomicU64>,
    last_attempt: Gauge<f64, AtomicU64>,
    duration: Gauge<f64, AtomicU64>,
    consecutive_failures: Gauge,
    failures: Counter,
    /// The record's failure count last seen (the counter grows by the difference).
    failures_seen: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Default for DrillMetrics {
    fn default() -> Self {
        DrillMetrics {
            read_at: Default::default(),
            last_success: Gauge::default(),
            last_attempt: Gauge::default(),
            duration: Gauge::default(),
            consecutive_failures: Gauge::default(),
            failures: Counter::default(),
            failures_seen: std::sync::Arc::new(std::sync::atomic::AtomicU64::new(NOT_SEEN)),
        }
    }
}

impl std::fmt::Debug for DrillMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrillMetrics").finish_non_exhaustive()
    }
}

/// `failures_seen` before the first read.
const NOT_SEEN: u64 = u64::MAX;
/// How often the record is read at the most (counted from the last attempt).
const RECORD_TTL: Duration = Duration::from_secs(60);
/// How long one read of the record may take.
const RECORD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a scrape waits for a read it started.
const SCRAPE_WAIT: Duration = Duration::from_secs(1);

impl DrillMetrics {
    /// Registers `etcd_warden_restore_drill_…`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("etcd_warden_restore_drill");
        for (name, help, gauge) in [
            (
                "last_success_timestamp_seconds",
                "When the last successful restore drill ended (unix seconds; 0: none recorded)",
                &self.last_success,
            ),
            (
                "last_attempt_timestamp_seconds",
                "When the last restore drill ended, whatever its outcome (unix seconds; 0: none)",
                &self.last_attempt,
            ),
            (
                "duration_seconds",
                "How long the last restore drill took",
                &self.duration,
            ),
        ] {
            r.register(name, help, gauge.clone());
        }
        r.register(
            "consecutive_failures",
            "Restore drills failed since the last success",
            self.consecutive_failures.clone(),
        );
        r.register(
            "failures",
            "Failed restore drills recorded in the store while this sidecar ran",
            self.failures.clone(),
        );
    }

    /// Reads the record of `store` again if the last attempt is older than a minute, waiting
    /// [`SCRAPE_WAIT`] for it at the most.
    pub async fn refresh(&self, store: &SnapshotStore) {
        let Ok(mut attempted) = self.read_at.clone().try_lock_owned() else {
            return; // another scrape's read is under way
        };
        if attempted.is_some_and(|t| t.elapsed() < RECORD_TTL) {
            return;
        }
        *attempted = Some(Instant::now());
        let (this, store) = (self.clone(), store.clone());
        let read = tokio::spawn(async move {
            let _attempted = attempted; // held until the read ends: one read at a time
            match tokio::time::timeout(RECORD_TIMEOUT, read_record(&store)).await {
                Ok(Ok(record)) => this.show(&record),
                Ok(Err(e)) => tracing::warn!(error = %e, "reading the restore drill record failed"),
                Err(_) => tracing::warn!(
                    after = ?RECORD_TIMEOUT,
                    "reading the restore drill record timed out"
                ),
            }
        });
        // Not done within the wait: the read goes on and the next scrape shows it.
        let _ = tokio::time::timeout(SCRAPE_WAIT, read).await;
    }

    /// Sets the metrics from `record`.
    pub fn show(&self, record: &DrillRecord) {
        let secs = |t: Option<DateTime<Utc>>| t.map_or(0.0, |t| t.timestamp_millis() as f64 / 1e3);
        self.last_success.set(secs(record.last_success));
        self.last_attempt.set(secs(record.last_attempt));
        self.duration.set(record.last_duration_seconds);
        self.consecutive_failures
            .set(i64::try_from(record.consecutive_failures).unwrap_or(i64::MAX));
        let seen = self
            .failures_seen
            .swap(record.failures_total, std::sync::atomic::Ordering::Relaxed);
        // The first read sets the baseline (a restarted sidecar must not count old failures
        // again); a record started anew (removed, unreadable) counts from there on.
        if seen != NOT_SEEN && record.failures_total > seen {
            self.failures.inc_by(record.failures_total - seen);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that accepts connections and never answers: a scrape waits a second for the
    /// record, not the read's bound, and the next scrape within the minute does not ask again.
    #[tokio::test]
    async fn a_hanging_store_never_holds_a_scrape() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        let hold = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                open.push(conn); // never answered
            }
        });
        let config = crate::config::StoreConfig {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            region: Some("us-east-1".into()),
            allow_http: true,
            access_key_id: Some(crate::config::Secret::Value("k".into())),
            secret_access_key: Some(crate::config::Secret::Value("s".into())),
            ..crate::config::StoreConfig::at(
                crate::config::StoreLocation::parse("s3://b/p").unwrap(),
            )
        };
        let store = SnapshotStore::new(crate::store::build(&config).unwrap(), "p");
        let metrics = DrillMetrics::default();
        for _ in 0..3 {
            let started = Instant::now();
            metrics.refresh(&store).await;
            assert!(
                started.elapsed() < SCRAPE_WAIT + Duration::from_millis(500),
                "a scrape waited {:?}",
                started.elapsed()
            );
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        hold.abort();
    }

    fn state(revision: i64, keys: &[(&str, &str, i64)]) -> Expected {
        Expected {
            revision,
            keys: keys
                .iter()
                .map(|(k, v, rev)| {
                    let kv = DecodedKv {
                        key: k.as_bytes().to_vec(),
                        create_revision: 2,
                        mod_revision: *rev,
                        version: 1,
                        value: v.as_bytes().to_vec(),
                    };
                    (kv.key.clone(), digest(&kv))
                })
                .collect(),
        }
    }

    #[test]
    fn the_comparison_names_the_first_difference() {
        let chain = state(9, &[("a", "1", 3), ("b", "2", 4), ("c", "3", 9)]);
        let (keys, hash) = compare(&chain, &chain.clone()).unwrap();
        assert_eq!((keys, hash.len()), (3, 64));
        for (served, want) in [
            (
                state(8, &[("a", "1", 3), ("b", "2", 4), ("c", "3", 9)]),
                "revision 8",
            ),
            (
                state(9, &[("a", "1", 3), ("b", "X", 4), ("c", "3", 9)]),
                "key \"b\" has another value",
            ),
            (
                state(9, &[("a", "1", 3), ("b", "2", 5), ("c", "3", 9)]),
                "key \"b\" has another value",
            ),
            (
                state(9, &[("a", "1", 3), ("c", "3", 9)]),
                "key \"b\" of the chain is missing",
            ),
            (
                state(
                    9,
                    &[("a", "1", 3), ("aa", "0", 5), ("b", "2", 4), ("c", "3", 9)],
                ),
                "serves key \"aa\"",
            ),
            (
                state(
                    9,
                    &[("a", "1", 3), ("b", "2", 4), ("c", "3", 9), ("d", "4", 9)],
                ),
                "serves key \"d\"",
            ),
        ] {
            let e = compare(&chain, &served).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn the_record_counts_failures_until_a_success() {
        let t = |s| DateTime::from_timestamp(s, 0).unwrap();
        let report = DrillReport {
            full_snapshot: "Full-00000000-00000010-1".into(),
            deltas: 2,
            revision: 30,
            keys: 5,
            hash: "ab".into(),
            restore_seconds: 1.0,
            check_seconds: 1.0,
        };
        let r = DrillRecord::default()
            .after(Err("no full snapshot"), t(10), Duration::from_secs(1))
            .after(Err("a delta is lost"), t(20), Duration::from_secs(2));
        assert_eq!(
            (r.consecutive_failures, r.failures_total, r.last_success),
            (2, 2, None)
        );
        assert_eq!(r.last_error.as_deref(), Some("a delta is lost"));
        let r = r.after(Ok(&report), t(30), Duration::from_secs(3));
        assert_eq!(
            (
                r.consecutive_failures,
                r.failures_total,
                r.last_success,
                r.last_error.as_deref()
            ),
            (0, 2, Some(t(30)), None)
        );
        assert_eq!(r.last_duration_seconds, 3.0);
        assert_eq!(r.last_report, Some(report));
    }
}
