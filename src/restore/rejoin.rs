//! `serve` with `restore.initialize` in a multi-member cluster: a member whose data directory is
//! missing or invalid while the rest of the cluster has quorum is rebuilt by etcd, not from the
//! store. The store is not read on this path.
//!
//! # When
//! The store restores the directory (today's path, [`super::initialize`]) when
//! `restore.cluster_endpoints` is empty or `restore.initial_cluster` names this member alone (a
//! single-member cluster has nobody to replicate from). Otherwise the member rejoins, and only
//! rejoins: when no endpoint answers, or the cluster has no quorum, it waits and retries until
//! `restore.rejoin_timeout` and then fails, and the kubelet starts it again. An unreachable
//! cluster is not proof of a lost cluster (a network partition looks the same), and a member
//! restored from the store beside live members with data would fork the cluster's history.
//! Recovering a cluster that lost quorum is an administrator's decision: empty
//! `restore.cluster_endpoints` on every member to restore them all from the store.
//!
//! # How
//! Each step starts from a fresh observation: a member list through an endpoint that first
//! served a linearizable read (so it is connected to a leader with quorum and its list is
//! current), and each member's status. [`decide`] (pure) then names at most one membership
//! change, as the operator's planner does, with its quorum rules
//! ([`crate::operator::plan::has_quorum`], [`crate::operator::plan::removal_keeps_quorum`]):
//! remove our stale voter, remove a learner of ours left by an earlier attempt, or add us as a
//! learner. The added learner runs as a temporary etcd on `<data_dir>.part` (our name, our
//! peer URLs, `--initial-cluster-state=existing`, its client URL on loopback only) and receives
//! the leader's snapshot; it is promoted when etcd accepts the promotion (etcd refuses a learner
//! that is not in sync), stopped cleanly, synced, and moved into place, an invalid old
//! directory moved aside first, never deleted. The real etcd then starts on it as a voter; its
//! static `--initial-cluster*` flags are ignored because the directory holds a member.
//!
//! # Failures
//! Until the promotion, a failure leaves at most a learner behind: it does not count towards
//! quorum, and the next attempt removes it and adds a fresh one (its log, partly replicated to a
//! directory that no longer exists, cannot be resumed: the leader would take its progress for
//! granted). After the promotion, the steps left (stop, sync, rename) are local; should the
//! process die among them, the next attempt finds our voter unhealthy and removes it as it
//! removed the stale one, under the same quorum check.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, MemberAddOptions};

use super::datadir::{self, DataDir};
use super::initialize::{InitializeMetrics, check_guard};
use super::{EtcdTools, MemberParams, RestoreError, install, remove_if_exists, sibling, sync_tree};
use crate::backoff::Backoff;
use crate::config::{EtcdConfig, RestoreConfig};
use crate::etcd::EtcdError;
use crate::etcd::process::{
    Bootstrap, ClusterState, EtcdProcess, MemberSpec, PeerUrls, ProcessError,
};
use crate::operator::plan::{MemberState, has_quorum, quorum, removal_keeps_quorum};

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

fn same_url(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
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
            "learner {} is in the cluster; etcd allows one learner at a time",
            label(l)
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

/// How long one call to the cluster may take, at most.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the promoted member has to stop after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// The joining member's backend quota: as the real member's (an applied write beyond a
/// smaller quota would raise a cluster-wide NOSPACE alarm).
const QUOTA_BACKEND_BYTES: &str = "8589934592";

/// `serve`'s hook before [`super::initialize`]: rejoins when [`rejoins`] and the data directory
/// is missing or invalid; `false` leaves the directory to [`super::initialize`] (valid, or to be
/// restored from the store).
pub async fn initialize(
    config: &RestoreConfig,
    metrics: &InitializeMetrics,
) -> Result<bool, RejoinError> {
    let (Some(cluster), Some(data_dir)) = (&config.cluster, config.data_dir.as_deref()) else {
        return Ok(false);
    };
    if !rejoins(config) {
        tracing::info!(
            "restore.initial_cluster names this member alone: a lost data directory is restored from the store"
        );
        return Ok(false);
    }
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
    let started = Instant::now();
    let result = rejoin(cluster, config, data_dir).await;
    metrics.rejoined(result.is_ok(), started);
    let moved_aside = result?;
    tracing::info!(
        data_dir = %data_dir.display(),
        moved_aside = ?moved_aside,
        elapsed = ?started.elapsed(),
        "rejoin complete: etcd starts as a voter on the replicated data directory"
    );
    Ok(true)
}

/// One observation: the members with their health, and a client through an endpoint that
/// served a linearizable read.
struct Observation {
    members: Vec<MemberState>,
    client: Client,
}

/// Rejoins the cluster at `cluster` as the member `config` describes, building `data_dir`.
/// Returns where an invalid old directory was moved.
#[tracing::instrument(name = "rejoin", skip_all, fields(name = %config.name, data_dir = %data_dir.display()))]
pub async fn rejoin(
    cluster: &EtcdConfig,
    config: &RestoreConfig,
    data_dir: &Path,
) -> Result<Option<PathBuf>, RejoinError> {
    let me = Me::from_config(config);
    let tools = EtcdTools::locate(config.etcd_bin.as_deref()).await?;
    tracing::warn!(peer_urls = ?me.peer_urls, endpoints = ?cluster.endpoints, "data directory missing or invalid; rejoining the cluster as a learner");
    let mut last = String::from("nothing tried yet");
    let joined = tokio::time::timeout(
        config.rejoin_timeout,
        join(cluster, config, data_dir, &me, &tools, &mut last),
    )
    .await;
    let (id, member) = match joined {
        Ok(result) => result?,
        Err(_) => {
            return Err(RejoinError::Timeout {
                timeout: config.rejoin_timeout,
                endpoints: cluster.endpoints.join(","),
                last,
            });
        }
    };
    // Promoted: from here on only local steps, each bounded on its own.
    let part = sibling(data_dir, ".part");
    member
        .terminate(STOP_TIMEOUT)
        .await
        .map_err(|source| RejoinError::Stop { id, source })?;
    sync_tree(&part).await?;
    let moved_aside = install(&part, data_dir, true)?;
    if let Some(aside) = &moved_aside {
        tracing::warn!(aside = %aside.display(), "the invalid data directory was moved aside");
    }
    Ok(moved_aside)
}

/// Adds us as a learner (after whatever removals [`decide`] asks for), starts it and promotes
/// it once etcd accepts; returns its ID and the running member. `last` holds the latest
/// refusal or error, for the timeout's message.
async fn join(
    cluster: &EtcdConfig,
    config: &RestoreConfig,
    data_dir: &Path,
    me: &Me,
    tools: &EtcdTools,
    last: &mut String,
) -> Result<(u64, EtcdProcess), RejoinError> {
    let backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let opts = crate::etcd::connect_options(cluster)?;
    let mut failures = 0u32;
    let (id, initial_cluster, client) = loop {
        if failures > 0 {
            tokio::time::sleep(backoff.delay(failures)).await;
        }
        failures = failures.saturating_add(1);
        let obs = match observe(cluster, &opts).await {
            Ok(obs) => obs,
            Err(e) => {
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
                        let ic = crate::operator::execute::initial_cluster(
                            resp.member_list(),
                            &me.name,
                            id,
                        );
                        break (id, ic, c);
                    }
                    Err(e) => *last = format!("adding a learner: {e}"),
                }
            }
        }
    };
    let member = start(config, data_dir, me, tools, id, initial_cluster).await?;
    promote(client, id, &member, &backoff, last).await?;
    Ok((id, member))
}

/// Starts the added learner on `<data_dir>.part` (an earlier attempt's partial directory is
/// removed first: it belongs to a member that no longer exists) and waits until it serves.
async fn start(
    config: &RestoreConfig,
    data_dir: &Path,
    me: &Me,
    tools: &EtcdTools,
    id: u64,
    initial_cluster: String,
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
        // Durable: once promoted this member votes.
        no_fsync: false,
        log_level: "warn".into(),
        extra_args: vec!["--quota-backend-bytes".into(), QUOTA_BACKEND_BYTES.into()],
        log: Some(sibling(data_dir, ".rejoin.log")),
        ..MemberSpec::new(&me.name, &part)
    };
    // Until it answers a status with a leader: a joining member serves once it has applied
    // the cluster's state up to its own publication, so this includes most of the catch-up.
    let member = spec
        .start(&tools.binaries, Duration::from_secs(24 * 3600))
        .await
        .map_err(|source| RejoinError::Member { id, source })?;
    tracing::info!(member_id = %format!("{id:x}"), client_url = %member.client_url(), "learner started and serving");
    Ok(member)
}

/// Promotes learner `id` once etcd accepts (it refuses a learner that is not in sync).
async fn promote(
    mut client: Client,
    id: u64,
    member: &EtcdProcess,
    backoff: &Backoff,
    last: &mut String,
) -> Result<(), RejoinError> {
    let mut failures = 0u32;
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
        match bounded(client.member_promote(id)).await {
            Ok(_) => break,
            // Already a voter: an earlier promotion got through.
            Err(e) if e.contains("can only promote a learner member") && !e.contains("in sync") => {
                break;
            }
            Err(e) => {
                tracing::debug!(error = %e, "promotion refused; retrying");
                *last = format!("promoting learner {id:x}: {e}");
            }
        }
        failures = failures.saturating_add(1);
        tokio::time::sleep(backoff.delay(failures).min(Duration::from_secs(2))).await;
    }
    tracing::info!(member_id = %format!("{id:x}"), "promoted to voter");
    Ok(())
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
        assert!(matches!(decide(&me(), &ms), Step::Refuse(r) if r.contains("one learner")));
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
            cluster: cluster.then(|| EtcdConfig {
                endpoints: vec!["http://10.0.0.1:2379".into()],
                tls: None,
                username: None,
                password: None,
                connect_timeout: Duration::from_secs(1),
                request_timeout: Duration::from_secs(1),
            }),
            rejoin_timeout: Duration::from_secs(60),
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
