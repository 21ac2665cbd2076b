//! `serve` with `restore.initialize` in a multi-member cluster: a member whose data directory is
//! missing or invalid while the rest of the cluster has quorum is rebuilt by etcd, not from the
//! store. The store is not read on this path, except its listing for a first bootstrap (below).
//!
//! # When
//! The store restores the directory (today's path, [`super::initialize`]) when
//! `restore.cluster_endpoints` is empty, or when the live member list (through any endpoint
//! that answers one) names this member alone; only when no endpoint answers does the static
//! `restore.initial_cluster` decide (a member grown by `member add` names itself alone there).
//! Otherwise the member rejoins, and only rejoins: when no endpoint answers, or the cluster has
//! no quorum, it waits and retries until `restore.rejoin_timeout` and then fails, and the
//! kubelet starts it again. An unreachable cluster is not proof of a lost cluster (a network
//! partition looks the same), and a member restored from the store beside live members with
//! data would fork the cluster's history. Recovering a cluster that lost quorum is an
//! administrator's decision: empty `restore.cluster_endpoints` on every member to restore them
//! all from the store.
//!
//! One exception, a new cluster's first start ([`Outcome::FirstBootstrap`]): no endpoint
//! answers a member list (each etcd waits for its own sidecar), the store lists no snapshot at
//! all, and the directory is missing, not corrupt. Then [`super::initialize`] starts etcd fresh.
//! A heuristic rather than a switch: a switch set for the first start and forgotten would start
//! fresh after any later outage; a cluster that ever ran with backups has a snapshot in its
//! store, and an unreachable store is not an empty one. What it cannot tell apart: a cluster
//! that never stored a snapshot and whose members are all down or restarting without quorum.
//!
//! # How
//! Each step starts from a fresh observation: a member list through an endpoint that first
//! served a linearizable read (so it is connected to a leader with quorum and its list is
//! current), and each member's status. [`decide`] (pure) then names at most one membership
//! change, as the operator's planner does, with its quorum rules
//! ([`crate::etcd::membership::has_quorum`], [`crate::etcd::membership::removal_keeps_quorum`]):
//! remove our stale voter, remove a learner of ours left by an earlier attempt, or add us as a
//! learner. The added learner runs as a temporary etcd on `<data_dir>.part` (our name, our
//! peer URLs and peer certificate ([`peer_tls`]), `--initial-cluster-state=existing`, its
//! client URL on loopback only) and receives
//! the leader's snapshot; it is promoted when etcd accepts the promotion (etcd refuses a learner
//! that is not in sync), stopped cleanly, synced, and moved into place, an invalid old
//! directory moved aside first, never deleted. The real etcd then starts on it as a voter; its
//! static `--initial-cluster*` flags are ignored because the directory holds a member.
//!
//! `restore.rejoin_timeout` bounds the observe phase (until the learner is added); replication
//! then runs for as long as it progresses (`.part` growing or the learner's applied index
//! rising), and fails after `restore.rejoin_timeout` without progress ([`Progress`]).
//!
//! # Failures
//! Until the promotion, a failure leaves at most a learner behind: it does not count towards
//! quorum, and the next attempt removes it and adds a fresh one (its log, partly replicated to a
//! directory that no longer exists, cannot be resumed: the leader would take its progress for
//! granted). A learner removed by someone else ends the attempt. After the promotion a journal
//! (`<data_dir>.rejoin.json`, [`Journal`]) names the member; should the process die before the
//! rename, the next attempt installs `.part` without any membership change when that member is
//! still a voter in any answering endpoint's member list and `.part` passes validation (quorum
//! may be missing precisely because this member is down). Otherwise the journal is dropped and
//! the next attempt removes our voter as it removed the stale one, under the same quorum check.
//! Cancellation (SIGTERM) stops the temporary member and ends the attempt.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, MemberAddOptions};

use super::datadir::{self, DataDir};
use super::initialize::{InitializeMetrics, check_guard};
use super::{EtcdTools, MemberParams, RestoreError, install, remove_if_exists, sibling, sync_tree};
use crate::backoff::Backoff;
use crate::config::{EtcdConfig, PeerTls, RestoreConfig};
use crate::etcd::EtcdError;
use crate::etcd::membership::{
    MemberState, has_quorum, initial_cluster, quorum, removal_keeps_quorum, same_url,
};
use crate::etcd::process::{
    Bootstrap, ClusterState, EtcdProcess, MemberSpec, PeerUrls, ProcessError, ServerTls,
};
use crate::store::SnapshotStore;
use tokio_util::sync::CancellationToken;

/// Why a rejoin failed.
#[derive(Debug, thiserror::Error)]
pub enum RejoinError {
    /// The guard, the etcd binaries, or a file operation.
    #[error("{0}")]
    Restore(#[from] RestoreError),
    /// A client could not be built (TLS or password files).
    #[error("{0}")]
    Client(#[from] EtcdError),
    /// The rejoin did not finish in time; `last` is the last refusal or error seen.
    #[error(
        "not rejoined within {timeout:?} (restore.rejoin_timeout) through {endpoints}; last: {last}"
    )]
    Timeout {
        timeout: Duration,
        endpoints: String,
        last: String,
    },
    /// The joining member could not be started, or exited.
    #[error("joining member {id:x}: {source}")]
    Member {
        id: u64,
        #[source]
        source: ProcessError,
    },
    /// Validating the data directory failed to run.
    #[error("validating the data directory: {0}")]
    Validate(String),
    /// Replication made no progress for `stall` (restore.rejoin_timeout).
    #[error(
        "learner {id:x} made no replication progress for {stall:?} (restore.rejoin_timeout); last: {last}"
    )]
    Stalled {
        id: u64,
        stall: Duration,
        last: String,
    },
    /// Our learner was removed from the cluster (by someone else) before its promotion.
    #[error("learner {id:x} was removed from the cluster before its promotion")]
    Removed { id: u64 },
    /// The sidecar is shutting down.
    #[error("cancelled")]
    Cancelled,
    /// The peer URLs are `https://` but no usable peer certificate is configured: refused
    /// before any membership change.
    #[error("{0}")]
    PeerTls(String),
    /// The promoted member did not stop cleanly: its directory is not moved into place.
    #[error("stopping promoted member {id:x}: {source}")]
    Stop {
        id: u64,
        #[source]
        source: ProcessError,
    },
}

/// This member as the configuration describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Me {
    /// `restore.name`.
    pub name: String,
    /// `restore.initial_advertise_peer_urls`, split.
    pub peer_urls: Vec<String>,
}

impl Me {
    /// From the restore section.
    pub fn from_config(config: &RestoreConfig) -> Me {
        Me {
            name: config.name.clone(),
            peer_urls: config
                .initial_advertise_peer_urls
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(String::from)
                .collect(),
        }
    }

    fn owns(&self, m: &MemberState) -> bool {
        m.peer_urls
            .iter()
            .any(|u| self.peer_urls.iter().any(|p| same_url(p, u)))
    }
}

/// Whether a lost data directory rejoins the cluster (`true`) or comes from the store: only
/// with `restore.cluster_endpoints` set and more than this member in `restore.initial_cluster`.
pub fn rejoins(config: &RestoreConfig) -> bool {
    let params = MemberParams {
        name: config.name.clone(),
        initial_cluster: config.initial_cluster.clone(),
        initial_cluster_token: config.initial_cluster_token.clone(),
        initial_advertise_peer_urls: config.initial_advertise_peer_urls.clone(),
    };
    config.cluster.is_some() && params.is_multi_member()
}

/// The next step towards rejoining, from the member list and each member's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Remove our stale voter (its data is gone); the other voters keep a healthy majority.
    RemoveVoter { id: u64 },
    /// Remove a learner of ours left by an earlier attempt.
    RemoveLearner { id: u64 },
    /// Add us as a learner.
    AddLearner,
    /// Nothing safe to do now; observed again until `restore.rejoin_timeout`.
    Refuse(String),
}

fn label(m: &MemberState) -> String {
    if m.name.is_empty() {
        format!("{:x}", m.id)
    } else {
        format!("{} ({:x})", m.name, m.id)
    }
}

/// Decides the next step (pure). At most one membership change: each changes the facts the
/// next depends on, so the caller observes again after it.
pub fn decide(me: &Me, members: &[MemberState]) -> Step {
    for m in members {
        let ours = me.owns(m);
        if m.name == me.name && !ours {
            return Step::Refuse(format!(
                "member {} has peer URLs {:?}, not this member's {:?}: another member has this \
                 name",
                label(m),
                m.peer_urls,
                me.peer_urls
            ));
        }
        if ours && m.started() && m.name != me.name {
            return Step::Refuse(format!(
                "member {} has this member's peer URLs {:?} under another name",
                label(m),
                me.peer_urls
            ));
        }
    }
    if !has_quorum(members) {
        let voters: Vec<&MemberState> = members.iter().filter(|m| !m.is_learner).collect();
        let healthy = voters.iter().filter(|m| m.healthy).count();
        return Step::Refuse(format!(
            "quorum lost: {healthy} of {} voters healthy, {} needed; not changing membership",
            voters.len(),
            quorum(voters.len())
        ));
    }
    if let Some(m) = members.iter().find(|m| me.owns(m)) {
        if m.is_learner {
            return Step::RemoveLearner { id: m.id };
        }
        if m.healthy {
            return Step::Refuse(format!(
                "voter {} answers with this member's peer URLs although this data directory is \
                 lost: is this member running elsewhere?",
                label(m)
            ));
        }
        if !removal_keeps_quorum(members, m.id) {
            return Step::Refuse(format!(
                "removing this member's stale voter {} would leave the other voters without a \
                 healthy majority",
                label(m)
            ));
        }
        return Step::RemoveVoter { id: m.id };
    }
    if let Some(l) = members.iter().find(|m| m.is_learner) {
        return Step::Refuse(format!(
            "learner {} with peer URLs {:?} is in the cluster and etcd allows one learner at a \
             time; if it is abandoned, remove it: etcdctl member remove {:x}",
            label(l),
            l.peer_urls,
            l.id
        ));
    }
    Step::AddLearner
}

/// Where the joining member listens for `peer`: etcd binds IP addresses only, so a host name
/// becomes `0.0.0.0` on the same port (as the real etcd's `--listen-peer-urls` in the pod).
pub fn listen_url(peer: &str) -> String {
    let Ok(url) = url::Url::parse(peer) else {
        return peer.to_owned();
    };
    match (url.host(), url.port_or_known_default()) {
        (Some(url::Host::Domain(_)), Some(port)) => format!("{}://0.0.0.0:{port}", url.scheme()),
        _ => peer.to_owned(),
    }
}

/// Where the peer certificate is configured, for messages: `restore.peer_*`, or under
/// etcd-druid etcd's configuration file (which [`crate::druid`] reads into them).
const PEER_TLS_KEYS: &str = "restore.peer_cert_file and restore.peer_key_file; under etcd-druid, \
     peer-transport-security's cert-file and key-file in etcd's configuration file";

/// The temporary member's peer TLS: `config`'s, checked to be there (readable files) when a
/// peer URL is `https://`. Checked before any membership change: a learner added for a
/// member that cannot start would only block the next one.
pub fn peer_tls(config: &RestoreConfig, me: &Me) -> Result<Option<ServerTls>, RejoinError> {
    let https: Vec<&String> = me
        .peer_urls
        .iter()
        .filter(|u| u.starts_with("https://"))
        .collect();
    let Some(tls) = &config.peer_tls else {
        if https.is_empty() {
            return Ok(None);
        }
        return Err(RejoinError::PeerTls(format!(
            "peer URLs {https:?} are https:// but no peer certificate is configured: the \
             rejoining member's temporary etcd needs this member's peer certificate \
             ({PEER_TLS_KEYS})"
        )));
    };
    let PeerTls {
        cert_file,
        key_file,
        ca_file,
        client_cert_auth,
    } = tls;
    for file in [Some(cert_file), Some(key_file), ca_file.as_ref()]
        .into_iter()
        .flatten()
    {
        if let Err(e) = std::fs::File::open(file) {
            return Err(RejoinError::PeerTls(format!(
                "peer TLS file {} cannot be read ({e}): named by restore.peer_cert_file, \
                 restore.peer_key_file or restore.peer_ca_file (under etcd-druid by \
                 peer-transport-security in etcd's configuration file: the peer certificate's \
                 Secrets must be mounted into this container at the same paths)",
                file.display()
            )));
        }
    }
    Ok(Some(ServerTls {
        cert_file: cert_file.clone(),
        key_file: key_file.clone(),
        trusted_ca_file: ca_file.clone(),
        client_cert_auth: *client_cert_auth,
    }))
}

/// How long one call to the cluster may take, at most.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the promoted member has to stop after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// The joining member's backend quota: as the real member's (an applied write beyond a
/// smaller quota would raise a cluster-wide NOSPACE alarm).
const QUOTA_BACKEND_BYTES: &str = "8589934592";

/// `serve`'s hook before [`super::initialize`]: rejoins when the data directory is missing or
/// invalid and the cluster has members other than this one ([`rejoins`] decides only when no
/// endpoint answers). `false` leaves the directory to [`super::initialize`]: valid, to be
/// restored from the store, or a first bootstrap ([`Outcome::FirstBootstrap`]). `store` is
/// listed only for that last check; `cancel` (the sidecar's root token) stops the rejoin.
pub async fn rejoin_if_lost(
    config: &RestoreConfig,
    metrics: &InitializeMetrics,
    store: &SnapshotStore,
    cancel: &CancellationToken,
) -> Result<bool, RejoinError> {
    let (Some(cluster), Some(data_dir)) = (&config.cluster, config.data_dir.as_deref()) else {
        return Ok(false);
    };
    if let Some(guard) = &config.guard {
        check_guard(data_dir, guard)?;
    }
    // etcd already runs on it: left alone. Else the lock is held until the rejoin is done.
    let _lock = match datadir::lock_db(data_dir) {
        Ok(datadir::DbLock::Busy) => {
            tracing::info!(data_dir = %data_dir.display(), "etcd holds the database open; no rejoin");
            return Ok(false);
        }
        Ok(lock) => lock,
        Err(e) => return Err(RejoinError::Validate(e)),
    };
    // The same validation as a restore's (restore.validation): a valid directory is kept (one
    // member of several catches up from the leader), a missing or corrupt one is rebuilt.
    let (dir, mode) = (data_dir.to_path_buf(), config.validation);
    let found = tokio::task::spawn_blocking(move || datadir::check(&dir, mode))
        .await
        .map_err(|e| RejoinError::Validate(e.to_string()))?;
    match &found {
        DataDir::Valid { .. } => return Ok(false),
        DataDir::Missing => {}
        DataDir::Corrupt(reason) => {
            tracing::error!(data_dir = %data_dir.display(), validation = ?config.validation, %reason, "data directory fails validation; rebuilding it by rejoining, the old one is moved aside");
        }
    }
    // The live member list decides when anyone answers: restore.initial_cluster of a member
    // added by `member add` names it alone although others run.
    let me = Me::from_config(config);
    let opts = crate::etcd::connect_options(cluster)?;
    match live_members(cluster, &opts).await {
        Some(list) if !others_in(&me, &list) => {
            tracing::info!(
                "the live member list names this member alone: a lost data directory is restored from the store"
            );
            return Ok(false);
        }
        Some(_) => {}
        None if !rejoins(config) => {
            tracing::info!(
                "no endpoint answers and restore.initial_cluster names this member alone: a lost data directory is restored from the store"
            );
            return Ok(false);
        }
        None => {}
    }
    let started = Instant::now();
    // Boxed: the state machine is large for the caller's stack (a test's thread in debug).
    let result = Box::pin(rejoin(
        cluster,
        config,
        data_dir,
        &found,
        Some(store),
        cancel,
    ))
    .await;
    match result {
        Ok(Outcome::FirstBootstrap) => Ok(false),
        Ok(Outcome::Rejoined { moved_aside }) => {
            metrics.rejoined(true, started);
            tracing::info!(
                data_dir = %data_dir.display(),
                moved_aside = ?moved_aside,
                elapsed = ?started.elapsed(),
                "rejoin complete: etcd starts as a voter on the replicated data directory"
            );
            Ok(true)
        }
        Err(e) => {
            metrics.rejoined(false, started);
            Err(e)
        }
    }
}

/// Whether `members` holds a member other than this one.
pub fn others_in(me: &Me, members: &[MemberState]) -> bool {
    members.iter().any(|m| !me.owns(m))
}

/// One observation: the members with their health, and a client through an endpoint that
/// served a linearizable read.
struct Observation {
    members: Vec<MemberState>,
    client: Client,
}

/// How a rejoin ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The data directory is in place; `moved_aside` is where an invalid old one went.
    Rejoined { moved_aside: Option<PathBuf> },
    /// Nobody answers, the store holds no snapshot and the directory is missing: a new
    /// cluster's first start, left to [`super::initialize`] (which starts etcd fresh).
    FirstBootstrap,
}

/// What the observe phase ended with.
enum Admitted {
    /// A learner was added: its ID, `--initial-cluster`, and the client that added it.
    Learner {
        id: u64,
        initial_cluster: String,
        client: Box<Client>,
    },
    /// An earlier attempt's promoted member was installed from its journal.
    Installed(Option<PathBuf>),
    /// See [`Outcome::FirstBootstrap`].
    FirstBootstrap,
}

/// `fut`, or [`RejoinError::Cancelled`] once `cancel` fires.
async fn or_cancel<T>(
    cancel: &CancellationToken,
    fut: impl std::future::Future<Output = T>,
) -> Result<T, RejoinError> {
    tokio::select! {
        v = fut => Ok(v),
        () = cancel.cancelled() => Err(RejoinError::Cancelled),
    }
}

/// Rejoins the cluster at `cluster` as the member `config` describes, building `data_dir`
/// (`found` is what validation found there). `restore.rejoin_timeout` bounds the observe phase
/// (until a learner is added) and then each stretch of replication without progress.
#[tracing::instrument(name = "rejoin", skip_all, fields(name = %config.name, data_dir = %data_dir.display()))]
pub async fn rejoin(
    cluster: &EtcdConfig,
    config: &RestoreConfig,
    data_dir: &Path,
    found: &DataDir,
    store: Option<&SnapshotStore>,
    cancel: &CancellationToken,
) -> Result<Outcome, RejoinError> {
    let me = Me::from_config(config);
    let peer_tls = peer_tls(config, &me)?;
    let tools = EtcdTools::locate(config.etcd_bin.as_deref()).await?;
    let opts = crate::etcd::connect_options(cluster)?;
    tracing::warn!(peer_urls = ?me.peer_urls, endpoints = ?cluster.endpoints, "data directory missing or invalid; rejoining the cluster as a learner");
    let mut last = String::from("nothing tried yet");
    let admitting = Box::pin(admit(
        cluster, &opts, config, data_dir, found, store, &me, &mut last,
    ));
    let admitted = or_cancel(
        cancel,
        tokio::time::timeout(config.rejoin_timeout, admitting),
    )
    .await?;
    let (id, initial_cluster, client) = match admitted {
        Ok(Ok(Admitted::Learner {
            id,
            initial_cluster,
            client,
        })) => (id, initial_cluster, client),
        Ok(Ok(Admitted::Installed(moved_aside))) => return Ok(Outcome::Rejoined { moved_aside }),
        Ok(Ok(Admitted::FirstBootstrap)) => return Ok(Outcome::FirstBootstrap),
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(RejoinError::Timeout {
                timeout: config.rejoin_timeout,
                endpoints: cluster.endpoints.join(","),
                last,
            });
        }
    };
    let part = sibling(data_dir, ".part");
    let member = start(config, data_dir, &me, &tools, id, initial_cluster, peer_tls)?;
    let replicated = or_cancel(
        cancel,
        Box::pin(replicate(
            *client,
            id,
            &member,
            &part,
            config.rejoin_timeout,
            &mut last,
        )),
    )
    .await;
    match replicated {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(cancelled) => {
            // A learner: stopped, left for the next attempt to remove.
            let _ = member.terminate(STOP_TIMEOUT).await;
            return Err(cancelled);
        }
    }
    // Promoted: from here on only local steps, each bounded on its own. The journal lets a
    // restart install `.part` instead of replacing a complete voter.
    Journal {
        member_id: id,
        peer_urls: me.peer_urls.clone(),
        promoted: true,
    }
    .write(data_dir)?;
    member
        .terminate(STOP_TIMEOUT)
        .await
        .map_err(|source| RejoinError::Stop { id, source })?;
    sync_tree(&part).await?;
    let moved_aside = install(&part, data_dir, true)?;
    Journal::remove(data_dir)?;
    if let Some(aside) = &moved_aside {
        tracing::warn!(aside = %aside.display(), "the invalid data directory was moved aside");
    }
    Ok(Outcome::Rejoined { moved_aside })
}

/// Adds us as a learner (after whatever removals [`decide`] asks for); returns its ID, its
/// `--initial-cluster` and the client that added it. Also ends with an earlier attempt's
/// promoted member installed from its journal, or with a first bootstrap. `last` holds the
/// latest refusal or error, for the timeout's message.
#[allow(clippy::too_many_arguments)]
async fn admit(
    cluster: &EtcdConfig,
    opts: &etcd_client::ConnectOptions,
    config: &RestoreConfig,
    data_dir: &Path,
    found: &DataDir,
    store: Option<&SnapshotStore>,
    me: &Me,
    last: &mut String,
) -> Result<Admitted, RejoinError> {
    let backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut failures = 0u32;
    loop {
        if failures > 0 {
            tokio::time::sleep(backoff.delay(failures)).await;
        }
        failures = failures.saturating_add(1);
        if let Some(journal) = Journal::read(data_dir)? {
            match resume(&journal, cluster, opts, config, data_dir, me).await? {
                Resume::Installed(moved) => return Ok(Admitted::Installed(moved)),
                Resume::Discard(why) => {
                    tracing::warn!(member_id = %format!("{:x}", journal.member_id), %why, "the rejoin journal is stale; rejoining from the start");
                    Journal::remove(data_dir)?;
                }
                Resume::Unknown(e) => {
                    *last = e;
                    continue;
                }
            }
        }
        let obs = match observe(cluster, opts).await {
            Ok(obs) => obs,
            Err(e) => {
                if matches!(found, DataDir::Missing) && first_bootstrap(cluster, opts, store).await
                {
                    return Ok(Admitted::FirstBootstrap);
                }
                tracing::info!(error = %e, "cluster not reachable with quorum; retrying");
                *last = e;
                continue;
            }
        };
        let mut c = obs.client;
        let step = decide(me, &obs.members);
        match step {
            Step::Refuse(reason) => {
                tracing::warn!(%reason, "not rejoining yet");
                *last = reason;
            }
            Step::RemoveVoter { id } | Step::RemoveLearner { id } => {
                let what = if matches!(step, Step::RemoveVoter { .. }) {
                    "stale voter"
                } else {
                    "learner of an earlier attempt"
                };
                match bounded(c.member_remove(id)).await {
                    Ok(_) => {
                        tracing::warn!(member_id = %format!("{id:x}"), "removed this member's {what}");
                        failures = 0;
                    }
                    Err(e) => *last = format!("removing member {id:x}: {e}"),
                }
            }
            Step::AddLearner => {
                let add = MemberAddOptions::new().with_is_learner();
                match bounded(c.member_add(me.peer_urls.clone(), Some(add))).await {
                    Ok(resp) => {
                        let Some(id) = resp.member().map(|m| m.id()) else {
                            *last = "member add answered without the member".into();
                            continue;
                        };
                        tracing::info!(member_id = %format!("{id:x}"), "added as a learner");
                        let initial_cluster = initial_cluster(resp.member_list(), &me.name, id);
                        return Ok(Admitted::Learner {
                            id,
                            initial_cluster,
                            client: Box::new(c),
                        });
                    }
                    Err(e) => *last = format!("adding a learner: {e}"),
                }
            }
        }
    }
}

/// A new cluster's first start: no endpoint answers at all and the store lists no snapshot (an
/// unreachable store is not an empty one). The caller checked that the directory is missing.
async fn first_bootstrap(
    cluster: &EtcdConfig,
    opts: &etcd_client::ConnectOptions,
    store: Option<&SnapshotStore>,
) -> bool {
    let Some(store) = store else {
        return false;
    };
    if live_members(cluster, opts).await.is_some() {
        return false;
    }
    match store.list().await {
        Ok(list) if list.is_empty() => {
            tracing::warn!(endpoints = ?cluster.endpoints, "no endpoint answers, the store holds no snapshot and the data directory is missing: a new cluster's first start, etcd starts fresh");
            true
        }
        Ok(_) => false,
        Err(e) => {
            tracing::info!(error = %e, "the store could not be listed: not taken for a first bootstrap");
            false
        }
    }
}

/// The journal of a promoted member, `<data_dir>.rejoin.json`: written (fsynced) after the
/// promotion, removed after `.part` is in place.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Journal {
    /// The promoted member's ID.
    pub member_id: u64,
    /// Its peer URLs.
    pub peer_urls: Vec<String>,
    /// Written only after the promotion.
    pub promoted: bool,
}

impl Journal {
    /// Where the journal of `data_dir` lives.
    pub fn path(data_dir: &Path) -> PathBuf {
        sibling(data_dir, ".rejoin.json")
    }

    /// Writes it durably: a temporary file, synced, renamed, and the directory synced.
    pub fn write(&self, data_dir: &Path) -> Result<(), RestoreError> {
        use std::io::Write;
        let path = Journal::path(data_dir);
        let tmp = sibling(&path, ".tmp");
        let text = serde_json::to_vec(self).unwrap_or_default();
        let mut f = std::fs::File::create(&tmp).map_err(|e| RestoreError::io(&tmp, e))?;
        f.write_all(&text).map_err(|e| RestoreError::io(&tmp, e))?;
        f.sync_all().map_err(|e| RestoreError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| RestoreError::io(&path, e))?;
        sync_parent(&path)
    }

    /// The journal of `data_dir`, if any; an unreadable one is ignored (the rename makes a
    /// torn one impossible, so it is not ours).
    pub fn read(data_dir: &Path) -> Result<Option<Journal>, RestoreError> {
        let path = Journal::path(data_dir);
        match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Journal>(&bytes) {
                Ok(j) if j.promoted => Ok(Some(j)),
                Ok(_) => Ok(None),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "ignoring an unreadable rejoin journal");
                    Ok(None)
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(RestoreError::io(&path, e)),
        }
    }

    /// Removes the journal of `data_dir` (durably).
    pub fn remove(data_dir: &Path) -> Result<(), RestoreError> {
        let path = Journal::path(data_dir);
        match std::fs::remove_file(&path) {
            Ok(()) => sync_parent(&path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RestoreError::io(&path, e)),
        }
    }
}

fn sync_parent(path: &Path) -> Result<(), RestoreError> {
    let Some(parent) = path.parent() else {
        return Ok(());
    };
    std::fs::File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(|e| RestoreError::io(parent, e))
}

/// What a journal found at the start of an attempt leads to.
enum Resume {
    /// `.part` was moved into place; where an old directory went.
    Installed(Option<PathBuf>),
    /// The journal does not apply any more (why); rejoin from the start.
    Discard(String),
    /// No endpoint answers: try again.
    Unknown(String),
}

/// Installs the `.part` of a promoted member without any membership change, when that member
/// is still a voter (in the member list of any endpoint that answers: quorum may be missing
/// precisely because this member is down) and `.part` passes validation.
async fn resume(
    journal: &Journal,
    cluster: &EtcdConfig,
    opts: &etcd_client::ConnectOptions,
    config: &RestoreConfig,
    data_dir: &Path,
    me: &Me,
) -> Result<Resume, RejoinError> {
    let Some(list) = live_members(cluster, opts).await else {
        return Ok(Resume::Unknown(format!(
            "rejoin journal of promoted member {:x}: no endpoint answers a member list",
            journal.member_id
        )));
    };
    match list.iter().find(|m| m.id == journal.member_id) {
        Some(m) if !m.is_learner && me.owns(m) => {}
        _ => {
            return Ok(Resume::Discard(format!(
                "member {:x} is not a voter with this member's peer URLs",
                journal.member_id
            )));
        }
    }
    let part = sibling(data_dir, ".part");
    let (dir, mode) = (part.clone(), config.validation);
    let found = tokio::task::spawn_blocking(move || datadir::check(&dir, mode))
        .await
        .map_err(|e| RejoinError::Validate(e.to_string()))?;
    if !matches!(found, DataDir::Valid { .. }) {
        return Ok(Resume::Discard(format!(
            "{} is not a valid data directory: {found:?}",
            part.display()
        )));
    }
    sync_tree(&part).await?;
    let moved_aside = install(&part, data_dir, true)?;
    Journal::remove(data_dir)?;
    tracing::warn!(member_id = %format!("{:x}", journal.member_id), "an earlier attempt's promoted member is installed from its journal; no membership change");
    Ok(Resume::Installed(moved_aside))
}

/// Starts the added learner on `<data_dir>.part` (an earlier attempt's partial directory is
/// removed first: it belongs to a member that no longer exists), with the member's peer TLS,
/// not waiting for it.
fn start(
    config: &RestoreConfig,
    data_dir: &Path,
    me: &Me,
    tools: &EtcdTools,
    id: u64,
    initial_cluster: String,
    peer_tls: Option<ServerTls>,
) -> Result<EtcdProcess, RejoinError> {
    let part = sibling(data_dir, ".part");
    remove_if_exists(&part)?;
    let mut spec = MemberSpec {
        bootstrap: Some(Bootstrap {
            initial_cluster: Some(initial_cluster),
            state: ClusterState::Existing,
            token: config.initial_cluster_token.clone(),
        }),
        peer_urls: Some(PeerUrls {
            listen: me
                .peer_urls
                .iter()
                .map(|u| listen_url(u))
                .collect::<Vec<_>>()
                .join(","),
            advertise: me.peer_urls.join(","),
        }),
        peer_tls,
        // Durable: once promoted this member votes.
        no_fsync: false,
        log_level: "warn".into(),
        extra_args: vec!["--quota-backend-bytes".into(), QUOTA_BACKEND_BYTES.into()],
        log: Some(sibling(data_dir, ".rejoin.log")),
        ..MemberSpec::new(&me.name, &part)
    };
    let member = spec
        .spawn(&tools.binaries)
        .map_err(|source| RejoinError::Member { id, source })?;
    tracing::info!(member_id = %format!("{id:x}"), client_url = %member.client_url(), "learner started");
    Ok(member)
}

/// Progress of a replication: the bytes under `.part` (a snapshot being received) and the
/// learner's applied index, each counted when it passes its highest value so far.
#[derive(Debug, Clone)]
pub struct Progress {
    bytes: u64,
    index: u64,
    since: Instant,
}

impl Progress {
    /// Nothing seen yet, at `now`.
    pub fn new(now: Instant) -> Progress {
        Progress {
            bytes: 0,
            index: 0,
            since: now,
        }
    }

    /// Records a sample at `now`; whether it moved.
    pub fn note(&mut self, now: Instant, bytes: u64, index: u64) -> bool {
        if bytes > self.bytes || index > self.index {
            self.bytes = self.bytes.max(bytes);
            self.index = self.index.max(index);
            self.since = now;
            true
        } else {
            false
        }
    }

    /// Whether nothing moved for `limit` up to `now`.
    pub fn stalled(&self, now: Instant, limit: Duration) -> bool {
        now.saturating_duration_since(self.since) >= limit
    }
}

/// How often replication is sampled and promotion tried.
const REPLICATION_TICK: Duration = Duration::from_secs(2);

/// Waits until etcd accepts learner `id`'s promotion (it refuses a learner that is not in
/// sync) for as long as replication progresses; fails after `stall` without progress.
async fn replicate(
    mut client: Client,
    id: u64,
    member: &EtcdProcess,
    part: &Path,
    stall: Duration,
    last: &mut String,
) -> Result<(), RejoinError> {
    let mut progress = Progress::new(Instant::now());
    let local = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_secs(2));
    loop {
        if let Some(status) = member.exit_status() {
            return Err(RejoinError::Member {
                id,
                source: ProcessError::Exited {
                    name: member.name().to_owned(),
                    status: status.to_string(),
                    tail: member.log_tail(3),
                },
            });
        }
        let dir = part.to_path_buf();
        let bytes = tokio::task::spawn_blocking(move || tree_size(&dir))
            .await
            .unwrap_or(0);
        let index = bounded(async {
            let mut c = Client::connect([member.client_url()], Some(local.clone())).await?;
            c.status().await
        })
        .await
        .map_or(0, |s| s.raft_applied_index());
        if progress.note(Instant::now(), bytes, index) {
            tracing::debug!(bytes, applied_index = index, "replicating");
        }
        match bounded(client.member_promote(id)).await {
            Ok(_) => break,
            Err(e) => match refusal(&e) {
                Refusal::AlreadyVoter => break,
                Refusal::Removed => return Err(RejoinError::Removed { id }),
                Refusal::Retry => {
                    tracing::debug!(error = %e, "promotion refused; retrying");
                    *last = format!("promoting learner {id:x}: {e}");
                }
            },
        }
        if progress.stalled(Instant::now(), stall) {
            return Err(RejoinError::Stalled {
                id,
                stall,
                last: last.clone(),
            });
        }
        tokio::time::sleep(REPLICATION_TICK).await;
    }
    tracing::info!(member_id = %format!("{id:x}"), "promoted to voter");
    Ok(())
}

/// What a refused promotion means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Already a voter: an earlier promotion got through.
    AlreadyVoter,
    /// The learner was removed meanwhile (by an administrator): this attempt is over.
    Removed,
    /// Not in sync yet, or a transient error: tried again.
    Retry,
}

/// Reads etcd's refusal of a promotion.
pub fn refusal(message: &str) -> Refusal {
    if message.contains("member not found") {
        Refusal::Removed
    } else if message.contains("can only promote a learner member") && !message.contains("in sync")
    {
        Refusal::AlreadyVoter
    } else {
        Refusal::Retry
    }
}

/// The bytes of the files under `dir` (0 when it cannot be read).
fn tree_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => tree_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// A cluster call bounded by [`CALL_TIMEOUT`]; its error as etcd's message.
async fn bounded<T>(
    call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(etcd_client::Error::GRpcStatus(s))) => Err(s.message().to_owned()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("timed out after {CALL_TIMEOUT:?}")),
    }
}

/// The key read linearizably to prove an endpoint is connected to a leader with quorum (it need
/// not exist).
const QUORUM_CHECK_KEY: &str = "/etcd-warden/rejoin-quorum-check";

/// The member list through the first endpoint that serves a linearizable read, and each
/// member's status (healthy: answered without errors and knows a leader).
async fn observe(
    cluster: &EtcdConfig,
    opts: &etcd_client::ConnectOptions,
) -> Result<Observation, String> {
    let mut errors = Vec::new();
    for ep in &cluster.endpoints {
        let attempt = async {
            let mut c = Client::connect([ep.as_str()], Some(opts.clone())).await?;
            let read = GetOptions::new().with_count_only();
            match c.get(QUORUM_CHECK_KEY, Some(read)).await {
                // Refused after the read index was confirmed: quorum is there all the same.
                Err(etcd_client::Error::GRpcStatus(s))
                    if s.message().contains("permission denied") => {}
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            let list = c.member_list().await?;
            Ok((c, list.members().to_vec()))
        };
        match bounded(attempt).await {
            Ok((client, list)) => {
                let members = statuses(&list, opts).await;
                return Ok(Observation { members, client });
            }
            Err(e) => errors.push(format!("{ep}: {e}")),
        }
    }
    Err(format!(
        "no endpoint served a linearizable read ({})",
        errors.join("; ")
    ))
}

/// The member list through the first endpoint that answers one (served from that member's
/// state, without quorum), health unknown; `None` when no endpoint answers.
async fn live_members(
    cluster: &EtcdConfig,
    opts: &etcd_client::ConnectOptions,
) -> Option<Vec<MemberState>> {
    for ep in &cluster.endpoints {
        let attempt = async {
            let mut c = Client::connect([ep.as_str()], Some(opts.clone())).await?;
            c.member_list().await
        };
        if let Ok(list) = bounded(attempt).await {
            return Some(
                list.members()
                    .iter()
                    .map(|m| MemberState {
                        id: m.id(),
                        name: m.name().to_owned(),
                        peer_urls: m.peer_urls().to_vec(),
                        is_learner: m.is_learner(),
                        healthy: false,
                        applied_index: 0,
                    })
                    .collect(),
            );
        }
    }
    None
}

async fn statuses(
    list: &[etcd_client::Member],
    opts: &etcd_client::ConnectOptions,
) -> Vec<MemberState> {
    futures::future::join_all(list.iter().map(|m| async move {
        let status = match m.client_urls().first() {
            Some(url) => bounded(async {
                let mut c = Client::connect([url.as_str()], Some(opts.clone())).await?;
                c.status().await
            })
            .await
            .ok(),
            None => None,
        };
        MemberState {
            id: m.id(),
            name: m.name().to_owned(),
            peer_urls: m.peer_urls().to_vec(),
            is_learner: m.is_learner(),
            healthy: status
                .as_ref()
                .is_some_and(|s| s.errors().is_empty() && s.leader() != 0),
            applied_index: status.as_ref().map_or(0, |s| s.raft_applied_index()),
        }
    }))
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: &str = "http://10.0.0.3:2380";

    fn me() -> Me {
        Me {
            name: "m3".into(),
            peer_urls: vec![OURS.into()],
        }
    }

    fn member(id: u64, name: &str, peer: &str, learner: bool, healthy: bool) -> MemberState {
        MemberState {
            id,
            name: name.into(),
            peer_urls: vec![peer.into()],
            is_learner: learner,
            healthy,
            applied_index: 10,
        }
    }

    fn others() -> Vec<MemberState> {
        vec![
            member(1, "m1", "http://10.0.0.1:2380", false, true),
            member(2, "m2", "http://10.0.0.2:2380", false, true),
        ]
    }

    fn with(extra: MemberState) -> Vec<MemberState> {
        let mut m = others();
        m.push(extra);
        m
    }

    #[test]
    fn a_stale_voter_is_removed_when_the_others_keep_quorum() {
        let ms = with(member(3, "m3", OURS, false, false));
        assert_eq!(decide(&me(), &ms), Step::RemoveVoter { id: 3 });
        // Matched on the peer URL, a trailing slash aside.
        let ms = with(member(3, "m3", "http://10.0.0.3:2380/", false, false));
        assert_eq!(decide(&me(), &ms), Step::RemoveVoter { id: 3 });
    }

    #[test]
    fn a_stale_voter_is_removed_with_another_member_down_if_a_majority_remains() {
        // 5 voters, ours and one other down: 3 of 5 now, 3 of 4 after the removal. Requiring
        // every other voter healthy would deadlock two lost members, each waiting for the other.
        let mut ms = with(member(3, "m3", OURS, false, false));
        ms.push(member(4, "m4", "http://10.0.0.4:2380", false, true));
        ms.push(member(5, "m5", "http://10.0.0.5:2380", false, true));
        ms[0].healthy = false;
        assert_eq!(decide(&me(), &ms), Step::RemoveVoter { id: 3 });
    }

    #[test]
    fn removal_is_refused_when_the_rest_would_have_no_majority() {
        // 4 voters (mid-replacement), ours and one other down: 2 of 4 is no quorum.
        let mut ms = with(member(3, "m3", OURS, false, false));
        ms.push(member(4, "m4", "http://10.0.0.4:2380", false, true));
        ms[0].healthy = false;
        assert!(matches!(decide(&me(), &ms), Step::Refuse(r) if r.contains("2 of 4")));
    }

    #[test]
    fn a_cluster_without_quorum_is_left_alone() {
        let mut ms = with(member(3, "m3", OURS, false, false));
        ms[1].healthy = false;
        assert!(matches!(decide(&me(), &ms), Step::Refuse(r) if r.contains("1 of 3")));
        assert!(matches!(decide(&me(), &[]), Step::Refuse(r) if r.contains("quorum lost")));
    }

    #[test]
    fn a_healthy_voter_with_our_peer_url_is_not_removed() {
        let ms = with(member(3, "m3", OURS, false, true));
        assert!(matches!(decide(&me(), &ms), Step::Refuse(r) if r.contains("running elsewhere")));
    }

    #[test]
    fn a_learner_of_an_earlier_attempt_is_removed_started_or_not() {
        let ms = with(member(7, "", OURS, true, false));
        assert_eq!(decide(&me(), &ms), Step::RemoveLearner { id: 7 });
        let ms = with(member(7, "m3", OURS, true, true));
        assert_eq!(decide(&me(), &ms), Step::RemoveLearner { id: 7 });
    }

    #[test]
    fn without_a_member_of_ours_a_learner_is_added() {
        assert_eq!(decide(&me(), &others()), Step::AddLearner);
    }

    #[test]
    fn another_learner_waits_for_its_turn() {
        let ms = with(member(9, "", "http://10.0.0.9:2380", true, false));
        let Step::Refuse(r) = decide(&me(), &ms) else {
            panic!("not refused");
        };
        // Enough to clear an abandoned one by hand.
        assert!(r.contains("one learner"), "{r}");
        assert!(r.contains("http://10.0.0.9:2380"), "{r}");
        assert!(r.contains("etcdctl member remove 9"), "{r}");
    }

    #[test]
    fn the_live_list_decides_who_else_is_there() {
        assert!(others_in(&me(), &others()));
        assert!(others_in(&me(), &with(member(3, "m3", OURS, false, false))));
        // Only our own (stale) member, or nobody.
        assert!(!others_in(&me(), &[member(3, "m3", OURS, false, false)]));
        assert!(!others_in(&me(), &[]));
    }

    #[test]
    fn replication_fails_only_after_a_stretch_without_progress() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(60);
        let mut p = Progress::new(t0);
        // Far beyond the limit in total, never stalled while something moves.
        for i in 1..=100u64 {
            let now = t0 + Duration::from_secs(30 * i);
            let moved = p.note(now, i * 1000, 0);
            assert!(moved);
            assert!(!p.stalled(now, limit));
        }
        // Then the applied index takes over (the snapshot is in, the bytes stay).
        let t1 = t0 + Duration::from_secs(3000);
        assert!(p.note(t1, 100_000, 5));
        assert!(!p.note(t1 + Duration::from_secs(10), 90_000, 5));
        assert!(!p.stalled(t1 + Duration::from_secs(59), limit));
        assert!(p.stalled(t1 + Duration::from_secs(60), limit));
    }

    #[test]
    fn a_removed_learner_ends_the_attempt_and_only_sync_is_retried() {
        assert_eq!(refusal("etcdserver: member not found"), Refusal::Removed);
        assert_eq!(
            refusal("etcdserver: can only promote a learner member which is in sync with leader"),
            Refusal::Retry
        );
        assert_eq!(
            refusal("etcdserver: can only promote a learner member"),
            Refusal::AlreadyVoter
        );
        assert_eq!(refusal("timed out after 10s"), Refusal::Retry);
    }

    #[test]
    fn the_journal_is_written_read_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        assert_eq!(Journal::read(&data).unwrap(), None);
        let j = Journal {
            member_id: 0xabc,
            peer_urls: vec![OURS.into()],
            promoted: true,
        };
        j.write(&data).unwrap();
        assert!(dir.path().join("data.rejoin.json").exists());
        assert_eq!(Journal::read(&data).unwrap(), Some(j));
        Journal::remove(&data).unwrap();
        assert_eq!(Journal::read(&data).unwrap(), None);
        Journal::remove(&data).unwrap();
        std::fs::write(Journal::path(&data), b"{torn").unwrap();
        assert_eq!(Journal::read(&data).unwrap(), None);
    }

    #[test]
    fn name_and_peer_url_conflicts_are_refused() {
        let ms = with(member(3, "m3", "http://10.0.0.8:2380", false, false));
        assert!(
            matches!(decide(&me(), &ms), Step::Refuse(r) if r.contains("another member has this name"))
        );
        let ms = with(member(3, "m9", OURS, false, false));
        assert!(matches!(decide(&me(), &ms), Step::Refuse(r) if r.contains("under another name")));
    }

    #[test]
    fn listen_urls_bind_ip_addresses() {
        assert_eq!(listen_url("http://127.0.0.1:2380"), "http://127.0.0.1:2380");
        assert_eq!(
            listen_url("http://etcd-0.etcd-peer.ns.svc:2380"),
            "http://0.0.0.0:2380"
        );
        assert_eq!(listen_url("http://[::1]:2380"), "http://[::1]:2380");
    }

    fn restore_config(cluster: bool, initial_cluster: &str) -> RestoreConfig {
        RestoreConfig {
            data_dir: Some("/var/lib/etcd/data".into()),
            name: "m3".into(),
            initial_cluster: initial_cluster.into(),
            initial_cluster_token: "t".into(),
            initial_advertise_peer_urls: OURS.into(),
            etcd_bin: None,
            parallel_fetch: 1,
            force: false,
            initialize: true,
            validation: crate::config::Validation::Sanity,
            fallback: true,
            guard: None,
            work_dir: None,
            cluster: cluster.then(|| EtcdConfig {
                endpoints: vec!["http://10.0.0.1:2379".into()],
                tls: None,
                username: None,
                password: None,
                connect_timeout: Duration::from_secs(1),
                request_timeout: Duration::from_secs(1),
            }),
            rejoin_timeout: Duration::from_secs(60),
            peer_tls: None,
            bump_revision: 0,
            mark_compacted: false,
            read_limits: Default::default(),
        }
    }

    #[test]
    fn only_a_multi_member_cluster_with_endpoints_rejoins() {
        let three = format!("m1=http://10.0.0.1:2380,m2=http://10.0.0.2:2380,m3={OURS}");
        assert!(rejoins(&restore_config(true, &three)));
        assert!(!rejoins(&restore_config(false, &three)));
        assert!(!rejoins(&restore_config(true, "")));
        assert!(!rejoins(&restore_config(true, &format!("m3={OURS}"))));
    }
}
