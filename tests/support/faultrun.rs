//! One fault schedule against real processes, judged by the invariant checker.
//!
//! The world of a run: an embedded DNS server holding the owner record, `s3s-fs` behind a
//! [`FaultProxy`], one pod (a real PID namespace) per etcd member holding that member's etcd and
//! its `etcd-warden serve`, a [`Kubelet`] restarting dead containers, a [`Service`] in front of
//! etcd's client ports gated by the sidecars' `/healthz`, a [`Writer`] writing through the Service,
//! and a [`Monitor`] polling every sidecar. The run waits until every sidecar is ready and the
//! writer has written, plays the schedule, heals everything, leaves the record at the schedule's
//! ending, lets the system settle (bounded), stops the writer and checks the invariants.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::collections::BTreeSet;

use etcd_client::{Client, PutOptions};
use etcd_warden::owner::handoff::{HandOffObjects, the_final};
use etcd_warden::store::{Snapshot, SnapshotStore};
use object_store::ObjectStore;
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::dns::{DnsServer, Mode};
use super::etcd::Release;
use super::etcd::member_healthy;
use super::faultproxy::{FaultMode, FaultProxy};
use super::invariants::{
    self, Evidence, MemberNames, Monitor, Probe, Violation, fence_prefix, get_json,
};
use super::podns::{Exit, Kubelet, Pod, etcd_command, member_specs};
use super::s3::{ACCESS_KEY, REGION, S3Server, SECRET_KEY};
use super::schedule::{Burial, Ending, Fault, Schedule};
use super::service::{Backend, Service};
use super::writer::{Ack, Writer};
use super::{free_port, warden};
use etcd_warden::etcd::process::{self, MemberSpec};

/// The owner record every sidecar of a run watches.
pub const RECORD: &str = "owner.fault.warden.test";
/// This seed's owner ID.
pub const US: &str = "seed-a";
/// The other seed's.
pub const THEM: &str = "seed-b";
pub const BUCKET: &str = "backups";
pub const PREFIX: &str = "etcd";
/// Container indexes in a member's pod.
pub const ETCD: usize = 0;
pub const SIDECAR: usize = 1;
/// How long the kubelet waits before starting a dead container again.
const RESTART_DELAY: Duration = Duration::from_millis(200);
/// Settle bound when the record ends naming someone else (a final snapshot must appear).
const SETTLE_HANDOFF: Duration = Duration::from_secs(40);
/// Settle bound when it ends naming us.
const SETTLE_US: Duration = Duration::from_secs(20);

/// What one run found.
pub struct Outcome {
    pub schedule: Schedule,
    pub violations: Vec<Violation>,
    /// Findings that are not violations (e.g. the reasons a sidecar gives for no final).
    pub notes: Vec<String>,
    /// One line for the summary.
    pub summary: String,
    /// Everything needed to understand a failure: schedule, events, timeline, store, log tails.
    pub report: String,
    pub elapsed: Duration,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Shared event log of a run, with times since the run's epoch.
#[derive(Clone)]
pub struct Events {
    pub epoch: Instant,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Events {
    pub fn push(&self, line: impl AsRef<str>) {
        let t = self.epoch.elapsed().as_secs_f64();
        self.lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(format!("{t:8.3}s {}", line.as_ref()));
    }

    pub fn all(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Keys on short leases nobody keeps alive (`Schedule::leases`), written through the Service.
pub struct LeaseWriter {
    pub acks: Arc<Mutex<Vec<Ack>>>,
    pub stop: CancellationToken,
    pub task: JoinHandle<()>,
}

/// What happened around `etcd-warden reclaim` (`Ending::Reclaim`).
#[derive(Default)]
pub struct Reclaim {
    /// When it succeeded.
    pub at: Option<Duration>,
    /// What the CLI said last.
    pub said: String,
    /// The unreclaimed finals just before it.
    pub first_finals: Vec<String>,
    /// `/snapshot/latest` answers reporting a reclaimed final as final: (time, member, body).
    pub read_as_final: Arc<Mutex<Vec<(Duration, usize, String)>>>,
    pub poller: Option<JoinHandle<()>>,
}

/// Everything a run started; dropped in field order (clients first, pods, then servers).
pub struct World {
    pub writer: Option<Writer>,
    pub leases: Option<LeaseWriter>,
    pub reclaim: Reclaim,
    pub service: Option<Service>,
    pub monitor: Option<Monitor>,
    pub http: Vec<JoinHandle<()>>,
    pub kubelet: Kubelet,
    pub proxy: FaultProxy,
    pub s3: S3Server,
    pub dns: DnsServer,
    pub dns_stopped: bool,
    pub specs: Vec<MemberSpec>,
    pub names: Option<MemberNames>,
    /// Members killed for good.
    pub buried: Vec<usize>,
    /// Each sidecar's configuration keys (the CLI runs with them too).
    pub keys: Vec<Vec<(String, String)>>,
    pub sidecar_ports: Vec<u16>,
    /// Each sidecar's address (its port is `sidecar_ports`'): 127.0.0.1, or its member's own
    /// loopback address ([`WorldSpec::hosts`]).
    pub sidecar_hosts: Vec<std::net::Ipv4Addr>,
    pub sidecar_logs: Vec<PathBuf>,
    pub etcd_logs: Vec<PathBuf>,
    pub incarnations: Vec<Arc<AtomicU32>>,
    pub token: String,
    pub store: SnapshotStore,
    pub objects: HandOffObjects,
    pub raw_store: Arc<dyn ObjectStore>,
    pub events: Events,
    pub http_client: reqwest::Client,
    pub dir: tempfile::TempDir,
}

/// What a world is made of: a fault schedule's (`WorldSpec::of`) or a soak profile's.
#[derive(Debug, Clone)]
pub struct WorldSpec {
    pub seed: u64,
    pub members: usize,
    /// `owner.interval` (and `owner.timeout`) of the sidecars, ms.
    pub interval_ms: u64,
    /// The lease writer runs (`Schedule::leases`).
    pub leases: bool,
    /// The etcd release the members run.
    pub release: Release,
    /// Sidecar configuration keys beyond the fault schedules' (they win over those).
    pub extra_keys: Vec<(String, String)>,
    /// Buckets the S3 server holds beyond the primary's (a secondary store, a copy's destination).
    pub extra_buckets: Vec<String>,
    /// The plain writer (`/fault/<n>`, one put every 5 ms) runs.
    pub writer: bool,
    /// A directory holding a filesystem of its own for some members' data directories (a small
    /// tmpfs the harness fills to make the disk full): `<dir>/m<i>` where it exists; the others,
    /// and all with None, stay in the temp directory.
    pub data_mounts: Option<PathBuf>,
    /// Each sidecar's wall clock is faked ([`faked_clock`]) from `<dir>/<member>.clock`.
    pub clock_dir: Option<PathBuf>,
    /// Each member (its etcd and its sidecar) on a loopback address of its own,
    /// 127.0.0.(10 + i), and every sidecar on the same port, as the pods of a StatefulSet: what
    /// a sidecar needs to find the leader's from its etcd's client URL (etcd-druid's trigger
    /// forwarding).
    pub hosts: bool,
    /// (member, uid): that member's etcd runs under a uid of its own, so that its packets can be
    /// told apart (`iptables -m owner`: the soak's partition fault).
    pub own_uid: Option<(usize, u32)>,
    /// Environment of every sidecar beyond its keys (`KUBECONFIG`).
    pub sidecar_env: Vec<(String, String)>,
}

impl WorldSpec {
    /// The world of a fault schedule.
    pub fn of(schedule: &Schedule) -> WorldSpec {
        WorldSpec {
            seed: schedule.seed,
            members: schedule.members,
            interval_ms: schedule.interval_ms,
            leases: schedule.leases,
            release: Release::V35,
            extra_keys: Vec::new(),
            extra_buckets: Vec::new(),
            writer: true,
            data_mounts: None,
            clock_dir: None,
            hosts: false,
            own_uid: None,
            sidecar_env: Vec::new(),
        }
    }
}

/// The loopback address of member `i` when [`WorldSpec::hosts`] asks for one each.
pub fn member_host(i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, 0, 0, 10 + i as u8)
}

/// Configuration keys of the sidecar next to `spec`.
fn sidecar_keys(
    spec: &MemberSpec,
    world: &WorldSpec,
    listen: SocketAddr,
    dns: SocketAddr,
    store_endpoint: &str,
    token: &str,
) -> Vec<(String, String)> {
    let interval = format!("{}ms", world.interval_ms);
    [
        ("etcd.endpoints", spec.client_url()),
        ("store.url", format!("s3://{BUCKET}/{PREFIX}")),
        ("store.endpoint", store_endpoint.to_string()),
        ("store.region", REGION.to_string()),
        ("store.access_key_id", ACCESS_KEY.to_string()),
        ("store.secret_access_key", SECRET_KEY.to_string()),
        ("snapshot.delta_period", "300ms".into()),
        ("snapshot.leader_check_interval", "200ms".into()),
        // Short, so that a store answering late (Fault::StoreLate) outlasts the client's patience.
        ("snapshot.timeout", "3s".into()),
        ("owner.name", RECORD.into()),
        ("owner.id", US.into()),
        ("owner.interval", interval.clone()),
        ("owner.timeout", interval),
        ("owner.failure_threshold", "2".into()),
        // A member killed for good after its fence is taken over within seconds.
        ("owner.takeover_after", "2s".into()),
        // The fixture's records say TTL 60 s: trust none of it, see every change at the next check.
        ("owner.ttl_cap", "0s".into()),
        ("owner.nameservers", dns.to_string()),
        // The production configuration: the pod's PID namespace holds this member's etcd only.
        ("kill.process_name", "etcd".into()),
        ("kill.grace", "2s".into()),
        ("kill.settle", "1s".into()),
        ("server.listen", listen.to_string()),
        ("server.token", token.to_string()),
        // As production sidecars know it: where the watchdog reads the member ID from the
        // write-ahead log when etcd is down for good (a crash loop on a full disk).
        ("restore.data_dir", spec.data_dir.display().to_string()),
    ]
    .into_iter()
    // Releases from before the take-over refuse the key as unknown.
    .filter(|(k, _)| other_binary().is_none() || *k != "owner.takeover_after")
    .map(|(k, v)| (k.to_string(), v))
    .filter(|(k, _)| !world.extra_keys.iter().any(|(x, _)| x == k))
    .chain(world.extra_keys.iter().cloned())
    .collect()
}

/// Makes `data_dir` (under `world_dir`) a directory `uid` owns, and lets `uid` through
/// `world_dir`, so an etcd under that uid can create its member there.
fn own_data_dir(
    world_dir: &std::path::Path,
    data_dir: &std::path::Path,
    uid: u32,
) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut dir = data_dir.parent();
    while let Some(d) = dir {
        if !d.starts_with(world_dir) {
            break;
        }
        let mode = std::fs::metadata(d)?.permissions().mode();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o711))?;
        dir = d.parent();
    }
    std::fs::create_dir_all(data_dir)?;
    std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))?;
    std::os::unix::fs::chown(data_dir, Some(uid), Some(uid))
}

/// `cmd` run under `uid` (and that gid, no supplementary groups) through util-linux's `setpriv`,
/// which execs it: the pod's process is then `cmd`'s own.
fn as_uid(cmd: &std::process::Command, uid: u32) -> std::process::Command {
    let mut setpriv = std::process::Command::new("setpriv");
    setpriv.args([
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
        "--".into(),
    ]);
    super::podns::wrapping(setpriv, cmd)
}

/// `FAULT_BIN`: another build of `etcd-warden` to judge instead of this one (a previous release,
/// to show what the harness finds in it). Every sidecar and CLI call runs it.
pub fn other_binary() -> Option<std::path::PathBuf> {
    std::env::var_os("FAULT_BIN").map(std::path::PathBuf::from)
}

fn sidecar_command(keys: &[(String, String)]) -> std::process::Command {
    cli_command(keys, "serve")
}

/// libfaketime (Debian's `faketime` package), which the clock-jump fault needs.
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Runs `cmd` on a wall clock offset by what `file` says (`+0`, `+3600`, `-7200`: seconds), read
/// again every second: a clock that jumps as an NTP step does. The monotonic clock is left alone
/// (a step never moves it), so timeouts and intervals keep their length.
pub fn faked_clock(cmd: &mut std::process::Command, file: &std::path::Path) {
    if !file.exists() {
        let _ = std::fs::write(file, "+0\n");
    }
    cmd.env("LD_PRELOAD", LIBFAKETIME)
        .env("FAKETIME_TIMESTAMP_FILE", file)
        .env("FAKETIME_CACHE_DURATION", "1")
        .env("DONT_FAKE_MONOTONIC", "1");
}

/// Runs `etcd-warden <subcommand> <args>` ([`cli_command`]) off the async threads: whether it
/// succeeded, and its standard output then its standard error (or why it could not run).
pub async fn cli_output(
    keys: Vec<(String, String)>,
    subcommand: String,
    args: Vec<String>,
) -> (bool, String) {
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = cli_command(&keys, &subcommand);
        cmd.args(&args);
        cmd.output()
    })
    .await;
    match out {
        Ok(Ok(o)) => (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        ),
        Ok(Err(e)) => (false, e.to_string()),
        Err(e) => (false, e.to_string()),
    }
}

/// The last line of `s` that is not blank, at most 200 characters.
pub fn last_line(s: &str) -> String {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .chars()
        .take(200)
        .collect()
}

/// `etcd-warden <subcommand>` with a sidecar's configuration in its environment.
pub fn cli_command(keys: &[(String, String)], subcommand: &str) -> std::process::Command {
    let mut cmd = match other_binary() {
        Some(bin) => warden::command_of(&bin),
        None => warden::command(),
    };
    cmd.arg(subcommand);
    for (k, v) in keys {
        cmd.env(
            format!("ETCD_WARDEN_{}", k.replace('.', "_").to_ascii_uppercase()),
            v,
        );
    }
    cmd
}

pub fn tail(text: &str, n: usize, skip_debug: bool) -> String {
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !skip_debug || !l.contains("DEBUG"))
        .collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl World {
    /// Sidecar `m`'s address.
    pub fn sidecar_addr(&self, m: usize) -> SocketAddr {
        (self.sidecar_hosts[m], self.sidecar_ports[m]).into()
    }

    /// `http://<sidecar m>{path}`.
    pub fn sidecar_url(&self, m: usize, path: &str) -> String {
        format!("http://{}{path}", self.sidecar_addr(m))
    }

    pub async fn start(
        schedule: &WorldSpec,
        epoch: Instant,
    ) -> Result<World, (String, Option<World>)> {
        World::start_with(schedule, epoch, |_, _, _| {}).await
    }

    /// As [`World::start`], with `adjust` given each member's index, the S3 server's own
    /// endpoint (not the fault proxy's) and each sidecar's keys before it starts.
    pub async fn start_with(
        schedule: &WorldSpec,
        epoch: Instant,
        adjust: impl Fn(usize, &str, &mut Vec<(String, String)>),
    ) -> Result<World, (String, Option<World>)> {
        let events = Events {
            epoch,
            lines: Arc::new(Mutex::new(Vec::new())),
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let dns = DnsServer::start().await;
        dns.set_txt(RECORD, &[US]).await;
        let mut buckets = vec![BUCKET];
        buckets.extend(schedule.extra_buckets.iter().map(String::as_str));
        let s3 = S3Server::start(&buckets);
        let s3_addr: SocketAddr = ([127, 0, 0, 1], s3.port).into();
        let proxy = FaultProxy::start(s3_addr).await;
        let token = format!("fault-token-{:x}", schedule.seed);
        let mut specs = member_specs(
            schedule.members,
            dir.path(),
            &format!("fault-{}-{:x}", std::process::id(), schedule.seed),
        );
        if schedule.hosts {
            for (i, spec) in specs.iter_mut().enumerate() {
                spec.host = member_host(i);
            }
            let initial_cluster = process::initial_cluster(&specs);
            for spec in &mut specs {
                if let Some(b) = spec.bootstrap.as_mut() {
                    b.initial_cluster = Some(initial_cluster.clone());
                }
            }
        }
        if let Some(mounts) = &schedule.data_mounts {
            for spec in &mut specs {
                // Only the members given a directory there (a filesystem of their own).
                if mounts.join(&spec.name).is_dir() {
                    spec.data_dir = mounts.join(&spec.name).join("data");
                }
            }
        }
        let mut pods = Vec::new();
        let mut sidecar_ports = Vec::new();
        let mut sidecar_logs = Vec::new();
        let mut etcd_logs = Vec::new();
        let mut incarnations = Vec::new();
        let mut all_keys = Vec::new();
        let mut sidecar_hosts = Vec::new();
        // With a host each, the sidecars share one port (a StatefulSet's pods do).
        let shared_port = schedule.hosts.then(free_port);
        if let Some((m, uid)) = schedule.own_uid {
            own_data_dir(dir.path(), &specs[m].data_dir, uid)
                .map_err(|e| (format!("m{m}'s data directory for uid {uid}: {e}"), None))?;
        }
        for (i, spec) in specs.iter().enumerate() {
            let mut pod = Pod::new(&format!("pod-{}", spec.name));
            let etcd_log = dir.path().join(format!("{}.etcd.log", spec.name));
            let s = spec.clone();
            let release = schedule.release;
            let uid = schedule
                .own_uid
                .and_then(|(m, uid)| (m == i).then_some(uid));
            pod.add("etcd", etcd_log.clone(), move || {
                let cmd = etcd_command(&s, release);
                match uid {
                    Some(uid) => as_uid(&cmd, uid),
                    None => cmd,
                }
            });
            let port = shared_port.unwrap_or_else(free_port);
            let host = if schedule.hosts {
                spec.host
            } else {
                std::net::Ipv4Addr::LOCALHOST
            };
            let mut keys = sidecar_keys(
                spec,
                schedule,
                (host, port).into(),
                dns.addr(),
                &proxy.endpoint(),
                &token,
            );
            adjust(i, &s3.endpoint(), &mut keys);
            sidecar_hosts.push(host);
            let log = dir.path().join(format!("{}.sidecar.log", spec.name));
            all_keys.push(keys.clone());
            let clock = schedule
                .clock_dir
                .as_ref()
                .map(|d| d.join(format!("{}.clock", spec.name)));
            let env = schedule.sidecar_env.clone();
            pod.add("sidecar", log.clone(), move || {
                let mut cmd = sidecar_command(&keys);
                cmd.envs(env.iter().map(|(k, v)| (k, v)));
                if let Some(file) = &clock {
                    faked_clock(&mut cmd, file);
                }
                cmd
            });
            incarnations.push(pod.containers[SIDECAR].incarnation.clone());
            pod.start(ETCD);
            pods.push(pod);
            sidecar_ports.push(port);
            sidecar_logs.push(log);
            etcd_logs.push(etcd_log);
        }
        let kubelet = Kubelet::start(pods, RESTART_DELAY);
        let store = SnapshotStore::new(s3.object_store(BUCKET), PREFIX);
        let raw_store: Arc<dyn ObjectStore> = s3.object_store(BUCKET);
        let objects = HandOffObjects::new(store.clone());
        let mut world = World {
            writer: None,
            leases: None,
            reclaim: Reclaim::default(),
            service: None,
            monitor: None,
            http: Vec::new(),
            kubelet,
            proxy,
            s3,
            dns,
            dns_stopped: false,
            specs,
            names: None,
            buried: Vec::new(),
            keys: all_keys,
            sidecar_ports,
            sidecar_hosts,
            sidecar_logs,
            etcd_logs,
            incarnations,
            token,
            store,
            objects,
            raw_store,
            events,
            http_client: super::http_client(Duration::from_secs(20)),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        for spec in &world.specs {
            while !member_healthy(&spec.client_url()).await {
                if Instant::now() > deadline {
                    return Err((format!("etcd {} never healthy", spec.name), Some(world)));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let names = match member_names(&world.specs).await {
            Ok(n) => n,
            Err(e) => return Err((format!("member list: {e}"), Some(world))),
        };
        for m in 0..world.specs.len() {
            world.kubelet.with_pod(m, |p| p.start(SIDECAR));
        }
        let probes = (0..world.specs.len())
            .map(|m| Probe {
                member: m,
                addr: world.sidecar_addr(m),
                incarnation: world.incarnations[m].clone(),
            })
            .collect();
        world.monitor = Some(Monitor::start(
            probes,
            world.raw_store.clone(),
            fence_prefix(PREFIX),
            names.clone(),
            epoch,
            Duration::from_millis(40),
        ));
        world.names = Some(names);
        let all_ready = super::eventually(Duration::from_secs(30), || async {
            world.monitor.as_ref().is_some_and(|mon| {
                mon.with(|o| {
                    (0..world.specs.len()).all(|m| {
                        o.current(m)
                            .and_then(|t| t.last_healthz.as_ref())
                            .is_some_and(|(c, _)| *c == 200)
                    })
                })
            })
        })
        .await;
        if !all_ready {
            return Err((
                "not every sidecar became ready within 30 s".into(),
                Some(world),
            ));
        }
        let backends = (0..world.specs.len())
            .map(|m| Backend {
                target: (world.specs[m].host, world.specs[m].client_port).into(),
                health: world.sidecar_url(m, "/healthz"),
            })
            .collect();
        let service = Service::start(backends, Duration::from_millis(50)).await;
        if schedule.writer {
            world.writer = Some(Writer::start(
                service.endpoint(),
                "/fault".into(),
                epoch,
                Duration::from_millis(5),
            ));
        }
        if schedule.leases {
            let acks = Arc::new(Mutex::new(Vec::new()));
            let stop = CancellationToken::new();
            let task = tokio::spawn(lease_writer(
                service.endpoint(),
                epoch,
                acks.clone(),
                stop.clone(),
            ));
            world.leases = Some(LeaseWriter { acks, stop, task });
        }
        world.service = Some(service);
        let wrote = !schedule.writer
            || super::eventually(Duration::from_secs(15), || async {
                world.writer.as_ref().is_some_and(|w| w.ack_count() >= 10)
            })
            .await;
        if !wrote {
            return Err((
                "the writer got no acknowledged write through the Service within 15 s".into(),
                Some(world),
            ));
        }
        world
            .events
            .push("setup done: every sidecar ready, writer writing");
        Ok(world)
    }

    pub fn monitor(&self) -> &Monitor {
        self.monitor.as_ref().expect("monitor started")
    }

    pub async fn apply(&mut self, fault: Fault) {
        self.events.push(fault.to_string());
        match fault {
            Fault::RecordOther => self.dns.set_txt(RECORD, &[THEM]).await,
            Fault::RecordDeleted => self.dns.remove_txt(RECORD).await,
            Fault::RecordUs => self.dns.set_txt(RECORD, &[US]).await,
            Fault::DnsServFail => self.dns.set_mode(Mode::ServFail),
            Fault::DnsSilent => self.dns.set_mode(Mode::Silent),
            Fault::DnsStop => {
                self.dns.stop().await;
                self.dns_stopped = true;
            }
            Fault::DnsHeal => self.heal_dns().await,
            Fault::StoreDown => self.proxy.set(FaultMode::Down),
            Fault::StoreSlow(ms) => self.proxy.set(FaultMode::Slow(Duration::from_millis(ms))),
            Fault::StoreBlackhole => self.proxy.set(FaultMode::Blackhole),
            Fault::StoreLoseAnswers => self.proxy.set(FaultMode::LoseAnswers),
            Fault::StoreLate(ms) => self.proxy.set(FaultMode::Late(Duration::from_millis(ms))),
            Fault::StoreHeal => self.proxy.set(FaultMode::Pass),
            Fault::SidecarKill { member, down_ms } => {
                let killed = self
                    .kubelet
                    .with_pod(member, |p| p.kill(SIDECAR, Duration::from_millis(down_ms)));
                if !killed {
                    self.events
                        .push(format!("  m{member}'s sidecar was not running"));
                }
            }
            Fault::SidecarKillWhenDeactivated { member, down_ms } => {
                let url = self.sidecar_url(member, "/status");
                let client = super::http_client(Duration::from_millis(300));
                let start = Instant::now();
                let mut killed = false;
                while start.elapsed() < Duration::from_secs(3) {
                    if let Some((200, s)) = get_json(&client, &url).await
                        && s["owner"]["state"] == "deactivated"
                    {
                        killed = self
                            .kubelet
                            .with_pod(member, |p| p.kill(SIDECAR, Duration::from_millis(down_ms)));
                        self.events.push(format!(
                            "  m{member} showed deactivated ({}): killed={killed}",
                            s["owner"]["detail"]
                        ));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if !killed {
                    self.events.push(format!(
                        "  m{member} not deactivated within 3 s: not killed"
                    ));
                }
            }
            Fault::EtcdKill { member } => {
                let killed = self
                    .kubelet
                    .with_pod(member, |p| p.kill(ETCD, Duration::ZERO));
                if !killed {
                    self.events
                        .push(format!("  m{member}'s etcd was not running"));
                }
            }
            Fault::HttpFull { member } => self.post(member, "/snapshot/full"),
            Fault::HttpFinal { member } => self.post(member, "/snapshot/full?final=true"),
            Fault::HttpDelta { member } => self.post(member, "/snapshot/delta"),
        }
    }

    /// POSTs in the background (a snapshot may take a while); the answer goes to the event log.
    pub fn post(&mut self, member: usize, path: &str) {
        let url = self.sidecar_url(member, path);
        let (client, token, events) = (
            self.http_client.clone(),
            self.token.clone(),
            self.events.clone(),
        );
        let path = path.to_string();
        self.http.push(tokio::spawn(async move {
            let answer = match client.post(&url).bearer_auth(token).send().await {
                Ok(r) => {
                    let code = r.status().as_u16();
                    let body = r.text().await.unwrap_or_default();
                    format!("{code} {}", body.chars().take(200).collect::<String>())
                }
                Err(e) => format!("no answer: {e}"),
            };
            events.push(format!("  POST m{member} {path} → {answer}"));
        }));
    }

    pub async fn heal_dns(&mut self) {
        self.dns.set_mode(Mode::Normal);
        if self.dns_stopped {
            self.dns.restart().await;
            self.dns_stopped = false;
        }
    }

    /// Heals everything and leaves the record at `ending`.
    pub async fn heal(&mut self, ending: Ending) {
        self.heal_dns().await;
        self.proxy.set(FaultMode::Pass);
        match ending {
            Ending::Other | Ending::Reclaim => self.dns.set_txt(RECORD, &[THEM]).await,
            Ending::Deleted => self.dns.remove_txt(RECORD).await,
            Ending::Us => self.dns.set_txt(RECORD, &[US]).await,
        }
        self.events.push(format!(
            "healed: DNS answering, store passing, record → {ending:?}"
        ));
    }

    /// Each member's current sidecar state as the monitor last saw it: (state, ready).
    pub fn states(&self) -> Vec<(String, bool)> {
        self.monitor().with(|o| {
            (0..self.specs.len())
                .map(|m| {
                    o.current(m)
                        .map(|t| {
                            let state = t
                                .last_status
                                .as_ref()
                                .and_then(|s| s["owner"]["state"].as_str())
                                .unwrap_or("?")
                                .to_string();
                            let ready = t.last_healthz.as_ref().is_some_and(|(c, _)| *c == 200);
                            (state, ready)
                        })
                        .unwrap_or(("?".into(), false))
                })
                .collect()
        })
    }

    /// Waits (bounded) until the system has done what the ending asks for.
    pub async fn settle(&mut self, ending: Ending) {
        let start = Instant::now();
        let bound = if ending.hands_off() {
            SETTLE_HANDOFF
        } else {
            SETTLE_US
        };
        loop {
            let final_latest = self.latest_is_final().await;
            let states: Vec<(String, bool)> = self
                .states()
                .into_iter()
                .enumerate()
                .filter(|(m, _)| !self.buried.contains(m))
                .map(|(_, s)| s)
                .collect();
            let all = |f: &dyn Fn(&(String, bool)) -> bool| states.iter().all(f);
            let active = |s: &(String, bool)| s.0 == "active" && s.1;
            let deactivated = |s: &(String, bool)| s.0 == "deactivated";
            let done = if ending.hands_off() {
                final_latest && all(&deactivated)
            } else {
                all(&active)
                    || (all(&|s| active(s) || deactivated(s))
                        && (final_latest || start.elapsed() > Duration::from_secs(10)))
            };
            if done {
                self.events.push(format!(
                    "settled after {:.1}s: {states:?}, latest full final: {final_latest}",
                    start.elapsed().as_secs_f64()
                ));
                // Long enough for a late violation (a second final, a 200 after deactivation).
                tokio::time::sleep(Duration::from_millis(1500)).await;
                return;
            }
            if start.elapsed() > bound {
                self.events.push(format!(
                    "not settled after {bound:?}: {states:?}, latest full final: {final_latest}"
                ));
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Whether the latest full snapshot is final as every reader sees it (the_final decides).
    pub async fn latest_is_final(&self) -> bool {
        self.objects
            .latest_chain()
            .await
            .is_ok_and(|c| c.full_snapshot.is_some_and(|s| s.is_final))
    }

    /// What the schedule plays after the record's final change: a store fault timed to meet the
    /// final's upload, and a member killed for good right after its fence; at once.
    pub async fn end_play(&mut self, schedule: &Schedule) {
        let store = async {
            let Some(e) = schedule.end_store else { return };
            tokio::time::sleep(Duration::from_millis(e.after_ms)).await;
            self.events.push(format!("end: {}", e.fault));
            match e.fault {
                Fault::StoreLate(ms) => self.proxy.set(FaultMode::Late(Duration::from_millis(ms))),
                _ => self.proxy.set(FaultMode::LoseAnswers),
            }
            tokio::time::sleep(Duration::from_millis(e.for_ms)).await;
            self.proxy.set(FaultMode::Pass);
            self.events.push("end: store healed");
        };
        let burial = async {
            let target = match (schedule.burial, &self.names) {
                (Some(Burial::Member(m)), _) => m,
                (Some(Burial::Taker), Some(names)) => (0..names.ids.len())
                    .min_by_key(|&m| names.ids[m])
                    .unwrap_or(0),
                _ => return None,
            };
            let fenced = super::eventually(Duration::from_secs(20), || async {
                self.monitor().with(|o| o.fence_seen.contains_key(&target))
            })
            .await;
            if !fenced {
                self.events.push(format!(
                    "end: m{target}'s fence marker not listed within 20 s: not buried"
                ));
                return None;
            }
            let (sidecar, etcd) = self
                .kubelet
                .with_pod(target, |p| (p.bury(SIDECAR), p.bury(ETCD)));
            self.events.push(format!(
                "end: m{target} fenced: buried (sidecar was running: {sidecar}, etcd: {etcd})"
            ));
            Some(target)
        };
        let ((), buried) = tokio::join!(store, burial);
        self.buried.extend(buried);
    }

    /// `Ending::Reclaim` after the first hand-off settled: the record names us again, `etcd-warden
    /// reclaim` undoes the hand-off, every sidecar is restarted and serves (the writers go on),
    /// then the record names another seed again. The caller settles the second hand-off.
    pub async fn reclaim_and_flip_again(&mut self) {
        if !self.reclaim().await {
            return;
        }
        // Serve with writes for a while, then the second hand-off.
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.dns.set_txt(RECORD, &[THEM]).await;
        self.events
            .push("reclaim: record → other (the second hand-off)");
    }

    /// The record names us again and `etcd-warden reclaim` undoes the hand-off (retried for up to
    /// 15 s), every sidecar is SIGKILLed and restarted by the kubelet, and the run waits (up to
    /// 30 s) until each is active and ready. False when the reclaim did not succeed.
    pub async fn reclaim(&mut self) -> bool {
        self.reclaim.first_finals = self
            .objects
            .finals()
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|s| s.snap_name)
            .collect();
        self.dns.set_txt(RECORD, &[US]).await;
        self.events.push("reclaim: record → us");
        let keys = self.keys[0].clone();
        let start = Instant::now();
        loop {
            let k = keys.clone();
            let out =
                tokio::task::spawn_blocking(move || cli_command(&k, "reclaim").output()).await;
            let (ok, said) = match out {
                Ok(Ok(o)) => (
                    o.status.success(),
                    format!(
                        "{} {}",
                        String::from_utf8_lossy(&o.stdout).trim(),
                        String::from_utf8_lossy(&o.stderr).trim()
                    ),
                ),
                Ok(Err(e)) => (false, e.to_string()),
                Err(e) => (false, e.to_string()),
            };
            let said: String = said.chars().take(400).collect();
            self.events.push(format!("reclaim: ok={ok}: {said}"));
            self.reclaim.said = said;
            if ok {
                break;
            }
            if start.elapsed() > Duration::from_secs(15) {
                self.events.push("reclaim: gave up after 15 s");
                return false;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let epoch = self.events.epoch;
        self.reclaim.at = Some(epoch.elapsed());
        self.monitor()
            .observed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget_fences(epoch.elapsed());
        let reclaimed = self.objects.reclaimed().await.unwrap_or_default();
        if let Some(p) = self.reclaim.poller.take() {
            p.abort();
        }
        self.reclaim.poller = Some(tokio::spawn(watch_latest(
            (0..self.specs.len())
                .map(|m| self.sidecar_addr(m))
                .collect(),
            reclaimed,
            self.reclaim.read_as_final.clone(),
            epoch,
        )));
        for m in 0..self.specs.len() {
            self.kubelet
                .with_pod(m, |p| p.kill(SIDECAR, Duration::ZERO));
        }
        self.events
            .push("reclaim: every sidecar SIGKILLed (the kubelet restarts them)");
        // A fence listing in flight during the reclaim may have put a deleted marker back.
        tokio::time::sleep(Duration::from_millis(400)).await;
        self.monitor()
            .observed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget_fences(epoch.elapsed());
        let serving = super::eventually(Duration::from_secs(30), || async {
            self.states().iter().all(|(s, r)| s == "active" && *r)
        })
        .await;
        self.events.push(format!(
            "reclaim: every sidecar active and ready: {serving} {:?}",
            self.states()
        ));
        true
    }

    /// Every sidecar's `/status` answer, by member (`None` unless it answered 200).
    pub async fn sidecar_statuses(&self) -> Vec<Option<serde_json::Value>> {
        let mut statuses = Vec::new();
        for m in 0..self.specs.len() {
            let url = self.sidecar_url(m, "/status");
            statuses.push(
                get_json(&self.http_client, &url)
                    .await
                    .filter(|(c, _)| *c == 200)
                    .map(|(_, v)| v),
            );
        }
        statuses
    }

    /// Every sidecar's log so far, by member.
    pub fn sidecar_log_texts(&self) -> Vec<String> {
        self.sidecar_logs
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .collect()
    }

    /// The reclaimed finals read as the final so far (what the reclaim recorded).
    pub fn read_as_final(&self) -> Vec<(Duration, usize, String)> {
        self.reclaim
            .read_as_final
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn sidecar_exits(&self) -> Vec<Exit> {
        (0..self.specs.len())
            .flat_map(|m| {
                self.kubelet
                    .with_pod(m, |p| p.containers[SIDECAR].exits.clone())
                    .into_iter()
                    .map(move |mut x| {
                        x.container = format!("m{m}/sidecar");
                        x
                    })
            })
            .collect()
    }

    pub fn restarts(&self, c: usize) -> Vec<u32> {
        (0..self.specs.len())
            .map(|m| self.kubelet.with_pod(m, |p| p.containers[c].restarts))
            .collect()
    }

    /// The part of a report every outcome shares.
    pub fn describe(&self, out: &mut String, snapshots: &[Snapshot]) {
        let _ = writeln!(out, "events:");
        for e in self.events.all() {
            let _ = writeln!(out, "  {e}");
        }
        if let Some(mon) = &self.monitor {
            mon.with(|o| {
                let _ = writeln!(out, "sidecar timeline (state changes, last 150):");
                for l in &o.timeline[o.timeline.len().saturating_sub(150)..] {
                    let _ = writeln!(out, "  {l}");
                }
                let _ = writeln!(out, "fence markers: {:?}", o.fence_objects);
            });
        }
        let _ = writeln!(out, "container exits (last 12 per member):");
        for m in 0..self.specs.len() {
            let exits: Vec<String> = self.kubelet.with_pod(m, |p| {
                p.containers
                    .iter()
                    .flat_map(|c| c.exits.iter())
                    .map(|x| {
                        format!(
                            "{}#{} {} after {:.1}s{}",
                            x.container,
                            x.incarnation,
                            x.status,
                            x.after.as_secs_f64(),
                            if x.expected { "" } else { " (on its own)" }
                        )
                    })
                    .collect()
            });
            for x in &exits[exits.len().saturating_sub(12)..] {
                let _ = writeln!(out, "  m{m} {x}");
            }
        }
        let _ = writeln!(out, "store listing ({PREFIX}/v2/):");
        for s in snapshots {
            let _ = writeln!(out, "  {}", s.snap_name);
        }
        if let Some(w) = &self.writer {
            let acks = w.acks();
            let _ = writeln!(
                out,
                "writer: {} acknowledged (max revision {:?}, last at {:?}), {} failures; recent errors:",
                acks.len(),
                acks.iter().map(|a| a.revision).max(),
                acks.last().map(|a| a.at),
                w.failures()
            );
            for (t, e) in w.recent_errors().iter().rev().take(8).rev() {
                let _ = writeln!(out, "  {:8.3}s {e}", t.as_secs_f64());
            }
        }
        if let Some(s) = &self.service {
            let _ = writeln!(
                out,
                "service: forwarded {:?}, closed for want of a ready member {}",
                s.forwarded(),
                s.refused()
            );
        }
        for m in 0..self.specs.len() {
            let log = std::fs::read_to_string(&self.sidecar_logs[m]).unwrap_or_default();
            let _ = writeln!(
                out,
                "---- m{m} sidecar log (tail, DEBUG lines left out) ----"
            );
            let _ = writeln!(out, "{}", tail(&log, 60, true));
            let log = std::fs::read_to_string(&self.etcd_logs[m]).unwrap_or_default();
            let _ = writeln!(out, "---- m{m} etcd log (tail) ----");
            let _ = writeln!(out, "{}", tail(&log, 10, false));
        }
    }
}

/// Puts `/lease/<n>` keys through `endpoint`, each on its own fresh lease of 1–3 s that nobody
/// keeps alive, one every ~100 ms, recording every acknowledged put: after a kill their expiry
/// moves etcd's revision without any client write.
async fn lease_writer(
    endpoint: String,
    epoch: Instant,
    acks: Arc<Mutex<Vec<Ack>>>,
    stop: CancellationToken,
) {
    let mut client: Option<Client> = None;
    let mut n: u64 = 0;
    while !stop.is_cancelled() {
        if client.is_none() {
            client = super::writer::connect(&endpoint).await.ok();
        }
        if let Some(c) = client.as_mut() {
            let key = format!("/lease/{n:08}");
            let ttl = 1 + (n % 3) as i64;
            n += 1;
            let put = async {
                let lease = c.lease_grant(ttl, None).await?;
                c.put(
                    key.clone(),
                    "x",
                    Some(PutOptions::new().with_lease(lease.id())),
                )
                .await
            };
            let answer = tokio::select! {
                _ = stop.cancelled() => return,
                a = tokio::time::timeout(Duration::from_secs(3), put) => a,
            };
            match answer {
                Ok(Ok(resp)) => acks.lock().unwrap_or_else(|e| e.into_inner()).push(Ack {
                    key,
                    revision: resp.header().map(|h| h.revision()).unwrap_or(0),
                    at: epoch.elapsed(),
                }),
                _ => client = None,
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// Polls every sidecar's `/snapshot/latest` every 100 ms, recording each answer that reports a
/// final of `reclaimed` as final (a flow polling `isFinal` would take it for the next hand-off's).
async fn watch_latest(
    sidecars: Vec<SocketAddr>,
    reclaimed: BTreeSet<String>,
    found: Arc<Mutex<Vec<(Duration, usize, String)>>>,
    epoch: Instant,
) {
    let client = super::http_client(Duration::from_millis(800));
    loop {
        for (m, addr) in sidecars.iter().enumerate() {
            let url = format!("http://{addr}/snapshot/latest");
            if let Some((200, body)) = get_json(&client, &url).await {
                let full = &body["fullSnapshot"];
                let name = full["snapName"].as_str().unwrap_or_default();
                if full["isFinal"] == true && reclaimed.contains(name) {
                    let mut f = found.lock().unwrap_or_else(|e| e.into_inner());
                    if f.len() < 20 {
                        f.push((epoch.elapsed(), m, body.to_string()));
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn member_names(specs: &[MemberSpec]) -> Result<MemberNames, etcd_client::Error> {
    let endpoints: Vec<String> = specs.iter().map(MemberSpec::client_url).collect();
    let mut client = etcd_client::Client::connect(endpoints, None).await?;
    let list = client.member_list().await?;
    let ids = specs
        .iter()
        .map(|s| {
            list.members()
                .iter()
                .find(|m| m.name() == s.name)
                .map(|m| m.id())
                .unwrap_or(0)
        })
        .collect();
    Ok(MemberNames {
        names: specs.iter().map(|s| s.name.clone()).collect(),
        ids,
    })
}

/// Runs `schedule` from scratch and judges it.
pub async fn run(schedule: &Schedule) -> Outcome {
    let epoch = Instant::now();
    let mut world = match World::start(&WorldSpec::of(schedule), epoch).await {
        Ok(w) => w,
        Err((why, world)) => {
            let mut report = format!("{schedule}\nsetup failed: {why}\n");
            if let Some(w) = &world {
                let snapshots = w.store.list().await.unwrap_or_default();
                w.describe(&mut report, &snapshots);
            }
            let violations = vec![Violation {
                kind: "setup",
                detail: why,
            }];
            return Outcome {
                summary: summary_line(schedule, &violations, "setup failed", epoch.elapsed()),
                schedule: schedule.clone(),
                violations,
                notes: Vec::new(),
                report,
                elapsed: epoch.elapsed(),
            };
        }
    };

    let ownership = super::timeline::watch_world(&world);
    for step in &schedule.steps {
        tokio::time::sleep(Duration::from_millis(step.wait_ms)).await;
        world.apply(step.fault).await;
    }
    world.heal(schedule.ending).await;
    world.end_play(schedule).await;
    // etcd is running again in every pod (the kubelet restarts it within RESTART_DELAY + start),
    // except in a buried member's.
    world.settle(schedule.ending).await;
    if schedule.ending == Ending::Reclaim {
        world.reclaim_and_flip_again().await;
        world.settle(schedule.ending).await;
    }

    let mut writer = world.writer.take().expect("writer started");
    writer.stop().await;
    let mut acks = writer.acks();
    if let Some(l) = world.leases.take() {
        l.stop.cancel();
        let _ = l.task.await;
        let lease_acks = l.acks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        world.events.push(format!(
            "lease writer: {} keys on 1–3 s leases acknowledged",
            lease_acks.len()
        ));
        acks.extend(lease_acks);
        acks.sort_by_key(|a| a.revision);
    }
    if let Some(p) = world.reclaim.poller.take() {
        p.abort();
    }
    for h in world.http.drain(..) {
        h.abort();
    }
    world.monitor().stop();
    let final_status = world.sidecar_statuses().await;
    let snapshots = world.store.list().await.unwrap_or_default();
    let seen = world.objects.seen().await.unwrap_or_default();
    let named = the_final(&snapshots, &seen).map(|s| s.snap_name.clone());
    let latest_final = world.latest_is_final().await;
    let read_as_final = world.read_as_final();
    let sidecar_exits = world.sidecar_exits();
    world.kubelet.stop();
    let sidecar_logs = world.sidecar_log_texts();
    let etcd_ok = (0..world.specs.len())
        .filter(|m| !world.buried.contains(m))
        .all(|m| world.kubelet.with_pod(m, |p| p.process(ETCD).is_some()));
    let (mut violations, notes) = world.monitor().with(|observed| {
        invariants::check(&Evidence {
            ending: schedule.ending,
            healed: etcd_ok,
            acks: &acks,
            snapshots: &snapshots,
            observed,
            final_status: &final_status,
            sidecar_exits: &sidecar_exits,
            sidecar_logs: &sidecar_logs,
            reclaimed: &seen.reclaimed,
            the_final: named.as_deref(),
            latest_final,
            reclaim_at: world.reclaim.at,
            reclaimed_at: None,
            first_finals: &world.reclaim.first_finals,
            reclaimed_read_as_final: &read_as_final,
            buried: &world.buried,
        })
    });

    // Ownership against the owner record, over the whole run.
    ownership.stop();
    let finals: Vec<(String, i64, Option<Duration>)> = snapshots
        .iter()
        .filter(|s| s.is_final)
        .map(|s| {
            let until = seen
                .reclaimed
                .contains(&s.snap_name)
                .then_some(world.reclaim.at.unwrap_or(Duration::MAX));
            (s.snap_name.clone(), s.last_revision, until)
        })
        .collect();
    let timeline = super::timeline::world_timeline(&world, &ownership, &finals, &acks);
    violations.extend(super::timeline::judge(
        &timeline,
        &super::timeline::world_bounds(&world),
    ));
    if schedule.ending == Ending::Reclaim && world.reclaim.at.is_none() {
        violations.push(Violation {
            kind: "reclaim-failed",
            detail: format!(
                "`etcd-warden reclaim` did not succeed within 15 s of the record naming us again \
                 after the first hand-off: {}",
                world.reclaim.said
            ),
        });
    }
    let finals: Vec<String> = snapshots
        .iter()
        .filter(|s| s.is_final)
        .map(|s| {
            let mark = if seen.reclaimed.contains(&s.snap_name) {
                "(reclaimed)"
            } else if named.as_deref() == Some(s.snap_name.as_str()) {
                ""
            } else {
                "(unnamed)"
            };
            format!("@{}{mark}", s.last_revision)
        })
        .collect();
    let fences = world.monitor().with(|o| {
        (
            o.fence_seen.len(),
            o.fence_objects.values().filter(|m| m.is_none()).count(),
        )
    });
    let detail = format!(
        "acks={} max_rev={} finals=[{}] fenced={}/{}{} etcd_restarts={:?} sidecar_restarts={:?}",
        acks.len(),
        acks.iter().map(|a| a.revision).max().unwrap_or(0),
        finals.join(","),
        fences.0,
        schedule.members,
        if fences.1 > 0 {
            format!(" (+{} unattributed markers)", fences.1)
        } else {
            String::new()
        },
        world.restarts(ETCD),
        world.restarts(SIDECAR),
    );
    let mut extra = Vec::new();
    let lost = world
        .proxy
        .counts
        .lost
        .load(std::sync::atomic::Ordering::SeqCst);
    let late = world
        .proxy
        .counts
        .late
        .load(std::sync::atomic::Ordering::SeqCst);
    if lost + late > 0 {
        extra.push(format!("store_answers_lost={lost} late={late}"));
    }
    let claims = world.objects.claims().await.unwrap_or_default();
    if claims.len() > 1 {
        let who: Vec<String> = claims
            .iter()
            .map(|c| {
                let id = c.member().unwrap_or(0);
                let m = world
                    .names
                    .as_ref()
                    .and_then(|n| n.ids.iter().position(|i| *i == id));
                m.map_or(format!("{}:{id:x}", c.epoch), |m| {
                    format!("{}:m{m}", c.epoch)
                })
            })
            .collect();
        extra.push(format!("claims=[{}]", who.join(",")));
    }
    let takeovers: usize = sidecar_logs
        .iter()
        .map(|l| l.matches("claiming the take-over").count())
        .sum();
    if takeovers > 0 {
        extra.push(format!("takeover_claims={takeovers}"));
    }
    if schedule.leases {
        extra.push(format!(
            "lease_acks={}",
            acks.iter().filter(|a| a.key.starts_with("/lease/")).count()
        ));
    }
    if !world.buried.is_empty() {
        extra.push(format!("buried={:?}", world.buried));
    }
    if let Some(at) = world.reclaim.at {
        extra.push(format!("reclaimed_at={:.1}s", at.as_secs_f64()));
    } else if schedule.ending == Ending::Reclaim {
        extra.push("reclaim=failed".into());
    }
    let detail = if extra.is_empty() {
        detail
    } else {
        format!("{detail} {}", extra.join(" "))
    };
    let mut report = format!("{schedule}\n");
    let _ = writeln!(
        report,
        "hand-off objects: the_final={named:?} record={:?} intent={:?} reclaimed={:?}",
        seen.handoff_record.as_ref().map(|r| &r.final_snapshot),
        seen.intent
            .as_ref()
            .map(|i| (&i.final_snapshot, i.revision)),
        seen.reclaimed
    );
    let _ = writeln!(report, "{}", super::timeline::summary(&timeline));
    let _ = writeln!(report, "violations:");
    for v in &violations {
        let _ = writeln!(report, "  - {v}");
    }
    for n in &notes {
        let _ = writeln!(report, "  note: {n}");
    }
    let _ = writeln!(report, "final /status:");
    for (m, s) in final_status.iter().enumerate() {
        let _ = writeln!(
            report,
            "  m{m}: {}",
            s.as_ref().map(Value::to_string).unwrap_or("-".into())
        );
    }
    world.writer = Some(writer);
    world.describe(&mut report, &snapshots);
    let elapsed = epoch.elapsed();
    Outcome {
        summary: summary_line(schedule, &violations, &detail, elapsed),
        schedule: schedule.clone(),
        violations,
        notes,
        report,
        elapsed,
    }
}

fn summary_line(
    schedule: &Schedule,
    violations: &[Violation],
    detail: &str,
    elapsed: Duration,
) -> String {
    let mut kinds: Vec<&str> = violations.iter().map(|v| v.kind).collect();
    kinds.dedup();
    format!(
        "{} seed={:#018x} members={} steps={} end={:?} {detail} {:.1}s{}",
        if violations.is_empty() {
            "PASS"
        } else {
            "FAIL"
        },
        schedule.seed,
        schedule.members,
        schedule.steps.len(),
        schedule.ending,
        elapsed.as_secs_f64(),
        if kinds.is_empty() {
            String::new()
        } else {
            format!(" violations: {}", kinds.join(","))
        }
    )
}
