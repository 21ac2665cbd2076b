//! The robustness harness: the whole product in one world for a chosen time, under a nemesis,
//! judged from the recorded history (docs/robustness.md).
//!
//! Grown from the fault schedules ([`faultrun::World`]: pods with a kubelet, the sidecars, the
//! Service, the owner record, the store behind the fault proxy, the monitor and the ownership
//! invariants). A soak run adds, all at once and for as long as it is asked to:
//!
//! - the sidecars configured for every feature: full snapshots every minute, deltas, LimitBased
//!   retention, defragmentation on a schedule and on a fragmentation trigger, a secondary store;
//! - [`Traffic`] with a recorded history (puts to 1.4 MiB, deletes and range deletes,
//!   transactions, linearizable reads, a watcher, kube-apiserver-like compaction) and the lease
//!   writer;
//! - the Jobs a user runs beside it: `compact`, `verify --restore` (the drill), `ls`, and at every
//!   hand-off the copy Job, a restore of the destination started and read, and `reclaim`;
//! - a nemesis ([`Nemesis`]) killing and freezing etcd and sidecars, failing, hanging, slowing the
//!   store and losing or delaying its answers, failing DNS, and filling a member's disk;
//! - a sampler of each sidecar's memory, descriptors and threads.
//!
//! Every so often the record hands off; the hand-off is judged (the ownership invariants, one
//! final that every reader names, the copy, the destination holding the state at the final), then
//! reclaimed, and the run goes on. At the end: the KV history against etcd's model
//! ([`kvcheck`]), every chain restored by the drill, deltas without gaps outside a fault, and
//! flat resources. A run that finds a violation writes a report directory and prints the command
//! that replays it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::dns::Mode;
use super::etcd::Release;
use super::faultkinds::{self, Target};
use super::faultproxy::FaultMode;
use super::faultrun::{
    self, ETCD, PREFIX, RECORD, SIDECAR, THEM, US, World, WorldSpec, last_line, tail,
};
use super::handoff_judge;
use super::invariants::{self, Evidence, Violation, get_json};
use super::kvcheck::{self, Seen};
use super::opchecks;
use super::podns::Pod;
use super::s3::{ACCESS_KEY, REGION, SECRET_KEY};
use super::schedule::{Ending, SplitMix64};
use super::traffic::{self, Recorded, Traffic};
use super::writer::Ack;
use super::{deltacheck, leakprobe, linsearch, revmodel};
use etcd_warden::owner::handoff::the_final;
use etcd_warden::store::Snapshot;

#[path = "soak_handoff.rs"]
mod soak_handoff;

/// The secondary store's bucket and the copy Job's destination bucket.
const SECONDARY: &str = "secondary";
const DEST: &str = "dest";

/// A soak profile: what runs and how often.
#[derive(Debug, Clone)]
pub struct Profile {
    pub name: &'static str,
    pub release: Release,
    /// A hand-off every this many seconds (drawn in the range).
    pub handoff_every: (u64, u64),
    /// Between two faults, ms (drawn in the range).
    pub fault_gap: (u64, u64),
    /// How long a fault holds, ms (drawn in the range).
    pub fault_hold: (u64, u64),
    /// The compaction Job and the drill, each about every this many seconds.
    pub jobs_every: u64,
    /// etcd's history compacted (as kube-apiserver does) every this many seconds.
    pub etcd_compact_every: u64,
    /// Traffic workers.
    pub workers: u32,
    /// The operator lane replaces a machine (or buries one, then replaces it) about every this
    /// many seconds.
    pub operator_every: u64,
    /// A sidecar process that lived at least this long is judged for flat resources.
    pub flat_after: Duration,
    /// Every sidecar runs with `[druid]` against the API-server double ([`DruidLane`]).
    pub druid: bool,
    /// The copy Job's `--final-timeout` at every hand-off; some hand-offs keep the sidecars'
    /// store down this long from the flip (outcome (b) of [`handoff_judge`]).
    pub copy_final_timeout: Duration,
    /// The run goes on past its time until this many hand-offs were judged.
    pub min_handoffs: u32,
}

impl Profile {
    /// `ci` (short, fixed seeds in CI), `druid` (the same under `[druid]`), `v35` and `v34`
    /// (long runs on etcd 3.5 and 3.4).
    pub fn named(name: &str) -> Option<Profile> {
        let long = Profile {
            name: "v35",
            release: Release::V35,
            handoff_every: (900, 1500),
            fault_gap: (3_000, 15_000),
            fault_hold: (1_000, 12_000),
            jobs_every: 240,
            etcd_compact_every: 120,
            workers: 2,
            operator_every: 300,
            flat_after: Duration::from_secs(600),
            druid: false,
            copy_final_timeout: Duration::from_secs(60),
            min_handoffs: 1,
        };
        // Debian's etcd 3.4: PyPI's 3.5.1 re-applies entries after a crash (etcd-io/etcd#13766,
        // fixed in 3.5.3) and its members' revisions drift apart under the nemesis's kills and
        // full disks, which fails a run whatever the sidecars do (docs/robustness.md). CI must
        // judge etcd-warden; the long `v35` profile and the `druid` profile stay on 3.5.
        let ci = Profile {
            name: "ci",
            release: Release::V34,
            // Three hand-offs in the CI run's 3 minutes: two that store a final and one with
            // the store down through the copy Job's (short) timeout.
            handoff_every: (40, 50),
            fault_gap: (1_500, 5_000),
            fault_hold: (500, 4_000),
            jobs_every: 45,
            etcd_compact_every: 30,
            operator_every: 50,
            copy_final_timeout: Duration::from_secs(20),
            min_handoffs: 3,
            ..long.clone()
        };
        match name {
            "ci" => Some(ci),
            // The ci profile's pace with every sidecar under `[druid]`.
            "druid" => Some(Profile {
                name: "druid",
                release: Release::V35,
                druid: true,
                ..ci
            }),
            // The ci profile with hand-offs and operator replacements sooner: the plants' runner
            // plays one short run per plant and stops at the first violation it waits for.
            "plants" => Some(Profile {
                name: "plants",
                handoff_every: (25, 35),
                operator_every: 30,
                jobs_every: 20,
                ..ci
            }),
            "v35" => Some(long),
            "v34" => Some(Profile {
                name: "v34",
                release: Release::V34,
                ..long
            }),
            _ => None,
        }
    }
}

/// One fault of the nemesis, held for a while and then healed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Nemesis {
    EtcdKill(usize),
    SidecarKill(usize, u64),
    /// SIGSTOP, then SIGCONT when healed.
    EtcdFreeze(usize),
    SidecarFreeze(usize),
    Store(FaultMode),
    Dns(Mode),
    DnsStopped,
    /// The member's data directory's filesystem is filled until healed.
    DiskFull(usize),
    /// The member's sidecar's wall clock steps by this many seconds (back when negative), and
    /// steps back when healed.
    ClockJump(usize, i64),
    /// `POST /snapshot/full` or `/snapshot/delta` to a member (not a fault: a user's request).
    Trigger(usize, &'static str),
    /// The member's etcd cut off from its peers ([`Partition`]): it loses leadership, the others
    /// go on without it, its linearizable reads fail; healed by removing the rules.
    Partition(usize),
    /// The API server (the druid profile's double) unreachable: its proxy refuses or hangs.
    ApiServer(FaultMode),
    /// A store other than the primary faulted through its own proxy ([`faultkinds`]).
    OtherStore(Target, FaultMode),
}

impl Nemesis {
    fn draw(rng: &mut SplitMix64, members: usize, can: Can) -> Nemesis {
        let m = rng.range(0, members as u64 - 1) as usize;
        let i = rng.weighted(&Nemesis::weights(can));
        Nemesis::build(i, rng, m, can)
    }

    /// How often each kind of [`Nemesis::build`] is drawn (0: the run cannot play it).
    fn weights(can: Can) -> [u64; 20] {
        [
            8, // etcd kill
            6, // sidecar kill
            4, // etcd freeze
            4, // sidecar freeze
            4, // store down
            3, // store slow
            3, // store blackhole
            4, // store loses answers
            3, // store late
            3, // dns servfail
            2, // dns silent
            2, // dns stopped
            if can.disk { 3 } else { 0 },
            4, // triggers
            if can.clock { 3 } else { 0 },
            if can.partition { 4 } else { 0 },
            if can.api_server { 3 } else { 0 },
            4, // store 5xx
            3, // secondary 5xx
            2, // secondary loses answers
        ]
    }

    /// The fault of kind `i` (an index of [`Nemesis::weights`]) on member `m` where it takes one.
    fn build(i: usize, rng: &mut SplitMix64, m: usize, can: Can) -> Nemesis {
        match i {
            0 => Nemesis::EtcdKill(m),
            1 => Nemesis::SidecarKill(m, rng.range(0, 2000)),
            2 => Nemesis::EtcdFreeze(m),
            3 => Nemesis::SidecarFreeze(m),
            4 => Nemesis::Store(FaultMode::Down),
            5 => Nemesis::Store(FaultMode::Slow(Duration::from_millis(rng.range(5, 60)))),
            6 => Nemesis::Store(FaultMode::Blackhole),
            7 => Nemesis::Store(FaultMode::LoseAnswers),
            8 => Nemesis::Store(FaultMode::Late(Duration::from_millis(
                rng.range(3500, 6000),
            ))),
            9 => Nemesis::Dns(Mode::ServFail),
            10 => Nemesis::Dns(Mode::Silent),
            11 => Nemesis::DnsStopped,
            12 => Nemesis::DiskFull(can.disk_member),
            14 => {
                let secs = [-7200, -600, -90, 90, 3600, 86_400][rng.range(0, 5) as usize];
                Nemesis::ClockJump(m, secs)
            }
            15 => Nemesis::Partition(can.partition_member),
            16 => Nemesis::ApiServer(if rng.chance(50) {
                FaultMode::Down
            } else {
                FaultMode::Blackhole
            }),
            17 => Nemesis::Store(faultkinds::status_mode(rng)),
            18 => Nemesis::OtherStore(Target::Secondary, faultkinds::status_mode(rng)),
            19 => Nemesis::OtherStore(Target::Secondary, FaultMode::LoseAnswers),
            _ => Nemesis::Trigger(
                m,
                if rng.chance(50) {
                    "/snapshot/full"
                } else {
                    "/snapshot/delta"
                },
            ),
        }
    }

    /// A short stable name, for the counts.
    fn kind(&self) -> &'static str {
        match self {
            Nemesis::EtcdKill(_) => "etcd-kill",
            Nemesis::SidecarKill(..) => "sidecar-kill",
            Nemesis::EtcdFreeze(_) => "etcd-freeze",
            Nemesis::SidecarFreeze(_) => "sidecar-freeze",
            Nemesis::Store(mode) => faultkinds::store_kind(None, *mode),
            Nemesis::OtherStore(t, mode) => faultkinds::store_kind(Some(*t), *mode),
            Nemesis::Dns(Mode::ServFail) => "dns-servfail",
            Nemesis::Dns(_) => "dns-silent",
            Nemesis::DnsStopped => "dns-stopped",
            Nemesis::DiskFull(_) => "disk-full",
            Nemesis::ClockJump(..) => "clock-jump",
            Nemesis::Trigger(..) => "trigger",
            Nemesis::Partition(_) => "partition",
            Nemesis::ApiServer(_) => "apiserver-down",
        }
    }

    /// Whether this fault may stop member `m`'s sidecar renewing its Lease.
    fn stops_lease_of(&self, m: usize) -> bool {
        match *self {
            Nemesis::EtcdKill(x)
            | Nemesis::SidecarKill(x, _)
            | Nemesis::EtcdFreeze(x)
            | Nemesis::SidecarFreeze(x)
            | Nemesis::DiskFull(x)
            | Nemesis::Partition(x) => x == m,
            Nemesis::ApiServer(_) => true,
            _ => false,
        }
    }
}

/// Which faults a run can play.
#[derive(Debug, Clone, Copy)]
struct Can {
    disk: bool,
    clock: bool,
    partition: bool,
    api_server: bool,
    /// The member whose data directory is a filesystem of its own, filled by
    /// [`Nemesis::DiskFull`], and the one [`Nemesis::Partition`] cuts off: both chosen by the
    /// seed ([`faultkinds::members_for`]).
    disk_member: usize,
    partition_member: usize,
}

/// The opening round's gaps between faults and holds, ms: every kind once within about a minute.
const OPENING_PACE: ((u64, u64), (u64, u64)) = ((300, 1000), (500, 1500));

/// The uid the partitioned member's etcd runs under.
const PARTITION_UID: u32 = 40_040;

/// The iptables chain holding the partition's rules (in the run's own network namespace).
const PARTITION_CHAIN: &str = "soak-partition";

/// Set (to anything) in a test process that runs in a network namespace of its own, which
/// `tests/robustness.rs` creates with `unshare --net`: only there does the harness touch
/// packet filters.
pub const NETNS_ENV: &str = "ROBUSTNESS_IN_NETNS";

fn iptables(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("iptables")
        .arg("-w")
        .args(args)
        .output()
        .map_err(|e| format!("iptables: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "iptables {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// One member's etcd cut off from its peers by iptables rules in the run's own network
/// namespace. Its etcd runs under [`PARTITION_UID`], so the packets of the connections it dials
/// (to the others' peer ports, from an ephemeral port on 127.0.0.1, like everyone's) are told
/// apart by `-m owner`; the connections the others dial to it are told by its peer port. Its
/// clients still reach it, as on a host whose peer network is down: it loses leadership (etcd's
/// check-quorum), the others elect among themselves, and its linearizable reads fail.
struct Partition {
    member: usize,
    own_peer: u16,
    other_peers: Vec<u16>,
    client_url: String,
}

impl Partition {
    /// Why the partition cannot run here, if it cannot: the process is not in a network
    /// namespace of its own ([`NETNS_ENV`]) or iptables is not usable in it.
    fn unavailable() -> Option<String> {
        if std::env::var_os(NETNS_ENV).is_none() {
            return Some(format!(
                "not in a network namespace of the harness's own ({NETNS_ENV} unset)"
            ));
        }
        iptables(&["-S", "OUTPUT"]).err()
    }

    fn new(world: &World, member: usize) -> Result<Partition, String> {
        let _ = iptables(&["-N", PARTITION_CHAIN]);
        iptables(&["-F", PARTITION_CHAIN])?;
        if iptables(&["-C", "OUTPUT", "-j", PARTITION_CHAIN]).is_err() {
            iptables(&["-I", "OUTPUT", "-j", PARTITION_CHAIN])?;
        }
        Ok(Partition {
            member,
            own_peer: world.specs[member].peer_port,
            other_peers: world
                .specs
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != member)
                .map(|(_, s)| s.peer_port)
                .collect(),
            client_url: world.specs[member].client_url(),
        })
    }

    fn cut(&self) -> Result<(), String> {
        let own = self.own_peer.to_string();
        let uid = PARTITION_UID.to_string();
        for p in &self.other_peers {
            let p = p.to_string();
            iptables(&[
                "-A",
                PARTITION_CHAIN,
                "-p",
                "tcp",
                "-m",
                "owner",
                "--uid-owner",
                &uid,
                "--dport",
                &p,
                "-j",
                "DROP",
            ])?;
        }
        iptables(&[
            "-A",
            PARTITION_CHAIN,
            "-p",
            "tcp",
            "--dport",
            &own,
            "-j",
            "DROP",
        ])?;
        iptables(&[
            "-A",
            PARTITION_CHAIN,
            "-p",
            "tcp",
            "--sport",
            &own,
            "-j",
            "DROP",
        ])
    }

    fn heal(&self) -> Result<(), String> {
        iptables(&["-F", PARTITION_CHAIN])
    }

    /// A linearizable read on the member, within `within`.
    async fn read(&self, within: Duration) -> Result<i64, String> {
        let read = async {
            let mut c = super::writer::connect(&self.client_url)
                .await
                .map_err(|e| e.to_string())?;
            c.get("/", Some(etcd_client::GetOptions::new().with_limit(1)))
                .await
                .map(|r| r.header().map_or(0, |h| h.revision()))
                .map_err(|e| e.to_string())
        };
        tokio::time::timeout(within, read)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {within:?}")))
    }
}

/// A tmpfs of `size` mounted at `dir` (root only); unmounted on drop.
struct Mount(PathBuf);

impl Mount {
    fn tmpfs(dir: &Path, size: &str) -> Option<Mount> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Mount(dir.to_path_buf()))
    }

    /// Fills the filesystem: one file holding every free byte.
    fn fill(&self) -> bool {
        let filler = self.0.join("filler");
        let Ok(f) = std::fs::File::create(&filler) else {
            return false;
        };
        let free = nix::sys::statvfs::statvfs(&self.0)
            .map(|s| s.blocks_available() * s.fragment_size())
            .unwrap_or(0);
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, free as i64).is_ok()
    }

    fn free(&self) {
        let _ = std::fs::remove_file(self.0.join("filler"));
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .args(["-l"])
            .arg(&self.0)
            .status();
    }
}

/// The namespace of the druid profile's Leases.
const DRUID_NAMESPACE: &str = "soak";
const FULL_LEASE: &str = "soak-full-snap";
const DELTA_LEASE: &str = "soak-delta-snap";
/// A member Lease not renewed for this long, with nothing that could stop its sidecar, is a
/// violation (the heartbeat is 1 s: this is load, not a missed beat).
const LEASE_STALE: Duration = Duration::from_secs(30);

/// One reading of a member Lease that changed (its resourceVersion moved).
#[derive(Debug, Clone)]
struct LeaseSeen {
    at: Duration,
    member: usize,
    holder: String,
    renew: String,
}

/// The druid profile's lane: the API-server double (one for the run) behind a fault proxy that
/// the nemesis fails, the Leases druid creates (each member's, the snapshot Leases), a watcher
/// recording every change of the member Leases, and what the triggers sent to followers did.
pub struct DruidLane {
    api: super::apiserver::ApiServer,
    proxy: super::faultproxy::FaultProxy,
    /// The file druid writes (`etcd.conf.yaml`), every member's URLs as maps.
    etcd_config: PathBuf,
    kubeconfig: PathBuf,
    seen: Arc<Mutex<Vec<LeaseSeen>>>,
    stop: CancellationToken,
    triggers: u32,
    forwarded: u32,
}

impl DruidLane {
    /// The double, its proxy and the Leases, before the sidecars start.
    async fn start(dir: &Path, members: usize) -> Result<DruidLane, String> {
        use k8s_openapi::api::coordination::v1::Lease;
        let api = super::apiserver::ApiServer::start().await;
        let proxy = super::faultproxy::FaultProxy::start(api.addr()).await;
        let kubeconfig = dir.join("kubeconfig");
        api.write_kubeconfig_via(&kubeconfig, DRUID_NAMESPACE, &proxy.endpoint());
        let leases: kube::Api<Lease> =
            kube::Api::namespaced(api.client_as("druid"), DRUID_NAMESPACE);
        let names = (0..members)
            .map(|m| format!("m{m}"))
            .chain([FULL_LEASE.to_string(), DELTA_LEASE.to_string()]);
        for name in names {
            let lease: Lease = serde_json::from_value(serde_json::json!({
                "metadata": { "name": name, "namespace": DRUID_NAMESPACE },
                "spec": {}
            }))
            .map_err(|e| e.to_string())?;
            leases
                .create(&Default::default(), &lease)
                .await
                .map_err(|e| format!("creating Lease {name}: {e}"))?;
        }
        Ok(DruidLane {
            api,
            proxy,
            etcd_config: dir.join("etcd.conf.yaml"),
            kubeconfig,
            seen: Arc::new(Mutex::new(Vec::new())),
            stop: CancellationToken::new(),
            triggers: 0,
            forwarded: 0,
        })
    }

    /// The `[druid]` keys of member `m`'s sidecar.
    fn keys(&self, m: usize) -> Vec<(String, String)> {
        [
            ("druid.etcd_config", self.etcd_config.display().to_string()),
            ("druid.pod_name", format!("m{m}")),
            ("druid.pod_namespace", DRUID_NAMESPACE.into()),
            ("druid.member_lease", "true".into()),
            ("druid.heartbeat", "1s".into()),
            ("druid.snapshot_leases", "true".into()),
            ("druid.full_snapshot_lease", FULL_LEASE.into()),
            ("druid.delta_snapshot_lease", DELTA_LEASE.into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Writes etcd's configuration file as druid does (the members' URLs as maps keyed by
    /// member name), and starts the watcher of the member Leases.
    fn serve(&self, world: &World, epoch: Instant) -> Result<(), String> {
        use std::fmt::Write as _;
        let mut peers = String::new();
        let mut clients = String::new();
        for s in &world.specs {
            let _ = writeln!(peers, "  {}: [\"{}\"]", s.name, s.peer_url());
            let _ = writeln!(clients, "  {}: [\"{}\"]", s.name, s.client_url());
        }
        let initial = etcd_warden::etcd::process::initial_cluster(&world.specs);
        let text = format!(
            "initial-advertise-peer-urls:\n{peers}advertise-client-urls:\n{clients}\
             initial-cluster: {initial}\ninitial-cluster-token: soak\n"
        );
        std::fs::write(&self.etcd_config, text).map_err(|e| e.to_string())?;
        tokio::spawn(watch_leases(
            self.api.client_as("watcher"),
            world.specs.len(),
            epoch,
            self.seen.clone(),
            self.stop.clone(),
        ));
        Ok(())
    }

    /// Stops the watcher and judges what it saw ([`judge_leases`]): (violations, changes seen).
    fn judge(
        &self,
        names: &super::invariants::MemberNames,
        faults: &[(Nemesis, Duration, Duration)],
        quiet: &[(Duration, Duration)],
        end: Duration,
    ) -> (Vec<Violation>, u32) {
        self.stop.cancel();
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (
            judge_leases(&seen, &names.ids, faults, quiet, end),
            seen.len() as u32,
        )
    }
}

/// The member Leases' findings: every holder names its own member (`ids[m]` for Lease `m<m>`)
/// of one cluster, and no Lease goes unrenewed for [`LEASE_STALE`] while nothing could stop its
/// sidecar (`faults`: each fault and its window; `quiet`: the hand-offs, when every sidecar
/// restarts), up to `end`.
fn judge_leases(
    seen: &[LeaseSeen],
    ids: &[u64],
    faults: &[(Nemesis, Duration, Duration)],
    quiet: &[(Duration, Duration)],
    end: Duration,
) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut cluster: Option<String> = None;
    for l in seen {
        let parts: Vec<&str> = l.holder.split(':').collect();
        let own = ids.get(l.member).map(|id| format!("{id:x}"));
        let fine = parts.len() == 3
            && Some(parts[0].to_string()) == own
            && matches!(parts[2], "Leader" | "Member");
        if !fine {
            out.push(Violation {
                kind: "druid-lease",
                detail: format!(
                    "{:.1}s: Lease m{} holds {:?} (renewed {}); m{}'s member ID is {:?}, the \
                         members are {:x?}",
                    l.at.as_secs_f64(),
                    l.member,
                    l.holder,
                    l.renew,
                    l.member,
                    own,
                    ids
                ),
            });
            continue;
        }
        match &cluster {
            None => cluster = Some(parts[1].to_string()),
            Some(c) if c != parts[1] => out.push(Violation {
                kind: "druid-lease",
                detail: format!(
                    "{:.1}s: Lease m{} names cluster {}, earlier Leases {c}",
                    l.at.as_secs_f64(),
                    l.member,
                    parts[1]
                ),
            }),
            _ => {}
        }
    }
    let members = ids.len();
    for m in 0..members {
        let mut times: Vec<Duration> = seen
            .iter()
            .filter(|l| l.member == m)
            .map(|l| l.at)
            .collect();
        if times.is_empty() {
            out.push(Violation {
                kind: "druid-lease-stale",
                detail: format!("Lease m{m} was never renewed"),
            });
            continue;
        }
        times.sort();
        times.push(end);
        for w in times.windows(2) {
            let (a, b) = (w[0], w[1]);
            if b.saturating_sub(a) <= LEASE_STALE {
                continue;
            }
            let near =
                |from: Duration, to: Duration| from <= b && to + Duration::from_secs(20) >= a;
            let excused = faults
                .iter()
                .any(|(n, from, to)| n.stops_lease_of(m) && near(*from, *to))
                || quiet.iter().any(|(from, to)| near(*from, *to));
            if !excused {
                out.push(Violation {
                    kind: "druid-lease-stale",
                    detail: format!(
                        "Lease m{m} not renewed from {:.1}s to {:.1}s, with no fault of m{m}, \
                             of the API server or a hand-off between",
                        a.as_secs_f64(),
                        b.as_secs_f64()
                    ),
                });
            }
        }
    }
    out
}

/// Reads every member Lease every 500 ms (from the double itself, not through the proxy) and
/// records each change.
async fn watch_leases(
    client: kube::Client,
    members: usize,
    epoch: Instant,
    out: Arc<Mutex<Vec<LeaseSeen>>>,
    stop: CancellationToken,
) {
    use k8s_openapi::api::coordination::v1::Lease;
    let api: kube::Api<Lease> = kube::Api::namespaced(client, DRUID_NAMESPACE);
    let mut last: Vec<Option<String>> = vec![None; members];
    while !stop.is_cancelled() {
        for (m, last) in last.iter_mut().enumerate() {
            let Ok(l) = api.get(&format!("m{m}")).await else {
                continue;
            };
            let rv = l.metadata.resource_version.clone();
            let Some(spec) = l.spec else { continue };
            let Some(holder) = spec.holder_identity else {
                continue;
            };
            if *last != rv {
                *last = rv;
                out.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(LeaseSeen {
                        at: epoch.elapsed(),
                        member: m,
                        holder,
                        renew: spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default(),
                    });
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// One sample of a sidecar process.
#[derive(Debug, Clone)]
pub struct Sample {
    pub at: Duration,
    pub member: usize,
    pub incarnation: u32,
    pub rss_kib: u64,
    pub fds: u64,
    pub threads: u64,
    /// Whether the sidecar took snapshots then (`/status`), when it answered: a leader holds the
    /// delta watch, takes the full snapshots and copies to the secondary, a follower none of it.
    pub leader: Option<bool>,
}

fn sample_process(pid: i32) -> Option<(u64, u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((field("VmRSS:")?, fds, field("Threads:")?))
}

/// Samples every sidecar every 5 s until stopped; `statuses` are their `/status` URLs.
async fn sampler(
    pods: Arc<Mutex<Vec<Pod>>>,
    statuses: Vec<String>,
    client: reqwest::Client,
    epoch: Instant,
    out: Arc<Mutex<Vec<Sample>>>,
    stop: CancellationToken,
) {
    let members = statuses.len();
    loop {
        for m in 0..members {
            let found = {
                let mut pods = pods.lock().unwrap_or_else(|e| e.into_inner());
                let pod = &mut pods[m];
                let incarnation = pod.containers[SIDECAR]
                    .incarnation
                    .load(std::sync::atomic::Ordering::SeqCst);
                pod.process(SIDECAR)
                    .and_then(|p| p.pid())
                    .map(|pid| (pid, incarnation))
            };
            if let Some((pid, incarnation)) = found
                && let Some((rss_kib, fds, threads)) = sample_process(pid)
            {
                // Bounded: a frozen sidecar must not hold the others' samples.
                let status = tokio::time::timeout(
                    Duration::from_millis(500),
                    get_json(&client, &statuses[m]),
                )
                .await;
                let leader = match status {
                    Ok(Some((200, v))) => v["snapshotter"]["leader"].as_bool(),
                    _ => None,
                };
                out.lock().unwrap_or_else(|e| e.into_inner()).push(Sample {
                    at: epoch.elapsed(),
                    member: m,
                    incarnation,
                    rss_kib,
                    fds,
                    threads,
                    leader,
                });
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

/// A resource of a sample: its name, how to read it, and the absolute slack it is allowed.
type Measure = (&'static str, fn(&Sample) -> u64, u64);

/// The value at fraction `q` (0..=1) of `values` sorted (nearest rank); `None` when empty.
fn percentile(values: &[u64], q: f64) -> Option<u64> {
    let mut v = values.to_vec();
    v.sort_unstable();
    let last = v.len().checked_sub(1)?;
    v.get(((last as f64) * q).round() as usize).copied()
}

/// How long a process warms up before it is judged (caches, pools, the first snapshot).
const WARM_UP: Duration = Duration::from_secs(120);

/// The longest window compared: the issue's "last hour's peak within 1.2× the first hour's".
const FLAT_WINDOW: Duration = Duration::from_secs(3600);

/// The resource check, for each sidecar process (member and incarnation: a restart starts a new
/// series; so does a change of snapshot leadership, which moves the baseline by the delta
/// watch, the full snapshots and the secondary's copies) that lived at least `after`. Its first window (past [`WARM_UP`]) and its last window,
/// each a quarter of its judged life and at most an hour, are compared twice:
/// - the baseline (the median): the last within 1.2× the first: a climb moves it;
/// - the peak, sustained: the last window's 90th percentile within 1.2× the first window's
///   peak. A snapshot or defragmentation spike is a few samples, under the 90th percentile, so
///   one late spike is not growth; a peak that keeps coming back is.
///
/// Descriptors and threads get 4 more as slack (they are small counts).
pub fn flat(samples: &[Sample], after: Duration) -> Vec<String> {
    // (member, incarnation, its n-th role) → samples; a sample whose role is unknown (the
    // sidecar did not answer) stays in the role before it.
    let mut by_process: BTreeMap<(usize, u32, usize), Vec<&Sample>> = BTreeMap::new();
    let mut roles: BTreeMap<(usize, u32), (usize, Option<bool>)> = BTreeMap::new();
    for s in samples {
        let role = roles
            .entry((s.member, s.incarnation))
            .or_insert((0, s.leader));
        if s.leader.is_some() && role.1.is_some() && s.leader != role.1 {
            role.0 += 1;
        }
        if s.leader.is_some() {
            role.1 = s.leader;
        }
        by_process
            .entry((s.member, s.incarnation, role.0))
            .or_default()
            .push(s);
    }
    let mut out = Vec::new();
    for ((m, inc, _), list) in by_process {
        let role = match list.iter().find_map(|s| s.leader) {
            Some(true) => " as snapshot leader",
            Some(false) => " as follower",
            None => "",
        };
        let (Some(first), Some(last)) = (list.first(), list.last()) else {
            continue;
        };
        let life = last.at.saturating_sub(first.at);
        if life < after {
            continue;
        }
        let warm = first.at + WARM_UP;
        let window = (life.saturating_sub(WARM_UP) / 4).min(FLAT_WINDOW);
        let late_from = last.at.saturating_sub(window);
        let checks: [Measure; 3] = [
            ("rss_kib", |s| s.rss_kib, 0),
            ("fds", |s| s.fds, 4),
            ("threads", |s| s.threads, 4),
        ];
        for (name, f, slack) in checks {
            let early: Vec<u64> = list
                .iter()
                .filter(|s| s.at >= warm && s.at < warm + window)
                .map(|s| f(s))
                .collect();
            let late: Vec<u64> = list
                .iter()
                .filter(|s| s.at >= late_from)
                .map(|s| f(s))
                .collect();
            let over = |b: u64, a: u64| b as f64 > a as f64 * 1.2 + slack as f64;
            let life_min = life.as_secs_f64() / 60.0;
            let win_min = window.as_secs_f64() / 60.0;
            if let (Some(a), Some(b)) = (percentile(&early, 0.5), percentile(&late, 0.5))
                && over(b, a)
            {
                out.push(format!(
                    "sidecar m{m}#{inc}{role} ({life_min:.0} min): {name} baseline (median) {b} in its \
                     last {win_min:.0} min, {a} in its first (after warming up): more than 1.2×"
                ));
            }
            if let (Some(a), Some(b)) = (percentile(&early, 1.0), percentile(&late, 0.9))
                && over(b, a)
            {
                out.push(format!(
                    "sidecar m{m}#{inc}{role} ({life_min:.0} min): {name} 90th percentile {b} in its \
                     last {win_min:.0} min, above 1.2× the peak {a} of its first (after warming \
                     up): a peak that stays"
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod flat_tests {
    use super::*;

    /// A process sampled every 5 s for `minutes`, its RSS (MiB) given by `rss(seconds)`.
    fn series(
        member: usize,
        inc: u32,
        from: u64,
        minutes: u64,
        rss: impl Fn(u64) -> u64,
    ) -> Vec<Sample> {
        (0..minutes * 12)
            .map(|i| {
                let t = i * 5;
                Sample {
                    at: Duration::from_secs(from + t),
                    member,
                    incarnation: inc,
                    rss_kib: rss(t) * 1024,
                    fds: 40,
                    threads: 12,
                    leader: None,
                }
            })
            .collect()
    }

    const AFTER: Duration = Duration::from_secs(600);

    #[test]
    fn a_steady_process_is_flat() {
        let s = series(0, 1, 0, 40, |t| 50 + (t / 5) % 3);
        assert_eq!(flat(&s, AFTER), Vec::<String>::new());
    }

    #[test]
    fn a_climb_is_growth() {
        // 50 MiB growing to 90 over 40 minutes: the baseline and the sustained peak both move.
        let s = series(0, 1, 0, 40, |t| 50 + t / 60);
        let found = flat(&s, AFTER);
        assert!(
            found.iter().any(|f| f.contains("rss_kib baseline")),
            "{found:?}"
        );
        assert!(
            found.iter().any(|f| f.contains("rss_kib 90th")),
            "{found:?}"
        );
    }

    #[test]
    fn a_late_spike_is_not_growth() {
        // Spikes of 30 MiB around snapshots, one of them late and bigger than any early one:
        // the peak-only check of before flagged this (open finding 4).
        let s = series(0, 1, 0, 40, |t| match t {
            600..=620 => 75,
            2300..=2330 => 95,
            _ => 50,
        });
        assert_eq!(flat(&s, AFTER), Vec::<String>::new());
    }

    #[test]
    fn a_peak_that_stays_is_growth() {
        // The baseline holds but the late window is mostly at a new plateau with dips.
        let s = series(0, 1, 0, 40, |t| {
            if t > 1800 && (t / 5) % 4 != 0 { 80 } else { 50 }
        });
        let found = flat(&s, AFTER);
        assert!(
            found.iter().any(|f| f.contains("rss_kib 90th")),
            "{found:?}"
        );
    }

    /// The second two-hour run's m0#9: a follower at 47 MiB that takes snapshot leadership and
    /// holds 57 MiB from then on is two flat series, not growth; a climb while it leads is
    /// still found, and named with its role.
    #[test]
    fn taking_snapshot_leadership_starts_a_new_series() {
        let role = |s: Vec<Sample>, leader: Option<bool>| {
            s.into_iter()
                .map(|x| Sample { leader, ..x })
                .collect::<Vec<_>>()
        };
        let mut s = role(series(0, 9, 0, 20, |_| 47), Some(false));
        s.extend(role(series(0, 9, 1200, 2, |_| 50), None));
        s.extend(role(
            series(0, 9, 1320, 20, |t| 57 + (t / 5) % 2),
            Some(true),
        ));
        assert_eq!(flat(&s, AFTER), Vec::<String>::new());
        let mut climbing = role(series(1, 3, 0, 20, |_| 47), Some(false));
        climbing.extend(role(series(1, 3, 1200, 20, |t| 55 + t / 30), Some(true)));
        let found = flat(&climbing, AFTER);
        assert!(
            !found.is_empty() && found.iter().all(|f| f.contains("m1#3 as snapshot leader")),
            "{found:?}"
        );
    }

    #[test]
    fn a_restart_starts_a_new_series() {
        // The first process ends high, the next starts low and warms up to the same level:
        // judged together it would look like growth; each alone is flat.
        let mut s = series(1, 1, 0, 20, |_| 90);
        s.extend(series(1, 2, 1200, 20, |t| if t < 60 { 30 } else { 50 }));
        s.extend(series(1, 3, 2400, 20, |t| 50 + (t / 5) % 2));
        assert_eq!(flat(&s, AFTER), Vec::<String>::new());
        // A climb in one incarnation is still found and named.
        s.extend(series(2, 4, 0, 20, |t| 40 + t / 20));
        let found = flat(&s, AFTER);
        assert!(
            !found.is_empty() && found.iter().all(|f| f.contains("m2#4")),
            "{found:?}"
        );
    }

    #[test]
    fn descriptors_that_leak_are_growth_and_a_short_life_is_not_judged() {
        let mut s = series(0, 1, 0, 40, |_| 50);
        for (i, x) in s.iter_mut().enumerate() {
            x.fds = 40 + i as u64 / 10;
        }
        let found = flat(&s, AFTER);
        assert!(
            found.iter().any(|f| f.contains("fds baseline")),
            "{found:?}"
        );
        let short = series(0, 1, 0, 9, |t| 50 + t);
        assert_eq!(flat(&short, AFTER), Vec::<String>::new());
    }

    #[test]
    fn long_runs_compare_the_first_and_last_hour() {
        // Eight hours: a climb in the third hour that then holds is growth between the first
        // and last hour, though the last quarter (two hours) alone is flat.
        let s = series(0, 1, 0, 480, |t| {
            if t < 7200 {
                50
            } else if t < 10800 {
                50 + (t - 7200) / 150
            } else {
                74
            }
        });
        let found = flat(&s, AFTER);
        assert!(found.iter().any(|f| f.contains("last 60 min")), "{found:?}");
    }
}

/// What a soak run found.
pub struct SoakOutcome {
    pub violations: Vec<Violation>,
    pub summary: String,
    pub report_dir: Option<PathBuf>,
    /// Hand-offs by the outcome they reached.
    pub handoffs: soak_handoff::Reached,
    /// Each kind of violation found, with when it was first found (from the run's start).
    pub fired: BTreeMap<&'static str, Duration>,
}

/// Counts for the summary and the docs.
#[derive(Default, Debug)]
struct Counts {
    faults: BTreeMap<&'static str, u32>,
    handoffs: u32,
    settled: u32,
    copies: u32,
    restores: u32,
    reclaims: u32,
    compactions: u32,
    drills: u32,
    drill_failures: u32,
    restore_disk_full: u32,
    /// Copy Job attempts that failed and were run again (as the Job's `backoffLimit` does).
    copy_retries: u32,
}

/// The copy Job's `backoffLimit` in deploy/copy-job/job.yaml.
const COPY_BACKOFF_LIMIT: u32 = 3;

struct Run<'a> {
    profile: &'a Profile,
    seed: u64,
    rng: SplitMix64,
    world: World,
    traffic: Traffic,
    mounts: Vec<Mount>,
    restore_mount: Option<Mount>,
    samples: Arc<Mutex<Vec<Sample>>>,
    stop_sampler: CancellationToken,
    violations: Vec<Violation>,
    notes: Vec<String>,
    counts: Counts,
    wall_epoch: SystemTime,
    /// Bucket prefixes the copy Job wrote (one per hand-off).
    destinations: u32,
    /// Where the sidecars' faked clocks are set (None without libfaketime).
    clock_dir: Option<PathBuf>,
    lane: Option<OperatorLane>,
    /// When each reclaimed final was reclaimed (a run reclaims at every hand-off).
    reclaimed_at: BTreeMap<String, Duration>,
    /// Every fault played, with its window.
    fault_log: Vec<(Nemesis, Duration, Duration)>,
    /// Each hand-off's window (from its first heal to the sidecars serving again).
    handoff_windows: Vec<(Duration, Duration)>,
    partition: Option<Partition>,
    druid: Option<DruidLane>,
    /// The end's drills, whole (the report keeps them).
    drill_outputs: Vec<(&'static str, String)>,
    /// Every drill that passed (the Jobs' on the primary, the end's on each store), judged at
    /// the end against the history (`drill-compared-nothing`).
    passed_drills: Vec<deltacheck::PreservedDrill>,
    /// The operator lane's files for the report directory.
    lane_report: Vec<(&'static str, String)>,
    /// Hand-offs judged by outcome, and every final tracked (issue 53: [`soak_handoff`]).
    h53: soak_handoff::State,
    /// Each destination's traffic keys as read (hand-off, the final's revision, contents),
    /// judged again at the end against the complete revision history.
    destination_reads: Vec<(u32, i64, BTreeMap<String, Seen>)>,
    /// The secondary's, the destination's and the Jobs' stores, each behind its own proxy.
    proxies: faultkinds::StoreProxies,
    /// The sidecars' members' leader every ~200 ms and the defragmentations their logs showed.
    leadership: Arc<Mutex<opchecks::Leadership>>,
    /// What the opening round still has to play (`None`: two faults at once), from the back.
    opening: Vec<Option<Nemesis>>,
    /// The fault kinds this run must play ([`faultkinds::required`]).
    required_kinds: Vec<&'static str>,
    disk_member: usize,
    partition_member: usize,
    /// The ownership timeline's etcd probes (`support::timeline`).
    ownership: super::timeline::Recorder,
    /// Every hand-off's final (name, revision), for the timeline's judge at the end.
    finals: Vec<(String, i64)>,
    /// The run stops as soon as one of these kinds is found ([`run_until`]; the plants' runner).
    stop_on: &'a [&'a str],
    /// Each kind found, with when it was first found.
    fired: BTreeMap<&'static str, Duration>,
}

/// The sidecars' configuration beyond the fault schedules': every feature on.
fn soak_keys(release: Release, store_endpoint: String) -> Vec<(String, String)> {
    [
        ("snapshot.schedule", "*/1 * * * *".to_string()),
        ("snapshot.delta_period", "2s".into()),
        ("snapshot.gc_policy", "LimitBased".into()),
        ("snapshot.max_backups", "4".into()),
        ("snapshot.gc_period", "30s".into()),
        // The fault schedules' 3 s is for small databases: the soak's large values grow the
        // database to hundreds of MiB, whose finals never fitted 3 s (docs/robustness.md).
        ("snapshot.timeout", "60s".into()),
        // Small, so that a store outage at the soak's write rate (about 1 MiB/s) fills it: the
        // watch is then not read until a delta is stored, under every fault, and a sidecar's
        // memory is bounded by the limit rather than by how long the store was down.
        ("snapshot.delta_memory_limit", "8MiB".into()),
        ("defrag.schedule", "*/4 * * * *".into()),
        ("defrag.check_interval", "1m".into()),
        ("defrag.trigger_min_db_size", "8MiB".into()),
        ("defrag.trigger_min_free_fraction", "0.3".into()),
        ("store.secondary.url", format!("s3://{SECONDARY}/{PREFIX}")),
        ("store.secondary.endpoint", store_endpoint),
        ("store.secondary.region", REGION.into()),
        ("store.secondary.access_key_id", ACCESS_KEY.into()),
        ("store.secondary.secret_access_key", SECRET_KEY.into()),
        ("store.secondary.sync_interval", "10s".into()),
        (
            "restore.etcd_bin",
            release.bin_dir().to_string_lossy().into_owned(),
        ),
    ]
    .into_iter()
    // A previous release (`FAULT_BIN`) refuses keys it does not know: the fragmentation
    // trigger and the secondary store came later.
    .filter(|(k, _)| {
        faultrun::other_binary().is_none()
            || !(k.starts_with("store.secondary")
                || k.starts_with("defrag.trigger")
                || *k == "defrag.check_interval")
    })
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

impl Run<'_> {
    fn event(&self, line: impl AsRef<str>) {
        self.world.events.push(line);
    }

    fn violation(&mut self, kind: &'static str, detail: String) {
        self.event(format!("VIOLATION [{kind}] {detail}"));
        self.fired
            .entry(kind)
            .or_insert_with(|| self.world.events.epoch.elapsed());
        self.violations.push(Violation { kind, detail });
    }

    /// A kind the run was asked to stop on has been found.
    fn stopped(&self) -> bool {
        self.stop_on.iter().any(|k| self.fired.contains_key(k))
    }

    fn clock_file(&self, m: usize) -> PathBuf {
        self.clock_dir
            .as_deref()
            .unwrap_or(Path::new("/nonexistent"))
            .join(format!("m{m}.clock"))
    }

    /// The first sidecar's keys, for the CLI: without `[druid]`, which is the sidecar's (a
    /// Job under druid writes Leases only when asked; these Jobs are etcd-warden's own).
    fn keys(&self) -> Vec<(String, String)> {
        let mut keys = self.world.keys[0].clone();
        keys.retain(|(k, _)| !k.starts_with("druid."));
        // The Jobs reach the primary through a proxy of their own (faulted beside a Job).
        for (k, v) in &mut keys {
            if k == "store.endpoint" {
                *v = self.proxies.jobs.endpoint();
            }
        }
        keys
    }

    /// Runs the CLI with the first sidecar's configuration plus `extra` keys; (ok, output).
    async fn cli(
        &self,
        subcommand: &str,
        args: &[String],
        extra: &[(String, String)],
    ) -> (bool, String) {
        let mut keys = self.keys();
        keys.retain(|(k, _)| !extra.iter().any(|(x, _)| x == k));
        keys.extend(extra.iter().cloned());
        faultrun::cli_output(keys, subcommand.to_string(), args.to_vec()).await
    }

    /// Applies `n`, holds it, heals it.
    async fn play(&mut self, n: Nemesis, hold: Duration) {
        *self.counts.faults.entry(n.kind()).or_default() += 1;
        let from = self.world.events.epoch.elapsed();
        self.event(format!("nemesis: {n:?} for {hold:?}"));
        let kubelet = &self.world.kubelet;
        match n {
            Nemesis::EtcdKill(m) => {
                kubelet.with_pod(m, |p| p.kill(ETCD, Duration::ZERO));
            }
            Nemesis::SidecarKill(m, down) => {
                kubelet.with_pod(m, |p| p.kill(SIDECAR, Duration::from_millis(down)));
            }
            Nemesis::EtcdFreeze(m) | Nemesis::SidecarFreeze(m) => {
                let c = if matches!(n, Nemesis::EtcdFreeze(_)) {
                    ETCD
                } else {
                    SIDECAR
                };
                let stopped =
                    kubelet.with_pod(m, |p| p.process(c).map(|p| p.signal(Signal::SIGSTOP)));
                tokio::time::sleep(hold).await;
                let resumed = self
                    .world
                    .kubelet
                    .with_pod(m, |p| p.process(c).map(|p| p.resume()));
                self.event(format!("  stopped: {stopped:?}, resumed: {resumed:?}"));
            }
            Nemesis::Store(mode) => {
                self.world.proxy.set(mode);
                tokio::time::sleep(hold).await;
                self.world.proxy.set(FaultMode::Pass);
            }
            Nemesis::Dns(mode) => {
                self.world.dns.set_mode(mode);
                tokio::time::sleep(hold).await;
                self.world.heal_dns().await;
            }
            Nemesis::DnsStopped => {
                self.world.dns.stop().await;
                self.world.dns_stopped = true;
                tokio::time::sleep(hold).await;
                self.world.heal_dns().await;
            }
            Nemesis::DiskFull(m) => {
                let filled = self.mounts.first().is_some_and(Mount::fill);
                self.event(format!("  m{m}'s data filesystem filled: {filled}"));
                tokio::time::sleep(hold).await;
                if let Some(mount) = self.mounts.first() {
                    mount.free();
                }
            }
            Nemesis::ClockJump(m, secs) => {
                let file = self.clock_file(m);
                let _ = std::fs::write(&file, format!("{secs:+}\n"));
                tokio::time::sleep(hold).await;
                let _ = std::fs::write(&file, "+0\n");
            }
            Nemesis::Trigger(m, path) => self.world.post(m, path),
            Nemesis::Partition(m) => self.partition(m, hold).await,
            Nemesis::ApiServer(mode) => {
                if let Some(d) = &self.druid {
                    d.proxy.set(mode);
                    tokio::time::sleep(hold).await;
                    d.proxy.set(FaultMode::Pass);
                }
            }
            Nemesis::OtherStore(t, mode) => {
                let proxy = self.proxies.of(t).clone();
                proxy.set(mode);
                tokio::time::sleep(hold).await;
                proxy.set(FaultMode::Pass);
            }
        }
        let to = self.world.events.epoch.elapsed();
        self.fault_log.push((n, from, to));
        self.event(format!("nemesis: {} healed", n.kind()));
    }

    /// The partition, held at least 4 s: the cut member's linearizable read must fail while it
    /// is cut (else the rules did not cut it, and the run tests nothing: a violation), and the
    /// member is read again once healed (how long it took is recorded).
    async fn partition(&mut self, m: usize, hold: Duration) {
        let Some(p) = self.partition.as_ref().filter(|p| p.member == m) else {
            return;
        };
        let hold = hold.max(Duration::from_secs(4));
        if let Err(e) = p.cut() {
            let _ = p.heal();
            self.violation("partition", format!("m{m} could not be cut off: {e}"));
            return;
        }
        let cut_at = Instant::now();
        // Past etcd's election timeout (1 s): a leader has stepped down, a follower has lost
        // its leader.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let read = p.read(Duration::from_millis(1500)).await;
        // Who the others follow meanwhile (they elect among themselves when m led).
        let mut others = Vec::new();
        for (i, s) in self.world.specs.iter().enumerate() {
            if i == m {
                continue;
            }
            let ids = self
                .world
                .names
                .as_ref()
                .map(|n| n.ids.clone())
                .unwrap_or_default();
            let leader = match super::writer::connect(&s.client_url()).await {
                Ok(mut c) => match tokio::time::timeout(Duration::from_secs(1), c.status()).await {
                    Ok(Ok(st)) => ids
                        .iter()
                        .position(|id| *id == st.leader())
                        .map_or_else(|| format!("{:x}", st.leader()), |l| format!("m{l}")),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no answer".into(),
                },
                Err(e) => e.to_string(),
            };
            others.push(format!("m{i} follows {leader}"));
        }
        tokio::time::sleep(hold.saturating_sub(cut_at.elapsed())).await;
        let healed = p.heal();
        let healed_at = Instant::now();
        let mut back = None;
        while healed.is_ok() && healed_at.elapsed() < Duration::from_secs(20) {
            if p.read(Duration::from_secs(2)).await.is_ok() {
                back = Some(healed_at.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.event(format!(
            "  m{m} cut off for {:?}: its linearizable read while cut: {read:?}; the others: \
             {}; healed: {healed:?}; serving linearizable reads again after {back:?}",
            healed_at - cut_at,
            others.join(", ")
        ));
        if let Ok(rev) = read {
            self.violation(
                "partition",
                format!(
                    "m{m} answered a linearizable read (revision {rev}) 2.5 s into its \
                     partition: the rules did not cut it off"
                ),
            );
        }
        if let Err(e) = healed {
            self.violation("partition", format!("m{m}'s partition not healed: {e}"));
        }
    }

    /// With everything healed: a full snapshot asked of a follower's sidecar must be forwarded
    /// to the leader's, which takes it and answers (issue 40, the druid profile). Leadership may
    /// move between the choice and the request, so it is tried up to three times.
    async fn druid_trigger(&mut self, k: u32) {
        if self.druid.is_none() {
            return;
        }
        let mut said = Vec::new();
        for attempt in 1..=3 {
            if attempt > 1 {
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            if let Some(d) = self.druid.as_mut() {
                d.triggers += 1;
            }
            match self.forwarded_once().await {
                Ok(line) => {
                    if let Some(d) = self.druid.as_mut() {
                        d.forwarded += 1;
                    }
                    self.event(format!("hand-off {k}: {line}"));
                    return;
                }
                Err(e) => {
                    self.event(format!("hand-off {k}: trigger attempt {attempt}: {e}"));
                    said.push(e);
                }
            }
        }
        self.violation(
            "druid-forward",
            format!(
                "hand-off {k}: with nothing faulted, no full snapshot asked of a follower's \
                 sidecar was taken by the leader's: {said:?}"
            ),
        );
    }

    async fn leader(&self) -> Option<usize> {
        let ids = &self.world.names.as_ref()?.ids;
        for s in &self.world.specs {
            if let Ok(mut c) = super::writer::connect(&s.client_url()).await
                && let Ok(Ok(st)) = tokio::time::timeout(Duration::from_secs(2), c.status()).await
                && st.leader() != 0
            {
                return ids.iter().position(|id| *id == st.leader());
            }
        }
        None
    }

    /// One `POST /snapshot/full` to a follower; what showed it was forwarded, or why not.
    async fn forwarded_once(&mut self) -> Result<String, String> {
        let leader = self.leader().await.ok_or("no leader known")?;
        let members = self.world.specs.len();
        let follower = (leader + 1 + self.rng.range(0, members as u64 - 2) as usize) % members;
        let log_len = |m: usize, w: &World| {
            std::fs::metadata(&w.sidecar_logs[m]).map_or(0, |md| md.len() as usize)
        };
        let since: Vec<usize> = (0..members).map(|m| log_len(m, &self.world)).collect();
        let url = self.world.sidecar_url(follower, "/snapshot/full");
        let answer = super::http_client(Duration::from_secs(90))
            .post(&url)
            .bearer_auth(&self.world.token)
            .send()
            .await
            .map_err(|e| format!("POST m{follower} /snapshot/full: {e}"))?;
        let code = answer.status().as_u16();
        let body = answer.text().await.unwrap_or_default();
        if code != 200 {
            return Err(format!(
                "POST m{follower} /snapshot/full (leader m{leader}) → {code} {}",
                body.chars().take(200).collect::<String>()
            ));
        }
        let snap: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        let name = snap["snapName"].as_str().unwrap_or_default().to_string();
        if name.is_empty() || snap["kind"] != "Full" {
            return Err(format!("POST m{follower} answered 200 with {body}"));
        }
        let stored = self.world.store.list().await.unwrap_or_default();
        if !stored.iter().any(|s| s.snap_name == name) {
            self.violation(
                "druid-forward",
                format!("m{follower} answered a full snapshot {name} that the store does not hold"),
            );
        }
        let new_log = |m: usize| {
            let text = std::fs::read(&self.world.sidecar_logs[m]).unwrap_or_default();
            String::from_utf8_lossy(text.get(since[m]..).unwrap_or_default()).into_owned()
        };
        let taker = (0..members).find(|m| {
            new_log(*m)
                .lines()
                .any(|l| l.contains("full snapshot stored") && l.contains(&name))
        });
        let forwarded = new_log(follower).contains("forwarded to the leader's sidecar");
        match taker {
            Some(t) if t != follower && forwarded => Ok(format!(
                "POST /snapshot/full to follower m{follower} forwarded, {name} taken by m{t} \
                 (leader m{leader})"
            )),
            _ => Err(format!(
                "POST m{follower} (leader m{leader}) answered {name}, taken by {taker:?}, \
                 forwarding logged: {forwarded}"
            )),
        }
    }

    /// Copies a passed drill's chain out of its store for the end's judgment
    /// (`drill-compared-nothing`), at most a dozen.
    async fn preserve_drill(&mut self, label: &'static str, passed: deltacheck::PassedDrill) {
        if self.passed_drills.len() >= 12 {
            return;
        }
        let store = match label {
            "secondary" => etcd_warden::store::SnapshotStore::new(
                self.world.s3.object_store(SECONDARY),
                PREFIX,
            ),
            _ => self.world.store.clone(),
        };
        let root = self
            .world
            .dir
            .path()
            .join(format!("drills/{}", self.passed_drills.len()));
        match deltacheck::preserve(label, &store, passed, &root).await {
            Ok(p) => self.passed_drills.push(p),
            Err(e) => self.event(format!("drill's chain not preserved: {e}")),
        }
    }

    /// A user's Job: `compact` or the drill, chosen at random.
    async fn job(&mut self) {
        if self.rng.chance(50) {
            self.counts.compactions += 1;
            let (ok, said) = self.cli("compact", &[], &[]).await;
            self.event(format!("job compact: ok={ok}: {}", last_line(&said)));
        } else {
            self.counts.drills += 1;
            // Now and then the Jobs' store fails under the drill (it may then fail: counted).
            let beside = if self.rng.chance(35) {
                let mode = if self.rng.chance(50) {
                    faultkinds::status_mode(&mut self.rng)
                } else {
                    FaultMode::LoseAnswers
                };
                let after = Duration::from_millis(self.rng.range(0, 3000));
                let hold = Duration::from_millis(self.rng.range(500, 3000));
                Some(self.fault_beside(Target::Jobs, mode, after, hold))
            } else {
                None
            };
            let (ok, said) = self.cli("verify", &["--restore".into()], &[]).await;
            if let Some(b) = beside {
                self.record_beside(b).await;
            }
            self.event(format!(
                "job verify --restore: ok={ok}: {}",
                last_line(&said)
            ));
            if !ok {
                // A drill under faults may fail (the store is hanging): counted, judged at the end
                // when nothing is faulted.
                self.counts.drill_failures += 1;
            }
            if let Some(passed) = ok.then(|| deltacheck::passed_drill(&said)).flatten() {
                self.preserve_drill("primary", passed).await;
            }
            // But no fault excuses a restore that finished and serves another state than its
            // chain (`DrillError::Mismatch`): a fault may stop a restore, never change it.
            if !ok && said.contains("the restored etcd differs from the chain") {
                self.violation(
                    "drill",
                    format!(
                        "a drill Job's restore differs from its chain: {}",
                        tail(&said, 3, true)
                    ),
                );
            }
        }
    }

    /// Serves until `until`: faults one after another, Jobs in between.
    async fn serve(&mut self, until: Instant) {
        let mut next_job = Instant::now() + Duration::from_secs(self.profile.jobs_every / 2);
        let every = self.profile.operator_every;
        let mut next_operator =
            Instant::now() + Duration::from_secs(self.rng.range(every / 2, every * 3 / 2));
        while Instant::now() < until && !self.stopped() {
            // The opening round goes at a faster pace, so that it ends within the first serve.
            let (gap, hold) = if self.opening.is_empty() {
                (self.profile.fault_gap, self.profile.fault_hold)
            } else {
                OPENING_PACE
            };
            let gap = Duration::from_millis(self.rng.range(gap.0, gap.1));
            tokio::time::sleep(gap.min(until.saturating_duration_since(Instant::now()))).await;
            if Instant::now() >= until {
                break;
            }
            if Instant::now() >= next_operator
                && let Some(lane) = self.lane.as_mut()
            {
                let said = lane.act(&mut self.rng).await;
                self.event(format!("operator lane: {said}"));
                next_operator =
                    Instant::now() + Duration::from_secs(self.rng.range(every / 2, every * 3 / 2));
                continue;
            }
            if Instant::now() >= next_job {
                self.job().await;
                next_job = Instant::now()
                    + Duration::from_secs(
                        self.rng
                            .range(self.profile.jobs_every / 2, self.profile.jobs_every * 3 / 2),
                    );
                continue;
            }
            let can = self.can();
            // The opening round first (every kind once), then drawn faults, now and then two
            // at once.
            let (n, pair) = match self.opening.pop() {
                Some(Some(n)) => (n, false),
                Some(None) => (
                    Nemesis::draw(&mut self.rng, self.world.specs.len(), can),
                    true,
                ),
                None => (
                    Nemesis::draw(&mut self.rng, self.world.specs.len(), can),
                    self.rng.chance(12),
                ),
            };
            let hold = Duration::from_millis(self.rng.range(hold.0, hold.1));
            if pair {
                self.play_two(n, hold).await;
            } else {
                self.play(n, hold).await;
            }
        }
    }

    /// Which faults this run can play, and on which members.
    fn can(&self) -> Can {
        Can {
            disk: !self.mounts.is_empty(),
            clock: self.clock_dir.is_some(),
            partition: self.partition.is_some(),
            api_server: self.druid.is_some(),
            disk_member: self.disk_member,
            partition_member: self.partition_member,
        }
    }

    /// `n` played while a store fault holds on a store `n` does not touch (the primary, or the
    /// secondary when `n` is the primary's): two faults at once, both recorded.
    async fn play_two(&mut self, n: Nemesis, hold: Duration) {
        let mode = match self.rng.range(0, 3) {
            0 => faultkinds::status_mode(&mut self.rng),
            1 => FaultMode::LoseAnswers,
            2 => FaultMode::Down,
            _ => FaultMode::Late(Duration::from_millis(self.rng.range(3500, 6000))),
        };
        let other = if matches!(n, Nemesis::Store(_)) {
            Nemesis::OtherStore(Target::Secondary, mode)
        } else {
            Nemesis::Store(mode)
        };
        *self.counts.faults.entry(faultkinds::PAIR).or_default() += 1;
        *self.counts.faults.entry(other.kind()).or_default() += 1;
        let from = self.world.events.epoch.elapsed();
        self.event(format!(
            "nemesis: two at once: {other:?} held across the next"
        ));
        match other {
            Nemesis::OtherStore(t, m) => self.proxies.of(t).set(m),
            _ => self.world.proxy.set(mode),
        }
        let started = Instant::now();
        self.play(n, hold).await;
        tokio::time::sleep(hold.saturating_sub(started.elapsed())).await;
        match other {
            Nemesis::OtherStore(t, _) => self.proxies.of(t).set(FaultMode::Pass),
            _ => self.world.proxy.set(FaultMode::Pass),
        }
        let to = self.world.events.epoch.elapsed();
        self.fault_log.push((other, from, to));
        self.event(format!("nemesis: {} healed (two at once)", other.kind()));
    }

    /// Holds `mode` on `target`'s proxy beside a Job: from `after` for `hold`. Await the handle
    /// (then [`Run::record_beside`]) once the Job is done.
    fn fault_beside(
        &self,
        target: Target,
        mode: FaultMode,
        after: Duration,
        hold: Duration,
    ) -> (
        Nemesis,
        Duration,
        tokio::task::JoinHandle<(Duration, Duration)>,
    ) {
        let n = Nemesis::OtherStore(target, mode);
        self.event(format!(
            "nemesis: {n:?} from {after:?} for {hold:?}, beside the Job"
        ));
        let task = tokio::spawn(faultkinds::hold_fault(
            self.proxies.of(target).clone(),
            mode,
            after,
            hold,
        ));
        (n, self.world.events.epoch.elapsed(), task)
    }

    /// Counts and logs a fault [`Run::fault_beside`] held (it has healed once this returns).
    async fn record_beside(
        &mut self,
        (n, at, task): (
            Nemesis,
            Duration,
            tokio::task::JoinHandle<(Duration, Duration)>,
        ),
    ) {
        let Ok((from, to)) = task.await else {
            self.proxies.of(Target::Jobs).set(FaultMode::Pass);
            self.proxies.of(Target::Destination).set(FaultMode::Pass);
            return;
        };
        *self.counts.faults.entry(n.kind()).or_default() += 1;
        self.fault_log.push((n, at + from, at + to));
        self.event(format!("nemesis: {} healed", n.kind()));
    }

    /// Every acknowledged write so far, as the ownership invariants take them.
    fn acks(&self, recorded: &Recorded) -> Vec<Ack> {
        let mut acks: Vec<Ack> = recorded
            .ops
            .iter()
            .filter_map(|op| {
                let revision = op.write_revision()?;
                Some(Ack {
                    key: format!("{:?}", op.call).chars().take(80).collect(),
                    revision,
                    at: op.completed,
                })
            })
            .collect();
        if let Some(l) = &self.world.leases {
            acks.extend(
                l.acks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .cloned(),
            );
        }
        acks.sort_by_key(|a| a.revision);
        acks
    }

    /// One hand-off, judged, copied, restored at the destination and reclaimed.
    async fn handoff(&mut self, last: bool) {
        self.counts.handoffs += 1;
        let k = self.counts.handoffs;
        let started = self.world.events.epoch.elapsed();
        // Heal whatever a fault left behind; every etcd runs again.
        self.world.heal_dns().await;
        self.world.proxy.set(FaultMode::Pass);
        self.proxies.heal();
        if let Some(p) = &self.partition {
            let _ = p.heal();
        }
        if let Some(d) = &self.druid {
            d.proxy.set(FaultMode::Pass);
        }
        for mount in &self.mounts {
            mount.free();
        }
        if self.clock_dir.is_some() {
            for m in 0..self.world.specs.len() {
                let _ = std::fs::write(self.clock_file(m), "+0\n");
            }
        }
        self.members_agree(k).await;
        self.druid_trigger(k).await;
        if self.rng.chance(30) {
            self.event(format!("hand-off {k}: the record flaps (other, then us)"));
            self.world.dns.set_txt(RECORD, &[THEM]).await;
            tokio::time::sleep(Duration::from_millis(self.rng.range(50, 400))).await;
            self.world.dns.set_txt(RECORD, &[US]).await;
            tokio::time::sleep(Duration::from_millis(self.rng.range(200, 1500))).await;
        }
        let ending = if self.rng.chance(75) {
            Ending::Other
        } else {
            Ending::Deleted
        };
        self.event(format!("hand-off {k}: record → {ending:?}"));
        // Some hand-offs keep the sidecars' store down from the flip through the copy Job's
        // final_timeout: outcome (b) of [`handoff_judge`].
        let outage = self.outage_from_flip(k);
        let flip = self.world.events.epoch.elapsed();
        self.h53.flips.push(flip);
        match ending {
            Ending::Deleted => self.world.dns.remove_txt(RECORD).await,
            _ => self.world.dns.set_txt(RECORD, &[THEM]).await,
        }
        let early_copy = if outage {
            Some(self.copy_through_outage(k, flip).await)
        } else {
            None
        };
        // A fault timed to meet the final (as the schedules' end_store), or a sidecar killed the
        // moment it deactivates.
        match if outage { 9 } else { self.rng.range(0, 9) } {
            0..=2 => {
                let after = self.rng.range(800, 3000);
                let hold = self.rng.range(500, 3000);
                let mode = if self.rng.chance(50) {
                    FaultMode::LoseAnswers
                } else {
                    FaultMode::Late(Duration::from_millis(self.rng.range(3500, 6000)))
                };
                tokio::time::sleep(Duration::from_millis(after)).await;
                self.play(Nemesis::Store(mode), Duration::from_millis(hold))
                    .await;
            }
            3..=4 => {
                let m = self.rng.range(0, self.world.specs.len() as u64 - 1) as usize;
                let down = self.rng.range(0, 800);
                *self
                    .counts
                    .faults
                    .entry("sidecar-kill-at-deactivation")
                    .or_default() += 1;
                self.world
                    .apply(super::schedule::Fault::SidecarKillWhenDeactivated {
                        member: m,
                        down_ms: down,
                    })
                    .await;
            }
            _ => {}
        }
        self.world.settle(ending).await;
        let recorded = self.traffic.snapshot();
        let acks = self.acks(&recorded);
        let snapshots = self.world.store.list().await.unwrap_or_default();
        let seen = self.world.objects.seen().await.unwrap_or_default();
        let named = the_final(&snapshots, &seen).map(|s| s.snap_name.clone());
        let latest_final = self.world.latest_is_final().await;
        if latest_final {
            self.counts.settled += 1;
        }
        let final_status = self.world.sidecar_statuses().await;
        let sidecar_exits = self.world.sidecar_exits();
        let sidecar_logs = self.world.sidecar_log_texts();
        let read_as_final = self.world.read_as_final();
        let (violations, notes) = self.world.monitor().with(|observed| {
            invariants::check(&Evidence {
                ending,
                healed: true,
                acks: &acks,
                snapshots: &snapshots,
                observed,
                final_status: &final_status,
                sidecar_exits: &sidecar_exits,
                sidecar_logs: &sidecar_logs,
                reclaimed: &seen.reclaimed,
                the_final: named.as_deref(),
                latest_final,
                reclaim_at: self.world.reclaim.at,
                reclaimed_at: Some(&self.reclaimed_at),
                first_finals: &[],
                reclaimed_read_as_final: &read_as_final,
                buried: &self.world.buried,
            })
        });
        for v in violations {
            // The monitor's findings accumulate: report each once.
            if !self.violations.contains(&v) {
                self.violation(v.kind, v.detail);
            }
        }
        self.notes.extend(notes.iter().cloned());
        if let Some(name) = &named
            && let Some(rev) = snapshots
                .iter()
                .find(|s| &s.snap_name == name)
                .map(|s| s.last_revision)
            && !self.finals.iter().any(|(n, _)| n == name)
        {
            self.finals.push((name.clone(), rev));
        }
        self.judge_handoff(k, flip, named, &snapshots, early_copy, &recorded, &notes)
            .await;
        if last {
            self.handoff_windows
                .push((started, self.world.events.epoch.elapsed()));
            return;
        }
        self.counts.reclaims += 1;
        let reclaim_started = self.world.events.epoch.elapsed();
        let reclaimed = self.world.reclaim().await;
        for name in self.world.objects.reclaimed().await.unwrap_or_default() {
            self.h53
                .reclaim_started
                .entry(name)
                .or_insert(reclaim_started);
        }
        // The sidecars restart after the reclaim: a Lease may wait for them.
        self.handoff_windows.push((
            started,
            self.world.events.epoch.elapsed() + Duration::from_secs(30),
        ));
        if let Some(at) = self.world.reclaim.at {
            for name in self.world.objects.reclaimed().await.unwrap_or_default() {
                self.reclaimed_at.entry(name).or_insert(at);
            }
        }
        if !reclaimed {
            let said = self.world.reclaim.said.clone();
            self.violation(
                "reclaim-failed",
                format!(
                    "hand-off {k}: `etcd-warden reclaim` did not bring the sidecars back: {said}"
                ),
            );
        }
    }

    /// Every member holds the same history: each one's KV hash at one revision (etcd's own
    /// corruption check, as its robustness tests do). Waits (up to 30 s) for every member to be
    /// healthy first; a member that is not is named and skipped.
    async fn members_agree(&mut self, k: u32) {
        let urls: Vec<String> = self.world.specs.iter().map(|s| s.client_url()).collect();
        let healthy = super::eventually(Duration::from_secs(30), || async {
            let mut all = true;
            for u in &urls {
                all &= super::etcd::member_healthy(u).await;
            }
            all
        })
        .await;
        let mut clients = Vec::new();
        for (m, u) in urls.iter().enumerate() {
            match super::writer::connect(u).await {
                Ok(c) => clients.push((m, c)),
                Err(e) => self.event(format!(
                    "hand-off {k}: m{m} not reachable for the hash: {e}"
                )),
            }
        }
        let mut revisions = Vec::new();
        for (m, c) in &mut clients {
            if let Ok(r) = c
                .get("/", Some(etcd_client::GetOptions::new().with_limit(1)))
                .await
            {
                revisions.push((*m, r.header().map_or(0, |h| h.revision())));
            }
        }
        let Some(at) = revisions.iter().map(|(_, r)| *r).min() else {
            return;
        };
        let mut hashes = Vec::new();
        for (m, c) in &mut clients {
            match c.hash_kv(at).await {
                Ok(h) => hashes.push((*m, h.hash(), h.compact_version())),
                Err(e) => self.event(format!("hand-off {k}: m{m} hash at {at}: {e}")),
            }
        }
        self.event(format!(
            "hand-off {k}: members healthy: {healthy}; KV hashes at revision {at}: {hashes:?}"
        ));
        let distinct: std::collections::BTreeSet<(u32, i64)> =
            hashes.iter().map(|(_, h, c)| (*h, *c)).collect();
        if distinct.len() > 1 {
            self.violation(
                "members-diverged",
                format!(
                    "hand-off {k}: the members' KV hashes at revision {at} differ: {hashes:?} \
                     (member, hash, compacted revision)"
                ),
            );
        }
    }

    /// The copy Job into a fresh destination, a restore of it (first onto a full disk when the
    /// profile has one), etcd started on it and read: it must hold the state at the final.
    /// One step of a hand-off run as the binary's `subcommand`: logged as `"{what} ok=…"`, and on
    /// failure a violation (`kind`, `"{failed}: <its last lines>"`); whether it succeeded.
    async fn hand_off_step(
        &mut self,
        subcommand: &str,
        args: &[String],
        extra: &[(String, String)],
        what: String,
        (kind, failed): (&'static str, String),
    ) -> bool {
        let (ok, said) = self.cli(subcommand, args, extra).await;
        self.event(format!("{what} ok={ok}: {}", last_line(&said)));
        if !ok {
            self.violation(kind, format!("{failed}: {}", tail(&said, 5, true)));
        }
        ok
    }

    /// [`Run::copy_and_restore_steps`] with the destination's and the Jobs' stores faulted
    /// beside the copy Job and the restore ([`faultkinds::handoff_faults`]).
    async fn copy_and_restore(
        &mut self,
        k: u32,
        recorded: &Recorded,
        direct: bool,
    ) -> (handoff_judge::CopyRun, Option<Result<i64, String>>) {
        let (dest, jobs) = faultkinds::handoff_faults(k, &mut self.rng);
        let mut beside = Vec::new();
        for (target, mode) in [(Target::Destination, dest), (Target::Jobs, jobs)] {
            if let Some(mode) = mode {
                let after = Duration::from_millis(self.rng.range(0, 1500));
                let hold = Duration::from_millis(self.rng.range(500, 2500));
                beside.push(self.fault_beside(target, mode, after, hold));
            }
        }
        if beside.len() > 1 {
            *self.counts.faults.entry(faultkinds::PAIR).or_default() += 1;
        }
        let out = self.copy_and_restore_steps(k, recorded, direct).await;
        for b in beside {
            self.record_beside(b).await;
        }
        out
    }

    /// The copy Job (the Jobs reach the stores through a proxy of their own, so an outage of
    /// the sidecars' route (`direct`: [`soak_handoff`]) does not reach it), then the
    /// destination restored and read at its newest chain's end. What the copy chose, and the
    /// revision at which the destination equals the model.
    async fn copy_and_restore_steps(
        &mut self,
        k: u32,
        recorded: &Recorded,
        direct: bool,
    ) -> (handoff_judge::CopyRun, Option<Result<i64, String>>) {
        self.destinations += 1;
        let dest_prefix = format!("{PREFIX}-{k}");
        let endpoint = self.proxies.destination.endpoint();
        let mut source: Vec<(String, String)> = self
            .keys()
            .into_iter()
            .filter(|(key, _)| key.starts_with("store.") && !key.starts_with("store.secondary"))
            .map(|(key, v)| (key.replacen("store.", "source_store.", 1), v))
            .collect();
        source.push(("store.url".into(), format!("s3://{DEST}/{dest_prefix}")));
        source.push(("store.endpoint".into(), endpoint));
        let args: Vec<String> = vec![
            "--wait-for-final".into(),
            "--final-timeout".into(),
            format!("{}s", self.profile.copy_final_timeout.as_secs()),
            "--poll-interval".into(),
            "1s".into(),
        ];
        // Run as Kubernetes runs the Job (deploy/copy-job/job.yaml, `backoffLimit: 3`): a failed
        // attempt is run again, up to three times; the last one's failure is the violation. An
        // attempt fails on one lost answer to a single PUT (docs/robustness.md).
        let (mut ok, mut said) = (false, String::new());
        let mut started = self.world.events.epoch.elapsed();
        for attempt in 0..=COPY_BACKOFF_LIMIT {
            started = self.world.events.epoch.elapsed();
            (ok, said) = self.cli("copy", &args, &source).await;
            self.event(format!(
                "hand-off {k}: copy Job (attempt {}, sidecars' route down: {direct}) ok={ok}: {}",
                attempt + 1,
                last_line(&said)
            ));
            if ok {
                break;
            }
            if attempt < COPY_BACKOFF_LIMIT {
                self.counts.copy_retries += 1;
            }
        }
        let dest =
            etcd_warden::store::SnapshotStore::new(self.world.s3.object_store(DEST), &dest_prefix);
        let dest_listed = dest.list().await.unwrap_or_default();
        let mut copy = soak_handoff::copy_run(started, ok, &said, &dest_listed);
        if !ok {
            self.violation(
                "copy-failed",
                format!(
                    "hand-off {k}: the copy Job failed {} times: {}",
                    COPY_BACKOFF_LIMIT + 1,
                    tail(&said, 5, true)
                ),
            );
        }
        // The newest chain the source held, as the copy listed it (the sidecars' route is down
        // in an outage hand-off, so it has not moved since).
        let source_listed = self.world.store.list().await.unwrap_or_default();
        copy.newest_revision = soak_handoff::chain_end(&source_listed);
        if direct {
            self.outage_healed();
        }
        if !ok {
            return (copy, None);
        }
        let Some(final_rev) = soak_handoff::chain_end(&dest_listed) else {
            return (copy, Some(Err("the destination holds no chain".into())));
        };
        self.counts.copies += 1;
        let dest_keys = vec![
            (
                "store.url".to_string(),
                format!("s3://{DEST}/{dest_prefix}"),
            ),
            (
                "store.endpoint".to_string(),
                self.proxies.destination.endpoint(),
            ),
        ];
        let etcd_bin = self
            .profile
            .release
            .bin_dir()
            .to_string_lossy()
            .into_owned();
        if let Some(mount) = &self.restore_mount
            && self.rng.chance(30)
        {
            self.counts.restore_disk_full += 1;
            let filled = mount.fill();
            let target = mount.0.join(format!("full-{k}"));
            let (ok, said) = self
                .cli(
                    "restore",
                    &[
                        "--data-dir".into(),
                        target.to_string_lossy().into_owned(),
                        "--etcd-bin".into(),
                        etcd_bin.clone(),
                    ],
                    &dest_keys,
                )
                .await;
            mount.free();
            self.event(format!(
                "hand-off {k}: restore onto a full disk (filled={filled}): ok={ok}: {}",
                last_line(&said)
            ));
            if ok && filled {
                self.violation(
                    "restore-full-disk",
                    format!(
                        "hand-off {k}: a restore onto a full filesystem said it succeeded: {said}"
                    ),
                );
            }
            if target.join("member").exists() {
                self.violation("restore-full-disk", format!("hand-off {k}: a restore that failed for a full disk left {} with a member directory", target.display()));
            }
        }
        let target = self.world.dir.path().join(format!("dest-{k}")).join("data");
        let restored = self
            .hand_off_step(
                "restore",
                &[
                    "--data-dir".into(),
                    target.to_string_lossy().into_owned(),
                    "--etcd-bin".into(),
                    etcd_bin,
                ],
                &dest_keys,
                format!("hand-off {k}: destination restore"),
                (
                    "restore-failed",
                    format!("hand-off {k}: restoring the destination failed"),
                ),
            )
            .await;
        if !restored {
            return (copy, Some(Err("restoring the destination failed".into())));
        }
        self.counts.restores += 1;
        let destination = match read_restored(self.profile.release, &target, final_rev).await {
            Ok((revision, contents)) => {
                let mut found = Vec::new();
                if revision < final_rev {
                    found.push(format!(
                        "the destination serves revision {revision}, below its chain's {final_rev}"
                    ));
                }
                found.extend(
                    kvcheck::restored_state(&recorded.ops, &recorded.watches, final_rev, &contents)
                        .into_iter()
                        .map(|f| f.to_string()),
                );
                for f in &found {
                    self.violation("restored", format!("hand-off {k}: {f}"));
                }
                self.destination_reads
                    .push((k, final_rev, contents.clone()));
                self.event(format!(
                    "hand-off {k}: destination serves {} traffic keys at revision {revision}",
                    contents.len()
                ));
                if found.is_empty() {
                    Ok(final_rev)
                } else {
                    Err(format!(
                        "{} differences from the model at {final_rev}, first: {}",
                        found.len(),
                        found[0]
                    ))
                }
            }
            Err(e) => {
                self.violation(
                    "restored",
                    format!("hand-off {k}: the destination did not start or answer: {e}"),
                );
                Err(format!("did not start or answer: {e}"))
            }
        };
        let _ = std::fs::remove_dir_all(target.parent().unwrap_or(&target));
        (copy, Some(destination))
    }
}

/// Starts etcd on a restored data directory and reads every traffic key: (revision, contents).
async fn read_restored(
    release: Release,
    data_dir: &Path,
    at: i64,
) -> Result<(i64, BTreeMap<String, Seen>), String> {
    let etcd = super::etcd::temp_etcd(release, data_dir, "default", data_dir.with_extension("log"))
        .await?;
    let read = async {
        let client = etcd_client::Client::connect([&etcd.client_url], None)
            .await
            .map_err(|e| e.to_string())?;
        // Live large values can add up beyond gRPC's default 4 MiB in one answer.
        let r = client
            .kv_client()
            .max_decoding_message_size(1 << 30)
            .get(
                traffic::PREFIX,
                // At the final's revision: keys on leases expire once it runs, moving it on.
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_revision(at),
                ),
            )
            .await
            .map_err(|e| e.to_string())?;
        let revision = r.header().map_or(0, |h| h.revision());
        let contents = r
            .kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    Seen {
                        id: kvcheck::id_of(kv.value()).unwrap_or_else(|| {
                            format!("<not a traffic value, {} bytes>", kv.value().len())
                        }),
                        mod_revision: kv.mod_revision(),
                    },
                )
            })
            .collect();
        Ok::<_, String>((revision, contents))
    };
    let out = read.await;
    let _ = etcd.stop().await;
    out
}

/// Completes the traffic's revision history at the end: the workers stop, the last hand-off is
/// undone so etcd serves again, and the closing write must reach the watch (revmodel.rs). None
/// (and an event saying why) when it could not: the lost answers then stay ambiguous.
async fn complete_history(run: &mut Run<'_>) -> Option<i64> {
    run.traffic.stop_writes().await;
    let reclaim_started = run.world.events.epoch.elapsed();
    let reclaimed = run.world.reclaim().await;
    // The judges see this reclaim as every other: the finals it marks are reclaimed from then
    // on (the timeline's ack-after-final, the finals tracker's final-gone).
    for name in run.world.objects.reclaimed().await.unwrap_or_default() {
        run.h53
            .reclaim_started
            .entry(name.clone())
            .or_insert(reclaim_started);
        if let Some(at) = run.world.reclaim.at {
            run.reclaimed_at.entry(name).or_insert(at);
        }
    }
    if !reclaimed {
        run.event("end: the reclaim before the closing write failed");
    }
    match run.traffic.complete_history(Duration::from_secs(90)).await {
        Ok(r) => {
            run.event(format!("end: the history is complete to revision {r}"));
            Some(r)
        }
        Err(e) => {
            run.event(format!("end: the history could not be completed: {e}"));
            None
        }
    }
}

/// The KV history judged with every lost answer the revision history resolves resolved: the
/// model's checks (`kvcheck`), the revision history's (`revmodel`: `lost-write`, reads,
/// transactions, every event explained), the destinations read at each hand-off, and the
/// linearizability search for what stays ambiguous. Returns the model and a summary.
fn judge_history(
    run: &mut Run<'_>,
    recorded: &Recorded,
    complete: bool,
) -> (revmodel::RevModel, String) {
    let model = revmodel::RevModel::build(&recorded.watches);
    let res = model.resolve(&recorded.ops, complete);
    let kind = |check: &'static str| match check {
        "lost-write" => "lost-write",
        _ => "history",
    };
    let found: Vec<kvcheck::Finding> =
        kvcheck::check_resolved(&recorded.ops, &recorded.watches, &res)
            .into_iter()
            .chain(revmodel::judge(&model, &recorded.ops, &res))
            .collect();
    for f in found {
        run.violation(kind(f.check), f.to_string());
    }
    for (k, rev, contents) in std::mem::take(&mut run.destination_reads) {
        if !model.knows(rev) {
            run.event(format!(
                "end: hand-off {k}'s destination not judged: the history is complete to {} only",
                model.complete_to
            ));
            continue;
        }
        let diff = revmodel::judge_contents(&model, traffic::PREFIX, rev, &contents);
        if !diff.is_empty() {
            run.violation(
                "destination-mismatch",
                format!(
                    "hand-off {k}: the destination at revision {rev} differs from the history in \
                     {} keys, e.g. {}",
                    diff.len(),
                    diff.iter().take(3).cloned().collect::<Vec<_>>().join("; ")
                ),
            );
        }
    }
    let (lin, searched, undecided) = linsearch::judge_keys(&recorded.ops, &res, 200_000);
    for f in lin {
        run.violation("not-linearizable", f.to_string());
    }
    let unknown = recorded
        .ops
        .iter()
        .filter(|o| o.ret == kvcheck::Ret::Unknown)
        .count();
    let summary = format!(
        " history: complete_to={} gaps={} unknown_resolved={}/{unknown} (happened {}, never {}) \
         searched_keys={searched} undecided_keys={undecided}",
        model.complete_to,
        model.gaps.len(),
        res.happened.len() + res.not_happened.len(),
        res.happened.len(),
        res.not_happened.len(),
    );
    run.event(format!("end:{summary}"));
    (model, summary)
}

/// Every chain of the primary and the secondary restored at revisions the seed chooses and
/// compared with the revision history (deltacheck.rs, `delta-history`). Short profiles restore 2
/// revisions a chain, 16 in all; long ones 20 a chain, 300 in all.
async fn judge_deltas(
    run: &mut Run<'_>,
    model: &revmodel::RevModel,
    primary: &[Snapshot],
) -> String {
    let short = matches!(run.profile.name, "ci" | "druid" | "plants");
    let (per_chain, max) = if short { (2, 16) } else { (20, 300) };
    let mut sources = vec![deltacheck::Source {
        label: "primary",
        snapshots: primary.to_vec(),
        store: run.world.store.clone(),
        keys: Vec::new(),
    }];
    if faultrun::other_binary().is_none() {
        let secondary =
            etcd_warden::store::SnapshotStore::new(run.world.s3.object_store(SECONDARY), PREFIX);
        sources.push(deltacheck::Source {
            label: "secondary",
            snapshots: secondary.list().await.unwrap_or_default(),
            store: secondary,
            keys: vec![
                ("store.url".into(), format!("s3://{SECONDARY}/{PREFIX}")),
                (
                    "store.endpoint".into(),
                    format!("http://127.0.0.1:{}", run.world.s3.port),
                ),
            ],
        });
    }
    let started = Instant::now();
    let dir = run.world.dir.path().join("deltacheck");
    let out = deltacheck::judge(
        model,
        traffic::PREFIX,
        &run.keys(),
        &sources,
        per_chain,
        max,
        run.seed,
        run.profile.release,
        &dir,
    )
    .await;
    for v in &out.violations {
        run.violation("delta-history", v.clone());
    }
    for g in &out.gone {
        run.event(format!("end: deleted by retention while judged: {g}"));
    }
    // Every passed drill's chain, restored by the harness where the drill saw etcd serve.
    let judged = deltacheck::judge_drills(
        model,
        traffic::PREFIX,
        &run.keys(),
        &run.passed_drills,
        run.profile.release,
        &dir,
    )
    .await;
    for v in &judged.violations {
        run.violation("drill-compared-nothing", v.clone());
    }
    for u in &judged.unjudged {
        run.event(format!("end: a passed drill not judged: {u}"));
    }
    let summary = format!(
        " deltas: chains={} restores={} gone={} raced={} drills_judged={} (unjudged {}) in {:.0}s",
        out.chains,
        out.restores,
        out.gone.len(),
        out.raced,
        judged.chains,
        judged.unjudged.len(),
        started.elapsed().as_secs_f64()
    );
    run.event(format!("end:{summary}"));
    summary
}

/// Plays `profile` for `duration` from `seed` and judges it.
pub async fn run(profile: &Profile, seed: u64, duration: Duration) -> SoakOutcome {
    run_until(profile, seed, duration, &[]).await
}

/// [`run`], stopped as soon as a violation of one of the `stop_on` kinds is found: no further
/// fault or hand-off, and the end's drills are skipped (the plants' runner, which waits for one
/// checker to fire).
pub async fn run_until(
    profile: &Profile,
    seed: u64,
    duration: Duration,
    stop_on: &[&str],
) -> SoakOutcome {
    let epoch = Instant::now();
    let wall_epoch = SystemTime::now();
    let scratch = tempfile::tempdir().expect("temp dir");
    let members = 3;
    let (disk_member, partition_member) = faultkinds::members_for(seed, members);
    // One member's data directory on a filesystem of its own, which the disk-full fault fills
    // (RAM-backed: every member on one, over hours of large values, ran the machine out of
    // memory).
    let mounts: Vec<Mount> = Mount::tmpfs(&scratch.path().join(format!("m{disk_member}")), "1g")
        .into_iter()
        .collect();
    if disk_member == partition_member && !mounts.is_empty() {
        // The partitioned member's etcd runs under its own uid: it must reach its data
        // directory on the tmpfs (the directories above it only traversable).
        use std::os::unix::fs::PermissionsExt;
        for d in [
            scratch.path().to_path_buf(),
            scratch.path().join(format!("m{disk_member}")),
        ] {
            let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711));
        }
    }
    let restore_mount = Mount::tmpfs(&scratch.path().join("restore"), "256m");
    let no_partition = Partition::unavailable();
    let druid = if profile.druid {
        match DruidLane::start(scratch.path(), members).await {
            Ok(d) => Some(d),
            Err(e) => {
                return SoakOutcome {
                    violations: vec![Violation {
                        kind: "setup",
                        detail: format!("the API-server double: {e}"),
                    }],
                    summary: format!("FAIL profile={} seed={seed:#x} setup failed", profile.name),
                    report_dir: None,
                    handoffs: Default::default(),
                    fired: BTreeMap::from([("setup", epoch.elapsed())]),
                };
            }
        }
    } else {
        None
    };
    let spec = WorldSpec {
        seed,
        members,
        interval_ms: 250,
        leases: true,
        release: profile.release,
        extra_keys: Vec::new(),
        extra_buckets: vec![SECONDARY.into(), DEST.into()],
        writer: false,
        data_mounts: (!mounts.is_empty()).then(|| scratch.path().to_path_buf()),
        clock_dir: Path::new(faultrun::LIBFAKETIME)
            .exists()
            .then(|| scratch.path().to_path_buf()),
        hosts: profile.druid,
        own_uid: no_partition
            .is_none()
            .then_some((partition_member, PARTITION_UID)),
        sidecar_env: druid
            .iter()
            .map(|d| ("KUBECONFIG".to_string(), d.kubeconfig.display().to_string()))
            .collect(),
    };
    // The secondary's endpoint is the S3 server itself (not behind the fault proxy), known once
    // the world runs: the keys are added to the sidecars' before they start.
    let spec = WorldSpec {
        extra_keys: soak_keys(profile.release, String::new()),
        ..spec
    };
    let clock_dir = spec.clock_dir.clone();
    // The secondary behind a proxy of its own, started once the S3 server's address is known.
    let secondary = std::sync::OnceLock::new();
    let world = match World::start_with(&spec, epoch, |m, s3_endpoint, keys| {
        let proxy = secondary.get_or_init(|| {
            super::faultproxy::FaultProxy::spawn(
                s3_endpoint
                    .trim_start_matches("http://")
                    .parse()
                    .expect("the S3 server's address"),
            )
        });
        for (k, v) in keys.iter_mut() {
            if k == "store.secondary.endpoint" {
                *v = proxy.endpoint();
            }
        }
        if let Some(d) = &druid {
            keys.extend(d.keys(m));
        }
    })
    .await
    {
        Ok(w) => w,
        Err((why, world)) => {
            let mut report = format!("setup failed: {why}\n");
            if let Some(w) = &world {
                let snapshots = w.store.list().await.unwrap_or_default();
                w.describe(&mut report, &snapshots);
            }
            println!("{report}");
            return SoakOutcome {
                violations: vec![Violation {
                    kind: "setup",
                    detail: why,
                }],
                summary: format!("FAIL profile={} seed={seed:#x} setup failed", profile.name),
                report_dir: None,
                handoffs: Default::default(),
                fired: BTreeMap::from([("setup", epoch.elapsed())]),
            };
        }
    };
    let s3_addr = ([127, 0, 0, 1], world.s3.port).into();
    let proxies = faultkinds::StoreProxies::new(
        s3_addr,
        secondary
            .into_inner()
            .unwrap_or_else(|| super::faultproxy::FaultProxy::spawn(s3_addr)),
    );
    let service = world.service.as_ref().expect("service started").endpoint();
    let traffic = Traffic::start(
        traffic::fixed(service),
        seed,
        profile.workers,
        epoch,
        Duration::from_secs(profile.etcd_compact_every),
    );
    let samples = Arc::new(Mutex::new(Vec::new()));
    let stop_sampler = CancellationToken::new();
    tokio::spawn(sampler(
        world.kubelet.pods.clone(),
        (0..members)
            .map(|m| world.sidecar_url(m, "/status"))
            .collect(),
        world.http_client.clone(),
        epoch,
        samples.clone(),
        stop_sampler.clone(),
    ));
    let leadership = Arc::new(Mutex::new(opchecks::Leadership::default()));
    tokio::spawn(opchecks::watch_leadership(
        world.specs.iter().map(|s| s.client_url()).collect(),
        world.sidecar_logs.clone(),
        epoch,
        leadership.clone(),
        stop_sampler.clone(),
    ));
    let ownership = super::timeline::watch_world(&world);
    let mut run = Run {
        profile,
        seed,
        rng: SplitMix64::new(seed ^ 0x50a4_50a4),
        world,
        traffic,
        mounts,
        restore_mount,
        samples,
        stop_sampler,
        violations: Vec::new(),
        notes: Vec::new(),
        counts: Counts::default(),
        wall_epoch,
        destinations: 0,
        clock_dir,
        lane: None,
        reclaimed_at: BTreeMap::new(),
        fault_log: Vec::new(),
        handoff_windows: Vec::new(),
        partition: None,
        druid: None,
        drill_outputs: Vec::new(),
        passed_drills: Vec::new(),
        lane_report: Vec::new(),
        h53: soak_handoff::State::default(),
        destination_reads: Vec::new(),
        proxies,
        leadership,
        opening: Vec::new(),
        required_kinds: Vec::new(),
        disk_member,
        partition_member,
        ownership,
        finals: Vec::new(),
        stop_on,
        fired: BTreeMap::new(),
    };
    run.start_tracking_finals();
    match no_partition {
        None => match Partition::new(&run.world, partition_member) {
            Ok(p) => run.partition = Some(p),
            Err(e) => run.violation("setup", format!("the partition's chain: {e}")),
        },
        Some(why) => run.event(format!("no partition fault: {why}")),
    }
    if let Some(d) = druid {
        if let Err(e) = d.serve(&run.world, epoch) {
            run.violation(
                "setup",
                format!("etcd's configuration file for [druid]: {e}"),
            );
        }
        run.druid = Some(d);
    }
    match OperatorLane::start(profile.release, seed, epoch).await {
        Ok(lane) => run.lane = Some(lane),
        Err(e) => run.violation("setup", format!("the operator lane did not start: {e}")),
    }
    // The opening round: every kind this run can play, once, in an order the seed draws (the
    // hand-offs play the copy Job's stores' kinds).
    let can = run.can();
    let mut opening: Vec<Option<Nemesis>> = vec![None];
    for (i, w) in Nemesis::weights(can).iter().enumerate() {
        if *w > 0 {
            let m = run.rng.range(0, members as u64 - 1) as usize;
            opening.push(Some(Nemesis::build(i, &mut run.rng, m, can)));
        }
    }
    run.opening = faultkinds::shuffled(opening, &mut run.rng);
    run.required_kinds = faultkinds::required(
        &run.opening
            .iter()
            .flatten()
            .map(Nemesis::kind)
            .collect::<Vec<_>>(),
    );
    run.event(format!(
        "soak: profile {} seed {seed:#x} for {duration:?}; disk-full faults: {} (m{disk_member}); \
         partition: {} (m{partition_member}); druid: {}; fault kinds to play: {}",
        profile.name,
        !run.mounts.is_empty(),
        run.partition.is_some(),
        run.druid.is_some(),
        run.required_kinds.join(",")
    ));
    let deadline = epoch + duration;
    loop {
        let every = run
            .rng
            .range(profile.handoff_every.0, profile.handoff_every.1);
        let until = (Instant::now() + Duration::from_secs(every)).min(deadline);
        run.serve(until).await;
        if run.stopped() {
            break;
        }
        let last = Instant::now() + Duration::from_secs(profile.handoff_every.0 / 2) >= deadline
            && run.counts.handoffs + 1 >= profile.min_handoffs;
        run.handoff(last).await;
        if last || run.stopped() {
            break;
        }
    }
    finish(run, scratch).await
}

/// Ownership against the owner record over the whole run, the last hand-off's final to the end
/// (`support::timeline`).
fn judge_ownership(run: &mut Run<'_>, recorded: &Recorded) {
    run.ownership.stop();
    let acks = run.acks(recorded);
    let finals: Vec<(String, i64, Option<Duration>)> = run
        .finals
        .iter()
        .map(|(n, r)| (n.clone(), *r, run.reclaimed_at.get(n).copied()))
        .collect();
    let mut t = super::timeline::world_timeline(&run.world, &run.ownership, &finals, &acks);
    t.pauses
        .extend(run.fault_log.iter().filter_map(|(n, from, to)| match n {
            Nemesis::SidecarFreeze(m) => Some(super::timeline::Pause {
                member: Some(*m),
                from: *from,
                to: *to,
                why: "sidecar frozen".into(),
            }),
            _ => None,
        }));
    run.event(format!("end: {}", super::timeline::summary(&t)));
    for v in super::timeline::judge(&t, &super::timeline::world_bounds(&run.world)) {
        run.violation(v.kind, v.detail);
    }
}

/// The end of a run: the history, the drill on every store, delta gaps, resources; the report.
async fn finish(mut run: Run<'_>, scratch: tempfile::TempDir) -> SoakOutcome {
    // A run stopped on a violation asked for (the plants' runner) has its verdict: the closing
    // write and the delta restores, a minute and a half of judging, are skipped.
    let closing = if run.stopped() {
        run.event("end: stopped on a violation asked for; no closing write");
        None
    } else {
        complete_history(&mut run).await
    };
    run.traffic.stop().await;
    if let Some(l) = &run.world.leases {
        l.stop.cancel();
    }
    run.stop_sampler.cancel();
    run.world.monitor().stop();
    if let Some(p) = &run.partition {
        let _ = p.heal();
    }
    let mut druid_summary = String::new();
    // Kept (the double serving the sidecars) until they stop.
    let druid = run.druid.take();
    if let Some(d) = &druid {
        let names = run
            .world
            .names
            .clone()
            .unwrap_or(super::invariants::MemberNames {
                names: Vec::new(),
                ids: Vec::new(),
            });
        let end = run.world.events.epoch.elapsed();
        let (found, renewals) = d.judge(&names, &run.fault_log, &run.handoff_windows, end);
        for v in found {
            run.violation(v.kind, v.detail);
        }
        druid_summary = format!(
            " druid: lease_renewals_seen={renewals} triggers_to_followers={} forwarded={}",
            d.triggers, d.forwarded
        );
    }
    let recorded = run.traffic.snapshot();
    let (model, model_summary) = judge_history(&mut run, &recorded, closing.is_some());
    judge_ownership(&mut run, &recorded);
    let mut lane_summary = String::from(" operator=absent");
    if let Some(mut lane) = run.lane.take() {
        for v in lane.judge().await {
            run.violation(v.kind, v.detail);
        }
        run.lane_report = std::mem::take(&mut lane.report);
        let r = lane.traffic.snapshot();
        lane_summary = format!(
            " operator: replacements={} dead_for_good={} operator_restarts={} \
             membership_changes={} writes={} reads={}",
            lane.replacements,
            lane.deaths,
            lane.operator_restarts,
            lane.members.lock().unwrap_or_else(|e| e.into_inner()).len(),
            r.ops
                .iter()
                .filter(|o| o.write_revision().is_some())
                .count(),
            r.ops
                .iter()
                .filter(|o| matches!(o.ret, kvcheck::Ret::Read { .. }))
                .count()
        );
    }
    // Every chain restores: the drill on the primary (the final's chain) and on the secondary.
    let mut drills = vec![("primary", vec!["--restore".to_string()])];
    if faultrun::other_binary().is_none() {
        drills.push((
            "secondary",
            vec!["--restore".to_string(), "--secondary".into()],
        ));
    }
    if run.stopped() {
        run.event("end: stopped on a violation asked for; no drills");
        drills.clear();
    }
    for (label, args) in drills {
        let (ok, said) = run.cli("verify", &args, &[]).await;
        run.drill_outputs.push((label, said.clone()));
        if let Some(passed) = ok.then(|| deltacheck::passed_drill(&said)).flatten() {
            run.preserve_drill(label, passed).await;
        }
        run.event(format!(
            "end: drill on the {label}: ok={ok}: {}",
            last_line(&said)
        ));
        if !ok {
            run.violation(
                "drill",
                format!(
                    "the drill on the {label} store failed with nothing faulted: {}",
                    tail(&said, 8, true)
                ),
            );
        }
    }
    run.judge_finals();
    let leadership = run
        .leadership
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    for (at, id, m) in opchecks::leader_defragmented(&leadership) {
        run.violation(
            "leader-defragmented",
            format!(
                "{:.1}s: m{m}'s sidecar defragmented member {id:x}, which every leadership \
                 sample from {:.1}s to {:.1}s names as the leader: leadership was not moved first",
                at.as_secs_f64(),
                (at.saturating_sub(opchecks::BEFORE)).as_secs_f64(),
                (at + opchecks::AFTER).as_secs_f64()
            ),
        );
    }
    let missed = faultkinds::missing(&run.required_kinds, &run.counts.faults);
    let kinds_summary = format!(
        " copy_job_retries={} defrags_seen={} fault_kinds={}/{}",
        run.counts.copy_retries,
        leadership.defrags.len(),
        run.required_kinds.len() - missed.len(),
        run.required_kinds.len()
    );
    for v in missed {
        if run.world.events.epoch.elapsed() >= faultkinds::JUDGED_FROM {
            run.violation(v.kind, v.detail);
        } else {
            run.event(format!("end: a short run: {}", v.detail));
        }
    }
    let snapshots = run.world.store.list().await.unwrap_or_default();
    let store_faults: Vec<(Duration, Duration)> = run
        .fault_log
        .iter()
        .filter(|(n, _, _)| matches!(n, Nemesis::Store(_)))
        .map(|(_, a, b)| (*a, *b))
        .collect();
    for g in deltacheck::gaps(&snapshots, &store_faults, run.wall_epoch) {
        run.violation("delta-gap", g);
    }
    let delta_summary = if run.stopped() {
        " deltas: not judged (stopped on a violation asked for)".to_string()
    } else {
        judge_deltas(&mut run, &model, &snapshots).await
    };
    // After the deltas are judged from the listing above: the probe's own deltas are not the
    // history's.
    let leak_summary = if run.stopped() || closing.is_none() {
        " leak_probe=unjudged (no closing write)".to_string()
    } else {
        match leakprobe::probe(&run.world).await {
            Ok(p) => {
                if let Some(v) = leakprobe::judge(p.member, &p.rss_after) {
                    run.violation("leaked", v);
                }
                format!(" leak_probe: m{} rss_kib={:?}", p.member, p.rss_after)
            }
            Err(why) => {
                // The history is complete and etcd serves: a probe that cannot run is a finding
                // of its own, never a pass.
                run.violation(
                    "leak-unjudged",
                    format!("the leak probe could not run after the closing write: {why}"),
                );
                format!(" leak_probe=unjudged ({why})")
            }
        }
    };
    let samples = run
        .samples
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    for f in flat(&samples, run.profile.flat_after) {
        run.violation("resources", f);
    }
    let writes = recorded
        .ops
        .iter()
        .filter(|o| o.write_revision().is_some())
        .count();
    let reads = recorded
        .ops
        .iter()
        .filter(|o| matches!(o.ret, kvcheck::Ret::Read { .. }))
        .count();
    let unknown = recorded
        .ops
        .iter()
        .filter(|o| o.ret == kvcheck::Ret::Unknown)
        .count();
    let events: usize = recorded.watches.iter().map(|w| w.events.len()).sum();
    let faults: u32 = run.counts.faults.values().sum();
    let peak_rss = samples.iter().map(|s| s.rss_kib).max().unwrap_or(0);
    let elapsed = run.world.events.epoch.elapsed();
    let c = &run.counts;
    let mut kinds: Vec<&str> = run.violations.iter().map(|v| v.kind).collect();
    kinds.sort_unstable();
    kinds.dedup();
    let summary = format!(
        "{} profile={} seed={:#x} {:.1} min: writes={writes} reads={reads} unknown={unknown} \
         watch_events={events} streams={} etcd_compactions={} faults={faults} {:?} handoffs={} \
         settled={} copies={} restores={} restore_disk_full={} reclaims={} compact_jobs={} \
         drills={} (failed under faults {}) peak_sidecar_rss={} MiB {}{model_summary}{delta_summary}\
         {lane_summary}{druid_summary}{kinds_summary}{leak_summary}{}",
        if run.violations.is_empty() {
            "PASS"
        } else {
            "FAIL"
        },
        run.profile.name,
        run.seed,
        elapsed.as_secs_f64() / 60.0,
        recorded.watches.len(),
        recorded.compactions.len(),
        c.faults,
        c.handoffs,
        c.settled,
        c.copies,
        c.restores,
        c.restore_disk_full,
        c.reclaims,
        c.compactions,
        c.drills,
        c.drill_failures,
        peak_rss / 1024,
        run.h53.reached,
        if kinds.is_empty() {
            String::new()
        } else {
            format!(" violations: {}", kinds.join(","))
        }
    );
    let want_report = !run.violations.is_empty() || std::env::var_os("SOAK_REPORT").is_some();
    let report_dir = if want_report {
        Some(write_report(&run, &summary, &recorded, &samples, &snapshots).await)
    } else {
        None
    };
    run.world.kubelet.stop();
    drop(druid);
    drop(run.mounts.drain(..));
    drop(run.restore_mount.take());
    let violations = run.violations.clone();
    let handoffs = run.h53.reached.clone();
    let fired = std::mem::take(&mut run.fired);
    drop(run);
    drop(scratch);
    SoakOutcome {
        violations,
        summary,
        report_dir,
        handoffs,
        fired,
    }
}

/// The report directory: summary, violations, the nemesis timeline, the history, the resources,
/// the store listing, every process's log and the replay command.
async fn write_report(
    run: &Run<'_>,
    summary: &str,
    recorded: &Recorded,
    samples: &[Sample],
    snapshots: &[Snapshot],
) -> PathBuf {
    let base = std::env::var_os("SOAK_REPORT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/robustness"));
    let dir = base.join(format!(
        "{}-{:x}-{}",
        run.profile.name,
        run.seed,
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    ));
    let _ = std::fs::create_dir_all(dir.join("logs"));
    let minutes = run.world.events.epoch.elapsed().as_secs().div_ceil(60);
    let replay = format!(
        "SOAK_PROFILE={} SOAK_SEED={:#x} SOAK_MINUTES={minutes} cargo test --release --test it -- --nocapture robustness::soak",
        run.profile.name, run.seed
    );
    let mut text = format!("{summary}\nreplay: {replay}\n\nviolations:\n");
    for v in &run.violations {
        let _ = writeln!(text, "  - {v}");
    }
    for n in &run.notes {
        let _ = writeln!(text, "  note: {n}");
    }
    let _ = std::fs::write(dir.join("summary.txt"), text);
    let _ = std::fs::write(dir.join("replay.txt"), format!("{replay}\n"));
    let mut report = String::new();
    run.world.describe(&mut report, snapshots);
    let _ = std::fs::write(dir.join("timeline.txt"), report);
    let mut history = String::new();
    for op in &recorded.ops {
        let _ = writeln!(history, "{}", serde_json::to_string(op).unwrap_or_default());
    }
    let _ = std::fs::write(dir.join("history.jsonl"), history);
    let mut watch = String::new();
    for w in &recorded.watches {
        let _ = writeln!(watch, "{}", serde_json::to_string(w).unwrap_or_default());
    }
    let _ = std::fs::write(dir.join("watch.jsonl"), watch);
    let mut csv = String::from("seconds,member,incarnation,rss_kib,fds,threads,leader\n");
    for s in samples {
        let _ = writeln!(
            csv,
            "{:.1},{},{},{},{},{},{}",
            s.at.as_secs_f64(),
            s.member,
            s.incarnation,
            s.rss_kib,
            s.fds,
            s.threads,
            s.leader.map_or("", |l| if l { "1" } else { "0" })
        );
    }
    let _ = std::fs::write(dir.join("resources.csv"), csv);
    let (_, listing) = run.cli("ls", &[], &[]).await;
    let _ = std::fs::write(dir.join("store.txt"), listing);
    for (m, p) in run.world.sidecar_logs.iter().enumerate() {
        let _ = std::fs::copy(p, dir.join(format!("logs/m{m}.sidecar.log")));
    }
    for (name, text) in &run.lane_report {
        let _ = std::fs::write(dir.join(name), text);
    }
    for (label, said) in &run.drill_outputs {
        let _ = std::fs::write(dir.join(format!("logs/drill-{label}.txt")), said);
    }
    for (m, p) in run.world.etcd_logs.iter().enumerate() {
        let _ = std::fs::copy(p, dir.join(format!("logs/m{m}.etcd.log")));
    }
    dir
}

/// The operator beside the sidecars' cluster: the local backend (real etcd processes on
/// loopback, a machine API deleting unhooked machines), its own recorded traffic, and now and
/// then a machine replaced or a member dead for good and then replaced. Judged by the same
/// history model, a read of every key at the end, and a quorum watch that reads each member
/// itself (not the operator's view).
pub struct OperatorLane {
    _dir: tempfile::TempDir,
    pub cluster: Arc<LocalCluster>,
    pub op: Arc<Operator<LocalCluster>>,
    cancel: CancellationToken,
    /// The running operator's own token: cancelling it is the operator process dying.
    op_run: CancellationToken,
    pub traffic: Traffic,
    /// (time, healthy voters, voters) whenever either changed.
    pub quorum: Arc<Mutex<Vec<(Duration, usize, usize)>>>,
    /// Files for the report directory, set by [`OperatorLane::judge`]: the lane's history and
    /// its quorum samples.
    pub report: Vec<(&'static str, String)>,
    pub replacements: u32,
    pub deaths: u32,
    pub operator_restarts: u32,
    epoch: Instant,
    /// The member list whenever it changed, read every 50 ms ([`opchecks::watch_membership`]).
    pub members: Arc<Mutex<Vec<opchecks::MemberSample>>>,
    /// The client URL of every etcd the lane killed for good, with when.
    killed: Vec<(Duration, String)>,
}

use etcd_warden::operator::local::{LocalCluster, LocalOptions};
use etcd_warden::operator::quorum::execute::{Operator, Timing};
use etcd_warden::operator::quorum::plan::{Condition, Replacement, Spec};

impl OperatorLane {
    pub async fn start(
        release: Release,
        seed: u64,
        epoch: Instant,
    ) -> Result<OperatorLane, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let cluster = LocalCluster::start(LocalOptions {
            members: 3,
            dir: dir.path().join("cluster"),
            etcd: release.bin("etcd"),
            no_fsync: true,
            set: None,
        })
        .await
        .map_err(|e| e.to_string())?;
        cluster
            .wait_ready(Duration::from_secs(30))
            .await
            .map_err(|e| e.to_string())?;
        let cancel = CancellationToken::new();
        tokio::spawn(Arc::clone(&cluster).run_machine_api(cancel.child_token()));
        let op = new_operator(&cluster);
        let op_run = cancel.child_token();
        {
            let (op, c) = (Arc::clone(&op), op_run.clone());
            tokio::spawn(async move { op.run(c).await });
        }
        let urls = {
            let c = Arc::clone(&cluster);
            Arc::new(move || c.client_urls()) as traffic::Endpoints
        };
        let members = Arc::new(Mutex::new(Vec::new()));
        tokio::spawn(opchecks::watch_membership(
            urls.clone(),
            epoch,
            members.clone(),
            cancel.child_token(),
        ));
        let traffic = Traffic::start(urls, seed ^ 0x0e7a, 1, epoch, Duration::from_secs(60));
        let quorum = Arc::new(Mutex::new(Vec::new()));
        tokio::spawn(watch_quorum(
            Arc::clone(&cluster),
            epoch,
            quorum.clone(),
            cancel.child_token(),
        ));
        Ok(OperatorLane {
            _dir: dir,
            cluster,
            op,
            cancel,
            traffic,
            quorum,
            report: Vec::new(),
            replacements: 0,
            deaths: 0,
            operator_restarts: 0,
            op_run,
            epoch,
            members,
            killed: Vec::new(),
        })
    }

    /// The operator dies wherever it is (its task cancelled mid-step) and a new one starts after
    /// `down`, knowing only what the cluster and the machines say.
    async fn restart_operator(&mut self, down: Duration) {
        self.op_run.cancel();
        tokio::time::sleep(down).await;
        self.op = new_operator(&self.cluster);
        self.op_run = self.cancel.child_token();
        let (op, c) = (Arc::clone(&self.op), self.op_run.clone());
        tokio::spawn(async move { op.run(c).await });
        self.operator_restarts += 1;
    }

    fn settled(&self) -> bool {
        matches!(self.op.status().condition, Some(Condition::Settled))
    }

    /// Replaces a machine (a rolling replacement) or kills one's etcd for good and then replaces
    /// it, when the operator is settled; what it did, for the event log.
    pub async fn act(&mut self, rng: &mut SplitMix64) -> String {
        if !self.settled() {
            return format!(
                "operator not settled ({:?}): nothing asked",
                self.op.status().condition
            );
        }
        let machines: Vec<_> = self
            .cluster
            .machines()
            .into_iter()
            .filter(|m| !m.deleting && m.pid.is_some())
            .collect();
        if machines.is_empty() {
            return "no running machine".into();
        }
        let m = &machines[rng.range(0, machines.len() as u64 - 1) as usize];
        let mut said = String::new();
        if rng.chance(40)
            && let Some(pid) = m.pid
        {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL);
            self.killed
                .push((self.epoch.elapsed(), m.client_url.clone()));
            self.deaths += 1;
            let _ = write!(said, "{}'s etcd killed for good; ", m.name);
            tokio::time::sleep(Duration::from_millis(rng.range(1000, 5000))).await;
        }
        match self.cluster.replace_machine(&m.name) {
            Ok(new) => {
                self.replacements += 1;
                let _ = write!(said, "{} replaced by {new}", m.name);
            }
            Err(e) => {
                let _ = write!(said, "replacing {} refused: {e}", m.name);
            }
        }
        if rng.chance(35) {
            // Mid-replacement: the operator dies and another takes over.
            tokio::time::sleep(Duration::from_millis(rng.range(200, 3000))).await;
            let down = Duration::from_millis(rng.range(100, 3000));
            self.restart_operator(down).await;
            let _ = write!(
                said,
                "; the operator killed mid-replacement, back after {down:?}"
            );
        }
        said
    }

    /// The lane's findings: its history, every key read back at the end, quorum.
    pub async fn judge(&mut self) -> Vec<Violation> {
        let mut out = Vec::new();
        let settled = super::eventually(Duration::from_secs(90), || async { self.settled() }).await;
        if !settled {
            out.push(Violation {
                kind: "operator-unsettled",
                detail: format!(
                    "the operator did not settle within 90 s of the run's end: {:?}",
                    self.op.status().condition
                ),
            });
        }
        self.traffic.stop().await;
        self.cancel.cancel();
        let recorded = self.traffic.snapshot();
        for f in kvcheck::check(&recorded.ops, &recorded.watches) {
            out.push(Violation {
                kind: "operator-history",
                detail: f.to_string(),
            });
        }
        match read_cluster(&self.cluster.client_urls()).await {
            Ok((revision, contents)) => {
                for f in
                    kvcheck::restored_state(&recorded.ops, &recorded.watches, revision, &contents)
                {
                    out.push(Violation {
                        kind: "operator-lost-write",
                        detail: f.to_string(),
                    });
                }
            }
            Err(e) => out.push(Violation {
                kind: "operator-lost-write",
                detail: format!("the cluster could not be read at the end: {e}"),
            }),
        }
        let samples = self
            .quorum
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let committed: Vec<Duration> = recorded
            .ops
            .iter()
            .filter(|o| !matches!(o.ret, kvcheck::Ret::Unknown))
            .map(|o| o.completed)
            .collect();
        for (from, to, gap) in quorum_lost(&samples, &committed, QUORUM_GRACE) {
            out.push(Violation {
                kind: "quorum-lost",
                detail: format!(
                    "{:.1}s..{:.1}s: fewer healthy voters than a majority, and no write or \
                     linearizable read of the lane's traffic completed for {:.1}s of it",
                    from.as_secs_f64(),
                    to.as_secs_f64(),
                    gap.as_secs_f64()
                ),
            });
        }
        let members = self
            .members
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for f in opchecks::voters_removed_early(&members, &self.killed, 3) {
            out.push(Violation {
                kind: "voter-removed-early",
                detail: f,
            });
        }
        let mut membership = String::new();
        for m in &members {
            let _ = writeln!(membership, "{:.3} {:x?}", m.at.as_secs_f64(), m.members);
        }
        let mut history = String::new();
        for op in &recorded.ops {
            let _ = writeln!(history, "{}", serde_json::to_string(op).unwrap_or_default());
        }
        let mut quorum = String::from("seconds,healthy_voters,voters\n");
        for (t, healthy, voters) in &samples {
            let _ = writeln!(quorum, "{:.3},{healthy},{voters}", t.as_secs_f64());
        }
        self.report = vec![
            ("operator-history.jsonl", history),
            ("operator-quorum.csv", quorum),
            ("operator-members.txt", membership),
        ];
        out
    }
}

/// Longest a majority may be missing: an election or a member restarting takes less.
const QUORUM_GRACE: Duration = Duration::from_secs(5);

/// Where the lane lost quorum: a stretch of the status probe's `samples` (time, healthy voters,
/// voters) below a majority for more than `grace`, within which no operation that needs a
/// majority (an acknowledged write or a linearizable read, completed at the times in
/// `committed`) completed for more than `grace`. The probe alone reads a member that is slow to
/// answer its 800 ms status call (a just-promoted member at a load of 60) as unhealthy; a
/// committed operation proves a majority was there. Returns (from, to, longest gap without a
/// committed operation) per stretch.
fn quorum_lost(
    samples: &[(Duration, usize, usize)],
    committed: &[Duration],
    grace: Duration,
) -> Vec<(Duration, Duration, Duration)> {
    let mut out = Vec::new();
    let mut below: Option<Duration> = None;
    for (t, healthy, voters) in samples {
        let lost = *healthy < voters / 2 + 1;
        match (lost, below) {
            (true, None) => below = Some(*t),
            (false, Some(from)) => {
                below = None;
                if *t - from <= grace {
                    continue;
                }
                let mut edges: Vec<Duration> = committed
                    .iter()
                    .copied()
                    .filter(|c| *c > from && *c < *t)
                    .collect();
                edges.push(from);
                edges.push(*t);
                edges.sort();
                let gap = edges
                    .windows(2)
                    .map(|w| w[1] - w[0])
                    .max()
                    .unwrap_or_default();
                if gap > grace {
                    out.push((from, *t, gap));
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod quorum_tests {
    use super::*;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn a_probe_stretch_below_a_majority_with_no_committed_operation_is_quorum_lost() {
        let samples = [(s(10.0), 3, 3), (s(12.0), 1, 3), (s(20.0), 3, 3)];
        let lost = quorum_lost(&samples, &[s(11.0), s(21.0)], QUORUM_GRACE);
        assert_eq!(lost, vec![(s(12.0), s(20.0), s(8.0))]);
        // Committed operations, but a 6 s hole between two of them: still lost.
        let lost = quorum_lost(&samples, &[s(13.0), s(19.5)], QUORUM_GRACE);
        assert_eq!(lost, vec![(s(12.0), s(20.0), s(6.5))]);
    }

    #[test]
    fn operations_committed_throughout_a_low_probe_stretch_prove_a_majority() {
        let samples = [(s(10.0), 3, 4), (s(12.0), 2, 4), (s(20.0), 3, 4)];
        let committed: Vec<Duration> = (0..20).map(|i| s(12.2 + f64::from(i) * 0.4)).collect();
        assert!(quorum_lost(&samples, &committed, QUORUM_GRACE).is_empty());
    }

    #[test]
    fn a_short_stretch_below_a_majority_is_an_election() {
        let samples = [(s(10.0), 1, 3), (s(14.9), 3, 3)];
        assert!(quorum_lost(&samples, &[], QUORUM_GRACE).is_empty());
    }
}

fn new_operator(cluster: &Arc<LocalCluster>) -> Arc<Operator<LocalCluster>> {
    Arc::new(Operator::new(
        Spec {
            desired_voters: 3,
            replacement: Replacement::OnDeletion,
        },
        Arc::clone(cluster),
        cluster.client_urls(),
        Timing {
            interval: Duration::from_millis(200),
            min_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
        },
    ))
}

/// Samples the lane's members every 250 ms: healthy voters (a member that answers with a leader
/// and is not a learner) and voters (from the member list).
async fn watch_quorum(
    cluster: Arc<LocalCluster>,
    epoch: Instant,
    out: Arc<Mutex<Vec<(Duration, usize, usize)>>>,
    stop: CancellationToken,
) {
    let mut last = None;
    while !stop.is_cancelled() {
        let mut healthy = 0;
        let mut voters = None;
        for url in cluster.client_urls() {
            let Ok(mut c) = super::writer::connect(&url).await else {
                continue;
            };
            let status = tokio::time::timeout(Duration::from_millis(800), c.status()).await;
            if let Ok(Ok(s)) = status
                && s.leader() != 0
                && !s.is_learner()
            {
                healthy += 1;
            }
            if voters.is_none()
                && let Ok(Ok(list)) =
                    tokio::time::timeout(Duration::from_millis(800), c.member_list()).await
            {
                voters = Some(list.members().iter().filter(|m| !m.is_learner()).count());
            }
        }
        if let Some(v) = voters
            && last != Some((healthy, v))
        {
            last = Some((healthy, v));
            out.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((epoch.elapsed(), healthy, v));
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// Every traffic key of a running cluster, read linearizably: (revision, contents).
async fn read_cluster(urls: &[String]) -> Result<(i64, BTreeMap<String, Seen>), String> {
    let client = etcd_client::Client::connect(urls, None)
        .await
        .map_err(|e| e.to_string())?;
    let r = client
        .kv_client()
        .max_decoding_message_size(1 << 30)
        .get(
            traffic::PREFIX,
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .map_err(|e| e.to_string())?;
    let revision = r.header().map_or(0, |h| h.revision());
    Ok((revision, contents_of(r.kvs())))
}

fn contents_of(kvs: &[etcd_client::KeyValue]) -> BTreeMap<String, Seen> {
    kvs.iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                Seen {
                    id: kvcheck::id_of(kv.value()).unwrap_or_else(|| {
                        format!("<not a traffic value, {} bytes>", kv.value().len())
                    }),
                    mod_revision: kv.mod_revision(),
                },
            )
        })
        .collect()
}

#[cfg(test)]
mod lease_tests {
    use super::*;

    const IDS: [u64; 2] = [0xa1, 0xb2];

    fn renewals(member: usize, holder: &str, every: u64, until: u64) -> Vec<LeaseSeen> {
        (0..until / every)
            .map(|i| LeaseSeen {
                at: Duration::from_secs(i * every),
                member,
                holder: holder.to_string(),
                renew: String::new(),
            })
            .collect()
    }

    fn kinds(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(|v| v.kind).collect()
    }

    const END: Duration = Duration::from_secs(120);

    #[test]
    fn leases_renewed_by_their_own_members_pass() {
        let mut seen = renewals(0, "a1:c:Leader", 1, 120);
        seen.extend(renewals(1, "b2:c:Member", 1, 120));
        assert!(judge_leases(&seen, &IDS, &[], &[], END).is_empty());
    }

    #[test]
    fn a_lease_naming_another_or_no_member_or_cluster_is_found() {
        let mut seen = renewals(0, "a1:c:Leader", 1, 120);
        seen.extend(renewals(1, "b2:c:Member", 1, 60));
        // m1's Lease naming m0, then a member that is not one, then another cluster.
        seen.extend(renewals(1, "a1:c:Member", 1, 1));
        seen.extend(renewals(1, "ff:c:Member", 1, 1));
        seen.extend(renewals(1, "b2:d:Member", 1, 1));
        seen.extend(renewals(1, "garbage", 1, 1));
        let v = judge_leases(&seen, &IDS, &[], &[], Duration::from_secs(60));
        assert_eq!(kinds(&v), ["druid-lease"; 4], "{v:?}");
    }

    #[test]
    fn a_lease_left_unrenewed_is_found_unless_a_fault_explains_it() {
        let mut seen = renewals(0, "a1:c:Leader", 1, 120);
        let m1: Vec<LeaseSeen> = renewals(1, "b2:c:Member", 1, 120)
            .into_iter()
            .filter(|l| !(40..90).contains(&l.at.as_secs()))
            .collect();
        seen.extend(m1);
        let v = judge_leases(&seen, &IDS, &[], &[], END);
        assert_eq!(kinds(&v), ["druid-lease-stale"], "{v:?}");
        // m1's etcd killed at the start of the gap: explained. m0's sidecar killed: not.
        let s = Duration::from_secs;
        let killed = [(Nemesis::EtcdKill(1), s(38), s(39))];
        assert!(judge_leases(&seen, &IDS, &killed, &[], END).is_empty());
        let other = [(Nemesis::SidecarKill(0, 0), s(38), s(39))];
        assert_eq!(judge_leases(&seen, &IDS, &other, &[], END).len(), 1);
        let api = [(Nemesis::ApiServer(FaultMode::Down), s(50), s(52))];
        assert!(judge_leases(&seen, &IDS, &api, &[], END).is_empty());
        assert!(judge_leases(&seen, &IDS, &[], &[(s(35), s(45))], END).is_empty());
        // Never renewed, or not since long before the end.
        let v = judge_leases(&renewals(0, "a1:c:Leader", 1, 50), &IDS, &[], &[], END);
        assert_eq!(
            kinds(&v),
            ["druid-lease-stale", "druid-lease-stale"],
            "{v:?}"
        );
    }
}
