//! How a restore builds the data directory from the full snapshot and its deltas: one of three
//! strategies, chosen by [`choose`] (pure) from etcd's version, the options and the chain before
//! anything is fetched, and a fallback; one function each. Every one leaves the result in `part`,
//! not yet synced (the caller syncs it once and moves it into place), and what it did is turned
//! into the report in one place ([`build`]).
//!
//! - [`Strategy::MemberDir`] (etcd 3.4 to 3.6): the member directory written here as the
//!   release's own tool writes it ([`member_dir`]), its database the fetched snapshot patched in
//!   place with the new membership, the deltas, a point in time and a bump ([`direct`]), its
//!   revision read back from the file. No etcd runs, and no tool.
//! - [`Strategy::ToolOnly`] (other releases, nothing to write into the database): the release's
//!   tool restores the snapshot as fetched.
//! - [`Strategy::DirectThenTool`] (other releases): the deltas, a point in time or a bump written
//!   into the fetched snapshot, the release's tool restores the result, and a temporary etcd
//!   checks its revision.
//! - The fallback of both writing strategies, for deltas the database cannot take directly
//!   ([`direct::Outcome::Unsupported`]): the snapshot restored by the tool and the deltas replayed
//!   through a temporary etcd ([`Job::replay_through_etcd`]), unless an option needs them written
//!   ([`Unwritable::Refuse`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use tracing::Instrument as _;

use super::direct::{self, Outcome};
use super::member_dir::{self, Cluster, Release};
use super::{
    DbHash, EtcdTools, MemberParams, Replay, RestoreError, RestoreOptions, RevisionBump, StepExt,
    TempEtcd,
};
use crate::store::{Snapshot, SnapshotStore};

/// How a restore builds the data directory ([`choose`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Strategy {
    /// A release whose tool is kept, and nothing to write into the database: the tool restores
    /// the snapshot as fetched.
    ToolOnly,
    /// etcd 3.4 to 3.6: the member directory and its database written here, as `release`'s tool
    /// writes them.
    MemberDir {
        release: Release,
        unwritable: Unwritable,
    },
    /// A release whose tool is kept: the deltas (a point in time, a bump) written into the
    /// snapshot, which the tool then restores, and a temporary etcd checks.
    DirectThenTool { unwritable: Unwritable },
}

/// What becomes of deltas the database cannot take directly (puts without their create revision
/// and version, a database layout the patcher does not know).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unwritable {
    /// Replayed through a temporary etcd instead.
    ReplayThroughEtcd,
    /// The restore fails: `option` is applied to the database as it is written.
    Refuse { option: &'static str },
}

/// Chooses how to restore (pure): etcd 3.4 to 3.6 get their member directory written here;
/// other releases keep their tool, which restores the snapshot as fetched unless something must
/// be written into it first. A point in time is checked against the database's own revision and
/// a bump is written into it, so both need the database written even without deltas. Whether the
/// cluster has several members changes where a temporary etcd runs ([`TempSite`]), not this.
pub(super) fn choose(
    version: (u32, u32, u32),
    opts: &RestoreOptions,
    deltas: &[Snapshot],
) -> Strategy {
    let unwritable = match (opts.to, opts.bump.by) {
        (Some(_), _) => Unwritable::Refuse {
            option: "a point-in-time restore",
        },
        (None, 1..) => Unwritable::Refuse {
            option: "a revision bump",
        },
        (None, 0) => Unwritable::ReplayThroughEtcd,
    };
    match Release::of(version) {
        Some(release) => Strategy::MemberDir {
            release,
            unwritable,
        },
        None if deltas.is_empty() && opts.to.is_none() && opts.bump == RevisionBump::default() => {
            Strategy::ToolOnly
        }
        None => Strategy::DirectThenTool { unwritable },
    }
}

/// How the deltas were applied, as reported: with none there is nothing to tell, whichever
/// strategy built the directory.
fn replay_of(deltas: &[Snapshot], through_etcd: bool) -> Replay {
    match (deltas.is_empty(), through_etcd) {
        (true, _) => Replay::NoDeltas,
        (false, true) => Replay::ThroughEtcd,
        (false, false) => Replay::Direct,
    }
}

/// What [`build`] made.
pub(super) struct Built {
    pub events: u64,
    pub revision: i64,
    pub etcd_revision: i64,
    pub last_event_time: Option<chrono::DateTime<chrono::Utc>>,
    pub replay_time: std::time::Duration,
    pub replay: Replay,
}

/// What one strategy made.
struct Applied {
    events: u64,
    revision: i64,
    etcd_revision: i64,
    last_event_time: Option<chrono::DateTime<chrono::Utc>>,
    replay_time: std::time::Duration,
    /// The deltas were replayed through a temporary etcd.
    through_etcd: bool,
}

/// What a writing strategy made of the deltas.
enum Written {
    Done(Applied),
    /// The database cannot take them directly, for this reason.
    Unsupported(String),
}

/// Builds the restored directory in `part` (not yet synced), `work` being the restore's private
/// scratch directory.
pub(super) async fn build(
    store: &SnapshotStore,
    tools: &EtcdTools,
    opts: &RestoreOptions,
    full: &Snapshot,
    deltas: &[Snapshot],
    part: &Path,
    work: &Path,
) -> Result<Built, RestoreError> {
    let job = Job {
        store,
        tools,
        opts,
        full,
        deltas,
        part,
        work,
    };
    let strategy = choose(tools.binaries.version, opts, deltas);
    tracing::debug!(?strategy, "restore strategy chosen");
    let applied = match strategy {
        Strategy::ToolOnly => job.tool_only().await?,
        Strategy::MemberDir {
            release,
            unwritable,
        } => {
            let written = job.member_dir(release).await?;
            job.or_fallback(written, unwritable).await?
        }
        Strategy::DirectThenTool { unwritable } => {
            let written = job.direct_then_tool().await?;
            job.or_fallback(written, unwritable).await?
        }
    };
    Ok(Built {
        events: applied.events,
        revision: applied.revision,
        etcd_revision: applied.etcd_revision,
        last_event_time: applied.last_event_time,
        replay_time: applied.replay_time,
        replay: replay_of(deltas, applied.through_etcd),
    })
}

/// Where a temporary etcd runs on a restored database, and as which member. A temporary etcd
/// cannot start as one member of several: those are checked or replayed in a single-member
/// scratch copy, and the tool then restores the result again with the cluster's parameters.
struct TempSite {
    dir: PathBuf,
    member: MemberParams,
    /// In a scratch copy, not in `part`.
    scratch: bool,
}

impl TempSite {
    fn of(opts: &RestoreOptions, part: &Path, work: &Path) -> TempSite {
        match opts.member.is_multi_member() {
            true => TempSite {
                dir: work.join("scratch.etcd"),
                member: MemberParams {
                    name: opts.member.name.clone(),
                    ..MemberParams::default()
                },
                scratch: true,
            },
            false => TempSite {
                dir: part.to_path_buf(),
                member: opts.member.clone(),
                scratch: false,
            },
        }
    }
}

/// One restore's inputs, shared by the strategies.
struct Job<'a> {
    store: &'a SnapshotStore,
    tools: &'a EtcdTools,
    opts: &'a RestoreOptions,
    full: &'a Snapshot,
    deltas: &'a [Snapshot],
    /// The directory built.
    part: &'a Path,
    /// The restore's private scratch directory.
    work: &'a Path,
}

impl Job<'_> {
    /// Where the full snapshot is fetched to.
    fn snapshot_db(&self) -> PathBuf {
        self.work.join("snapshot.db")
    }

    /// Fetches the full snapshot; returns the length of its database (without etcd's hash).
    /// A `kept` snapshot becomes the member's database (patched in place): it is written back
    /// to disk as it arrives.
    async fn fetch(&self, kept: bool) -> Result<u64, RestoreError> {
        let bytes = super::fetch_full(self.store, self.full, &self.snapshot_db(), kept).await?;
        Ok(bytes.saturating_sub(crate::snapshot::delta::HASH_LEN as u64))
    }

    /// [`Strategy::ToolOnly`]. Without deltas the revision is the snapshot's (reading it would
    /// need an etcd).
    async fn tool_only(&self) -> Result<Applied, RestoreError> {
        self.fetch(false).await?;
        self.tools
            .restore_db(
                &self.snapshot_db(),
                DbHash::Appended,
                self.part,
                &self.opts.member,
            )
            .await
            .step("restoring the full snapshot")?;
        Ok(Applied {
            events: 0,
            revision: self.full.last_revision,
            etcd_revision: self.full.last_revision,
            last_event_time: None,
            replay_time: std::time::Duration::ZERO,
            through_etcd: false,
        })
    }

    /// [`Strategy::MemberDir`]: the cluster's ids are derived before anything is fetched.
    async fn member_dir(&self, release: Release) -> Result<Written, RestoreError> {
        let cluster = Cluster::from_params(&self.opts.member)
            .map_err(RestoreError::MemberDir)
            .step("deriving the cluster's ids")?;
        let db_len = self.fetch(true).await?;
        member_dir::write(self.part, &cluster, release)
            .map_err(RestoreError::MemberDir)
            .step("writing the member directory")?;
        let written = member_dir::db_path(self.part);
        let membership = direct::Membership::of(&cluster, release);
        let outcome = self
            .write_deltas(db_len, &written, Some(membership))
            .await?;
        if let Written::Done(applied) = &outcome {
            check_written_revision(&written, applied.etcd_revision).await?;
        }
        Ok(outcome)
    }

    /// [`Strategy::DirectThenTool`]: etcd itself must open the result and agree on the
    /// revision before it is used.
    async fn direct_then_tool(&self) -> Result<Written, RestoreError> {
        let db_len = self.fetch(false).await?;
        let written = self.work.join("with-deltas.db");
        let outcome = self.write_deltas(db_len, &written, None).await?;
        let Written::Done(applied) = &outcome else {
            return Ok(outcome);
        };
        let site = TempSite::of(self.opts, self.part, self.work);
        self.tools
            .restore_db(&written, DbHash::None, &site.dir, &site.member)
            .await
            .step("restoring the database with the deltas")?;
        check_in_temp_etcd(
            self.tools,
            &site.dir,
            &site.member.name,
            self.work,
            applied.etcd_revision,
        )
        .await?;
        if site.scratch {
            self.tools
                .restore_db(&written, DbHash::None, self.part, &self.opts.member)
                .await
                .step("restoring the database with the cluster's parameters")?;
        }
        Ok(outcome)
    }

    /// Writes the deltas (the point in time, the bump, the `membership`) into the fetched
    /// snapshot, moved to `written`, and checks the revision it ends at.
    async fn write_deltas(
        &self,
        db_len: u64,
        written: &Path,
        membership: Option<direct::Membership>,
    ) -> Result<Written, RestoreError> {
        let (first, last) = revision_range(self.deltas);
        let span = tracing::info_span!(
            "write_deltas",
            deltas = self.deltas.len(),
            first_revision = first,
            last_revision = last
        );
        let started = Instant::now();
        let plan = direct::Plan {
            until: self.opts.to,
            bump: self.opts.bump,
            membership,
        };
        let outcome = direct::write(
            self.store,
            self.deltas,
            self.opts.parallel_fetch.max(1),
            &self.snapshot_db(),
            db_len,
            written,
            plan,
        )
        .instrument(span.clone())
        .await
        .step("writing the deltas into the database")?;
        let write_time = started.elapsed();
        let (events, revision, restored, etcd_revision, last_event_time) = match outcome {
            Outcome::Done {
                events,
                revision,
                restored,
                etcd_revision,
                last_event_time,
            } => (events, revision, restored, etcd_revision, last_event_time),
            Outcome::Unsupported(reason) => return Ok(Written::Unsupported(reason)),
        };
        span.in_scope(|| {
            super::check_final_revision(revision, restored, self.deltas, self.opts.to)
                .step("checking the final revision")?;
            tracing::info!(
                events,
                revision,
                etcd_revision,
                seconds = write_time.as_secs_f64(),
                events_per_second = events as f64 / write_time.as_secs_f64().max(1e-9),
                "deltas written into the database"
            );
            Ok::<_, RestoreError>(())
        })?;
        Ok(Written::Done(Applied {
            events,
            revision,
            etcd_revision,
            last_event_time,
            replay_time: write_time,
            through_etcd: false,
        }))
    }

    /// What a writing strategy made, or its fallback: deltas the database cannot take are
    /// replayed through a temporary etcd unless an option needs them written.
    async fn or_fallback(
        &self,
        written: Written,
        unwritable: Unwritable,
    ) -> Result<Applied, RestoreError> {
        let reason = match written {
            Written::Done(applied) => return Ok(applied),
            Written::Unsupported(reason) => reason,
        };
        if let Unwritable::Refuse { option } = unwritable {
            return Err(RestoreError::NeedsDirect { option, reason })
                .step("writing the deltas into the database");
        }
        let (first, last) = revision_range(self.deltas);
        let span = tracing::info_span!(
            "replay_deltas",
            deltas = self.deltas.len(),
            first_revision = first,
            last_revision = last
        );
        span.in_scope(|| {
            tracing::warn!(
                %reason,
                "cannot write these deltas into the database directly; replaying them \
                 through a temporary etcd instead"
            )
        });
        // A member directory written before the patch gave up.
        super::remove_if_exists(self.part).step("removing the member directory written")?;
        self.replay_through_etcd().instrument(span).await
    }

    /// The fallback: the full snapshot (as fetched: a patch that gives up leaves it so) restored
    /// by the tool, a temporary etcd on it, and every delta replayed through it in transactions
    /// ([`super::replay`]).
    async fn replay_through_etcd(&self) -> Result<Applied, RestoreError> {
        let (tools, opts, db) = (self.tools, self.opts, self.snapshot_db());
        let site = TempSite::of(opts, self.part, self.work);
        tools
            .restore_db(&db, DbHash::Appended, &site.dir, &site.member)
            .await
            .step("restoring the full snapshot")?;
        let _ = std::fs::remove_file(&db);

        let temp = TempEtcd::start(
            tools,
            &site.dir,
            &site.member.name,
            self.work.join("temp-etcd.log"),
        )
        .await
        .step("starting the temporary etcd")?;
        let replay_started = Instant::now();
        let replayed =
            super::replay_all(self.store, &temp, self.deltas, opts.parallel_fetch.max(1)).await;
        let replay_time = replay_started.elapsed();
        let (applied, revision) = match replayed {
            Ok(r) => r,
            Err(e) => {
                let _ = temp.stop().await;
                return Err(e);
            }
        };
        if site.scratch {
            let snap = self.work.join("replayed.db");
            let saved = super::snapshot_to_file(&temp.client_url, &snap)
                .await
                .step("snapshotting the replayed etcd");
            temp.stop().await.step("stopping the temporary etcd")?;
            saved?;
            tools
                .restore_db(&snap, DbHash::Appended, self.part, &opts.member)
                .await
                .step("restoring the replayed snapshot with the cluster's parameters")?;
        } else {
            temp.stop().await.step("stopping the temporary etcd")?;
        }
        Ok(Applied {
            events: applied,
            revision,
            etcd_revision: revision,
            last_event_time: None,
            replay_time,
            through_etcd: true,
        })
    }
}

/// Reads the revision etcd will start at from the written database `db` and checks it is
/// `expected`; makes the file private, as etcd's tools do.
#[tracing::instrument(name = "check_written_revision", skip_all, fields(expected = expected))]
async fn check_written_revision(db: &Path, expected: i64) -> Result<(), RestoreError> {
    use std::os::unix::fs::PermissionsExt;
    let path = db.to_path_buf();
    let seen = tokio::task::spawn_blocking(move || {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        direct::file_revision(&path).map_err(|e| std::io::Error::other(e.to_string()))
    })
    .await
    .map_err(|cause| RestoreError::Task {
        what: "reading the written database",
        cause,
    })?
    .map_err(|e| RestoreError::io(db, e))
    .step("reading the restored revision")?;
    if seen != expected {
        return Err(RestoreError::WrittenRevision {
            path: db.display().to_string(),
            seen,
            expected,
        })
        .step("checking the final revision");
    }
    tracing::info!("the written database is at the expected revision");
    Ok(())
}

/// Starts a temporary etcd on the restored `data_dir` and checks it opens the database at
/// `expected`: etcd itself must agree before the result is used.
#[tracing::instrument(name = "temp_etcd_check", skip_all, fields(expected = expected))]
async fn check_in_temp_etcd(
    tools: &EtcdTools,
    data_dir: &Path,
    name: &str,
    work: &Path,
    expected: i64,
) -> Result<(), RestoreError> {
    let temp = TempEtcd::start(tools, data_dir, name, work.join("temp-etcd.log"))
        .await
        .step("starting the temporary etcd")?;
    let seen = async {
        let mut client = etcd_client::Client::connect([&temp.client_url], None)
            .await
            .map_err(RestoreError::Etcd)?;
        super::current_revision(&mut client).await
    }
    .await;
    temp.stop().await.step("stopping the temporary etcd")?;
    let seen = seen.step("reading the restored revision")?;
    if seen != expected {
        return Err(RestoreError::RevisionMismatch { seen, expected })
            .step("checking the final revision");
    }
    tracing::info!("etcd opened the restored database at the expected revision");
    Ok(())
}

/// The revisions the deltas cover: the first one's start and the last one's end.
fn revision_range(deltas: &[Snapshot]) -> (i64, i64) {
    (
        deltas.first().map_or(0, |d| d.start_revision),
        deltas.last().map_or(0, |d| d.last_revision),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::layout::Target;
    use crate::store::{Codec, Kind};

    fn options(to: Option<Target>, bump: RevisionBump, multi: bool) -> RestoreOptions {
        let mut opts = RestoreOptions::scratch(Path::new("/restore/data"), None, 1);
        opts.to = to;
        opts.bump = bump;
        if multi {
            opts.member.initial_cluster = "a=http://a:2380,b=http://b:2380".into();
            opts.member.name = "a".into();
            opts.member.initial_advertise_peer_urls = "http://a:2380".into();
        }
        opts
    }

    fn deltas(n: i64) -> Vec<Snapshot> {
        let at = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        (0..n)
            .map(|i| Snapshot::new("", Kind::Incr, 11 + i, 11 + i, at, Codec::Gzip, false))
            .collect()
    }

    const PIT: &str = "a point-in-time restore";
    const BUMP: &str = "a revision bump";

    /// Examples, one per rule.
    #[test]
    fn strategies() {
        let none = RevisionBump::default();
        let bump = RevisionBump {
            by: 1000,
            mark_compacted: true,
        };
        let to = Some(Target::Revision(12));
        let replay = Unwritable::ReplayThroughEtcd;
        let refuse = |option| Unwritable::Refuse { option };
        let v35 = |unwritable| Strategy::MemberDir {
            release: Release::V35,
            unwritable,
        };
        let direct = |unwritable| Strategy::DirectThenTool { unwritable };
        let cases = [
            // (version, to, bump, deltas, expected)
            ((3, 5, 17), None, none, 0, v35(replay)),
            ((3, 5, 17), None, none, 2, v35(replay)),
            ((3, 5, 17), to, none, 2, v35(refuse(PIT))),
            ((3, 5, 17), None, bump, 0, v35(refuse(BUMP))),
            ((3, 5, 17), to, bump, 0, v35(refuse(PIT))),
            (
                (3, 4, 34),
                None,
                none,
                1,
                Strategy::MemberDir {
                    release: Release::V34,
                    unwritable: replay,
                },
            ),
            ((3, 6, 5), None, none, 1, v35(replay)),
            // Releases whose tool is kept.
            ((3, 7, 0), None, none, 0, Strategy::ToolOnly),
            ((3, 3, 27), None, none, 2, direct(replay)),
            ((3, 7, 0), to, none, 0, direct(refuse(PIT))),
            ((3, 7, 0), None, bump, 0, direct(refuse(BUMP))),
            // A compaction mark alone is written too, but needs no refusal.
            (
                (3, 7, 0),
                None,
                RevisionBump {
                    by: 0,
                    mark_compacted: true,
                },
                0,
                direct(replay),
            ),
        ];
        for (version, to, bump, n, expected) in cases {
            assert_eq!(
                choose(version, &options(to, bump, false), &deltas(n)),
                expected,
                "{version:?} to={to:?} bump={bump:?} deltas={n}"
            );
        }
    }

    /// Every combination of the inputs the choice reads: the release family, a target (none,
    /// a revision, a time), a bump (none, a mark alone, a bump, a marked bump), one member or
    /// several, deltas or none.
    #[test]
    fn every_combination_gets_the_one_strategy_its_rules_give() {
        let versions = [
            ((3, 3, 27), None),
            ((3, 4, 0), Some(Release::V34)),
            ((3, 4, 34), Some(Release::V34)),
            ((3, 5, 0), Some(Release::V35)),
            ((3, 5, 21), Some(Release::V35)),
            ((3, 6, 5), Some(Release::V35)),
            ((3, 7, 0), None),
            ((4, 0, 0), None),
        ];
        let time = chrono::DateTime::from_timestamp(1_700_000_100, 0).unwrap();
        let targets = [None, Some(Target::Revision(12)), Some(Target::Time(time))];
        let bumps =
            [(0, false), (0, true), (1000, false), (1000, true)].map(|(by, mark)| RevisionBump {
                by,
                mark_compacted: mark,
            });
        let mut seen = std::collections::HashSet::new();
        for (version, release) in versions {
            for to in targets {
                for bump in bumps {
                    for multi in [false, true] {
                        for n in [0, 3] {
                            let got = choose(version, &options(to, bump, multi), &deltas(n));
                            let unwritable = match (to, bump.by) {
                                (Some(_), _) => Unwritable::Refuse { option: PIT },
                                (None, 0) => Unwritable::ReplayThroughEtcd,
                                (None, _) => Unwritable::Refuse { option: BUMP },
                            };
                            let nothing_to_write =
                                n == 0 && to.is_none() && !bump.mark_compacted && bump.by == 0;
                            let expected = match (release, nothing_to_write) {
                                (Some(release), _) => Strategy::MemberDir {
                                    release,
                                    unwritable,
                                },
                                (None, true) => Strategy::ToolOnly,
                                (None, false) => Strategy::DirectThenTool { unwritable },
                            };
                            assert_eq!(
                                got, expected,
                                "{version:?} to={to:?} bump={bump:?} multi={multi} deltas={n}"
                            );
                            seen.insert(format!("{got:?}"));
                        }
                    }
                }
            }
        }
        // Every strategy is reachable with each fallback it has: the member directory of two
        // releases and the tool after a write, with three fallbacks each, and the tool alone.
        assert_eq!(seen.len(), 2 * 3 + 3 + 1, "{seen:?}");
    }

    /// With no deltas the report says so, whichever strategy built the directory (a bumped
    /// restore without deltas said `Direct` on releases whose tool is kept, `NoDeltas` on 3.4
    /// to 3.6).
    #[test]
    fn the_report_says_no_deltas_whichever_strategy_ran() {
        for through_etcd in [false, true] {
            assert_eq!(replay_of(&[], through_etcd), Replay::NoDeltas);
        }
        assert_eq!(replay_of(&deltas(1), false), Replay::Direct);
        assert_eq!(replay_of(&deltas(1), true), Replay::ThroughEtcd);
    }

    #[test]
    fn a_temporary_etcd_runs_in_a_scratch_copy_only_for_several_members() {
        let (part, work) = (Path::new("/d.part"), Path::new("/d.work"));
        let one = TempSite::of(&options(None, RevisionBump::default(), false), part, work);
        assert_eq!((one.dir.as_path(), one.scratch), (part, false));
        let several = TempSite::of(&options(None, RevisionBump::default(), true), part, work);
        assert_eq!(
            (several.dir, several.scratch),
            (work.join("scratch.etcd"), true)
        );
        assert_eq!(several.member.name, "a");
        assert!(!several.member.is_multi_member());
    }
}
