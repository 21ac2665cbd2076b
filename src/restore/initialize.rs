//! `serve` with `restore.initialize`: before etcd is used, restore its data directory from the
//! store when it is missing or invalid, or leave it for etcd to start fresh when the store is
//! empty. A guard file next to the data directory keeps one cluster's backups out of another
//! cluster's volume.

use std::path::{Path, PathBuf};

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

/// Restores `config.data_dir` from `store` if it is missing or invalid.
pub async fn initialize(
    store: &SnapshotStore,
    config: &RestoreConfig,
) -> Result<Initialized, RestoreError> {
    let data_dir = config.data_dir.as_deref().ok_or(RestoreError::NoDataDir)?;
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
    match decide(valid, has_full, has_any) {
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
            let report = restore(store, &opts).await?;
            Ok(Initialized::Restored {
                moved_aside: report.moved_aside,
            })
        }
    }
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
