//! etcd's own tools, used by restore where it does not write the member directory itself
//! (releases other than 3.4 to 3.6, and the replay fallback when deltas cannot be written into
//! the database directly): `etcdutl snapshot restore` (3.5+) or `etcdctl snapshot restore`
//! (3.4), and a temporary etcd on loopback to replay deltas into. Both are found and run
//! through [`crate::etcd::process`]. Only those paths need the tool beside `etcd`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{RestoreError, member_dir};
use crate::etcd::process::{EtcdBinaries, EtcdProcess, MemberSpec};

/// Where the etcd binaries are and what they can do.
#[derive(Debug, Clone)]
pub struct EtcdTools {
    /// `etcd` and the tools beside it.
    pub binaries: EtcdBinaries,
    /// The binary that restores a snapshot file into a data directory: `None` where it is not
    /// beside `etcd` and the release's member directory is written without it (3.4 to 3.6),
    /// which then needs it only for the replay fallback ([`EtcdTools::restore_db`] fails there).
    pub restorer: Option<Restorer>,
}

/// `etcdutl` (3.5+) or `etcdctl` (3.4, which still restores snapshots itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restorer {
    Etcdutl(PathBuf),
    Etcdctl(PathBuf),
}

impl Restorer {
    /// The tool's name.
    pub fn name(&self) -> &'static str {
        match self {
            Restorer::Etcdutl(_) => "etcdutl",
            Restorer::Etcdctl(_) => "etcdctl",
        }
    }
}

/// Whether a database file ends in etcd's SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbHash {
    /// A snapshot as etcd streams it, hash appended.
    Appended,
    /// A database this program wrote, no hash.
    None,
}

/// How the restored member is named and which cluster it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberParams {
    pub name: String,
    /// `name=peerURL,...`; empty means a one-member cluster of this member.
    pub initial_cluster: String,
    pub initial_cluster_token: String,
    pub initial_advertise_peer_urls: String,
}

impl Default for MemberParams {
    fn default() -> Self {
        // etcd's own defaults, so a restored single member starts with plain `etcd --data-dir`.
        MemberParams {
            name: "default".into(),
            initial_cluster: String::new(),
            initial_cluster_token: "etcd-cluster".into(),
            initial_advertise_peer_urls: "http://localhost:2380".into(),
        }
    }
}

impl MemberParams {
    /// The `--initial-cluster` value: as given, or this member alone.
    pub fn initial_cluster(&self) -> String {
        if self.initial_cluster.is_empty() {
            format!("{}={}", self.name, self.initial_advertise_peer_urls)
        } else {
            self.initial_cluster.clone()
        }
    }

    /// Whether the cluster has more members than this one: distinct names, since a member
    /// with several peer URLs appears once per URL (`a=http://a1:2380,a=http://a2:2380`).
    pub fn is_multi_member(&self) -> bool {
        let cluster = self.initial_cluster();
        let names: std::collections::BTreeSet<&str> = cluster
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.split_once('=').map_or(s, |(name, _)| name).trim())
            .collect();
        names.len() > 1
    }
}

impl EtcdTools {
    /// Finds the tools in `dir` (`restore.etcd_bin`, `--etcd-bin`), else where
    /// [`EtcdBinaries::locate`] looks.
    pub async fn locate(dir: Option<&Path>) -> Result<EtcdTools, RestoreError> {
        let dir = dir.map(Path::to_path_buf);
        let binaries = tokio::task::spawn_blocking(move || EtcdBinaries::locate(dir.as_deref()))
            .await
            .map_err(|cause| RestoreError::Task {
                what: "locating etcd",
                cause,
            })?
            .map_err(RestoreError::Locate)?;
        let restorer = match (&binaries.etcdutl, &binaries.etcdctl) {
            (Some(u), _) if binaries.version >= (3, 5, 0) => Some(Restorer::Etcdutl(u.clone())),
            (_, Some(c)) if binaries.version < (3, 6, 0) => Some(Restorer::Etcdctl(c.clone())),
            _ => None,
        };
        let tools = EtcdTools { binaries, restorer };
        // A distroless etcd image has no etcdutl: where restore writes the member directory
        // itself, the tool is asked for only by the step that runs it.
        if tools.restorer.is_none() && member_dir::Release::of(tools.binaries.version).is_none() {
            return Err(tools.no_restorer());
        }
        Ok(tools)
    }

    /// The error for a missing restore tool: `etcdutl` from 3.5 on, `etcdctl` before.
    fn no_restorer(&self) -> RestoreError {
        let tool = if self.binaries.version >= (3, 5, 0) {
            "etcdutl"
        } else {
            "etcdctl"
        };
        RestoreError::NoRestorer {
            tool,
            etcd: self.binaries.etcd.clone(),
        }
    }

    /// Restores the database file `db` into the new directory `data_dir` with etcd's own tool,
    /// which checks the hash when there is one.
    #[tracing::instrument(
        name = "etcd_restore_tool",
        skip_all,
        fields(
            tool = self.restorer.as_ref().map_or("none", Restorer::name),
            data_dir = %data_dir.display(),
            name = %member.name
        )
    )]
    pub async fn restore_db(
        &self,
        db: &Path,
        hash: DbHash,
        data_dir: &Path,
        member: &MemberParams,
    ) -> Result<(), RestoreError> {
        let (bin, env_api) = match &self.restorer {
            Some(Restorer::Etcdutl(p)) => (p, None),
            Some(Restorer::Etcdctl(p)) => (p, Some(("ETCDCTL_API", "3"))),
            None => return Err(self.no_restorer()),
        };
        let mut cmd = Command::new(bin);
        cmd.arg("snapshot")
            .arg("restore")
            .arg(db)
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--name")
            .arg(&member.name)
            .arg("--initial-cluster")
            .arg(member.initial_cluster())
            .arg("--initial-cluster-token")
            .arg(&member.initial_cluster_token)
            .arg("--initial-advertise-peer-urls")
            .arg(&member.initial_advertise_peer_urls)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if hash == DbHash::None {
            cmd.arg("--skip-hash-check");
        }
        if let Some((k, v)) = env_api {
            cmd.env(k, v);
        }
        let out = cmd.output().await.map_err(|cause| RestoreError::RunTool {
            tool: bin.clone(),
            cause,
        })?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim();
            return Err(RestoreError::ToolFailed {
                tool: bin
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("etcd tool")
                    .to_owned(),
                status: out.status,
                stderr: last.to_owned(),
            });
        }
        tracing::debug!("snapshot restored into the data directory");
        Ok(())
    }
}

/// How often a temporary etcd's leases are renewed while it runs.
const LEASE_RENEWAL: Duration = Duration::from_secs(1);

/// A temporary etcd on a restored data directory, on loopback ports of its own, for replaying
/// deltas; killed if dropped. Its leases are renewed while it runs: they count down from its
/// start, and one expiring would delete its keys at a revision no delta has.
pub struct TempEtcd {
    process: EtcdProcess,
    /// `http://127.0.0.1:<port>`.
    pub client_url: String,
    _renewal: DropGuard,
}

impl TempEtcd {
    /// Starts etcd on `data_dir` as member `name` and waits until it answers.
    pub async fn start(
        tools: &EtcdTools,
        data_dir: &Path,
        name: &str,
        log: PathBuf,
    ) -> Result<TempEtcd, RestoreError> {
        let mut spec = MemberSpec {
            // The data directory holds the restored member; it needs no bootstrap flags.
            bootstrap: None,
            // Not durable: the result is synced once before it is moved into place.
            no_fsync: true,
            log_level: "error".into(),
            // One revision may hold many events (a transaction, a revoked lease): allow big txns.
            extra_args: [
                "--max-txn-ops",
                "1000000",
                "--max-request-bytes",
                "33554432",
                "--quota-backend-bytes",
                "8589934592",
            ]
            .map(String::from)
            .to_vec(),
            log: Some(log),
            ..MemberSpec::new(name, data_dir)
        };
        let process = spec
            .start(&tools.binaries, Duration::from_secs(60))
            .await
            .map_err(RestoreError::TempEtcd)?;
        let client_url = spec.client_url();
        let renewal = CancellationToken::new();
        tokio::spawn(renew_leases(client_url.clone(), renewal.clone()));
        Ok(TempEtcd {
            client_url,
            process,
            _renewal: renewal.drop_guard(),
        })
    }

    /// Stops etcd cleanly (SIGTERM, so it closes its database) and waits for it.
    pub async fn stop(self) -> Result<(), RestoreError> {
        let TempEtcd {
            process, _renewal, ..
        } = self;
        // Renewal ends first, so it does not log the stopping etcd's refusals.
        drop(_renewal);
        process
            .terminate(Duration::from_secs(60))
            .await
            .map_err(RestoreError::TempEtcd)
    }
}

/// Renews every lease of the etcd at `url` each [`LEASE_RENEWAL`] until `stop`. Failures are
/// logged only: the revision checks after a replay and of a compacted snapshot catch a lease
/// that expired anyway.
async fn renew_leases(url: String, stop: CancellationToken) {
    let client = match etcd_client::Client::connect([url.as_str()], None).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "connecting to the temporary etcd to renew its leases failed");
            return;
        }
    };
    let mut lease = client.lease_client();
    let ids: Vec<i64> = match lease.leases().await {
        Ok(r) => r.leases().iter().map(|l| l.id()).collect(),
        Err(e) => {
            tracing::warn!(error = %e, "listing the temporary etcd's leases failed");
            return;
        }
    };
    if ids.is_empty() {
        return;
    }
    tracing::info!(
        leases = ids.len(),
        "renewing the restored leases while the temporary etcd runs"
    );
    let mut keepers = Vec::with_capacity(ids.len());
    for id in ids {
        match lease.keep_alive(id).await {
            // The responses are not needed; the stream is kept so the call stays open.
            Ok(pair) => keepers.push(pair),
            Err(e) => tracing::warn!(lease = id, error = %e, "renewing a lease failed"),
        }
    }
    let mut tick = tokio::time::interval(LEASE_RENEWAL);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        for (keeper, responses) in &mut keepers {
            if let Err(e) = keeper.keep_alive().await {
                tracing::warn!(lease = keeper.id(), error = %e, "renewing a lease failed");
                continue;
            }
            // Drain the answer so the stream's buffer does not grow.
            let _ = tokio::time::timeout(LEASE_RENEWAL, responses.message()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_alone_is_its_own_initial_cluster() {
        let m = MemberParams::default();
        assert_eq!(m.initial_cluster(), "default=http://localhost:2380");
        assert!(!m.is_multi_member());
        let m = MemberParams {
            initial_cluster: "a=http://a:2380,b=http://b:2380".into(),
            ..m
        };
        assert!(m.is_multi_member());
    }

    #[test]
    fn a_member_with_two_peer_urls_is_still_one_member() {
        let m = MemberParams {
            initial_cluster: "a=http://a1:2380,a=http://a2:2380".into(),
            ..MemberParams::default()
        };
        assert!(!m.is_multi_member());
        let m = MemberParams {
            initial_cluster: "a=http://a1:2380,a=http://a2:2380,b=http://b:2380".into(),
            ..m
        };
        assert!(m.is_multi_member());
    }
}
