//! The ownership promise as checks over what a fault schedule left behind.
//!
//! A [`Monitor`] polls every sidecar's `/status` then `/healthz` (in that order, one request at a
//! time per sidecar, so an answer received later was produced later) and lists the store's fence
//! markers, all through the run; [`check`] then judges the evidence:
//!
//! - **no lost write**: every final snapshot's last revision is at least the revision of every
//!   write the writer saw acknowledged;
//! - **liveness**: when the record ends naming someone else and everything is healed, the latest
//!   full snapshot is final by the end of the settle time; a sidecar's `/status` saying why it
//!   is not (`owner.reason`) goes in the violation's text and excuses nothing;
//! - **one final per hand-off**: at most one unreclaimed final snapshot in the store, and it is
//!   the one the store's hand-off objects name (`owner::handoff::the_final`, what every reader
//!   goes by); a final `etcd-warden reclaim` undid must still hold every write acknowledged
//!   before the reclaim, and no sidecar's `/snapshot/latest` may report it as final afterwards;
//! - **a buried member does not excuse a missing final**: when a member died for good after its
//!   fence and another survives, the survivors must store the final;
//! - **never ready after deactivation**: a sidecar process that said `deactivated` (in `/status`
//!   or the `/healthz` body) never answers `/healthz` 200 again; once a member's fence marker is
//!   in the store, no sidecar process of that member answers 200 again;
//! - **no panic, no unexpected exit** of a sidecar;
//! - **no stuck state without a reason**: at the end, a sidecar that is not active and ready says
//!   why in `/status` (`owner.reason`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_warden::store::{Kind, Snapshot};
use futures::StreamExt;
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::podns::Exit;
use super::schedule::Ending;
use super::writer::Ack;

/// One broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// A short stable name (`lost-write`, `two-finals`, …) for summaries.
    pub kind: &'static str,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.kind, self.detail)
    }
}

/// A sidecar as the monitor reaches it.
#[derive(Debug, Clone)]
pub struct Probe {
    pub member: usize,
    pub addr: std::net::SocketAddr,
    /// The container's incarnation counter: tells one process from the next.
    pub incarnation: Arc<AtomicU32>,
}

/// What one sidecar process was seen doing.
#[derive(Debug, Clone, Default)]
pub struct ProcessTrack {
    /// When `/status` or `/healthz` first said deactivated.
    pub deactivated_at: Option<Duration>,
    /// `/healthz` 200 answered to a request sent after the process said deactivated.
    pub ready_after_deactivation: Vec<(Duration, String)>,
    /// `/healthz` 200 answered to a request sent after the member's fence marker was listed.
    pub ready_after_fence: Vec<(Duration, String)>,
    pub last_status: Option<Value>,
    pub last_healthz: Option<(u16, Value)>,
    /// The (state, ready) last put on the timeline.
    pub last_seen: Option<(String, bool)>,
}

/// Everything the monitor saw.
#[derive(Debug, Default)]
pub struct Observed {
    /// Per (member, incarnation).
    pub processes: BTreeMap<(usize, u32), ProcessTrack>,
    /// When each member's fence marker was first listed.
    pub fence_seen: BTreeMap<usize, Duration>,
    /// Every fence marker key listed, with the member it was attributed to.
    pub fence_objects: BTreeMap<String, Option<usize>>,
    /// State changes, for reports: `t member#incarnation state ready`.
    pub timeline: Vec<String>,
    /// Every `/healthz` answer, for the ownership timeline (`support::timeline`).
    pub healthz: Vec<HealthzAnswer>,
}

/// One `/healthz` answer of one sidecar process: requested at `sent`, answered by `received`,
/// after the `/status` asked at `asked`.
#[derive(Debug, Clone, Copy)]
pub struct HealthzAnswer {
    pub member: usize,
    pub incarnation: u32,
    pub asked: Duration,
    pub sent: Duration,
    pub received: Duration,
    pub ready: bool,
    /// `/status` or the `/healthz` body said deactivated.
    pub deactivated: bool,
    /// `/status` counted failed owner lookups in a row (the sidecar has not learnt the record).
    pub lookups_failing: bool,
}

impl Observed {
    /// Forgets the fence markers seen so far: `etcd-warden reclaim` deleted them, and a sidecar
    /// started after it may be ready again until the next hand-off's markers appear.
    pub fn forget_fences(&mut self, now: Duration) {
        self.fence_seen.clear();
        self.fence_objects.clear();
        self.timeline.push(format!(
            "{:8.3}s fence markers forgotten (reclaimed)",
            now.as_secs_f64()
        ));
    }
}

impl Observed {
    /// The latest `/status` of the current process of `member`.
    pub fn current(&self, member: usize) -> Option<&ProcessTrack> {
        self.processes
            .range((member, 0)..=(member, u32::MAX))
            .next_back()
            .map(|(_, t)| t)
    }
}

/// How fence markers are told apart: the member's name (`m0`) or its etcd member ID (hex or
/// decimal) as a whole token of the marker's key.
#[derive(Debug, Clone)]
pub struct MemberNames {
    pub names: Vec<String>,
    pub ids: Vec<u64>,
}

impl MemberNames {
    /// The member a fence marker `key` belongs to, if it names exactly one. A single-member
    /// cluster's markers are its member's.
    pub fn attribute(&self, key: &str) -> Option<usize> {
        if self.names.len() == 1 {
            return Some(0);
        }
        let file = key.rsplit('/').next().unwrap_or(key);
        let tokens: Vec<&str> = key
            .split(|c: char| !c.is_ascii_alphanumeric())
            .chain(std::iter::once(file))
            .filter(|t| !t.is_empty())
            .collect();
        let hits: Vec<usize> = (0..self.names.len())
            .filter(|i| {
                let id = self.ids.get(*i).copied().unwrap_or(0);
                let forms = [
                    self.names[*i].clone(),
                    format!("{id:x}"),
                    format!("{id:016x}"),
                    id.to_string(),
                ];
                tokens.iter().any(|t| forms.iter().any(|f| f == t))
            })
            .collect();
        match hits.as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }
}

/// Polls sidecars and fence markers until stopped.
pub struct Monitor {
    pub observed: Arc<Mutex<Observed>>,
    stop: CancellationToken,
}

/// `<store prefix>/etcd-warden/fence/`.
pub fn fence_prefix(store_prefix: &str) -> String {
    let p = store_prefix.trim_matches('/');
    if p.is_empty() {
        "etcd-warden/fence".into()
    } else {
        format!("{p}/etcd-warden/fence")
    }
}

/// Keys of every object under `prefix` (None when the store cannot be listed).
pub async fn list_keys(store: &dyn ObjectStore, prefix: &str) -> Option<Vec<String>> {
    let path = ObjectPath::from(prefix);
    let mut out = Vec::new();
    let mut listing = store.list(Some(&path));
    while let Some(item) = listing.next().await {
        out.push(item.ok()?.location.to_string());
    }
    Some(out)
}

fn state_of(status: Option<&Value>, healthz: Option<&(u16, Value)>) -> (String, bool) {
    let state = status
        .and_then(|s| s["owner"]["state"].as_str())
        .or_else(|| healthz.and_then(|(_, b)| b["state"].as_str()))
        .unwrap_or("?")
        .to_ascii_lowercase();
    (state, healthz.is_some_and(|(c, _)| *c == 200))
}

impl Monitor {
    /// Starts polling every `every`; fence markers under `fence_prefix` of `store`.
    pub fn start(
        probes: Vec<Probe>,
        store: Arc<dyn ObjectStore>,
        fence_prefix: String,
        names: MemberNames,
        epoch: Instant,
        every: Duration,
    ) -> Monitor {
        let observed = Arc::new(Mutex::new(Observed::default()));
        let stop = CancellationToken::new();
        for probe in probes {
            tokio::spawn(poll_sidecar(
                probe,
                observed.clone(),
                epoch,
                every,
                stop.clone(),
            ));
        }
        tokio::spawn(poll_fences(
            store,
            fence_prefix,
            names,
            observed.clone(),
            epoch,
            stop.clone(),
        ));
        Monitor { observed, stop }
    }

    /// Runs `f` over what was seen so far.
    pub fn with<T>(&self, f: impl FnOnce(&Observed) -> T) -> T {
        f(&self.observed.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// GET `url`: (status, JSON body or the text as a string), None without an answer.
pub async fn get_json(client: &reqwest::Client, url: &str) -> Option<(u16, Value)> {
    let r = client.get(url).send().await.ok()?;
    let code = r.status().as_u16();
    let text = r.text().await.ok()?;
    Some((
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

async fn poll_sidecar(
    probe: Probe,
    observed: Arc<Mutex<Observed>>,
    epoch: Instant,
    every: Duration,
    stop: CancellationToken,
) {
    let client = super::http_client(Duration::from_millis(800));
    let base = format!("http://{}", probe.addr);
    while !stop.is_cancelled() {
        let incarnation = probe.incarnation.load(Ordering::SeqCst);
        let asked = epoch.elapsed();
        let status = get_json(&client, &format!("{base}/status")).await;
        let sent = epoch.elapsed();
        let healthz = get_json(&client, &format!("{base}/healthz")).await;
        let now = epoch.elapsed();
        // A restart in between: the answers may belong to either process.
        if incarnation != 0 && probe.incarnation.load(Ordering::SeqCst) == incarnation {
            let mut o = observed.lock().unwrap_or_else(|e| e.into_inner());
            let fence = o.fence_seen.get(&probe.member).copied();
            let track = o.processes.entry((probe.member, incarnation)).or_default();
            let status = status.filter(|(c, _)| *c == 200).map(|(_, v)| v);
            let said_deactivated = status
                .as_ref()
                .is_some_and(|s| s["owner"]["state"] == "deactivated");
            let healthz_deactivated = healthz.as_ref().is_some_and(|(_, b)| {
                b["state"]
                    .as_str()
                    .is_some_and(|s| s.eq_ignore_ascii_case("deactivated"))
            });
            let ready = healthz.as_ref().is_some_and(|(c, _)| *c == 200);
            // /status answered before this /healthz request was sent.
            if said_deactivated {
                track.deactivated_at.get_or_insert(sent);
            }
            if ready && track.deactivated_at.is_some() {
                let body = healthz
                    .as_ref()
                    .map(|(_, b)| b.to_string())
                    .unwrap_or_default();
                track.ready_after_deactivation.push((now, body));
            }
            if ready && fence.is_some_and(|f| f <= sent) {
                let body = healthz
                    .as_ref()
                    .map(|(_, b)| b.to_string())
                    .unwrap_or_default();
                track.ready_after_fence.push((now, body));
            }
            if healthz_deactivated {
                track.deactivated_at.get_or_insert(now);
            }
            let answer = healthz.is_some().then_some(HealthzAnswer {
                member: probe.member,
                incarnation,
                asked,
                sent,
                received: now,
                ready,
                deactivated: said_deactivated || healthz_deactivated,
                lookups_failing: status
                    .as_ref()
                    .is_some_and(|s| s["owner"]["consecutiveFailures"].as_u64() > Some(0)),
            });
            let seen = state_of(status.as_ref(), healthz.as_ref());
            let changed = track.last_seen.as_ref() != Some(&seen);
            if status.is_some() {
                track.last_status = status;
            }
            track.last_healthz = healthz;
            if changed {
                track.last_seen = Some(seen.clone());
                let line = format!(
                    "{:8.3}s m{}#{} {} {}",
                    now.as_secs_f64(),
                    probe.member,
                    incarnation,
                    seen.0,
                    if seen.1 { "ready" } else { "unready" }
                );
                o.timeline.push(line);
            }
            o.healthz.extend(answer);
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

async fn poll_fences(
    store: Arc<dyn ObjectStore>,
    prefix: String,
    names: MemberNames,
    observed: Arc<Mutex<Observed>>,
    epoch: Instant,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        if let Some(keys) = list_keys(store.as_ref(), &prefix).await {
            let now = epoch.elapsed();
            let mut o = observed.lock().unwrap_or_else(|e| e.into_inner());
            for key in keys {
                if o.fence_objects.contains_key(&key) {
                    continue;
                }
                let member = names.attribute(&key);
                if let Some(m) = member {
                    o.fence_seen.entry(m).or_insert(now);
                }
                o.timeline.push(format!(
                    "{:8.3}s fence marker {key} (member {member:?})",
                    now.as_secs_f64()
                ));
                o.fence_objects.insert(key, member);
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// What a run left behind, for [`check`].
#[derive(Debug)]
pub struct Evidence<'a> {
    pub ending: Ending,
    /// Whether everything was healed before the settle time (DNS, store, etcd running).
    pub healed: bool,
    pub acks: &'a [Ack],
    /// The store's snapshots at the end.
    pub snapshots: &'a [Snapshot],
    pub observed: &'a Observed,
    /// Every sidecar's `/status` at the end (None: no answer).
    pub final_status: &'a [Option<Value>],
    /// Every sidecar exit the kubelet saw.
    pub sidecar_exits: &'a [Exit],
    /// Each member's sidecar log (every process of it).
    pub sidecar_logs: &'a [String],
    /// Finals marked reclaimed in the store at the end.
    pub reclaimed: &'a BTreeSet<String>,
    /// The hand-off's final as the store's hand-off objects name it (`the_final`), at the end.
    pub the_final: Option<&'a str>,
    /// Whether the latest full snapshot, as readers see it (`HandOffObjects::latest_chain`), is
    /// final at the end.
    pub latest_final: bool,
    /// When `etcd-warden reclaim` undid the first hand-off (`Ending::Reclaim`).
    pub reclaim_at: Option<Duration>,
    /// When each reclaimed final was reclaimed, for runs that reclaim more than once (the
    /// robustness harness); a final not named here is judged up to `reclaim_at`.
    pub reclaimed_at: Option<&'a BTreeMap<String, Duration>>,
    /// The unreclaimed finals in the store just before that reclaim.
    pub first_finals: &'a [String],
    /// `/snapshot/latest` answers (time, member, body) that reported a reclaimed final as final.
    pub reclaimed_read_as_final: &'a [(Duration, usize, String)],
    /// Members killed for good (sidecar and etcd) after their fence.
    pub buried: &'a [usize],
}

fn reason_of(status: &Value) -> Option<&str> {
    status["owner"]["reason"]
        .as_str()
        .filter(|r| !r.trim().is_empty())
}

fn active_and_ready(status: &Value) -> bool {
    status["owner"]["state"] == "active" && status["readiness"]["ready"] == true
}

/// Judges the evidence; empty means the run kept every promise.
pub fn check(e: &Evidence<'_>) -> (Vec<Violation>, Vec<String>) {
    let mut v = Vec::new();
    let mut notes = Vec::new();
    let finals: Vec<&Snapshot> = e
        .snapshots
        .iter()
        .filter(|s| s.kind == Kind::Full && s.is_final)
        .collect();
    let max_ack = e.acks.iter().map(|a| a.revision).max();

    // No lost write. A final the run reclaimed was undone on purpose: it must hold every write
    // acknowledged before the reclaim (writes after it belong to the next hand-off).
    for f in &finals {
        let until = if e.reclaimed.contains(&f.snap_name) {
            e.reclaimed_at
                .and_then(|at| at.get(&f.snap_name).copied())
                .or(e.reclaim_at)
                .unwrap_or(Duration::MAX)
        } else {
            Duration::MAX
        };
        let missed: Vec<&Ack> = e
            .acks
            .iter()
            .filter(|a| a.at < until && a.revision > f.last_revision)
            .collect();
        if let (Some(first), Some(last)) = (missed.first(), missed.last()) {
            v.push(Violation {
                kind: "lost-write",
                detail: format!(
                    "final {} (revision {}) misses {} acknowledged writes: revisions {}..={} \
                     ({} at {:.3}s .. {} at {:.3}s)",
                    f.snap_name,
                    f.last_revision,
                    missed.len(),
                    first.revision,
                    last.revision,
                    first.key,
                    first.at.as_secs_f64(),
                    last.key,
                    last.at.as_secs_f64()
                ),
            });
        }
    }

    // One final per hand-off: at most one that was not reclaimed, and it is the one the hand-off
    // objects name; the reclaimed hand-off had at most one too.
    let live: Vec<&&Snapshot> = finals
        .iter()
        .filter(|s| !e.reclaimed.contains(&s.snap_name))
        .collect();
    if live.len() > 1 {
        v.push(Violation {
            kind: "two-finals",
            detail: format!(
                "{} final snapshots not reclaimed: {} (reclaimed: {:?})",
                live.len(),
                live.iter()
                    .map(|s| s.snap_name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                e.reclaimed
            ),
        });
    }
    if e.first_finals.len() > 1 {
        v.push(Violation {
            kind: "two-finals",
            detail: format!(
                "the first hand-off (later reclaimed) stored {} finals: {}",
                e.first_finals.len(),
                e.first_finals.join(", ")
            ),
        });
    }
    for f in &live {
        if e.the_final != Some(f.snap_name.as_str()) {
            v.push(Violation {
                kind: "unnamed-final",
                detail: format!(
                    "final {} is not reclaimed, yet the store's hand-off objects name {:?} as \
                     the final: readers disagree on which object ends the hand-off",
                    f.snap_name, e.the_final
                ),
            });
        }
    }
    for (at, m, body) in e.reclaimed_read_as_final {
        v.push(Violation {
            kind: "reclaimed-read-as-final",
            detail: format!(
                "m{m}'s /snapshot/latest at {:.3}s reported a reclaimed final as final: {body}",
                at.as_secs_f64()
            ),
        });
    }

    // Liveness of the hand-off.
    let survivor = (0..e.final_status.len()).any(|m| !e.buried.contains(&m));
    let burial_excuses_nothing = !e.buried.is_empty() && survivor;
    if e.ending.hands_off() && e.healed && !e.latest_final {
        let reasons: Vec<String> = e
            .final_status
            .iter()
            .enumerate()
            .filter(|(m, _)| !e.buried.contains(m))
            .filter_map(|(m, s)| {
                let s = s.as_ref()?;
                (!active_and_ready(s))
                    .then(|| reason_of(s).map(|r| format!("m{m}: {r}")))
                    .flatten()
            })
            .collect();
        if burial_excuses_nothing {
            v.push(Violation {
                kind: "no-final",
                detail: format!(
                    "member(s) {:?} died for good after their fence, another survives, yet no \
                     final is read as final after the settle time (the_final {:?}, {} finals); \
                     sidecars say: {}",
                    e.buried,
                    e.the_final,
                    finals.len(),
                    reasons.join("; ")
                ),
            });
        } else if reasons.is_empty() {
            v.push(Violation {
                kind: "no-final",
                detail: format!(
                    "the record ends naming another owner ({:?}) and everything healed, but the \
                     latest full snapshot ({}) is not final after the settle time ({} finals), \
                     and no sidecar's /status says why (max acknowledged revision {max_ack:?})",
                    e.ending,
                    etcd_warden::store::layout::latest_chain(e.snapshots)
                        .full_snapshot
                        .map_or("none".to_string(), |s| s.snap_name),
                    finals.len()
                ),
            });
        } else {
            // A reason explains; it excuses nothing: everything healed and the record names
            // another owner, so the final was due within the settle time.
            v.push(Violation {
                kind: "no-final",
                detail: format!(
                    "the record ends naming another owner ({:?}) and everything healed, but no \
                     final is read as final after the settle time ({} finals); sidecars say: {}",
                    e.ending,
                    finals.len(),
                    reasons.join("; ")
                ),
            });
        }
    }

    // Never ready after deactivation or fencing.
    for ((m, inc), t) in &e.observed.processes {
        if let Some((at, body)) = t.ready_after_deactivation.first() {
            v.push(Violation {
                kind: "ready-after-deactivation",
                detail: format!(
                    "sidecar m{m}#{inc} said deactivated at {:.3}s, then /healthz 200 at {:.3}s \
                     ({} times): {body}",
                    t.deactivated_at.unwrap_or_default().as_secs_f64(),
                    at.as_secs_f64(),
                    t.ready_after_deactivation.len()
                ),
            });
        }
        if let Some((at, body)) = t.ready_after_fence.first() {
            v.push(Violation {
                kind: "ready-after-fence",
                detail: format!(
                    "member m{m}'s fence marker was listed at {:.3}s, then sidecar m{m}#{inc} \
                     answered /healthz 200 at {:.3}s: {body}",
                    e.observed
                        .fence_seen
                        .get(m)
                        .copied()
                        .unwrap_or_default()
                        .as_secs_f64(),
                    at.as_secs_f64()
                ),
            });
        }
    }
    let unattributed: Vec<&String> = e
        .observed
        .fence_objects
        .iter()
        .filter(|(_, m)| m.is_none())
        .map(|(k, _)| k)
        .collect();
    if !unattributed.is_empty() {
        notes.push(format!(
            "fence markers naming no single member (not checked): {unattributed:?}"
        ));
    }

    // No panic, no unexpected exit.
    for (m, log) in e.sidecar_logs.iter().enumerate() {
        if let Some(line) = log.lines().find(|l| l.contains("panicked")) {
            v.push(Violation {
                kind: "panic",
                detail: format!("sidecar m{m}: {line}"),
            });
        }
    }
    for x in e.sidecar_exits.iter().filter(|x| !x.expected) {
        v.push(Violation {
            kind: "unexpected-exit",
            detail: format!(
                "{}#{} exited on its own ({}) after {:.3}s",
                x.container,
                x.incarnation,
                x.status,
                x.after.as_secs_f64()
            ),
        });
    }

    // No stuck state without a reason.
    for (m, s) in e.final_status.iter().enumerate() {
        if e.buried.contains(&m) {
            continue;
        }
        match s {
            None => v.push(Violation {
                kind: "no-status",
                detail: format!("sidecar m{m} did not answer /status at the end"),
            }),
            Some(s) if !active_and_ready(s) && reason_of(s).is_none() => v.push(Violation {
                kind: "no-reason",
                detail: format!(
                    "sidecar m{m} ends {} ({}) without owner.reason: {}",
                    s["owner"]["state"], s["owner"]["detail"], s["readiness"]
                ),
            }),
            Some(_) => {}
        }
    }
    (v, notes)
}
