//! etcd's own tools, used by restore: `etcdutl snapshot restore` (3.5+) or `etcdctl snapshot
//! restore` (3.4), and a temporary etcd on loopback to replay deltas into.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use super::RestoreError;

/// Where the etcd binaries are and what they can do.
#[derive(Debug, Clone)]
pub struct EtcdTools {
    /// The `etcd` server binary.
    pub etcd: PathBuf,
    /// The binary that restores a snapshot file into a data directory.
    pub restorer: Restorer,
    /// `etcd --version`, e.g. (3, 5, 1).
    pub version: (u32, u32, u32),
}

/// `etcdutl` (3.5+) or `etcdctl` (3.4, which still restores snapshots itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restorer {
    Etcdutl(PathBuf),
    Etcdctl(PathBuf),
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

    /// Whether the cluster has more members than this one.
    pub fn is_multi_member(&self) -> bool {
        self.initial_cluster()
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .count()
            > 1
    }
}

fn find_in(dir: Option<&Path>, name: &str) -> Option<PathBuf> {
    match dir {
        Some(d) => Some(d.join(name)).filter(|p| p.is_file()),
        None => std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join(name))
            .find(|p| p.is_file()),
    }
}

/// Parses `etcd Version: 3.5.1` out of `etcd --version`.
pub fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("etcd Version:"))?
        .trim();
    let mut it = v.split(['.', '-', '+']).map(|p| p.parse::<u32>());
    Some((it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?))
}

impl EtcdTools {
    /// Finds the tools in `dir` (the `--etcd-bin` flag), else on `PATH`.
    pub async fn locate(dir: Option<&Path>) -> Result<EtcdTools, RestoreError> {
        let where_ = dir
            .map(|d| d.display().to_string())
            .unwrap_or_else(|| "PATH".into());
        let missing = |what: &str| {
            RestoreError::Tools(format!(
                "no {what} in {where_}; point --etcd-bin at etcd's binaries"
            ))
        };
        let etcd = find_in(dir, "etcd").ok_or_else(|| missing("etcd"))?;
        let out = Command::new(&etcd)
            .arg("--version")
            .output()
            .await
            .map_err(|e| {
                RestoreError::Tools(format!("running {} --version: {e}", etcd.display()))
            })?;
        let version = parse_version(&String::from_utf8_lossy(&out.stdout)).ok_or_else(|| {
            RestoreError::Tools(format!("{} --version printed no version", etcd.display()))
        })?;
        let restorer = match (find_in(dir, "etcdutl"), find_in(dir, "etcdctl")) {
            (Some(u), _) if version >= (3, 5, 0) => Restorer::Etcdutl(u),
            (_, Some(c)) if version < (3, 6, 0) => Restorer::Etcdctl(c),
            _ => {
                return Err(missing(if version >= (3, 5, 0) {
                    "etcdutl"
                } else {
                    "etcdctl"
                }));
            }
        };
        Ok(EtcdTools {
            etcd,
            restorer,
            version,
        })
    }

    /// Whether `etcd` accepts `--unsafe-no-fsync` (3.5+): the temporary etcd need not be durable,
    /// the result is synced once before it is moved into place.
    pub fn has_no_fsync(&self) -> bool {
        self.version >= (3, 5, 0)
    }

    /// Restores the snapshot file `db` (etcd's format, hash appended) into the new directory
    /// `data_dir` with etcd's own tool, which checks the hash.
    pub async fn restore_file(
        &self,
        db: &Path,
        data_dir: &Path,
        member: &MemberParams,
    ) -> Result<(), RestoreError> {
        self.restore_db(db, data_dir, member, true).await
    }

    /// Restores the database file `db`, which has no hash appended (one this program wrote),
    /// into the new directory `data_dir` with etcd's own tool.
    pub async fn restore_unhashed(
        &self,
        db: &Path,
        data_dir: &Path,
        member: &MemberParams,
    ) -> Result<(), RestoreError> {
        self.restore_db(db, data_dir, member, false).await
    }

    async fn restore_db(
        &self,
        db: &Path,
        data_dir: &Path,
        member: &MemberParams,
        hashed: bool,
    ) -> Result<(), RestoreError> {
        let (bin, env_api) = match &self.restorer {
            Restorer::Etcdutl(p) => (p, None),
            Restorer::Etcdctl(p) => (p, Some(("ETCDCTL_API", "3"))),
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
        if !hashed {
            cmd.arg("--skip-hash-check");
        }
        if let Some((k, v)) = env_api {
            cmd.env(k, v);
        }
        let out = cmd
            .output()
            .await
            .map_err(|e| RestoreError::Tools(format!("running {}: {e}", bin.display())))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim();
            return Err(RestoreError::Tools(format!(
                "{} snapshot restore failed ({}): {last}",
                bin.file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("etcd tool"),
                out.status
            )));
        }
        Ok(())
    }
}

/// A temporary etcd on a restored data directory, on free loopback ports, for replaying deltas.
pub struct TempEtcd {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub client_url: String,
    log: PathBuf,
}

fn free_port() -> Result<u16, RestoreError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| RestoreError::Tools(format!("no free loopback port: {e}")))
}

impl TempEtcd {
    /// Starts etcd on `data_dir` as member `name` and waits until it answers.
    pub async fn start(
        tools: &EtcdTools,
        data_dir: &Path,
        name: &str,
        log: PathBuf,
    ) -> Result<TempEtcd, RestoreError> {
        let client_url = format!("http://127.0.0.1:{}", free_port()?);
        let peer_url = format!("http://127.0.0.1:{}", free_port()?);
        let log_file = std::fs::File::create(&log).map_err(|e| RestoreError::io(&log, e))?;
        let log_err = log_file
            .try_clone()
            .map_err(|e| RestoreError::io(&log, e))?;
        let mut cmd = Command::new(&tools.etcd);
        cmd.arg("--name")
            .arg(name)
            .arg("--data-dir")
            .arg(data_dir)
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            // One revision may hold many events (a transaction, a revoked lease): allow big txns.
            .args([
                "--max-txn-ops",
                "1000000",
                "--max-request-bytes",
                "33554432",
            ])
            .args(["--quota-backend-bytes", "8589934592"])
            .args(["--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_file))
            .stderr(Stdio::from(log_err))
            .kill_on_drop(true);
        if tools.has_no_fsync() {
            cmd.arg("--unsafe-no-fsync");
        }
        let child = cmd
            .spawn()
            .map_err(|e| RestoreError::Tools(format!("starting {}: {e}", tools.etcd.display())))?;
        let mut temp = TempEtcd {
            child,
            client_url,
            log,
        };
        temp.wait_ready(Duration::from_secs(60)).await?;
        Ok(temp)
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), RestoreError> {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(RestoreError::Tools(format!(
                    "temporary etcd exited ({status}): {}",
                    self.log_tail()
                )));
            }
            if let Ok(mut c) = etcd_client::Client::connect([&self.client_url], None).await
                && c.status().await.is_ok()
            {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(RestoreError::Tools(format!(
                    "temporary etcd did not answer within {timeout:?}: {}",
                    self.log_tail()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .rev()
            .take(3)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join(" | ")
    }

    /// Stops etcd cleanly (SIGTERM, so it closes its database) and waits for it.
    pub async fn stop(mut self) -> Result<(), RestoreError> {
        if let Some(pid) = self.child.id() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(RestoreError::Tools(format!(
                "waiting for temporary etcd: {e}"
            ))),
            Err(_) => {
                let _ = self.child.kill().await;
                Err(RestoreError::Tools(
                    "temporary etcd did not stop within 60s".into(),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse() {
        assert_eq!(
            parse_version("etcd Version: 3.5.1\nGit SHA: x\n"),
            Some((3, 5, 1))
        );
        assert_eq!(parse_version("etcd Version: 3.4.23\n"), Some((3, 4, 23)));
        assert_eq!(parse_version("etcd Version: 3.6.0-rc.1\n"), Some((3, 6, 0)));
        assert_eq!(parse_version("nothing"), None);
    }

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
}
