//! Restore an etcd data directory from a full snapshot and its deltas.
//!
//! The full snapshot is fetched and its hash checked; for etcd 3.4, 3.5 and 3.6 the member
//! directory is written into `<data-dir>.part` as their own restore tool writes it
//! ([`member_dir`]): the WAL and `.snap` file, and the database streamed from the snapshot's
//! with the new membership and the deltas' events written straight into it as the records etcd
//! itself would have written ([`direct`]); its revision is read back from the file, then the
//! result is synced and renamed into place. No etcd runs. Other releases (and the fallbacks
//! below) have the release's own tool restore the written database and a temporary etcd on
//! loopback check its revision; only those paths need the tool (`etcdutl`, or 3.4's `etcdctl`)
//! beside `etcd`. Deltas that cannot be written directly (puts without their create revision
//! and version) are replayed through the temporary etcd instead ([`replay`]). Which of these
//! ways a restore takes is chosen in one place, before anything is fetched (`strategy`). Any
//! failure leaves an existing data directory untouched.
//!
//! Leases are not restored: puts from deltas carry no lease (as etcd-backup-restore does), so
//! keys written under a lease after the full snapshot live until deleted.
//!
//! A restore may stop at a point in the past ([`RestoreOptions::to`]: the newest full snapshot
//! before it and the delta events up to it) and may bump the revision past everything the
//! source served ([`RevisionBump`]), as `etcdutl snapshot restore --bump-revision
//! --mark-compacted` does, so Kubernetes' watch caches and informers see a compaction instead of
//! a revision going back. Both work on the database as it is written, for etcd 3.4 to 3.6.

pub mod bolt;
pub mod datadir;
pub mod direct;
pub mod drill;
pub mod initialize;
pub mod member_dir;
pub mod quorum;
pub mod rejoin;
pub mod replay;
mod strategy;
pub mod tools;
pub mod wal;
mod write_back;

use std::path::{Path, PathBuf};
use std::time::Instant;

use futures::StreamExt;

use crate::etcd::process::ProcessError;
use crate::scratch::ScratchDir;
use crate::snapshot::delta::{self, DeltaError, EventType};
use crate::snapshot::full::verify_sha256;
use crate::store::encryption::EncryptionError;
use crate::store::{ByteStream, Snapshot, SnapshotStore, StoreError, layout};
pub use layout::Target;

use replay::{ReplayOp, RevisionGroup};
use strategy::Built;
pub use tools::{DbHash, EtcdTools, MemberParams, TempEtcd};

/// What went wrong in a restore; each says which step. Where a message includes a cause, the
/// cause is not also the error's source (which would print it twice).
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// etcd's binaries could not be found.
    #[error("{0}")]
    Locate(ProcessError),
    /// No snapshot restore tool beside the etcd binary.
    #[error("no {tool} beside {}; point --etcd-bin at a directory holding etcd and {tool}", etcd.display())]
    NoRestorer {
        /// `etcdutl` or `etcdctl`.
        tool: &'static str,
        /// The etcd binary found.
        etcd: PathBuf,
    },
    /// etcd's snapshot restore tool could not be run.
    #[error("running {}: {cause}", tool.display())]
    RunTool {
        tool: PathBuf,
        cause: std::io::Error,
    },
    /// etcd's snapshot restore tool failed; `stderr` is the last line it printed.
    #[error("{tool} snapshot restore failed ({status}): {stderr}")]
    ToolFailed {
        tool: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    /// The member directory could not be written (the initial cluster, a file).
    #[error("{0}")]
    MemberDir(member_dir::MemberDirError),
    /// The written database is not at the revision the deltas end at.
    #[error("the restored database {path} is at revision {seen}, the deltas end at {expected}")]
    WrittenRevision {
        path: String,
        seen: i64,
        expected: i64,
    },
    /// The temporary etcd could not be started or stopped.
    #[error("temporary etcd: {0}")]
    TempEtcd(ProcessError),
    /// A blocking task of the restore panicked or was cancelled.
    #[error("{what}: {cause}")]
    Task {
        what: &'static str,
        cause: tokio::task::JoinError,
    },
    /// `restore.initialize` without `restore.data_dir`.
    #[error("restore.initialize needs restore.data_dir")]
    NoDataDir,
    /// A delta could not be fetched or decoded (its hash, its JSON).
    #[error("delta {name}: {cause}")]
    Delta { name: String, cause: DeltaError },
    /// The deltas do not fit the full snapshot or each other (a gap, an order, a revision).
    #[error("{0}")]
    Deltas(String),
    /// No chain in the store restores the point in time asked for.
    #[error("{0}")]
    Target(layout::TargetError),
    /// Deltas only a replay through etcd can apply, with an option that needs them written
    /// into the database (a point in time, a revision bump).
    #[error("{option} needs the deltas written into the database, and these cannot be: {reason}")]
    NeedsDirect {
        option: &'static str,
        reason: String,
    },
    /// An etcd request failed.
    #[error("etcd: {0}")]
    Etcd(etcd_client::Error),
    /// etcd answered a status request without a header.
    #[error("etcd: status without a header")]
    NoHeader,
    /// Replaying a round of revisions through the temporary etcd failed.
    #[error("etcd: replaying revisions {first} to {last}: {cause}")]
    Replay {
        first: i64,
        last: i64,
        cause: etcd_client::Error,
    },
    /// The temporary etcd opened the restored database at another revision than the deltas'.
    #[error(
        "etcd: etcd opened the restored database at revision {seen}, the deltas end at {expected}"
    )]
    RevisionMismatch { seen: i64, expected: i64 },
    #[error("{path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    /// Reading the store failed.
    #[error("{0}")]
    Store(StoreError),
    /// The store has no full snapshot to restore.
    #[error("the store has no full snapshot")]
    NoFullSnapshot,
    /// A snapshot's payload fails verification: its hash, its compression or its encryption
    /// (truncated or changed in the store).
    #[error("snapshot {name} fails verification: {cause}")]
    CorruptSnapshot { name: String, cause: std::io::Error },
    /// A full snapshot that cannot be decrypted with the configured identities (none is
    /// configured, it is encrypted to other keys, its header is damaged, cut short or beyond
    /// its bounds): skipped as one failing verification is, since a name planted in the store
    /// must not block every restore. `cause` names it.
    #[error("{cause}")]
    UndecryptableFull { name: String, cause: StoreError },
    /// Every full snapshot that could be fallen back to failed verification too; `note` says
    /// which encrypted ones were skipped for want of an identity.
    #[error("{cause}; the store holds no earlier full snapshot to fall back to{note}")]
    NothingToFallBackTo {
        cause: Box<RestoreError>,
        note: String,
    },
    /// A full snapshot failed verification and no earlier chain can stand in for it: `why`
    /// says what stops that chain (a gap, a target it does not reach), `cause` why the full
    /// snapshot was skipped, so neither hides the other.
    #[error("{cause}; falling back to an earlier full snapshot failed: {why}")]
    FallbackFailed {
        cause: Box<RestoreError>,
        why: Box<RestoreError>,
    },
    /// The restore would not bring the data directory forward (see
    /// [`RestoreOptions::must_exceed`]); nothing was moved into place.
    #[error("the restore reaches revision {reached}, not beyond the data directory's {current}")]
    NotNewer { reached: i64, current: i64 },
    /// `restore.initialize` found a corrupt data directory and no full snapshot to restore.
    #[error(
        "the data directory is corrupt ({reason}) and the store holds no full snapshot; refusing \
         to start etcd on it or empty. Move it aside by hand to start empty"
    )]
    CorruptWithoutBackup { reason: String },
    /// The store holds deltas but no full snapshot: starting etcd empty would lose them.
    #[error("the store holds deltas but no full snapshot; refusing to start etcd empty")]
    DeltasWithoutFull,
    /// The data directory is a symbolic link: the restored directory cannot be renamed over it.
    #[error(
        "the data directory {} is a symbolic link (to {}); a restore replaces the directory \
         itself: point restore.data_dir at {} or remove the link",
        path.display(),
        to.display(),
        to.display()
    )]
    DataDirSymlink { path: PathBuf, to: PathBuf },
    /// The target directory is in use and `--force` was not given.
    #[error("{0} exists and is not empty; pass --force to move it aside")]
    TargetNotEmpty(String),
    /// The guard file next to the data directory names another etcd.
    #[error(
        "{} holds {found:?} but this sidecar's restore.guard is {expected:?}: the volume belongs \
         to another etcd; refusing to restore into it",
        file.display()
    )]
    Guard {
        file: PathBuf,
        found: String,
        expected: String,
    },
    /// A step of the restore failed; nothing was moved into place.
    #[error("restore failed while {step}: {cause}")]
    Step {
        step: &'static str,
        cause: Box<RestoreError>,
    },
}

impl RestoreError {
    /// The snapshot whose payload failed verification, if that is what this error is.
    pub fn corrupt_snapshot(&self) -> Option<&str> {
        match self {
            RestoreError::CorruptSnapshot { name, .. }
            | RestoreError::UndecryptableFull { name, .. } => Some(name),
            RestoreError::Step { cause, .. } => cause.corrupt_snapshot(),
            _ => None,
        }
    }

    /// Whether this skips a full snapshot because no identity is configured to decrypt it.
    fn wants_identity(&self) -> bool {
        match self {
            RestoreError::UndecryptableFull {
                cause: StoreError::Encryption(e),
                ..
            } => matches!(**e, EncryptionError::NoIdentity { .. }),
            RestoreError::Step { cause, .. } => cause.wants_identity(),
            _ => false,
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        RestoreError::Io {
            path: path.display().to_string(),
            cause: source,
        }
    }
}

/// Names the step a fallible operation belongs to.
trait StepExt<T> {
    fn step(self, step: &'static str) -> Result<T, RestoreError>;
}

impl<T> StepExt<T> for Result<T, RestoreError> {
    fn step(self, step: &'static str) -> Result<T, RestoreError> {
        self.map_err(|e| match e {
            // The innermost step is the most precise.
            e @ RestoreError::Step { .. } => e,
            e => RestoreError::Step {
                step,
                cause: Box::new(e),
            },
        })
    }
}

/// What to restore into and how.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// The data directory to create.
    pub data_dir: PathBuf,
    /// How the restored member is named and which cluster it starts.
    pub member: MemberParams,
    /// Where etcd's binaries are; `None` means `PATH`.
    pub etcd_bin: Option<PathBuf>,
    /// Move a non-empty `data_dir` aside to `<data-dir>.old-<unix-time>` instead of refusing.
    pub force: bool,
    /// Deltas fetched ahead of the one being replayed.
    pub parallel_fetch: usize,
    /// A full snapshot that fails verification is skipped for the previous one and the deltas
    /// that continue it; without this it fails the restore.
    pub fallback: bool,
    /// Install the result only if its revision is above this one (the revision of a data
    /// directory being replaced because it is behind the store): a fallback must not replace a
    /// directory with an older one.
    pub must_exceed: Option<i64>,
    /// Restore the state at this point in the past; `None`: the newest the store holds.
    pub to: Option<Target>,
    /// Revisions after the restored data that etcd must count as used.
    pub bump: RevisionBump,
}

impl RestoreOptions {
    /// A single-member restore of the latest chain into a tool's scratch `data_dir` (`compact`,
    /// a drill): no fallback, since a tool working on an older chain than the latest would
    /// pass for one that worked on the latest.
    pub fn scratch(data_dir: &Path, etcd_bin: Option<PathBuf>, parallel_fetch: usize) -> Self {
        RestoreOptions {
            data_dir: data_dir.to_path_buf(),
            member: MemberParams::default(),
            etcd_bin,
            force: false,
            parallel_fetch,
            fallback: false,
            must_exceed: None,
            to: None,
            bump: RevisionBump::default(),
        }
    }
}

/// A revision bump after the restored data (`etcdutl snapshot restore --bump-revision N
/// --mark-compacted`): etcd starts `by` revisions above the last restored one, and with
/// `mark_compacted` compacts up to there on its first start, so a client holding a revision the
/// source served after the backup (a watch cache, an informer) gets "compacted" instead of
/// waiting for revisions that mean something else now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RevisionBump {
    /// How far above the restored revision etcd starts; 0: no bump.
    pub by: u64,
    /// Mark the bumped revision compacted.
    pub mark_compacted: bool,
}

impl RestoreOptions {
    /// Options from the `[restore]` section, restoring into `data_dir`.
    pub fn from_config(c: &crate::config::RestoreConfig, data_dir: &Path) -> Self {
        RestoreOptions {
            data_dir: data_dir.to_path_buf(),
            member: MemberParams {
                name: c.name.clone(),
                initial_cluster: c.initial_cluster.clone(),
                initial_cluster_token: c.initial_cluster_token.clone(),
                initial_advertise_peer_urls: c.initial_advertise_peer_urls.clone(),
            },
            etcd_bin: c.etcd_bin.clone(),
            force: c.force,
            parallel_fetch: c.parallel_fetch,
            fallback: c.fallback,
            must_exceed: None,
            to: None,
            bump: RevisionBump {
                by: c.bump_revision,
                mark_compacted: c.mark_compacted,
            },
        }
    }
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreReport {
    /// The full snapshot restored.
    pub full_snapshot: String,
    /// Deltas read.
    pub deltas: usize,
    /// Events replayed (those already in the full snapshot are not counted).
    pub events_applied: u64,
    /// The revision of the restored data: the last event's (the target's, for a point in time).
    pub revision: i64,
    /// The revision etcd starts at: `revision` plus the bump.
    pub etcd_revision: i64,
    /// When the sidecar received the last event restored (`None` without events).
    pub last_event_time: Option<chrono::DateTime<chrono::Utc>>,
    /// Time spent applying the deltas, fetching overlapped: for [`Replay::Direct`] writing the
    /// database with them (the copy of the snapshot's part included), for
    /// [`Replay::ThroughEtcd`] the replay.
    pub replay_time: std::time::Duration,
    /// How the deltas were applied.
    pub replay: Replay,
    /// Where a previous data directory was moved (`--force`).
    pub moved_aside: Option<PathBuf>,
    /// Full snapshots skipped because they failed verification, newest first.
    pub skipped: Vec<Skipped>,
    /// The newest revision any snapshot in the store reaches (above `revision` when a
    /// fallback could not reach it).
    pub store_revision: i64,
}

/// A full snapshot a restore did not use, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Its name.
    pub snapshot: String,
    /// What its verification found.
    pub reason: String,
}

/// How a restore applied the deltas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// There were none (whatever wrote the database: a point in time or a bump is still
    /// written into it).
    NoDeltas,
    /// Written into the full snapshot's database ([`direct`]), then its revision checked.
    Direct,
    /// Replayed through a temporary etcd ([`replay`]): deltas [`direct`] cannot write.
    ThroughEtcd,
}

/// `<dir><suffix>` next to `dir`.
pub(super) fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut s = dir.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Whether `dir` exists with something in it.
fn is_non_empty_dir(dir: &Path) -> Result<bool, RestoreError> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(RestoreError::io(dir, e)),
    }
}

/// Refuses a data directory that is a symbolic link, before anything is fetched: rename(2)
/// puts the restored directory over no link (`ENOTDIR`), and with `--force` the link would be
/// moved aside and the data land beside the volume it points to.
fn refuse_symlink(dir: &Path) -> Result<(), RestoreError> {
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.file_type().is_symlink() => Err(RestoreError::DataDirSymlink {
            path: dir.to_path_buf(),
            to: std::fs::read_link(dir).map_err(|e| RestoreError::io(dir, e))?,
        }),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(RestoreError::io(dir, e)),
    }
}

pub(super) fn remove_if_exists(path: &Path) -> Result<(), RestoreError> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(RestoreError::io(path, e)),
    }
}

/// Restores `opts.data_dir` from the latest full snapshot in `store` and every later delta.
#[tracing::instrument(
    name = "restore",
    skip_all,
    fields(store = %store.prefix(), data_dir = %opts.data_dir.display())
)]
pub async fn restore(
    store: &SnapshotStore,
    opts: &RestoreOptions,
) -> Result<RestoreReport, RestoreError> {
    let target = &opts.data_dir;
    refuse_symlink(target)?;
    if is_non_empty_dir(target)? && !opts.force {
        return Err(RestoreError::TargetNotEmpty(target.display().to_string()));
    }
    let listing = store
        .listing()
        .await
        .map_err(RestoreError::Store)
        .step("listing the store")?;
    if !listing.unrecognised.is_empty() {
        // A damaged name may be the snapshot this restore should have used.
        tracing::warn!(
            objects = %listing.unrecognised_names().join(", "),
            "objects in the store whose names are not snapshot names are not restored"
        );
    }
    let list = listing.snapshots();
    let store_revision = list.iter().map(|s| s.last_revision).max().unwrap_or(0);
    let mut chain = choose_chain(&list, opts.to, &[]).step("checking the chain")?;
    let mut skipped: Vec<Skipped> = Vec::new();
    let mut wanting_identity: Vec<String> = Vec::new();
    let mut tools: Option<EtcdTools> = None;
    loop {
        // A fallback chain always has a base: the loop ends below when none is left.
        let Some(full) = chain.full_snapshot.clone() else {
            return Err(RestoreError::NoFullSnapshot).step("listing the store");
        };
        let attempt = restore_chain(store, opts, &mut tools, &full, &chain.delta_snapshots).await;
        let error = match attempt {
            Ok(built) => {
                return Ok(report(built, &full, &chain, skipped, store_revision));
            }
            Err(e) => e,
        };
        // Only a full snapshot whose own payload fails verification or cannot be decrypted is
        // skipped: a store that cannot be read, a key file that cannot be read or a broken delta
        // fails as it is.
        if error.corrupt_snapshot() != Some(full.snap_name.as_str()) || !opts.fallback {
            return Err(error);
        }
        tracing::error!(
            snapshot = %full.snap_name,
            revision = full.last_revision,
            %error,
            "the full snapshot fails verification; falling back to the previous full snapshot"
        );
        if error.wants_identity() {
            wanting_identity.push(full.snap_name.clone());
        }
        skipped.push(Skipped {
            snapshot: full.snap_name.clone(),
            reason: error.to_string(),
        });
        let names: Vec<String> = skipped.iter().map(|s| s.snapshot.clone()).collect();
        chain = match choose_chain(&list, opts.to, &names) {
            Ok(c) if c.full_snapshot.is_some() => c,
            Ok(_) | Err(RestoreError::Target(layout::TargetError::BeforeOldest { .. })) => {
                // A user who forgot the identity must learn it even when the last snapshot
                // tried failed for another reason.
                let note = match wanting_identity.is_empty() {
                    true => String::new(),
                    false => format!(
                        " (skipped as encrypted with no identity configured to decrypt them: \
                         {}; set encryption.identities, ETCD_WARDEN_ENCRYPTION_IDENTITIES)",
                        wanting_identity.join(", ")
                    ),
                };
                return Err(RestoreError::NothingToFallBackTo {
                    cause: Box::new(error),
                    note,
                });
            }
            Err(why) => {
                return Err(RestoreError::FallbackFailed {
                    cause: Box::new(error),
                    why: Box::new(why),
                });
            }
        };
    }
}

/// The chain a restore uses: the latest (or, with full snapshots `skipped`, the latest that
/// continues the one before them exactly), or the one that reaches `to`. The deltas' events are
/// checked again as they are written; a gap fails here, before anything is fetched, with the
/// message `verify` and `copy` give.
fn choose_chain(
    list: &[Snapshot],
    to: Option<Target>,
    skipped: &[String],
) -> Result<layout::Chain, RestoreError> {
    if let Some(target) = to {
        return layout::chain_to(list, target, skipped).map_err(RestoreError::Target);
    }
    if !skipped.is_empty() {
        return Ok(layout::fallback_chain(list, skipped));
    }
    let chain = layout::latest_chain(list);
    match layout::first_gap(&chain) {
        Some(gap) => Err(RestoreError::Deltas(gap.to_string())),
        None => Ok(chain),
    }
}

/// What [`restore_chain`] installed.
struct Installed {
    built: Built,
    moved_aside: Option<PathBuf>,
}

/// Restores `full` and `deltas` into `opts.data_dir`: built beside it, checked, synced, then
/// moved into place. A failure leaves the data directory as it was.
async fn restore_chain(
    store: &SnapshotStore,
    opts: &RestoreOptions,
    tools: &mut Option<EtcdTools>,
    full: &Snapshot,
    deltas: &[Snapshot],
) -> Result<Installed, RestoreError> {
    let target = &opts.data_dir;
    // Before anything is written, each snapshot's header (only that is read) must open. A full
    // snapshot that does not is skipped as a corrupt one is; a delta that does not fails the
    // restore by name, as a corrupt delta does.
    store
        .check_decryptable(&[full])
        .await
        .map_err(|cause| match cause {
            StoreError::Encryption(e)
                if matches!(
                    *e,
                    EncryptionError::NoIdentity { .. } | EncryptionError::Undecryptable { .. }
                ) =>
            {
                RestoreError::UndecryptableFull {
                    name: full.snap_name.clone(),
                    cause: StoreError::Encryption(e),
                }
            }
            other => RestoreError::Store(other),
        })
        .step("checking the full snapshot can be decrypted")?;
    let deltas_listed: Vec<&Snapshot> = deltas.iter().collect();
    store
        .check_decryptable(&deltas_listed)
        .await
        .map_err(RestoreError::Store)
        .step("checking the deltas can be decrypted")?;
    let tools = match tools {
        Some(t) => t,
        None => tools.insert(
            EtcdTools::locate(opts.etcd_bin.as_deref())
                .await
                .step("locating etcd's tools")?,
        ),
    };

    let part = sibling(target, ".part");
    let work_path = sibling(target, ".restore-work");
    if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
        crate::scratch::create_private_dirs(parent)
            .map_err(|e| RestoreError::io(parent, e))
            .step("creating the parent directory")?;
    }
    // Leftovers of an interrupted restore are ours to discard. The work directory (it holds
    // the fetched snapshot, decrypted) is then created fresh and private: a directory or link
    // that appears at its name in between is refused, never used. `part` is created as
    // freshly by whatever writes it (here, or etcd's tool, which creates it 0700).
    remove_if_exists(&part).step("removing an earlier partial restore")?;
    remove_if_exists(&work_path).step("removing an earlier partial restore")?;
    let work = ScratchDir::create(&work_path)
        .map_err(|e| RestoreError::io(&work_path, e))
        .step("creating the work directory")?;

    let built = strategy::build(store, tools, opts, full, deltas, &part, work.path()).await;
    drop(work);
    // Every strategy ends here: the temporary etcd may have run without fsync, so the
    // result is synced once, then moved into place. A failure removes `part` and nothing else.
    let installed = async {
        let built = built?;
        if let Some(current) = opts.must_exceed.filter(|c| built.revision <= *c) {
            return Err(RestoreError::NotNewer {
                reached: built.revision,
                current,
            });
        }
        sync_tree(&part)
            .await
            .step("syncing the restored directory")?;
        let moved_aside =
            install(&part, target, opts.force).step("moving the result into place")?;
        Ok::<_, RestoreError>(Installed { built, moved_aside })
    }
    .await;
    if installed.is_err() {
        let _ = std::fs::remove_dir_all(&part);
    }
    installed
}

/// The report of a restore of `full` and `chain`'s deltas, logged.
fn report(
    installed: Installed,
    full: &Snapshot,
    chain: &layout::Chain,
    skipped: Vec<Skipped>,
    store_revision: i64,
) -> RestoreReport {
    let Installed { built, moved_aside } = installed;
    let report = RestoreReport {
        full_snapshot: full.snap_name.clone(),
        deltas: chain.delta_snapshots.len(),
        events_applied: built.events,
        revision: built.revision,
        etcd_revision: built.etcd_revision,
        last_event_time: built.last_event_time,
        replay_time: built.replay_time,
        replay: built.replay,
        moved_aside,
        skipped,
        store_revision,
    };
    if report.skipped.is_empty() {
        tracing::info!(
            full_snapshot = %report.full_snapshot,
            deltas = report.deltas,
            events = report.events_applied,
            revision = report.revision,
            "restore complete"
        );
    } else {
        let skipped: Vec<&str> = report.skipped.iter().map(|s| s.snapshot.as_str()).collect();
        tracing::warn!(
            full_snapshot = %report.full_snapshot,
            skipped = %skipped.join(", "),
            deltas = report.deltas,
            events = report.events_applied,
            revision = report.revision,
            store_revision,
            "restore complete from an earlier full snapshot; revisions after `revision` up to \
             `store_revision` are not restored"
        );
    }
    report
}

/// Fetches the full snapshot into `db`, checking its hash on the way. Returns its length.
#[tracing::instrument(
    name = "fetch_full_snapshot",
    skip_all,
    fields(snapshot = %full.snap_name, revision = full.last_revision)
)]
pub(super) async fn fetch_full(
    store: &SnapshotStore,
    full: &Snapshot,
    db: &Path,
    kept: bool,
) -> Result<u64, RestoreError> {
    let started = Instant::now();
    let stream = store
        .get_decoded(full)
        .await
        .map_err(RestoreError::Store)
        .step("fetching the full snapshot")?;
    let bytes = write_verified(stream, db, &full.snap_name, kept)
        .await
        .step("fetching and verifying the full snapshot")?;
    tracing::info!(
        bytes,
        seconds = started.elapsed().as_secs_f64(),
        "full snapshot fetched and verified"
    );
    Ok(bytes)
}

/// The restore must end where the last delta ends (or, when the full snapshot holds writes
/// made after its name's revision, at the snapshot's own revision), or at the target revision;
/// never short of it. A time has no revision to check: the chain was chosen to reach it.
fn check_final_revision(
    actual: i64,
    restored: i64,
    deltas: &[Snapshot],
    to: Option<Target>,
) -> Result<(), RestoreError> {
    let (expected, what) = match to {
        Some(Target::Time(_)) => return Ok(()),
        Some(Target::Revision(r)) => (r, "the target is"),
        None => (
            deltas
                .last()
                .map_or(restored, |d| d.last_revision)
                .max(restored),
            "the last delta ends at",
        ),
    };
    if actual == expected {
        return Ok(());
    }
    Err(RestoreError::Deltas(format!(
        "the restored database is at revision {actual}, {what} {expected}"
    )))
}

/// Fetches deltas `parallel` ahead (within the process's delta budget, [`delta::read_all`])
/// and replays them in order. Returns (events applied, revision).
async fn replay_all(
    store: &SnapshotStore,
    temp: &TempEtcd,
    deltas: &[Snapshot],
    parallel: usize,
) -> Result<(u64, i64), RestoreError> {
    let mut client = etcd_client::Client::connect([&temp.client_url], None)
        .await
        .map_err(RestoreError::Etcd)
        .step("connecting to the temporary etcd")?;
    let restored = current_revision(&mut client)
        .await
        .step("reading the restored revision")?;
    let mut current = restored;
    let started = Instant::now();
    tracing::info!(revision = restored, "replaying deltas");
    let mut fetched = std::pin::pin!(delta::read_all(store, deltas, parallel));
    let kv = client.kv_client();
    let mut applied = replay::Applied::default();
    // The last revision seen is held back until a later event (or the end) shows it is
    // complete: nothing guarantees that one revision's events never straddle two deltas.
    let mut pending = Pending::default();
    while let Some((d, events)) = fetched.next().await {
        let events = events
            .map_err(|cause| RestoreError::Delta {
                name: d.snap_name.clone(),
                cause,
            })
            .step("fetching and verifying deltas")?;
        for event in events.views() {
            let (rev, op) = to_op(&event, d)?;
            pending.push(rev, op, d).step("replaying deltas")?;
            if pending.bytes >= Pending::APPLY_BYTES {
                pending
                    .apply_complete(&kv, &mut current, &mut applied)
                    .await?;
            }
        }
        pending
            .apply_complete(&kv, &mut current, &mut applied)
            .await?;
    }
    let groups: Vec<RevisionGroup> =
        replay::group(std::mem::take(&mut pending.ops)).step("replaying deltas")?;
    let done = replay::apply(&kv, &groups, &mut current)
        .await
        .step("replaying deltas")?;
    applied.events += done.events;
    applied.rounds += done.rounds;
    let actual = current_revision(&mut client)
        .await
        .step("reading the final revision")?;
    check_final_revision(actual, restored, deltas, None).step("checking the final revision")?;
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        events = applied.events,
        rounds = applied.rounds,
        revision = actual,
        seconds = secs,
        events_per_second = applied.events as f64 / secs.max(1e-9),
        "deltas replayed"
    );
    Ok((applied.events, actual))
}

/// Replay operations read and not applied yet, in revision order: applied a few MiB at a time,
/// so a delta's events are held once (packed, by the budget), not again as operations.
#[derive(Default)]
struct Pending {
    ops: Vec<(i64, ReplayOp)>,
    /// What `ops` hold, about.
    bytes: usize,
    /// Of them, what the last revision holds.
    last_bytes: usize,
}

impl Pending {
    /// Bytes of operations gathered before the complete revisions are applied.
    const APPLY_BYTES: usize = 4 << 20;
    /// The most one revision may hold: the temporary etcd takes a revision in one transaction
    /// of at most this (its `--max-request-bytes`, [`tools::TempEtcd::start`]).
    const REVISION_BYTES: usize = 32 << 20;

    fn push(&mut self, rev: i64, op: ReplayOp, d: &Snapshot) -> Result<(), RestoreError> {
        let last = self.ops.last().map(|(r, _)| *r);
        if let Some(last) = last
            && rev < last
        {
            return Err(RestoreError::Deltas(format!(
                "delta {}: events out of order: revision {rev} after {last}",
                d.snap_name
            )));
        }
        let cost = size_of::<(i64, ReplayOp)>()
            + 32
            + match &op {
                ReplayOp::Put { key, value } => key.len() + value.len(),
                ReplayOp::Delete { key } => key.len(),
            };
        self.last_bytes = match last == Some(rev) {
            true => self.last_bytes + cost,
            false => cost,
        };
        if self.last_bytes > Self::REVISION_BYTES {
            return Err(RestoreError::Deltas(format!(
                "delta {}: revision {rev} holds more than {} MiB of changes, more than the \
                 temporary etcd takes in one transaction",
                d.snap_name,
                Self::REVISION_BYTES >> 20
            )));
        }
        self.bytes += cost;
        self.ops.push((rev, op));
        Ok(())
    }

    /// Applies every revision but the last (which may go on in what follows).
    async fn apply_complete(
        &mut self,
        kv: &etcd_client::KvClient,
        current: &mut i64,
        applied: &mut replay::Applied,
    ) -> Result<(), RestoreError> {
        let Some(&(last, _)) = self.ops.last() else {
            return Ok(());
        };
        let complete = self.ops.partition_point(|(r, _)| *r < last);
        if complete == 0 {
            return Ok(());
        }
        let groups = replay::group(self.ops.drain(..complete)).step("replaying deltas")?;
        self.bytes = self.last_bytes;
        let done = replay::apply(kv, &groups, current)
            .await
            .step("replaying deltas")?;
        applied.events += done.events;
        applied.rounds += done.rounds;
        Ok(())
    }
}

/// A delta event as a replay operation; the lease is dropped on purpose (see the module doc).
fn to_op(event: &delta::EventView, d: &Snapshot) -> Result<(i64, ReplayOp), RestoreError> {
    let kv = event.kv.ok_or_else(|| RestoreError::Step {
        step: "replaying deltas",
        cause: Box::new(RestoreError::Deltas(format!(
            "delta {}: an event without a key",
            d.snap_name
        ))),
    })?;
    let op = match event.kind {
        EventType::Put => ReplayOp::Put {
            key: kv.key.to_vec(),
            value: kv.value.to_vec(),
        },
        EventType::Delete => ReplayOp::Delete {
            key: kv.key.to_vec(),
        },
    };
    Ok((kv.mod_revision, op))
}

async fn current_revision(client: &mut etcd_client::Client) -> Result<i64, RestoreError> {
    let status = client.status().await.map_err(RestoreError::Etcd)?;
    status
        .header()
        .map(|h| h.revision())
        .ok_or(RestoreError::NoHeader)
}

/// Writes a stream to `path`, checking etcd's trailing SHA-256 as it passes. A payload that
/// fails its check or its decoding is [`RestoreError::CorruptSnapshot`] `name`, and so is one
/// that is no bbolt database: its meta pages are read before anything is written, and no byte
/// beyond the size they declare (and the hash) is written ([`bolt::Incoming`]).
///
/// The file is not synced here: the restore syncs what it keeps once. When the file is `kept`
/// (it becomes the member's database), it is written back as it grows ([`write_back`]), so that
/// final sync has little left to do; otherwise etcd's tool copies it and nothing of it needs the
/// disk. The hash and the writes run on one blocking thread, the decompression on its own, so
/// the two overlap and no async worker is held.
async fn write_verified(
    stream: ByteStream,
    path: &Path,
    name: &str,
    kept: bool,
) -> Result<u64, RestoreError> {
    let mut verified = verify_sha256(stream);
    let (path, name) = (path.to_path_buf(), name.to_owned());
    let handle = tokio::runtime::Handle::current();
    // Dropped (a signal), this restore stops the writing thread at its next chunk.
    let cancel = tokio_util::sync::CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    tokio::task::spawn_blocking(move || {
        use std::io::Write as _;
        let not_bbolt = |e: bolt::BoltError| RestoreError::CorruptSnapshot {
            name: name.clone(),
            cause: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("its database: {e}"),
            ),
        };
        let mut incoming = bolt::Incoming::new(crate::snapshot::delta::HASH_LEN);
        // Decrypted data, in a private directory; a name taken already is refused.
        let mut file =
            crate::scratch::create_private_file(&path).map_err(|e| RestoreError::io(&path, e))?;
        let mut write_back = match kept {
            true => {
                Some(write_back::WriteBack::start(&file).map_err(|e| RestoreError::io(&path, e))?)
            }
            false => None,
        };
        let mut written = 0u64;
        while let Some(chunk) = handle.block_on(verified.next()) {
            if cancel.is_cancelled() {
                return Err(RestoreError::io(
                    &path,
                    std::io::Error::other("the restore was stopped"),
                ));
            }
            let chunk = chunk.map_err(|cause| match cause.kind() {
                // The hash and the decryption say InvalidData, flate2 InvalidInput (a corrupt
                // deflate stream, a bad header or footer), a short payload UnexpectedEof; a
                // store failing mid-read says Other (object_store's errors), and is no corrupt
                // snapshot.
                std::io::ErrorKind::InvalidData
                | std::io::ErrorKind::InvalidInput
                | std::io::ErrorKind::UnexpectedEof => RestoreError::CorruptSnapshot {
                    name: name.clone(),
                    cause,
                },
                _ => RestoreError::io(&path, cause),
            })?;
            let Some(bytes) = incoming.push(&chunk).map_err(not_bbolt)? else {
                continue;
            };
            written += bytes.len() as u64;
            file.write_all(&bytes)
                .map_err(|e| RestoreError::io(&path, e))?;
            if let Some(wb) = &mut write_back {
                wb.wrote(written);
            }
        }
        let rest = incoming.finish().map_err(not_bbolt)?;
        written += rest.len() as u64;
        file.write_all(&rest)
            .map_err(|e| RestoreError::io(&path, e))?;
        if let Some(wb) = write_back {
            wb.finish().map_err(|e| RestoreError::io(&path, e))?;
        }
        Ok(written)
    })
    .await
    .map_err(|cause| RestoreError::Task {
        what: "writing the snapshot",
        cause,
    })?
}

/// Saves a snapshot of the etcd at `url` (the maintenance API) to `path`.
async fn snapshot_to_file(url: &str, path: &Path) -> Result<u64, RestoreError> {
    let client = etcd_client::Client::connect([url], None)
        .await
        .map_err(RestoreError::Etcd)?;
    let stream = client
        .maintenance_client()
        .snapshot()
        .await
        .map_err(RestoreError::Etcd)?;
    let raw = futures::stream::unfold(stream, |mut s| async move {
        match s.message().await {
            Ok(Some(msg)) => Some((Ok(bytes::Bytes::copy_from_slice(msg.blob())), s)),
            Ok(None) => None,
            Err(e) => Some((Err(std::io::Error::other(e)), s)),
        }
    })
    .boxed();
    write_verified(raw, path, "of the temporary etcd", false).await
}

/// Syncs every file and directory under `dir` (the temporary etcd may have run without fsync).
pub(super) async fn sync_tree(dir: &Path) -> Result<(), RestoreError> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || sync_tree_blocking(&dir))
        .await
        .map_err(|cause| RestoreError::Task {
            what: "sync task failed",
            cause,
        })?
}

fn sync_tree_blocking(dir: &Path) -> Result<(), RestoreError> {
    for entry in std::fs::read_dir(dir).map_err(|e| RestoreError::io(dir, e))? {
        let path = entry.map_err(|e| RestoreError::io(dir, e))?.path();
        if path.is_dir() {
            sync_tree_blocking(&path)?;
        } else {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| RestoreError::io(&path, e))?;
        }
    }
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), RestoreError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| RestoreError::io(dir, e))
}

/// Renames `part` to `target`, first moving a non-empty `target` aside when `force` is set.
/// Returns where the old directory went.
pub(super) fn install(
    part: &Path,
    target: &Path,
    force: bool,
) -> Result<Option<PathBuf>, RestoreError> {
    let mut moved = None;
    if is_non_empty_dir(target)? {
        if !force {
            return Err(RestoreError::TargetNotEmpty(target.display().to_string()));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let aside = sibling(target, &format!(".old-{now}"));
        std::fs::rename(target, &aside).map_err(|e| RestoreError::io(target, e))?;
        moved = Some(aside);
    }
    // rename(2) replaces an empty directory, so an empty target needs no special case.
    if let Err(e) = std::fs::rename(part, target) {
        if let Some(aside) = &moved {
            // Put the old directory back: a failed restore leaves it where it was.
            let _ = std::fs::rename(aside, target);
        }
        return Err(RestoreError::io(target, e));
    }
    if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siblings_are_next_to_the_target() {
        assert_eq!(
            sibling(Path::new("/var/lib/etcd/data"), ".part"),
            PathBuf::from("/var/lib/etcd/data.part")
        );
    }

    /// `db` followed by its SHA-256, as etcd streams a snapshot.
    fn sealed(mut db: Vec<u8>) -> Vec<u8> {
        use sha2::Digest as _;
        let hash = sha2::Sha256::digest(&db);
        db.extend_from_slice(&hash);
        db
    }

    /// A small database as bbolt writes it, `page_size`-byte pages.
    fn database(page_size: usize) -> Vec<u8> {
        use crate::restore::bolt::{Bucket, NewFile};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let mut w = NewFile::create(&path, page_size).unwrap();
        let mut key = w.tree();
        for i in 0..500u32 {
            key.push(&i.to_be_bytes(), &[7; 40]).unwrap();
        }
        let key = key.finish().unwrap();
        w.finish(&[Bucket::paged(b"key", key)], 3).unwrap();
        std::fs::read(&path).unwrap()
    }

    /// Writes `payload` as a fetched full snapshot named `Full-x`; the error, if any, and the
    /// bytes on disk.
    async fn fetched(dir: &Path, name: &str, payload: &[u8]) -> (Result<u64, RestoreError>, u64) {
        let path = dir.join(name);
        let stream = crate::store::compression::chunked(payload, 64 << 10);
        let got = write_verified(stream, &path, "Full-x", false).await;
        (got, std::fs::metadata(&path).map_or(0, |m| m.len()))
    }

    /// 3 GiB of zeros gzip'd to 15 MB, named `Full-…gz`, wrote 2 GiB into the data directory's
    /// volume before its hash failed: bbolt's meta pages, in the first pages, say it is none.
    /// Here with the zeros' true hash, so nothing but the meta pages can refuse them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_that_is_no_bbolt_database_is_refused_before_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let garbage: Vec<u8> = (0..8u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut both_torn = database(4096);
        both_torn[40] ^= 1;
        both_torn[4096 + 40] ^= 1;
        for (name, db) in [
            ("zeros", vec![0u8; 8 << 20]),
            ("garbage", garbage),
            ("both-metas-torn", both_torn),
        ] {
            let (got, written) = fetched(dir.path(), name, &sealed(db)).await;
            let e = got.unwrap_err();
            assert_eq!(e.corrupt_snapshot(), Some("Full-x"), "{name}: {e}");
            assert!(e.to_string().contains("meta page"), "{name}: {e}");
            assert_eq!(written, 0, "{name}: bytes written before the refusal");
        }
    }

    /// A database followed by more than its meta page declares (its pages and etcd's hash), or
    /// shorter than that, is refused: the bytes beyond are never written. One torn meta page is
    /// legal (bbolt uses the other one), whatever the page size.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_beyond_what_its_meta_pages_declare_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(4096);
        let declared = db.len() as u64 + 32;
        let mut junk = db.clone();
        junk.extend_from_slice(&vec![0xA5; 1 << 20]);
        let (got, written) = fetched(dir.path(), "junk", &sealed(junk)).await;
        let e = got.unwrap_err();
        assert_eq!(e.corrupt_snapshot(), Some("Full-x"), "{e}");
        assert!(e.to_string().contains("declares"), "{e}");
        assert!(
            written <= declared,
            "{written} bytes written, {declared} declared"
        );
        let short = db[..db.len() - 4096].to_vec();
        let (got, _) = fetched(dir.path(), "short", &sealed(short)).await;
        let e = got.unwrap_err();
        assert!(e.to_string().contains("declares"), "{e}");

        let (got, written) = fetched(dir.path(), "exact", &sealed(db.clone())).await;
        assert_eq!((got.unwrap(), written), (declared, declared));
        for page_size in [512, 4096, 16384] {
            let mut torn = database(page_size);
            torn[40] ^= 1;
            let len = torn.len() as u64 + 32;
            let (got, _) = fetched(dir.path(), &format!("torn-{page_size}"), &sealed(torn)).await;
            assert_eq!(got.unwrap(), len, "page size {page_size}");
        }
    }

    /// A data directory that is a symbolic link (here to an empty directory) cannot be replaced
    /// by the restored one (rename(2) will not put a directory over a link): the restore failed
    /// only after fetching and writing everything. It is refused first, naming the path.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_data_dir_that_is_a_symlink_is_refused_before_anything_is_fetched() {
        use crate::store::{Codec, Kind};
        let dir = tempfile::tempdir().unwrap();
        let volume = dir.path().join("volume");
        std::fs::create_dir(&volume).unwrap();
        let data = dir.path().join("data");
        std::os::unix::fs::symlink(&volume, &data).unwrap();
        let store = SnapshotStore::new(
            std::sync::Arc::new(object_store::memory::InMemory::new()),
            "p",
        );
        let full = store.new_snapshot(Kind::Full, 0, 10, Codec::None, false);
        store
            .put_bytes(&full, sealed(database(4096)).into())
            .await
            .unwrap();
        for force in [false, true] {
            let mut opts = RestoreOptions::scratch(&data, None, 1);
            opts.force = force;
            let e = restore(&store, &opts).await.unwrap_err().to_string();
            assert!(
                e.contains("symbolic link") && e.contains(&data.display().to_string()),
                "{e}"
            );
            let mut left: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            left.sort();
            assert_eq!(left, ["data", "volume"], "nothing written beside it");
            assert!(std::fs::read_dir(&volume).unwrap().next().is_none());
        }
    }

    #[test]
    fn install_moves_the_old_directory_aside_never_deletes_it() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("data");
        let part = dir.path().join("data.part");
        std::fs::create_dir_all(&target).unwrap();
        std::fs::write(target.join("old"), b"x").unwrap();
        std::fs::create_dir_all(&part).unwrap();
        std::fs::write(part.join("new"), b"y").unwrap();
        assert!(matches!(
            install(&part, &target, false),
            Err(RestoreError::TargetNotEmpty(_))
        ));
        let aside = install(&part, &target, true).unwrap().unwrap();
        assert!(target.join("new").is_file());
        assert!(aside.join("old").is_file());
        assert!(!part.exists());
        // An empty target is simply replaced.
        let empty = dir.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        std::fs::create_dir_all(&part).unwrap();
        assert_eq!(install(&part, &empty, false).unwrap(), None);
    }
}
