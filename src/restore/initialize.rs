//! `serve` with `restore.initialize`: before etcd is used, restore its data directory from the
//! store when it is missing or invalid, or leave it for etcd to start fresh when the store is
//! empty. A guard file next to the data directory keeps one cluster's backups out of another
//! cluster's volume.

use std::path::{Path, PathBuf};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::{RestoreError, RestoreOptions, StepExt, restore};
use crate::config::RestoreConfig;
use crate::store::SnapshotStore;

/// Name of the guard file, in the data directory's parent.
pub const GUARD_FILE: &str = ".etcd-warden-guard";

/// What initialization found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Initialized {
    /// The data directory was valid and left alone.
    Valid,
    /// The store holds no snapshot: etcd starts with an empty data directory.
    Fresh,
    /// Restored from the store; a previous invalid directory was moved aside.
    Restored { moved_aside: Option<PathBuf> },
}

/// What to do, from what is on disk and in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Keep,
    StartFresh,
    Restore,
    /// Deltas without a full snapshot cannot be restored, and starting empty would lose them.
    Refuse,
}

/// Decides what initialization does (pure).
pub fn decide(data_dir_valid: bool, store_has_full: bool, store_has_any: bool) -> Decision {
    match (data_dir_valid, store_has_full, store_has_any) {
        (true, _, _) => Decision::Keep,
        (false, true, _) => Decision::Restore,
        (false, false, false) => Decision::StartFresh,
        (false, false, true) => Decision::Refuse,
    }
}

/// Whether `dir` looks like an etcd data directory (`member/snap` and `member/wal`).
pub fn is_valid_data_dir(dir: &Path) -> bool {
    dir.join("member/snap").is_dir() && dir.join("member/wal").is_dir()
}

/// Checks (and on first use writes) the guard file next to `data_dir`.
pub fn check_guard(data_dir: &Path, guard: &str) -> Result<(), RestoreError> {
    let parent = data_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file = parent.join(GUARD_FILE);
    match std::fs::read_to_string(&file) {
        Ok(found) if found.trim() == guard => Ok(()),
        Ok(found) => Err(RestoreError::Guard {
            file,
            found: found.trim().to_owned(),
            expected: guard.to_owned(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(parent).map_err(|e| RestoreError::io(parent, e))?;
            std::fs::write(&file, format!("{guard}\n")).map_err(|e| RestoreError::io(&file, e))
        }
        Err(e) => Err(RestoreError::io(&file, e)),
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SucceededLabel {
    succeeded: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RestorationLabels {
    restore: &'static str,
    succeeded: &'static str,
}

/// How long initialization took to validate and to restore, under the reference's names
/// (`etcdbr_validation_duration_seconds{succeeded}`,
/// `etcdbr_restoration_duration_seconds{restore,succeeded}`). Made before the registry exists
/// (initialization runs before anything else) and registered with the sidecar's others.
#[derive(Clone, Debug)]
pub struct InitializeMetrics {
    validation: Family<SucceededLabel, Histogram>,
    restoration: Family<RestorationLabels, Histogram>,
}

/// The reference's `restore` label for a member rebuilt from snapshots.
const SINGLE_NODE: &str = "single_node";

/// The reference's `restore` label for a member that re-joined a running cluster as a learner
/// ([`super::rejoin`]).
const SINGLE_MEMBER: &str = "single_member";

impl Default for InitializeMetrics {
    fn default() -> Self {
        InitializeMetrics {
            // 10 ms … ~5.5 h: validation is quick; restoring a large database with many deltas
            // takes minutes.
            validation: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.01, 2.0, 21))
            }),
            restoration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.01, 2.0, 21))
            }),
        }
    }
}

impl InitializeMetrics {
    /// Registers both histograms, every series at zero.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "etcdbr_validation_duration_seconds",
            "Total latency distribution of validating data directory",
            self.validation.clone(),
        );
        registry.register(
            "etcdbr_restoration_duration_seconds",
            "Total latency distribution required to restore the etcd member",
            self.restoration.clone(),
        );
        for ok in ["true", "false"] {
            drop(
                self.validation
                    .get_or_create(&SucceededLabel { succeeded: ok }),
            );
            for restore in [SINGLE_NODE, SINGLE_MEMBER] {
                drop(self.restoration.get_or_create(&RestorationLabels {
                    restore,
                    succeeded: ok,
                }));
            }
        }
    }

    fn validated(&self, ok: bool, started: Instant) {
        self.validation
            .get_or_create(&SucceededLabel {
                succeeded: if ok { "true" } else { "false" },
            })
            .observe(started.elapsed().as_secs_f64());
    }

    fn restored(&self, ok: bool, started: Instant) {
        self.restoration_as(SINGLE_NODE, ok, started);
    }

    /// A rejoin as a learner ([`super::rejoin`]) took from `started` until now.
    pub fn rejoined(&self, ok: bool, started: Instant) {
        self.restoration_as(SINGLE_MEMBER, ok, started);
    }

    fn restoration_as(&self, restore: &'static str, ok: bool, started: Instant) {
        self.restoration
            .get_or_create(&RestorationLabels {
                restore,
                succeeded: if ok { "true" } else { "false" },
            })
            .observe(started.elapsed().as_secs_f64());
    }
}

/// Restores `config.data_dir` from `store` if it is missing or invalid.
pub async fn initialize(
    store: &SnapshotStore,
    config: &RestoreConfig,
) -> Result<Initialized, RestoreError> {
    initialize_observed(store, config, &InitializeMetrics::default()).await
}

/// [`initialize`], observing how long validation (the guard, the data directory, the store's
/// listing) and a restore took in `metrics`.
pub async fn initialize_observed(
    store: &SnapshotStore,
    config: &RestoreConfig,
    metrics: &InitializeMetrics,
) -> Result<Initialized, RestoreError> {
    let data_dir = config.data_dir.as_deref().ok_or(RestoreError::NoDataDir)?;
    let started = Instant::now();
    let decision = validate(store, config, data_dir).await;
    // Deltas without a full snapshot: validation found nothing etcd could start from.
    metrics.validated(
        matches!(&decision, Ok(d) if *d != Decision::Refuse),
        started,
    );
    match decision? {
        Decision::Keep => {
            tracing::info!(data_dir = %data_dir.display(), "data directory valid; no restore");
            Ok(Initialized::Valid)
        }
        Decision::StartFresh => {
            tracing::info!(data_dir = %data_dir.display(), "store empty; etcd starts fresh");
            Ok(Initialized::Fresh)
        }
        Decision::Refuse => Err(RestoreError::DeltasWithoutFull),
        Decision::Restore => {
            tracing::warn!(data_dir = %data_dir.display(), "data directory missing or invalid; restoring from the store");
            let mut opts = RestoreOptions::from_config(config, data_dir);
            // An invalid directory is moved aside, never deleted.
            opts.force = true;
            let started = Instant::now();
            let report = restore(store, &opts).await;
            metrics.restored(report.is_ok(), started);
            Ok(Initialized::Restored {
                moved_aside: report?.moved_aside,
            })
        }
    }
}

/// The guard, the data directory and (when that is invalid) the store: what to do.
async fn validate(
    store: &SnapshotStore,
    config: &RestoreConfig,
    data_dir: &Path,
) -> Result<Decision, RestoreError> {
    if let Some(guard) = &config.guard {
        check_guard(data_dir, guard)?;
    }
    let valid = is_valid_data_dir(data_dir);
    let (has_full, has_any) = if valid {
        (false, false)
    } else {
        let list = store
            .list()
            .await
            .map_err(RestoreError::Store)
            .step("listing the store")?;
        (list.iter().any(|s| s.is_full()), !list.is_empty())
    };
    Ok(decide(valid, has_full, has_any))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions() {
        assert_eq!(decide(true, true, true), Decision::Keep);
        assert_eq!(decide(true, false, false), Decision::Keep);
        assert_eq!(decide(false, true, true), Decision::Restore);
        assert_eq!(decide(false, false, false), Decision::StartFresh);
        assert_eq!(decide(false, false, true), Decision::Refuse);
    }

    #[test]
    fn the_guard_is_written_once_and_then_enforced() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("vol/data");
        check_guard(&data, "ns-a").unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("vol").join(GUARD_FILE)).unwrap(),
            "ns-a\n"
        );
        check_guard(&data, "ns-a").unwrap();
        let e = check_guard(&data, "ns-b").unwrap_err().to_string();
        assert!(e.contains("ns-a") && e.contains("ns-b"), "{e}");
    }

    #[test]
    fn validity_needs_snap_and_wal() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_valid_data_dir(dir.path()));
        std::fs::create_dir_all(dir.path().join("member/snap")).unwrap();
        assert!(!is_valid_data_dir(dir.path()));
        std::fs::create_dir_all(dir.path().join("member/wal")).unwrap();
        assert!(is_valid_data_dir(dir.path()));
    }
}
