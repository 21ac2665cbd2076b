//! Which outcome one hand-off must reach, and by when, from what was recorded about it (issue
//! 53, item 1). Pure: the soak records, this judges.
//!
//! The protocol allows two outcomes and nothing else:
//! - **(a) one final**: the store was reachable from the fence at some point before the copy
//!   Job's `final_timeout` ran out, so one final is stored by the time the store's faults heal
//!   plus `owner.takeover_after` plus a margin; the copy Job copies it, and the destination
//!   restored from it equals the model at the final's revision;
//! - **(b) no final in time**: the store was unreachable from the fence from the flip through
//!   the copy Job's `final_timeout`, so the copy Job times out and proceeds with what the store
//!   holds; the destination equals the model at the newest stored snapshot's revision and the
//!   source stays unready. A final stored later (the source retries until stored) is reported,
//!   never copied, and is not a violation.
//!
//! Anything else is `handoff-unsettled`. A sidecar's stated reason is for the report: nothing
//! here reads it.

use std::time::Duration;

/// The store a fault hit, as the route from the fence reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The sidecars' primary store: where the fence marker and the final go.
    Primary,
    /// Any other store (the secondary, the destination, the Jobs' own route).
    Other,
}

/// One store fault seen from the fence.
#[derive(Debug, Clone, PartialEq)]
pub struct Outage {
    pub route: Route,
    pub from: Duration,
    pub to: Duration,
    /// Refused or never answered: nothing can be stored through it. Slow, late or lost answers
    /// delay a final but do not make the store unreachable.
    pub unreachable: bool,
}

/// A final the store held for this hand-off, from the continuous listing.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredFinal {
    pub name: String,
    pub revision: i64,
    pub first_seen: Duration,
}

/// What the copy Job chose.
#[derive(Debug, Clone, PartialEq)]
pub enum CopyChoice {
    /// It found this final and copied it.
    Final(String),
    /// It waited `final_timeout` for a final, then copied what the store held.
    TimedOut,
    /// It failed, or did not run (why).
    Failed(String),
}

/// The copy Job's run.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyRun {
    pub started: Duration,
    pub choice: CopyChoice,
    /// The newest snapshot's last revision in the source when the copy ran (what a copy that
    /// timed out holds at most).
    pub newest_revision: Option<i64>,
}

/// Everything recorded about one hand-off.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// When the record stopped naming us.
    pub flip: Duration,
    pub outages: Vec<Outage>,
    pub takeover_after: Duration,
    pub final_timeout: Duration,
    /// Beyond the bounds the protocol states: a final snapshot's own time, listing delays.
    pub margin: Duration,
    /// Finals stored for this hand-off, in the primary store.
    pub finals: Vec<StoredFinal>,
    pub copy: Option<CopyRun>,
    /// The revision at which the restored destination equals the model, or why it does not.
    pub destination: Option<Result<i64, String>>,
    /// Sidecar answers `/healthz` 200 seen after the flip (plus a grace) while judged.
    pub source_ready: Vec<String>,
}

/// The outcome the protocol requires of a hand-off, and by when.
#[derive(Debug, Clone, PartialEq)]
pub enum Must {
    /// (a): one final stored by `by`.
    OneFinal { by: Duration },
    /// (b): the copy Job gives up at `at` (started plus its `final_timeout`).
    CopyTimesOut { at: Duration },
}

/// What the hand-off reached.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// (a), with the final copied.
    OneFinal { name: String },
    /// (b), with the finals the source stored after the copy gave up (reported, not copied).
    TimedOut { late_finals: Vec<String> },
    /// Neither: `handoff-unsettled`.
    Unsettled { why: String },
}

/// Slack for the edges of two recorded windows (the flip and the fault set a few ms apart).
const EDGE: Duration = Duration::from_millis(500);

/// Whether the primary store was unreachable for all of `[from, to]`.
pub fn unreachable_through(outages: &[Outage], from: Duration, to: Duration) -> bool {
    let mut spans: Vec<(Duration, Duration)> = outages
        .iter()
        .filter(|o| o.route == Route::Primary && o.unreachable)
        .map(|o| (o.from, o.to))
        .collect();
    spans.sort();
    let mut covered_to: Option<Duration> = None;
    for (a, b) in spans {
        match covered_to {
            None if a <= from + EDGE => covered_to = Some(b),
            Some(c) if a <= c + EDGE => covered_to = Some(c.max(b)),
            _ => {}
        }
    }
    covered_to.is_some_and(|c| c + EDGE >= to)
}

/// When the primary store's faults that reach past the flip healed (the flip if none did).
pub fn healed_at(r: &Record) -> Duration {
    r.outages
        .iter()
        .filter(|o| o.route == Route::Primary && o.to >= r.flip)
        .map(|o| o.to)
        .fold(r.flip, Duration::max)
}

/// The outcome the hand-off must reach.
pub fn must(r: &Record) -> Must {
    if let Some(c) = &r.copy {
        let at = c.started + r.final_timeout;
        if unreachable_through(&r.outages, r.flip, at) {
            return Must::CopyTimesOut { at };
        }
    }
    Must::OneFinal {
        by: healed_at(r) + r.takeover_after + r.margin,
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// Judges the hand-off against [`must`].
pub fn judge(r: &Record) -> Outcome {
    let unsettled = |why: String| Outcome::Unsettled { why };
    let Some(copy) = &r.copy else {
        return unsettled("the copy Job did not run".into());
    };
    if let CopyChoice::Failed(e) = &copy.choice {
        return unsettled(format!("the copy Job failed: {e}"));
    }
    let mut finals: Vec<&StoredFinal> = r.finals.iter().collect();
    finals.sort_by_key(|f| f.first_seen);
    match must(r) {
        Must::OneFinal { by } => {
            let Some(first) = finals.first() else {
                return unsettled(format!(
                    "no final stored (the store was reachable; bound {})",
                    secs(by)
                ));
            };
            if first.first_seen > by {
                return unsettled(format!(
                    "final {} first stored at {}, after the bound {}",
                    first.name,
                    secs(first.first_seen),
                    secs(by)
                ));
            }
            match &copy.choice {
                CopyChoice::Final(n) if *n == first.name => {}
                CopyChoice::Final(n) => {
                    return unsettled(format!(
                        "the copy Job copied {n}, the hand-off's final is {}",
                        first.name
                    ));
                }
                _ => {
                    return unsettled(format!(
                        "the copy Job timed out though the store was reachable and {} was \
                         stored at {}",
                        first.name,
                        secs(first.first_seen)
                    ));
                }
            }
            match &r.destination {
                Some(Ok(rev)) if *rev == first.revision => {}
                Some(Ok(rev)) => {
                    return unsettled(format!(
                        "the destination equals the model at revision {rev}, the final's is {}",
                        first.revision
                    ));
                }
                Some(Err(e)) => return unsettled(format!("the destination: {e}")),
                None => return unsettled("the destination was not restored".into()),
            }
            Outcome::OneFinal {
                name: first.name.clone(),
            }
        }
        Must::CopyTimesOut { at } => {
            if let CopyChoice::Final(n) = &copy.choice {
                return unsettled(format!(
                    "the copy Job copied final {n} though the store was unreachable from the \
                     fence through its timeout ({})",
                    secs(at)
                ));
            }
            if let Some(f) = finals.iter().find(|f| f.first_seen + EDGE < at) {
                return unsettled(format!(
                    "final {} was stored at {}, before the copy Job gave up at {}",
                    f.name,
                    secs(f.first_seen),
                    secs(at)
                ));
            }
            if !r.source_ready.is_empty() {
                return unsettled(format!(
                    "the source answered ready after the flip: {}",
                    r.source_ready.join("; ")
                ));
            }
            let Some(newest) = copy.newest_revision else {
                return unsettled("the source held no snapshot for the copy".into());
            };
            match &r.destination {
                Some(Ok(rev)) if *rev == newest => {}
                Some(Ok(rev)) => {
                    return unsettled(format!(
                        "the destination equals the model at revision {rev}, the newest \
                         stored snapshot's is {newest}"
                    ));
                }
                Some(Err(e)) => return unsettled(format!("the destination: {e}")),
                None => return unsettled("the destination was not restored".into()),
            }
            Outcome::TimedOut {
                late_finals: finals.iter().map(|f| f.name.clone()).collect(),
            }
        }
    }
}

/// Sidecar processes ready at some moment of `[from, to]`, from the monitor's timeline (lines
/// `"<t>s m<member>#<incarnation> <state> ready|unready"`, one per change): those still ready
/// when the window opens, and those turning ready in it.
pub fn ready_during(timeline: &[String], from: Duration, to: Duration) -> Vec<String> {
    let mut before: std::collections::BTreeMap<&str, (bool, &str)> = Default::default();
    let mut within = Vec::new();
    for line in timeline {
        // The state may be more than one word: the time, the process and readiness are the
        // first, second and last.
        let parts: Vec<&str> = line.split_whitespace().collect();
        let [t, who, .., ready] = parts.as_slice() else {
            continue;
        };
        let Some(t) = t.strip_suffix('s').and_then(|t| t.parse::<f64>().ok()) else {
            continue;
        };
        let ready = match *ready {
            "ready" => true,
            "unready" => false,
            _ => continue,
        };
        if !who.starts_with('m') || !who.contains('#') {
            continue;
        }
        let t = Duration::from_secs_f64(t.max(0.0));
        if t > to {
            break;
        }
        if t < from {
            before.insert(who, (ready, line.trim()));
        } else if ready {
            within.push(line.trim().to_string());
        }
    }
    let mut out: Vec<String> = before
        .into_values()
        .filter(|(ready, _)| *ready)
        .map(|(_, line)| format!("{line} (still ready at {})", secs(from)))
        .collect();
    out.extend(within);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: f64) -> Duration {
        Duration::from_secs_f64(x)
    }

    fn down(from: f64, to: f64) -> Outage {
        Outage {
            route: Route::Primary,
            from: s(from),
            to: s(to),
            unreachable: true,
        }
    }

    fn fin(name: &str, rev: i64, at: f64) -> StoredFinal {
        StoredFinal {
            name: name.into(),
            revision: rev,
            first_seen: s(at),
        }
    }

    /// A hand-off at 100 s whose copy starts at 110 s with a 20 s timeout.
    fn record() -> Record {
        Record {
            flip: s(100.0),
            outages: Vec::new(),
            takeover_after: s(2.0),
            final_timeout: s(20.0),
            margin: s(40.0),
            finals: vec![fin("F.final", 500, 104.0)],
            copy: Some(CopyRun {
                started: s(110.0),
                choice: CopyChoice::Final("F.final".into()),
                newest_revision: Some(480),
            }),
            destination: Some(Ok(500)),
            source_ready: Vec::new(),
        }
    }

    /// (b): the store down from the flip through the copy's timeout, the copy gave up.
    fn outage_record() -> Record {
        let mut r = record();
        r.outages = vec![down(99.9, 131.0)];
        r.finals = vec![fin("F.final", 500, 133.0)];
        if let Some(c) = r.copy.as_mut() {
            c.choice = CopyChoice::TimedOut;
        }
        r.destination = Some(Ok(480));
        r
    }

    fn why(o: Outcome) -> String {
        match o {
            Outcome::Unsettled { why } => why,
            other => panic!("expected unsettled, got {other:?}"),
        }
    }

    #[test]
    fn one_final_copied_and_restored_is_outcome_a() {
        let r = record();
        assert_eq!(must(&r), Must::OneFinal { by: s(142.0) });
        assert_eq!(
            judge(&r),
            Outcome::OneFinal {
                name: "F.final".into()
            }
        );
    }

    #[test]
    fn the_bound_of_a_moves_with_the_last_store_fault_after_the_flip() {
        let mut r = record();
        r.outages = vec![down(90.0, 95.0), down(101.0, 103.0), down(102.0, 108.0)];
        assert_eq!(must(&r), Must::OneFinal { by: s(150.0) });
        // A fault that healed before the flip does not move it.
        r.outages = vec![down(90.0, 95.0)];
        assert_eq!(must(&r), Must::OneFinal { by: s(142.0) });
    }

    #[test]
    fn a_hand_off_that_never_takes_its_final_is_unsettled_whatever_the_sidecars_say() {
        // The `never-final` plant: no final, the copy waited and gave up, with the store
        // reachable the whole time.
        let mut r = record();
        r.finals.clear();
        if let Some(c) = r.copy.as_mut() {
            c.choice = CopyChoice::TimedOut;
        }
        r.destination = Some(Ok(480));
        assert!(why(judge(&r)).contains("no final stored"));
    }

    #[test]
    fn a_final_after_its_bound_is_unsettled() {
        let mut r = record();
        r.finals = vec![fin("F.final", 500, 150.0)];
        assert!(why(judge(&r)).contains("after the bound"));
    }

    #[test]
    fn a_copy_that_times_out_with_the_store_reachable_is_unsettled() {
        let mut r = record();
        if let Some(c) = r.copy.as_mut() {
            c.choice = CopyChoice::TimedOut;
        }
        assert!(why(judge(&r)).contains("timed out though the store was reachable"));
        // A store that was only slow (reachable) does not excuse it either.
        r.outages = vec![Outage {
            unreachable: false,
            ..down(99.0, 131.0)
        }];
        assert!(matches!(must(&r), Must::OneFinal { .. }));
        assert!(why(judge(&r)).contains("timed out"));
    }

    #[test]
    fn a_copy_of_another_final_or_a_failed_or_missing_copy_is_unsettled() {
        let mut r = record();
        if let Some(c) = r.copy.as_mut() {
            c.choice = CopyChoice::Final("G.final".into());
        }
        assert!(why(judge(&r)).contains("copied G.final"));
        if let Some(c) = r.copy.as_mut() {
            c.choice = CopyChoice::Failed("exit 1".into());
        }
        assert!(why(judge(&r)).contains("failed: exit 1"));
        r.copy = None;
        assert!(why(judge(&r)).contains("did not run"));
    }

    #[test]
    fn a_destination_not_at_the_finals_revision_is_unsettled() {
        let mut r = record();
        r.destination = Some(Ok(499));
        assert!(why(judge(&r)).contains("revision 499"));
        r.destination = Some(Err("key /soak/1 missing".into()));
        assert!(why(judge(&r)).contains("key /soak/1 missing"));
        r.destination = None;
        assert!(why(judge(&r)).contains("not restored"));
    }

    #[test]
    fn the_store_down_through_the_copys_timeout_is_outcome_b_with_the_late_final_reported() {
        let r = outage_record();
        assert_eq!(must(&r), Must::CopyTimesOut { at: s(130.0) });
        assert_eq!(
            judge(&r),
            Outcome::TimedOut {
                late_finals: vec!["F.final".into()]
            }
        );
        // With no final at all yet, (b) all the same.
        let mut r = outage_record();
        r.finals.clear();
        assert_eq!(
            judge(&r),
            Outcome::TimedOut {
                late_finals: Vec::new()
            }
        );
    }

    #[test]
    fn back_to_back_outages_cover_and_a_hole_does_not() {
        let mut r = outage_record();
        r.outages = vec![down(99.8, 115.0), down(115.2, 131.0)];
        assert!(matches!(must(&r), Must::CopyTimesOut { .. }));
        // A 3 s hole: the final could have been stored then; the copy must have found it.
        r.outages = vec![down(99.8, 112.0), down(115.0, 131.0)];
        assert!(matches!(must(&r), Must::OneFinal { .. }));
        // Down only from after the flip: the fence could store then.
        r.outages = vec![down(103.0, 131.0)];
        assert!(matches!(must(&r), Must::OneFinal { .. }));
        // Down, but healed before the copy's timeout.
        r.outages = vec![down(99.9, 125.0)];
        assert!(matches!(must(&r), Must::OneFinal { .. }));
        // Another store's outage covers nothing.
        r.outages = vec![Outage {
            route: Route::Other,
            ..down(99.9, 131.0)
        }];
        assert!(matches!(must(&r), Must::OneFinal { .. }));
    }

    #[test]
    fn in_b_a_copied_final_an_early_final_or_a_ready_source_is_unsettled() {
        let mut r = outage_record();
        if let Some(c) = r.copy.as_mut() {
            c.choice = CopyChoice::Final("F.final".into());
        }
        assert!(why(judge(&r)).contains("unreachable"));
        let mut r = outage_record();
        r.finals = vec![fin("F.final", 500, 120.0)];
        assert!(why(judge(&r)).contains("before the copy Job gave up"));
        let mut r = outage_record();
        r.source_ready = vec!["120.000s m1#2 active ready".into()];
        assert!(why(judge(&r)).contains("ready after the flip"));
    }

    #[test]
    fn in_b_the_destination_must_hold_the_newest_stored_snapshot() {
        let mut r = outage_record();
        r.destination = Some(Ok(470));
        assert!(why(judge(&r)).contains("newest stored snapshot's is 480"));
        r.destination = None;
        assert!(why(judge(&r)).contains("not restored"));
        let mut r = outage_record();
        if let Some(c) = r.copy.as_mut() {
            c.newest_revision = None;
        }
        assert!(why(judge(&r)).contains("no snapshot"));
        let mut r = outage_record();
        if let Some(c) = r.copy.as_mut() {
            c.choice = CopyChoice::Failed("x".into());
        }
        assert!(why(judge(&r)).contains("failed"));
    }

    #[test]
    fn ready_during_finds_a_process_ready_in_the_window_or_still_ready_when_it_opens() {
        let tl: Vec<String> = [
            "   1.000s m0#1 active ready",
            "   1.100s m1#1 active ready",
            "   1.200s fence marker x (member Some(0))",
            "   1.300s m2#1 taking the final unready",
            "   5.000s m0#1 deactivated unready",
            "  20.000s m2#3 active ready",
            "  40.000s m0#2 active ready",
        ]
        .iter()
        .map(|l| l.to_string())
        .collect();
        let found = ready_during(&tl, s(10.0), s(30.0));
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("1.100s m1#1") && found[0].contains("still ready"));
        assert!(found[1].starts_with("20.000s m2#3"));
        assert_eq!(ready_during(&tl[..5], s(10.0), s(30.0)).len(), 1);
        assert!(ready_during(&tl, s(41.0), s(50.0)).len() == 3);
        let quiet: Vec<String> = vec![
            "   1.000s m0#1 active ready".into(),
            "   2.000s m0#1 deactivated unready".into(),
        ];
        assert!(ready_during(&quiet, s(3.0), s(9.0)).is_empty());
    }
}
