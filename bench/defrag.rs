//! Defragmentation side by side (issue #41): what clients spread over a 3-member etcd 3.5 see
//! while (1) etcd-warden's pass defragments every member, moving leadership away before the
//! leader's turn, (2) the leader alone is defragmented in place, (3) etcd-backup-restore's
//! defragmentor (`etcdbrctl server`, one per member as etcd-druid runs it) defragments the
//! followers and then the leader in place.
//!
//! `cargo bench --bench defrag -- <work-dir> [rounds] [etcdbrctl] [mib]`
//!
//! The first run builds `<work-dir>/base`: a 3-member cluster written with `mib` MiB (default
//! 1024) of 64 KiB values, every other key deleted, the history compacted (a database file of
//! ~`mib` MiB, about half of it free). Each arm runs on a fresh copy of those data directories,
//! on the same ports, with fsync on and `info` logs; `rounds` rounds (default 3) run the arms
//! in a rotating order. Without `etcdbrctl` (a path to the binary) its arm is left out;
//! `DEFRAG_BENCH_ARMS` (a comma list of `warden`, `inplace`, `ebr`) runs only those arms.
//!
//! The load is kube-apiserver's shape: a client per member, talking only to that member (as an
//! API server talks to its local etcd), each with a writer (1 KiB puts), a linearizable reader
//! and a lease keep-alive stream (15 s TTL), every request timed. When each member was being
//! defragmented is read from its own log (etcd's "starting defragment" / "finished
//! defragment"), so a request is counted as through a defragmenting member, or not, the same way
//! in every arm. Results go in docs/benchmarks.md.

mod common;
#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use chrono::{DateTime, Utc};
use etcd_client::{Client, CompactionOptions, DeleteOptions};
use etcd_warden::config::GcPolicy;
use etcd_warden::etcd::RotatingClient;
use etcd_warden::etcd::process::{self, EtcdProcess, MemberSpec};
use etcd_warden::snapshot::actor;
use etcd_warden::snapshot::engine::EtcdEngine;
use etcd_warden::snapshot::gate::Gate;
use etcd_warden::snapshot::metrics::SnapshotMetrics;
use etcd_warden::store::Codec;
use etcd_warden::store::gc::Retention;
use futures::StreamExt;
use support::etcd::Release;
use tokio_util::sync::CancellationToken;

const MEMBERS: usize = 3;
const VALUE: usize = 64 * 1024;
/// etcd's default quota (2 GiB) would refuse the bulk load's history before its compaction.
const QUOTA: &str = "8589934592";
/// Longest a client request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause between one client's requests.
const PACE: Duration = Duration::from_millis(20);
/// Load before the first defragmentation starts and after the last ends that counts.
const MARGIN: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    Warden,
    InPlace,
    Ebr,
}

impl Arm {
    fn key(self) -> &'static str {
        match self {
            Arm::Warden => "warden",
            Arm::InPlace => "inplace",
            Arm::Ebr => "ebr",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Arm::Warden => "etcd-warden pass",
            Arm::InPlace => "leader in place",
            Arm::Ebr => "etcd-backup-restore",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write,
    Read,
    KeepAlive,
}

const KINDS: [Kind; 3] = [Kind::Write, Kind::Read, Kind::KeepAlive];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Write => "write",
            Kind::Read => "linearizable read",
            Kind::KeepAlive => "lease keep-alive",
        }
    }
}

/// One client request: which kind, through which member, when it started, how long it took.
#[derive(Debug, Clone, Copy)]
struct Sample {
    kind: Kind,
    member: usize,
    start: SystemTime,
    latency: Duration,
    ok: bool,
}

impl Sample {
    fn end(&self) -> SystemTime {
        self.start + self.latency
    }
}

/// A member's defragmentation, from its log.
#[derive(Debug, Clone, Copy)]
struct Interval {
    member: usize,
    start: SystemTime,
    end: SystemTime,
}

/// The members' ports, fixed by the base cluster (its peer URLs are in the data).
fn read_ports(base: &Path) -> Option<Vec<(u16, u16)>> {
    let text = std::fs::read_to_string(base.join("ports")).ok()?;
    text.lines()
        .map(|l| {
            let mut it = l.split_whitespace().map(|p| p.parse().ok());
            Some((it.next()??, it.next()??))
        })
        .collect()
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

async fn connect(url: &str) -> Client {
    Client::connect([url], None)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// Each member's (ID, database size, size in use, leader, raft index), by its own status.
async fn statuses(urls: &[String]) -> Vec<(u64, i64, i64, u64, u64)> {
    let mut out = Vec::new();
    for u in urls {
        let s = connect(u).await.status().await.expect("status");
        out.push((
            s.header().expect("header").member_id(),
            s.db_size(),
            s.raft_used_db_size(),
            s.leader(),
            s.raft_index(),
        ));
    }
    out
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Builds the base cluster: `size_mib` MiB of values, half deleted, compacted.
async fn prepare(base: &Path, size_mib: usize) {
    std::fs::create_dir_all(base).expect("base dir");
    let mut specs: Vec<MemberSpec> = (0..MEMBERS)
        .map(|i| {
            let mut s = MemberSpec::new(format!("m{i}"), base.join(format!("m{i}.etcd")));
            s.bootstrap = Some(process::Bootstrap {
                initial_cluster: None,
                state: process::ClusterState::New,
                token: "defrag-bench".into(),
            });
            s.no_fsync = true;
            s.log = Some(base.join(format!("m{i}.log")));
            // Snapshots every 10000 entries let etcd drop the bulk load's WAL files.
            s.extra_args = vec![
                "--quota-backend-bytes".into(),
                QUOTA.into(),
                "--snapshot-count".into(),
                "10000".into(),
            ];
            s
        })
        .collect();
    let procs =
        process::start_cluster(Release::V35.binaries(), &mut specs, Duration::from_secs(60))
            .await
            .expect("start the base cluster");
    let urls: Vec<String> = specs.iter().map(MemberSpec::client_url).collect();
    let client = Client::connect(&urls, None).await.expect("connect");
    let n = size_mib * 1024 * 1024 / VALUE;
    let value: Vec<u8> = (0..VALUE).map(|i| (i * 7 % 251) as u8).collect();
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let mut c = client.clone();
            let v = value.clone();
            async move { c.put(format!("/bulk/{i:07}"), v, None).await.expect("put") }
        })
        .buffer_unordered(16)
        .for_each(|_| async {})
        .await;
    println!(
        "prepare: {n} values of {VALUE} bytes in {:.0?}",
        t.elapsed()
    );
    futures::stream::iter((0..n).step_by(2))
        .map(|i| {
            let mut c = client.clone();
            async move {
                c.delete(format!("/bulk/{i:07}"), None::<DeleteOptions>)
                    .await
                    .expect("delete")
            }
        })
        .buffer_unordered(16)
        .for_each(|_| async {})
        .await;
    let mut c = client.clone();
    let rev = support::etcd::revision(&mut c, "/bulk").await;
    c.compact(rev, Some(CompactionOptions::new().with_physical()))
        .await
        .expect("compact");
    // bbolt counts freed pages as free only after a later write transaction.
    for waited in 0.. {
        let s = statuses(&urls).await;
        if s.iter().all(|m| m.2 < m.1 * 6 / 10) {
            break;
        }
        assert!(waited < 300, "the compaction never freed the pages");
        c.put("/tick", "t", None).await.expect("tick");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for m in statuses(&urls).await {
        println!(
            "prepare: member {:x}: database {:.0} MiB, {:.0} MiB in use",
            m.0,
            mib(m.1),
            mib(m.2)
        );
    }
    for p in procs {
        p.terminate(Duration::from_secs(60))
            .await
            .expect("stop a base member");
    }
    let ports: Vec<String> = specs
        .iter()
        .map(|s| format!("{} {}", s.client_port, s.peer_port))
        .collect();
    std::fs::write(base.join("ports"), ports.join("\n") + "\n").expect("write ports");
}

/// One arm's cluster: copies of the base data directories, started on the base's ports.
struct Cluster {
    procs: Vec<EtcdProcess>,
    urls: Vec<String>,
    ids: Vec<u64>,
    logs: Vec<PathBuf>,
}

impl Cluster {
    async fn start(base: &Path, dir: &Path, ports: &[(u16, u16)]) -> Cluster {
        std::fs::create_dir_all(dir).expect("arm dir");
        let mut specs = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let data = dir.join(format!("m{i}.etcd"));
            common::run(
                Command::new("cp")
                    .arg("-a")
                    .arg(base.join(format!("m{i}.etcd")))
                    .arg(&data),
            );
            let mut s = MemberSpec::new(format!("m{i}"), data);
            s.bootstrap = None;
            s.client_port = *client;
            s.peer_port = *peer;
            s.log_level = "info".into();
            s.log = Some(dir.join(format!("m{i}.log")));
            s.extra_args = vec!["--quota-backend-bytes".into(), QUOTA.into()];
            specs.push(s);
        }
        let procs = process::start_cluster(
            Release::V35.binaries(),
            &mut specs,
            Duration::from_secs(120),
        )
        .await
        .expect("start the arm's cluster");
        let urls: Vec<String> = specs.iter().map(MemberSpec::client_url).collect();
        let logs = specs.iter().filter_map(|s| s.log.clone()).collect();
        // Every member caught up and naming one leader before the load starts.
        let mut ids = Vec::new();
        for waited in 0.. {
            let s = statuses(&urls).await;
            let leader = s[0].3;
            let top = s.iter().map(|m| m.4).max().unwrap_or(0);
            if leader != 0 && s.iter().all(|m| m.3 == leader && m.4 + 10 >= top) {
                ids = s.iter().map(|m| m.0).collect();
                break;
            }
            assert!(waited < 300, "the arm's cluster never settled: {s:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Cluster {
            procs,
            urls,
            ids,
            logs,
        }
    }

    /// The leader's index among the members.
    async fn leader(&self) -> usize {
        let s = statuses(&self.urls).await;
        self.ids
            .iter()
            .position(|id| *id == s[0].3)
            .expect("the leader is a member")
    }

    async fn stop(self) {
        for p in self.procs {
            if p.terminate(Duration::from_secs(30)).await.is_err() {
                p.kill();
            }
        }
    }

    /// Each member's defragmentations, from its log.
    fn intervals(&self) -> Vec<Interval> {
        let mut out = Vec::new();
        for (member, log) in self.logs.iter().enumerate() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let mut start = None;
            for line in text.lines() {
                if line.contains("\"msg\":\"starting defragment\"") {
                    start = log_time(line);
                } else if line.contains("\"msg\":\"finished defragment\"")
                    && let (Some(s), Some(e)) = (start.take(), log_time(line))
                {
                    out.push(Interval {
                        member,
                        start: s,
                        end: e,
                    });
                }
            }
        }
        out.sort_by_key(|i| i.start);
        out
    }
}

/// The `ts` of one of etcd's JSON log lines ("2026-11-28T15:39:03.123Z" or "...+0100").
fn log_time(line: &str) -> Option<SystemTime> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let ts = v.get("ts")?.as_str()?;
    let ts = ts
        .strip_suffix('Z')
        .map_or(ts.to_string(), |t| format!("{t}+0000"));
    let t = DateTime::parse_from_str(&ts, "%Y-%m-%dT%H:%M:%S%.f%z").ok()?;
    Some(SystemTime::from(t.with_timezone(&Utc)))
}

type Samples = Arc<Mutex<Vec<Sample>>>;

fn record(samples: &Samples, kind: Kind, member: usize, start: SystemTime, t: Instant, ok: bool) {
    let s = Sample {
        kind,
        member,
        start,
        latency: t.elapsed(),
        ok,
    };
    samples.lock().expect("samples").push(s);
}

/// One member's writer and linearizable reader: a request, then `PACE`, until `stop`.
async fn rw_client(
    url: String,
    member: usize,
    kind: Kind,
    samples: Samples,
    stop: CancellationToken,
) {
    let mut c = connect(&url).await;
    let value = vec![b'v'; 1024];
    let mut n = 0u64;
    while !stop.is_cancelled() {
        let key = format!("/load/m{member}/{}", n % 100);
        n += 1;
        let (start, t) = (SystemTime::now(), Instant::now());
        let ok = match kind {
            Kind::Write => {
                matches!(
                    tokio::time::timeout(REQUEST_TIMEOUT, c.put(key, value.clone(), None)).await,
                    Ok(Ok(_))
                )
            }
            _ => matches!(
                tokio::time::timeout(REQUEST_TIMEOUT, c.get(key, None)).await,
                Ok(Ok(_))
            ),
        };
        record(&samples, kind, member, start, t, ok);
        tokio::time::sleep(PACE).await;
    }
}

/// One member's lease keep-alive stream: a keep-alive, its answer, then `PACE`, until `stop`.
/// A failed keep-alive opens the stream again (that first keep-alive is timed too); a lease
/// that expired meanwhile is granted again (not timed).
async fn keepalive_client(url: String, member: usize, samples: Samples, stop: CancellationToken) {
    let mut c = connect(&url).await;
    let mut lease = c.lease_grant(15, None).await.expect("lease grant").id();
    let mut stream = None;
    while !stop.is_cancelled() {
        let (start, t) = (SystemTime::now(), Instant::now());
        let ok = match stream.as_mut() {
            None => match tokio::time::timeout(REQUEST_TIMEOUT, c.lease_keep_alive(lease)).await {
                Ok(Ok(s)) => {
                    stream = Some(s);
                    true
                }
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(_))) => {
                    // Expired while the stream was down.
                    if let Ok(Ok(r)) =
                        tokio::time::timeout(REQUEST_TIMEOUT, c.lease_grant(15, None)).await
                    {
                        lease = r.id();
                    }
                    false
                }
                _ => false,
            },
            Some((keeper, answers)) => {
                let ka = async {
                    keeper.keep_alive().await?;
                    answers.message().await
                };
                match tokio::time::timeout(REQUEST_TIMEOUT, ka).await {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => true,
                    _ => {
                        stream = None;
                        false
                    }
                }
            }
        };
        record(&samples, Kind::KeepAlive, member, start, t, ok);
        tokio::time::sleep(PACE).await;
    }
}

/// etcd-warden's pass: the snapshot actor next to the leader (its etcd endpoint the leader's),
/// asked for a pass once its first full snapshot (due at once on an empty store) is taken, so
/// the pass runs as it does in a sidecar that has been up for a while.
struct Warden {
    actor: actor::ActorHandle,
    task: tokio::task::JoinHandle<()>,
    cancel: CancellationToken,
    _gate: tokio::sync::watch::Sender<Gate>,
}

impl Warden {
    async fn next_to(url: &str, store: &Path) -> Warden {
        let engine = EtcdEngine::new(
            RotatingClient::connect(&support::etcd::plain_client_config(
                vec![url.to_string()],
                Duration::from_secs(10),
            ))
            .await
            .expect("warden's etcd client"),
            support::file_store(store),
            Codec::Gzip,
            Retention {
                policy: GcPolicy::LimitBased { max_backups: 100 },
                delta_retention: Duration::ZERO,
            },
        );
        let mut config =
            support::quiet_actor_config(Duration::ZERO, u64::MAX, Duration::from_secs(600));
        config.defrag.timeout = Duration::from_secs(600);
        let cancel = CancellationToken::new();
        let (gate, gate_rx) = tokio::sync::watch::channel(Gate::Open);
        let (actor, task) = actor::spawn(
            engine,
            config,
            gate_rx,
            SnapshotMetrics::default(),
            cancel.clone(),
        );
        let mut status = actor.watch_status();
        tokio::time::timeout(
            Duration::from_secs(600),
            status.wait_for(|s| s.leader && s.last_full.is_some()),
        )
        .await
        .expect("the actor leads and took its first full snapshot")
        .expect("actor status");
        drop(status);
        Warden {
            actor,
            task,
            cancel,
            _gate: gate,
        }
    }

    async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

/// `etcdbrctl server` next to each member, as etcd-druid runs it (its etcd config file at
/// `ETCD_CONF`, the pod's name), with no store and a defragmentation schedule of every minute:
/// the sidecar whose member leads runs the defragmentor.
fn start_ebr(bin: &Path, dir: &Path, cluster: &Cluster, ports: &[(u16, u16)]) -> Vec<Child> {
    let initial: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| format!("m{i}={}", url(p.1)))
        .collect();
    let initial = initial.join(",");
    let mut out = Vec::new();
    for (i, (client, peer)) in ports.iter().enumerate() {
        let conf = dir.join(format!("ebr-m{i}.yaml"));
        let yaml = format!(
            "name: m{i}\ndata-dir: {data}\ninitial-cluster: {initial}\n\
             initial-advertise-peer-urls:\n  m{i}:\n  - {peer}\n\
             advertise-client-urls:\n  m{i}:\n  - {client}\n\
             listen-client-urls: {client}\nlisten-peer-urls: {peer}\n",
            data = dir.join(format!("m{i}.etcd")).display(),
            peer = url(*peer),
            client = url(*client),
        );
        std::fs::write(&conf, yaml).expect("write ebr etcd config");
        let tmp = dir.join(format!("ebr-m{i}.tmp"));
        std::fs::create_dir_all(&tmp).expect("ebr temp dir");
        let log = std::fs::File::create(dir.join(format!("ebr-m{i}.log"))).expect("ebr log");
        let port = process::pick_port().expect("a port");
        let child = Command::new(bin)
            .arg("server")
            .arg(format!("--endpoints={}", cluster.urls[i]))
            .arg(format!("--service-endpoints={}", cluster.urls[i]))
            .arg("--defragmentation-schedule=* * * * *")
            .arg(format!(
                "--data-dir={}",
                dir.join(format!("m{i}.etcd")).display()
            ))
            .arg(format!("--server-port={port}"))
            .arg("--insecure-transport=true")
            .arg("--etcd-connection-timeout=30s")
            .arg("--etcd-defrag-timeout=8m")
            .arg(format!("--snapstore-temp-directory={}", tmp.display()))
            .arg(format!(
                "--restoration-temp-snapshots-dir={}",
                tmp.display()
            ))
            .env("ETCD_CONF", &conf)
            .env("POD_NAME", format!("m{i}"))
            .env("POD_NAMESPACE", "default")
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start etcdbrctl server");
        out.push(child);
    }
    out
}

/// Waits until the members' own logs show `members` defragmentations finished: etcd goes on
/// with a defragmentation whose caller gave up (etcdbrctl's leader elector cancels its
/// defragmentor when its member's status times out, as it does while the leader defragments).
/// Prints what etcdbrctl said about failures.
async fn wait_ebr(dir: &Path, members: usize) -> Result<(), String> {
    // The schedule fires within a minute, the defragmentor's first try a minute after that;
    // a busy cluster (a timed-out member list) puts it off by another minute each time.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut told = false;
    loop {
        let mut done = 0;
        for i in 0..MEMBERS {
            let etcd = std::fs::read_to_string(dir.join(format!("m{i}.log"))).unwrap_or_default();
            done += etcd.matches("\"msg\":\"finished defragment\"").count();
            let text =
                std::fs::read_to_string(dir.join(format!("ebr-m{i}.log"))).unwrap_or_default();
            if !told && (text.contains("failed to defrag") || text.contains("level=fatal")) {
                told = true;
                let failed: Vec<&str> = text
                    .lines()
                    .filter(|l| l.contains("level=error") || l.contains("level=fatal"))
                    .collect();
                println!("  etcdbrctl m{i} reported:\n{}", failed.join("\n"));
            }
        }
        if done >= members {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{done} of {members} members defragmented within 600 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What one arm measured.
struct Outcome {
    samples: Vec<Sample>,
    intervals: Vec<Interval>,
    leader: usize,
    db_mib: f64,
}

async fn run_arm(
    arm: Arm,
    base: &Path,
    dir: &Path,
    ports: &[(u16, u16)],
    ebr: Option<&Path>,
) -> Outcome {
    let _ = std::fs::remove_dir_all(dir);
    let cluster = Cluster::start(base, dir, ports).await;
    let leader = cluster.leader().await;
    let db_mib = mib(statuses(&cluster.urls).await[leader].1);
    let warden = match arm {
        Arm::Warden => Some(Warden::next_to(&cluster.urls[leader], &dir.join("store")).await),
        _ => None,
    };
    let samples: Samples = Arc::default();
    let stop = CancellationToken::new();
    let mut load = Vec::new();
    for (m, u) in cluster.urls.iter().enumerate() {
        for kind in [Kind::Write, Kind::Read] {
            load.push(tokio::spawn(rw_client(
                u.clone(),
                m,
                kind,
                samples.clone(),
                stop.clone(),
            )));
        }
        load.push(tokio::spawn(keepalive_client(
            u.clone(),
            m,
            samples.clone(),
            stop.clone(),
        )));
    }
    tokio::time::sleep(MARGIN).await;
    let mut ebr_children = Vec::new();
    match arm {
        Arm::InPlace => {
            let mut c = connect(&cluster.urls[leader]).await;
            c.defragment().await.expect("defragment the leader");
        }
        Arm::Warden => {
            let w = warden.expect("warden");
            let report = w.actor.defrag().await.expect("etcd-warden's pass");
            println!("  etcd-warden events: {:?}", report.events);
            w.stop().await;
        }
        Arm::Ebr => {
            let bin = ebr.expect("etcdbrctl");
            ebr_children = start_ebr(bin, dir, &cluster, ports);
            if let Err(e) = wait_ebr(dir, MEMBERS).await {
                println!("  etcd-backup-restore: {e}");
            }
        }
    }
    tokio::time::sleep(MARGIN).await;
    stop.cancel();
    for t in load {
        let _ = t.await;
    }
    for mut c in ebr_children {
        let _ = c.kill();
        let _ = c.wait();
    }
    let intervals = cluster.intervals();
    cluster.stop().await;
    let samples = std::mem::take(&mut *samples.lock().expect("samples"));
    Outcome {
        samples,
        intervals,
        leader,
        db_mib,
    }
}

/// Whether `s` overlapped a defragmentation of the member it went through.
fn during_own_defrag(s: &Sample, intervals: &[Interval]) -> bool {
    intervals
        .iter()
        .any(|i| i.member == s.member && s.start < i.end && s.end() > i.start)
}

/// The samples within `MARGIN` of the defragmentations (all of them when there were none).
fn window(o: &Outcome) -> Vec<Sample> {
    let (Some(first), Some(last)) = (
        o.intervals.iter().map(|i| i.start).min(),
        o.intervals.iter().map(|i| i.end).max(),
    ) else {
        return o.samples.clone();
    };
    o.samples
        .iter()
        .filter(|s| s.end() >= first - MARGIN && s.start <= last + MARGIN)
        .copied()
        .collect()
}

/// n, failures, p99 and maximum of `samples`' latencies.
fn stats<'a>(samples: impl Iterator<Item = &'a Sample>) -> (usize, usize, Duration, Duration) {
    let mut lat: Vec<Duration> = Vec::new();
    let mut failed = 0;
    for s in samples {
        lat.push(s.latency);
        failed += usize::from(!s.ok);
    }
    if lat.is_empty() {
        return (0, 0, Duration::ZERO, Duration::ZERO);
    }
    lat.sort();
    let p99 = lat[(lat.len() * 99).div_ceil(100).saturating_sub(1)];
    (lat.len(), failed, p99, lat[lat.len() - 1])
}

/// The longest time a member's keep-alive client went without a successful renewal (from one
/// successful answer to the next), over `samples`, leaving out gaps that overlap a
/// defragmentation of that member itself: what a lease through another member lives through.
/// Per-request latency hides it: a forwarded keep-alive gives up at etcd's request timeout and
/// the next one waits again, so a long stall shows as several failed requests of ~7 s each.
fn keepalive_stall(samples: &[Sample], intervals: &[Interval]) -> Duration {
    let mut worst = Duration::ZERO;
    for m in 0..MEMBERS {
        let mut ends: Vec<SystemTime> = samples
            .iter()
            .filter(|s| s.kind == Kind::KeepAlive && s.member == m && s.ok)
            .map(Sample::end)
            .collect();
        ends.sort();
        for w in ends.windows(2) {
            let own = intervals
                .iter()
                .any(|i| i.member == m && w[0] < i.end && w[1] > i.start);
            if !own {
                worst = worst.max(w[1].duration_since(w[0]).unwrap_or_default());
            }
        }
    }
    worst
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

/// Prints one markdown table of `samples` (tagged with whether each went through a member
/// being defragmented) by kind: all, through a defragmenting member, through the others.
fn table(title: &str, samples: &[(Sample, bool)]) {
    println!("\n{title}\n");
    println!("| request | through | n | failures | p99 ms | max ms |");
    println!("|---|---|---:|---:|---:|---:|");
    for kind in KINDS {
        for (via, pick) in [
            ("any member", None),
            ("the defragmenting member", Some(true)),
            ("another member", Some(false)),
        ] {
            let (n, failed, p99, max) = stats(
                samples
                    .iter()
                    .filter(|(s, d)| s.kind == kind && pick.is_none_or(|p| p == *d))
                    .map(|(s, _)| s),
            );
            println!(
                "| {} | {via} | {n} | {failed} | {} | {} |",
                kind.name(),
                ms(p99),
                ms(max)
            );
        }
    }
}

/// The five slowest requests through a member not being defragmented, and when they started
/// (seconds after the first defragmentation started): where the stalls came from.
fn slowest(samples: &[(Sample, bool)], t0: Option<SystemTime>) {
    let mut other: Vec<&Sample> = samples.iter().filter(|(_, d)| !d).map(|(s, _)| s).collect();
    other.sort_by_key(|s| std::cmp::Reverse(s.latency));
    for s in other.iter().take(5) {
        let at = t0.map_or(0.0, |t| match s.start.duration_since(t) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        });
        println!(
            "  slow: {} through m{} at {at:+.2}s took {} ms{}",
            s.kind.name(),
            s.member,
            ms(s.latency),
            if s.ok { "" } else { " (failed)" }
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let work = PathBuf::from(
        args.first()
            .expect("usage: defrag <work-dir> [rounds] [etcdbrctl] [mib]"),
    );
    let rounds: usize = args.get(1).map_or(3, |r| r.parse().expect("rounds"));
    let ebr = args
        .get(2)
        .map(PathBuf::from)
        .filter(|p| !p.as_os_str().is_empty());
    let size_mib: usize = args.get(3).map_or(1024, |m| m.parse().expect("mib"));
    let base = work.join("base");
    let ports = match read_ports(&base) {
        Some(p) => p,
        None => {
            let _ = std::fs::remove_dir_all(&base);
            prepare(&base, size_mib).await;
            read_ports(&base).expect("ports written")
        }
    };
    let mut arms = vec![Arm::Warden, Arm::InPlace];
    if ebr.is_some() {
        arms.push(Arm::Ebr);
    }
    // A subset, e.g. `DEFRAG_BENCH_ARMS=ebr`, to run one arm again.
    if let Ok(only) = std::env::var("DEFRAG_BENCH_ARMS") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        arms.retain(|a| only.contains(&a.key()));
    }
    let mut pooled: Vec<(Arm, Vec<(Sample, bool)>)> =
        arms.iter().map(|a| (*a, Vec::new())).collect();
    let mut stalls: Vec<(Arm, Duration)> = arms.iter().map(|a| (*a, Duration::ZERO)).collect();
    for round in 0..rounds {
        let mut order = arms.clone();
        order.rotate_left(round % arms.len());
        if round % 2 == 1 {
            order.reverse();
        }
        for arm in order {
            println!("\n## round {} — {}", round + 1, arm.name());
            let dir = work.join("arm");
            let t = Instant::now();
            let o = run_arm(arm, &base, &dir, &ports, ebr.as_deref()).await;
            let _ = std::fs::remove_dir_all(&dir);
            println!(
                "  leader before: m{}; its database {:.0} MiB; arm took {:.0?}",
                o.leader,
                o.db_mib,
                t.elapsed()
            );
            let t0 = o.intervals.first().map(|i| i.start);
            for i in &o.intervals {
                let since = t0
                    .and_then(|t| i.start.duration_since(t).ok())
                    .unwrap_or_default();
                println!(
                    "  m{} defragmented at +{:.2}s for {:.2}s",
                    i.member,
                    since.as_secs_f64(),
                    i.end
                        .duration_since(i.start)
                        .unwrap_or_default()
                        .as_secs_f64()
                );
            }
            let tagged: Vec<(Sample, bool)> = window(&o)
                .into_iter()
                .map(|s| (s, during_own_defrag(&s, &o.intervals)))
                .collect();
            table(&format!("round {} — {}", round + 1, arm.name()), &tagged);
            slowest(&tagged, t0);
            let stall = keepalive_stall(&window(&o), &o.intervals);
            println!(
                "  longest time without a successful keep-alive through a member not being \
                 defragmented: {} ms",
                ms(stall)
            );
            if let Some(p) = pooled.iter_mut().find(|p| p.0 == arm) {
                p.1.extend(tagged);
            }
            if let Some(s) = stalls.iter_mut().find(|s| s.0 == arm) {
                s.1 = s.1.max(stall);
            }
        }
    }
    println!("\n# all rounds pooled");
    for (arm, samples) in &pooled {
        table(&format!("{} ({rounds} rounds)", arm.name()), samples);
    }
    let ka_max = |arm: Arm| {
        pooled
            .iter()
            .find(|p| p.0 == arm)
            .map(|p| {
                stats(
                    p.1.iter()
                        .filter(|(s, d)| s.kind == Kind::KeepAlive && !d)
                        .map(|(s, _)| s),
                )
                .3
            })
            .unwrap_or_default()
    };
    let (w, i) = (ka_max(Arm::Warden), ka_max(Arm::InPlace));
    let other_max = pooled
        .iter()
        .find(|p| p.0 == Arm::Warden)
        .map(|p| stats(p.1.iter().filter(|(_, d)| !d).map(|(s, _)| s)).3)
        .unwrap_or_default();
    let stall = |arm: Arm| {
        stalls
            .iter()
            .find(|s| s.0 == arm)
            .map(|s| s.1)
            .unwrap_or_default()
    };
    for (arm, _) in &stalls {
        println!(
            "{}: longest time without a successful keep-alive through a member not being \
             defragmented, over all rounds: {} ms",
            arm.name(),
            ms(stall(*arm))
        );
    }
    let (ws, is) = (stall(Arm::Warden), stall(Arm::InPlace));
    println!(
        "\ngoal: keep-alive stall during etcd-warden's pass {} ms vs in place {} ms: {:.3} of it \
         (goal <= 0.1)",
        ms(ws),
        ms(is),
        ws.as_secs_f64() / is.as_secs_f64().max(1e-9)
    );
    println!(
        "\ngoal: keep-alive max through a member not being defragmented during etcd-warden's pass {} ms vs in place {} ms: {:.3} of it (goal <= 0.1); \
         slowest request through a member not being defragmented during the pass {} ms (goal <= 500)",
        ms(w),
        ms(i),
        w.as_secs_f64() / i.as_secs_f64().max(1e-9),
        ms(other_max)
    );
}
