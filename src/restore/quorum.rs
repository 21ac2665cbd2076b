//! `quorum-restore`: a one-member cluster rebuilt from the freshest surviving member's data
//! directory after a majority of the members is lost for good.
//!
//! Reviving a minority can lose writes a cut-off majority acknowledged, so every step refuses
//! unless it is sure: the member list (read from this member's database) is probed for
//! `lost_for` and a majority must stay unreachable the whole time; this member's etcd must be
//! stopped (its database lock free, its URLs silent); a store that says the cluster handed off
//! refuses it ([`crate::owner::handoff::may_revive`]). Among the survivors' data directories the
//! one with the highest committed raft index, read from its WAL (the last hard state, checksums
//! checked) and its database (`meta/consistent_index`), is chosen; survivors of different
//! clusters, or whose logs disagree at an index both committed, are an error.
//!
//! The chosen directory is copied, never changed: etcd itself runs once on the copy with
//! `--force-new-cluster` (which keeps the entries up to the commit index and drops the other
//! members), so the semantics are etcd's, not a rewrite of raft state by hand. With a revision
//! bump, or when the survivor is another member's directory, the forced member is snapshotted
//! and restored by [`super::restore`] as this member, with `restore`'s bump and compaction
//! mark. Only then is this member's directory renamed aside
//! (`<data-dir>.before-quorum-restore-<unix-time>`) and the result renamed into its place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::datadir::{self, DbLock};
use super::member_dir;
use super::wal::{self, WalError, WalState};
use super::{MemberParams, RestoreError, RestoreOptions, RevisionBump, sibling};
use crate::config::Validation;
use crate::etcd::membership::quorum;
use crate::etcd::process::{EtcdBinaries, MemberSpec, ProcessError};
use crate::owner::handoff::{self, HandOffObjects, Refusal};
use crate::store::{SnapshotStore, layout};

/// How long a forced member has to become healthy.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a forced member has to stop after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one TCP probe waits.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why quorum-restore refused or failed. Nothing is overwritten in any case.
#[derive(Debug, thiserror::Error)]
pub enum QuorumError {
    /// The directory does not hold an etcd member.
    #[error("{path} is not an etcd data directory: {reason}")]
    NotEtcd {
        /// The directory.
        path: String,
        /// What is missing.
        reason: String,
    },
    /// Its WAL does not read.
    #[error("{path}: {source}")]
    Wal {
        /// The data directory.
        path: String,
        /// Why.
        #[source]
        source: WalError,
    },
    /// Its database does not read.
    #[error("{path}: the database {reason}")]
    Database {
        /// The data directory.
        path: String,
        /// Why.
        reason: String,
    },
    /// This member's etcd (or another process) uses the directory.
    #[error("{path} is in use: {reason}; stop this member's etcd first")]
    Running {
        /// The data directory.
        path: String,
        /// What shows it.
        reason: String,
    },
    /// Two survivors cannot both be this cluster's.
    #[error("the survivors {a} and {b} disagree: {reason}")]
    Disagree {
        /// One.
        a: String,
        /// The other.
        b: String,
        /// How.
        reason: String,
    },
    /// This member is not in its own member list.
    #[error("{path}: member {id:x} is not in its own member list ({members})")]
    NotAMember {
        /// The data directory.
        path: String,
        /// Its member id.
        id: u64,
        /// The list.
        members: String,
    },
    /// Quorum is not lost.
    #[error("refusing: quorum is not lost: {reason}")]
    NotLost {
        /// What is reachable.
        reason: String,
    },
    /// The cluster handed off.
    #[error("{0}")]
    HandOff(Refusal),
    /// The store cannot be read.
    #[error("reading the store {location}: {reason}")]
    Store {
        /// The store.
        location: String,
        /// Why.
        reason: String,
    },
    /// The survivor holds less than the store.
    #[error(
        "refusing: the survivor {path} serves revision {revision}, behind the store's newest snapshot {snapshot} at revision {store_revision}: the store is the better source, use `etcd-warden restore` (or --force to rebuild from the survivor anyway)"
    )]
    BehindStore {
        /// The survivor.
        path: String,
        /// Its revision.
        revision: i64,
        /// The store's newest snapshot.
        snapshot: String,
        /// Its revision.
        store_revision: i64,
    },
    /// Running etcd on the copy failed.
    #[error("etcd --force-new-cluster on the copy {path}: {reason}")]
    Forced {
        /// The copy.
        path: String,
        /// Why.
        reason: String,
    },
    /// Restoring the forced member as this member failed.
    #[error("rebuilding {path} with the revision bump: {source}")]
    Restore {
        /// Where.
        path: String,
        /// Why (boxed: a restore's error is large, and every other variant small).
        #[source]
        source: Box<RestoreError>,
    },
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On what.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> QuorumError + use<> {
    let path = path.display().to_string();
    move |source| QuorumError::Io { what, path, source }
}

/// One member as a data directory's database lists it (`members` bucket).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct MemberRecord {
    /// Its id.
    pub id: u64,
    /// Its name (empty until it published it).
    #[serde(default)]
    pub name: String,
    /// Its peer URLs.
    #[serde(rename = "peerURLs", default)]
    pub peer_urls: Vec<String>,
    /// Its client URLs (empty until it published them).
    #[serde(rename = "clientURLs", default)]
    pub client_urls: Vec<String>,
    /// A learner does not vote.
    #[serde(rename = "isLearner", default)]
    pub is_learner: bool,
}

impl MemberRecord {
    /// `name (id)` for messages.
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            format!("{:x}", self.id)
        } else {
            format!("{} ({:x})", self.name, self.id)
        }
    }
}

/// What a survivor's data directory holds, read without etcd.
#[derive(Debug, Clone)]
pub struct Survivor {
    /// The data directory.
    pub path: PathBuf,
    /// Its WAL's state.
    pub wal: WalState,
    /// The last raft index applied to its database.
    pub consistent_index: u64,
    /// Its database's revision (etcd may apply a few WAL entries more on start).
    pub revision: i64,
    /// Its member list.
    pub members: Vec<MemberRecord>,
}

impl Survivor {
    /// The highest raft index it knows committed: the WAL's hard state, its snapshot, or the
    /// database's applied index, whichever is highest.
    pub fn committed(&self) -> u64 {
        self.wal.committed().max(self.consistent_index)
    }

    /// Its own member record.
    pub fn own(&self) -> Option<&MemberRecord> {
        self.members.iter().find(|m| m.id == self.wal.node_id)
    }
}

/// Reads `dir` as an etcd member's data directory: its WAL (every checksum), its database's
/// revision, applied index and member list.
pub fn inspect(dir: &Path) -> Result<Survivor, QuorumError> {
    let path = dir.display().to_string();
    let not_etcd = |reason: &str| QuorumError::NotEtcd {
        path: path.clone(),
        reason: reason.into(),
    };
    if !dir.is_dir() {
        return Err(not_etcd("no such directory"));
    }
    for sub in ["member/wal", "member/snap"] {
        if !dir.join(sub).is_dir() {
            return Err(not_etcd(&format!("no {sub} directory")));
        }
    }
    let wal = wal::read_state(&dir.join("member/wal")).map_err(|source| match source {
        WalError::NoSegment(_) => not_etcd("no WAL segment (*.wal) in member/wal"),
        source => QuorumError::Wal {
            path: path.clone(),
            source,
        },
    })?;
    if wal.node_id == 0 || wal.cluster_id == 0 {
        return Err(not_etcd("its WAL names no member or cluster"));
    }
    let db = member_dir::db_path(dir);
    let len = std::fs::metadata(&db)
        .map_err(|e| not_etcd(&format!("member/snap/db: {e}")))?
        .len();
    let database = |reason: String| QuorumError::Database {
        path: path.clone(),
        reason,
    };
    let (revision, consistent_index) =
        datadir::database(&db, len, Validation::Sanity).map_err(|e| database(e.to_string()))?;
    let members = read_members(&db, len).map_err(database)?;
    Ok(Survivor {
        path: dir.to_path_buf(),
        wal,
        consistent_index,
        revision,
        members,
    })
}

/// The `members` bucket's records.
fn read_members(db: &Path, len: u64) -> Result<Vec<MemberRecord>, String> {
    let reader = super::bolt::Reader::open(db, len).map_err(|e| e.to_string())?;
    let buckets = reader.buckets().map_err(|e| e.to_string())?;
    let Some(bucket) = buckets.iter().find(|b| b.name == b"members") else {
        return Err("has no `members` bucket".into());
    };
    let mut members = Vec::new();
    let mut bad = None;
    reader
        .visit(&bucket.root, &mut |_, key, value| {
            match serde_json::from_slice::<MemberRecord>(value) {
                Ok(m) => members.push(m),
                Err(e) => {
                    bad.get_or_insert(format!(
                        "member {} in the `members` bucket does not parse: {e}",
                        String::from_utf8_lossy(key)
                    ));
                }
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    if let Some(bad) = bad {
        return Err(bad);
    }
    if members.is_empty() {
        return Err("lists no member".into());
    }
    Ok(members)
}

/// Fails when `a` and `b` cannot both be survivors of one cluster: different cluster ids, or
/// different terms at an index both hold committed (raft never commits two entries there).
pub fn check_agree(a: &Survivor, b: &Survivor) -> Result<(), QuorumError> {
    let disagree = |reason: String| QuorumError::Disagree {
        a: a.path.display().to_string(),
        b: b.path.display().to_string(),
        reason,
    };
    if a.wal.cluster_id != b.wal.cluster_id {
        return Err(disagree(format!(
            "cluster ids {:x} and {:x}: they are members of different clusters",
            a.wal.cluster_id, b.wal.cluster_id
        )));
    }
    let index = a.committed().min(b.committed());
    if let (Some(ta), Some(tb)) = (a.wal.term_at(index), b.wal.term_at(index))
        && ta != tb
    {
        return Err(disagree(format!(
            "both committed raft index {index}, in term {ta} and in term {tb}: their logs diverge"
        )));
    }
    Ok(())
}

/// The survivor to rebuild from: the highest committed index; at a tie the first listed (this
/// member's own directory comes first).
pub fn choose(survivors: &[Survivor]) -> Option<usize> {
    let best = survivors.iter().map(Survivor::committed).max()?;
    survivors.iter().position(|s| s.committed() == best)
}

/// Whether quorum is lost, from which other voters answered (`reachable`: member id → the URL
/// that answered). This member counts as one that could serve: its etcd is only stopped, so
/// were it started with the reachable ones a quorum would form, and restarting it is the fix.
pub fn decide_lost(
    own: u64,
    members: &[MemberRecord],
    reachable: &BTreeMap<u64, String>,
) -> Result<(), QuorumError> {
    let voters: Vec<&MemberRecord> = members.iter().filter(|m| !m.is_learner).collect();
    let needed = quorum(voters.len());
    let own_votes = usize::from(voters.iter().any(|m| m.id == own));
    let up: Vec<String> = voters
        .iter()
        .filter(|m| m.id != own)
        .filter_map(|m| {
            reachable
                .get(&m.id)
                .map(|url| format!("{} at {url}", m.label()))
        })
        .collect();
    if up.len() + own_votes >= needed {
        return Err(QuorumError::NotLost {
            reason: format!(
                "{} answer{}; with this member that is {} of {} voters, a quorum (of {needed}): start this member's etcd instead",
                up.join(", "),
                if up.len() == 1 { "s" } else { "" },
                up.len() + own_votes,
                voters.len()
            ),
        });
    }
    Ok(())
}

/// `host:port` of a URL, for a TCP probe.
fn authority(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    let host = u.host_str()?;
    let port = u.port_or_known_default()?;
    // An IPv6 host comes in brackets already.
    Some(format!("{host}:{port}"))
}

/// The first of `urls` that accepts a TCP connection. A connection is enough: anything
/// listening where a member listened may be that member, so it counts (fail closed).
async fn first_answering(urls: &[String]) -> Option<String> {
    for url in urls {
        let Some(addr) = authority(url) else { continue };
        if let Ok(Ok(_)) =
            tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(&addr)).await
        {
            return Some(url.clone());
        }
    }
    None
}

fn urls(m: &MemberRecord) -> Vec<String> {
    m.client_urls.iter().chain(&m.peer_urls).cloned().collect()
}

/// Probes every other member every `interval` for `lost_for`; refuses as soon as a quorum
/// (counting this member) answers, or an answering member reports a leader.
async fn wait_lost(
    own: u64,
    members: &[MemberRecord],
    lost_for: Duration,
    interval: Duration,
) -> Result<usize, QuorumError> {
    let started = tokio::time::Instant::now();
    let deadline = started + lost_for;
    let mut probes = 0;
    loop {
        probes += 1;
        let mut reachable = BTreeMap::new();
        for m in members.iter().filter(|m| m.id != own) {
            if let Some(url) = first_answering(&urls(m)).await {
                reachable.insert(m.id, url);
            }
        }
        decide_lost(own, members, &reachable)?;
        // A member that answers may see a quorum this one cannot (a partition): ask it.
        for m in members.iter().filter(|m| reachable.contains_key(&m.id)) {
            for url in &m.client_urls {
                if crate::etcd::process::is_healthy(url, None).await {
                    return Err(QuorumError::NotLost {
                        reason: format!("{} at {url} reports a leader", m.label()),
                    });
                }
            }
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Ok(probes);
        }
        tracing::info!(
            unreachable_for = ?now - started,
            lost_for = ?lost_for,
            reachable = reachable.len(),
            "a majority of the members is unreachable; probing until lost_for has passed"
        );
        tokio::time::sleep(interval.min(deadline - now)).await;
    }
}

/// What to rebuild and how.
#[derive(Debug, Clone)]
pub struct QuorumOptions {
    /// This member's data directory; replaced by the result, the original kept aside.
    pub data_dir: PathBuf,
    /// Other survivors' data directories (copied from their machines), only read.
    pub survivors: Vec<PathBuf>,
    /// This member's name in the rebuilt cluster; default the name in its member record.
    pub name: Option<String>,
    /// Its peer URLs in the rebuilt cluster; default those of its member record.
    pub initial_advertise_peer_urls: Option<String>,
    /// The rebuilt cluster's token, when it is restored ([`RevisionBump`], another survivor).
    pub initial_cluster_token: String,
    /// Where etcd's binaries are.
    pub etcd_bin: Option<PathBuf>,
    /// How long a majority must stay unreachable.
    pub lost_for: Duration,
    /// How often it is probed meanwhile.
    pub probe_interval: Duration,
    /// `restore`'s revision bump and compaction mark.
    pub bump: RevisionBump,
    /// Rebuild from a survivor behind the store's newest snapshot.
    pub force: bool,
}

/// The store to compare with and check for a hand-off.
pub struct StoreCheck<'a> {
    /// The store.
    pub store: &'a SnapshotStore,
    /// Its location, for messages.
    pub location: String,
    /// The owner record's name, for messages (empty without an [owner] section).
    pub owner_record: String,
}

/// How the rebuilt directory was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rebuilt {
    /// etcd `--force-new-cluster` on a copy of this member's directory: the same member id.
    ForceNewCluster,
    /// That, then snapshotted and restored as this member (a bump, another survivor's
    /// directory, or a new name or peer URL).
    Restored,
}

/// The store's newest snapshot against the survivor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreComparison {
    /// The end of its latest chain (the last delta, else the full snapshot).
    pub snapshot: String,
    /// Its revision.
    pub revision: i64,
}

/// What quorum-restore did.
#[derive(Debug, Clone)]
pub struct QuorumReport {
    /// Every survivor read, with its committed index.
    pub survivors: Vec<(PathBuf, u64)>,
    /// The survivor rebuilt from.
    pub chosen: PathBuf,
    /// Its member.
    pub chosen_member: String,
    /// Its committed raft index.
    pub committed: u64,
    /// The revision the forced member served: the survivor's data.
    pub revision: i64,
    /// The revision the rebuilt member starts at (above `revision` with a bump).
    pub etcd_revision: i64,
    /// The members dropped from the cluster.
    pub dropped: Vec<String>,
    /// Where this member's original directory is kept.
    pub kept_at: PathBuf,
    /// How.
    pub rebuilt: Rebuilt,
    /// The store's newest snapshot, when a store was given.
    pub store: Option<StoreComparison>,
    /// Times the members were probed.
    pub probes: usize,
}

impl QuorumReport {
    /// Revisions the survivor holds beyond the store's newest snapshot: what a restore from
    /// the store would have lost.
    pub fn store_would_lose(&self) -> Option<i64> {
        self.store
            .as_ref()
            .map(|s| (self.revision - s.revision).max(0))
    }
}

/// Rebuilds `opts.data_dir` as a one-member cluster from the freshest survivor; see the module
/// documentation for the refusals.
#[tracing::instrument(name = "quorum_restore", skip_all, fields(data_dir = %opts.data_dir.display()))]
pub async fn quorum_restore(
    opts: &QuorumOptions,
    store: Option<StoreCheck<'_>>,
) -> Result<QuorumReport, QuorumError> {
    // Held until the end: etcd cannot open this member's database while it is copied.
    let mut locks = Vec::new();
    let mut survivors = Vec::new();
    for dir in std::iter::once(&opts.data_dir).chain(&opts.survivors) {
        // The lock first: a database etcd is writing may not read consistently.
        match datadir::lock_db(dir) {
            Ok(DbLock::Busy) => {
                return Err(QuorumError::Running {
                    path: dir.display().to_string(),
                    reason: "etcd holds its database's lock".into(),
                });
            }
            Ok(lock) => locks.push(lock),
            Err(reason) => {
                return Err(QuorumError::Running {
                    path: dir.display().to_string(),
                    reason,
                });
            }
        }
        survivors.push(inspect(dir)?);
    }
    for (i, a) in survivors.iter().enumerate() {
        for b in &survivors[i + 1..] {
            check_agree(a, b)?;
        }
    }
    let own = &survivors[0];
    let own_record = own.own().cloned().ok_or_else(|| QuorumError::NotAMember {
        path: own.path.display().to_string(),
        id: own.wal.node_id,
        members: own
            .members
            .iter()
            .map(MemberRecord::label)
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    if let Some(url) = first_answering(&urls(&own_record)).await {
        return Err(QuorumError::Running {
            path: own.path.display().to_string(),
            reason: format!("this member's URL {url} accepts connections"),
        });
    }

    let newest = match &store {
        Some(check) => Some(store_state(check).await?),
        None => None,
    };

    // The membership of the freshest directory is the one that counts, but every survivor's
    // list names the same cluster; this member's is what it would rejoin.
    let probes = wait_lost(
        own.wal.node_id,
        &own.members,
        opts.lost_for,
        opts.probe_interval.max(Duration::from_millis(100)),
    )
    .await?;

    let chosen_at = choose(&survivors).unwrap_or(0);
    let chosen = &survivors[chosen_at];
    let chosen_member = chosen
        .own()
        .map_or_else(|| format!("{:x}", chosen.wal.node_id), MemberRecord::label);
    tracing::info!(
        chosen = %chosen.path.display(),
        committed = chosen.committed(),
        member = %chosen_member,
        "rebuilding from the freshest survivor"
    );

    let name = opts.name.clone().unwrap_or_else(|| own_record.name.clone());
    let peers = opts
        .initial_advertise_peer_urls
        .clone()
        .unwrap_or_else(|| own_record.peer_urls.join(","));
    let same_member =
        chosen_at == 0 && name == own_record.name && same_urls(&peers, &own_record.peer_urls);
    let rebuilt = if same_member && opts.bump == RevisionBump::default() {
        Rebuilt::ForceNewCluster
    } else {
        Rebuilt::Restored
    };

    let work = sibling(&opts.data_dir, ".quorum-restore");
    super::remove_if_exists(&work).map_err(|e| QuorumError::Forced {
        path: work.display().to_string(),
        reason: e.to_string(),
    })?;
    std::fs::create_dir_all(&work).map_err(io("creating", &work))?;
    let outcome = rebuild(opts, chosen, &name, &peers, rebuilt, newest.as_ref(), &work).await;
    let (result, revision, etcd_revision) = match outcome {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&work);
            return Err(e);
        }
    };

    let stamp = chrono::Utc::now().timestamp();
    let kept_at = sibling(&opts.data_dir, &format!(".before-quorum-restore-{stamp}"));
    let installed = install(&result, &opts.data_dir, &kept_at);
    let _ = std::fs::remove_dir_all(&work);
    installed?;
    drop(locks);

    let dropped = chosen
        .members
        .iter()
        .filter(|m| m.id != chosen.wal.node_id)
        .map(MemberRecord::label)
        .collect();
    Ok(QuorumReport {
        survivors: survivors
            .iter()
            .map(|s| (s.path.clone(), s.committed()))
            .collect(),
        chosen: chosen.path.clone(),
        chosen_member,
        committed: chosen.committed(),
        revision,
        etcd_revision,
        dropped,
        kept_at,
        rebuilt,
        store: newest,
        probes,
    })
}

fn same_urls(list: &str, urls: &[String]) -> bool {
    let mut a: Vec<&str> = list.split(',').map(str::trim).collect();
    let mut b: Vec<&str> = urls.iter().map(String::as_str).collect();
    a.sort_unstable();
    b.sort_unstable();
    a == b
}

/// The hand-off rules, then the store's newest snapshot.
async fn store_state(check: &StoreCheck<'_>) -> Result<StoreComparison, QuorumError> {
    let failed = |reason: String| QuorumError::Store {
        location: check.location.clone(),
        reason,
    };
    let objects = HandOffObjects::new(check.store.clone());
    let hold = objects.hold().await.map_err(|e| failed(e.to_string()))?;
    let seen = objects.seen().await.map_err(|e| failed(e.to_string()))?;
    let listing = check
        .store
        .listing()
        .await
        .map_err(|e| failed(e.to_string()))?;
    let sorted = listing.snapshots();
    let the_final = handoff::the_final(&sorted, &seen).map(|s| s.snap_name.clone());
    handoff::may_revive(
        hold.as_ref(),
        the_final.as_deref(),
        &check.location,
        &check.owner_record,
    )
    .map_err(QuorumError::HandOff)?;
    let chain = layout::latest_chain(&sorted);
    Ok(match (chain.delta_snapshots.last(), &chain.full_snapshot) {
        (Some(d), _) => StoreComparison {
            snapshot: d.snap_name.clone(),
            revision: d.last_revision,
        },
        (None, Some(f)) => StoreComparison {
            snapshot: f.snap_name.clone(),
            revision: f.last_revision,
        },
        (None, None) => StoreComparison {
            snapshot: "(none)".into(),
            revision: 0,
        },
    })
}

/// Copies `from` into `to` (created), files and directories only.
fn copy_tree(from: &Path, to: &Path) -> Result<(), QuorumError> {
    std::fs::create_dir_all(to).map_err(io("creating", to))?;
    for entry in std::fs::read_dir(from).map_err(io("reading", from))? {
        let entry = entry.map_err(io("reading", from))?;
        let kind = entry.file_type().map_err(io("reading", &entry.path()))?;
        let dest = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&entry.path(), &dest)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &dest).map_err(io("copying", &entry.path()))?;
        }
    }
    Ok(())
}

/// Builds the one-member directory in `work`; returns it, the survivor's revision and the
/// revision the result starts at.
async fn rebuild(
    opts: &QuorumOptions,
    chosen: &Survivor,
    name: &str,
    peers: &str,
    rebuilt: Rebuilt,
    newest: Option<&StoreComparison>,
    work: &Path,
) -> Result<(PathBuf, i64, i64), QuorumError> {
    let copy = work.join("forced.etcd");
    let (from, to) = (chosen.path.clone(), copy.clone());
    tokio::task::spawn_blocking(move || copy_tree(&from, &to))
        .await
        .map_err(|e| QuorumError::Forced {
            path: copy.display().to_string(),
            reason: format!("the copy stopped: {e}"),
        })??;
    let forced = |reason: String| QuorumError::Forced {
        path: copy.display().to_string(),
        reason,
    };
    let bins = EtcdBinaries::locate(opts.etcd_bin.as_deref()).map_err(|e| forced(e.to_string()))?;
    let member_name = chosen.own().map_or(name, |m| m.name.as_str()).to_owned();
    let mut spec = MemberSpec {
        bootstrap: None,
        extra_args: vec!["--force-new-cluster".into()],
        log: Some(work.join("forced.log")),
        ..MemberSpec::new(member_name, &copy)
    };
    let etcd = spec
        .start(&bins, START_TIMEOUT)
        .await
        .map_err(|e: ProcessError| forced(e.to_string()))?;
    let status = async {
        let mut c = etcd_client::Client::connect([spec.client_url()], None).await?;
        let s = c.status().await?;
        let members = c.member_list().await?.members().len();
        Ok::<_, etcd_client::Error>((c, s.header().map_or(0, |h| h.revision()), members))
    }
    .await;
    let (client, revision, members) = match status {
        Ok(s) => s,
        Err(e) => {
            etcd.kill();
            return Err(forced(format!("reading its status: {e}")));
        }
    };
    if members != 1 {
        etcd.kill();
        return Err(forced(format!(
            "{members} members after --force-new-cluster, not 1"
        )));
    }
    if let Some(s) = newest
        && revision < s.revision
        && !opts.force
    {
        etcd.kill();
        return Err(QuorumError::BehindStore {
            path: chosen.path.display().to_string(),
            revision,
            snapshot: s.snapshot.clone(),
            store_revision: s.revision,
        });
    }
    match rebuilt {
        Rebuilt::ForceNewCluster => {
            stop(&etcd).await;
            Ok((copy, revision, revision))
        }
        Rebuilt::Restored => {
            let store_dir = work.join("store");
            std::fs::create_dir_all(&store_dir).map_err(io("creating", &store_dir))?;
            let backend = object_store::local::LocalFileSystem::new_with_prefix(&store_dir)
                .map_err(|e| forced(format!("a scratch store in {}: {e}", store_dir.display())))?;
            let scratch = SnapshotStore::new(std::sync::Arc::new(backend), "");
            let taken =
                crate::snapshot::take_full(&client, &scratch, crate::store::Codec::None, false)
                    .await;
            stop(&etcd).await;
            taken.map_err(|e| forced(format!("snapshotting the forced member: {e}")))?;
            let target = work.join("restored.etcd");
            let member = MemberParams {
                name: name.to_owned(),
                initial_cluster: peers
                    .split(',')
                    .map(|p| format!("{name}={}", p.trim()))
                    .collect::<Vec<_>>()
                    .join(","),
                initial_cluster_token: opts.initial_cluster_token.clone(),
                initial_advertise_peer_urls: peers.to_owned(),
            };
            let restore_opts = RestoreOptions {
                member,
                bump: opts.bump,
                ..RestoreOptions::scratch(&target, opts.etcd_bin.clone(), 1)
            };
            let report = super::restore(&scratch, &restore_opts)
                .await
                .map_err(|source| QuorumError::Restore {
                    path: target.display().to_string(),
                    source: Box::new(source),
                })?;
            Ok((target, report.revision, report.etcd_revision))
        }
    }
}

/// SIGTERM, so etcd closes its database; a member that does not stop in time is killed (its
/// WAL is synced: the copy stays consistent either way).
async fn stop(etcd: &crate::etcd::process::EtcdProcess) {
    if let Err(e) = etcd.terminate(STOP_TIMEOUT).await {
        tracing::warn!(error = %e, "the forced member did not stop in time; killed");
    }
}

/// Renames `data_dir` to `kept_at`, then `result` to `data_dir`; puts the original back when
/// the second rename fails.
fn install(result: &Path, data_dir: &Path, kept_at: &Path) -> Result<(), QuorumError> {
    std::fs::rename(data_dir, kept_at).map_err(io("keeping the original aside as", kept_at))?;
    if let Err(e) = std::fs::rename(result, data_dir) {
        let _ = std::fs::rename(kept_at, data_dir);
        return Err(io("moving the rebuilt directory to", data_dir)(e));
    }
    if let Some(parent) = data_dir.parent().filter(|p| !p.as_os_str().is_empty())
        && let Ok(d) = std::fs::File::open(parent)
    {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64, name: &str, learner: bool) -> MemberRecord {
        MemberRecord {
            id,
            name: name.into(),
            peer_urls: vec![format!("http://10.0.0.{id}:2380")],
            client_urls: vec![format!("http://10.0.0.{id}:2379")],
            is_learner: learner,
        }
    }

    fn survivor(path: &str, cluster: u64, commit: u64, terms: &[(u64, u64)]) -> Survivor {
        let mut wal = WalState::default();
        wal.node_id = 1;
        wal.cluster_id = cluster;
        wal.commit = commit;
        for (index, term) in terms {
            wal_entry(&mut wal, *index, *term);
        }
        Survivor {
            path: path.into(),
            wal,
            consistent_index: 0,
            revision: 1,
            members: vec![member(1, "m1", false)],
        }
    }

    fn wal_entry(wal: &mut WalState, index: u64, term: u64) {
        wal.entry(index, term);
    }

    #[test]
    fn a_majority_reachable_refuses_counting_this_member() {
        let members = vec![
            member(1, "m1", false),
            member(2, "m2", false),
            member(3, "m3", false),
            member(4, "m4", true),
        ];
        let none = BTreeMap::new();
        assert!(decide_lost(1, &members, &none).is_ok());
        // The learner answering changes nothing: it does not vote.
        let learner = BTreeMap::from([(4, "http://10.0.0.4:2379".to_string())]);
        assert!(decide_lost(1, &members, &learner).is_ok());
        // One voter up: with this member, 2 of 3.
        let one = BTreeMap::from([(2, "http://10.0.0.2:2379".to_string())]);
        let err = decide_lost(1, &members, &one).unwrap_err().to_string();
        assert!(err.contains("m2 (2) at http://10.0.0.2:2379"), "{err}");
        assert!(err.contains("2 of 3 voters"), "{err}");
        // Five voters, one other up: 2 of 5 is no quorum.
        let five: Vec<_> = (1..=5)
            .map(|i| member(i, &format!("m{i}"), false))
            .collect();
        assert!(decide_lost(1, &five, &one).is_ok());
        let two = BTreeMap::from([(2, "a".to_string()), (3, "b".to_string())]);
        assert!(decide_lost(1, &five, &two).is_err());
    }

    #[test]
    fn the_freshest_is_chosen_and_a_tie_keeps_this_member() {
        let a = survivor("/a", 7, 10, &[(10, 2)]);
        let b = survivor("/b", 7, 12, &[(12, 2)]);
        let c = survivor("/c", 7, 12, &[(12, 2)]);
        assert_eq!(choose(&[a.clone(), b.clone(), c.clone()]), Some(1));
        assert_eq!(choose(&[b.clone(), c]), Some(0));
        let mut d = a.clone();
        d.consistent_index = 20;
        assert_eq!(choose(&[a, b, d]), Some(2));
    }

    #[test]
    fn survivors_of_other_clusters_or_diverging_logs_disagree() {
        let a = survivor("/a", 7, 10, &[(1, 1), (10, 2)]);
        let other = survivor("/b", 8, 10, &[(1, 1), (10, 2)]);
        let err = check_agree(&a, &other).unwrap_err().to_string();
        assert!(
            err.contains("/a") && err.contains("/b") && err.contains("different clusters"),
            "{err}"
        );
        let diverged = survivor("/c", 7, 12, &[(1, 1), (10, 3), (12, 3)]);
        let err = check_agree(&a, &diverged).unwrap_err().to_string();
        assert!(
            err.contains("raft index 10") && err.contains("term 2 and in term 3"),
            "{err}"
        );
        let agreeing = survivor("/d", 7, 14, &[(1, 1), (10, 2), (14, 3)]);
        assert!(check_agree(&a, &agreeing).is_ok());
    }

    #[test]
    fn urls_give_their_authority() {
        assert_eq!(
            authority("http://127.0.0.1:2379").as_deref(),
            Some("127.0.0.1:2379")
        );
        assert_eq!(
            authority("https://etcd-0.x:2379").as_deref(),
            Some("etcd-0.x:2379")
        );
        assert_eq!(
            authority("http://[::1]:2380").as_deref(),
            Some("[::1]:2380")
        );
        assert!(same_urls(
            "http://a:1, http://b:2",
            &["http://b:2".into(), "http://a:1".into()]
        ));
    }
}
