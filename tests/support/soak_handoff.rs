//! The soak's hooks for issue 53, items 1 and 4: every hand-off judged by the outcome it must
//! reach ([`handoff_judge`]), never excused by what a sidecar says; every final in every store
//! tracked for the whole run ([`finals`]); the readers of each hand-off's final asked until they
//! agree or a deadline passes.
//!
//! A child of `soak`, so it reaches the run's state; its logic lives here so that `soak.rs`
//! keeps only small hooks.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::ObjectStore;
use serde_json::Value;

use super::super::finals;
use super::super::handoff_judge::{
    self, CopyChoice, CopyRun, Outage, Outcome, Record, Route, StoredFinal,
};
use super::super::invariants::get_json;
use super::super::schedule::SplitMix64;
use super::super::traffic::Recorded;
use super::{DEST, FaultMode, Nemesis, PREFIX, Run, SECONDARY, last_line, tail};
use etcd_warden::store::{Snapshot, layout};

/// After the flip, a sidecar may still answer ready this long (the record is read every
/// `owner.interval`, 250 ms, and a flip needs `owner.failure_threshold` reads).
const READY_GRACE: Duration = Duration::from_secs(3);
/// Readers are asked again until they agree, at most this long after the hand-off settled.
const READERS_DEADLINE: Duration = Duration::from_secs(30);
/// The sidecars' `owner.takeover_after` (faultrun's keys).
const TAKEOVER_AFTER: Duration = Duration::from_secs(2);
/// A final snapshot's own time: the sidecars' `snapshot.timeout`.
const FINAL_MARGIN: Duration = Duration::from_secs(60);

/// Hand-offs by the outcome they reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reached {
    /// (a): one final, copied and restored.
    pub one_final: u32,
    /// (b): the copy Job timed out with the store unreachable.
    pub timed_out: u32,
    /// Neither (`handoff-unsettled`).
    pub unsettled: u32,
    /// Finals stored after the copy Job of a (b) hand-off gave up (reported, not copied).
    pub late_finals: u32,
}

impl fmt::Display for Reached {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "handoff_outcomes: one_final={} timed_out={} unsettled={} late_finals={}",
            self.one_final, self.timed_out, self.unsettled, self.late_finals
        )
    }
}

/// What the hooks keep for the run.
#[derive(Default)]
pub(super) struct State {
    /// Every hand-off's flip, from the epoch.
    pub flips: Vec<Duration>,
    /// Final name → when the reclaim that marked it started.
    pub reclaim_started: BTreeMap<String, Duration>,
    pub reached: Reached,
    /// Hand-off `k` keeps the store down from its flip when `(k + phase) % 3 == 0`.
    phase: u64,
    /// When the store went down for the current outage hand-off.
    outage_from: Option<Duration>,
    tracker: Option<finals::Tracker>,
}

/// The newest chain's last revision.
pub(super) fn chain_end(snapshots: &[Snapshot]) -> Option<i64> {
    let chain = layout::latest_chain(snapshots);
    chain
        .delta_snapshots
        .last()
        .or(chain.full_snapshot.as_ref())
        .map(|s| s.last_revision)
}

/// What the copy Job chose, from its output and the destination it left.
pub(super) fn copy_run(
    started: Duration,
    ok: bool,
    said: &str,
    dest_listed: &[Snapshot],
) -> CopyRun {
    let dest_full = layout::latest_chain(dest_listed)
        .full_snapshot
        .map(|s| s.snap_name);
    let found = said
        .lines()
        .filter(|l| l.contains("final snapshot found"))
        .find_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("snapshot="))
                .map(|n| n.trim_matches('"').to_string())
        });
    let choice = if !ok {
        CopyChoice::Failed(tail(said, 3, true))
    } else if said.contains("NO FINAL SNAPSHOT") {
        CopyChoice::TimedOut
    } else {
        match (found, dest_full) {
            (Some(n), Some(d)) if n.strip_suffix(".final") == Some(d.as_str()) => {
                CopyChoice::Final(n)
            }
            (Some(n), d) => CopyChoice::Failed(format!(
                "it found final {n}, yet the destination's newest full snapshot is {d:?}"
            )),
            (None, _) => CopyChoice::Failed(format!(
                "it neither found a final nor timed out: {}",
                last_line(said)
            )),
        }
    };
    CopyRun {
        started,
        choice,
        newest_revision: None,
    }
}

/// The revision in a final's name (`Full-<start>-<last>-…`).
fn name_revision(name: &str) -> Option<i64> {
    name.split('-').nth(2)?.parse().ok()
}

impl Run<'_> {
    /// Starts listing every store every second, and draws which hand-offs keep the store down.
    pub(super) fn start_tracking_finals(&mut self) {
        let s3 = &self.world.s3;
        let secondary: Arc<dyn ObjectStore> = s3.object_store(SECONDARY);
        let dest: Arc<dyn ObjectStore> = s3.object_store(DEST);
        self.h53.tracker = Some(finals::Tracker::start(
            vec![
                ("primary", self.world.raw_store.clone(), PREFIX.to_string()),
                ("secondary", secondary, String::new()),
                ("destination", dest, String::new()),
            ],
            self.world.events.epoch,
            Duration::from_secs(1),
        ));
        // Its own generator, so the nemesis's draws stay those of earlier runs of the seed.
        self.h53.phase = SplitMix64::new(self.seed ^ 0x53b0).range(0, 2);
        let first = (1..=3)
            .find(|k: &u64| (k + self.h53.phase).is_multiple_of(3))
            .unwrap_or(0);
        self.event(format!(
            "hand-offs {first}, {}, … keep the sidecars' store down from the flip through the \
             copy Job's final_timeout ({:?})",
            first + 3,
            self.profile.copy_final_timeout
        ));
    }

    /// Whether hand-off `k` keeps the store down from its flip; if so, takes it down now.
    pub(super) fn outage_from_flip(&mut self, k: u32) -> bool {
        if !(u64::from(k) + self.h53.phase).is_multiple_of(3) {
            return false;
        }
        *self
            .counts
            .faults
            .entry("store-down-through-copy")
            .or_default() += 1;
        self.world.proxy.set(FaultMode::Down);
        self.h53.outage_from = Some(self.world.events.epoch.elapsed());
        self.event(format!(
            "hand-off {k}: the sidecars' store down from the flip through the copy Job's \
             final_timeout (the copy Job reaches the store directly)"
        ));
        true
    }

    /// The copy Job and the destination, with the sidecars' store down until the copy ends.
    pub(super) async fn copy_through_outage(
        &mut self,
        k: u32,
        flip: Duration,
    ) -> (CopyRun, Option<Result<i64, String>>) {
        let recorded = self.traffic.snapshot();
        let out = self.copy_and_restore(k, &recorded, true).await;
        self.outage_healed();
        self.event(format!(
            "hand-off {k}: the copy Job of the outage ended {:.1}s after the flip",
            (self.world.events.epoch.elapsed().saturating_sub(flip)).as_secs_f64()
        ));
        out
    }

    /// Heals the outage hand-off's store fault (if one is on) and records its window.
    pub(super) fn outage_healed(&mut self) {
        let Some(from) = self.h53.outage_from.take() else {
            return;
        };
        self.world.proxy.set(FaultMode::Pass);
        let to = self.world.events.epoch.elapsed();
        self.fault_log
            .push((Nemesis::Store(FaultMode::Down), from, to));
        self.event("hand-off: the sidecars' store is back");
    }

    /// Store faults of the sidecars' route since `flip`.
    fn outages_since(&self, flip: Duration) -> Vec<Outage> {
        self.fault_log
            .iter()
            .filter(|(_, _, to)| *to + Duration::from_secs(1) >= flip)
            .filter_map(|(n, from, to)| match n {
                Nemesis::Store(mode) => Some(Outage {
                    route: Route::Primary,
                    from: *from,
                    to: *to,
                    unreachable: matches!(mode, FaultMode::Down | FaultMode::Blackhole),
                }),
                _ => None,
            })
            .collect()
    }

    /// What every reader says now.
    async fn reader_answers(&self) -> finals::Answers {
        let (ok, said) = self.cli("ls", &["--json".into()], &[]).await;
        let listed: Vec<String> = serde_json::from_str::<Value>(said.trim_end())
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter(|s| s["isFinal"] == true || s["is_final"] == true)
            .filter_map(|s| {
                s["snapName"]
                    .as_str()
                    .or(s["snap_name"].as_str())
                    .map(String::from)
            })
            .collect();
        let (vok, vsaid) = self.cli("verify", &[], &[]).await;
        let verify = match finals::verify_names(&vsaid) {
            Ok(n) if vok => Ok(n),
            Ok(n) => Err(format!("failed, naming {n}: {}", last_line(&vsaid))),
            Err(e) => Err(format!("ok={vok}: {e}")),
        };
        let mut latest = Vec::new();
        for m in 0..self.world.specs.len() {
            let url = self.world.sidecar_url(m, "/snapshot/latest");
            latest.push(
                get_json(&self.world.http_client, &url)
                    .await
                    .map(|(code, body)| {
                        let full = &body["fullSnapshot"];
                        (
                            code,
                            full["snapName"].as_str().map(String::from),
                            full["isFinal"] == true,
                        )
                    }),
            );
        }
        finals::Answers {
            ls: (ok, listed),
            verify,
            latest,
        }
    }

    /// `ls --json`, `verify` and every sidecar's `/snapshot/latest` name `name` as the one final,
    /// asked again until they do or [`READERS_DEADLINE`] passes; a non-200 answer is a failure.
    async fn readers_name(&mut self, k: u32, name: &str) {
        let deadline = Instant::now() + READERS_DEADLINE;
        let mut asked = 0;
        loop {
            asked += 1;
            let found = finals::disagreements(name, &self.reader_answers().await);
            if found.is_empty() {
                self.event(format!(
                    "hand-off {k}: `ls`, `verify` and every /snapshot/latest name {name} \
                     (asked {asked} times)"
                ));
                return;
            }
            if Instant::now() >= deadline {
                for f in found {
                    self.violation(
                        "readers-disagree",
                        format!(
                            "hand-off {k}: {f}; the hand-off's final is {name} (asked {asked} \
                             times over {READERS_DEADLINE:?})"
                        ),
                    );
                }
                return;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }

    /// Judges hand-off `k` after it settled: the readers, the copy (run now unless the outage
    /// ran it already), the destination, and the outcome it must reach.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn judge_handoff(
        &mut self,
        k: u32,
        flip: Duration,
        named: Option<String>,
        snapshots: &[Snapshot],
        early_copy: Option<(CopyRun, Option<Result<i64, String>>)>,
        recorded: &Recorded,
        notes: &[String],
    ) {
        let outage = early_copy.is_some();
        if let Some(name) = &named {
            self.readers_name(k, name).await;
        }
        let (copy, destination) = match early_copy {
            Some(done) => done,
            None => self.copy_and_restore(k, recorded, false).await,
        };
        if let (CopyChoice::Final(n), Some(name)) = (&copy.choice, &named)
            && n != name
        {
            self.violation(
                "copy-wrong-final",
                format!("hand-off {k}: the copy Job copied {n}, the hand-off's final is {name}"),
            );
        }
        let now = self.world.events.epoch.elapsed();
        let objects = self
            .h53
            .tracker
            .as_ref()
            .map(finals::Tracker::objects)
            .unwrap_or_default();
        let finals: Vec<StoredFinal> =
            finals::primary_finals_of(&objects, &self.h53.flips, self.h53.flips.len())
                .into_iter()
                .map(|name| StoredFinal {
                    revision: snapshots
                        .iter()
                        .find(|s| s.snap_name == name)
                        .map(|s| s.last_revision)
                        .or_else(|| name_revision(&name))
                        .unwrap_or(0),
                    first_seen: objects
                        .iter()
                        .filter(|o| o.store == "primary" && o.name() == name)
                        .map(|o| o.first_seen)
                        .min()
                        .unwrap_or(now),
                    name,
                })
                .collect();
        let source_ready = if outage {
            let timeline = self.world.monitor().with(|o| o.timeline.clone());
            handoff_judge::ready_during(&timeline, flip + READY_GRACE, now)
        } else {
            Vec::new()
        };
        let record = Record {
            flip,
            outages: self.outages_since(flip),
            takeover_after: TAKEOVER_AFTER,
            final_timeout: self.profile.copy_final_timeout,
            margin: FINAL_MARGIN,
            finals,
            copy: Some(copy),
            destination,
            source_ready,
        };
        let must = handoff_judge::must(&record);
        let outcome = handoff_judge::judge(&record);
        self.event(format!(
            "hand-off {k}: must reach {must:?}; reached {outcome:?} (finals {:?}, copy {:?}, \
             destination {:?})",
            record.finals.iter().map(|f| &f.name).collect::<Vec<_>>(),
            record.copy.as_ref().map(|c| &c.choice),
            record.destination
        ));
        match outcome {
            Outcome::OneFinal { .. } => {
                self.h53.reached.one_final += 1;
            }
            Outcome::TimedOut { late_finals } => {
                self.h53.reached.timed_out += 1;
                self.h53.reached.late_finals += late_finals.len() as u32;
                if !late_finals.is_empty() {
                    self.event(format!(
                        "hand-off {k}: final(s) stored after the copy Job gave up (reported, \
                         not copied): {late_finals:?}"
                    ));
                }
            }
            Outcome::Unsettled { why } => {
                self.h53.reached.unsettled += 1;
                let said = if notes.is_empty() {
                    String::new()
                } else {
                    format!(" (for the report, not the verdict: {})", notes.join("; "))
                };
                self.violation(
                    "handoff-unsettled",
                    format!("hand-off {k}: must reach {must:?}: {why}{said}"),
                );
            }
        }
    }

    /// At the end: two finals for one hand-off, a final gone with no reclaim.
    pub(super) fn judge_finals(&mut self) {
        let Some(tracker) = self.h53.tracker.take() else {
            return;
        };
        tracker.stop();
        let objects = tracker.objects();
        let failed = tracker
            .failed_listings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        self.event(format!(
            "finals tracked: {} objects ({:?}); failed listings: {failed:?}",
            objects.len(),
            objects
                .iter()
                .map(|o| format!(
                    "{}:{} {:.1}s..{:.1}s gone {:?}",
                    o.store,
                    o.name(),
                    o.first_seen.as_secs_f64(),
                    o.last_seen.as_secs_f64(),
                    o.gone_at.map(|g| g.as_secs_f64())
                ))
                .collect::<Vec<_>>()
        ));
        let mut found = finals::two_finals(&objects, &self.h53.flips);
        found.extend(finals::finals_gone(&objects, &self.h53.reclaim_started));
        for v in found {
            self.violation(v.kind, v.detail);
        }
    }
}
