//! `serve` with `restore.initialize`: before etcd is used, validate its data directory
//! ([`datadir`]) and restore it from the store when it is missing, corrupt or behind the store
//! (moving the old one aside), or leave it for etcd to start fresh when the store is empty. A guard file next to the data directory keeps one cluster's backups out of another
//! cluster's volume.

use std::path::{Path, PathBuf};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::datadir::{self, DataDir, DbLock};
use super::{RestoreError, RestoreOptions, StepExt, restore};
use crate::config::RestoreConfig;
use crate::snapshot::metrics::doubling_seconds;
use crate::store::SnapshotStore;

/// Name of the guard file, in the data directory's parent.
pub const GUARD_FILE: &str = ".etcd-warden-guard";

/// What initialization found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Initialized {
    /// The data directory was valid and at or ahead of the store: left alone.
    Valid,
    /// The store holds no snapshot: etcd starts with an empty data directory.
    Fresh,
    /// Restored from the store, for this reason; a previous directory was moved aside.
    Restored {
        why: Why,
        /// The revision restored.
        revision: i64,
        /// Full snapshots skipped because they failed verification.
        skipped: Vec<String>,
        moved_aside: Option<PathBuf>,
    },
}

/// What the store offers a data directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreState {
    /// No snapshot at all.
    Empty,
    /// Deltas but no full snapshot: nothing restorable.
    DeltasOnly,
    /// A full snapshot; its chain (full and later deltas) reaches this revision.
    Latest { revision: i64 },
}

/// Why a data directory is restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// There is none.
    Missing,
    /// It failed validation.
    Corrupt,
    /// Its database is behind the store's latest chain.
    Behind { dir: i64, store: i64 },
}

/// What to do, from what is on disk and in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Keep,
    StartFresh,
    Restore(Why),
    /// Deltas without a full snapshot cannot be restored, and starting empty would lose them.
    RefuseDeltasOnly,
    /// A corrupt directory and nothing to restore: starting etcd on it, or empty, is not ours
    /// to decide.
    RefuseCorrupt,
}

/// Decides what initialization does (pure). A directory at or ahead of the store is kept: it
/// is newer than any backup. A directory behind it is restored (moved aside, never deleted),
/// unless the entries its WAL holds past its database could bring it level: etcd applies them
/// on start (a crash before the database's periodic commit), each adds at most one revision,
/// and they may hold writes newer than the store's that a restore would drop. One member of several (`multi_member`) behind the store is kept:
/// it catches up from the leader, whereas a restore would make it a new cluster of its own.
pub fn decide(dir: &DataDir, store: StoreState, multi_member: bool) -> Decision {
    match (dir, store) {
        // Behind even if every WAL entry past the database wrote a revision.
        (
            DataDir::Valid {
                revision,
                wal_ahead,
            },
            StoreState::Latest { revision: latest },
        ) if revision.saturating_add(i64::try_from(*wal_ahead).unwrap_or(i64::MAX)) < latest
            && !multi_member =>
        {
            Decision::Restore(Why::Behind {
                dir: *revision,
                store: latest,
            })
        }
        (DataDir::Valid { .. }, _) => Decision::Keep,
        (DataDir::Missing, StoreState::Latest { .. }) => Decision::Restore(Why::Missing),
        (DataDir::Missing, StoreState::Empty) => Decision::StartFresh,
        (DataDir::Missing, StoreState::DeltasOnly) => Decision::RefuseDeltasOnly,
        (DataDir::Corrupt(_), StoreState::Latest { .. }) => Decision::Restore(Why::Corrupt),
        (DataDir::Corrupt(_), StoreState::Empty | StoreState::DeltasOnly) => {
            Decision::RefuseCorrupt
        }
    }
}

/// What the store's listing offers.
pub fn store_state(list: &[crate::store::Snapshot]) -> StoreState {
    let chain = crate::store::layout::latest_chain(list);
    match &chain.full_snapshot {
        Some(full) => StoreState::Latest {
            revision: chain
                .delta_snapshots
                .iter()
                .map(|d| d.last_revision)
                .fold(full.last_revision, i64::max),
        },
        None if list.is_empty() => StoreState::Empty,
        None => StoreState::DeltasOnly,
    }
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
            validation: Family::new_with_constructor(doubling_seconds::<10, 21>),
            restoration: Family::new_with_constructor(doubling_seconds::<10, 21>),
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

/// The store `restore.initialize` reads: the primary, unless it cannot be listed or holds no
/// snapshot while the secondary (`[store.secondary]`) holds some. The secondary only ever holds
/// copies of the primary's snapshots, so a primary that lost them or cannot be reached is
/// better served by those copies than by starting empty or failing. The choice is logged.
pub async fn pick_store(
    primary: &SnapshotStore,
    secondary: Option<&SnapshotStore>,
) -> (SnapshotStore, &'static str) {
    let Some(secondary) = secondary else {
        return (primary.clone(), "primary");
    };
    let why = match primary.list().await {
        Ok(list) if !list.is_empty() => return (primary.clone(), "primary"),
        Ok(_) => "holds no snapshot".to_string(),
        Err(e) => format!("cannot be listed ({e})"),
    };
    match secondary.list().await {
        Ok(list) if !list.is_empty() => {
            tracing::warn!(primary = %primary.prefix(), secondary = %secondary.prefix(), %why, "the primary store {why}; initializing from the SECONDARY store");
            (secondary.clone(), "secondary")
        }
        _ => (primary.clone(), "primary"),
    }
}

/// The secondary store (`[store.secondary]`) as `restore.initialize` reads it: its own
/// provider variables (`SECONDARY_…`) and the same keys to decrypt as the primary.
pub fn secondary_store(
    config: &crate::config::Config,
) -> Result<Option<SnapshotStore>, crate::store::StoreError> {
    let Some(secondary) = &config.secondary else {
        return Ok(None);
    };
    let backend = crate::store::build_with_env(
        &secondary.store,
        &crate::config::ProcessEnv,
        Some("SECONDARY_"),
    )?;
    let pager = crate::store::pager_with_env(
        &secondary.store,
        &crate::config::ProcessEnv,
        Some("SECONDARY_"),
    )?;
    Ok(Some(
        SnapshotStore::at(backend, &secondary.store.location)
            .with_pager(pager)
            .with_encryption(config.encryption.clone())
            .with_read_limits(config.restore.read_limits),
    ))
}

/// [`initialize_observed`] from the store [`pick_store`] chooses: how `serve`, `initialize` and
/// etcd-wrapper's initialization (`[druid]`) restore a member's data directory.
pub async fn initialize_from(
    primary: &SnapshotStore,
    secondary: Option<&SnapshotStore>,
    config: &RestoreConfig,
    metrics: &InitializeMetrics,
) -> Result<Initialized, RestoreError> {
    let (from, which) = pick_store(primary, secondary).await;
    tracing::info!(store = which, "the initialization reads this store");
    initialize_observed(&from, config, metrics).await
}

/// Restores `config.data_dir` from `store` if it is missing, invalid or behind the store.
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
    // etcd already runs on the directory (this sidecar restarted alone): nothing to decide, and
    // nothing may be moved under it. Otherwise the lock is held until the end, so etcd cannot
    // open the database while it is checked and perhaps replaced.
    let _lock = match datadir::lock_db(data_dir) {
        Ok(DbLock::Busy) => {
            tracing::info!(data_dir = %data_dir.display(), "etcd holds the database open; the data directory is left alone");
            metrics.validated(true, started);
            return Ok(Initialized::Valid);
        }
        Ok(lock) => lock,
        Err(cause) => {
            return Err(RestoreError::Io {
                path: data_dir.display().to_string(),
                cause: std::io::Error::other(cause),
            });
        }
    };
    let decision = validate(store, config, data_dir).await;
    // Succeeded: validation came to something etcd can start from.
    metrics.validated(
        matches!(
            &decision,
            Ok((d, _)) if !matches!(d, Decision::RefuseDeltasOnly | Decision::RefuseCorrupt)
        ),
        started,
    );
    let (decision, found) = decision?;
    let dir = data_dir.display();
    let why = match decision {
        Decision::Keep => {
            if let DataDir::Valid {
                revision,
                wal_ahead,
            } = found
                && wal_ahead > 0
            {
                tracing::info!(data_dir = %dir, db_revision = revision, wal_entries_ahead = wal_ahead, "the WAL holds entries past the database; etcd applies them on start");
            }
            tracing::info!(data_dir = %dir, validation = ?config.validation, ?found, "data directory valid; kept");
            return Ok(Initialized::Valid);
        }
        Decision::StartFresh => {
            tracing::info!(data_dir = %dir, "store empty; etcd starts fresh");
            return Ok(Initialized::Fresh);
        }
        Decision::RefuseDeltasOnly => return Err(RestoreError::DeltasWithoutFull),
        Decision::RefuseCorrupt => {
            let reason = match found {
                DataDir::Corrupt(reason) => reason,
                other => format!("{other:?}"),
            };
            return Err(RestoreError::CorruptWithoutBackup { reason });
        }
        Decision::Restore(why) => why,
    };
    let mut opts = RestoreOptions::from_config(config, data_dir);
    // The old directory is moved aside, never deleted.
    opts.force = true;
    match why {
        Why::Missing => {
            tracing::warn!(data_dir = %dir, "no data directory; restoring from the store");
        }
        Why::Corrupt => {
            let reason = match &found {
                DataDir::Corrupt(reason) => reason.as_str(),
                _ => "",
            };
            tracing::error!(data_dir = %dir, validation = ?config.validation, %reason, "data directory fails validation; restoring from the store, the old one is moved aside");
        }
        Why::Behind {
            dir: at,
            store: latest,
        } => {
            tracing::warn!(data_dir = %dir, dir_revision = at, store_revision = latest, "data directory is behind the store; restoring from the store, the old one is moved aside");
            // A fallback that reaches no further than the directory must not replace it.
            opts.must_exceed = Some(at);
        }
    }
    let started = Instant::now();
    let report = restore(store, &opts).await;
    metrics.restored(report.is_ok(), started);
    match report {
        Ok(report) => Ok(Initialized::Restored {
            why,
            revision: report.revision,
            skipped: report.skipped.into_iter().map(|s| s.snapshot).collect(),
            moved_aside: report.moved_aside,
        }),
        Err(RestoreError::NotNewer { reached, current }) => {
            tracing::error!(data_dir = %dir, dir_revision = current, reached, "the store's latest chain could not be restored beyond the data directory's revision; keeping the data directory");
            Ok(Initialized::Valid)
        }
        Err(e) => Err(e),
    }
}

/// The guard, the data directory and the store: what to do, and what the directory held.
async fn validate(
    store: &SnapshotStore,
    config: &RestoreConfig,
    data_dir: &Path,
) -> Result<(Decision, DataDir), RestoreError> {
    if let Some(guard) = &config.guard {
        check_guard(data_dir, guard)?;
    }
    let (dir, mode) = (data_dir.to_path_buf(), config.validation);
    let found = tokio::task::spawn_blocking(move || datadir::check(&dir, mode))
        .await
        .map_err(|cause| RestoreError::Task {
            what: "validating the data directory",
            cause,
        })?;
    // Even a valid directory needs the store's revision: an unreachable store fails
    // initialization (and the sidecar, which is restarted) rather than guess.
    let list = store
        .list()
        .await
        .map_err(RestoreError::Store)
        .step("listing the store")?;
    let multi_member = RestoreOptions::from_config(config, data_dir)
        .member
        .is_multi_member();
    Ok((decide(&found, store_state(&list), multi_member), found))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_secondary_is_read_only_when_the_primary_holds_nothing() {
        use crate::config::{StoreConfig, StoreLocation};
        let dirs = [(); 2].map(|_| tempfile::tempdir().unwrap());
        let at = |d: &tempfile::TempDir| {
            let url = format!("file://{}", d.path().display());
            SnapshotStore::from_config(&StoreConfig::at(StoreLocation::parse(&url).unwrap()))
                .unwrap()
        };
        let (primary, secondary) = (at(&dirs[0]), at(&dirs[1]));
        let full = |store: &SnapshotStore| {
            crate::store::Snapshot::new(
                store.prefix(),
                crate::store::Kind::Full,
                0,
                1,
                chrono::Utc::now(),
                crate::store::Codec::None,
                false,
            )
        };
        // Both empty: the primary (etcd starts fresh from it).
        assert_eq!(pick_store(&primary, Some(&secondary)).await.1, "primary");
        secondary
            .put_bytes(&full(&secondary), bytes::Bytes::from_static(b"x"))
            .await
            .unwrap();
        assert_eq!(pick_store(&primary, Some(&secondary)).await.1, "secondary");
        assert_eq!(pick_store(&primary, None).await.1, "primary");
        primary
            .put_bytes(&full(&primary), bytes::Bytes::from_static(b"x"))
            .await
            .unwrap();
        assert_eq!(pick_store(&primary, Some(&secondary)).await.1, "primary");
    }

    /// Every kind of directory against every kind of store.
    #[test]
    fn decisions() {
        use Decision::*;
        let corrupt = DataDir::Corrupt("truncated".into());
        let at = |revision| DataDir::Valid {
            revision,
            wal_ahead: 0,
        };
        let ahead = |revision, wal_ahead| DataDir::Valid {
            revision,
            wal_ahead,
        };
        let latest = |revision| StoreState::Latest { revision };
        let behind = |dir, store| Restore(Why::Behind { dir, store });
        let cases = [
            (DataDir::Missing, StoreState::Empty, StartFresh),
            (DataDir::Missing, StoreState::DeltasOnly, RefuseDeltasOnly),
            (DataDir::Missing, latest(10), Restore(Why::Missing)),
            (corrupt.clone(), StoreState::Empty, RefuseCorrupt),
            (corrupt.clone(), StoreState::DeltasOnly, RefuseCorrupt),
            (corrupt.clone(), latest(10), Restore(Why::Corrupt)),
            (at(10), StoreState::Empty, Keep),
            (at(10), StoreState::DeltasOnly, Keep),
            (at(9), latest(10), behind(9, 10)),
            (at(1), latest(10), behind(1, 10)),
            (at(10), latest(10), Keep),
            (at(11), latest(10), Keep),
            // WAL entries past the database may bring it level: kept; too few cannot.
            (ahead(9, 1), latest(10), Keep),
            (ahead(7, 5), latest(10), Keep),
            (ahead(1, 3), latest(10), behind(1, 10)),
            (ahead(8, 1), latest(10), behind(8, 10)),
            (ahead(10, 2), StoreState::Empty, Keep),
        ];
        for (dir, store, want) in cases {
            assert_eq!(decide(&dir, store, false), want, "{dir:?} with {store:?}");
            // One member of several: the same, except that behind is kept (raft catches it up).
            let multi = match want {
                Restore(Why::Behind { .. }) => Keep,
                other => other,
            };
            assert_eq!(
                decide(&dir, store, true),
                multi,
                "{dir:?} with {store:?}, multi"
            );
        }
    }

    #[test]
    fn the_store_offers_its_latest_chain_end() {
        use crate::store::{Codec, Kind, Snapshot};
        let at = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let snap = |kind, start, last| Snapshot::new("", kind, start, last, at, Codec::None, false);
        assert_eq!(store_state(&[]), StoreState::Empty);
        assert_eq!(
            store_state(&[snap(Kind::Incr, 1, 5)]),
            StoreState::DeltasOnly
        );
        assert_eq!(
            store_state(&[snap(Kind::Full, 0, 5)]),
            StoreState::Latest { revision: 5 }
        );
        assert_eq!(
            store_state(&[snap(Kind::Full, 0, 5), snap(Kind::Incr, 6, 9)]),
            StoreState::Latest { revision: 9 }
        );
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
}
