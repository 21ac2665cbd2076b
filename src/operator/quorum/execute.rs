//! The executor: observes etcd (through `etcd-client`) and a machine backend, asks the planner,
//! and applies its actions.
//!
//! Every step starts from a fresh observation, so a crash or cancellation between two actions
//! leaves nothing to undo: the next step sees where things stand and continues (a learner added
//! but never started is started, a promoted learner is not promoted twice, a removed member is
//! not removed twice). etcd refuses membership changes for a few seconds after a start or a
//! promotion ("unhealthy cluster", "learner not in sync", "too many learners"); those refusals
//! are retried with backoff, observing again before each attempt, and etcd itself stays the
//! judge of when a learner is in sync.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use etcd_client::{Client, MemberAddOptions};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::etcd::membership::initial_cluster;
use tracing::field::Empty;
use tracing::{Instrument as _, Span, debug, info, warn};

use super::plan::{Action, Condition, MachineState, MemberState, Observed, Plan, Spec, plan};
use crate::operator::metrics::{MemberGauge, Metrics};

/// Errors of a machine backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No machine with that name.
    #[error("machine {0} not found")]
    NotFound(String),
    /// An I/O operation of the backend failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A machine's member could not be started.
    #[error("starting the member of {machine}: {source}")]
    Start {
        /// The machine.
        machine: String,
        /// What running etcd reported.
        #[source]
        source: crate::etcd::process::ProcessError,
    },
    /// The backend itself is unavailable (its API cannot be reached, or it is shutting down);
    /// the next step tries again.
    #[error("machine backend unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Our hook is not put on a machine being deleted that does not carry it: someone took it
    /// off (the administrator's escape hatch), and it stays off.
    #[error("machine {0} is being deleted without our hook; it is not put back")]
    Deleting(String),
    /// Every attempt to change a machine met a concurrent change (409); the next step reads
    /// it again.
    #[error("machine {machine}: still conflicting after {attempts} attempts")]
    Conflict {
        /// The machine.
        machine: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The backend refused the request for good (forbidden, invalid, an object it cannot
    /// read): retrying the same request will not help.
    #[error("{what}: {source}")]
    Rejected {
        /// What was being done.
        what: String,
        /// What the backend answered.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl BackendError {
    /// Whether trying again later may succeed without anyone changing anything.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            BackendError::Unavailable(_) | BackendError::Conflict { .. }
        )
    }
}

/// Errors of one executor step.
#[derive(Debug, thiserror::Error)]
pub enum ExecuteError {
    /// No endpoint answered a member list.
    #[error("no etcd endpoint answered a member list (tried {tried}): {last}")]
    NoEndpoint {
        /// Endpoints tried.
        tried: String,
        /// The last error seen.
        last: String,
    },
    /// An etcd call failed.
    #[error("etcd {op}: {source}")]
    Etcd {
        /// The call.
        op: &'static str,
        /// What etcd-client returned.
        #[source]
        source: etcd_client::Error,
    },
    /// The machine backend failed.
    #[error("machine backend: {0}")]
    Backend(#[from] BackendError),
    /// A member the plan refers to is no longer listed.
    #[error("member {0:x} is no longer in the member list")]
    MemberGone(u64),
}

/// etcd refusals that lift on their own within seconds.
const TRANSIENT: &[&str] = &[
    "unhealthy cluster",
    "not in sync",
    "too many learner",
    "leader changed",
    "request timed out",
    "no leader",
    "timed out",
    "transport error",
];

impl ExecuteError {
    /// Whether retrying after a short wait is expected to succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            ExecuteError::NoEndpoint { .. } | ExecuteError::MemberGone(_) => true,
            ExecuteError::Etcd { source, .. } => is_transient_etcd(source),
            ExecuteError::Backend(e) => e.is_transient(),
        }
    }
}

fn is_transient_etcd(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => {
            // gRPC codes DEADLINE_EXCEEDED (4) and UNAVAILABLE (14).
            let code: i32 = s.code().into();
            matches!(code, 4 | 14) || TRANSIENT.iter().any(|t| s.message().contains(t))
        }
        other => {
            let text = other.to_string();
            TRANSIENT.iter().any(|t| text.contains(t))
        }
    }
}

fn etcd_message(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.message().to_owned(),
        other => other.to_string(),
    }
}

/// How a new member joins: the `--initial-cluster` it starts with (state `existing`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Join {
    /// The new member's name (the machine name).
    pub name: String,
    /// The added member's ID.
    pub member_id: u64,
    /// `name=peerURL,...` of every member including the new one.
    pub initial_cluster: String,
}

/// The seam to whatever hosts members: Kubernetes Machines, or local processes.
///
/// Both backends pass one conformance suite (`tests/machines_conformance.rs`) for `list`,
/// `add_hook` and `release_hook`.
#[async_trait]
pub trait Machines: Send + Sync + 'static {
    /// Every control-plane machine with its deletion state and hook.
    async fn list(&self) -> Result<Vec<MachineState>, BackendError>;
    /// Puts our pre-drain deletion hook on a machine (idempotent). Never puts it back on a
    /// machine being deleted whose hook someone else took off: [`BackendError::Deleting`].
    async fn add_hook(&self, machine: &str) -> Result<(), BackendError>;
    /// Takes our hook, and only ours, off a machine (idempotent).
    async fn release_hook(&self, machine: &str) -> Result<(), BackendError>;
    /// Starts the member of a machine whose learner was just added. Idempotent: a member already
    /// running is left alone and `false` returned.
    ///
    /// Only a backend that runs etcd itself starts members (the local one). On Kubernetes the
    /// platform starts a new machine's etcd (its pod, with the initial cluster taken from the
    /// `etcd-endpoints` ConfigMap), so that backend keeps this default: nothing to do.
    async fn start_member(&self, machine: &str, join: &Join) -> Result<bool, BackendError> {
        let _ = (machine, join);
        Ok(false)
    }
}

/// One member as shown in the status.
#[derive(Debug, Clone, Serialize)]
pub struct MemberStatus {
    /// Member ID in hex (as etcdctl prints it).
    pub id: String,
    /// Member name (empty until started).
    pub name: String,
    /// Peer URLs.
    pub peer_urls: Vec<String>,
    /// Client URLs (empty until started).
    pub client_urls: Vec<String>,
    /// Learner rather than voter.
    pub is_learner: bool,
    /// Answered status without errors and knows a leader.
    pub healthy: bool,
    /// The raft leader.
    pub is_leader: bool,
    /// Knows a leader.
    pub has_leader: bool,
    /// Raft applied index.
    pub applied_index: u64,
}

/// One applied (or failed) action.
#[derive(Debug, Clone, Serialize)]
pub struct ActionRecord {
    /// The action.
    #[serde(flatten)]
    pub action: Action,
    /// Human-readable form.
    pub text: String,
    /// When it finished.
    pub at: DateTime<Utc>,
    /// Error text when it failed.
    pub error: Option<String>,
}

/// Most actions kept in the status history.
const HISTORY: usize = 200;

/// What the operator reports on `/status`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OperatorStatus {
    /// Condition of the last plan (none before the first observation).
    pub condition: Option<Condition>,
    /// Members at the last observation.
    pub members: Vec<MemberStatus>,
    /// Machines at the last observation.
    pub machines: Vec<MachineState>,
    /// The last action applied or attempted.
    pub last_action: Option<ActionRecord>,
    /// The last step's error, cleared by a successful step.
    pub last_error: Option<String>,
    /// Recent actions, oldest first.
    pub history: Vec<ActionRecord>,
}

/// A full observation: the planner's input plus what status and metrics show.
#[derive(Debug, Clone)]
pub struct Observation {
    /// The planner's input.
    pub observed: Observed,
    /// Per-member details.
    pub members: Vec<MemberStatus>,
    /// Client URL of the leader, for membership calls.
    pub leader_client_url: Option<String>,
}

/// Timings of the executor.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Between steps when there was nothing to do.
    pub interval: Duration,
    /// First wait after a failed step; doubles up to `max_backoff`.
    pub min_backoff: Duration,
    /// Longest wait after failed steps.
    pub max_backoff: Duration,
    /// Per etcd request.
    pub request_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            interval: Duration::from_secs(1),
            min_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(3),
            request_timeout: Duration::from_secs(3),
        }
    }
}

/// The operator: planner plus executor over one backend.
pub struct Operator<M: Machines> {
    spec: Spec,
    machines: Arc<M>,
    /// Client URLs given at start; a last resort once members have moved on.
    seeds: Vec<String>,
    /// Client URLs of the members at the last observation.
    known: Mutex<Vec<String>>,
    /// One client per URL, reused across steps; dropped on the first error.
    clients: Mutex<HashMap<String, Client>>,
    timing: Timing,
    metrics: Metrics,
    status: Arc<Mutex<OperatorStatus>>,
    /// Every applied or failed action, for whoever reports them (Kubernetes Events).
    actions: tokio::sync::broadcast::Sender<ActionRecord>,
    /// Client TLS for `https://` endpoints (mutual TLS with a certificate and key).
    tls: Option<crate::config::TlsFiles>,
    /// When the TLS files were last seen modified; a change drops every cached client.
    tls_stamp: Mutex<Vec<Option<std::time::SystemTime>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<M: Machines> Operator<M> {
    /// An operator for `spec`, reaching etcd first through `endpoints` (client URLs) and then
    /// through the client URLs of the members it observes.
    pub fn new(spec: Spec, machines: Arc<M>, endpoints: Vec<String>, timing: Timing) -> Self {
        Operator {
            spec,
            machines,
            seeds: endpoints,
            known: Mutex::new(Vec::new()),
            clients: Mutex::new(HashMap::new()),
            timing,
            metrics: Metrics::default(),
            status: Arc::new(Mutex::new(OperatorStatus::default())),
            actions: tokio::sync::broadcast::channel(HISTORY).0,
            tls: None,
            tls_stamp: Mutex::new(Vec::new()),
        }
    }

    /// Reaches etcd with client TLS from these files, read again on every new connection.
    pub fn with_tls(mut self, tls: Option<crate::config::TlsFiles>) -> Self {
        self.tls = tls;
        *lock(&self.tls_stamp) = crate::etcd::client::stamp(&self.etcd_config(""));
        self
    }

    /// The etcd seam's configuration for one endpoint.
    fn etcd_config(&self, endpoint: &str) -> crate::config::EtcdConfig {
        crate::config::EtcdConfig {
            endpoints: vec![endpoint.to_owned()],
            tls: self.tls.clone(),
            username: None,
            password: None,
            connect_timeout: self.timing.request_timeout,
            request_timeout: self.timing.request_timeout,
        }
    }

    /// Drops every cached client when the TLS files changed on disk, so rotated certificates
    /// are used from the next call on, not only after a connection fails.
    fn follow_rotation(&self) {
        if self.tls.is_none() {
            return;
        }
        let now = crate::etcd::client::stamp(&self.etcd_config(""));
        let mut seen = lock(&self.tls_stamp);
        if *seen != now {
            *seen = now;
            lock(&self.clients).clear();
            info!("etcd TLS files changed on disk; reconnecting with them");
        }
    }

    /// Every action applied or attempted from now on, as it is recorded in the status. A
    /// receiver that falls more than the status history behind loses the oldest.
    pub fn subscribe_actions(&self) -> tokio::sync::broadcast::Receiver<ActionRecord> {
        self.actions.subscribe()
    }

    /// The metrics handles (register them once).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A shared handle on the status.
    pub fn status_handle(&self) -> Arc<Mutex<OperatorStatus>> {
        Arc::clone(&self.status)
    }

    /// A copy of the current status.
    pub fn status(&self) -> OperatorStatus {
        lock(&self.status).clone()
    }

    /// Current members' client URLs first, then the seeds.
    fn endpoints(&self) -> Vec<String> {
        let mut eps = lock(&self.known).clone();
        for s in &self.seeds {
            if !eps.contains(s) {
                eps.push(s.clone());
            }
        }
        eps
    }

    /// A client for one endpoint, cached.
    async fn connect(&self, endpoint: &str) -> Result<Client, etcd_client::Error> {
        if let Some(c) = lock(&self.clients).get(endpoint) {
            return Ok(c.clone());
        }
        // The crate's etcd seam builds the options: TLS files are read on every connect, so a
        // client dropped after an error reconnects with rotated certificates.
        let opts = crate::etcd::client::connect_options(&self.etcd_config(endpoint))
            .map_err(|e| etcd_client::Error::IoError(std::io::Error::other(e.to_string())))?;
        let c = Client::connect([endpoint], Some(opts)).await?;
        lock(&self.clients).insert(endpoint.to_owned(), c.clone());
        Ok(c)
    }

    /// Drops the cached client of an endpoint that failed.
    fn forget(&self, endpoint: &str) {
        lock(&self.clients).remove(endpoint);
    }

    /// Lists members through the first endpoint that answers.
    async fn member_list(&self) -> Result<Vec<etcd_client::Member>, ExecuteError> {
        self.follow_rotation();
        let endpoints = self.endpoints();
        let mut last = String::from("no endpoints");
        for ep in &endpoints {
            let attempt = async {
                let mut c = self.connect(ep).await?;
                c.member_list().await
            };
            match attempt.await {
                Ok(resp) => return Ok(resp.members().to_vec()),
                Err(e) => {
                    debug!(endpoint = %ep, error = %e, "member list failed");
                    self.forget(ep);
                    last = format!("{ep}: {}", etcd_message(&e));
                }
            }
        }
        Err(ExecuteError::NoEndpoint {
            tried: endpoints.join(","),
            last,
        })
    }

    /// Observes etcd members (list, then each member's status) and the machines.
    pub async fn observe(&self) -> Result<Observation, ExecuteError> {
        let list = self.member_list().await?;
        // Voters first: learners refuse most requests.
        let mut urls: Vec<(bool, String)> = list
            .iter()
            .flat_map(|m| m.client_urls().iter().map(|u| (m.is_learner(), u.clone())))
            .collect();
        urls.sort();
        let urls: Vec<String> = urls.into_iter().map(|(_, u)| u).collect();
        if !urls.is_empty() {
            // Follow membership so the operator still reaches etcd after every seed is replaced.
            *lock(&self.known) = urls;
            let keep = self.endpoints();
            lock(&self.clients).retain(|url, _| keep.contains(url));
        }

        let statuses = futures::future::join_all(list.iter().map(|m| async move {
            let url = m.client_urls().first()?;
            let attempt = async {
                let mut c = self.connect(url).await?;
                c.status().await
            };
            match tokio::time::timeout(self.timing.request_timeout, attempt).await {
                Ok(Ok(s)) => Some(s),
                Ok(Err(e)) => {
                    debug!(member = m.name(), error = %e, "status failed");
                    self.forget(url);
                    None
                }
                Err(_) => {
                    self.forget(url);
                    None
                }
            }
        }))
        .await;

        let leader_id = statuses
            .iter()
            .flatten()
            .map(|s| s.leader())
            .find(|&l| l != 0);
        let mut members = Vec::new();
        let mut details = Vec::new();
        let mut leader_applied = None;
        let mut leader_client_url = None;
        for (m, s) in list.iter().zip(&statuses) {
            let has_leader = s.as_ref().is_some_and(|s| s.leader() != 0);
            let healthy = s.as_ref().is_some_and(|s| s.errors().is_empty()) && has_leader;
            let applied = s.as_ref().map_or(0, |s| s.raft_applied_index());
            let is_leader = leader_id == Some(m.id());
            if is_leader && s.is_some() {
                leader_applied = Some(applied);
                leader_client_url = m.client_urls().first().cloned();
            }
            members.push(MemberState {
                id: m.id(),
                name: m.name().to_owned(),
                peer_urls: m.peer_urls().to_vec(),
                is_learner: m.is_learner(),
                healthy,
                applied_index: applied,
            });
            details.push(MemberStatus {
                id: hex(m.id()),
                name: m.name().to_owned(),
                peer_urls: m.peer_urls().to_vec(),
                client_urls: m.client_urls().to_vec(),
                is_learner: m.is_learner(),
                healthy,
                is_leader,
                has_leader,
                applied_index: applied,
            });
        }
        let machines = self.machines.list().await?;
        Ok(Observation {
            observed: Observed {
                members,
                machines,
                leader_applied_index: leader_applied,
            },
            members: details,
            leader_client_url,
        })
    }

    fn record_observation(&self, obs: &Observation, p: &Plan) {
        self.metrics.observe_members(
            &obs.members
                .iter()
                .map(|m| MemberGauge {
                    member: if m.name.is_empty() {
                        m.id.clone()
                    } else {
                        m.name.clone()
                    },
                    is_leader: m.is_leader,
                    is_learner: m.is_learner,
                    has_leader: m.has_leader,
                })
                .collect::<Vec<_>>(),
        );
        self.metrics.condition(p.condition.kind());
        let mut st = lock(&self.status);
        st.condition = Some(p.condition.clone());
        st.members = obs.members.clone();
        st.machines = obs.observed.machines.clone();
    }

    fn record_action(&self, action: &Action, result: Result<(), &ExecuteError>) {
        self.metrics.action(action.kind(), result.is_ok());
        let rec = ActionRecord {
            action: action.clone(),
            text: action.to_string(),
            at: Utc::now(),
            error: result.err().map(|e| e.to_string()),
        };
        // No receiver is fine: nobody reports actions outside the status.
        let _ = self.actions.send(rec.clone());
        let mut st = lock(&self.status);
        st.last_action = Some(rec.clone());
        st.history.push(rec);
        let excess = st.history.len().saturating_sub(HISTORY);
        st.history.drain(..excess);
    }

    /// One step: observe, plan, apply the plan's actions in order (no membership change after
    /// a failed action). Returns the plan that was applied.
    pub async fn step(&self) -> Result<Plan, ExecuteError> {
        self.step_acted().await.map(|(plan, _)| plan)
    }

    /// [`Operator::step`], also telling whether any action changed something. A planned action
    /// can turn out to be nothing to do (a start the platform does itself, a hook kept because a
    /// linearizable member list still shows a member): a loop that steps again at once after
    /// every non-empty plan would spin while the platform starts a member.
    #[tracing::instrument(name = "operator_step", skip_all, fields(condition, actions))]
    pub async fn step_acted(&self) -> Result<(Plan, bool), ExecuteError> {
        let result = self.step_inner().await;
        let mut st = lock(&self.status);
        st.last_error = result.as_ref().err().map(|e| e.to_string());
        result
    }

    async fn step_inner(&self) -> Result<(Plan, bool), ExecuteError> {
        let obs = self.observe().await?;
        let p = plan(self.spec, &obs.observed);
        Span::current()
            .record("condition", p.condition.kind())
            .record("actions", p.actions.len());
        self.record_observation(&obs, &p);
        // Hook and start actions are independent of each other: one failing does not hold the
        // others back. The membership change is skipped after any failure, though: when the
        // backend misbehaves, membership is better left alone.
        let mut first_error = None;
        let mut acted = false;
        for action in &p.actions {
            if first_error.is_some() && action.is_membership_change() {
                break;
            }
            match self.act(action, &obs).instrument(action_span(action)).await {
                Ok(changed) => acted |= changed,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok((p, acted)),
        }
    }

    /// Applies one action, records it in the status and logs it; `false` when there was nothing
    /// to do after all.
    async fn act(&self, action: &Action, obs: &Observation) -> Result<bool, ExecuteError> {
        match self.apply(action, obs).await {
            Ok(true) => {
                self.record_action(action, Ok(()));
                info!("{action}");
                Ok(true)
            }
            // Nothing to do after all (a member that was starting already runs).
            Ok(false) => {
                debug!("{action}: already done");
                Ok(false)
            }
            Err(e) => {
                self.record_action(action, Err(&e));
                Err(e)
            }
        }
    }

    /// A client for membership calls: the leader if known, else any member that answers.
    async fn cluster_client(&self, obs: &Observation) -> Result<Client, ExecuteError> {
        if let Some(url) = &obs.leader_client_url
            && let Ok(c) = self.connect(url).await
        {
            return Ok(c);
        }
        let endpoints = self.endpoints();
        let mut last = String::from("no endpoints");
        for ep in &endpoints {
            match self.connect(ep).await {
                Ok(c) => return Ok(c),
                Err(e) => last = e.to_string(),
            }
        }
        Err(ExecuteError::NoEndpoint {
            tried: endpoints.join(","),
            last,
        })
    }

    /// Whether a member with `peer_url` is in the member list, read after a linearizable read on
    /// the same member (so the list holds every membership change committed before it).
    async fn member_on(&self, obs: &Observation, peer_url: &str) -> Result<bool, ExecuteError> {
        let mut c = self.cluster_client(obs).await?;
        c.get(
            "\0",
            Some(
                etcd_client::GetOptions::new()
                    .with_keys_only()
                    .with_limit(1),
            ),
        )
        .await
        .map_err(|source| ExecuteError::Etcd {
            op: "linearizable read",
            source,
        })?;
        let list = c.member_list().await.map_err(|source| ExecuteError::Etcd {
            op: "member list",
            source,
        })?;
        Ok(list.members().iter().any(|m| {
            m.peer_urls()
                .iter()
                .any(|u| super::plan::same_url(u, peer_url))
        }))
    }

    /// Applies one action; `false` when there turned out to be nothing to do.
    async fn apply(&self, action: &Action, obs: &Observation) -> Result<bool, ExecuteError> {
        match action {
            Action::AddHook { machine } => {
                self.machines.add_hook(machine).await?;
                Ok(true)
            }
            Action::ReleaseHook { machine } => {
                // The plan saw no member on this machine in a member list any member may have
                // served from its own state; a follower that lags could still be missing a
                // member that was just added. Released only once a member list read after a
                // linearizable read (through the leader when known) agrees.
                if let Some(peer_url) = obs
                    .observed
                    .machines
                    .iter()
                    .find(|m| &m.name == machine)
                    .map(|m| m.peer_url.clone())
                    && self.member_on(obs, &peer_url).await?
                {
                    info!(machine = %machine, "a linearizable member list still shows a member on it; hook kept");
                    return Ok(false);
                }
                self.machines.release_hook(machine).await?;
                Ok(true)
            }
            Action::AddLearner { machine, peer_url } => {
                let mut c = self.cluster_client(obs).await?;
                let opts = MemberAddOptions::new().with_is_learner();
                let id = match c.member_add([peer_url.as_str()], Some(opts)).await {
                    Ok(resp) => resp.member().map(|m| m.id()),
                    // An earlier attempt got through; the next observation sees the learner.
                    Err(e) if etcd_message(&e).contains("already exists") => None,
                    Err(e) => {
                        return Err(ExecuteError::Etcd {
                            op: "member add",
                            source: e,
                        });
                    }
                };
                if let Some(id) = id {
                    Span::current().record("member_id", hex(id).as_str());
                    // A failed start is retried by the next step (StartMember).
                    if let Err(e) = self.start(machine, id).await {
                        warn!(error = %e, "learner added, start failed");
                    }
                }
                Ok(true)
            }
            Action::StartMember { machine, member_id } => self.start(machine, *member_id).await,
            Action::Promote { member_id, .. } => {
                let mut c = self.cluster_client(obs).await?;
                match c.member_promote(*member_id).await {
                    Ok(_) => Ok(true),
                    // Already a voter: an earlier promotion got through.
                    Err(e)
                        if etcd_message(&e).contains("can only promote a learner member")
                            && !etcd_message(&e).contains("in sync") =>
                    {
                        Ok(false)
                    }
                    Err(e) => Err(ExecuteError::Etcd {
                        op: "member promote",
                        source: e,
                    }),
                }
            }
            Action::RemoveMember { member_id, .. } => {
                let mut c = self.cluster_client(obs).await?;
                match c.member_remove(*member_id).await {
                    Ok(_) => Ok(true),
                    Err(e) if etcd_message(&e).contains("member not found") => Ok(false),
                    Err(e) => Err(ExecuteError::Etcd {
                        op: "member remove",
                        source: e,
                    }),
                }
            }
        }
    }

    /// Starts the member `member_id` on `machine` with the current membership as its
    /// initial cluster.
    async fn start(&self, machine: &str, member_id: u64) -> Result<bool, ExecuteError> {
        let list = self.member_list().await?;
        if !list.iter().any(|m| m.id() == member_id) {
            return Err(ExecuteError::MemberGone(member_id));
        }
        let join = Join {
            name: machine.to_owned(),
            member_id,
            initial_cluster: initial_cluster(&list, machine, member_id),
        };
        Ok(self.machines.start_member(machine, &join).await?)
    }

    /// Runs steps until cancelled: right away after a step that changed something, after
    /// `interval` when there was nothing to do (or nothing planned could be done yet), with doubling backoff after failures.
    pub async fn run(&self, cancel: CancellationToken) {
        let backoff =
            crate::backoff::Backoff::new(self.timing.min_backoff, self.timing.max_backoff);
        let mut failures = 0u32;
        loop {
            let result = tokio::select! {
                _ = cancel.cancelled() => return,
                r = self.step_acted() => r,
            };
            let wait = match result {
                Ok((_, acted)) => {
                    failures = 0;
                    if acted {
                        Duration::from_millis(50)
                    } else {
                        self.timing.interval
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let retry_in = backoff.delay(failures);
                    if e.is_transient() {
                        info!(error = %e, ?retry_in, "step refused, retrying");
                    } else {
                        warn!(error = %e, ?retry_in, "step failed, retrying");
                    }
                    retry_in
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// The span of one action: its kind, and the machine and member it acts on where known.
fn action_span(action: &Action) -> Span {
    let span = tracing::info_span!(
        "operator_action",
        action = action.kind(),
        machine = Empty,
        member_id = Empty
    );
    if let Some(machine) = action.machine() {
        span.record("machine", machine);
    }
    if let Some(id) = action.member_id() {
        span.record("member_id", hex(id).as_str());
    }
    span
}

/// A member ID as etcdctl prints it.
fn hex(id: u64) -> String {
    format!("{id:x}")
}
