//! Ownership against the owner record: one timeline of what the DNS owner record said, what every
//! sidecar's `/healthz` answered, whether every member's etcd answered clients, and the writes
//! each seed acknowledged; [`judge`] checks it (a pure function, unit-tested below).
//!
//! The [`Recorder`] polls every sidecar's `/healthz` and every member's etcd (a `Status` call,
//! which any live etcd answers, quorum or not) about every 50 ms, one request at a time per
//! target, each stamped with when it was sent and when its answer came back: the answer was
//! produced in between. The record's changes and the DNS server's outages come from the server's
//! own log ([`DnsServer::changes`]), stamped once in effect.
//!
//! The violations:
//! - `ready-after-record`: a sidecar answers `/healthz` 200 to a request sent later than
//!   `owner.interval` plus [`READY_GRACE`] after the record stopped naming its seed (and before
//!   the record named it again);
//! - `two-ready`: sidecars of two seeds both proven ready over a common stretch of time;
//! - `etcd-serving-after-deactivation`: an etcd process of a member, started before that
//!   member's sidecar deactivated, still answers a client `kill.settle + kill.grace +
//!   `[`KILL_MARGIN`] after the sidecar said deactivated. One the kubelet started after the
//!   deactivation may serve: the final is taken from it, and the Service no longer routes to it.
//!   (Whether the second kill, `kill.settle` later, stopped a restart cannot be told from outside:
//!   from Suspended the second kill follows the first at once.)
//! - `ack-after-final`: a write a seed acknowledged with a revision past its final's, from the
//!   start of the run until the final was reclaimed (or the end of the run).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::dns::{DnsEvent, DnsServer, Mode};
use super::faultrun::{ETCD, RECORD, US, World};
use super::invariants::{Violation, get_json};
use super::writer::Ack;

/// How much later than one `owner.interval` after the record changed a sidecar may still answer
/// 200. The verdict comes from the first lookup begun after the change, at most one interval
/// later; on loopback a lookup answers in milliseconds, and readiness turns 503 in the step that
/// takes the verdict (`owner::protocol`, "Entering Deactivated"). The grace is for a lookup that
/// was in flight at the change and for a loaded two-core machine's scheduling. It must stay well
/// under one second: the plant `ready-late` clears readiness one second late, and at the
/// harnesses' intervals (200–300 ms) a deadline of at most 800 ms still sees it.
pub const READY_GRACE: Duration = Duration::from_millis(500);

/// Beyond `kill.settle + kill.grace` (the second kill's start and its SIGTERM-to-SIGKILL wait), for
/// the kill's verification and scheduling.
pub const KILL_MARGIN: Duration = Duration::from_millis(1500);

/// How often the recorder polls.
pub const EVERY: Duration = Duration::from_millis(50);

/// The record from `at` on: the IDs it names, None when it is deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordAt {
    pub at: Duration,
    pub names: Option<Vec<String>>,
}

/// One `/healthz` answer of one sidecar process.
#[derive(Debug, Clone)]
pub struct Health {
    pub seed: &'static str,
    pub member: usize,
    /// The sidecar container's incarnation: tells one process from the next.
    pub incarnation: u32,
    /// The answer tells the process's state at some moment after this one (the `/healthz`
    /// request's, or the `/status` request's before it).
    pub asked: Duration,
    pub sent: Duration,
    pub received: Duration,
    /// Answered 200.
    pub ready: bool,
    /// `/status` or the `/healthz` body said deactivated.
    pub deactivated: bool,
    /// `/status` said its last owner lookups failed: it has not learnt the record yet, and its
    /// promise is to suspend (503) after `owner.failure_threshold` of them, not to follow it.
    pub lookups_failing: bool,
}

/// One probe of one member's etcd.
#[derive(Debug, Clone)]
pub struct Serving {
    pub seed: &'static str,
    pub member: usize,
    /// The etcd container's incarnation (unchanged from before the request to after it).
    pub incarnation: u32,
    pub sent: Duration,
    pub received: Duration,
    /// It answered a client request.
    pub serving: bool,
}

/// A span in which a sidecar could not learn of a change: frozen (member Some), or DNS not
/// answering (member None: every sidecar). Its duty to clear readiness starts when the span ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pause {
    pub member: Option<usize>,
    pub from: Duration,
    pub to: Duration,
    pub why: String,
}

/// A final snapshot of a seed, and until when it is the seed's last word.
#[derive(Debug, Clone)]
pub struct Final {
    pub seed: &'static str,
    pub name: String,
    pub revision: i64,
    /// When it was reclaimed (the seed serves again from then on); None: to the end of the run.
    pub until: Option<Duration>,
}

/// Everything [`judge`] reads.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    pub record: Vec<RecordAt>,
    pub health: Vec<Health>,
    pub serving: Vec<Serving>,
    pub pauses: Vec<Pause>,
    pub finals: Vec<Final>,
    /// Every acknowledged write, per seed.
    pub acks: BTreeMap<&'static str, Vec<Ack>>,
}

/// The sidecars' settings the judge measures against.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// `owner.interval`.
    pub interval: Duration,
    /// `kill.settle`: the second kill comes this long after readiness went 503.
    pub settle: Duration,
    /// `kill.grace`: SIGTERM to SIGKILL.
    pub kill_grace: Duration,
}

impl Bounds {
    /// The readiness deadline after a duty starts.
    pub fn ready_within(&self) -> Duration {
        self.interval + READY_GRACE
    }

    /// How long after deactivation an etcd of before the second kill may still answer.
    pub fn killed_within(&self) -> Duration {
        self.settle + self.kill_grace + KILL_MARGIN
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

/// Judges the timeline; empty means every ownership promise held.
pub fn judge(t: &Timeline, b: &Bounds) -> Vec<Violation> {
    let mut v = ready_after_record(t, b);
    v.extend(two_ready(t));
    v.extend(etcd_serving_after_deactivation(t, b));
    v.extend(ack_after_final(t));
    v
}

fn names(r: &RecordAt, seed: &str) -> bool {
    r.names
        .as_ref()
        .is_some_and(|n| n.iter().any(|x| x == seed))
}

/// Spans [from, to) in which the record did not name `seed`, after it had (to: when it named it
/// again, or None).
fn unnamed(record: &[RecordAt], seed: &str) -> Vec<(Duration, Option<Duration>)> {
    let mut out = Vec::new();
    let mut open: Option<Duration> = None;
    let mut was_named = false;
    for r in record {
        let now = names(r, seed);
        if was_named && !now && open.is_none() {
            open = Some(r.at);
        }
        if now && let Some(from) = open.take() {
            out.push((from, Some(r.at)));
        }
        was_named |= now;
    }
    if let Some(from) = open {
        out.push((from, None));
    }
    out
}

/// When a sidecar of `member` whose duty began at `from` must be unready: a pause that begins
/// before the deadline moves the duty's start to its end.
fn deadline(pauses: &[Pause], member: usize, from: Duration, within: Duration) -> Duration {
    let mut start = from;
    loop {
        let moved = pauses
            .iter()
            .filter(|p| p.member.is_none_or(|m| m == member))
            .filter(|p| p.from <= start.saturating_add(within) && p.to > start)
            .map(|p| p.to)
            .max();
        match moved {
            Some(to) => start = to,
            None => return start.saturating_add(within),
        }
    }
}

/// A sidecar process: (seed, member, incarnation).
type Process = (&'static str, usize, u32);

fn processes(t: &Timeline) -> BTreeMap<Process, Vec<&Health>> {
    let mut out: BTreeMap<_, Vec<&Health>> = BTreeMap::new();
    for h in &t.health {
        out.entry((h.seed, h.member, h.incarnation))
            .or_default()
            .push(h);
    }
    for samples in out.values_mut() {
        samples.sort_by_key(|h| h.sent);
    }
    out
}

/// `ready-after-record`.
fn ready_after_record(t: &Timeline, b: &Bounds) -> Vec<Violation> {
    let mut v = Vec::new();
    let within = b.ready_within();
    for ((seed, m, inc), samples) in processes(t) {
        for (from, to) in unnamed(&t.record, seed) {
            let due = deadline(&t.pauses, m, from, within);
            let late: Vec<&&Health> = samples
                .iter()
                .filter(|h| h.ready && !h.lookups_failing && h.sent >= due)
                .filter(|h| to.is_none_or(|to| h.sent < to))
                .collect();
            if let (Some(first), Some(last)) = (late.first(), late.last()) {
                v.push(Violation {
                    kind: "ready-after-record",
                    detail: format!(
                        "the record stopped naming {seed} at {}; sidecar {seed}/m{m}#{inc} had to \
                         be unready from {} (owner.interval {} ms + grace {} ms, after any pause), \
                         yet answered /healthz 200 to {} requests sent from {} to {}",
                        secs(from),
                        secs(due),
                        b.interval.as_millis(),
                        READY_GRACE.as_millis(),
                        late.len(),
                        secs(first.sent),
                        secs(last.sent)
                    ),
                });
            }
        }
    }
    v
}

/// Stretches over which a process is proven ready: a run of consecutive 200 answers, from the
/// first one's arrival to the last one's request (every instant between two consecutive answers
/// lies after the first was produced and before the second was).
fn ready_stretches(samples: &[&Health]) -> Vec<(Duration, Duration)> {
    let mut out = Vec::new();
    let mut run: Option<(Duration, Duration)> = None;
    for h in samples {
        if !h.ready {
            out.extend(run.take());
            continue;
        }
        match run.as_mut() {
            Some(r) => r.1 = h.sent,
            None => run = Some((h.received, h.sent)),
        }
    }
    out.extend(run);
    out.retain(|(from, to)| to > from);
    out
}

/// `two-ready`.
fn two_ready(t: &Timeline) -> Vec<Violation> {
    let mut v = Vec::new();
    let stretches: Vec<(Process, (Duration, Duration))> = processes(t)
        .into_iter()
        .flat_map(|(p, samples)| {
            ready_stretches(&samples)
                .into_iter()
                .map(move |s| (p, s))
                .collect::<Vec<_>>()
        })
        .collect();
    let mut seen = BTreeSet::new();
    for (i, (a, (a0, a1))) in stretches.iter().enumerate() {
        for (bp, (b0, b1)) in &stretches[i + 1..] {
            if a.0 == bp.0 {
                continue;
            }
            let (from, to) = (*a0.max(b0), *a1.min(b1));
            if to > from && seen.insert((a.0.min(bp.0), a.0.max(bp.0))) {
                v.push(Violation {
                    kind: "two-ready",
                    detail: format!(
                        "sidecars {}/m{}#{} and {}/m{}#{} were both ready from {} to {}",
                        a.0,
                        a.1,
                        a.2,
                        bp.0,
                        bp.1,
                        bp.2,
                        secs(from),
                        secs(to)
                    ),
                });
            }
        }
    }
    v
}

/// `etcd-serving-after-deactivation`.
fn etcd_serving_after_deactivation(t: &Timeline, b: &Bounds) -> Vec<Violation> {
    let mut v = Vec::new();
    let procs = processes(t);
    for ((seed, m, inc), samples) in &procs {
        let Some(i) = samples.iter().position(|h| h.deactivated) else {
            continue;
        };
        // It deactivated before this answer arrived, and after the answer before was produced
        // (or, for a process that said so at its first answer, after the one before it ended).
        let at = samples[i].received;
        let after = match i {
            0 => procs
                .iter()
                .filter(|((s, mm, i), _)| s == seed && mm == m && i < inc)
                .filter_map(|(_, earlier)| earlier.last().map(|h| h.received))
                .max(),
            _ => Some(samples[i - 1].asked),
        };
        let Some(after) = after else {
            continue;
        };
        // The process's life ends when a later one of the member answers: a new process kills
        // what it finds itself.
        let ends = procs
            .iter()
            .filter(|((s, mm, i), _)| s == seed && mm == m && i > inc)
            .filter_map(|(_, later)| later.first().map(|h| h.received))
            .min();
        let probes: Vec<&Serving> = t
            .serving
            .iter()
            .filter(|s| s.seed == *seed && s.member == *m)
            .collect();
        // The etcd processes started before it deactivated: its first kill (or its second,
        // `kill.settle` later) must stop them. One started later may serve the final.
        let Some(old) = probes
            .iter()
            .filter(|s| s.sent <= after)
            .map(|s| s.incarnation)
            .max()
        else {
            continue;
        };
        let due = at + b.killed_within();
        let late: Vec<&&Serving> = probes
            .iter()
            .filter(|s| s.serving && s.incarnation <= old && s.sent >= due)
            .filter(|s| ends.is_none_or(|e| s.sent < e))
            .collect();
        if let (Some(first), Some(last)) = (late.first(), late.last()) {
            v.push(Violation {
                kind: "etcd-serving-after-deactivation",
                detail: format!(
                    "sidecar {seed}/m{m}#{inc} said deactivated by {}; etcd #{} of m{m} (started \
                     before it deactivated) had to be gone by {} (kill.settle {} ms + kill.grace \
                     {} ms + {} ms), yet answered {} probes sent from {} to {}",
                    secs(at),
                    first.incarnation,
                    secs(due),
                    b.settle.as_millis(),
                    b.kill_grace.as_millis(),
                    KILL_MARGIN.as_millis(),
                    late.len(),
                    secs(first.sent),
                    secs(last.sent)
                ),
            });
        }
    }
    v
}

/// `ack-after-final`.
fn ack_after_final(t: &Timeline) -> Vec<Violation> {
    let mut v = Vec::new();
    for f in &t.finals {
        let acks = t.acks.get(f.seed).map(Vec::as_slice).unwrap_or_default();
        let after: Vec<&Ack> = acks
            .iter()
            .filter(|a| a.revision > f.revision && f.until.is_none_or(|u| a.at < u))
            .collect();
        if let (Some(first), Some(last)) = (
            after.iter().min_by_key(|a| a.at),
            after.iter().max_by_key(|a| a.at),
        ) {
            v.push(Violation {
                kind: "ack-after-final",
                detail: format!(
                    "{} acknowledged {} writes past its final {} (revision {}) {}: first {} at \
                     revision {} ({}), last at {} ({})",
                    f.seed,
                    after.len(),
                    f.name,
                    f.revision,
                    f.until
                        .map_or("by the end of the run".to_string(), |u| format!(
                            "before it was reclaimed at {}",
                            secs(u)
                        )),
                    secs(first.at),
                    first.revision,
                    first.key,
                    secs(last.at),
                    last.key
                ),
            });
        }
    }
    v
}

/// The record's changes at `record` and the DNS outages (as every-sidecar pauses), from `dns`'s
/// log, on `epoch`'s clock.
pub fn from_dns(dns: &DnsServer, record: &str, epoch: Instant) -> (Vec<RecordAt>, Vec<Pause>) {
    let want = record.trim_end_matches('.');
    let mut records = Vec::new();
    let mut pauses = Vec::new();
    // DNS cannot answer while its mode is not Normal or while it is stopped.
    let (mut bad_mode, mut stopped) = (None::<Mode>, false);
    let mut out: Option<(Duration, String)> = None;
    for (at, event) in dns.changes() {
        let at = at.saturating_duration_since(epoch);
        match event {
            DnsEvent::Txt { name, values } => {
                if name.trim_end_matches('.') == want {
                    records.push(RecordAt { at, names: values });
                }
                continue;
            }
            DnsEvent::Mode(Mode::Normal) => bad_mode = None,
            DnsEvent::Mode(mode) => bad_mode = Some(mode),
            DnsEvent::Stopped => stopped = true,
            DnsEvent::Serving => stopped = false,
        }
        match (bad_mode, stopped, out.is_some()) {
            (None, false, true) => {
                if let Some((from, why)) = out.take() {
                    pauses.push(Pause {
                        member: None,
                        from,
                        to: at,
                        why,
                    });
                }
            }
            (Some(mode), _, false) => out = Some((at, format!("dns {mode:?}"))),
            (None, true, false) => out = Some((at, "dns stopped".into())),
            _ => {}
        }
    }
    if let Some((from, why)) = out {
        pauses.push(Pause {
            member: None,
            from,
            to: Duration::MAX,
            why,
        });
    }
    (records, pauses)
}

/// A sidecar the recorder polls.
#[derive(Debug, Clone)]
pub struct SidecarProbe {
    pub seed: &'static str,
    pub member: usize,
    pub addr: SocketAddr,
    /// Its container's incarnation (0: not started yet); None: one process for the whole run.
    pub incarnation: Option<Arc<AtomicU32>>,
}

/// A member's etcd the recorder probes.
#[derive(Debug, Clone)]
pub struct EtcdProbe {
    pub seed: &'static str,
    pub member: usize,
    pub url: String,
    pub incarnation: Option<Arc<AtomicU32>>,
}

#[derive(Default)]
struct Seen {
    health: Vec<Health>,
    serving: Vec<Serving>,
}

/// Polls sidecars and etcd members until stopped or dropped.
pub struct Recorder {
    seen: Arc<Mutex<Seen>>,
    epoch: Instant,
    stop: CancellationToken,
}

fn incarnation(i: &Option<Arc<AtomicU32>>) -> u32 {
    i.as_ref().map_or(1, |i| i.load(Ordering::SeqCst))
}

impl Recorder {
    pub fn start(epoch: Instant, sidecars: Vec<SidecarProbe>, etcds: Vec<EtcdProbe>) -> Recorder {
        let r = Recorder {
            seen: Arc::new(Mutex::new(Seen::default())),
            epoch,
            stop: CancellationToken::new(),
        };
        for p in sidecars {
            r.add_sidecar(p);
        }
        for p in etcds {
            tokio::spawn(poll_etcd(p, r.seen.clone(), epoch, r.stop.clone()));
        }
        r
    }

    /// Polls one more sidecar from now on (one started later, as a destination seed's).
    pub fn add_sidecar(&self, p: SidecarProbe) {
        tokio::spawn(poll_sidecar(
            p,
            self.seen.clone(),
            self.epoch,
            self.stop.clone(),
        ));
    }

    /// What was seen so far, with the record and the DNS outages from `dns`.
    pub fn timeline(&self, dns: &DnsServer, record: &str) -> Timeline {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (record, pauses) = from_dns(dns, record, self.epoch);
        Timeline {
            record,
            health: seen.health.clone(),
            serving: seen.serving.clone(),
            pauses,
            ..Timeline::default()
        }
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn poll_sidecar(
    p: SidecarProbe,
    seen: Arc<Mutex<Seen>>,
    epoch: Instant,
    stop: CancellationToken,
) {
    let client = super::http_client(Duration::from_millis(800));
    let url = format!("http://{}/healthz", p.addr);
    while !stop.is_cancelled() {
        let inc = incarnation(&p.incarnation);
        let sent = epoch.elapsed();
        let answer = get_json(&client, &url).await;
        let received = epoch.elapsed();
        // A restart in between: the answer may be either process's.
        if inc != 0
            && incarnation(&p.incarnation) == inc
            && let Some((code, body)) = answer
        {
            let deactivated = body["state"]
                .as_str()
                .is_some_and(|s| s.eq_ignore_ascii_case("deactivated"));
            seen.lock()
                .unwrap_or_else(|e| e.into_inner())
                .health
                .push(Health {
                    seed: p.seed,
                    member: p.member,
                    incarnation: inc,
                    asked: sent,
                    sent,
                    received,
                    ready: code == 200,
                    deactivated,
                    lookups_failing: false,
                });
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
    }
}

async fn poll_etcd(p: EtcdProbe, seen: Arc<Mutex<Seen>>, epoch: Instant, stop: CancellationToken) {
    let options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(300))
        .with_timeout(Duration::from_millis(500));
    let mut client: Option<etcd_client::Client> = None;
    while !stop.is_cancelled() {
        let inc = incarnation(&p.incarnation);
        let sent = epoch.elapsed();
        if client.is_none() {
            client = tokio::time::timeout(
                Duration::from_millis(500),
                etcd_client::Client::connect([p.url.as_str()], Some(options.clone())),
            )
            .await
            .ok()
            .and_then(Result::ok);
        }
        let serving = match client.as_mut() {
            Some(c) => {
                let ok = tokio::time::timeout(Duration::from_millis(500), c.status())
                    .await
                    .is_ok_and(|r| r.is_ok());
                if !ok {
                    client = None;
                }
                ok
            }
            None => false,
        };
        let received = epoch.elapsed();
        if inc != 0 && incarnation(&p.incarnation) == inc {
            seen.lock()
                .unwrap_or_else(|e| e.into_inner())
                .serving
                .push(Serving {
                    seed: p.seed,
                    member: p.member,
                    incarnation: inc,
                    sent,
                    received,
                    serving,
                });
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
    }
}

/// Probes every member's etcd of a fault-schedule or soak world (its sidecars' `/healthz` the
/// world's monitor already polls).
pub fn watch_world(world: &World) -> Recorder {
    let etcds = (0..world.specs.len())
        .map(|m| EtcdProbe {
            seed: US,
            member: m,
            url: world.specs[m].client_url(),
            incarnation: Some(
                world
                    .kubelet
                    .with_pod(m, |p| p.containers[ETCD].incarnation.clone()),
            ),
        })
        .collect();
    Recorder::start(world.events.epoch, Vec::new(), etcds)
}

/// A duration as the sidecars' configuration writes it (`250ms`, `2s`).
fn config_duration(keys: &[(String, String)], key: &str) -> Option<Duration> {
    let v = keys.iter().find(|(k, _)| k == key)?.1.trim().to_string();
    if let Some(ms) = v.strip_suffix("ms") {
        return ms.parse().ok().map(Duration::from_millis);
    }
    v.strip_suffix('s')?
        .parse()
        .ok()
        .map(Duration::from_secs_f64)
}

/// The world's sidecars' `owner.interval`, `kill.settle` and `kill.grace`.
pub fn world_bounds(world: &World) -> Bounds {
    let keys = world.keys.first().map(Vec::as_slice).unwrap_or_default();
    Bounds {
        interval: config_duration(keys, "owner.interval").unwrap_or(Duration::from_millis(250)),
        settle: config_duration(keys, "kill.settle").unwrap_or(Duration::from_secs(1)),
        kill_grace: config_duration(keys, "kill.grace").unwrap_or(Duration::from_secs(2)),
    }
}

/// The world's timeline: the record and the DNS outages, the monitor's `/healthz` answers, the
/// recorder's etcd probes; `finals` (name, revision, reclaimed at) and `acks` are the caller's.
pub fn world_timeline(
    world: &World,
    recorder: &Recorder,
    finals: &[(String, i64, Option<Duration>)],
    acks: &[Ack],
) -> Timeline {
    let mut t = recorder.timeline(&world.dns, RECORD);
    if let Some(monitor) = world.monitor.as_ref() {
        t.health = monitor.with(|o| {
            o.healthz
                .iter()
                .map(|h| Health {
                    seed: US,
                    member: h.member,
                    incarnation: h.incarnation,
                    asked: h.asked,
                    sent: h.sent,
                    received: h.received,
                    ready: h.ready,
                    deactivated: h.deactivated,
                    lookups_failing: h.lookups_failing,
                })
                .collect()
        });
    }
    t.finals = finals
        .iter()
        .map(|(name, revision, until)| Final {
            seed: US,
            name: name.clone(),
            revision: *revision,
            until: *until,
        })
        .collect();
    t.acks.insert(US, acks.to_vec());
    t
}

/// One line for a run's summary: what the timeline holds.
pub fn summary(t: &Timeline) -> String {
    format!(
        "timeline: record_changes={} healthz={} etcd_probes={} pauses={} finals={}",
        t.record.len(),
        t.health.len(),
        t.serving.len(),
        t.pauses.len(),
        t.finals.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "seed-a";
    const B: &str = "seed-b";

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn bounds() -> Bounds {
        Bounds {
            interval: ms(250),
            settle: ms(1000),
            kill_grace: ms(2000),
        }
    }

    fn record(at: u64, names: Option<&[&str]>) -> RecordAt {
        RecordAt {
            at: ms(at),
            names: names.map(|n| n.iter().map(|s| s.to_string()).collect()),
        }
    }

    /// A sidecar of `seed` polled every 50 ms from `from` to `to` (request sent, answered 10 ms
    /// later), ready until `unready_at` (the request's send time), deactivated from then on.
    fn polled(seed: &'static str, from: u64, to: u64, unready_at: u64) -> Vec<Health> {
        (from..to)
            .step_by(50)
            .map(|t| Health {
                seed,
                member: 0,
                incarnation: 1,
                asked: ms(t),
                sent: ms(t),
                received: ms(t + 10),
                ready: t < unready_at,
                deactivated: t >= unready_at,
                lookups_failing: false,
            })
            .collect()
    }

    fn kinds(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(|x| x.kind).collect()
    }

    fn handed_off(unready_at: u64) -> Timeline {
        Timeline {
            record: vec![record(0, Some(&[A])), record(1000, Some(&[B]))],
            health: polled(A, 100, 4000, unready_at),
            ..Timeline::default()
        }
    }

    #[test]
    fn readiness_cleared_within_the_interval_passes() {
        let t = handed_off(1300);
        assert_eq!(judge(&t, &bounds()), vec![]);
    }

    #[test]
    fn readiness_cleared_a_second_late_is_ready_after_record() {
        // The verdict at 1.25 s, readiness cleared a second later: the plant `ready-late`.
        let v = judge(&handed_off(2250), &bounds());
        assert_eq!(kinds(&v), vec!["ready-after-record"], "{v:?}");
        assert!(v[0].detail.contains("sent from 1.750s"), "{}", v[0].detail);
    }

    #[test]
    fn a_deleted_record_counts_and_naming_the_seed_again_ends_the_duty() {
        let mut t = handed_off(10_000);
        t.record = vec![record(0, Some(&[A])), record(1000, None)];
        assert_eq!(kinds(&judge(&t, &bounds())), vec!["ready-after-record"]);
        // Named again at 1.5 s, before the deadline: nothing was due.
        t.record.push(record(1500, Some(&[A])));
        assert_eq!(judge(&t, &bounds()), vec![]);
    }

    #[test]
    fn a_sidecar_that_could_not_act_at_the_change_is_due_once_it_can() {
        // Frozen from 0.9 s to 2.5 s: its duty starts at 2.5 s, due at 3.25 s.
        let mut t = handed_off(2600);
        t.pauses.push(Pause {
            member: Some(0),
            from: ms(900),
            to: ms(2500),
            why: "frozen".into(),
        });
        assert_eq!(judge(&t, &bounds()), vec![]);
        // The same for DNS not answering, every member.
        t.pauses[0].member = None;
        assert_eq!(judge(&t, &bounds()), vec![]);
        // A pause of another member excuses nothing.
        t.pauses[0].member = Some(1);
        assert_eq!(kinds(&judge(&t, &bounds())), vec!["ready-after-record"]);
    }

    #[test]
    fn a_sidecar_whose_lookups_fail_has_not_learnt_the_record() {
        // Ready until 2.25 s, its lookups failing from 1.2 s (it suspends at the threshold).
        let mut t = handed_off(2250);
        for h in &mut t.health {
            h.lookups_failing = h.sent >= ms(1200);
        }
        assert_eq!(judge(&t, &bounds()), vec![]);
        // Failing only until 1.8 s: from then on it knows, and is late.
        for h in &mut t.health {
            h.lookups_failing = h.sent >= ms(1200) && h.sent < ms(1800);
        }
        let v = judge(&t, &bounds());
        assert_eq!(kinds(&v), vec!["ready-after-record"], "{v:?}");
        assert!(v[0].detail.contains("sent from 1.800s"), "{}", v[0].detail);
    }

    #[test]
    fn a_sidecar_becoming_ready_while_the_record_names_another_is_ready_after_record() {
        // Not ready at the change (so nothing to clear then), ready at 3 s all the same.
        let mut t = handed_off(0);
        t.health
            .extend(polled(A, 3000, 3500, 10_000).into_iter().map(|mut h| {
                h.incarnation = 2;
                h
            }));
        assert_eq!(kinds(&judge(&t, &bounds())), vec!["ready-after-record"]);
    }

    #[test]
    fn two_seeds_ready_at_once_is_two_ready() {
        let mut t = handed_off(1300);
        // The destination ready from 1.4 s: after the source cleared.
        t.health.extend(polled(B, 1400, 4000, 10_000));
        assert_eq!(judge(&t, &bounds()), vec![]);
        // From 1.1 s: both ready from 1.11 s to 1.25 s.
        t.health.extend(polled(B, 1100, 1400, 10_000));
        let v = judge(&t, &bounds());
        assert_eq!(kinds(&v), vec!["two-ready"], "{v:?}");
    }

    #[test]
    fn answers_that_only_might_overlap_are_not_two_ready() {
        // One 200 each, their windows overlapping: not proof of a common instant in between.
        let t = Timeline {
            health: vec![
                Health {
                    seed: A,
                    member: 0,
                    incarnation: 1,
                    asked: ms(0),
                    sent: ms(0),
                    received: ms(100),
                    ready: true,
                    deactivated: false,
                    lookups_failing: false,
                },
                Health {
                    seed: B,
                    member: 0,
                    incarnation: 1,
                    asked: ms(50),
                    sent: ms(50),
                    received: ms(150),
                    ready: true,
                    deactivated: false,
                    lookups_failing: false,
                },
            ],
            ..Timeline::default()
        };
        assert_eq!(judge(&t, &bounds()), vec![]);
    }

    fn probes(inc: u32, from: u64, to: u64, serving: bool) -> Vec<Serving> {
        (from..to)
            .step_by(100)
            .map(|t| Serving {
                seed: A,
                member: 0,
                incarnation: inc,
                sent: ms(t),
                received: ms(t + 5),
                serving,
            })
            .collect()
    }

    #[test]
    fn etcd_killed_and_restarted_for_the_final_passes() {
        let mut t = handed_off(1300);
        // Killed at 1.3 s, restarted at 1.8 s, killed again at 2.3 s, restarted (#3) at 2.8 s.
        t.serving = probes(1, 0, 1300, true);
        t.serving.extend(probes(1, 1300, 1800, false));
        t.serving.extend(probes(2, 1800, 2300, true));
        t.serving.extend(probes(2, 2300, 2800, false));
        t.serving.extend(probes(3, 2800, 9000, true));
        assert_eq!(judge(&t, &bounds()), vec![]);
    }

    #[test]
    fn etcd_left_serving_after_deactivation_is_found() {
        // The plant `ack-after-kill`: the sidecar never kills etcd.
        let mut t = handed_off(1300);
        t.serving = probes(1, 0, 9000, true);
        let v = judge(&t, &bounds());
        assert_eq!(kinds(&v), vec!["etcd-serving-after-deactivation"], "{v:?}");
        // Killed at 1.3 s, restarted at 1.8 s and serving: the final is taken from it.
        t.serving = probes(1, 0, 1300, true);
        t.serving.extend(probes(2, 1800, 9000, true));
        assert_eq!(judge(&t, &bounds()), vec![]);
        // A new sidecar process takes over the duty (the old one's ends at its first answer), and
        // says deactivated while #2 serves: #2 must go.
        t.health
            .extend(polled(A, 3000, 3100, 0).into_iter().map(|mut h| {
                h.incarnation = 2;
                h
            }));
        assert_eq!(
            kinds(&judge(&t, &bounds())),
            vec!["etcd-serving-after-deactivation"],
            "the second process said deactivated at 3.01 s and is due at 7.51 s"
        );
        t.serving.retain(|s| s.sent < ms(7000));
        assert_eq!(judge(&t, &bounds()), vec![]);
    }

    fn ack(at: u64, revision: i64) -> Ack {
        Ack {
            key: format!("/k/{revision}"),
            revision,
            at: ms(at),
        }
    }

    #[test]
    fn a_write_acknowledged_past_the_final_is_ack_after_final() {
        let mut t = Timeline {
            finals: vec![Final {
                seed: A,
                name: "final-1".into(),
                revision: 10,
                until: Some(ms(5000)),
            }],
            ..Timeline::default()
        };
        // Writes up to the final, then more after the reclaim: fine.
        t.acks
            .insert(A, vec![ack(100, 9), ack(200, 10), ack(6000, 11)]);
        assert_eq!(judge(&t, &bounds()), vec![]);
        // One past the final before the reclaim.
        t.acks.get_mut(A).unwrap().push(ack(4000, 12));
        assert_eq!(kinds(&judge(&t, &bounds())), vec!["ack-after-final"]);
        // The last hand-off's final is judged to the end of the run.
        t.finals[0].until = None;
        let v = judge(&t, &bounds());
        assert_eq!(kinds(&v), vec!["ack-after-final"]);
        assert!(v[0].detail.contains("2 writes"), "{}", v[0].detail);
        // Another seed's writes are its own.
        t.finals[0].seed = B;
        assert_eq!(judge(&t, &bounds()), vec![]);
    }

    #[test]
    fn the_unnamed_spans_follow_the_record() {
        let r = vec![
            record(0, Some(&[B])),
            record(100, Some(&[A])),
            record(200, Some(&[B])),
            record(300, None),
            record(400, Some(&[A])),
            record(500, Some(&[B])),
        ];
        // Before A was ever named there is no duty.
        assert_eq!(
            unnamed(&r, A),
            vec![(ms(200), Some(ms(400))), (ms(500), None)]
        );
    }
}
